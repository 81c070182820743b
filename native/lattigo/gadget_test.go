package main

import (
	"testing"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

// gadgetSetup: parameters with the given primes, one Galois key, a random ciphertext's c1
// decomposed at `level`.
func gadgetSetup(t testing.TB, logN int, logQ, logP []int, level int) (ckks.Parameters, *ckks.Evaluator, []ringqp.Poly, *rlwe.GadgetCiphertext) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{LogN: logN, LogQ: logQ, LogP: logP, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	gk := kg.GenGaloisKeyNew(params.GaloisElement(3), sk)
	eval := ckks.NewEvaluator(params, rlwe.NewMemEvaluationKeySet(nil, gk))
	ct := randomCiphertext(t, params, ckks.NewEncoder(params), rlwe.NewEncryptor(params, sk))
	ct.Resize(1, level)
	return params, eval, decompose(eval, level, ct.Value[1]), &gk.GadgetCiphertext
}

// TestGadgetProductHoistedMatchesLattigo: the one-pass gadget product gives Lattigo's residues
// for one, two (the offload parameters' case, gadgetSum2) and six RNS digits, at two levels.
func TestGadgetProductHoistedMatchesLattigo(t *testing.T) {
	for _, c := range []struct {
		name       string
		logQ, logP []int
	}{
		{"1 digit", []int{50, 40}, []int{61, 61}},
		{"2 digits", []int{60, 40, 40}, []int{61, 61}},
		{"6 digits", []int{55, 45, 45, 45, 45, 45}, []int{61}},
	} {
		for _, drop := range []int{0, 1} {
			level := len(c.logQ) - 1 - drop
			params, eval, decomp, key := gadgetSetup(t, 11, c.logQ, c.logP, level)
			levelP := key.LevelP()
			want := rlwe.NewElementExtended(params.Parameters, 1, level, levelP)
			want.IsNTT = true
			if err := eval.GadgetProductHoistedLazy(level, decomp, key, want); err != nil {
				t.Fatal(err)
			}
			got := rlwe.NewElementExtended(params.Parameters, 1, level, levelP)
			got.IsNTT = true
			if !gadgetProductHoisted(params.Parameters, level, decomp, key, got) {
				t.Fatalf("%s, level %d: gadgetProductHoisted did not apply", c.name, level)
			}
			for k := 0; k < 2; k++ {
				samePoly(t, c.name+" Q", want.Value[k].Q, got.Value[k].Q)
				samePoly(t, c.name+" P", want.Value[k].P, got.Value[k].P)
			}
		}
	}
}

// BenchmarkGadgetProductHoisted: the fhe mode's shape (N = 2^15 here to keep the key small,
// 12 primes of Q at level 11, 3 of P: 4 digits), ours against Lattigo's.
func BenchmarkGadgetProductHoisted(b *testing.B) {
	logQ := []int{55, 45, 45, 45, 45, 45, 45, 45, 45, 45, 45, 45}
	params, eval, decomp, key := gadgetSetup(b, 15, logQ, []int{61, 61, 61}, len(logQ)-1)
	level := len(logQ) - 1
	out := rlwe.NewElementExtended(params.Parameters, 1, level, key.LevelP())
	out.IsNTT = true
	b.Run("lattigo", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := eval.GadgetProductHoistedLazy(level, decomp, key, out); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("one-pass", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			gadgetProductHoisted(params.Parameters, level, decomp, key, out)
		}
	})
}

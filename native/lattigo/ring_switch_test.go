package main

import (
	"testing"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils"
)

// TestRingSwitchFastMatchesLattigo: ringSwitchFast gives the residues of Lattigo's
// ApplyEvaluationKey to the half ring, at the offload parameters (N = 8192, Q 60 + 40, P 60).
func TestRingSwitchFastMatchesLattigo(t *testing.T) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	big := &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}
	small, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 12, Q: params.Q()[:1], Xs: params.Xs(), Xe: params.Xe(), LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	smallCtx := &ctxObj{params: small, encoder: newEncoder(small), eval: ckks.NewEvaluator(small, nil)}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	skS := rlwe.NewKeyGenerator(small).GenSecretKeyNew()
	evk := rlwe.NewEvaluationKey(params, rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(0), LevelP: utils.Pointy(0)})
	kg.GenEvaluationKey(sk, skS, evk)
	k := &rskObj{ctx: big, small: smallCtx, evk: evk, eval: ckks.NewEvaluator(params, nil)}
	if !ringSwitchFastPath(k) {
		t.Fatal("the offload key should take the fast path")
	}
	ct := rlwe.NewEncryptor(params, sk).EncryptZeroNew(0)
	want := ckks.NewCiphertext(small, 1, 0)
	if err := k.eval.ApplyEvaluationKey(ct, evk, want); err != nil {
		t.Fatal(err)
	}
	got := ckks.NewCiphertext(small, 1, 0)
	ringSwitchFast(k, ct, got)
	for i := 0; i < 2; i++ {
		for j, v := range got.Value[i].Coeffs[0] {
			if v != want.Value[i].Coeffs[0][j] {
				t.Fatalf("poly %d coefficient %d: %d, Lattigo %d", i, j, v, want.Value[i].Coeffs[0][j])
			}
		}
	}
}

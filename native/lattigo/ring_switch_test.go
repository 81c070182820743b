package main

import (
	"testing"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils"
)

// halfRingFixture: the offload context (N = 8192, Q 60 + 40, P 60), its half ring of the given
// kind over its first `levels` primes (checked as the library checks it), and a secret of each.
func halfRingFixture(t *testing.T, rt ring.Type, levels int) (big, small *ctxObj, sk, skS *rlwe.SecretKey) {
	t.Helper()
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	big = &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}
	sp, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 12, Q: params.Q()[:levels], Xs: params.Xs(), Xe: params.Xe(), RingType: rt, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	small = &ctxObj{params: sp, encoder: newEncoder(sp), eval: ckks.NewEvaluator(sp, nil)}
	if err := checkHalfRing(big, small, levels); err != nil {
		t.Fatal(err)
	}
	return big, small, rlwe.NewKeyGenerator(params).GenSecretKeyNew(), rlwe.NewKeyGenerator(sp).GenSecretKeyNew()
}

// sameResidues: got and want hold the same residues in every polynomial and prime.
func sameResidues(t *testing.T, got, want *rlwe.Ciphertext) {
	t.Helper()
	for i := range want.Value {
		for l := range want.Value[i].Coeffs {
			for j, v := range got.Value[i].Coeffs[l] {
				if v != want.Value[i].Coeffs[l][j] {
					t.Fatalf("poly %d prime %d coefficient %d: %d, Lattigo %d", i, l, j, v, want.Value[i].Coeffs[l][j])
				}
			}
		}
	}
}

// TestRingSwitchFastMatchesLattigo: ringSwitchFast gives the residues of Lattigo's
// DomainSwitcher.ComplexToReal at the offload parameters (N = 8192, Q 60 + 40, P 60).
func TestRingSwitchFastMatchesLattigo(t *testing.T) {
	big, small, sk, skS := halfRingFixture(t, ring.ConjugateInvariant, 1)
	params := big.params
	evk, _ := rlwe.NewKeyGenerator(params).GenEvaluationKeysForRingSwapNew(sk, skS,
		rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(0), LevelP: utils.Pointy(0)})
	ciRing, err := params.RingQ().ConjugateInvariantRing()
	if err != nil {
		t.Fatal(err)
	}
	autIdx, err := ring.AutomorphismNTTIndex(params.N(), params.RingQ().NthRoot(), params.RingQ().NthRoot()-1)
	if err != nil {
		t.Fatal(err)
	}
	sw, err := ckks.NewDomainSwitcher(params, evk, nil)
	if err != nil {
		t.Fatal(err)
	}
	k := &rskObj{ctx: big, small: small, evk: evk, ciRing: ciRing.AtLevel(0), autIdx: autIdx,
		eval: ckks.NewEvaluator(params, nil), sw: sw}
	if !ringSwitchFastPath(k) {
		t.Fatal("the offload key should take the fast path")
	}
	ct := rlwe.NewEncryptor(params, sk).EncryptZeroNew(0)
	want := ckks.NewCiphertext(small.params, 1, 0)
	if err := sw.ComplexToReal(k.eval, ct, want); err != nil {
		t.Fatal(err)
	}
	got := ckks.NewCiphertext(small.params, 1, 0)
	ringSwitchFast(k, ct, got)
	sameResidues(t, got, want)
}

// TestRingSwitchFastEvenMatchesLattigo: the even fold's fast path gives the residues of
// Lattigo's ring-degree switch (ApplyEvaluationKey into a ciphertext of degree N/2).
func TestRingSwitchFastEvenMatchesLattigo(t *testing.T) {
	big, small, sk, skS := halfRingFixture(t, ring.Standard, 1)
	params := big.params
	evk := rlwe.NewKeyGenerator(params).GenEvaluationKeyNew(sk, skS,
		rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(0), LevelP: utils.Pointy(0)})
	k := &rskObj{ctx: big, small: small, evk: evk, even: true, eval: ckks.NewEvaluator(params, nil)}
	if !ringSwitchFastPath(k) {
		t.Fatal("the offload key should take the fast path")
	}
	ct := rlwe.NewEncryptor(params, sk).EncryptZeroNew(0)
	want := ckks.NewCiphertext(small.params, 1, 0)
	if err := k.eval.ApplyEvaluationKey(ct, evk, want); err != nil {
		t.Fatal(err)
	}
	got := ckks.NewCiphertext(small.params, 1, 0)
	ringSwitchFast(k, ct, got)
	sameResidues(t, got, want)
}

// TestRealToComplexFastMatchesLattigo: realToComplexFast gives the residues of Lattigo's
// DomainSwitcher.RealToComplex at the offload parameters (both data primes).
func TestRealToComplexFastMatchesLattigo(t *testing.T) {
	big, small, sk, skS := halfRingFixture(t, ring.ConjugateInvariant, 2)
	if err := checkInputRing(big, small); err != nil {
		t.Fatal(err)
	}
	params := big.params
	_, evk := rlwe.NewKeyGenerator(params).GenEvaluationKeysForRingSwapNew(sk, skS,
		rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(1), LevelP: utils.Pointy(0)})
	sw, err := ckks.NewDomainSwitcher(params, nil, evk)
	if err != nil {
		t.Fatal(err)
	}
	k := &iskObj{ctx: big, small: small, evk: evk, eval: ckks.NewEvaluator(params, nil), sw: sw}
	ct := rlwe.NewEncryptor(small.params, skS).EncryptZeroNew(1)
	want := ckks.NewCiphertext(params, 1, 1)
	if err := sw.RealToComplex(k.eval, ct, want); err != nil {
		t.Fatal(err)
	}
	got := ckks.NewCiphertext(params, 1, 1)
	if err := realToComplexFast(k, ct, got); err != nil {
		t.Fatal(err)
	}
	sameResidues(t, got, want)
}

// TestSwitchKeyBytesMatchesMarshal: switchKeyBytes is the length marshalSwitchKey writes, at
// both levels the offload keys use.
func TestSwitchKeyBytesMatchesMarshal(t *testing.T) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	c := &ctxObj{params: params}
	kg := rlwe.NewKeyGenerator(params)
	sk, sk2 := kg.GenSecretKeyNew(), kg.GenSecretKeyNew()
	for level := 0; level <= params.MaxLevel(); level++ {
		b, err := marshalSwitchKey(rskMagic, c, kg.GenEvaluationKeyNew(sk, sk2, switchKeyLevel(level)), level)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) != switchKeyBytes(c, level) {
			t.Fatalf("level %d: %d bytes marshalled, switchKeyBytes %d", level, len(b), switchKeyBytes(c, level))
		}
	}
}

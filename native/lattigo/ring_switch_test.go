package main

import (
	"testing"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils"
)

// TestRingSwitchFastMatchesLattigo: ringSwitchFast gives the residues of Lattigo's
// DomainSwitcher.ComplexToReal at the offload parameters (N = 8192, Q 60 + 40, P 60).
func TestRingSwitchFastMatchesLattigo(t *testing.T) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	big := &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}
	small, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 12, Q: params.Q()[:1], Xs: params.Xs(), Xe: params.Xe(), RingType: ring.ConjugateInvariant,
		LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	smallCtx := &ctxObj{params: small, encoder: newEncoder(small), eval: ckks.NewEvaluator(small, nil)}
	if err := checkHalfRing(big, smallCtx, 1); err != nil {
		t.Fatal(err)
	}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	skS := rlwe.NewKeyGenerator(small).GenSecretKeyNew()
	evk, _ := kg.GenEvaluationKeysForRingSwapNew(sk, skS,
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
	k := &rskObj{ctx: big, small: smallCtx, evk: evk, ciRing: ciRing.AtLevel(0), autIdx: autIdx,
		eval: ckks.NewEvaluator(params, nil), sw: sw}
	if !ringSwitchFastPath(k) {
		t.Fatal("the offload key should take the fast path")
	}
	ct := rlwe.NewEncryptor(params, sk).EncryptZeroNew(0)
	want := ckks.NewCiphertext(small, 1, 0)
	if err := sw.ComplexToReal(k.eval, ct, want); err != nil {
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

// TestRingSwitchFastEvenMatchesLattigo: the even fold's fast path gives the residues of
// Lattigo's ring-degree switch (ApplyEvaluationKey into a ciphertext of degree N/2).
func TestRingSwitchFastEvenMatchesLattigo(t *testing.T) {
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
	if err := checkHalfRing(big, smallCtx, 1); err != nil {
		t.Fatal(err)
	}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	skS := rlwe.NewKeyGenerator(small).GenSecretKeyNew()
	evk := kg.GenEvaluationKeyNew(sk, skS, rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(0), LevelP: utils.Pointy(0)})
	k := &rskObj{ctx: big, small: smallCtx, evk: evk, even: true, eval: ckks.NewEvaluator(params, nil)}
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

// TestRealToComplexFastMatchesLattigo: realToComplexFast gives the residues of Lattigo's
// DomainSwitcher.RealToComplex at the offload parameters (both data primes).
func TestRealToComplexFastMatchesLattigo(t *testing.T) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	big := &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}
	small, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 12, Q: params.Q(), Xs: params.Xs(), Xe: params.Xe(), RingType: ring.ConjugateInvariant,
		LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	smallCtx := &ctxObj{params: small, encoder: newEncoder(small), eval: ckks.NewEvaluator(small, nil)}
	if err := checkInputRing(big, smallCtx); err != nil {
		t.Fatal(err)
	}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	skS := rlwe.NewKeyGenerator(small).GenSecretKeyNew()
	_, evk := kg.GenEvaluationKeysForRingSwapNew(sk, skS,
		rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(1), LevelP: utils.Pointy(0)})
	sw, err := ckks.NewDomainSwitcher(params, nil, evk)
	if err != nil {
		t.Fatal(err)
	}
	k := &iskObj{ctx: big, small: smallCtx, evk: evk, eval: ckks.NewEvaluator(params, nil), sw: sw}
	ct := rlwe.NewEncryptor(small, skS).EncryptZeroNew(1)
	want := ckks.NewCiphertext(params, 1, 1)
	if err := sw.RealToComplex(k.eval, ct, want); err != nil {
		t.Fatal(err)
	}
	got := ckks.NewCiphertext(params, 1, 1)
	if err := realToComplexFast(k, ct, got); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		for l := 0; l < 2; l++ {
			for j, v := range got.Value[i].Coeffs[l] {
				if v != want.Value[i].Coeffs[l][j] {
					t.Fatalf("poly %d prime %d coefficient %d: %d, Lattigo %d", i, l, j, v, want.Value[i].Coeffs[l][j])
				}
			}
		}
	}
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

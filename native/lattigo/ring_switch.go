package main

// Half-ring ciphertexts for the offload matmul (cipherlm/he/matmul.py; docs/offload.md "Half-ring
// results" and "Real inputs in the half ring").  Three switches between the offload context
// (degree N, data primes q0 q1, one special prime P) and rings of degree N/2:
//
//   results, conjugate-invariant (complex-input plans): a level-0 result is switched to the
//     conjugate-invariant ring of degree N/2 over q0 (Kim and Song, "Approximate homomorphic
//     encryption over the conjugate-invariant ring", ICISC 2018; Lattigo's
//     ckks.DomainSwitcher.ComplexToReal): one key switch from the client's secret s to its
//     secret s' of that ring, then the fold m(X) + m(X^-1).  The client decrypts the real parts
//     of all N/2 slots.
//   results, even (real-input plans, whose result slots are periodic with period N/4): a
//     level-0 result is key-switched to s'(X^2), s' a secret of the standard ring of degree N/2
//     over q0, and its even coefficients kept (Lattigo's ring-degree switch).  The client
//     decrypts the message's even part, m itself, N/4 complex slots.
//   inputs, conjugate-invariant: the client encrypts real slot values in the
//     conjugate-invariant ring of degree N/2 over q0 q1 under a secret s''; the server unfolds
//     the ciphertext to degree N and key-switches it from s'' to s (Lattigo's RealToComplex):
//     half the bytes up.
//
//   clg_ctx_half_ring        a ring of degree N/2 over the first primes of Q (no special prime:
//                            no key lives in it, only the client's secrets s', s'')
//   clg_ring_switch_keygen   client: a fresh s' and the seeded key s -> s' (level 0)
//   clg_ring_switch_key_from_bytes   server: validate and expand a peer's result key
//   clg_ring_switch          server: a level-0 ciphertext -> its half-ring ciphertext
//   clg_input_switch_keygen  client: a fresh s'' and the seeded key s'' -> s (top level)
//   clg_input_switch_key_from_bytes  server: validate and expand a peer's input key
//   clg_real_to_complex      server: a half-ring input -> a ciphertext of the offload context

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils"
)

// rskMagic heads a serialised result switching key, iskMagic an input switching key: magic,
// wire version, 3 zero bytes, the seed, then the key's rows bit-packed at their primes' lengths.
const (
	rskMagic = "CLGW"
	iskMagic = "CLGU"
)

// rskObj: a peer's switching key from the offload secret s to s' (conjugate-invariant, or
// s'(X^2) for the even fold), with the two contexts and one evaluator (guarded: one result
// at a time per key on Lattigo's paths).
type rskObj struct {
	ctx    *ctxObj
	small  *ctxObj
	evk    *rlwe.EvaluationKey
	even   bool       // the small ring is standard: keep the even coefficients
	ciRing *ring.Ring // conjugate-invariant: the offload ring's counterpart (level 0)
	autIdx []uint64   // conjugate-invariant: the NTT-domain permutation of X -> X^-1
	mu     sync.Mutex
	eval   *ckks.Evaluator
	sw     ckks.DomainSwitcher // Lattigo's path (not the offload parameters' one digit, one P)
}

func (o *rskObj) context() *ctxObj { return o.ctx }

// iskObj: a peer's switching key from its half-ring input secret s'' to s.
type iskObj struct {
	ctx   *ctxObj
	small *ctxObj
	evk   *rlwe.EvaluationKey
	mu    sync.Mutex
	eval  *ckks.Evaluator
	sw    ckks.DomainSwitcher
}

// context: the half ring, where the inputs this key takes live.
func (o *iskObj) context() *ctxObj { return o.small }

// switchKeyLevel: a switching key at levels 0..levelQ of Q with one special prime, seeded.
func switchKeyLevel(levelQ int) rlwe.EvaluationKeyParameters {
	return rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(levelQ), LevelP: utils.Pointy(0), Compressed: true}
}

var rskLevel = switchKeyLevel(0)

// checkHalfRing: small is a half ring of big (degree N/2, Q = the first `levels` primes of big,
// no P, conjugate-invariant or standard) and big has a special prime (the switching key's P).
func checkHalfRing(big, small *ctxObj, levels int) error {
	if small.params.N()*2 != big.params.N() {
		return fmt.Errorf("half-ring context of degree %d for a context of degree %d", small.params.N(), big.params.N())
	}
	if levels < 1 || levels > big.params.QCount() || small.params.QCount() != levels || small.params.PCount() != 0 ||
		big.params.RingType() != ring.Standard {
		return fmt.Errorf("the half-ring context must hold exactly the first %d data primes of the offload context", levels)
	}
	for i := 0; i < levels; i++ {
		if small.params.Q()[i] != big.params.Q()[i] {
			return errors.New("the half-ring context's primes differ from the offload context's")
		}
	}
	if big.params.PCount() < 1 {
		return errors.New("the offload context has no special prime for the switching key")
	}
	return nil
}

// clg_ctx_half_ring: the context of degree N/2 whose primes are the first `levels` primes of
// ctx's Q (NTT-friendly for it: its NTT is of order 2N, as the offload context's), the same
// secret and error distributions; conjugate-invariant (N/2 real slots) when conj != 0, else
// standard (N/4 complex slots).
//
//export clg_ctx_half_ring
func clg_ctx_half_ring(h C.int64_t, conj C.int, levels C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		if c.params.LogN() <= 10 {
			return errors.New("no half ring below N = 2^11")
		}
		if levels < 1 || int(levels) > c.params.QCount() {
			return fmt.Errorf("a half ring of %d primes for a context of %d", int(levels), c.params.QCount())
		}
		rt := ring.Standard
		if conj != 0 {
			rt = ring.ConjugateInvariant
		}
		lit := ckks.ParametersLiteral{
			LogN:            c.params.LogN() - 1,
			Q:               append([]uint64(nil), c.params.Q()[:int(levels)]...),
			Xs:              c.params.Xs(),
			Xe:              c.params.Xe(),
			RingType:        rt,
			LogDefaultScale: c.params.LogDefaultScale(),
		}
		params, err := ckks.NewParametersFromLiteral(lit)
		if err != nil {
			return err
		}
		*out = C.int64_t(put(&ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}))
		return nil
	})
}

// switchKeyBytes: the length of a serialised switching key of c at levels 0..levelQ: the
// header, the seed, and per gadget digit (one per prime of Q[:levelQ+1], one special prime) the
// seeded half's rows bit-packed (TestSwitchKeyBytesMatchesMarshal checks it against a key).
func switchKeyBytes(c *ctxObj, levelQ int) int {
	row := packedRowLen(c.params.N(), c.params.P()[0])
	for _, q := range c.params.Q()[:levelQ+1] {
		row += packedRowLen(c.params.N(), q)
	}
	return 4 + 4 + seedLen + (levelQ+1)*row
}

// marshalSwitchKey: magic | version | 0 0 0 | seed | rows bit-packed.
func marshalSwitchKey(magic string, c *ctxObj, evk *rlwe.EvaluationKey, levelQ int) ([]byte, error) {
	if evk.Seed == nil || !evk.IsCompressed() {
		return nil, errors.New("Lattigo returned an uncompressed switching key")
	}
	b := append([]byte(magic), wireVersion, 0, 0, 0)
	b = append(b, evk.Seed[:]...)
	return appendPackedKey(b, evk, c.params.Q()[:levelQ+1], c.params.P()[:1]), nil
}

// unmarshalSwitchKey: a peer's switching key of c at levels 0..levelQ, checked (header, exact
// length, reduced rows) and expanded.
func unmarshalSwitchKey(magic, what string, c *ctxObj, levelQ int, b []byte) (*rlwe.EvaluationKey, error) {
	if len(b) < len(magic)+4+seedLen || string(b[:4]) != magic || b[4] != wireVersion ||
		b[5] != 0 || b[6] != 0 || b[7] != 0 {
		return nil, fmt.Errorf("not a cipherlm/Lattigo %s (bad header)", what)
	}
	if want := switchKeyBytes(c, levelQ); len(b) != want {
		return nil, fmt.Errorf("%s blob of %d bytes, expected %d", what, len(b), want)
	}
	evk := rlwe.NewEvaluationKey(c.params, switchKeyLevel(levelQ))
	var seed [seedLen]byte
	copy(seed[:], b[8:8+seedLen])
	rest, err := readEvkRows(evk, c.params.Q()[:levelQ+1], c.params.P()[:1], b[8+seedLen:], packedRows)
	if err != nil {
		return nil, err
	}
	if len(rest) != 0 {
		return nil, fmt.Errorf("trailing bytes after the %s", what)
	}
	evk.Seed = &seed
	if err := evk.Expand(c.params, nil); err != nil {
		return nil, err
	}
	if evk.Degree() != 1 {
		return nil, fmt.Errorf("%s did not expand", what)
	}
	return evk, nil
}

// newSecretHandle: a fresh secret of the half ring (Lattigo's key generator, seeded from
// crypto/rand) as a secret-key handle of that context (no public key).
func newSecretHandle(small *ctxObj) (*rlwe.SecretKey, C.int64_t) {
	sk := rlwe.NewKeyGenerator(small.params).GenSecretKeyNew()
	return sk, C.int64_t(put(&skObj{ctx: small, sk: sk, enc: rlwe.NewEncryptor(small.params, sk),
		dec: rlwe.NewDecryptor(small.params, sk)}))
}

// clg_ring_switch_keygen: a fresh secret s' of the half-ring context smallh (one prime) and the
// seeded switching key s -> s' (conjugate-invariant: unfolded to the standard ring; standard:
// s'(X^2)) at level 0 for the peer.
//
//export clg_ring_switch_keygen
func clg_ring_switch_keygen(skh C.int64_t, smallh C.int64_t, skOut *C.int64_t, out **C.uchar, outLen *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		small, err := get[*ctxObj](smallh, "context")
		if err != nil {
			return err
		}
		if err := checkHalfRing(s.ctx, small, 1); err != nil {
			return err
		}
		skS, hS := newSecretHandle(small)
		kg := rlwe.NewKeyGenerator(s.ctx.params)
		var evk *rlwe.EvaluationKey
		if small.params.RingType() == ring.ConjugateInvariant {
			evk, _ = kg.GenEvaluationKeysForRingSwapNew(s.sk, skS, rskLevel)
		} else {
			evk = kg.GenEvaluationKeyNew(s.sk, skS, rskLevel)
		}
		b, err := marshalSwitchKey(rskMagic, s.ctx, evk, 0)
		if err != nil {
			return err
		}
		*skOut = hS
		bytesOut(b, out, outLen)
		return nil
	})
}

// clg_ring_switch_key_from_bytes: a peer's result switching key for the offload context h and
// its half-ring context smallh, checked (header, exact length, reduced rows) and expanded.
//
//export clg_ring_switch_key_from_bytes
func clg_ring_switch_key_from_bytes(h C.int64_t, smallh C.int64_t, buf *C.uchar, n C.int64_t, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		small, err := get[*ctxObj](smallh, "context")
		if err != nil {
			return err
		}
		if err := checkHalfRing(c, small, 1); err != nil {
			return err
		}
		evk, err := unmarshalSwitchKey(rskMagic, "ring-switching key", c, 0, bytesIn(buf, n))
		if err != nil {
			return err
		}
		k := &rskObj{ctx: c, small: small, evk: evk, eval: ckks.NewEvaluator(c.params, nil)}
		if small.params.RingType() == ring.Standard {
			k.even = true
			*out = C.int64_t(put(k))
			return nil
		}
		ciRing, err := c.params.RingQ().ConjugateInvariantRing()
		if err != nil {
			return err
		}
		k.ciRing = ciRing.AtLevel(0)
		if k.autIdx, err = ring.AutomorphismNTTIndex(c.params.N(), c.params.RingQ().NthRoot(),
			c.params.RingQ().NthRoot()-1); err != nil {
			return err
		}
		if k.sw, err = ckks.NewDomainSwitcher(c.params, evk, nil); err != nil {
			return err
		}
		*out = C.int64_t(put(k))
		return nil
	})
}

// clg_ring_switch: the half-ring ciphertext of a level-0 ciphertext of the offload context:
// conjugate-invariant, under s', the real parts of its N/2 slots at twice its scale (as
// ComplexToReal leaves it); even, under s', its even part at its scale.
//
//export clg_ring_switch
func clg_ring_switch(rsh C.int64_t, cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(rsh, "ring-switching key", errbuf, errlen, func(k *rskObj) error {
		c, err := getIn[*ctObj](cth, "ciphertext", "ciphertext and ring-switching key belong to different contexts", k)
		if err != nil {
			return err
		}
		if c.ct.Level() != 0 || c.ct.Degree() != 1 || !c.ct.IsNTT {
			return fmt.Errorf("ring switching takes a degree-1 NTT ciphertext at level 0, got level %d degree %d",
				c.ct.Level(), c.ct.Degree())
		}
		res := ckks.NewCiphertext(k.small.params, 1, 0)
		switch {
		case ringSwitchFastPath(k):
			ringSwitchFast(k, c.ct, res)
		case k.even:
			k.mu.Lock()
			err = k.eval.ApplyEvaluationKey(c.ct, k.evk, res)
			k.mu.Unlock()
		default:
			k.mu.Lock()
			err = k.sw.ComplexToReal(k.eval, c.ct, res)
			k.mu.Unlock()
		}
		if err != nil {
			return err
		}
		res.IsNTT = true
		res.Scale = c.ct.Scale
		if !k.even {
			res.Scale = res.Scale.Mul(rlwe.NewScale(2)) // m(X) + m(X^-1): twice the real parts
		}
		res.LogDimensions = k.small.params.LogMaxDimensions()
		*out = C.int64_t(put(&ctObj{ctx: k.small, ct: res}))
		return nil
	})
}

// ringSwitchFastPath: the key has one digit and one special prime (the offload parameters).
func ringSwitchFastPath(k *rskObj) bool {
	return k.evk.LevelQ() == 0 && k.evk.LevelP() == 0 && k.evk.BaseTwoDecomposition == 0 &&
		len(k.evk.Value) == 1 && len(k.evk.Value[0]) == 1
}

// ringSwitchFast: Lattigo's ComplexToReal, or its ring-degree switch for the even fold (gadget
// product with ModDown, c0 added, then the fold to the conjugate-invariant ring or the even
// coefficients) for one q0 digit and one special prime P, on this library's transforms: 4
// transforms of degree N (c1's inverse, the digit's forward at P, then per polynomial the
// ModDown's inverse at P and forward at q0) with the same residues as Lattigo's
// (TestRingSwitchFastMatchesLattigo); the even fold adds per polynomial an inverse transform
// of degree N and a forward one of degree N/2.
//   d   = c1 centred, lifted to P, in NTT form (the digit; its q0 part is c1 itself)
//   u_k = ModDown(c1 * K_k.Q, d * K_k.P)   (NTT, K the switching key), u_0 += c0
//   out_k = u_k + u_k(X^-1), the first N/2 NTT values (conjugate-invariant), or
//           the even coefficients of u_k, transformed at degree N/2 (even)
func ringSwitchFast(k *rskObj, ct, out *rlwe.Ciphertext) {
	params := k.ctx.params
	sQ, sP := params.RingQ().SubRings[0], params.RingP().SubRings[0]
	q, p := sQ.Modulus, sP.Modulus
	N := params.N()
	bufs := make([]*[]uint64, 5)
	for i := range bufs {
		bufs[i] = getScratch(N)
		defer putScratch(bufs[i])
	}
	coef, dP, uQ, uP, w := (*bufs[0])[:N], (*bufs[1])[:N], (*bufs[2])[:N], (*bufs[3])[:N], (*bufs[4])[:N]
	c1 := ct.Value[1].Coeffs[0][:N]
	nttOf(sQ).Backward(c1, coef)
	liftCentred(coef, dP, q, p, sP.BRedConstant)
	nttOf(sP).Forward(dP, dP)
	el := k.evk.Value[0][0]
	wQ := ring.Poly{Coeffs: [][]uint64{w}}
	for i := 0; i < 2; i++ {
		kQ, kP := el[i].Q.Coeffs[0][:N], el[i].P.Coeffs[0][:N]
		for j := range uQ {
			uQ[j] = ring.MRed(c1[j], kQ[j], q, sQ.MRedConstant)
			uP[j] = ring.MRed(dP[j], kP[j], p, sP.MRedConstant)
		}
		modDownQPtoQNTT(params.Parameters, nil, 0, 0, ring.Poly{Coeffs: [][]uint64{uQ}},
			ring.Poly{Coeffs: [][]uint64{uP}}, wQ)
		if i == 0 {
			sQ.Add(w, ct.Value[0].Coeffs[0][:N], w)
		}
		if !k.even {
			k.ciRing.FoldStandardToConjugateInvariant(wQ, k.autIdx, out.Value[i])
			continue
		}
		nttOf(sQ).Backward(w, coef)
		dst := out.Value[i].Coeffs[0][:N/2]
		for j := range dst {
			dst[j] = coef[2*j]
		}
		nttOf(k.small.params.RingQ().SubRings[0]).Forward(dst, dst)
	}
}

// clg_input_switch_keygen: a fresh secret s'' of the conjugate-invariant half-ring context
// smallh (all of the offload context's data primes) and the seeded switching key s'' -> s
// (s'' unfolded to the standard ring) at the top level, for the peer.
//
//export clg_input_switch_keygen
func clg_input_switch_keygen(skh C.int64_t, smallh C.int64_t, skOut *C.int64_t, out **C.uchar, outLen *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		small, err := get[*ctxObj](smallh, "context")
		if err != nil {
			return err
		}
		if err := checkInputRing(s.ctx, small); err != nil {
			return err
		}
		skS, hS := newSecretHandle(small)
		top := s.ctx.params.MaxLevel()
		_, evk := rlwe.NewKeyGenerator(s.ctx.params).GenEvaluationKeysForRingSwapNew(s.sk, skS, switchKeyLevel(top))
		b, err := marshalSwitchKey(iskMagic, s.ctx, evk, top)
		if err != nil {
			return err
		}
		*skOut = hS
		bytesOut(b, out, outLen)
		return nil
	})
}

// checkInputRing: small is the conjugate-invariant half ring of big over all its data primes.
func checkInputRing(big, small *ctxObj) error {
	if err := checkHalfRing(big, small, big.params.QCount()); err != nil {
		return err
	}
	if small.params.RingType() != ring.ConjugateInvariant {
		return errors.New("half-ring inputs live in the conjugate-invariant ring")
	}
	return nil
}

// clg_input_switch_key_from_bytes: a peer's input switching key for the offload context h and
// its conjugate-invariant half ring smallh, checked and expanded.
//
//export clg_input_switch_key_from_bytes
func clg_input_switch_key_from_bytes(h C.int64_t, smallh C.int64_t, buf *C.uchar, n C.int64_t, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		small, err := get[*ctxObj](smallh, "context")
		if err != nil {
			return err
		}
		if err := checkInputRing(c, small); err != nil {
			return err
		}
		evk, err := unmarshalSwitchKey(iskMagic, "input switching key", c, c.params.MaxLevel(), bytesIn(buf, n))
		if err != nil {
			return err
		}
		sw, err := ckks.NewDomainSwitcher(c.params, nil, evk)
		if err != nil {
			return err
		}
		*out = C.int64_t(put(&iskObj{ctx: c, small: small, evk: evk, eval: ckks.NewEvaluator(c.params, nil), sw: sw}))
		return nil
	})
}

// clg_real_to_complex: a ciphertext of the conjugate-invariant half ring at its top level (under
// s'', N/2 real slots) as a ciphertext of the offload context under s, at the same level and
// scale, whose N/2 complex slots hold those real values (Lattigo's RealToComplex).
//
//export clg_real_to_complex
func clg_real_to_complex(ikh C.int64_t, cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(ikh, "input switching key", errbuf, errlen, func(k *iskObj) error {
		c, err := getIn[*ctObj](cth, "ciphertext", "ciphertext and input switching key belong to different contexts", k)
		if err != nil {
			return err
		}
		if c.ct.Level() != k.small.params.MaxLevel() || c.ct.Degree() != 1 || !c.ct.IsNTT {
			return fmt.Errorf("a half-ring input is a degree-1 NTT ciphertext at level %d, got level %d degree %d",
				k.small.params.MaxLevel(), c.ct.Level(), c.ct.Degree())
		}
		res := ckks.NewCiphertext(k.ctx.params, 1, c.ct.Level())
		k.mu.Lock()
		if simdAvailableOnce() {
			err = realToComplexFast(k, c.ct, res)
		} else {
			err = k.sw.RealToComplex(k.eval, c.ct, res)
		}
		k.mu.Unlock()
		if err != nil {
			return err
		}
		res.IsNTT = true
		res.Scale = c.ct.Scale
		res.LogDimensions = k.ctx.params.LogMaxDimensions()
		*out = C.int64_t(put(&ctObj{ctx: k.ctx, ct: res}))
		return nil
	})
}

// realToComplexFast: Lattigo's RealToComplex (the unfold, then the gadget product with the
// input switching key and its ModDown, c0 added) with the decomposition and the ModDown on this
// library's transforms (decompose, keySwitchHoisted: the baby steps' own); the same residues
// (TestRealToComplexFastMatchesLattigo).  Guarded by k.mu (k.eval's decomposer and basis
// extender).
func realToComplexFast(k *iskObj, ctIn, out *rlwe.Ciphertext) error {
	level := ctIn.Level()
	ringQ := k.ctx.params.RingQ().AtLevel(level)
	ringQ.UnfoldConjugateInvariantToStandard(ctIn.Value[0], out.Value[0])
	ringQ.UnfoldConjugateInvariantToStandard(ctIn.Value[1], out.Value[1])
	t0, t1, free, err := keySwitchHoisted(k.eval, level, decompose(k.eval, level, out.Value[1]), &k.evk.GadgetCiphertext)
	if err != nil {
		return err
	}
	defer free()
	ringQ.Add(out.Value[0], t0, out.Value[0])
	out.Value[1].CopyLvl(level, t1)
	return nil
}

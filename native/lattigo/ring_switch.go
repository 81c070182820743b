package main

// Half-ring results for the offload matmul (cipherlm/he/matmul.py; docs/offload.md "Half-ring
// results"): a result ciphertext at level 0 of the offload context (degree N, data prime q0) is
// switched to the conjugate-invariant ring of degree N/2 over q0 (Kim and Song, "Approximate
// homomorphic encryption over the conjugate-invariant ring", ICISC 2018; Lattigo's
// ckks.DomainSwitcher.ComplexToReal): one key switch from the client's secret s to its secret
// s' of that ring, then the fold m(X) + m(X^-1), a permutation and an add in the NTT domain.
// The client receives N/2 coefficients instead of N, and decrypts the real parts of all N/2
// slots (the imaginary parts, which the offload packing never needs, are gone).
//
//   clg_ctx_half_ring        the conjugate-invariant context of degree N/2 over q0 alone (no
//                            special prime: no key lives in it, only the client's secret s')
//   clg_ring_switch_keygen   client: a fresh s' and the seeded switching key s -> s' (mapped to
//                            the standard ring), at level 0 with one special prime
//   clg_ring_switch_key_from_bytes   server: validate and expand a peer's switching key
//   clg_ring_switch          server: a level-0 ciphertext of the offload context -> its
//                            half-ring ciphertext (a new handle in the half-ring context)

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

// rskMagic heads a serialised switching key: magic, wire version, 3 zero bytes, the seed,
// then the key's rows bit-packed at their primes' lengths.
const rskMagic = "CLGW"

// rskObj: a peer's switching key from the offload secret s to s', with the two contexts and
// one evaluator (guarded: one result at a time per key).
type rskObj struct {
	ctx    *ctxObj
	small  *ctxObj
	evk    *rlwe.EvaluationKey
	ciRing *ring.Ring // the offload ring's conjugate-invariant counterpart (level 0)
	autIdx []uint64   // the NTT-domain permutation of X -> X^-1
	mu     sync.Mutex
	eval   *ckks.Evaluator
	sw     ckks.DomainSwitcher // Lattigo's path (not the offload parameters' one digit, one P)
}

func (o *rskObj) context() *ctxObj { return o.ctx }

var rskLevel = rlwe.EvaluationKeyParameters{LevelQ: utils.Pointy(0), LevelP: utils.Pointy(0), Compressed: true}

// checkHalfRing: small is the half-ring context of big (degree N/2, Q = [q0], no P) and big
// has a special prime (the switching key's P).
func checkHalfRing(big, small *ctxObj) error {
	if small.params.N()*2 != big.params.N() {
		return fmt.Errorf("half-ring context of degree %d for a context of degree %d", small.params.N(), big.params.N())
	}
	if small.params.QCount() != 1 || small.params.Q()[0] != big.params.Q()[0] || small.params.PCount() != 0 ||
		small.params.RingType() != ring.ConjugateInvariant || big.params.RingType() != ring.Standard {
		return errors.New("the half-ring context must be conjugate-invariant over exactly the data prime q0 of the offload context")
	}
	if big.params.PCount() < 1 {
		return errors.New("the offload context has no special prime for the switching key")
	}
	return nil
}

// clg_ctx_half_ring: the conjugate-invariant context of degree N/2 whose only prime is q0 of ctx
// (its NTT is of order 2N, as the offload context's), the same secret and error distributions.
//
//export clg_ctx_half_ring
func clg_ctx_half_ring(h C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		if c.params.LogN() <= 10 {
			return errors.New("no half ring below N = 2^11")
		}
		lit := ckks.ParametersLiteral{
			LogN:            c.params.LogN() - 1,
			Q:               []uint64{c.params.Q()[0]},
			Xs:              c.params.Xs(),
			Xe:              c.params.Xe(),
			RingType:        ring.ConjugateInvariant,
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

func rskBytes(c *ctxObj) int {
	evk := rlwe.NewEvaluationKey(c.params, rskLevel)
	return len(rskMagic) + 4 + seedLen + len(appendPackedKey(nil, evk, c.params.Q()[:1], c.params.P()[:1]))
}

// clg_ring_switch_keygen: a fresh secret s' of the half-ring context (Lattigo's key generator,
// seeded from crypto/rand) as a secret-key handle of that context, and the seeded switching key
// s -> s' (unfolded to the standard ring) at level 0 for the peer.
//
//export clg_ring_switch_keygen
func clg_ring_switch_keygen(skh C.int64_t, smallh C.int64_t, skOut *C.int64_t, out **C.uchar, outLen *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		small, err := get[*ctxObj](smallh, "context")
		if err != nil {
			return err
		}
		if err := checkHalfRing(s.ctx, small); err != nil {
			return err
		}
		skS := rlwe.NewKeyGenerator(small.params).GenSecretKeyNew()
		evk, _ := rlwe.NewKeyGenerator(s.ctx.params).GenEvaluationKeysForRingSwapNew(s.sk, skS, rskLevel)
		if evk.Seed == nil || !evk.IsCompressed() {
			return errors.New("Lattigo returned an uncompressed switching key")
		}
		b := append([]byte(rskMagic), wireVersion, 0, 0, 0)
		b = append(b, evk.Seed[:]...)
		b = appendPackedKey(b, evk, s.ctx.params.Q()[:1], s.ctx.params.P()[:1])
		enc := rlwe.NewEncryptor(small.params, skS)
		dec := rlwe.NewDecryptor(small.params, skS)
		*skOut = C.int64_t(put(&skObj{ctx: small, sk: skS, enc: enc, dec: dec}))
		bytesOut(b, out, outLen)
		return nil
	})
}

// clg_ring_switch_key_from_bytes: a peer's switching key for the offload context h and its
// half-ring context smallh, checked (header, exact length, reduced rows) and expanded.
//
//export clg_ring_switch_key_from_bytes
func clg_ring_switch_key_from_bytes(h C.int64_t, smallh C.int64_t, buf *C.uchar, n C.int64_t, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		small, err := get[*ctxObj](smallh, "context")
		if err != nil {
			return err
		}
		if err := checkHalfRing(c, small); err != nil {
			return err
		}
		b := bytesIn(buf, n)
		if len(b) < len(rskMagic)+4+seedLen || string(b[:4]) != rskMagic || b[4] != wireVersion ||
			b[5] != 0 || b[6] != 0 || b[7] != 0 {
			return errors.New("not a cipherlm/Lattigo ring-switching key (bad header)")
		}
		if want := rskBytes(c); len(b) != want {
			return fmt.Errorf("ring-switching key blob of %d bytes, expected %d", len(b), want)
		}
		evk := rlwe.NewEvaluationKey(c.params, rskLevel)
		var seed [seedLen]byte
		copy(seed[:], b[8:8+seedLen])
		rest, err := readEvkRows(evk, c.params.Q()[:1], c.params.P()[:1], b[8+seedLen:], packedRows)
		if err != nil {
			return err
		}
		if len(rest) != 0 {
			return errors.New("trailing bytes after the ring-switching key")
		}
		evk.Seed = &seed
		if err := evk.Expand(c.params, nil); err != nil {
			return err
		}
		if evk.Degree() != 1 {
			return errors.New("ring-switching key did not expand")
		}
		ciRing, err := c.params.RingQ().ConjugateInvariantRing()
		if err != nil {
			return err
		}
		ciRing = ciRing.AtLevel(0)
		autIdx, err := ring.AutomorphismNTTIndex(c.params.N(), c.params.RingQ().NthRoot(), c.params.RingQ().NthRoot()-1)
		if err != nil {
			return err
		}
		sw, err := ckks.NewDomainSwitcher(c.params, evk, nil)
		if err != nil {
			return err
		}
		*out = C.int64_t(put(&rskObj{ctx: c, small: small, evk: evk, ciRing: ciRing, autIdx: autIdx,
			eval: ckks.NewEvaluator(c.params, nil), sw: sw}))
		return nil
	})
}

// clg_ring_switch: the half-ring ciphertext of a level-0 ciphertext of the offload context
// (under s', the real parts of its N/2 slots, at twice its scale as ComplexToReal leaves it).
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
		if ringSwitchFastPath(k) {
			ringSwitchFast(k, c.ct, res)
		} else {
			k.mu.Lock()
			err = k.sw.ComplexToReal(k.eval, c.ct, res)
			k.mu.Unlock()
			if err != nil {
				return err
			}
		}
		res.IsNTT = true
		res.Scale = c.ct.Scale.Mul(rlwe.NewScale(2)) // m(X) + m(X^-1): twice the real parts
		res.LogDimensions = ring.Dimensions{Rows: 0, Cols: k.small.params.LogMaxSlots()}
		*out = C.int64_t(put(&ctObj{ctx: k.small, ct: res}))
		return nil
	})
}

// ringSwitchFastPath: the key has one digit and one special prime (the offload parameters).
func ringSwitchFastPath(k *rskObj) bool {
	return k.evk.LevelQ() == 0 && k.evk.LevelP() == 0 && k.evk.BaseTwoDecomposition == 0 &&
		len(k.evk.Value) == 1 && len(k.evk.Value[0]) == 1
}

// ringSwitchFast: Lattigo's ComplexToReal (gadget product with ModDown, c0 added, the fold to
// the conjugate-invariant ring) for one q0 digit and one special prime P, on this library's
// transforms: 4 transforms of degree N (c1's inverse, the digit's forward at P, then per
// polynomial the ModDown's inverse at P and forward at q0) with the same residues as Lattigo's
// (TestRingSwitchFastMatchesLattigo).
//   d   = c1 centred, lifted to P, in NTT form (the digit; its q0 part is c1 itself)
//   u_k = ModDown(c1 * K_k.Q, d * K_k.P)   (NTT, K the switching key), u_0 += c0
//   out_k = fold(u_k) = u_k + u_k(X^-1), the first N/2 NTT values
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
		k.ciRing.FoldStandardToConjugateInvariant(wQ, k.autIdx, out.Value[i])
	}
}

// CKKS operations for encrypted Transformer blocks (issue 15 item 1; the fhe mode of issue 17):
// relinearisation keys, ct x ct multiplication with relinearisation, subtraction, products and
// sums with scalars, and polynomial evaluation in the Chebyshev basis on an interval [a, b]
// (Lattigo v6.2.0's circuits/ckks/polynomial: the baby-step giant-step evaluation in the
// Chebyshev basis used by the bootstrapping of Bossuat et al., EUROCRYPT 2021).
//
// Conventions as in clattigo.go: handles, rc 0 / < 0 with a message, panics recovered.
// Relinearisation keys cross the wire in this package's own layout "CLGR" (the polynomials'
// raw RNS words, every one checked reduced; the shape follows from the parameters alone).
package main

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"unsafe"

	"github.com/tuneinsight/lattigo/v6/circuits/ckks/polynomial"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils/bignum"
)

func evkPolys(evk *rlwe.EvaluationKey) []*ring.Poly {
	var ps []*ring.Poly
	for i := range evk.Value {
		for j := range evk.Value[i] {
			ps = append(ps, qpPolys(evk.Value[i][j])...)
		}
	}
	return ps
}

// readEvk fills the (already shaped) evaluation key from b with the moduli q (Q part) and p
// (P part); every word must be reduced.  Returns the rest of b.
func readEvk(evk *rlwe.EvaluationKey, q, p []uint64, b []byte) ([]byte, error) {
	return readEvkRows(evk, q, p, b, wordRows)
}

// readEvkRows: readEvk with the rows stored in the given format (packedRows: seeded Galois keys).
func readEvkRows(evk *rlwe.EvaluationKey, q, p []uint64, b []byte, rows rowFormat) ([]byte, error) {
	var err error
	for i := range evk.Value {
		for j := range evk.Value[i] {
			if b, err = readQPRows(evk.Value[i][j], q, p, b, rows); err != nil {
				return nil, err
			}
		}
	}
	return b, nil
}

// clg_gen_eval_keys: a key set with a relinearisation key (relin != 0) and Galois keys for the
// slot rotations `steps` (n may be 0) and conjugation (conj != 0), under the secret key.
//
//export clg_gen_eval_keys
func clg_gen_eval_keys(skh C.int64_t, relin C.int, steps *C.int64_t, n C.int, conj C.int, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		els, err := galoisElements(s.ctx, i64s(steps, n), conj != 0)
		if err != nil {
			return err
		}
		if relin == 0 && len(els) == 0 {
			return errors.New("an empty key set (no relinearisation key, no rotations)")
		}
		kg := rlwe.NewKeyGenerator(s.ctx.params)
		var rlk *rlwe.RelinearizationKey
		if relin != 0 {
			rlk = kg.GenRelinearizationKeyNew(s.sk)
		}
		set := rlwe.NewMemEvaluationKeySet(rlk, kg.GenGaloisKeysNew(els, s.sk)...)
		*out = C.int64_t(put(&evkObj{ctx: s.ctx, set: set, eval: ckks.NewEvaluator(s.ctx.params, set)}))
		return nil
	})
}

// clg_evk_has_relin: 1 if the key set holds a relinearisation key.
//
//export clg_evk_has_relin
func clg_evk_has_relin(h C.int64_t, ok *C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "key set", errbuf, errlen, func(e *evkObj) error {
		*ok = 0
		if e.set.RelinearizationKey != nil {
			*ok = 1
		}
		return nil
	})
}

// clg_evk_merge: a new key set holding the relinearisation key and the Galois keys of a and b
// (same context; b's key wins where both have one).
//
//export clg_evk_merge
func clg_evk_merge(a C.int64_t, b C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(a, "key set", b, "key set", "key sets belong to different contexts",
		errbuf, errlen, func(x *evkObj, y *evkObj) error {
			rlk := x.set.RelinearizationKey
			if y.set.RelinearizationKey != nil {
				rlk = y.set.RelinearizationKey
			}
			set := rlwe.NewMemEvaluationKeySet(rlk)
			for _, src := range []*rlwe.MemEvaluationKeySet{x.set, y.set} {
				for g, gk := range src.GaloisKeys {
					set.GaloisKeys[g] = gk
				}
			}
			*out = C.int64_t(put(&evkObj{ctx: x.ctx, set: set, eval: ckks.NewEvaluator(x.ctx.params, set)}))
			return nil
		})
}

// clg_evk_keep_steps: a new set with the relinearisation key of h (if any) and, of its Galois
// keys, those of the rotations steps[0..n) and, with conj != 0, of the conjugation (each must be
// there); the others are not referenced by it (a server bounding the peer keys it keeps).
//
//export clg_evk_keep_steps
func clg_evk_keep_steps(h C.int64_t, steps *C.int64_t, n C.int, conj C.int, out *C.int64_t, errbuf *C.char,
	errlen C.int) (rc C.int) {
	return with(h, "key set", errbuf, errlen, func(e *evkObj) error {
		els, err := galoisElements(e.ctx, i64s(steps, n), conj != 0)
		if err != nil {
			return err
		}
		if g, missing := e.missingElement(els); missing {
			return fmt.Errorf("the key set has no key for Galois element %d", g)
		}
		set := rlwe.NewMemEvaluationKeySet(e.set.RelinearizationKey)
		for _, g := range els {
			set.GaloisKeys[g] = e.set.GaloisKeys[g]
		}
		*out = C.int64_t(put(&evkObj{ctx: e.ctx, set: set, eval: ckks.NewEvaluator(e.ctx.params, set)}))
		return nil
	})
}

// productOperands: the ciphertexts a and b of a ct x ct product under the key set e, checked:
// one context, a relinearisation key, degree 1, a level >= 1 to rescale at, and a product
// scale the modulus at that level holds.  Returns them, the level and the product's scale.
func productOperands(e *evkObj, a, b C.int64_t) (*ctObj, *ctObj, int, float64, error) {
	x, y, err := twoCts(a, b)
	if err != nil {
		return nil, nil, 0, 0, err
	}
	if x.ctx != e.ctx {
		return nil, nil, 0, 0, errors.New("ciphertexts and keys belong to different contexts")
	}
	if e.set.RelinearizationKey == nil {
		return nil, nil, 0, 0, errors.New("the key set has no relinearisation key")
	}
	if x.ct.Degree() != 1 || y.ct.Degree() != 1 {
		return nil, nil, 0, 0, errors.New("ct x ct multiplication needs degree-1 ciphertexts")
	}
	lvl := min(x.ct.Level(), y.ct.Level())
	if lvl == 0 {
		return nil, nil, 0, 0, errors.New("ciphertext at level 0: no prime left to rescale the product; bootstrap first")
	}
	s := x.ct.Scale.Float64() * y.ct.Scale.Float64()
	if s > math.Exp2(logQAt(e.ctx.params, lvl)-1) {
		return nil, nil, 0, 0, fmt.Errorf("product scale 2^%.1f exceeds the modulus at level %d (rescale first)",
			math.Log2(s), lvl)
	}
	return x, y, lvl, s, nil
}

// clg_mul_relin: a * b (ciphertexts, a == b squares), relinearised with the set's key, no rescale.
//
//export clg_mul_relin
func clg_mul_relin(evh C.int64_t, a C.int64_t, b C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(evh, "key set", errbuf, errlen, func(e *evkObj) error {
		x, y, lvl, _, err := productOperands(e, a, b)
		if err != nil {
			return err
		}
		res := ckks.NewCiphertext(e.ctx.params, 1, lvl)
		if err := mulRelin(e.eval, x.ct, y.ct, res); err != nil {
			return err
		}
		*out = C.int64_t(put(&ctObj{ctx: x.ctx, ct: res}))
		return nil
	})
}

// clg_mul_sum: sum_i a_i * b_i (ciphertexts, n >= 1 pairs, equal product scales) with one
// relinearisation: the degree-2 products accumulated in place (MulThenAdd), then relinearised
// once; no rescale.  At the lowest level of the operands.  The same sum as n clg_mul_relin
// products added, with one key switch instead of n (its noise once).
//
//export clg_mul_sum
func clg_mul_sum(evh C.int64_t, as *C.int64_t, bs *C.int64_t, n C.int, out *C.int64_t, errbuf *C.char,
	errlen C.int) (rc C.int) {
	return with(evh, "key set", errbuf, errlen, func(e *evkObj) error {
		if n < 1 || as == nil || bs == nil {
			return errors.New("no products to sum")
		}
		ha, hb := i64s(as, n), i64s(bs, n)
		xs := make([]*rlwe.Ciphertext, n)
		ys := make([]*rlwe.Ciphertext, n)
		lvl := -1
		var scale float64
		for i := range xs {
			x, y, l, s, err := productOperands(e, C.int64_t(ha[i]), C.int64_t(hb[i]))
			if err != nil {
				return err
			}
			if i == 0 {
				scale = s
			} else if math.Abs(s-scale) > 1e-9*scale {
				return fmt.Errorf("product %d has scale 2^%.6f, the first 2^%.6f: a sum needs one scale", i,
					math.Log2(s), math.Log2(scale))
			}
			if lvl < 0 || l < lvl {
				lvl = l
			}
			xs[i], ys[i] = x.ct, y.ct
		}
		acc := ckks.NewCiphertext(e.ctx.params, 2, lvl)
		for i := range xs {
			var err error
			if i == 0 {
				err = e.eval.Mul(xs[i], ys[i], acc)
			} else {
				err = e.eval.MulThenAdd(xs[i], ys[i], acc)
			}
			if err != nil {
				return err
			}
		}
		res := ckks.NewCiphertext(e.ctx.params, 1, lvl)
		if err := relinearize(e.eval, acc, res); err != nil {
			return err
		}
		*out = C.int64_t(put(&ctObj{ctx: e.ctx, ct: res}))
		return nil
	})
}

// clg_sub: a -= b (ciphertexts), or a -= pt when plain != 0.
//
//export clg_sub
func clg_sub(a C.int64_t, b C.int64_t, plain C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return inPlace(a, b, plain, errbuf, errlen, (*ckks.Evaluator).Sub)
}

// clg_mul_scalar: ct * (re + i im) into a new ciphertext.  A non-integer constant is encoded at
// the scale of the ciphertext's last prime (so a rescale restores the input scale); a Gaussian
// integer at scale 1.  No rescale.
//
//export clg_mul_scalar
func clg_mul_scalar(cth C.int64_t, re C.double, im C.double, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		v, err := finiteScalar(re, im)
		if err != nil {
			return err
		}
		res := ckks.NewCiphertext(c.ctx.params, c.ct.Degree(), c.ct.Level())
		if err := c.ctx.eval.Mul(c.ct, v, res); err != nil {
			return err
		}
		*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: res}))
		return nil
	})
}

// clg_add_scalar: ct += (re + i im), in place (encoded at the ciphertext's scale).
//
//export clg_add_scalar
func clg_add_scalar(cth C.int64_t, re C.double, im C.double, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		v, err := finiteScalar(re, im)
		if err != nil {
			return err
		}
		return c.ctx.eval.Add(c.ct, v, c.ct)
	})
}

// polyLevels: the levels a Chebyshev evaluation of degree d on [a, b] consumes: one for the
// change of variable x -> (2x - a - b) / (b - a) (none on [-1, 1]) and ceil(log2(d + 1)) for the
// evaluation (measured on Lattigo v6.2.0 for d = 1..33, tests/test_he_lattigo_ckks_ops.py:
// bignum's Depth(), ceil(log2(d)), is one short at powers of two).
func polyLevels(d int, a, b float64) int {
	depth := bits.Len(uint(d))
	if a != -1 || b != 1 {
		depth++
	}
	return depth
}

// clg_poly_levels: the levels clg_poly_eval consumes for a degree-d polynomial on [a, b].
//
//export clg_poly_levels
func clg_poly_levels(d C.int, a C.double, b C.double, out *C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return call(errbuf, errlen, func() error {
		if d < 1 || d > 1<<14 {
			return fmt.Errorf("degree %d out of range [1, 16384]", int(d))
		}
		*out = C.int(polyLevels(int(d), float64(a), float64(b)))
		return nil
	})
}

// clg_poly_eval: p(ct) for p = sum_k coeffs[k] T_k((2x - a - b) / (b - a)) (T_k: Chebyshev
// polynomials of the first kind), the result at the input's scale.  Needs the set's
// relinearisation key (degree >= 2) and clg_poly_levels(n - 1, a, b) levels.
//
//export clg_poly_eval
func clg_poly_eval(evh C.int64_t, cth C.int64_t, coeffs *C.double, n C.int, a C.double, b C.double, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(evh, "key set", cth, "ciphertext", "ciphertext and keys belong to different contexts",
		errbuf, errlen, func(e *evkObj, c *ctObj) error {
			if n < 2 || n > 1<<14+1 || coeffs == nil {
				return fmt.Errorf("%d coefficients (2..16385)", int(n))
			}
			lo, hi := float64(a), float64(b)
			if math.IsNaN(lo) || math.IsNaN(hi) || math.IsInf(lo, 0) || math.IsInf(hi, 0) || !(hi > lo) {
				return fmt.Errorf("bad interval [%g, %g]", lo, hi)
			}
			cs := make([]float64, int(n))
			copy(cs, unsafeFloats(coeffs, int(n)))
			for _, v := range cs {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					return errors.New("coefficients must be finite")
				}
			}
			if c.ct.Degree() != 1 {
				return errors.New("polynomial evaluation needs a degree-1 ciphertext")
			}
			deg := int(n) - 1
			if deg >= 2 && e.set.RelinearizationKey == nil {
				return errors.New("the key set has no relinearisation key")
			}
			need := polyLevels(deg, lo, hi)
			if c.ct.Level() < need {
				return fmt.Errorf("ciphertext at level %d, the degree-%d evaluation on [%g, %g] needs %d levels (bootstrap first)",
					c.ct.Level(), deg, lo, hi, need)
			}
			poly := polynomial.NewPolynomial(bignum.NewPolynomial(bignum.Chebyshev, cs, [2]float64{lo, hi}))
			x := c.ct
			if lo != -1 || hi != 1 {
				scalar, constant := poly.ChangeOfBasis()
				x = ckks.NewCiphertext(c.ctx.params, 1, c.ct.Level())
				if err := e.eval.Mul(c.ct, scalar, x); err != nil {
					return err
				}
				if err := e.eval.Add(x, constant, x); err != nil {
					return err
				}
				if err := rescale(e.eval, x, x); err != nil {
					return err
				}
			}
			// a fresh evaluator per call: Lattigo's polynomial evaluator keeps per-evaluation state
			res, err := polynomialEvaluator(e.ctx.params, e.eval).Evaluate(x, poly, c.ct.Scale)
			if err != nil {
				return err
			}
			*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: res}))
			return nil
		})
}

// clg_relin_to_bytes: the set's relinearisation key as "CLGR" | version | 0 0 0 | raw words.
//
//export clg_relin_to_bytes
func clg_relin_to_bytes(evh C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(evh, "key set", errbuf, errlen, func(e *evkObj) error {
		if e.set.RelinearizationKey == nil {
			return errors.New("the key set has no relinearisation key")
		}
		b := []byte{'C', 'L', 'G', 'R', wireVersion, 0, 0, 0}
		bytesOut(writePolys(b, evkPolys(&e.set.RelinearizationKey.EvaluationKey)), out, outLen)
		return nil
	})
}

// clg_relin_from_bytes: validate and load a peer's relinearisation key into a new key set.
//
//export clg_relin_from_bytes
func clg_relin_from_bytes(h C.int64_t, buf *C.uchar, n C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		b := bytesIn(buf, n)
		rlk := rlwe.NewRelinearizationKey(c.params)
		if want := keyHeader + 8*polysWords(evkPolys(&rlk.EvaluationKey)); len(b) != want {
			return fmt.Errorf("relinearisation key blob of %d bytes, expected %d", len(b), want)
		}
		if string(b[:4]) != "CLGR" || b[4] != wireVersion || b[5] != 0 || b[6] != 0 || b[7] != 0 {
			return errors.New("not a cipherlm/Lattigo relinearisation key (bad header)")
		}
		if _, err := readEvk(&rlk.EvaluationKey, c.params.Q(), c.params.P(), b[keyHeader:]); err != nil {
			return err
		}
		set := rlwe.NewMemEvaluationKeySet(rlk)
		*out = C.int64_t(put(&evkObj{ctx: c, set: set, eval: ckks.NewEvaluator(c.params, set)}))
		return nil
	})
}

// finiteScalar: re + i im, which must be finite.
func finiteScalar(re, im C.double) (complex128, error) {
	v := complex(float64(re), float64(im))
	if math.IsNaN(real(v)) || math.IsInf(real(v), 0) || math.IsNaN(imag(v)) || math.IsInf(imag(v), 0) {
		return 0, errors.New("scalar must be finite")
	}
	return v, nil
}

func unsafeFloats(p *C.double, n int) []float64 {
	return unsafe.Slice((*float64)(unsafe.Pointer(p)), n)
}

// logQAt: log2 of the product of the primes q_0..q_level.
func logQAt(params ckks.Parameters, level int) float64 {
	s := 0.0
	for _, q := range params.Q()[:level+1] {
		s += math.Log2(float64(q))
	}
	return s
}

// clg_ct_scale_by: multiply the ciphertext's scale by `factor` without touching its
// coefficients, in place: the message it decodes to is divided by `factor`.  The fhe mode
// brings a value of known bound B into the bootstrapping's input range this way (B on the
// way in, an integer product by B on the way out), which needs no level.
//
//export clg_ct_scale_by
func clg_ct_scale_by(cth C.int64_t, factor C.double, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		f := float64(factor)
		if !(f > 0) || math.IsInf(f, 0) || f > 0x1p60 || f < 0x1p-60 {
			return fmt.Errorf("bad scale factor %g (want 2^-60 <= factor <= 2^60)", f)
		}
		c.ct.Scale = c.ct.Scale.Mul(rlwe.NewScale(f))
		return nil
	})
}

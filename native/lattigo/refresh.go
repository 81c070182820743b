// The client-aided refresh of the fhe mode (cipherlm/protocols/ckks/refresh.py; docs/fhe.md,
// "Client-aided refresh"): instead of bootstrapping, the server adds a large random integer
// polynomial u to the message of a ciphertext at level l >= 1, the client decrypts the masked
// integer polynomial m + e + u exactly (CRT over the primes of level l, centred), re-encrypts
// it at the top level and the default scale, and the server subtracts u (scaled the same way).
//
// u's coefficients are uniform in [-2^bits, 2^bits), expanded from a 32-byte seed with
// `seedStream` (AES-256 in counter mode), so the server keeps 32 bytes per ciphertext and
// regenerates u to unmask.  With |m + e| <= 2^(bits - lambda) per coefficient, the client's
// view of one coefficient is within statistical distance 2^-(lambda + 1) of u alone.
//
// Scales: the client's result is round(c * r) with r = defaultScale / s, s the masked
// ciphertext's scale as a float64 (the value the wire carries); the server unmasks with
// round(u * r) computed by the same code (ratio, scaledInts), so the two roundings differ by
// at most one unit of the new scale.
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
	"math/big"
	"unsafe"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

// ratioPrec: bits of the scale ratio and of the scaled coefficients (the masked coefficients
// have at most ~2^440 at the top of N16QP1546H192H32's residual chain).
const ratioPrec = 512

// maskInts: N integers uniform in [-2^bits, 2^bits), expanded from seed (bits + 1 uniform bits
// each: exactly uniform).
func maskInts(seed []byte, n int, bits int) ([]*big.Int, error) {
	if bits < 1 || bits > 1000 {
		return nil, fmt.Errorf("mask of %d bits out of range 1..1000", bits)
	}
	prng, err := newSeedStream(seed)
	if err != nil {
		return nil, err
	}
	nb := (bits + 1 + 7) / 8
	top := byte(0xff >> uint(8*nb-(bits+1)))
	buf := make([]byte, nb)
	half := new(big.Int).Lsh(big.NewInt(1), uint(bits))
	out := make([]*big.Int, n)
	for i := range out {
		if _, err := prng.Read(buf); err != nil {
			return nil, err
		}
		buf[0] &= top
		out[i] = new(big.Int).SetBytes(buf)
		out[i].Sub(out[i], half)
	}
	return out, nil
}

// ratio: to / from (positive, finite float64 scales) at ratioPrec bits.
func ratio(to, from float64) (*big.Float, error) {
	if !(to > 0) || !(from > 0) || math.IsInf(to, 0) || math.IsInf(from, 0) {
		return nil, fmt.Errorf("bad scales %g / %g", to, from)
	}
	a := new(big.Float).SetPrec(ratioPrec).SetFloat64(to)
	b := new(big.Float).SetPrec(ratioPrec).SetFloat64(from)
	return a.Quo(a, b), nil
}

// scaledInts: round(v * r) for each v (in place when r is exactly 1).
func scaledInts(vs []*big.Int, r *big.Float) []*big.Int {
	if r.Cmp(big.NewFloat(1)) == 0 {
		return vs
	}
	half := big.NewFloat(0.5)
	out := make([]*big.Int, len(vs))
	f := new(big.Float).SetPrec(ratioPrec)
	for i, v := range vs {
		f.SetInt(v)
		f.Mul(f, r)
		if f.Sign() >= 0 {
			f.Add(f, half)
		} else {
			f.Sub(f, half)
		}
		out[i], _ = f.Int(nil) // truncation towards zero of x +- 1/2: rounding half away from zero
	}
	return out
}

// polyOfInts: the integers as a polynomial at `level`, in NTT form when ntt.
func polyOfInts(c *ctxObj, vs []*big.Int, level int, ntt bool) ring.Poly {
	rq := c.params.RingQ().AtLevel(level)
	p := rq.NewPoly()
	rq.SetCoefficientsBigint(vs, p)
	if ntt {
		rq.NTT(p, p)
	}
	return p
}

// maxBits: the largest bit length of |v| over vs.
func maxBits(vs []*big.Int) int {
	m := 0
	for _, v := range vs {
		m = max(m, v.BitLen())
	}
	return m
}

// clg_ct_add_mask: in place, ct's message += sign * round(u * r), u the seed's mask polynomial of
// `bits` bits and r = scale(ct) / fromScale (fromScale <= 0: r = 1, and the ciphertext's scale is
// first rounded to a float64, the value its serialisation carries).  The masked coefficients must
// stay below Q_level / 4 in magnitude: 2^(bits + 2) <= Q_level (else an error, nothing changed).
//
//export clg_ct_add_mask
func clg_ct_add_mask(cth C.int64_t, seed *C.uchar, seedLen C.int, bits C.int, sign C.int, fromScale C.double,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		if sign != 1 && sign != -1 {
			return fmt.Errorf("sign %d (want 1 or -1)", int(sign))
		}
		if c.ct.Degree() != 1 {
			return errors.New("masking needs a degree-1 ciphertext")
		}
		if seed == nil || seedLen != 32 {
			return errors.New("the mask seed must be 32 bytes")
		}
		lvl := c.ct.Level()
		if float64(bits)+2 > logQAt(c.ctx.params, lvl) {
			return fmt.Errorf("a %d-bit mask does not fit the modulus at level %d (2^%.1f): refresh at a higher level",
				int(bits), lvl, logQAt(c.ctx.params, lvl))
		}
		u, err := maskInts(C.GoBytes(unsafe.Pointer(seed), seedLen), c.ctx.params.N(), int(bits))
		if err != nil {
			return err
		}
		s := c.ct.Scale.Float64()
		from := float64(fromScale)
		if from <= 0 {
			from = s
		}
		r, err := ratio(s, from)
		if err != nil {
			return err
		}
		p := polyOfInts(c.ctx, scaledInts(u, r), lvl, c.ct.IsNTT)
		rq := c.ctx.params.RingQ().AtLevel(lvl)
		if sign > 0 {
			rq.Add(c.ct.Value[0], p, c.ct.Value[0])
		} else {
			rq.Sub(c.ct.Value[0], p, c.ct.Value[0])
		}
		c.ct.Scale = rlwe.NewScale(s)
		return nil
	})
}

// clg_ct_refresh_plaintext: the client's half of the refresh, up to the encryption.  Decrypts ct
// (level l) to its integer polynomial (centred mod Q_l), multiplies it by defaultScale / scale(ct)
// (rounded) and returns it as a plaintext at the top level with the default scale, for a fresh
// (seeded) encryption.  It never fails because of the decrypted values (only for a coefficient too
// large for the top modulus, which a masked ciphertext of the server's never produces), so the
// client's answer reveals nothing about them.
//
//export clg_ct_refresh_plaintext
func clg_ct_refresh_plaintext(skh C.int64_t, cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(skh, "secret key", cth, "ciphertext", "ciphertext and key belong to different contexts",
		errbuf, errlen, func(s *skObj, c *ctObj) error {
			if c.ct.Degree() != 1 {
				return errors.New("re-encryption needs a degree-1 ciphertext")
			}
			params := s.ctx.params
			lvl := c.ct.Level()
			pt := s.dec.DecryptNew(c.ct)
			rq := params.RingQ().AtLevel(lvl)
			if pt.IsNTT {
				rq.INTT(pt.Value, pt.Value)
			}
			vs := make([]*big.Int, params.N())
			for i := range vs {
				vs[i] = new(big.Int)
			}
			rq.PolyToBigintCentered(pt.Value, 1, vs)
			r, err := ratio(params.DefaultScale().Float64(), c.ct.Scale.Float64())
			if err != nil {
				return err
			}
			vs = scaledInts(vs, r)
			top := params.MaxLevel()
			if float64(maxBits(vs))+2 > logQAt(params, top) {
				return fmt.Errorf("a coefficient of %d bits does not fit the top modulus", maxBits(vs))
			}
			fresh := ckks.NewPlaintext(params, top)
			*fresh.MetaData = *c.ct.MetaData
			fresh.Scale = params.DefaultScale()
			fresh.IsNTT = true
			fresh.Value = polyOfInts(s.ctx, vs, top, true)
			*out = C.int64_t(put(&ptObj{ctx: s.ctx, pt: fresh}))
			return nil
		})
}

// clg_ct_scale: the ciphertext's scale as a float64 (exactly the value its serialisation carries).
//
//export clg_ct_scale
func clg_ct_scale(cth C.int64_t, out *C.double, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		*out = C.double(c.ct.Scale.Float64())
		return nil
	})
}

// clg_pt_coeffs: a plaintext's coefficients (coefficient form, RNS: (level + 1) rows of N words)
// into dst; n must be (level + 1) * N.  The client's own decrypted polynomials (tests read what a
// client sees of a masked ciphertext through it).
//
//export clg_pt_coeffs
func clg_pt_coeffs(ph C.int64_t, dst *C.uint64_t, n C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(ph, "plaintext", errbuf, errlen, func(p *ptObj) error {
		lvl, N := p.pt.Level(), p.ctx.params.N()
		if dst == nil || int(n) != (lvl+1)*N {
			return fmt.Errorf("a buffer of %d words for a plaintext of %d x %d", int(n), lvl+1, N)
		}
		v := p.pt.Value.CopyNew()
		if p.pt.IsNTT {
			p.ctx.params.RingQ().AtLevel(lvl).INTT(*v, *v)
		}
		out := unsafe.Slice((*uint64)(unsafe.Pointer(dst)), int(n))
		for i := 0; i <= lvl; i++ {
			copy(out[i*N:(i+1)*N], v.Coeffs[i][:N])
		}
		return nil
	})
}

// clg_ntt: Lattigo's own negacyclic NTT (ring.NTTStandard, the form CKKS ciphertexts are stored in)
// of k = rows RNS residue rows of N words, in place in buf (row i modulo the context's prime i);
// inverse != 0: the inverse transform.  Every input word must be reduced modulo its prime.  The
// conversions of BLB (section 6, Algorithms 1-2) move coefficient-form shares in and out of NTT
// form through it (`LattigoBackend.ntt_forward` / `ntt_inverse`); `cipherlm/he/lattigo_ntt.py` is
// its numpy reference in the tests.
//
//export clg_ntt
func clg_ntt(cth C.int64_t, buf *C.uint64_t, rows C.int, inverse C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "context", errbuf, errlen, func(c *ctxObj) error {
		N, k := c.params.N(), int(rows)
		if buf == nil || k < 1 || k > c.params.MaxLevel()+1 {
			return fmt.Errorf("%d residue rows for a context of %d primes", k, c.params.MaxLevel()+1)
		}
		d := unsafe.Slice((*uint64)(unsafe.Pointer(buf)), k*N)
		r := c.params.RingQ().AtLevel(k - 1)
		p := r.NewPoly()
		for i := 0; i < k; i++ {
			q := r.SubRings[i].Modulus
			row := d[i*N : (i+1)*N]
			for _, x := range row {
				if x >= q {
					return fmt.Errorf("residue %d not reduced modulo %d (row %d)", x, q, i)
				}
			}
			copy(p.Coeffs[i], row)
		}
		if inverse != 0 {
			r.INTT(p, p)
		} else {
			r.NTT(p, p)
		}
		for i := 0; i < k; i++ {
			copy(d[i*N:(i+1)*N], p.Coeffs[i][:N])
		}
		return nil
	})
}

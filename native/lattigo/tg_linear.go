// The fhe mode's projections in one call (cipherlm/protocols/ckks/linear.py, EncodedLinear): a
// ct x pt matrix product on token-group packed ciphertexts (AEGIS section 2.3: slot
// c * tp + t holds channel c of position t, cpc = slots / tp channels per ciphertext) by
// Halevi-Shoup diagonals over the channels with baby-step giant-step rotations in units of tp
// slots.  The diagonals are made from the matrix and encoded here, at the input's level, on the
// fly (at 2^15 slots a model's encoded diagonals would take tens of GB), by `workers` goroutines
// that share out the (output block, giant step) units; the baby steps are hoisted.
//
// Output block o = sum_j rot( rescale( sum_{i, b} diag(o, i, j g + b) * rot(x_i, b tp) ), j g tp ),
// diag(o, i, k)[c tp + t] = W[o cpc + c, i cpc + (c + k) mod cpc] * mask[t], pre-rotated by
// -(j g tp) so that the giant rotation lines it up (`EncodedLinear._diagonal`, same layout).
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
	"sync/atomic"
	"unsafe"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

type tgUnit struct{ o, j int }

// tgBatch: diagonals encoded before their products are summed in one pass (`mulAccTile`); each
// worker keeps this many plaintexts (5.2 MB each at level 9, N = 2^16).
const tgBatch = 16

// clg_tg_linear: the product of the padded matrix w (nOut cpc rows x nIn cpc columns, row-major)
// with the nIn ciphertexts `cts` (one level, degree 1) in the token-group layout of tp positions
// per channel, positions weighted by mask (tp values), g baby steps.  out[o]: block o's result
// (one level below the input, the input's scale), 0 when all its diagonals are zero.  counts:
// rotations, products, rescales.
//
//export clg_tg_linear
func clg_tg_linear(evh C.int64_t, cts *C.int64_t, nIn C.int, w *C.double, nOut C.int, mask *C.double, tp C.int,
	g C.int, workers C.int, out *C.int64_t, counts *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(evh, "key set", errbuf, errlen, func(e *evkObj) error {
		params := e.ctx.params
		slots := params.MaxSlots()
		T, G, ni, no := int(tp), int(g), int(nIn), int(nOut)
		if T < 1 || slots%T != 0 || ni < 1 || no < 1 || ni > 1<<12 || no > 1<<12 || cts == nil || w == nil || mask == nil {
			return fmt.Errorf("bad shape: %d inputs, %d outputs, tp %d (slots %d)", ni, no, T, slots)
		}
		cpc := slots / T
		if G < 1 || G > cpc {
			return fmt.Errorf("%d baby steps for %d channels per ciphertext", G, cpc)
		}
		in, lvl, err := ctsAtOneLevel(e, unsafe.Slice((*int64)(unsafe.Pointer(cts)), ni), "inputs")
		if err != nil {
			return err
		}
		W := unsafe.Slice((*float64)(unsafe.Pointer(w)), no*cpc*ni*cpc)
		M := unsafe.Slice((*float64)(unsafe.Pointer(mask)), T)
		if err := finiteMatrix(W); err != nil {
			return err
		}
		cols := ni * cpc
		at := func(o, i, k, c int) float64 { return W[(o*cpc+c)*cols+i*cpc+(c+k)%cpc] }
		nz := make([]bool, no*ni*cpc) // diagonal (o, i, k) not all zero
		for o := 0; o < no; o++ {
			for i := 0; i < ni; i++ {
				for k := 0; k < cpc; k++ {
					for c := 0; c < cpc; c++ {
						if at(o, i, k, c) != 0 {
							nz[(o*ni+i)*cpc+k] = true
							break
						}
					}
				}
			}
		}
		nGiant := (cpc + G - 1) / G
		var units []tgUnit
		for o := 0; o < no; o++ {
			for j := 0; j < nGiant; j++ {
				for i := 0; i < ni; i++ {
					found := false
					for b := 0; b < G && j*G+b < cpc; b++ {
						if nz[(o*ni+i)*cpc+j*G+b] {
							found = true
							break
						}
					}
					if found {
						units = append(units, tgUnit{o, j})
						break
					}
				}
			}
		}
		steps := []int{}
		for b := 1; b < G; b++ {
			steps = append(steps, b*T)
		}
		for j := 1; j < nGiant; j++ {
			steps = append(steps, j*G*T)
		}
		for _, s := range steps {
			if _, ok := e.set.GaloisKeys[params.GaloisElement(s)]; !ok {
				return fmt.Errorf("the key set lacks the rotation by %d", s)
			}
		}
		wk := max(1, min(int(workers), 64))
		eval := e.eval

		// baby steps rot(x_i, b tp), hoisted per input, shared out over the workers
		baby := make([][]*rlwe.Ciphertext, ni)
		for i := range baby {
			baby[i] = make([]*rlwe.Ciphertext, G)
			baby[i][0] = in[i]
		}
		err = parallel(wk, func(t int) error {
			for i := 0; i < ni; i++ {
				var mine []int
				for b := 1 + t; b < G; b += wk {
					mine = append(mine, b*T)
				}
				if len(mine) == 0 {
					continue
				}
				res := map[int]*rlwe.Ciphertext{}
				for _, s := range mine {
					res[s] = ckks.NewCiphertext(params, 1, lvl)
				}
				if err := rotateHoisted(eval, in[i], mine, res); err != nil {
					return err
				}
				for _, s := range mine {
					baby[i][s/T] = res[s]
				}
			}
			return nil
		})
		if err != nil {
			return err
		}

		// the units: products with diagonals encoded on the fly, rescale, giant rotation.  Each
		// worker encodes the diagonals of a unit in batches of tgBatch into plaintexts it reuses
		// (a fresh one per diagonal cost a page-faulted allocation each: ~20% of the time at 2^15
		// slots) and adds the batch's products with the offload kernel `mulAccTile` (128-bit lazy
		// sums, one Montgomery reduction per coefficient and batch, tiled over the coefficients):
		// that gives sum_d ct * pt_d * R^-1 for the plain (non-Montgomery) diagonals, so each
		// unit's sum is multiplied by R once at the end (MForm): the same residues as Lattigo's
		// Mul / MulThenAdd, which convert every diagonal to the Montgomery form first.
		scale := rlwe.NewScale(params.Q()[lvl])
		ringQ := params.RingQ().AtLevel(lvl)
		N := params.N()
		sums := make([]*rlwe.Ciphertext, len(units))
		var products, rotations int64
		err = parallel(wk, func(t int) error {
			v := make([]float64, slots)
			pts := make([]*rlwe.Plaintext, tgBatch)
			for k := range pts {
				pts[k] = ckks.NewPlaintext(params, lvl)
				pts[k].Scale = scale
			}
			xs := make([]*rlwe.Ciphertext, 0, tgBatch)
			a0s, a1s, ps := make([][]uint64, tgBatch), make([][]uint64, tgBatch), make([][]uint64, tgBatch)
			tmp0, tmp1 := ringQ.NewPoly(), ringQ.NewPoly()
			tile := make([]uint64, 4*prodTile)
			var prods, rots int64
			for u := t; u < len(units); u += wk {
				o, j := units[u].o, units[u].j
				shift := j * G * T
				var acc *rlwe.Ciphertext
				flush := func() {
					if len(xs) == 0 {
						return
					}
					d0, d1, into := tmp0, tmp1, acc != nil
					if acc == nil {
						acc = ckks.NewCiphertext(params, 1, lvl)
						*acc.MetaData = *xs[0].MetaData
						acc.Scale = xs[0].Scale.Mul(scale)
						d0, d1 = acc.Value[0], acc.Value[1]
					}
					for l, sub := range ringQ.SubRings[:lvl+1] {
						q, qInv, fold := sub.Modulus, sub.MRedConstant, foldTerms(sub.Modulus)
						for c0 := 0; c0 < N; c0 += prodTile {
							c1 := min(c0+prodTile, N)
							for k, x := range xs {
								a0s[k], a1s[k] = x.Value[0].Coeffs[l][c0:c1], x.Value[1].Coeffs[l][c0:c1]
								ps[k] = pts[k].Value.Coeffs[l][c0:c1]
							}
							n := len(xs)
							mulAccTile(q, qInv, fold, a0s[:n], a1s[:n], ps[:n], d0.Coeffs[l][c0:c1], d1.Coeffs[l][c0:c1],
								tile[:4*(c1-c0)], 1)
						}
					}
					if into {
						ringQ.Add(acc.Value[0], d0, acc.Value[0])
						ringQ.Add(acc.Value[1], d1, acc.Value[1])
					}
					xs = xs[:0]
				}
				for i := 0; i < ni; i++ {
					for b := 0; b < G && j*G+b < cpc; b++ {
						k := j*G + b
						if !nz[(o*ni+i)*cpc+k] {
							continue
						}
						for c := 0; c < cpc; c++ { // the diagonal, rolled right by shift slots (T | shift)
							val := at(o, i, k, c)
							base := (c*T + shift) % slots
							for p := 0; p < T; p++ {
								v[base+p] = val * M[p]
							}
						}
						if err := encodeNTT(e.ctx.encoder, v, pts[len(xs)]); err != nil {
							return err
						}
						xs = append(xs, baby[i][b])
						if len(xs) == tgBatch {
							flush()
						}
						prods++
					}
				}
				flush()
				ringQ.MForm(acc.Value[0], acc.Value[0])
				ringQ.MForm(acc.Value[1], acc.Value[1])
				if err := rescale(eval, acc, acc); err != nil {
					return err
				}
				if shift != 0 {
					r := ckks.NewCiphertext(params, 1, acc.Level())
					if err := rotate(eval, acc, shift, r); err != nil {
						return err
					}
					acc = r
					rots++
				}
				sums[u] = acc
			}
			atomic.AddInt64(&products, prods)
			atomic.AddInt64(&rotations, rots)
			return nil
		})
		if err != nil {
			return err
		}
		res := make([]*rlwe.Ciphertext, no)
		for u, s := range sums {
			o := units[u].o
			if res[o] == nil {
				res[o] = s
			} else if err := eval.Add(res[o], s, res[o]); err != nil {
				return err
			}
		}
		dst := unsafe.Slice((*int64)(unsafe.Pointer(out)), no)
		for o, y := range res {
			if y == nil {
				dst[o] = 0
			} else {
				dst[o] = put(&ctObj{ctx: e.ctx, ct: y})
			}
		}
		cs := unsafe.Slice((*int64)(unsafe.Pointer(counts)), 3)
		cs[0] = rotations + int64(ni*(G-1))
		cs[1] = products
		cs[2] = int64(len(units))
		return nil
	})
}

// ctsAtOneLevel: the ciphertexts of the handles (the key set's context, degree 1, one level,
// at least level 1 so that a product can be rescaled) and that level; `what` names them in
// the errors.
func ctsAtOneLevel(e *evkObj, handles []int64, what string) ([]*rlwe.Ciphertext, int, error) {
	out := make([]*rlwe.Ciphertext, len(handles))
	for i, h := range handles {
		c, err := getIn[*ctObj](C.int64_t(h), "ciphertext", "ciphertext and keys belong to different contexts", e)
		if err != nil {
			return nil, 0, err
		}
		if c.ct.Degree() != 1 || (i > 0 && c.ct.Level() != out[0].Level()) {
			return nil, 0, fmt.Errorf("the %s must be degree-1 ciphertexts at one level", what)
		}
		out[i] = c.ct
	}
	if len(out) == 0 {
		return nil, 0, fmt.Errorf("no %s", what)
	}
	if out[0].Level() < 1 {
		return nil, 0, errors.New("input at level 0: no prime left to rescale the product; refresh first")
	}
	return out, out[0].Level(), nil
}

// finiteMatrix: an error if an entry of the matrix is NaN or infinite.
func finiteMatrix(w []float64) error {
	for _, v := range w {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return errors.New("matrix entries must be finite")
		}
	}
	return nil
}

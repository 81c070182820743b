// BLB's projections in one call (cipherlm/runtime/blb_block.py, `_Eval.linear`; BLB section
// 4's fused blocks, issue 16 item 2): y = x W^T on the stacked-row layout, where row r of a
// ciphertext sits in slots [r P, r P + P) and a value wider than the period P is cut into
// column chunks of P.  Per (output chunk, input chunk) block of W its d_i + d_o - 1 non-cyclic
// diagonals k = k0 .. d_i - 1 (entry (t, t + k) where both lie inside the block, zero
// elsewhere, so a rotation that reaches into the neighbouring row meets a zero), by
// baby-step giant-step:
//
//	y_(r, o) = rescale( sum_j rot( sum_(c, i) baby_(r, c)[i] * pt(o, c, j, i), k0 + j b ) )
//
// with baby_(r, c)[i] = rot(x_(r, c), i) (hoisted; passed in, so that the projections of one
// input share them) and pt(o, c, j, i) the diagonal k0 + j b + i rolled right by k0 + j b
// inside the period, tiled over the rows and encoded at the inputs' level with the scale of
// the prime the rescale drops (the result keeps the inputs' scale).
//
// The same operations as the Python path (`_Eval.linear` with `native = False`), in the
// same order where it matters (one rescale after the giant rotations, every sum exact mod q),
// so the two give bit-identical ciphertexts; what changes is that the diagonals are made and
// encoded here, each once for all rows, the products are accumulated in place (MulThenAdd:
// no ciphertext per product), and `workers` goroutines share out the (output chunk, giant
// step) units.
package main

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

// clg_blb_linear: w (dOut x dIn, row-major) times the value whose baby steps are `babies`
// (m row ciphertexts x kIn input chunks x B rotations rot(x, i), i < B, row-major; one level,
// degree 1), at period P.  plans: per output chunk (b, g, k0), b <= B (`blb_block.linear_plan`).
// logScale: log2 of the diagonals' scale (Python's float, as `encode_slots` takes it).  out:
// m x kOut handles, rescaled once (0: an all-zero block).  counts: products, giant rotations.
//
//export clg_blb_linear
func clg_blb_linear(evh C.int64_t, babies *C.int64_t, m C.int, kIn C.int, B C.int, w *C.double, dOut C.int,
	dIn C.int, period C.int, plans *C.int64_t, logScale C.double, workers C.int, out *C.int64_t,
	counts *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(evh, "key set", errbuf, errlen, func(e *evkObj) error {
		params := e.ctx.params
		slots := params.MaxSlots()
		M, KI, NB, DO, DI, P := int(m), int(kIn), int(B), int(dOut), int(dIn), int(period)
		if P < 1 || P&(P-1) != 0 || P > slots || M < 1 || NB < 1 || NB > P || DO < 1 || DI < 1 ||
			babies == nil || w == nil || plans == nil || out == nil || counts == nil {
			return fmt.Errorf("bad shape: %d rows x %d chunks x %d baby steps, %d x %d at period %d (slots %d)",
				M, KI, NB, DO, DI, P, slots)
		}
		if KI != (DI+P-1)/P {
			return fmt.Errorf("%d input chunks for width %d at period %d", KI, DI, P)
		}
		KO := (DO + P - 1) / P
		if logScale <= 0 || logScale > 120 {
			return fmt.Errorf("log2 scale %g out of range", float64(logScale))
		}
		bab, lvl, err := ctsAtOneLevel(e, unsafe.Slice((*int64)(unsafe.Pointer(babies)), M*KI*NB), "baby steps")
		if err != nil {
			return err
		}
		W := unsafe.Slice((*float64)(unsafe.Pointer(w)), DO*DI)
		if err := finiteMatrix(W); err != nil {
			return err
		}
		pl := unsafe.Slice((*int64)(unsafe.Pointer(plans)), 3*KO)
		type unit struct{ o, j, b, k0 int }
		var units []unit
		for o := 0; o < KO; o++ {
			b, g, k0 := int(pl[3*o]), int(pl[3*o+1]), int(pl[3*o+2])
			if b < 1 || b > NB || g < 1 || k0 > 0 || k0 <= -P-b {
				return fmt.Errorf("output chunk %d: plan (%d, %d, %d) for %d baby steps", o, b, g, k0, NB)
			}
			for j := 0; j < g; j++ {
				if s := ((k0+j*b)%slots + slots) % slots; s != 0 {
					if _, ok := e.set.GaloisKeys[params.GaloisElement(s)]; !ok {
						return fmt.Errorf("the key set lacks the rotation by %d", s)
					}
				}
				units = append(units, unit{o, j, b, k0})
			}
		}
		wk := max(1, min(int(workers), 64))
		eval := e.eval
		logP := bits.Len(uint(P)) - 1

		acc := make([]*rlwe.Ciphertext, M*KO) // the rotated inner sums of each (row, output chunk)
		locks := make([]sync.Mutex, KO)
		var products, rotations int64
		err = parallel(wk, func(t int) error {
			diag := make([]float64, P)
			cbuf := make([]complex128, P)
			pt := ckks.NewPlaintext(params, lvl) // one per worker, overwritten by each diagonal
			pt.Scale = rlwe.NewScale(math.Exp2(float64(logScale)))
			inner := make([]*rlwe.Ciphertext, M)
			var prods, rots int64
			for u := t; u < len(units); u += wk {
				o, j, b, k0 := units[u].o, units[u].j, units[u].b, units[u].k0
				do := min(P, DO-o*P)
				shift := k0 + j*b
				roll := ((shift % P) + P) % P
				for r := range inner {
					inner[r] = nil
				}
				for c := 0; c < KI; c++ {
					di := min(P, DI-c*P)
					for i := 0; i < b; i++ {
						k := shift + i
						if k >= di {
							continue
						}
						nonzero := false
						for x := range diag {
							diag[x] = 0
						}
						for row := 0; row < do; row++ { // entry (row, row + k) of the block, rolled right
							col := row + k
							if col < 0 || col >= di {
								continue
							}
							if v := W[(o*P+row)*DI+c*P+col]; v != 0 {
								diag[(row+roll)%P] = v
								nonzero = true
							}
						}
						if !nonzero {
							continue
						}
						if err := encodeTiled(e.ctx, diag, logP, pt, cbuf); err != nil {
							return err
						}
						for r := 0; r < M; r++ {
							x := bab[(r*KI+c)*NB+i]
							if inner[r] == nil {
								inner[r] = ckks.NewCiphertext(params, 1, lvl)
								if err := eval.Mul(x, pt, inner[r]); err != nil {
									return err
								}
							} else if err := eval.MulThenAdd(x, pt, inner[r]); err != nil {
								return err
							}
							prods++
						}
					}
				}
				if inner[0] == nil {
					continue // no diagonal of this giant step is nonzero
				}
				s := ((shift % slots) + slots) % slots
				for r := 0; r < M; r++ {
					y := inner[r]
					if s != 0 {
						y = ckks.NewCiphertext(params, 1, lvl)
						if err := rotate(eval, inner[r], s, y); err != nil {
							return err
						}
						rots++
					}
					locks[o].Lock()
					if acc[r*KO+o] == nil {
						acc[r*KO+o] = y
					} else {
						err := eval.Add(acc[r*KO+o], y, acc[r*KO+o])
						if err != nil {
							locks[o].Unlock()
							return err
						}
					}
					locks[o].Unlock()
				}
			}
			atomic.AddInt64(&products, prods)
			atomic.AddInt64(&rotations, rots)
			return nil
		})
		if err != nil {
			return err
		}
		dst := unsafe.Slice((*int64)(unsafe.Pointer(out)), M*KO)
		for n, y := range acc {
			if y == nil {
				dst[n] = 0
				continue
			}
			res := ckks.NewCiphertext(params, 1, lvl-1)
			if err := rescale(eval, y, res); err != nil {
				return err
			}
			dst[n] = put(&ctObj{ctx: e.ctx, ct: res})
		}
		cs := unsafe.Slice((*int64)(unsafe.Pointer(counts)), 2)
		cs[0], cs[1] = products, rotations
		return nil
	})
}

// encodeTiled: the P slot values `vals` repeated over all slots, encoded into pt (its level and
// scale) as the encoder does at the sparse dimension log2 P (IFFT of P points, the 2P
// coefficients of the polynomial in X^(N/2P), the sparse NTT that writes all N NTT values),
// without first zeroing the N - 2P coefficients that the sparse NTT overwrites anyway (an
// encoder of more than 53 bits of precision encodes by its own, arbitrary-precision path).
// Bit-identical to Encode with pt.LogDimensions = (0, log2 P) (tests: the Python path encodes
// through Encode).
func encodeTiled(c *ctxObj, vals []float64, logP int, pt *rlwe.Plaintext, buf []complex128) error {
	if c.encoder.Prec() > 53 { // an encoder in arbitrary precision (scales above 2^53): its own path
		full := pt.LogDimensions
		pt.LogDimensions = ring.Dimensions{Rows: 0, Cols: logP}
		err := c.encoder.Encode(vals, pt)
		pt.LogDimensions = full
		return err
	}
	n := len(vals)
	for i, v := range vals {
		buf[i] = complex(v, 0)
	}
	if err := c.encoder.IFFT(buf[:n], logP); err != nil {
		return err
	}
	r := c.params.RingQ().AtLevel(pt.Level())
	q := newQuantiser(r, pt.Scale.Float64(), pt.Value.Coeffs)
	for i, v := range buf[:n] {
		q.put(i, real(v))
		q.put(i+n, imag(v))
	}
	full := pt.LogDimensions
	pt.LogDimensions = ring.Dimensions{Rows: 0, Cols: logP}
	rlwe.NTTSparseAndMontgomery(r, pt.MetaData, pt.Value)
	pt.LogDimensions = full
	return nil
}

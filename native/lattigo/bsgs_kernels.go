package main

// Kernels of the offload matmul (clg_bsgs_eval), written for this package on Lattigo's ring
// types: the baby-step x diagonal products of many (block, giant step) units at once, tiled over
// the coefficients, with 128-bit lazy accumulation.

import (
	"fmt"
	"math/bits"
	"sync"

	"cipherlm/native/lattigo/simd"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

// prodTile is the number of coefficients of one tile of the product kernel: g baby steps x 2
// polynomials x prodTile words stay in the L2 cache while every unit of a batch reads them.
const prodTile = 512

// foldTerms: how many products of reduced operands (< q each, so each < q^2) a 128-bit
// accumulator may hold before its Montgomery reduction needs it below q * 2^64.
func foldTerms(q uint64) int {
	k := (^uint64(0)) / q
	if k > 1<<20 {
		k = 1 << 20
	}
	return int(k)
}

// redc128: (hi * 2^64 + lo) * 2^-64 mod q for hi*2^64 + lo < q * 2^64 (Montgomery; qInv =
// q^-1 mod 2^64, Lattigo's MRedConstant).  The result is reduced, in [0, q).
func redc128(hi, lo, q, qInv uint64) uint64 {
	h, _ := bits.Mul64(lo*qInv, q)
	r := hi - h + q
	if r >= q {
		r -= q
	}
	return r
}

// mulAccTile: out0 = sum_t a0s[t] * ps[t], out1 = sum_t a1s[t] * ps[t] (mod q), coefficient-wise
// over len(out0) coefficients, where the a's are reduced and the ps are reduced and in Montgomery
// form (x 2^64), so that one Montgomery reduction per fold gives the plain sum.  acc: 4 *
// len(out0) words of scratch.  Each product is one 64x64 -> 128-bit multiply added to a 128-bit
// accumulator; a reduction happens every `fold` terms and at the end.
//
// rep 2 or 8: every p holds one value per run of rep coefficients (bsgsDiag with rep 2; rep 8 or
// more, spread to one value per 8): ps[t][c/rep] in place of ps[t][c], each p len(out0)/rep words
// (len(out0) a multiple of rep); rep 1: whole.
func mulAccTile(q, qInv uint64, fold int, a0s, a1s, ps [][]uint64, out0, out1, acc []uint64, rep int) {
	n := len(out0)
	out1 = out1[:n]
	hi0, lo0 := acc[0:n], acc[n:2*n]
	hi1, lo1 := acc[2*n:3*n], acc[3*n:4*n]
	useSIMD := simd.HasAVX512 && q < 1<<60 // simd.MulAcc4's operand bound (reduced operands)
	first := true
	for start := 0; start < len(ps) || first; start += fold {
		end := min(start+fold, len(ps))
		clear(acc[:4*n])
		if rep > 1 {
			mulAccRep(a0s[start:end], ps[start:end], hi0, lo0, rep, useSIMD)
			mulAccRep(a1s[start:end], ps[start:end], hi1, lo1, rep, useSIMD)
		} else {
			mulAccHalf(a0s[start:end], ps[start:end], hi0, lo0, useSIMD)
			mulAccHalf(a1s[start:end], ps[start:end], hi1, lo1, useSIMD)
		}
		for c := 0; c < n; c++ {
			r0 := redc128(hi0[c], lo0[c], q, qInv)
			r1 := redc128(hi1[c], lo1[c], q, qInv)
			if !first {
				if r0 += out0[c]; r0 >= q {
					r0 -= q
				}
				if r1 += out1[c]; r1 >= q {
					r1 -= q
				}
			}
			out0[c], out1[c] = r0, r1
		}
		first = false
	}
}

// mulAccHalf: (hi, lo) += sum_t as[t] * ps[t] as 128-bit sums, four terms per pass over the
// accumulators (eight slices and one accumulator pair: few enough to stay in registers).
func mulAccHalf(as, ps [][]uint64, hi, lo []uint64, useSIMD bool) {
	n := len(hi)
	lo = lo[:n]
	t := 0
	if useSIMD && n%8 == 0 && n > 0 {
		var aa, pp [4]*uint64
		for ; t+4 <= len(ps); t += 4 {
			for k := 0; k < 4; k++ {
				aa[k], pp[k] = &as[t+k][:n][0], &ps[t+k][:n][0]
			}
			simd.MulAcc4(&aa, &pp, &hi[0], &lo[0], n)
		}
	}
	for ; t+4 <= len(ps); t += 4 {
		pa, pb, pc, pd := ps[t][:n], ps[t+1][:n], ps[t+2][:n], ps[t+3][:n]
		xa, xb, xc, xd := as[t][:n], as[t+1][:n], as[t+2][:n], as[t+3][:n]
		for c := 0; c < n; c++ {
			var cy uint64
			h0, l0 := hi[c], lo[c]
			h, l := bits.Mul64(xa[c], pa[c])
			l0, cy = bits.Add64(l0, l, 0)
			h0 += h + cy
			h, l = bits.Mul64(xb[c], pb[c])
			l0, cy = bits.Add64(l0, l, 0)
			h0 += h + cy
			h, l = bits.Mul64(xc[c], pc[c])
			l0, cy = bits.Add64(l0, l, 0)
			h0 += h + cy
			h, l = bits.Mul64(xd[c], pd[c])
			l0, cy = bits.Add64(l0, l, 0)
			h0 += h + cy
			hi[c], lo[c] = h0, l0
		}
	}
	for ; t < len(ps); t++ {
		p, x := ps[t][:n], as[t][:n]
		for c := 0; c < n; c++ {
			var cy uint64
			h, l := bits.Mul64(x[c], p[c])
			lo[c], cy = bits.Add64(lo[c], l, 0)
			hi[c] += h + cy
		}
	}
}

// mulAccRep: mulAccHalf with ps[t][c/rep] in place of ps[t][c], rep 2 or 8 (simd.MulAcc4Rep2 /
// MulAcc4Rep8: four terms per pass; the rest, and everything without AVX-512, in Go).
func mulAccRep(as, ps [][]uint64, hi, lo []uint64, rep int, useSIMD bool) {
	n := len(hi)
	lo = lo[:n]
	t := 0
	if useSIMD && n%8 == 0 && n > 0 {
		var aa, pp [4]*uint64
		for ; t+4 <= len(ps); t += 4 {
			for k := 0; k < 4; k++ {
				aa[k], pp[k] = &as[t+k][:n][0], &ps[t+k][:n/rep][0]
			}
			if rep == 2 {
				simd.MulAcc4Rep2(&aa, &pp, &hi[0], &lo[0], n)
			} else {
				simd.MulAcc4Rep8(&aa, &pp, &hi[0], &lo[0], n)
			}
		}
	}
	shift := bits.TrailingZeros(uint(rep))
	for ; t < len(ps); t++ {
		p, x := ps[t][:n/rep], as[t][:n]
		for c := 0; c < n; c++ {
			var cy uint64
			h, l := bits.Mul64(x[c], p[c>>shift])
			lo[c], cy = bits.Add64(lo[c], l, 0)
			hi[c] += h + cy
		}
	}
}

// recoverInto: deferred in every goroutine of the matmul, so that a panic there becomes that
// goroutine's error (guard only covers the exported function's own goroutine).
func recoverInto(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("internal error in the matmul: %v", r)
	}
}

// parallel runs work(t) for t = 0..w-1 on w goroutines and returns the first error in worker
// order (a panic in a worker becomes its error, recoverInto).
func parallel(w int, work func(t int) error) error {
	errs := make([]error, w)
	var wg sync.WaitGroup
	for t := 0; t < w; t++ {
		wg.Add(1)
		go func(t int) {
			defer wg.Done()
			defer recoverInto(&errs[t])
			errs[t] = work(t)
		}(t)
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// bsgsUnit: giant step i of output block o.
type bsgsUnit struct{ o, i int }

// bsgsDiag: one encoded diagonal (NTT domain, Montgomery form, at the matrix's level).  Stored
// whole (full), or, when every limb's NTT vector is constant on runs of rep consecutive
// positions (rep > 1), as one value per run: vals[l][i] is limb l's residue at positions
// i*rep .. i*rep+rep-1.  A slot vector of period S/T (the diagonals of a packed plan with one
// chunk: the same block in each of the T token lanes) is a polynomial in X^T, m(X) = q(X^T);
// its residue at the root psi^(2 brv(i)+1) of Lattigo's (bit-reversed) NTT order is
// q(psi^(T(2 brv(i)+1))), which only depends on i / T: runs of T equal values, the same pattern
// for every prime (TestPeriodicDiagonalRuns checks it on Lattigo's encoder).  1/T of the words,
// expanded tile by tile into a scratch buffer in the products (bit-identical results).
type bsgsDiag struct {
	full  *rlwe.Plaintext // rep == 1
	rep   int
	vals  [][]uint64 // rep > 1: [limb][N/rep]
	scale rlwe.Scale
}

// runLength: the largest power of two r <= maxRep with every limb of p constant on runs of r.
func runLength(p ring.Poly, maxRep int) int {
	r := 1
	for next := 2; next <= maxRep; next *= 2 {
		for _, x := range p.Coeffs {
			for i := 0; i < len(x); i += next {
				v := x[i]
				for _, y := range x[i+1 : i+next] {
					if y != v {
						return r
					}
				}
			}
		}
		r = next
	}
	return r
}

// newDiag: pt (NTT form) stored compressed when its runs allow (maxRep > 1), else whole, and put in
// Montgomery form (the products skip Lattigo's per-product MForm; a compressed diagonal's values
// only, 1/rep of the work).  (Diagonals of a known period that may be compressed come through
// sparseDiag instead.)
func newDiag(ringQ *ring.Ring, pt *rlwe.Plaintext, maxRep int) *bsgsDiag {
	d := &bsgsDiag{full: pt, rep: 1, scale: pt.Scale}
	r := 1
	if maxRep >= 2 {
		r = runLength(pt.Value, maxRep)
	}
	if r < 2 {
		ringQ.MForm(pt.Value, pt.Value)
		return d
	}
	d.full, d.rep = nil, r
	d.vals = make([][]uint64, len(pt.Value.Coeffs))
	for l, x := range pt.Value.Coeffs {
		s := ringQ.SubRings[l]
		v := make([]uint64, len(x)/r)
		for i := range v {
			v[i] = ring.MForm(x[i*r], s.Modulus, s.BRedConstant)
		}
		d.vals[l] = v
	}
	return d
}

// sparseDiag: the diagonal with slot values v repeated MaxSlots / len(v) times, encoded at scale
// and stored compressed (one value per run of gap = N / (2 len(v))) in Montgomery form, with no
// whole plaintext: Lattigo's sparse encoding (Encoder.Encode with fewer slots: the special IFFT
// of the len(v) values, their fixed-point CRT quantisation as the 2 len(v) coefficients of a
// polynomial in Y = X^gap, its NTT in dimension 2 len(v) with the roots of N, each value standing
// for a run of gap in dimension N) with `quantiser` and without spreading the runs, then the
// Montgomery form.  The same residues as encodeNTT followed by newDiag (TestSparseDiagMatchesEncode).
// buf: scratch, a polynomial at the diagonal's level.
func sparseDiag(ecd *ckks.Encoder, ringQ *ring.Ring, v []complex128, logSlots int, scale rlwe.Scale,
	buf ring.Poly) (*bsgsDiag, error) {
	slots := 1 << logSlots
	n := 2 * slots
	gap := ringQ.N() / n
	if ringQ.Type() != ring.Standard || gap < 2 || len(v) != slots {
		return nil, fmt.Errorf("sparse diagonal of %d values, %d slots, in a ring of degree %d", len(v), slots, ringQ.N())
	}
	z := make([]complex128, slots)
	copy(z, v)
	if err := ecd.IFFT(z, logSlots); err != nil {
		return nil, err
	}
	level := ringQ.Level()
	coeffs := make([][]uint64, level+1)
	for l := range coeffs {
		coeffs[l] = buf.Coeffs[l][:n]
	}
	q := newQuantiser(ringQ, scale.Float64(), coeffs)
	for i, x := range z {
		q.put(i, real(x))
		q.put(i+slots, imag(x))
	}
	d := &bsgsDiag{rep: gap, scale: scale, vals: make([][]uint64, level+1)}
	for l, s := range ringQ.SubRings[:level+1] {
		c := coeffs[l]
		ring.NTTStandard(c, c, n, s.Modulus, s.MRedConstant, s.BRedConstant, s.RootsForward)
		s.MForm(c, c)
		d.vals[l] = append([]uint64(nil), c...)
	}
	return d, nil
}

// words: the 64-bit words the diagonal keeps.
func (d *bsgsDiag) words() int64 {
	if d.rep == 1 {
		return int64(len(d.full.Value.Coeffs) * d.full.Value.N())
	}
	return int64(len(d.vals) * len(d.vals[0]))
}

// limb: coefficients [c0, c1) of limb l (c0 a multiple of rep); a compressed diagonal's are
// expanded into buf (at least c1 - c0 words).
func (d *bsgsDiag) limb(l, c0, c1 int, buf []uint64) []uint64 {
	if d.rep == 1 {
		return d.full.Value.Coeffs[l][c0:c1]
	}
	out := buf[:c1-c0]
	src := d.vals[l][c0/d.rep : (c1+d.rep-1)/d.rep]
	switch d.rep {
	case 2:
		for i, v := range src {
			out[2*i], out[2*i+1] = v, v
		}
	case 4:
		for i, v := range src {
			o := out[4*i : 4*i+4]
			o[0], o[1], o[2], o[3] = v, v, v, v
		}
	default:
		for i, v := range src {
			o := out[i*d.rep : (i+1)*d.rep]
			for j := range o {
				o[j] = v
			}
		}
	}
	return out
}

// spread8: coefficients [c0, c1) of limb l at one value per 8 (rep > 8, c0 and c1 multiples of
// rep) in buf (at least (c1 - c0) / 8 words).
func (d *bsgsDiag) spread8(l, c0, c1 int, buf []uint64) []uint64 {
	k := d.rep / 8
	out := buf[:(c1-c0)/8]
	for i, v := range d.vals[l][c0/d.rep : c1/d.rep] {
		o := out[i*k : (i+1)*k]
		for j := range o {
			o[j] = v
		}
	}
	return out
}

// unitRep: how the product kernel reads a unit's diagonals (mulAccTile's rep): 2 when every one
// is stored in runs of 2, 8 when every one is in runs of 8 or more, else 1 (expanded).
func unitRep(ds []*bsgsDiag) int {
	lo := 0
	for _, d := range ds {
		if d == nil {
			continue
		}
		if lo == 0 || d.rep < lo {
			lo = d.rep
		}
	}
	switch {
	case lo == 2:
		for _, d := range ds {
			if d != nil && d.rep != 2 {
				return 1
			}
		}
		return 2
	case lo >= 8:
		return 8
	}
	return 1
}

// poly: the whole diagonal (a compressed one expanded into tmp, a polynomial at its level).
func (d *bsgsDiag) poly(tmp ring.Poly) ring.Poly {
	if d.rep == 1 {
		return d.full.Value
	}
	for l := range d.vals {
		d.limb(l, 0, tmp.N(), tmp.Coeffs[l])
	}
	return tmp
}

// diagonals: the plaintexts of unit u's inner sum, indexed like the baby steps (input p's baby
// step j at p g + j; nil: a zero diagonal); with one input, fewer than g in the last giant step
// when g does not divide m.
func (b *bsgsObj) diagonals(u bsgsUnit) []*bsgsDiag {
	return b.units[u.o][u.i]
}

// unitDiagonals: block o's per-giant-step diagonal lists (diagonals): with one input, slices of
// pts[o]; with several, input p's diagonals ig .. ig+g-1 at p g .. p g + g - 1, nil-padded.
func (b *bsgsObj) unitDiagonals(o int) [][]*bsgsDiag {
	nGiant := (b.m + b.g - 1) / b.g
	out := make([][]*bsgsDiag, nGiant)
	for i := range out {
		if b.parts == 1 {
			out[i] = b.pts[o][i*b.g : min((i+1)*b.g, b.m)]
			continue
		}
		l := make([]*bsgsDiag, b.parts*b.g)
		for p := 0; p < b.parts; p++ {
			copy(l[p*b.g:], b.pts[o][p*b.m+i*b.g:p*b.m+min((i+1)*b.g, b.m)])
		}
		out[i] = l
	}
	return out
}

// workerShare: worker t's contiguous share of the units (of w workers): a worker's units mostly
// fall in one block (fewer partial sums).
func workerShare(units []bsgsUnit, t, w int) []bsgsUnit {
	return units[t*len(units)/w : (t+1)*len(units)/w]
}

// sumCounts: the workers' operation counts (rotations, products, additions, rescales) summed.
func sumCounts(cnt [][4]int64) (total [4]int64) {
	for _, c := range cnt {
		for k := range total {
			total[k] += c[k]
		}
	}
	return total
}

// bsgsFastPath: the parameters of cipherlm's offload matmul (the products at two primes, the
// giant steps at one prime and one special prime P, plain RNS gadget keys), for which
// bsgsGiantFast applies.
func bsgsFastPath(params ckks.Parameters, b *bsgsObj, galKeys map[int]*rlwe.GaloisKey) bool {
	if b.level != 1 || params.MaxLevelP() != 0 {
		return false
	}
	for _, gk := range galKeys {
		if gk.BaseTwoDecomposition != 0 || gk.LevelP() != 0 || gk.LevelQ() < 0 {
			return false
		}
	}
	return true
}

// bsgsGiantFast: the units' products, rescales and giant steps at level 1 -> 0 with one P prime.
// Per worker, units in batches of bsgsBatch:
//   - products: every unit of the batch at once, tile by tile of prodTile coefficients (the
//     baby steps' tile stays in cache while the batch's diagonals stream past), lazily summed in
//     128 bits and reduced once per inner sum (mulAccTile);
//   - giant step i > 0 of an inner sum (c0, c1) at level 1: c0 is rotated (an automorphism,
//     no key switch) and summed per block at level 1, to be rescaled once per block at the end;
//     c1 is rescaled to level 0, its one RNS digit (centred) is lifted to P, multiplied by the
//     Galois key in QP and rotated there; the block's key-switched part stays in QP (one ModDown
//     per block at the end, as before);
//   - giant step 0: the inner sum is added to the block's level-1 sum.
//
// So a giant step costs 4 one-prime NTTs (c1's rescale 2, its INTT and P's NTT) instead of 7
// (rescaling both halves, then Lattigo's gadget product re-NTTs the q0 digit).  The result per
// block: rescale(level-1 sum) + ModDown(QP sum), at level 0 with the scale of Rescale.
func bsgsGiantFast(eval *ckks.Evaluator, params ckks.Parameters, b *bsgsObj, in *rlwe.Ciphertext, baby []*rlwe.Ciphertext,
	units []bsgsUnit, galKeys map[int]*rlwe.GaloisKey, rotIdx map[int][]uint64, w int) ([]*rlwe.Ciphertext, [4]int64, error) {
	const bsgsBatch = 16
	var total [4]int64
	L := b.level
	ringQ := params.RingQ().AtLevel(L)
	ringQ0 := params.RingQ().AtLevel(L - 1)
	ringQP0 := params.RingQP().AtLevel(L-1, 0)
	sQ0 := ringQ0.SubRings[0]
	sP := params.RingP().AtLevel(0).SubRings[0]
	q0, pMod, bredP := sQ0.Modulus, sP.Modulus, sP.BRedConstant
	N := ringQ.N()

	// the product kernels need reduced operands (< q; the plaintexts are, clg_bsgs_set): Lattigo
	// returns reduced rotations and clg_ct_from_bytes checks its input, but do not rely on it
	for _, ct := range baby {
		for k := 0; k < 2; k++ {
			for l := 0; l <= L; l++ {
				q := ringQ.SubRings[l].Modulus
				for c, v := range ct.Value[k].Coeffs[l] {
					if v >= q {
						ct.Value[k].Coeffs[l][c] = v % q
					}
				}
			}
		}
	}
	accL1 := make([][]*[2]ring.Poly, w)   // [worker][block]: level-1 sums (c0 of every unit, c1 of giant step 0)
	accQP := make([][]*[2]ringqp.Poly, w) // [worker][block]: key-switched c1 parts in QP
	cnt := make([][4]int64, w)
	for t := 0; t < w; t++ {
		accL1[t] = make([]*[2]ring.Poly, b.nBlocks)
		accQP[t] = make([]*[2]ringqp.Poly, b.nBlocks)
	}
	err := parallel(w, func(t int) error {
		share := workerShare(units, t, w)
		if len(share) == 0 {
			return nil
		}
		L1, QP := accL1[t], accQP[t]
		nb := min(bsgsBatch, len(share))
		inner := make([][2]ring.Poly, nb) // written whole by mulAccTile: pooled scratch
		for x := range inner {
			for k := 0; k < 2; k++ {
				var free func()
				inner[x][k], free = scratchPoly(N, L)
				defer free()
			}
		}
		acc := make([]uint64, 4*prodTile)
		a0s := make([][]uint64, 0, len(baby))
		a1s := make([][]uint64, 0, len(baby))
		ps := make([][]uint64, 0, len(baby))
		exp := make([][]uint64, len(baby)) // scratch: compressed diagonals' tiles expanded
		for j := range exp {
			exp[j] = make([]uint64, prodTile)
		}
		r1, freeR1 := scratchPoly(N, 0)
		defer freeR1()
		coefB, dPB := getScratch(N), getScratch(N)
		defer putScratch(coefB)
		defer putScratch(dPB)
		coef, dP := (*coefB)[:N], (*dPB)[:N]
		for s := 0; s < len(share); s += bsgsBatch {
			bu := share[s:min(s+bsgsBatch, len(share))]
			for l := 0; l <= L; l++ {
				sub := ringQ.SubRings[l]
				q, qInv, fold := sub.Modulus, sub.MRedConstant, foldTerms(sub.Modulus)
				for c0 := 0; c0 < N; c0 += prodTile {
					c1 := min(c0+prodTile, N)
					for x, u := range bu {
						a0s, a1s, ps = a0s[:0], a1s[:0], ps[:0]
						// all of the unit's diagonals in runs of 2: read at half rate; all in
						// runs of 8 or more: one value per 8 coefficients (runs longer than 8
						// spread into scratch); else compressed ones expanded into scratch
						rep := unitRep(b.diagonals(u))
						for j, pt := range b.diagonals(u) {
							if pt == nil {
								continue
							}
							a0s = append(a0s, baby[j].Value[0].Coeffs[l][c0:c1])
							a1s = append(a1s, baby[j].Value[1].Coeffs[l][c0:c1])
							switch {
							case rep == 2 || (rep == 8 && pt.rep == 8):
								ps = append(ps, pt.vals[l][c0/rep:c1/rep])
							case rep == 8:
								ps = append(ps, pt.spread8(l, c0, c1, exp[len(ps)]))
							default:
								ps = append(ps, pt.limb(l, c0, c1, exp[len(ps)]))
							}
						}
						mulAccTile(q, qInv, fold, a0s, a1s, ps, inner[x][0].Coeffs[l][c0:c1], inner[x][1].Coeffs[l][c0:c1], acc, rep)
					}
				}
			}
			for x, u := range bu {
				np := int64(0)
				for _, pt := range b.diagonals(u) {
					if pt != nil {
						np++
					}
				}
				cnt[t][1] += np
				cnt[t][2] += np - 1
				cnt[t][3]++
				o := u.o
				if L1[o] == nil {
					L1[o] = &[2]ring.Poly{ringQ.NewPoly(), ringQ.NewPoly()}
				} else {
					cnt[t][2]++
				}
				if u.i == 0 {
					ringQ.Add(L1[o][0], inner[x][0], L1[o][0])
					ringQ.Add(L1[o][1], inner[x][1], L1[o][1])
					continue
				}
				idx := rotIdx[u.i]
				// c0: rotated at level 1 (no key switch), rescaled with the block's sum
				for l, sub := range ringQ.SubRings[:L+1] {
					permAdd(sub.Modulus, inner[x][0].Coeffs[l], idx, L1[o][0].Coeffs[l])
				}
				// c1: rescaled, its one digit lifted to P (centred, as Lattigo's decomposer),
				// times the Galois key in QP, rotated there
				divRoundByLastModulusNTT(ringQ, inner[x][1], r1)
				nttOf(sQ0).Backward(r1.Coeffs[0], coef)
				liftCentred(coef, dP, q0, pMod, bredP)
				nttOf(sP).Forward(dP, dP)
				el := galKeys[u.i].GadgetCiphertext.Value[0][0]
				if QP[o] == nil {
					QP[o] = &[2]ringqp.Poly{ringQP0.NewPoly(), ringQP0.NewPoly()}
				}
				for k := 0; k < 2; k++ {
					mulPermAdd(q0, sQ0.MRedConstant, r1.Coeffs[0], el[k].Q.Coeffs[0], idx, QP[o][k].Q.Coeffs[0])
					mulPermAdd(pMod, sP.MRedConstant, dP, el[k].P.Coeffs[0], idx, QP[o][k].P.Coeffs[0])
				}
				cnt[t][0]++
			}
		}
		return nil
	})
	if err != nil {
		return nil, total, err
	}
	total = sumCounts(cnt)
	// merge the workers' partials; per block one rescale (level-1 sum) and one ModDown (QP sum)
	scale := in.Scale.Mul(b.scale).Div(rlwe.NewScale(ringQ.SubRings[L].Modulus))
	sums := make([]*rlwe.Ciphertext, b.nBlocks)
	tmpQ0 := ringQ0.NewPoly()
	for o := 0; o < b.nBlocks; o++ {
		var l1 *[2]ring.Poly
		var qp *[2]ringqp.Poly
		for t := 0; t < w; t++ {
			if a := accL1[t][o]; a != nil {
				if l1 == nil {
					l1 = a
				} else {
					ringQ.Add(l1[0], a[0], l1[0])
					ringQ.Add(l1[1], a[1], l1[1])
					total[2]++
				}
			}
			if a := accQP[t][o]; a != nil {
				if qp == nil {
					qp = a
				} else {
					ringQP0.Add(qp[0], a[0], qp[0])
					ringQP0.Add(qp[1], a[1], qp[1])
				}
			}
		}
		if l1 == nil {
			continue
		}
		y := ckks.NewCiphertext(params, 1, L-1)
		*y.MetaData = *in.MetaData
		y.Scale = scale
		for k := 0; k < 2; k++ {
			divRoundByLastModulusNTT(ringQ, l1[k], y.Value[k])
			if qp != nil {
				modDownQPtoQNTT(params.Parameters, eval.BasisExtender, L-1, 0, qp[k].Q, qp[k].P, tmpQ0)
				ringQ0.Add(y.Value[k], tmpQ0, y.Value[k])
			}
		}
		sums[o] = y
	}
	return sums, total, nil
}

// liftCentred: dP = the residues mod p of the centred representatives of coef mod q (q's one
// RNS digit lifted to the special prime, as Lattigo's decomposer does).
func liftCentred(coef, dP []uint64, q, p uint64, bredP [2]uint64) {
	half := q >> 1
	for j, v := range coef {
		if v >= half {
			tp := ring.BRedAdd(q-v, p, bredP)
			if tp != 0 {
				tp = p - tp
			}
			dP[j] = tp
		} else {
			dP[j] = ring.BRedAdd(v, p, bredP)
		}
	}
}

// permAdd: acc[j] = acc[j] + a[idx[j]] mod q (Lattigo's AutomorphismNTTWithIndex then Add, in one
// pass; reduced inputs, reduced output).
func permAdd(q uint64, a, idx, acc []uint64) {
	acc = acc[:len(idx)]
	for j, i := range idx {
		v := acc[j] + a[i]
		if v >= q {
			v -= q
		}
		acc[j] = v
	}
}

// mulPermAdd: acc[j] = acc[j] + a[idx[j]] * b[idx[j]] * 2^-64 mod q (Lattigo's
// MulCoeffsMontgomery, AutomorphismNTTWithIndex and Add in one pass: the same residues).
func mulPermAdd(q, qInv uint64, a, b, idx, acc []uint64) {
	acc = acc[:len(idx)]
	for j, i := range idx {
		v := acc[j] + ring.MRed(a[i], b[i], q, qInv)
		if v >= q {
			v -= q
		}
		acc[j] = v
	}
}

// bsgsGiantGeneric: the units' products, rescales and giant steps for any parameters (the
// path before the fast one; used when bsgsFastPath does not hold).  Contiguous shares: a
// worker's units mostly fall in one block (fewer partial sums).  Giant steps are key-switched
// lazily (double hoisting, as Lattigo's lintrans): each rescaled inner sum's c1 goes through the
// gadget product without the ModDown, P*c0 is added, the automorphism is applied in QP, and the
// block's sum stays in QP: one ModDown per block and worker instead of one per giant step.
func bsgsGiantGeneric(eval *ckks.Evaluator, params ckks.Parameters, b *bsgsObj, baby []*rlwe.Ciphertext,
	units []bsgsUnit, galKeys map[int]*rlwe.GaloisKey, rotIdx map[int][]uint64, w int) ([]*rlwe.Ciphertext, [4]int64, error) {
	ringQ := params.RingQ().AtLevel(b.level)
	levelP := params.MaxLevelP()
	ringQP0 := params.RingQP().AtLevel(b.level-1, levelP)
	ringQ0 := ringQP0.RingQ
	bigP := params.RingP().AtLevel(levelP).Modulus()
	var total [4]int64
	accQP := make([][][2]ringqp.Poly, w) // [worker][block]
	have := make([][]bool, w)            // [worker][block]: accQP allocated
	meta := make([]*rlwe.MetaData, b.nBlocks)
	var metaMu sync.Mutex
	cnt := make([][4]int64, w)
	for t := 0; t < w; t++ {
		accQP[t] = make([][2]ringqp.Poly, b.nBlocks)
		have[t] = make([]bool, b.nBlocks)
	}
	err := parallel(w, func(t int) error {
		share := workerShare(units, t, w)
		cQP := &rlwe.Element[ringqp.Poly]{Value: []ringqp.Poly{ringQP0.NewPoly(), ringQP0.NewPoly()}}
		cQP.MetaData = &rlwe.MetaData{}
		cQP.IsNTT = true
		tmpQP := ringQP0.NewPoly()
		tmpQ := ringQ0.NewPoly()
		r := ckks.NewCiphertext(params, 1, b.level-1)
		tmpPt := ringQ.NewPoly()
		for _, u := range share {
			var inner *rlwe.Ciphertext
			for j, d := range b.diagonals(u) {
				if d == nil {
					continue
				}
				pv := d.poly(tmpPt)
				// pt is in Montgomery form (clg_bsgs_set): one Montgomery product per polynomial
				if inner == nil {
					inner = ckks.NewCiphertext(params, 1, b.level)
					inner.Scale = baby[j].Scale.Mul(d.scale)
					ringQ.MulCoeffsMontgomery(baby[j].Value[0], pv, inner.Value[0])
					ringQ.MulCoeffsMontgomery(baby[j].Value[1], pv, inner.Value[1])
				} else {
					ringQ.MulCoeffsMontgomeryThenAdd(baby[j].Value[0], pv, inner.Value[0])
					ringQ.MulCoeffsMontgomeryThenAdd(baby[j].Value[1], pv, inner.Value[1])
					cnt[t][2]++
				}
				cnt[t][1]++
			}
			if err := rescale(eval, inner, r); err != nil {
				return err
			}
			cnt[t][3]++
			acc := &accQP[t][u.o]
			if !have[t][u.o] {
				have[t][u.o] = true
				acc[0], acc[1] = ringQP0.NewPoly(), ringQP0.NewPoly()
				metaMu.Lock()
				if meta[u.o] == nil {
					m := *r.MetaData
					meta[u.o] = &m
				}
				metaMu.Unlock()
			} else {
				cnt[t][2]++
			}
			if u.i == 0 {
				// P * (c0, c1) in QP (zero mod P)
				for k := 0; k < 2; k++ {
					ringQ0.MulScalarBigint(r.Value[k], bigP, tmpQ)
					ringQ0.Add(acc[k].Q, tmpQ, acc[k].Q)
				}
				continue
			}
			// (d0, d1) = gadget product of c1 with the key, in QP; + P c0; then the automorphism
			if err := eval.GadgetProductLazy(b.level-1, r.Value[1], &galKeys[u.i].GadgetCiphertext, cQP); err != nil {
				return err
			}
			ringQ0.MulScalarBigint(r.Value[0], bigP, tmpQ)
			ringQ0.Add(cQP.Value[0].Q, tmpQ, cQP.Value[0].Q)
			for k := 0; k < 2; k++ {
				ringQP0.AutomorphismNTTWithIndex(cQP.Value[k], rotIdx[u.i], tmpQP)
				ringQP0.Add(acc[k], tmpQP, acc[k])
			}
			cnt[t][0]++
		}
		return nil
	})
	if err != nil {
		return nil, total, err
	}
	total = sumCounts(cnt)
	// merge the workers' partials in QP, one ModDown per block
	sums := make([]*rlwe.Ciphertext, b.nBlocks)
	for o := 0; o < b.nBlocks; o++ {
		var acc *[2]ringqp.Poly
		for t := 0; t < w; t++ {
			if !have[t][o] {
				continue
			}
			a := &accQP[t][o]
			if acc == nil {
				acc = a
			} else {
				ringQP0.Add(acc[0], a[0], acc[0])
				ringQP0.Add(acc[1], a[1], acc[1])
				total[2]++
			}
		}
		if acc == nil {
			continue
		}
		y := ckks.NewCiphertext(params, 1, b.level-1)
		*y.MetaData = *meta[o]
		modDownQPtoQNTT(params.Parameters, eval.BasisExtender, b.level-1, levelP, acc[0].Q, acc[0].P, y.Value[0])
		modDownQPtoQNTT(params.Parameters, eval.BasisExtender, b.level-1, levelP, acc[1].Q, acc[1].P, y.Value[1])
		sums[o] = y
	}
	return sums, total, nil
}

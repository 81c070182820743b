package main

// Lattigo operations re-expressed over the AVX-512 NTTs of ntt_avx512.c, for the hot paths of
// this library's kernels.  Lattigo (v6.2.0) routes every NTT through an unexported field of
// ring.SubRing whose concrete type its own code switches on (SubRing.Type panics on any
// other), so its transform cannot be replaced in place; these functions do the same arithmetic
// as Lattigo's, step for step, with the transforms swapped:
//   modDownQPtoQNTT          ring.BasisExtender.ModDownQPtoQNTT
//   divRoundByLastModulusNTT ring.Ring.DivRoundByLastModulusNTT; rescale: ckks.Evaluator.Rescale
//   decomposeNTT             rlwe.Evaluator.DecomposeNTT
//   automorphismHoisted      rlwe.Evaluator.AutomorphismHoisted; rotateHoisted, rotate:
//                            ckks.Evaluator.RotateHoisted, Rotate
//   relinearize, mulRelin    ckks.Evaluator.Relinearize, MulRelin
//   encodeNTT                ckks.Encoder.Encode (all slots)
//   fastEvaluator            the above behind Lattigo's polynomial evaluator
// Every step ends in a full modular reduction, so the outputs are the same residues as
// Lattigo's (ntt_simd_test.go checks each bit for bit); the lazy transforms' output ranges
// ([0, 4q) and [0, 2q), inside Lattigo's [0, 6q - 2] and [0, 2q - 1]) are within what the
// following step accepts.
//
// Where the AVX-512 code cannot run (simdNTTAvailable false, a modulus of 62 bits or more, a
// transform that failed its check against Lattigo's), each transform falls back to
// Lattigo's own, so these functions are always correct to call.

import (
	"encoding/binary"
	"math/bits"
	"sync"

	"github.com/tuneinsight/lattigo/v6/circuits/ckks/polynomial"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

var (
	simdOnce sync.Once
	simdOK   bool
	// nttKey -> *simdNTT, or nil where Lattigo's transform stays.  Keyed by content, not by
	// *ring.SubRing: every context builds its own rings, and a server makes a context per
	// session; the tables of one prime (64 N bytes) are built and checked once per process.
	simdByPrime sync.Map
	// modDownKey -> Montgomery constants of ModDown (by content too)
	modDownConsts sync.Map
)

// nttKey: what an NTT's tables depend on (the degree, the prime, Lattigo's first roots).
type nttKey struct {
	n         int
	q, fw, bw uint64
}

// simdFor: the checked AVX-512 transform of s's prime, built once per process, or nil.
func simdFor(s *ring.SubRing) *simdNTT {
	if !simdAvailableOnce() || s.Type() != ring.Standard || s.N < 16 || s.Modulus>>62 != 0 || s.NTTTable == nil || len(s.RootsForward) < s.N ||
		len(s.RootsBackward) < s.N {
		return nil
	}
	key := nttKey{s.N, s.Modulus, s.RootsForward[1], s.RootsBackward[1]}
	if v, ok := simdByPrime.Load(key); ok {
		t, _ := v.(*simdNTT)
		return t
	}
	t := newSIMDNTT(s)
	if !sameTransform(ring.NewNumberTheoreticTransformerStandard(s, s.N), t, s.N, s.Modulus) {
		t = nil
	}
	v, _ := simdByPrime.LoadOrStore(key, t)
	t, _ = v.(*simdNTT)
	return t
}

// nttOf: the transform of s to use: the checked AVX-512 one, or Lattigo's own (values in the
// ranges of ring.NumberTheoreticTransformer either way).
func nttOf(s *ring.SubRing) ring.NumberTheoreticTransformer {
	if t := simdFor(s); t != nil {
		return t
	}
	return lattigoNTT{s}
}

// lattigoNTT: s's own transform through its exported methods (pointer-shaped: no allocation
// when it is returned as an interface on every call, as nttOf does)
type lattigoNTT struct{ s *ring.SubRing }

func (l lattigoNTT) Forward(p1, p2 []uint64)      { l.s.NTT(p1, p2) }
func (l lattigoNTT) ForwardLazy(p1, p2 []uint64)  { l.s.NTTLazy(p1, p2) }
func (l lattigoNTT) Backward(p1, p2 []uint64)     { l.s.INTT(p1, p2) }
func (l lattigoNTT) BackwardLazy(p1, p2 []uint64) { l.s.INTTLazy(p1, p2) }

// scratch: reusable coefficient vectors of one ring degree
var scratchPools sync.Map // N -> *sync.Pool of *[]uint64

func getScratch(n int) *[]uint64 {
	v, _ := scratchPools.LoadOrStore(n, &sync.Pool{New: func() any { b := make([]uint64, n); return &b }})
	return v.(*sync.Pool).Get().(*[]uint64)
}

func putScratch(b *[]uint64) {
	v, _ := scratchPools.Load(len(*b))
	v.(*sync.Pool).Put(b)
}

// scratchPoly: a polynomial of level+1 scratch vectors, and its release.
func scratchPoly(n, level int) (ring.Poly, func()) {
	bs := make([]*[]uint64, level+1)
	p := ring.Poly{Coeffs: make([][]uint64, level+1)}
	for i := range bs {
		bs[i] = getScratch(n)
		p.Coeffs[i] = *bs[i]
	}
	return p, func() {
		for _, b := range bs {
			putScratch(b)
		}
	}
}

// scratchCiphertext: a degree-1 ciphertext at level whose polynomials come from the scratch
// pools (contents undefined; the metadata of ckks.NewCiphertext), and the func that returns
// them: for ciphertexts that live only inside one native call (the baby steps), so that each
// request does not allocate and zero them afresh.
func scratchCiphertext(params ckks.Parameters, level int) (*rlwe.Ciphertext, func()) {
	p0, free0 := scratchPoly(params.N(), level)
	p1, free1 := scratchPoly(params.N(), level)
	ct := &rlwe.Ciphertext{Element: rlwe.Element[ring.Poly]{Value: []ring.Poly{p0, p1}, MetaData: &rlwe.MetaData{}}}
	ct.IsNTT = true
	ct.IsBatched = true
	ct.Scale = params.DefaultScale()
	ct.LogDimensions = params.LogMaxDimensions()
	return ct, func() { free0(); free1() }
}

type modDownKey struct {
	levelP int
	moduli string // the Q primes, then the P primes up to levelP, as bytes
}

// modDownConstants: for each Q prime q_i, (P_0 ... P_levelP)^-1 mod q_i in Montgomery form,
// as ring.NewBasisExtender computes them (genmodDownConstants).
func modDownConstants(ringQ, ringP *ring.Ring, levelP int) []uint64 {
	ids := make([]byte, 0, 8*(len(ringQ.SubRings)+levelP+1))
	for _, s := range ringQ.SubRings {
		ids = binary.LittleEndian.AppendUint64(ids, s.Modulus)
	}
	for _, s := range ringP.SubRings[:levelP+1] {
		ids = binary.LittleEndian.AppendUint64(ids, s.Modulus)
	}
	key := modDownKey{levelP, string(ids)}
	if v, ok := modDownConsts.Load(key); ok {
		return v.([]uint64)
	}
	c := make([]uint64, len(ringQ.SubRings))
	for i, sq := range ringQ.SubRings {
		qi := sq.Modulus
		for j := 0; j <= levelP; j++ {
			inv := ring.MForm(ring.ModExp(ringP.SubRings[j].Modulus, qi-2, qi), qi, sq.BRedConstant)
			if j == 0 {
				c[i] = inv
			} else {
				c[i] = ring.MRed(inv, c[i], qi, sq.MRedConstant)
			}
		}
	}
	modDownConsts.Store(key, c)
	return c
}

// modDownQPtoQNTT: p2Q = round(p1 / P) mod Q for p1 = (p1Q, p1P) in the NTT domain
// (ring.BasisExtender.ModDownQPtoQNTT).  be is the evaluator's basis extender (ModUpPtoQ,
// Lattigo's exact basis extension, has no transform in it).
func modDownQPtoQNTT(params rlwe.Parameters, be *ring.BasisExtender, levelQ, levelP int, p1Q, p1P, p2Q ring.Poly) {
	ringQ, ringP := params.RingQ().AtLevel(levelQ), params.RingP().AtLevel(levelP)
	n := ringQ.N()
	buffP, freeP := scratchPoly(n, levelP)
	defer freeP()
	buffQ, freeQ := scratchPoly(n, levelQ)
	defer freeQ()
	for i, s := range ringP.SubRings[:levelP+1] {
		nttOf(s).BackwardLazy(p1P.Coeffs[i], buffP.Coeffs[i])
	}
	if levelP == 0 {
		modUpOnePrime(ringP.SubRings[0], ringQ, buffP.Coeffs[0], buffQ)
	} else {
		be.ModUpPtoQ(levelP, levelQ, buffP, buffQ)
	}
	c := modDownConstants(params.RingQ(), params.RingP(), levelP)
	for i, s := range ringQ.SubRings[:levelQ+1] {
		nttOf(s).ForwardLazy(buffQ.Coeffs[i], buffQ.Coeffs[i])
		s.SubThenMulScalarMontgomeryTwoModulus(buffQ.Coeffs[i], p1Q.Coeffs[i], s.Modulus-c[i], p2Q.Coeffs[i])
	}
}

// modUpOnePrime: ring.BasisExtender.ModUpPtoQ for one prime P: x (< 2P, the lazy inverse
// transform's range) -> y = (x + floor(P / 2)) mod P -> c = y - v P - floor(P / 2) (signed,
// |c| < P), c in every prime of ringQ, fully reduced (the residues of Lattigo's, whose lazy
// outputs the next steps reduce).  Lattigo's ModUpExact takes v = uint64(float64(y) /
// float64(P)), 1 only where float64(y) rounds to float64(P) (y within ~2^-53 P of P): here a
// threshold on y, found once per call.  Replaces the general basis extension (reconstructRNS /
// multSum, 128-bit sums) by one Barrett reduction per prime: c + M_j, M_j the multiple of q_j
// just above P, is non-negative and below 2^63.
func modUpOnePrime(sp *ring.SubRing, ringQ *ring.Ring, x []uint64, out ring.Poly) {
	P := sp.Modulus
	half := P >> 1
	pf := float64(P)
	lo, hi := P-min(P, 1<<16), P // the smallest y < P with uint64(float64(y) / pf) == 1, or P
	for lo < hi {
		mid := lo + (hi-lo)/2
		if uint64(float64(mid)/pf) >= 1 {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	thr := lo
	b := getScratch(len(x))
	defer putScratch(b)
	c := (*b)[:len(x)]
	for i, v := range x {
		y := v + half // < 2.5 P
		y -= P & uint64(int64(P-1-y)>>63)
		y -= P & uint64(int64(P-1-y)>>63)
		y -= P & uint64(int64(thr-1-y)>>63) // v P
		c[i] = y - half                     // c mod 2^64
	}
	for j, s := range ringQ.SubRings[:ringQ.Level()+1] {
		q, brc := s.Modulus, s.BRedConstant
		m := (P/q + 1) * q
		dst := out.Coeffs[j][:len(x)]
		for i, v := range c {
			dst[i] = ring.BRedAdd(v+m, q, brc)
		}
	}
}

// divRoundByLastModulusNTT: p1 = round(p0 / q_level) at level - 1, p0 in the NTT domain
// (ring.Ring.DivRoundByLastModulusNTT; r at p0's level).
func divRoundByLastModulusNTT(r *ring.Ring, p0, p1 ring.Poly) {
	level := r.Level()
	n := r.N()
	b0, b1 := getScratch(n), getScratch(n)
	defer putScratch(b0)
	defer putScratch(b1)
	buff0, buff1 := *b0, *b1
	last := r.SubRings[level]
	nttOf(last).BackwardLazy(p0.Coeffs[level], buff0)
	pHalf := (last.Modulus - 1) >> 1 // centre by (p - 1) / 2
	last.AddScalar(buff0, pHalf, buff0)
	for i, s := range r.SubRings[:level] {
		s.AddScalarLazy(buff0, s.Modulus-ring.BRedAdd(pHalf, s.Modulus, s.BRedConstant), buff1)
		nttOf(s).ForwardLazy(buff1, buff1)
		s.SubThenMulScalarMontgomeryTwoModulus(buff1, p0.Coeffs[i], r.RescaleConstants[level-1][i], p1.Coeffs[i])
	}
}

// rotateHoisted: ckks.Evaluator.RotateHoisted (one decomposition of ctIn's c1, then per
// rotation the hoisted gadget product, the ModDown, the automorphism), with the ModDowns on
// the AVX-512 transforms.  out[k] must exist for every k in rotations (degree 1).
func rotateHoisted(eval *ckks.Evaluator, ctIn *rlwe.Ciphertext, rotations []int, out map[int]*rlwe.Ciphertext) error {
	if !simdAvailableOnce() || !ctIn.IsNTT {
		return eval.RotateHoisted(ctIn, rotations, out)
	}
	params := eval.GetRLWEParameters()
	decomp := decompose(eval, ctIn.Level(), ctIn.Value[1])
	for _, k := range rotations {
		if err := automorphismHoisted(eval, ctIn.Level(), ctIn, decomp, params.GaloisElement(k), out[k]); err != nil {
			return err
		}
	}
	return nil
}

// simdAvailableOnce: simdNTTAvailable, read once per process.
func simdAvailableOnce() bool {
	simdOnce.Do(func() { simdOK = simdNTTAvailable() })
	return simdOK
}

// keySwitchHoisted: the key switch of a decomposed polynomial with a gadget ciphertext,
// (t0, t1) = ModDown(GadgetProductHoistedLazy(decomp, key)) at level (the gadget product in QP
// by gadgetProductHoisted where it applies, else Lattigo's; our ModDown); free releases t0 and t1.
func keySwitchHoisted(eval *ckks.Evaluator, level int, decomp []ringqp.Poly, key *rlwe.GadgetCiphertext) (t0, t1 ring.Poly, free func(), err error) {
	params := eval.GetRLWEParameters()
	levelP := key.LevelP()
	// the QP product in pooled scratch (both gadget products write every coefficient): a fresh
	// element per rotation cost the allocator and its zeroing ~4% of the offload matmul
	ctQP := &rlwe.Element[ringqp.Poly]{Value: make([]ringqp.Poly, 2), MetaData: &rlwe.MetaData{}}
	ctQP.IsNTT = true
	var frees []func()
	for k := range ctQP.Value {
		q, fq := scratchPoly(params.N(), level)
		p, fp := scratchPoly(params.N(), levelP)
		ctQP.Value[k] = ringqp.Poly{Q: q, P: p}
		frees = append(frees, fq, fp)
	}
	defer func() {
		for _, f := range frees {
			f()
		}
	}()
	if !gadgetProductHoisted(*params, level, decomp, key, ctQP) {
		if err = eval.GadgetProductHoistedLazy(level, decomp, key, ctQP); err != nil {
			return
		}
	}
	t0, free0 := scratchPoly(params.N(), level)
	t1, free1 := scratchPoly(params.N(), level)
	modDownQPtoQNTT(*params, eval.BasisExtender, level, levelP, ctQP.Value[0].Q, ctQP.Value[0].P, t0)
	modDownQPtoQNTT(*params, eval.BasisExtender, level, levelP, ctQP.Value[1].Q, ctQP.Value[1].P, t1)
	return t0, t1, func() { free0(); free1() }, nil
}

// automorphismHoisted: rlwe.Evaluator.AutomorphismHoisted for an NTT-domain ciphertext.
func automorphismHoisted(eval *ckks.Evaluator, level int, ctIn *rlwe.Ciphertext, decomp []ringqp.Poly, galEl uint64, opOut *rlwe.Ciphertext) error {
	if galEl == 1 {
		if ctIn != opOut {
			opOut.Copy(ctIn)
		}
		return nil
	}
	evk, err := eval.CheckAndGetGaloisKey(galEl)
	if err != nil {
		return err
	}
	params := eval.GetRLWEParameters()
	ringQ := params.RingQ().AtLevel(level)
	t0, t1, free, err := keySwitchHoisted(eval, level, decomp, &evk.GadgetCiphertext)
	if err != nil {
		return err
	}
	defer free()
	ringQ.Add(t0, ctIn.Value[0], t0)
	idx := eval.AutomorphismIndex(galEl) // precomputed by the evaluator for its Galois keys
	if idx == nil {
		var err error
		if idx, err = ring.AutomorphismNTTIndex(ringQ.N(), ringQ.NthRoot(), galEl); err != nil {
			return err
		}
	}
	opOut.Resize(opOut.Degree(), level)
	ringQ.AutomorphismNTTWithIndex(t0, idx, opOut.Value[0])
	ringQ.AutomorphismNTTWithIndex(t1, idx, opOut.Value[1])
	*opOut.MetaData = *ctIn.MetaData
	return nil
}

// rescale: ckks.Evaluator.Rescale (divide by the last prime, one level) with the transforms
// above; other settings (several primes per rescale, no AVX-512) go to Lattigo's.
func rescale(eval *ckks.Evaluator, op0, opOut *rlwe.Ciphertext) error {
	params := eval.GetParameters()
	if !simdAvailableOnce() || params.LevelsConsumedPerRescaling() != 1 || op0.MetaData == nil ||
		opOut.MetaData == nil || !op0.IsNTT || op0.Level() < 1 {
		return eval.Rescale(op0, opOut)
	}
	level := op0.Level()
	if op0 != opOut {
		opOut.Resize(op0.Degree(), level-1)
	}
	*opOut.MetaData = *op0.MetaData
	ringQ := params.RingQ().AtLevel(level)
	opOut.Scale = opOut.Scale.Div(rlwe.NewScale(ringQ.SubRings[level].Modulus))
	for i := range opOut.Value {
		divRoundByLastModulusNTT(ringQ, op0.Value[i], opOut.Value[i])
	}
	if op0 == opOut {
		opOut.Resize(op0.Degree(), level-1)
	}
	return nil
}

// decompose: the RNS decomposition of c (NTT domain, at level) that a hoisted key switch uses
// (rlwe.Evaluator.DecomposeNTT, Lattigo's transforms).
func decompose(eval *ckks.Evaluator, level int, c ring.Poly) []ringqp.Poly {
	params := eval.GetRLWEParameters()
	levelP := params.MaxLevelP()
	decomp := make([]ringqp.Poly, params.BaseRNSDecompositionVectorSize(level, levelP))
	for i := range decomp {
		decomp[i] = ringqp.NewPoly(params.N(), level, levelP)
	}
	decomposeNTT(eval, level, levelP, levelP+1, c, decomp)
	return decomp
}

// decomposeNTT: rlwe.Evaluator.DecomposeNTT for c2 in the NTT domain (its INTT, then per digit
// Lattigo's exact DecomposeAndSplit and the NTTs of the digit into the other primes and P).
func decomposeNTT(eval *ckks.Evaluator, levelQ, levelP, nbPi int, c2 ring.Poly, decompQP []ringqp.Poly) {
	params := eval.GetRLWEParameters()
	ringQ := params.RingQ().AtLevel(levelQ)
	ringP := params.RingP().AtLevel(levelP)
	inv, free := scratchPoly(params.N(), levelQ)
	defer free()
	for x, s := range ringQ.SubRings[:levelQ+1] {
		nttOf(s).Backward(c2.Coeffs[x], inv.Coeffs[x])
	}
	for i := range decompQP[:params.BaseRNSDecompositionVectorSize(levelQ, levelP)] {
		eval.Decomposer.DecomposeAndSplit(levelQ, levelP, nbPi, i, inv, decompQP[i].Q, decompQP[i].P)
		own0, own1 := i*nbPi, i*nbPi+nbPi
		for x, s := range ringQ.SubRings[:levelQ+1] {
			if own0 <= x && x < own1 {
				copy(decompQP[i].Q.Coeffs[x], c2.Coeffs[x])
			} else {
				nttOf(s).Forward(decompQP[i].Q.Coeffs[x], decompQP[i].Q.Coeffs[x])
			}
		}
		for x, s := range ringP.SubRings[:levelP+1] {
			nttOf(s).Forward(decompQP[i].P.Coeffs[x], decompQP[i].P.Coeffs[x])
		}
	}
}

// rotate: ckks.Evaluator.Rotate of a degree-1 NTT ciphertext, as a hoisted rotation of one step
// (the same decomposition, key switch and automorphism; tests: bit-identical).
func rotate(eval *ckks.Evaluator, ctIn *rlwe.Ciphertext, k int, opOut *rlwe.Ciphertext) error {
	if !simdAvailableOnce() || !ctIn.IsNTT || ctIn.Degree() != 1 {
		return eval.Rotate(ctIn, k, opOut)
	}
	params := eval.GetRLWEParameters()
	galEl := params.GaloisElement(k)
	if galEl == 1 {
		if ctIn != opOut {
			opOut.Copy(ctIn)
		}
		return nil
	}
	if _, err := eval.CheckAndGetGaloisKey(galEl); err != nil {
		return eval.Rotate(ctIn, k, opOut) // Lattigo's error message
	}
	return automorphismHoisted(eval, ctIn.Level(), ctIn, decompose(eval, ctIn.Level(), ctIn.Value[1]), galEl, opOut)
}

// relinearize: ckks.Evaluator.Relinearize of a degree-2 NTT ciphertext (c2 key-switched with the
// relinearisation key, ModDown on the AVX-512 transforms; tests: bit-identical).
func relinearize(eval *ckks.Evaluator, ctIn, opOut *rlwe.Ciphertext) error {
	if !simdAvailableOnce() || !ctIn.IsNTT || ctIn.Degree() != 2 {
		return eval.Relinearize(ctIn, opOut)
	}
	rlk, err := eval.CheckAndGetRelinearizationKey()
	if err != nil {
		return eval.Relinearize(ctIn, opOut)
	}
	params := eval.GetRLWEParameters()
	level := min(ctIn.Level(), opOut.Level())
	ringQ := params.RingQ().AtLevel(level)
	t0, t1, free, err := keySwitchHoisted(eval, level, decompose(eval, level, ctIn.Value[2]), &rlk.GadgetCiphertext)
	if err != nil {
		return err
	}
	defer free()
	opOut.Resize(1, level)
	ringQ.Add(ctIn.Value[0], t0, opOut.Value[0])
	ringQ.Add(ctIn.Value[1], t1, opOut.Value[1])
	*opOut.MetaData = *ctIn.MetaData
	return nil
}

// mulRelin: ckks.Evaluator.MulRelin of two ciphertexts (x * y, relinearised, no rescale) into
// opOut, at the lowest of the three levels, as Mul then relinearize (tests: bit-identical).
func mulRelin(eval *ckks.Evaluator, x, y, opOut *rlwe.Ciphertext) error {
	if !simdAvailableOnce() || x.Degree() != 1 || y.Degree() != 1 || !x.IsNTT || !y.IsNTT {
		return eval.MulRelin(x, y, opOut)
	}
	prod := ckks.NewCiphertext(*eval.GetParameters(), 2, min(x.Level(), y.Level(), opOut.Level()))
	if err := eval.Mul(x, y, prod); err != nil {
		return err
	}
	return relinearize(eval, prod, opOut)
}

// encodeNTT: ckks.Encoder.Encode of slot values into a batched NTT-domain plaintext with all
// the ring's slots, with the NTT on the AVX-512 transforms: Lattigo's own embedding (FFT,
// fixed-point CRT) into the coefficient domain, then the NTT and, if the plaintext is in
// Montgomery form, MForm of every prime (what rlwe.NTTSparseAndMontgomery does with all
// slots; tests: bit-identical).  Fewer slots go to Lattigo's encoder: its sparse NTT is
// already short, and its coefficient-domain spreading of a sparse plaintext does not clear
// every coefficient between the spread ones (v6.2.0), so it cannot be the input here.
func encodeNTT(ecd *ckks.Encoder, values any, pt *rlwe.Plaintext) error {
	params := ecd.GetRLWEParameters()
	if !simdAvailableOnce() || !pt.IsBatched || !pt.IsNTT || 1<<pt.LogDimensions.Cols != int(params.RingQ().NthRoot()>>2) {
		return ecd.Encode(values, pt)
	}
	ringQ := params.RingQ().AtLevel(pt.Level())
	if ringQ.Type() == ring.Standard && embedFullSlots(ecd, ringQ, values, pt) {
		goto ntt
	}
	{
		md := *pt.MetaData
		md.IsNTT, md.IsMontgomery = false, false
		if err := ecd.Embed(values, &md, pt.Value); err != nil {
			return err
		}
	}
ntt:
	for i, s := range ringQ.SubRings[:pt.Level()+1] {
		nttOf(s).Forward(pt.Value.Coeffs[i], pt.Value.Coeffs[i])
		if pt.IsMontgomery {
			s.MForm(pt.Value.Coeffs[i], pt.Value.Coeffs[i])
		}
	}
	return nil
}

// complexPool: the slot buffers of embedFullSlots (2^15 complex values at N = 2^16).
var complexPool sync.Pool

// embedFullSlots: Lattigo's Encoder.Embed of []float64 or []complex128 slot values into the
// coefficient domain of pt (all N/2 slots, standard ring): the same special IFFT
// (Encoder.IFFT), then Complex128ToFixedPointCRT's quantisation by `quantiser` (Lattigo's
// allocates for every coefficient: ~15% of an fhe projection's time at 2^15 slots).
// Bit-identical, the |x| >= 2^64 fallback included
// (TestEncodeNTTMatchesLattigo).  False (nothing written): another value type.
func embedFullSlots(ecd *ckks.Encoder, ringQ *ring.Ring, values any, pt *rlwe.Plaintext) bool {
	slots := ringQ.N() / 2
	bp, _ := complexPool.Get().(*[]complex128)
	if bp == nil || len(*bp) < slots {
		b := make([]complex128, slots)
		bp = &b
	}
	defer complexPool.Put(bp)
	buf := (*bp)[:slots]
	switch v := values.(type) {
	case []float64:
		if len(v) > slots {
			return false
		}
		for i, x := range v {
			buf[i] = complex(x, 0)
		}
		clear(buf[len(v):])
	case []complex128:
		if len(v) > slots {
			return false
		}
		copy(buf, v)
		clear(buf[len(v):])
	default:
		return false
	}
	if err := ecd.IFFT(buf, pt.LogDimensions.Cols); err != nil {
		return false
	}
	q := newQuantiser(ringQ, pt.Scale.Float64(), pt.Value.Coeffs)
	for i, x := range buf {
		q.put(i, real(x))
		q.put(i+slots, imag(x))
	}
	return true
}

// quantiser: Lattigo's SingleFloat64ToFixedPointCRT (coefficient i of a CRT polynomial =
// round(value * scale) mod every prime, with its exact conventions) with the ring's moduli and
// Barrett constants read once: Lattigo's reads them through calls that allocate a slice for
// every coefficient.
type quantiser struct {
	r      *ring.Ring
	scale  float64
	moduli []uint64
	brc    [][2]uint64
	coeffs [][]uint64
}

func newQuantiser(r *ring.Ring, scale float64, coeffs [][]uint64) quantiser {
	return quantiser{r, scale, r.ModuliChain()[:r.Level()+1], r.BRedConstants(), coeffs}
}

func (q quantiser) put(i int, value float64) {
	if value == 0 {
		for j := range q.moduli {
			q.coeffs[j][i] = 0
		}
		return
	}
	neg := value < 0
	x := value * q.scale
	if neg {
		x = -x
	}
	if x >= 1.8446744073709552e+19 { // Lattigo's big-number path
		ckks.SingleFloat64ToFixedPointCRT(q.r, i, value, q.scale, q.coeffs)
		return
	}
	c := uint64(x + 0.5)
	for j, qi := range q.moduli {
		switch {
		case neg && c > qi:
			q.coeffs[j][i] = qi - ring.BRedAdd(c, qi, q.brc[j])
		case neg:
			q.coeffs[j][i] = qi - c
		case c > 0x1fffffffffffffff:
			q.coeffs[j][i] = ring.BRedAdd(c, qi, q.brc[j])
		default:
			q.coeffs[j][i] = c
		}
	}
}

// fastEvaluator: a ckks.Evaluator whose ct-ct products, relinearisations and rescales go
// through the functions above when a Lattigo circuit calls them through the schemes.Evaluator
// interface (the polynomial evaluator: `polynomialEvaluator`).  Everything else is the
// embedded evaluator's.
type fastEvaluator struct{ *ckks.Evaluator }

func (f fastEvaluator) MulRelin(op0 *rlwe.Ciphertext, op1 rlwe.Operand, opOut *rlwe.Ciphertext) error {
	if ct, ok := op1.(*rlwe.Ciphertext); ok {
		return mulRelin(f.Evaluator, op0, ct, opOut)
	}
	return f.Evaluator.MulRelin(op0, op1, opOut)
}

func (f fastEvaluator) MulRelinNew(op0 *rlwe.Ciphertext, op1 rlwe.Operand) (*rlwe.Ciphertext, error) {
	ct, ok := op1.(*rlwe.Ciphertext)
	if !ok {
		return f.Evaluator.MulRelinNew(op0, op1)
	}
	out := ckks.NewCiphertext(*f.GetParameters(), 1, min(op0.Level(), ct.Level()))
	return out, f.MulRelin(op0, op1, out)
}

func (f fastEvaluator) Relinearize(op0, op1 *rlwe.Ciphertext) error {
	return relinearize(f.Evaluator, op0, op1)
}

func (f fastEvaluator) Rescale(op0, op1 *rlwe.Ciphertext) error {
	return rescale(f.Evaluator, op0, op1)
}

// polynomialEvaluator: Lattigo's CKKS polynomial evaluator over fastEvaluator.
func polynomialEvaluator(params ckks.Parameters, eval *ckks.Evaluator) *polynomial.Evaluator {
	pe := polynomial.NewEvaluator(params, eval)
	pe.Evaluator.Evaluator = fastEvaluator{eval}
	return pe
}

// gadgetProductHoisted: rlwe.Evaluator.GadgetProductHoistedLazy for a key without a base-2
// decomposition: ct = (sum_i decomp[i] * key_i0, sum_i decomp[i] * key_i1) in QP, both
// polynomials in one pass over the coefficients of each prime, each sum lazily in 128 bits and
// reduced once (Montgomery: the keys are in Montgomery form, as Lattigo stores them), fully
// reduced as Lattigo's result after its final Reduce; so the same residues (TestFastopsMatchLattigo
// checks the hoisted rotations bit for bit).  Lattigo's loop makes four passes per prime with a
// Montgomery reduction per product, then two Reduce passes.  False (nothing written) where it
// does not apply: a base-2 decomposition, more digits than one 128-bit sum holds, or a modulus of
// 63 bits or more.
func gadgetProductHoisted(params rlwe.Parameters, levelQ int, decomp []ringqp.Poly, key *rlwe.GadgetCiphertext,
	ct *rlwe.Element[ringqp.Poly]) bool {
	levelP := key.LevelP()
	if key.BaseTwoDecomposition != 0 || levelP < 0 {
		return false
	}
	n := params.BaseRNSDecompositionVectorSize(levelQ, levelP)
	if n < 1 || n > len(decomp) || n > len(key.Value) {
		return false
	}
	ringQP := params.RingQP().AtLevel(levelQ, levelP)
	type limb struct {
		sub  *ring.SubRing
		pick func(p ringqp.Poly) ring.Poly
		l    int
	}
	var limbs []limb
	for l, sub := range ringQP.RingQ.SubRings[:levelQ+1] {
		limbs = append(limbs, limb{sub, func(p ringqp.Poly) ring.Poly { return p.Q }, l})
	}
	for l, sub := range ringQP.RingP.SubRings[:levelP+1] {
		limbs = append(limbs, limb{sub, func(p ringqp.Poly) ring.Poly { return p.P }, l})
	}
	for _, lb := range limbs {
		if lb.sub.Modulus>>63 != 0 || foldTerms(lb.sub.Modulus) < n {
			return false
		}
	}
	ds := make([][]uint64, n)
	k0s := make([][]uint64, n)
	k1s := make([][]uint64, n)
	for _, lb := range limbs {
		for i := 0; i < n; i++ {
			g := key.Value[i][0]
			ds[i] = lb.pick(decomp[i]).Coeffs[lb.l]
			k0s[i] = lb.pick(g[0]).Coeffs[lb.l]
			k1s[i] = lb.pick(g[1]).Coeffs[lb.l]
		}
		out0, out1 := lb.pick(ct.Value[0]).Coeffs[lb.l], lb.pick(ct.Value[1]).Coeffs[lb.l]
		q, qInv := lb.sub.Modulus, lb.sub.MRedConstant
		if n == 2 {
			gadgetSum2(q, qInv, ds[0], ds[1], k0s[0], k0s[1], k1s[0], k1s[1], out0, out1)
			continue
		}
		for c := range out0 {
			var h0, l0, h1, l1, cy uint64
			for i := 0; i < n; i++ {
				d := ds[i][c]
				h, l := bits.Mul64(d, k0s[i][c])
				l0, cy = bits.Add64(l0, l, 0)
				h0 += h + cy
				h, l = bits.Mul64(d, k1s[i][c])
				l1, cy = bits.Add64(l1, l, 0)
				h1 += h + cy
			}
			out0[c], out1[c] = redc128(h0, l0, q, qInv), redc128(h1, l1, q, qInv)
		}
	}
	return true
}

// gadgetSum2: out0 = d0 a0 + d1 a1, out1 = d0 b0 + d1 b1 (Montgomery, reduced), the two-digit
// case of gadgetProductHoisted (the offload parameters: two primes, one special prime).
func gadgetSum2(q, qInv uint64, d0, d1, a0, a1, b0, b1, out0, out1 []uint64) {
	n := len(out0)
	d0, d1, a0, a1, b0, b1, out1 = d0[:n], d1[:n], a0[:n], a1[:n], b0[:n], b1[:n], out1[:n]
	for c := 0; c < n; c++ {
		x, y := d0[c], d1[c]
		h, l := bits.Mul64(x, a0[c])
		h2, l2 := bits.Mul64(y, a1[c])
		l, cy := bits.Add64(l, l2, 0)
		out0[c] = redc128(h+h2+cy, l, q, qInv)
		h, l = bits.Mul64(x, b0[c])
		h2, l2 = bits.Mul64(y, b1[c])
		l, cy = bits.Add64(l, l2, 0)
		out1[c] = redc128(h+h2+cy, l, q, qInv)
	}
}

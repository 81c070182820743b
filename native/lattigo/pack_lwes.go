package main

// PackLWEs (Chen, Dai, Kim, Song, "Efficient Homomorphic Conversion Between (Ring) LWE
// Ciphertexts", ACNS 2021, Algorithms 1-2) for FastQuery's private embedding lookup
// (fastquery_002 section 2.3, "PackLWEs optimization"; cipherlm/protocols/embedding.py): the
// same tree and output as cipherlm/he/packlwe.py's pack_lwes_stream (SEAL), here on Lattigo's
// ring arithmetic with the AVX-512 transforms of fastops.go, over goroutines.
//
// With n = 2^l leaves (absent ones are zero), in the bit-reversed order the tree consumes them:
//
//	PackLWEs(ct_0..ct_{2^l-1}):
//	    l = 0: ct_0
//	    ct_e = PackLWEs(even leaves), ct_o = PackLWEs(odd leaves)
//	    (ct_e + X^{N/2^l} ct_o) + tau_{2^l+1}(ct_e - X^{N/2^l} ct_o)
//
// then the field trace ct <- ct + tau_{2^k+1}(ct), k = log2 N .. l+1.  Coefficient j N/n of
// the result holds N times the constant coefficient of leaf j (the caller pre-multiplies the
// leaves by N^-1 mod Q).  tau_g: X -> X^g with the client's Galois keys for g = 2^k + 1.
//
// The exported functions:
//   clg_ctx_new_primes    a context with explicit primes (Q: the data primes, P: the special one)
//   clg_sk_from_ternary   a secret key from ternary coefficients (the client's numpy secret)
//   clg_evk_has_elements  whether a key set holds keys for given Galois elements
//   clg_packlwe_new / clg_packlwe_push / clg_packlwe_finish   the streaming packer
//   clg_packlwe_set_query / clg_packlwe_push_products          leaves made here from a query
//   clg_packlwe_weights_new / _add / clg_packlwe_push_cached   ... from weights made once
// Leaves and the output cross the boundary as coefficient-form residues (2, k, N) uint64;
// inside, ciphertexts are in the NTT domain (a monomial product is a pointwise product, an
// automorphism a permutation after the key switch).  A pushed chunk is a run of consecutive
// leaves in consumption order; it splits into aligned complete subtrees, each computed with
// its two halves on different goroutines (one evaluator and its buffers per goroutine) down
// to single-goroutine subtrees, then merged into the stack of partial results as in
// pack_lwes_stream.

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"math/bits"
	"runtime"
	"slices"
	"sync"
	"unsafe"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

// clg_ctx_new_primes: a context whose data chain is exactly the primes q[0..nQ) (q0 first) and
// whose key-switching primes are p[0..nP) (every prime NTT-friendly for 2N), uniform ternary
// secret, default Gaussian error.  Only the rlwe layer is used (PackLWEs on BFV-style
// ciphertexts); the CKKS scale is a placeholder.
//
//export clg_ctx_new_primes
func clg_ctx_new_primes(logN C.int, q *C.uint64_t, nQ C.int, p *C.uint64_t, nP C.int, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return call(errbuf, errlen, func() error {
		if nQ < 1 || nQ > 32 || nP < 1 || nP > 8 || q == nil || p == nil {
			return errors.New("need 1..32 data primes and 1..8 special primes")
		}
		c, err := newContextWithPrimes(int(logN), unsafe.Slice((*uint64)(unsafe.Pointer(q)), int(nQ)),
			unsafe.Slice((*uint64)(unsafe.Pointer(p)), int(nP)))
		if err != nil {
			return err
		}
		*out = C.int64_t(put(c))
		return nil
	})
}

// newContextWithPrimes: clg_ctx_new_primes's context.
func newContextWithPrimes(logN int, q, p []uint64) (*ctxObj, error) {
	if logN < 10 || logN > 16 {
		return nil, fmt.Errorf("logN %d out of range [10, 16]", logN)
	}
	qs, ps := slicesClone(q), slicesClone(p)
	minBits := 64
	for _, m := range append(slicesClone(qs), ps...) {
		if m < 1<<10 || m >= 1<<61 {
			return nil, fmt.Errorf("prime %d out of range [2^10, 2^61)", m)
		}
		minBits = min(minBits, bits.Len64(m))
	}
	lit := ckks.ParametersLiteral{
		LogN:            logN,
		Q:               qs,
		P:               ps,
		Xs:              ring.Ternary{P: 2.0 / 3.0},
		Xe:              rlwe.DefaultXe,
		LogDefaultScale: max(1, minBits-2),
	}
	params, err := ckks.NewParametersFromLiteral(lit)
	if err != nil {
		return nil, err
	}
	return &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}, nil
}

func slicesClone(v []uint64) []uint64 { return append([]uint64(nil), v...) }

// clg_sk_from_ternary: the secret key whose coefficients are s[0..N) (each -1, 0 or 1), in
// Lattigo's representation (every Q and P prime, NTT and Montgomery form, as its key generator
// leaves a sampled key), with its encryptor and decryptor.
//
//export clg_sk_from_ternary
func clg_sk_from_ternary(h C.int64_t, s *C.int64_t, n C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		if int64(n) != int64(c.params.N()) || s == nil {
			return fmt.Errorf("%d secret coefficients for N = %d", int64(n), c.params.N())
		}
		sk, err := secretKeyFromTernary(c, unsafe.Slice((*int64)(unsafe.Pointer(s)), int(n)))
		if err != nil {
			return err
		}
		*out = C.int64_t(put(&skObj{ctx: c, sk: sk, enc: rlwe.NewEncryptor(c.params, sk), dec: rlwe.NewDecryptor(c.params, sk)}))
		return nil
	})
}

// secretKeyFromTernary: clg_sk_from_ternary's key.
func secretKeyFromTernary(c *ctxObj, coeffs []int64) (*rlwe.SecretKey, error) {
	if len(coeffs) != c.params.N() {
		return nil, fmt.Errorf("%d secret coefficients for N = %d", len(coeffs), c.params.N())
	}
	for i, v := range coeffs {
		if v < -1 || v > 1 {
			return nil, fmt.Errorf("secret coefficient %d is %d, not ternary", i, v)
		}
	}
	sk := rlwe.NewSecretKey(c.params)
	set := func(p ring.Poly, mods []uint64) {
		for j, m := range mods[:len(p.Coeffs)] {
			row := p.Coeffs[j]
			for i, v := range coeffs {
				switch v {
				case 1:
					row[i] = 1
				case -1:
					row[i] = m - 1
				default:
					row[i] = 0
				}
			}
		}
	}
	set(sk.Value.Q, c.params.Q())
	if sk.Value.P.Coeffs != nil {
		set(sk.Value.P, c.params.P())
	}
	rqp := c.params.RingQP().AtLevel(sk.LevelQ(), sk.LevelP())
	rqp.NTT(sk.Value, sk.Value)
	rqp.MForm(sk.Value, sk.Value)
	return sk, nil
}

// clg_evk_has_elements: ok = 1 if the key set holds a key for every Galois element els[0..n)
// (1, the identity, needs none), else 0.
//
//export clg_evk_has_elements
func clg_evk_has_elements(h C.int64_t, els *C.uint64_t, n C.int, ok *C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "Galois key set", errbuf, errlen, func(e *evkObj) error {
		gs, err := galoisElementsIn(e.ctx, els, n)
		if err != nil {
			return err
		}
		*ok = 0
		if _, missing := e.missingElement(gs); !missing {
			*ok = 1
		}
		return nil
	})
}

// ----------------------------------------------------------------------------- the packer

// packNode: a partial result, a complete subtree of height h (nil ct: all its leaves absent).
type packNode struct {
	h  int
	ct *rlwe.Ciphertext
}

// packWorker: one goroutine's evaluator and key-switching buffers.
type packWorker struct {
	ev     *ckks.Evaluator
	decomp []ringqp.Poly
	ctQP   *rlwe.Element[ringqp.Poly]
	t0, t1 ring.Poly
	inv    ring.Poly // c1 in the coefficient domain (packDecompose)
	tmp    *rlwe.Ciphertext
}

type packObj struct {
	mu      sync.Mutex
	ctx     *ctxObj
	evk     *evkObj
	logN    int
	logn    int // log2 of the leaves rounded up to a power of two
	total   int // 2^logn
	pushed  int
	stack   []packNode
	mono    []ring.Poly // mono[h] = NTT(X^(N/2^h)) in Montgomery form, h = 1..logN
	workers []*packWorker
	query   *productQuery // the product leaves' query (clg_packlwe_set_query), or nil
	free    sync.Pool     // spent ciphertexts (*rlwe.Ciphertext), reused for leaves: few allocations, few GCs
	done    bool
	failed  error // an error inside the tree (not a refused input) spends the packer
}

func (o *packObj) context() *ctxObj      { return o.ctx }
func (pw *packWeights) context() *ctxObj { return pw.ctx }

func newPackWorker(params ckks.Parameters, set *rlwe.MemEvaluationKeySet) *packWorker {
	L, LP := params.MaxLevel(), params.MaxLevelP()
	w := &packWorker{ev: ckks.NewEvaluator(params, set)}
	w.decomp = make([]ringqp.Poly, params.BaseRNSDecompositionVectorSize(L, LP))
	for i := range w.decomp {
		w.decomp[i] = ringqp.NewPoly(params.N(), L, LP)
	}
	w.ctQP = rlwe.NewElementExtended(params, 1, L, LP)
	w.ctQP.MetaData = &rlwe.MetaData{}
	w.ctQP.IsNTT = true
	w.t0 = params.RingQ().NewPoly()
	w.t1 = params.RingQ().NewPoly()
	w.inv = params.RingQ().NewPoly()
	w.tmp = newNTTCiphertext(params)
	return w
}

func newNTTCiphertext(params ckks.Parameters) *rlwe.Ciphertext {
	ct := rlwe.NewCiphertext(params, 1, params.MaxLevel())
	ct.IsNTT = true
	return ct
}

// automorphism: ct <- tau_g(ct) in place (key switch of c1 with the Galois key of g, then the
// NTT-domain permutation), as automorphismHoisted with this worker's buffers.
func (w *packWorker) automorphism(ct *rlwe.Ciphertext, g uint64) error {
	evk, err := w.ev.CheckAndGetGaloisKey(g)
	if err != nil {
		return err
	}
	params := w.ev.GetRLWEParameters()
	L, LP := ct.Level(), evk.LevelP()
	rq := params.RingQ().AtLevel(L)
	packDecompose(w.ev, L, LP, ct.Value[1], w.inv, w.decomp)
	if err := w.ev.GadgetProductHoistedLazy(L, w.decomp, &evk.GadgetCiphertext, w.ctQP); err != nil {
		return err
	}
	modDownQPtoQNTT(*params, w.ev.BasisExtender, L, LP, w.ctQP.Value[0].Q, w.ctQP.Value[0].P, w.t0)
	modDownQPtoQNTT(*params, w.ev.BasisExtender, L, LP, w.ctQP.Value[1].Q, w.ctQP.Value[1].P, w.t1)
	rq.Add(w.t0, ct.Value[0], w.t0)
	idx := w.ev.AutomorphismIndex(g)
	if idx == nil {
		if idx, err = ring.AutomorphismNTTIndex(rq.N(), rq.NthRoot(), g); err != nil {
			return err
		}
	}
	rq.AutomorphismNTTWithIndex(w.t0, idx, ct.Value[0])
	rq.AutomorphismNTTWithIndex(w.t1, idx, ct.Value[1])
	return nil
}

// packDecompose: decomposeNTT (fastops.go) for one special prime (nbPi = 1: each digit is c1
// modulo one data prime q_i, centred, in every other prime), with the same residues.  Lattigo's
// DecomposeAndSplit reduces the centred digit modulo each target prime with a Barrett step per
// coefficient; when every target prime m exceeds (q_i / 2 + 1) / 2 (FastQuery's primes differ by
// a bit at most, P larger), the digit's magnitude is below 2 m: one conditional subtraction
// reduces it, then its sign is applied.  Other shapes go to decomposeNTT.
func packDecompose(eval *ckks.Evaluator, levelQ, levelP int, c2, inv ring.Poly, decompQP []ringqp.Poly) {
	params := eval.GetRLWEParameters()
	if levelP != 0 || params.BaseRNSDecompositionVectorSize(levelQ, levelP) != levelQ+1 {
		decomposeNTT(eval, levelQ, levelP, levelP+1, c2, decompQP)
		return
	}
	ringQ := params.RingQ().AtLevel(levelQ)
	ringP := params.RingP().AtLevel(levelP)
	Q, P := ringQ.ModuliChain(), ringP.ModuliChain()
	minMod := P[0]
	for _, q := range Q {
		minMod = min(minMod, q)
	}
	for _, q := range Q {
		if q>>1+1 >= 2*minMod {
			decomposeNTT(eval, levelQ, levelP, levelP+1, c2, decompQP)
			return
		}
	}
	for x, s := range ringQ.SubRings[:levelQ+1] {
		nttOf(s).Backward(c2.Coeffs[x], inv.Coeffs[x])
	}
	for i := 0; i <= levelQ; i++ {
		src, qi, half := inv.Coeffs[i], Q[i], Q[i]>>1
		split := func(dst []uint64, m uint64) { // the centred digit modulo m, branch-free
			dst = dst[:len(src)]
			if half+1 < m { // |digit| < m: c, or m - (q_i - c) for c >= q_i / 2
				off := m - qi // mod 2^64
				for j, c := range src {
					neg := uint64(int64(half-1-c) >> 63) // all ones iff c >= half (c < q_i < 2^61)
					dst[j] = c + off&neg
				}
				return
			}
			for j, c := range src { // |digit| <= half + 1 < 2 m: one conditional subtraction
				neg := uint64(int64(half-1-c) >> 63)
				mag := c ^ (c^(qi-c))&neg
				mag -= m & uint64(int64(m-1-mag)>>63)
				neg &= uint64(int64(-mag) >> 63) // a negative digit not 0 mod m: m - mag
				dst[j] = mag ^ (mag^(m-mag))&neg
			}
		}
		for x, s := range ringQ.SubRings[:levelQ+1] {
			if x == i {
				copy(decompQP[i].Q.Coeffs[x], c2.Coeffs[x])
				continue
			}
			split(decompQP[i].Q.Coeffs[x], Q[x])
			nttOf(s).Forward(decompQP[i].Q.Coeffs[x], decompQP[i].Q.Coeffs[x])
		}
		split(decompQP[i].P.Coeffs[0], P[0])
		nttOf(ringP.SubRings[0]).Forward(decompQP[i].P.Coeffs[0], decompQP[i].P.Coeffs[0])
	}
}

// combine: the node of height h from its children of height h - 1 (CDKS Algorithm 1's step,
// at level h: shift X^(N/2^h), automorphism 2^h + 1); reuses ce's or co's memory.
func (o *packObj) combine(w *packWorker, ce, co *rlwe.Ciphertext, h int) (*rlwe.Ciphertext, error) {
	rq := o.ctx.params.RingQ()
	g := uint64(1)<<h + 1
	if co == nil {
		if ce == nil {
			return nil, nil
		}
		w.tmp.Value[0].Copy(ce.Value[0]) // ct_e + tau(ct_e)
		w.tmp.Value[1].Copy(ce.Value[1])
		if err := w.automorphism(w.tmp, g); err != nil {
			return nil, err
		}
		rq.Add(ce.Value[0], w.tmp.Value[0], ce.Value[0])
		rq.Add(ce.Value[1], w.tmp.Value[1], ce.Value[1])
		return ce, nil
	}
	for i := range co.Value { // X^k ct_o
		rq.MulCoeffsMontgomery(co.Value[i], o.mono[h], co.Value[i])
	}
	if ce == nil { // X^k ct_o + tau(-X^k ct_o)
		rq.Neg(co.Value[0], w.tmp.Value[0])
		rq.Neg(co.Value[1], w.tmp.Value[1])
	} else { // (ct_e + X^k ct_o) + tau(ct_e - X^k ct_o)
		rq.Sub(ce.Value[0], co.Value[0], w.tmp.Value[0])
		rq.Sub(ce.Value[1], co.Value[1], w.tmp.Value[1])
		rq.Add(ce.Value[0], co.Value[0], co.Value[0])
		rq.Add(ce.Value[1], co.Value[1], co.Value[1])
	}
	if err := w.automorphism(w.tmp, g); err != nil {
		return nil, err
	}
	rq.Add(co.Value[0], w.tmp.Value[0], co.Value[0])
	rq.Add(co.Value[1], w.tmp.Value[1], co.Value[1])
	if ce != nil {
		o.free.Put(ce)
	}
	return co, nil
}

// packChunk: the leaves of one push and their presence flags: (m, 2, k, N) coefficient-form
// residues (clg_packlwe_push), or products of the packer's query and weight polynomials (prod,
// clg_packlwe_push_products).
type packChunk struct {
	data    []uint64
	present []byte
	k, n    int
	prod    *productChunk
}

// productChunk: product leaves (see clg_packlwe_push_products): the chunk's weight polynomials
// modulo each prime and their NTTs (C*B*k rows of N each, standard form), each leaf's token and
// column.
type productChunk struct {
	wmod     [][]uint64
	what     [][]uint64
	tok, col []int64
	w        []int64 // the signed weights (C, B, N), the caller's buffer during the push
	smallDot bool    // N max(q) max|w| < 2^62: c0's dot products in int64
	cache    *packWeights
}

// leaf: leaf i of the chunk as an NTT-domain ciphertext (nil if absent; push checked its
// residues reduced).
func (o *packObj) leaf(c *packChunk, i int) (*rlwe.Ciphertext, error) {
	if c.present[i] == 0 {
		return nil, nil
	}
	params := o.ctx.params
	ct, _ := o.free.Get().(*rlwe.Ciphertext)
	if ct == nil {
		ct = newNTTCiphertext(params)
	}
	if c.prod != nil {
		o.productLeaf(c, i, ct)
		return ct, nil
	}
	base := i * 2 * c.k * c.n
	for p := 0; p < 2; p++ {
		for j := 0; j < c.k; j++ {
			src := c.data[base+(p*c.k+j)*c.n : base+(p*c.k+j+1)*c.n]
			var high uint64 // OR of the coefficients of X^1 .. X^(N-1)
			for _, v := range src[1:] {
				high |= v
			}
			dst := ct.Value[p].Coeffs[j]
			if high == 0 { // a constant (FastQuery's c0: one useful coefficient): its NTT is itself
				for x := range dst {
					dst[x] = src[0]
				}
			} else {
				nttOf(params.RingQ().SubRings[j]).Forward(src, dst)
			}
		}
	}
	return ct, nil
}

// subtree: the complete subtree of height h over chunk leaves [lo, lo + 2^h), its halves on
// different goroutines while more than one worker is given (ws[0] merges them).
func (o *packObj) subtree(c *packChunk, lo, h int, ws []*packWorker) (*rlwe.Ciphertext, error) {
	if h == 0 {
		return o.leaf(c, lo)
	}
	half := 1 << (h - 1)
	var ce, co *rlwe.Ciphertext
	var err error
	if len(ws) > 1 {
		var errO error
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer recoverInto(&errO)
			co, errO = o.subtree(c, lo+half, h-1, ws[len(ws)/2:])
		}()
		ce, err = o.subtree(c, lo, h-1, ws[:len(ws)/2])
		wg.Wait()
		if err == nil {
			err = errO
		}
	} else {
		if ce, err = o.subtree(c, lo, h-1, ws); err == nil {
			co, err = o.subtree(c, lo+half, h-1, ws)
		}
	}
	if err != nil {
		return nil, err
	}
	return o.combine(ws[0], ce, co, h)
}

// pushNode: a finished subtree of height h onto the stack, merged with the equal-height
// partial results below it (pack_lwes_stream's loop).
func (o *packObj) pushNode(ct *rlwe.Ciphertext, h int) error {
	for len(o.stack) > 0 && o.stack[len(o.stack)-1].h == h {
		top := o.stack[len(o.stack)-1]
		o.stack = o.stack[:len(o.stack)-1]
		var err error
		if ct, err = o.combine(o.workers[0], top.ct, ct, h+1); err != nil {
			return err
		}
		h++
	}
	o.stack = append(o.stack, packNode{h: h, ct: ct})
	return nil
}

// clg_packlwe_new: a streaming packer of nLeaves (1..N) leaves with the Galois keys evh (they
// must hold 2^k + 1, k = 1..log2 N), working on `workers` goroutines (<= 0: GOMAXPROCS).
//
//export clg_packlwe_new
func clg_packlwe_new(evh C.int64_t, nLeaves C.int64_t, workers C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(evh, "Galois key set", errbuf, errlen, func(e *evkObj) error {
		o, err := newPacker(e, int64(nLeaves), int(workers))
		if err != nil {
			return err
		}
		*out = C.int64_t(put(o))
		return nil
	})
}

// clg_packlwe_push: the next m leaves in consumption order (bit-reversed slots, as
// pack_lwes_order): leaves (m, 2, k, N) coefficient-form residues modulo the k data primes
// (each checked reduced), present[i] 0 for an absent (zero) leaf, 1 otherwise.
//
//export clg_packlwe_push
func clg_packlwe_push(ph C.int64_t, leaves *C.uint64_t, nWords C.int64_t, present *C.uchar, m C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(ph, "PackLWEs packer", errbuf, errlen, func(o *packObj) error {
		if leaves == nil || present == nil || nWords < 1 || m < 1 || m > 1<<20 {
			return errors.New("empty leaf buffer")
		}
		return o.push(unsafe.Slice((*uint64)(unsafe.Pointer(leaves)), int(nWords)),
			unsafe.Slice((*byte)(unsafe.Pointer(present)), int(m)))
	})
}

// clg_packlwe_finish: after all 2^ceil(log2 n) leaves, the packed ciphertext (the tree's root
// followed by the field trace) as (2, k, N) coefficient-form residues into dst.  The packer is
// spent afterwards.
//
//export clg_packlwe_finish
func clg_packlwe_finish(ph C.int64_t, dst *C.uint64_t, nWords C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(ph, "PackLWEs packer", errbuf, errlen, func(o *packObj) error {
		if dst == nil || nWords < 1 {
			return errors.New("empty output buffer")
		}
		return o.finish(unsafe.Slice((*uint64)(unsafe.Pointer(dst)), int(nWords)))
	})
}

// newPacker: clg_packlwe_new's packer.
func newPacker(e *evkObj, nLeaves int64, workers int) (*packObj, error) {
	params := e.ctx.params
	N := params.N()
	if nLeaves < 1 || nLeaves > int64(N) {
		return nil, fmt.Errorf("PackLWEs packs 1..%d ciphertexts, got %d", N, nLeaves)
	}
	logN := params.LogN()
	needed := make([]uint64, logN)
	for k := 1; k <= logN; k++ {
		needed[k-1] = uint64(1)<<k + 1
	}
	if g, missing := e.missingElement(needed); missing {
		return nil, fmt.Errorf("the Galois keys lack the element %d that PackLWEs needs", g)
	}
	logn := bits.Len64(uint64(nLeaves) - 1)
	w := workers
	if w <= 0 {
		w = runtime.GOMAXPROCS(0)
	}
	w = max(1, min(w, 64))
	o := &packObj{ctx: e.ctx, evk: e, logN: logN, logn: logn, total: 1 << logn}
	rq := params.RingQ()
	o.mono = make([]ring.Poly, logN+1)
	for h := 1; h <= logN; h++ {
		m := rq.NewPoly()
		for j := range m.Coeffs {
			m.Coeffs[j][N>>h] = 1
		}
		rq.NTT(m, m)
		rq.MForm(m, m)
		o.mono[h] = m
	}
	for t := 0; t < w; t++ {
		o.workers = append(o.workers, newPackWorker(params, e.set))
	}
	return o, nil
}

// checkPush: a push of len(present) leaves is allowed (not finished, room left, flags 0 or 1).
func (o *packObj) checkPush(present []byte) error {
	if o.done {
		return errors.New("PackLWEs packer already finished")
	}
	if m := len(present); m < 1 || m > o.total-o.pushed {
		return fmt.Errorf("%d leaves pushed after %d of %d", m, o.pushed, o.total)
	}
	for i, b := range present {
		if b > 1 {
			return fmt.Errorf("presence flag %d of leaf %d is not 0 or 1", b, i)
		}
	}
	return nil
}

// push: clg_packlwe_push on Go slices (len(present) leaves in data).
func (o *packObj) push(data []uint64, present []byte) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.checkPush(present); err != nil {
		return err
	}
	params := o.ctx.params
	N, k := params.N(), params.MaxLevel()+1
	m := len(present)
	if want := int64(m) * 2 * int64(k) * int64(N); int64(len(data)) != want {
		return fmt.Errorf("leaf buffer of %d words, expected %d (m, 2, %d, %d)", len(data), want, k, N)
	}
	q := params.Q()
	for i, b := range present {
		if b == 0 {
			continue
		}
		for p := 0; p < 2; p++ { // every residue reduced, before anything changes the packer
			for j := 0; j < k; j++ {
				off := ((i*2+p)*k + j) * N
				for x, v := range data[off : off+N] {
					if v >= q[j] {
						return fmt.Errorf("leaf %d: coefficient %d of part %d, prime %d is %d, not reduced modulo %d",
							i, x, p, j, v, q[j])
					}
				}
			}
		}
	}
	return o.pushChunk(&packChunk{data: data, present: present, k: k, n: N})
}

// pushChunk: a checked chunk's leaves into the tree (the caller holds o.mu).
func (o *packObj) pushChunk(c *packChunk) error {
	if o.failed != nil {
		return o.failed
	}
	m := len(c.present)
	// split [pushed, pushed + m) into aligned complete subtrees, left to right
	lo := 0
	for lo < m {
		h := bits.TrailingZeros64(uint64(o.pushed+lo) | uint64(o.total))
		for lo+(1<<h) > m {
			h--
		}
		ct, err := o.subtree(c, lo, h, o.workers)
		if err == nil {
			err = o.pushNode(ct, h)
		}
		if err != nil { // the stack may hold part of this chunk: the packer is spent
			o.failed = fmt.Errorf("PackLWEs packer unusable after an earlier error: %w", err)
			return err
		}
		lo += 1 << h
	}
	o.pushed += m
	return nil
}

// finish: clg_packlwe_finish into dst (2 k N words).
func (o *packObj) finish(dst []uint64) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.done {
		return errors.New("PackLWEs packer already finished")
	}
	params := o.ctx.params
	N, k := params.N(), params.MaxLevel()+1
	if len(dst) != 2*k*N {
		return fmt.Errorf("output buffer of %d words, expected %d (2, %d, %d)", len(dst), 2*k*N, k, N)
	}
	if o.failed != nil {
		return o.failed
	}
	if o.pushed != o.total || len(o.stack) != 1 {
		return fmt.Errorf("PackLWEs got %d leaves, expected %d", o.pushed, o.total)
	}
	o.done = true
	ct := o.stack[0].ct
	o.stack = nil
	defer func() { o.workers = nil }()
	if ct == nil {
		return errors.New("PackLWEs of zero ciphertexts only")
	}
	w := o.workers[0]
	rq := params.RingQ()
	for kk := o.logN; kk > o.logn; kk-- { // field trace Tr_{K/K_n}
		w.tmp.Value[0].Copy(ct.Value[0])
		w.tmp.Value[1].Copy(ct.Value[1])
		if err := w.automorphism(w.tmp, uint64(1)<<kk+1); err != nil {
			return err
		}
		rq.Add(ct.Value[0], w.tmp.Value[0], ct.Value[0])
		rq.Add(ct.Value[1], w.tmp.Value[1], ct.Value[1])
	}
	for p := 0; p < 2; p++ {
		for j := 0; j < k; j++ {
			nttOf(rq.SubRings[j]).Backward(ct.Value[p].Coeffs[j], dst[(p*k+j)*N:(p*k+j+1)*N])
		}
	}
	return nil
}

// ----------------------------------------------------------------------------- product leaves

// FastQuery's PackLWEs rows (n_i = N, n_o = 1; cipherlm/protocols/embedding.py `_pack_all`)
// pack, for every (token t, column c), the product of the query ciphertexts of t (one per table
// block b) with the weight polynomials w[c, b], moved so that its coefficient N-1 is the
// constant and scaled by N^-1 (the tree multiplies by N):
//
//	leaf = -N^-1 X sum_b (c0, c1)[t, b] w[c, b].
//
// Only the constant of its c0 part matters (the trace removes the other coefficients): that is
// N^-1 times coefficient N-1 of sum_b c0[t, b] w[c, b], a dot product of c0[t, b] with w[c, b]
// reversed, computed here exactly.  Its c1 part is made in the NTT domain: sum_b qhat[t, b] *
// NTT(w[c, b]) with qhat[t, b] = NTT(c1[t, b]) * NTT(-N^-1 X); one weight transform per column,
// shared by the tokens, and no coefficient-form leaf at all.

// productQuery: the packer's query (clg_packlwe_set_query): c0, T*B*k coefficient rows, and qhat,
// T*B*k NTT rows in Montgomery form (one Montgomery product with a standard-form weight
// transform gives a standard product); ninv[j] = N^-1 mod q_j.
type productQuery struct {
	T, B int
	c0   [][]uint64
	qhat [][]uint64
	ninv []uint64
}

// clg_packlwe_set_query: the query of the product leaves, (T, B, 2, k, N) coefficient-form
// residues (each checked reduced); before the first clg_packlwe_push_products.
//
//export clg_packlwe_set_query
func clg_packlwe_set_query(ph C.int64_t, q *C.uint64_t, nWords C.int64_t, T C.int, B C.int, errbuf *C.char,
	errlen C.int) (rc C.int) {
	return with(ph, "PackLWEs packer", errbuf, errlen, func(o *packObj) error {
		if q == nil || nWords < 1 || T < 1 || B < 1 || int64(T)*int64(B) > 1<<20 {
			return errors.New("empty query buffer")
		}
		return o.setQuery(unsafe.Slice((*uint64)(unsafe.Pointer(q)), int(nWords)), int(T), int(B))
	})
}

func (o *packObj) setQuery(query []uint64, T, B int) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.done || o.pushed > 0 {
		return errors.New("the query is set before the first leaf")
	}
	params := o.ctx.params
	rq := params.RingQ()
	N, k := params.N(), params.MaxLevel()+1
	if int64(len(query)) != int64(T)*int64(B)*2*int64(k)*int64(N) {
		return fmt.Errorf("query buffer of %d words, expected %d (%d, %d, 2, %d, %d)", len(query), T*B*2*k*N, T, B, k, N)
	}
	q := params.Q()
	for r := 0; r < T*B*2*k; r++ {
		for x, v := range query[r*N : (r+1)*N] {
			if v >= q[r%k] {
				return fmt.Errorf("query row %d: coefficient %d is %d, not reduced modulo %d", r, x, v, q[r%k])
			}
		}
	}
	ninv := make([]uint64, k)
	shift := rq.NewPoly() // -N^-1 X, then its NTT in Montgomery form
	for j, qj := range q {
		ninv[j] = ring.ModExp(uint64(N), qj-2, qj)
		shift.Coeffs[j][1] = qj - ninv[j]
	}
	rq.NTT(shift, shift)
	rq.MForm(shift, shift)
	qy := &productQuery{T: T, B: B, c0: make([][]uint64, T*B*k), qhat: make([][]uint64, T*B*k), ninv: ninv}
	parallelRows(T*B*k, len(o.workers), func(r int) { // r = (t*B + b)*k + j; query row (t*B + b)*2*k + p*k + j
		tb, j := r/k, r%k
		s := rq.SubRings[j]
		qy.c0[r] = query[(tb*2*k+j)*N : (tb*2*k+j+1)*N]
		row := make([]uint64, N)
		nttOf(s).Forward(query[(tb*2*k+k+j)*N:(tb*2*k+k+j+1)*N], row)
		s.MulCoeffsMontgomery(row, shift.Coeffs[j], row) // standard-form product
		s.MForm(row, row)
		qy.qhat[r] = row
	})
	for r := range qy.c0 { // the caller's buffer is not ours after the call
		qy.c0[r] = slicesClone(qy.c0[r])
	}
	o.query = qy
	return nil
}

// clg_packlwe_push_products: the next m leaves as products (see above): w (C, B, N) the weight
// polynomials of the chunk's C columns (signed, |w| < 2^32), tok[i] in [0, T) and col[i] in
// [0, C) each leaf's token and column, present[i] 0 for an absent leaf.
//
//export clg_packlwe_push_products
func clg_packlwe_push_products(ph C.int64_t, w *C.int64_t, nW C.int64_t, nCols C.int, tok *C.int64_t, col *C.int64_t,
	present *C.uchar, m C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(ph, "PackLWEs packer", errbuf, errlen, func(o *packObj) error {
		if w == nil || tok == nil || col == nil || present == nil || nW < 1 || nCols < 1 || m < 1 || m > 1<<20 {
			return errors.New("empty product-leaf buffer")
		}
		return o.pushProducts(unsafe.Slice((*int64)(unsafe.Pointer(w)), int(nW)), int(nCols),
			unsafe.Slice((*int64)(unsafe.Pointer(tok)), int(m)), unsafe.Slice((*int64)(unsafe.Pointer(col)), int(m)),
			unsafe.Slice((*byte)(unsafe.Pointer(present)), int(m)))
	})
}

// productQueryFor: the query product leaves are made from, once the push's flags, tokens and
// columns (of C) are checked; the caller holds o.mu.
func (o *packObj) productQueryFor(tok, col []int64, present []byte, C int) (*productQuery, error) {
	if err := o.checkPush(present); err != nil {
		return nil, err
	}
	qy := o.query
	if qy == nil {
		return nil, errors.New("product leaves need the query first (clg_packlwe_set_query)")
	}
	for i := range present {
		if present[i] != 0 && (tok[i] < 0 || tok[i] >= int64(qy.T) || col[i] < 0 || col[i] >= int64(C)) {
			return nil, fmt.Errorf("leaf %d: token %d or column %d out of range (%d tokens, %d columns)", i, tok[i],
				col[i], qy.T, C)
		}
	}
	return qy, nil
}

func (o *packObj) pushProducts(w []int64, C int, tok, col []int64, present []byte) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	qy, err := o.productQueryFor(tok, col, present, C)
	if err != nil {
		return err
	}
	params := o.ctx.params
	rq := params.RingQ()
	N, k := params.N(), params.MaxLevel()+1
	if int64(len(w)) != int64(C)*int64(qy.B)*int64(N) {
		return fmt.Errorf("weight buffer of %d words, expected %d (%d, %d, %d)", len(w), C*qy.B*N, C, qy.B, N)
	}
	var maxAbs uint64
	for x, v := range w {
		if v <= -1<<32 || v >= 1<<32 {
			return fmt.Errorf("weight %d is %d, beyond 2^32 in magnitude", x, v)
		}
		maxAbs = max(maxAbs, uint64(max(v, -v)))
	}
	q := params.Q()
	minQ, maxQ := slices.Min(q), slices.Max(q)
	p := &productChunk{wmod: make([][]uint64, C*qy.B*k), what: make([][]uint64, C*qy.B*k), tok: tok, col: col, w: w,
		smallDot: bits.Len(uint(N))+bits.Len64(maxQ)+bits.Len64(maxAbs) <= 62}
	parallelRows(len(p.what), len(o.workers), func(r int) { // r = (c*B + b)*k + j
		j, src := r%k, w[(r/k)*N:(r/k+1)*N]
		qj := q[j]
		row := make([]uint64, N)
		if maxAbs < minQ {
			reduceSmall(row, src, qj)
		} else {
			for x, v := range src { // v mod q_j, v signed
				if v >= 0 {
					row[x] = uint64(v) % qj
				} else if t := uint64(-v) % qj; t != 0 {
					row[x] = qj - t
				}
			}
		}
		p.wmod[r] = row
		p.what[r] = make([]uint64, N)
		nttOf(rq.SubRings[j]).Forward(row, p.what[r])
	})
	return o.pushChunk(&packChunk{present: present, k: k, n: N, prod: p})
}

// productLeaf: leaf i of a product chunk into ct (NTT domain).
func (o *packObj) productLeaf(c *packChunk, i int, ct *rlwe.Ciphertext) {
	qy, p, rq := o.query, c.prod, o.ctx.params.RingQ()
	t, cl := int(p.tok[i]), int(p.col[i])
	for j := 0; j < c.k; j++ {
		s := rq.SubRings[j]
		var v uint64 // coefficient N-1 of sum_b c0[t, b] w[c, b] (no wrap-around at N-1)
		if p.cache != nil {
			v = p.cache.c0Sum(qy, t, cl, j)
		} else {
			v = p.c0Sum(qy, t, cl, j, c.k, s.Modulus)
		}
		v = ring.BRed(v, qy.ninv[j], s.Modulus, s.BRedConstant) // v N^-1
		dst := ct.Value[0].Coeffs[j]
		for x := range dst { // a constant's NTT is itself
			dst[x] = v
		}
		if p.cache != nil {
			p.cache.c1Sum(qy, t, cl, j, ct.Value[1].Coeffs[j])
		} else {
			p.c1Sum(qy, s, t, cl, j, c.k, ct.Value[1].Coeffs[j])
		}
	}
}

// c0Sum: coefficient N-1 of sum_b c0[t, b] w[cl, b] modulo q_j, from the chunk's weights (k
// data primes).
func (p *productChunk) c0Sum(qy *productQuery, t, cl, j, k int, qj uint64) uint64 {
	var v uint64
	for b := 0; b < qy.B; b++ {
		row := qy.c0[(t*qy.B+b)*k+j]
		N := len(row)
		if p.smallDot { // the signed weights: N products below 2^62 / N each, no overflow
			v = (v + reversedDotMod(row, p.w[(cl*qy.B+b)*N:(cl*qy.B+b+1)*N], qj)) % qj
			continue
		}
		wrow := p.wmod[(cl*qy.B+b)*k+j]
		var hi, lo uint64 // 128-bit sum of at most 32 products < q^2 < 2^122, then folded mod q
		for a0 := 0; a0 < N; a0 += 32 {
			for a := a0; a < min(a0+32, N); a++ {
				h, l := bits.Mul64(row[a], wrow[N-1-a])
				var carry uint64
				lo, carry = bits.Add64(lo, l, 0)
				hi += h + carry
			}
			hi, lo = 0, bits.Rem64(hi, lo, qj)
		}
		v = (v + lo) % qj
	}
	return v
}

// c1Sum: acc = sum_b qhat[t, b] NTT(w[cl, b]) modulo q_j (Montgomery products), from the
// chunk's weight transforms.
func (p *productChunk) c1Sum(qy *productQuery, s *ring.SubRing, t, cl, j, k int, acc []uint64) {
	for b := 0; b < qy.B; b++ {
		qrow, wrow := qy.qhat[(t*qy.B+b)*k+j], p.what[(cl*qy.B+b)*k+j]
		if b == 0 {
			s.MulCoeffsMontgomery(qrow, wrow, acc)
		} else {
			s.MulCoeffsMontgomeryThenAdd(qrow, wrow, acc)
		}
	}
}

// reversedDotMod: sum_a row[a] w[N-1-a] modulo q, in [0, q); the caller guarantees the sum
// stays in int64 (N max(row) max|w| < 2^63).
func reversedDotMod[W int16 | int64](row []uint64, w []W, q uint64) uint64 {
	N := len(row)
	var acc int64
	for a, x := range row {
		acc += int64(x) * int64(w[N-1-a])
	}
	r := acc % int64(q)
	return uint64(r) + q&uint64(r>>63)
}

// reduceSmall: dst = src mod q for signed |src| < q (q + v for v < 0).
func reduceSmall(dst []uint64, src []int64, q uint64) {
	for x, v := range src {
		dst[x] = uint64(v) + q&uint64(v>>63)
	}
}

// ----------------------------------------------------------------------------- weights made once

// packWeights: a table's weight polynomials prepared once per session (clg_packlwe_weights_new /
// _add) for clg_packlwe_push_cached, so that a lookup no longer reduces and transforms the
// weights of every column it packs: the signed weights (C, B, N) as int16 (|w| < 2^15: c0's dot
// products) and their transforms modulo each data prime (C, B, k, N) as uint32 (every data prime
// below 2^32).  The leaves are the same words as push_products'.
type packWeights struct {
	mu     sync.Mutex
	ctx    *ctxObj
	C, B   int
	filled int      // columns added so far
	w      []int16  // C-allocated (wbuf): see free
	what   []uint32 // C-allocated (hbuf)
	wbuf   unsafe.Pointer
	hbuf   unsafe.Pointer
	k, n   int
}

func newPackWeights(c *ctxObj, C, B int) (*packWeights, error) {
	params := c.params
	N, k := params.N(), params.MaxLevel()+1
	if C < 1 || B < 1 || int64(C)*int64(B)*int64(N)*int64(2+4*k) > 1<<36 {
		return nil, fmt.Errorf("weights of %d columns x %d blocks: out of range", C, B)
	}
	if q := slices.Max(params.Q()); q >= 1<<32 || bits.Len(uint(N))+bits.Len64(q)+15 > 62 {
		return nil, fmt.Errorf("data prime %d at N = %d: beyond 32 bits or the int64 dot products", q, N)
	}
	pw := &packWeights{ctx: c, C: C, B: B, k: k, n: N}
	// outside the Go heap, so that clg_free returns it to the OS at once (free)
	pw.wbuf, pw.hbuf = C.malloc(C.size_t(C*B*N*2)), C.malloc(C.size_t(C*B*k*N*4))
	pw.w = unsafe.Slice((*int16)(pw.wbuf), C*B*N)
	pw.what = unsafe.Slice((*uint32)(pw.hbuf), C*B*k*N)
	return pw, nil
}

// free: the buffers back to the C allocator (clg_free; the object is unusable afterwards).
func (pw *packWeights) free() {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	pw.w, pw.what, pw.filled, pw.C = nil, nil, 0, 0
	C.free(pw.wbuf)
	C.free(pw.hbuf)
	pw.wbuf, pw.hbuf = nil, nil
}

// add: the next columns' weight polynomials, w (c, B, N) signed, |w| < 2^15.
func (pw *packWeights) add(w []int64, c int) error {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	N, k, B := pw.n, pw.k, pw.B
	if c < 1 || pw.filled+c > pw.C || int64(len(w)) != int64(c)*int64(B)*int64(N) {
		return fmt.Errorf("weights of %d words for %d more columns (%d of %d filled, %d blocks, N = %d)", len(w), c,
			pw.filled, pw.C, B, N)
	}
	for x, v := range w {
		if v <= -1<<15 || v >= 1<<15 {
			return fmt.Errorf("weight %d is %d, beyond 2^15 in magnitude", x, v)
		}
	}
	base := pw.filled * B
	for r, v := range w {
		pw.w[base*N+r] = int16(v)
	}
	rq := pw.ctx.params.RingQ()
	parallelRows(c*B*k, runtime.GOMAXPROCS(0), func(r int) { // r = (col*B + b)*k + j
		j, src := r%k, w[(r/k)*N:(r/k+1)*N]
		qj := rq.SubRings[j].Modulus
		row := make([]uint64, N)
		reduceSmall(row, src, qj) // |v| < 2^15 < q_j
		nttOf(rq.SubRings[j]).Forward(row, row)
		dst := pw.what[(base*k+r)*N : (base*k+r+1)*N]
		for x, v := range row {
			dst[x] = uint32(v)
		}
	})
	pw.filled += c
	return nil
}

// c0Sum: coefficient N-1 of sum_b c0[t, b] w[cl, b] modulo q_j, from the prepared weights
// (productChunk.c0Sum's int64 path: N max(q) 2^15 < 2^62, newPackWeights).
func (pw *packWeights) c0Sum(qy *productQuery, t, cl, j int) uint64 {
	N, k, B := pw.n, pw.k, qy.B
	qj := pw.ctx.params.RingQ().SubRings[j].Modulus
	var v uint64
	for b := 0; b < B; b++ {
		v = (v + reversedDotMod(qy.c0[(t*B+b)*k+j], pw.w[(cl*B+b)*N:(cl*B+b+1)*N], qj)) % qj
	}
	return v
}

// c1Sum: acc = sum_b qhat[t, b] what[cl, b] modulo q_j from the prepared uint32 transforms, the
// words of productChunk.c1Sum (Lattigo's MulCoeffsMontgomery / ...ThenAdd, element by element).
func (pw *packWeights) c1Sum(qy *productQuery, t, cl, j int, acc []uint64) {
	N, k, B := pw.n, pw.k, qy.B
	s := pw.ctx.params.RingQ().SubRings[j]
	qj, mrc := s.Modulus, s.MRedConstant
	for b := 0; b < B; b++ {
		qrow, wrow := qy.qhat[(t*B+b)*k+j], pw.what[((cl*B+b)*k+j)*N:((cl*B+b)*k+j+1)*N]
		if b == 0 {
			for x, q := range qrow {
				acc[x] = ring.MRed(q, uint64(wrow[x]), qj, mrc)
			}
		} else {
			for x, q := range qrow {
				acc[x] = ring.CRed(acc[x]+ring.MRed(q, uint64(wrow[x]), qj, mrc), qj)
			}
		}
	}
}

// clg_packlwe_weights_new: an empty set of prepared weights for C columns of B blocks in the
// context of the Galois key set evh (the packer's).
//
//export clg_packlwe_weights_new
func clg_packlwe_weights_new(evh C.int64_t, nCols C.int64_t, B C.int, out *C.int64_t, errbuf *C.char,
	errlen C.int) (rc C.int) {
	return with(evh, "Galois key set", errbuf, errlen, func(e *evkObj) error {
		pw, err := newPackWeights(e.ctx, int(nCols), int(B))
		if err != nil {
			return err
		}
		*out = C.int64_t(put(pw))
		return nil
	})
}

// clg_packlwe_weights_add: the next nCols columns' weight polynomials, w (nCols, B, N) signed
// int64 with |w| < 2^15.
//
//export clg_packlwe_weights_add
func clg_packlwe_weights_add(wh C.int64_t, w *C.int64_t, nW C.int64_t, nCols C.int, errbuf *C.char,
	errlen C.int) (rc C.int) {
	return with(wh, "PackLWEs weights", errbuf, errlen, func(pw *packWeights) error {
		if w == nil || nW < 1 || nCols < 1 {
			return errors.New("empty weight buffer")
		}
		return pw.add(unsafe.Slice((*int64)(unsafe.Pointer(w)), int(nW)), int(nCols))
	})
}

// clg_packlwe_push_cached: as clg_packlwe_push_products, the weights from the prepared set wh
// (complete; made in the packer's context, with the query's blocks): col[i] in [0, C) a column
// of the whole table.
//
//export clg_packlwe_push_cached
func clg_packlwe_push_cached(ph C.int64_t, wh C.int64_t, tok *C.int64_t, col *C.int64_t, present *C.uchar, m C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(ph, "PackLWEs packer", wh, "PackLWEs weights", "the prepared weights belong to another context",
		errbuf, errlen, func(o *packObj, pw *packWeights) error {
			if tok == nil || col == nil || present == nil || m < 1 || m > 1<<20 {
				return errors.New("empty leaf buffer")
			}
			return o.pushCached(pw, unsafe.Slice((*int64)(unsafe.Pointer(tok)), int(m)),
				unsafe.Slice((*int64)(unsafe.Pointer(col)), int(m)), unsafe.Slice((*byte)(unsafe.Pointer(present)), int(m)))
		})
}

func (o *packObj) pushCached(pw *packWeights, tok, col []int64, present []byte) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	pw.mu.Lock()
	defer pw.mu.Unlock()
	qy, err := o.productQueryFor(tok, col, present, pw.C)
	if err != nil {
		return err
	}
	if pw.B != qy.B || pw.filled != pw.C {
		return fmt.Errorf("prepared weights (%d of %d columns, %d blocks) do not fit this packer (%d query blocks)",
			pw.filled, pw.C, pw.B, qy.B)
	}
	params := o.ctx.params
	return o.pushChunk(&packChunk{present: present, k: params.MaxLevel() + 1, n: params.N(),
		prod: &productChunk{tok: tok, col: col, cache: pw}})
}

// parallelRows: f(0..n-1) on up to `workers` goroutines.
func parallelRows(n, workers int, f func(int)) {
	workers = max(1, min(workers, n))
	var wg sync.WaitGroup
	for g := 0; g < workers; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for r := g; r < n; r += workers {
				f(r)
			}
		}(g)
	}
	wg.Wait()
}

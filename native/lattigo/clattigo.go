// Package main is cipherlm's C ABI over Lattigo v6 (CKKS), built with
// `go build -buildmode=c-shared` and loaded by cipherlm/he/lattigo_backend.py.
//
// Conventions (every exported function):
//   - objects (contexts, keys, plaintexts, ciphertexts) live in a Go map and
//     cross the boundary as int64 handles (> 0); clg_free releases one;
//   - the return value is 0 on success, < 0 on error, and the error message is
//     written NUL-terminated into (errbuf, errlen);
//   - a Go panic is recovered and reported as an error (rc -2), never
//     propagated into the Python interpreter;
//   - byte buffers the caller owns are only read; buffers Go returns are
//     malloc'ed (C.CBytes) and released by the caller with clg_free_buf.
//
// Untrusted bytes (ciphertexts, public keys, Galois keys) use this package's own
// fixed layouts (below), whose shape follows from the parameters alone: the
// length is checked before any allocation and every coefficient is checked to
// be reduced modulo its prime. Lattigo's own parsers never see a peer's bytes.
package main

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"unsafe"

	ltckks "github.com/tuneinsight/lattigo/v6/circuits/ckks/lintrans"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

const abiVersion = 17

// The offload server keeps ~2.7 GB of encoded weights alive (SmolLM2) and allocates a few
// hundred MB of short-lived ciphertexts per token: at Go's default GOGC=100 the heap grows to
// twice the live set before a collection.  The weights are pointer-free slices (cheap to mark),
// so collect at +20% instead unless the user set GOGC.
func init() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(20)
	}
}

// ----------------------------------------------------------------------------- handles

type ctxObj struct {
	params  ckks.Parameters
	encoder *ckks.Encoder
	eval    *ckks.Evaluator // without keys: add, mul by plaintext, rescale
	gkSize  int             // words of one Galois key (lazily computed)
	gkOnce  sync.Once
	gkcSize int // bytes of one seeded Galois key's bit-packed polys (packedGaloisKeyBytes)
	gkcOnce sync.Once
	btp     *btpPreset // bootstrappable contexts only (bootstrap.go)
}

type skObj struct {
	ctx *ctxObj
	sk  *rlwe.SecretKey
	enc *rlwe.Encryptor
	dec *rlwe.Decryptor
}

type pkObj struct {
	ctx *ctxObj
	pk  *rlwe.PublicKey
	enc *rlwe.Encryptor
}

type evkObj struct {
	ctx    *ctxObj
	set    *rlwe.MemEvaluationKeySet
	eval   *ckks.Evaluator
	ltOnce sync.Once
	ltEval *ltckks.Evaluator // BSGS linear transformations over eval (lazily built)
}

type ltObj struct {
	ctx *ctxObj
	lt  ltckks.LinearTransformation
}

// bsgsObj: a matrix encoded for cipherlm's offload matmul (cipherlm/he/matmul.py): per output
// block o and diagonal k the pre-rotated diagonal plaintext pts[o][k] (nil: all zero), g baby
// steps, giant steps of g slots, then the chunk sum's rotations.  maxRep > 1
// (clg_bsgs_compress): diagonals whose NTT residues come in runs of up to maxRep equal values
// are stored one value per run (bsgsDiag).
type bsgsObj struct {
	ctx        *ctxObj
	nBlocks    int
	m, g       int
	parts      int // input ciphertexts: block o's diagonals of input p are pts[o][p*m : (p+1)*m]
	chunkSteps []int
	level      int
	scale      rlwe.Scale
	maxRep     int
	pts        [][]*bsgsDiag
	units      [][][]*bsgsDiag // [block][giant step]: the diagonals of the unit's inner sum (diagonals)
}

type ptObj struct {
	ctx *ctxObj
	pt  *rlwe.Plaintext
}

type ctObj struct {
	ctx *ctxObj
	ct  *rlwe.Ciphertext
}

var (
	mu      sync.RWMutex
	objects = map[int64]any{}
	nextID  int64
)

func put(o any) int64 {
	mu.Lock()
	defer mu.Unlock()
	nextID++
	objects[nextID] = o
	return nextID
}

func get[T any](h C.int64_t, what string) (T, error) {
	mu.RLock()
	o, ok := objects[int64(h)]
	mu.RUnlock()
	var zero T
	if !ok {
		return zero, fmt.Errorf("invalid %s handle %d", what, int64(h))
	}
	t, ok := o.(T)
	if !ok {
		return zero, fmt.Errorf("handle %d is a %T, not a %s", int64(h), o, what)
	}
	return t, nil
}

// ----------------------------------------------------------------------------- errors

func writeErr(errbuf *C.char, errlen C.int, msg string) {
	if errbuf == nil || errlen <= 0 {
		return
	}
	b := unsafe.Slice((*byte)(unsafe.Pointer(errbuf)), int(errlen))
	n := copy(b[:len(b)-1], msg)
	b[n] = 0
}

func fail(errbuf *C.char, errlen C.int, err error) C.int {
	writeErr(errbuf, errlen, err.Error())
	return -1
}

// guard turns a panic into rc -2 with its message; deferred by call.
func guard(rc *C.int, errbuf *C.char, errlen C.int) {
	if r := recover(); r != nil {
		writeErr(errbuf, errlen, fmt.Sprintf("lattigo: recovered panic: %v", r))
		*rc = -2
	}
}

// call runs the body of an exported function (every one runs its body under call, or with / with2,
// which look its handles up first): an error the body returns becomes rc -1 with its message in
// (errbuf, errlen), a panic rc -2 (guard).
func call(errbuf *C.char, errlen C.int, body func() error) (rc C.int) {
	defer guard(&rc, errbuf, errlen)
	if err := body(); err != nil {
		return fail(errbuf, errlen, err)
	}
	return 0
}

// with: call on the object behind handle h (a `what` in get's messages).
func with[T any](h C.int64_t, what string, errbuf *C.char, errlen C.int, body func(T) error) C.int {
	return call(errbuf, errlen, func() error {
		o, err := get[T](h, what)
		if err != nil {
			return err
		}
		return body(o)
	})
}

// with2: call on the objects behind handles ha and hb; when mismatch is not empty, it is the error
// for objects of different contexts.
func with2[A, B owned](ha C.int64_t, whatA string, hb C.int64_t, whatB string, mismatch string,
	errbuf *C.char, errlen C.int, body func(A, B) error) C.int {
	return call(errbuf, errlen, func() error {
		a, b, err := pair[A, B](ha, whatA, hb, whatB, mismatch)
		if err != nil {
			return err
		}
		return body(a, b)
	})
}

// pair: the objects behind handles ha and hb (see with2 for mismatch).
func pair[A, B owned](ha C.int64_t, whatA string, hb C.int64_t, whatB string, mismatch string) (A, B, error) {
	var b B
	a, err := get[A](ha, whatA)
	if err == nil {
		b, err = getIn[B](hb, whatB, mismatch, a)
	}
	return a, b, err
}

// getIn: get, then (mismatch not empty) errors.New(mismatch) unless the object belongs to the
// context of the others.
func getIn[T owned](h C.int64_t, what string, mismatch string, others ...owned) (T, error) {
	t, err := get[T](h, what)
	if err == nil && mismatch != "" {
		err = sameContext(mismatch, t, others...)
	}
	return t, err
}

// owned: the objects that belong to a context.
type owned interface{ context() *ctxObj }

func (o *skObj) context() *ctxObj   { return o.ctx }
func (o *pkObj) context() *ctxObj   { return o.ctx }
func (o *evkObj) context() *ctxObj  { return o.ctx }
func (o *ltObj) context() *ctxObj   { return o.ctx }
func (o *bsgsObj) context() *ctxObj { return o.ctx }
func (o *ptObj) context() *ctxObj   { return o.ctx }
func (o *ctObj) context() *ctxObj   { return o.ctx }

// sameContext: errors.New(mismatch) unless every object belongs to a's context.
func sameContext(mismatch string, a owned, others ...owned) error {
	for _, o := range others {
		if o.context() != a.context() {
			return errors.New(mismatch)
		}
	}
	return nil
}

func i64s(p *C.int64_t, n C.int) []int64 {
	if n <= 0 || p == nil {
		return nil
	}
	return unsafe.Slice((*int64)(unsafe.Pointer(p)), int(n))
}

func bytesIn(p *C.uchar, n C.int64_t) []byte {
	if n <= 0 || p == nil {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(p)), int(n))
}

func bytesOut(b []byte, out **C.uchar, outLen *C.int64_t) {
	*out = (*C.uchar)(C.CBytes(b))
	*outLen = C.int64_t(len(b))
}

// ----------------------------------------------------------------------------- misc

//export clg_abi_version
func clg_abi_version() C.int { return abiVersion }

//export clg_free
func clg_free(h C.int64_t) {
	mu.Lock()
	o := objects[int64(h)]
	delete(objects, int64(h))
	mu.Unlock()
	if f, ok := o.(interface{ free() }); ok { // memory outside the Go heap (packWeights)
		f.free()
	}
}

//export clg_free_buf
func clg_free_buf(p *C.uchar) { C.free(unsafe.Pointer(p)) }

// clg_release_memory: a garbage collection, then the freed heap back to the OS now (the Go
// runtime otherwise keeps it for reuse and returns it over minutes); for long-lived processes
// between workloads, e.g. a test run between modules.
//
//export clg_release_memory
func clg_release_memory() {
	debug.FreeOSMemory()
}

//export clg_live_objects
func clg_live_objects() C.int64_t {
	mu.RLock()
	defer mu.RUnlock()
	return C.int64_t(len(objects))
}

// clg_primes: n distinct NTT-friendly primes (q = 1 mod 2^(logN+1)) of exactly the given bit sizes.
//
//export clg_primes
func clg_primes(logN C.int, bits *C.int64_t, n C.int, out *C.uint64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return call(errbuf, errlen, func() error {
		if logN < 1 || logN > 17 {
			return fmt.Errorf("logN %d out of range", int(logN))
		}
		dst := unsafe.Slice((*uint64)(unsafe.Pointer(out)), int(n))
		seen := map[uint64]bool{}
		gens := map[int64]*ring.NTTFriendlyPrimesGenerator{}
		for i, b := range i64s(bits, n) {
			if b < 10 || b > 61 {
				return fmt.Errorf("prime bit size %d out of range [10, 61]", b)
			}
			g, ok := gens[b]
			if !ok {
				gg := ring.NewNTTFriendlyPrimesGenerator(uint64(b), uint64(2)<<uint(logN))
				g = &gg
				gens[b] = g
			}
			for {
				q, err := g.NextDownstreamPrime() // below 2^b: exactly b bits, as SEAL's CoeffModulus.Create
				if err != nil {
					return err
				}
				if !seen[q] {
					seen[q] = true
					dst[i] = q
					break
				}
			}
		}
		return nil
	})
}

// ----------------------------------------------------------------------------- context

// clg_ckks_new: CKKS parameters from explicit prime sizes (logQ: data chain, q0
// first; logP: special primes), uniform ternary secret, default Gaussian error.
//
//export clg_ckks_new
func clg_ckks_new(logN C.int, logQ *C.int64_t, nQ C.int, logP *C.int64_t, nP C.int, logScale C.int,
	out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return call(errbuf, errlen, func() error {
		if logN < 10 || logN > 16 {
			return fmt.Errorf("logN %d out of range [10, 16]", int(logN))
		}
		if nQ < 1 || nP < 1 {
			return errors.New("need at least one data prime and one special prime")
		}
		toInts := func(v []int64) []int {
			r := make([]int, len(v))
			for i, x := range v {
				r[i] = int(x)
			}
			return r
		}
		lit := ckks.ParametersLiteral{
			LogN:            int(logN),
			LogQ:            toInts(i64s(logQ, nQ)),
			LogP:            toInts(i64s(logP, nP)),
			Xs:              ring.Ternary{P: 2.0 / 3.0}, // uniform ternary: the HE-standard table's secret
			Xe:              rlwe.DefaultXe,
			LogDefaultScale: int(logScale),
		}
		params, err := ckks.NewParametersFromLiteral(lit)
		if err != nil {
			return err
		}
		c := &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}
		*out = C.int64_t(put(c))
		return nil
	})
}

// encodingPrec: the precision of every context's encoder.  Lattigo's default is the
// context's scale when that is above 2^53 (BLB's per-block scales go up to 2^55), and then
// every encode and decode runs an IFFT of math/big floats, a multiple of the float64
// path's time.  A power-of-two scale multiplies a float64 exactly, so the float64 path
// loses only the IFFT's own relative rounding (~2^-50 of the values), below a fresh
// encryption's noise at such scales (~2^-46 at N = 2^14 and scale 2^55).
const encodingPrec = 53

// newEncoder: a CKKS encoder of encodingPrec bits for params.
func newEncoder(params ckks.Parameters) *ckks.Encoder {
	return ckks.NewEncoder(params, encodingPrec)
}

// clg_ctx_info: N, max level, number of Q and P primes, and the primes (Q then P) into moduli.
//
//export clg_ctx_info
func clg_ctx_info(h C.int64_t, n *C.int64_t, maxLevel *C.int, nQ *C.int, nP *C.int,
	moduli *C.uint64_t, cap_ C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		q, p := c.params.Q(), c.params.P()
		*n = C.int64_t(c.params.N())
		*maxLevel = C.int(c.params.MaxLevel())
		*nQ, *nP = C.int(len(q)), C.int(len(p))
		if int(cap_) < len(q)+len(p) {
			return errors.New("moduli buffer too small")
		}
		dst := unsafe.Slice((*uint64)(unsafe.Pointer(moduli)), len(q)+len(p))
		copy(dst, q)
		copy(dst[len(q):], p)
		return nil
	})
}

// ----------------------------------------------------------------------------- keys

//export clg_keygen
func clg_keygen(h C.int64_t, skOut *C.int64_t, pkOut *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		kg := rlwe.NewKeyGenerator(c.params)
		sk, pk := kg.GenKeyPairNew()
		*skOut = C.int64_t(put(&skObj{ctx: c, sk: sk, enc: rlwe.NewEncryptor(c.params, sk), dec: rlwe.NewDecryptor(c.params, sk)}))
		*pkOut = C.int64_t(put(&pkObj{ctx: c, pk: pk, enc: rlwe.NewEncryptor(c.params, pk)}))
		return nil
	})
}

func galoisElements(c *ctxObj, steps []int64, conj bool) ([]uint64, error) {
	half := int64(c.params.MaxSlots())
	seen := map[uint64]bool{}
	var els []uint64
	for _, s := range steps {
		if s <= -half || s >= half || s == 0 {
			return nil, fmt.Errorf("rotation step %d out of range (0 < |step| < %d)", s, half)
		}
		g := c.params.GaloisElement(int(s))
		if !seen[g] {
			seen[g] = true
			els = append(els, g)
		}
	}
	if conj {
		g := c.params.GaloisElementOrderTwoOrthogonalSubgroup()
		if !seen[g] {
			els = append(els, g)
		}
	}
	return els, nil
}

// clg_gen_rotation_keys: Galois keys for slot rotations by `steps` (and conjugation).
//
//export clg_gen_rotation_keys
func clg_gen_rotation_keys(skh C.int64_t, steps *C.int64_t, n C.int, conj C.int, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		els, err := galoisElements(s.ctx, i64s(steps, n), conj != 0)
		if err != nil {
			return err
		}
		gks := rlwe.NewKeyGenerator(s.ctx.params).GenGaloisKeysNew(els, s.sk)
		set := rlwe.NewMemEvaluationKeySet(nil, gks...)
		*out = C.int64_t(put(&evkObj{ctx: s.ctx, set: set, eval: ckks.NewEvaluator(s.ctx.params, set)}))
		return nil
	})
}

// clg_evk_has_steps: 1 if the key set holds a key for every rotation step, else 0.
//
//export clg_evk_has_steps
func clg_evk_has_steps(h C.int64_t, steps *C.int64_t, n C.int, conj C.int, ok *C.int, errbuf *C.char,
	errlen C.int) (rc C.int) {
	return with(h, "Galois key set", errbuf, errlen, func(e *evkObj) error {
		els, err := galoisElements(e.ctx, i64s(steps, n), conj != 0)
		if err != nil {
			return err
		}
		*ok = 0
		if _, missing := e.missingElement(els); !missing {
			*ok = 1
		}
		return nil
	})
}

// missingElement: the first of els the key set holds no Galois key for (and true), or false.
func (e *evkObj) missingElement(els []uint64) (uint64, bool) {
	for _, g := range els {
		if _, found := e.set.GaloisKeys[g]; !found {
			return g, true
		}
	}
	return 0, false
}

// galoisElementsIn: the caller's Galois elements els[0..n) (odd, < 2N), without repeats and
// without 1 (the identity needs no key), in their first order.
func galoisElementsIn(c *ctxObj, els *C.uint64_t, n C.int) ([]uint64, error) {
	if n < 1 || els == nil {
		return nil, errors.New("no Galois elements")
	}
	twoN := uint64(2 * c.params.N())
	seen := map[uint64]bool{}
	var gs []uint64
	for _, g := range unsafe.Slice((*uint64)(unsafe.Pointer(els)), int(n)) {
		if g&1 == 0 || g == 0 || g >= twoN {
			return nil, fmt.Errorf("invalid Galois element %d", g)
		}
		if g != 1 && !seen[g] {
			seen[g] = true
			gs = append(gs, g)
		}
	}
	return gs, nil
}

// clg_gen_galois_keys: Galois keys for the automorphisms X -> X^g, g in els (odd, < 2N; 1 is skipped).
//
//export clg_gen_galois_keys
func clg_gen_galois_keys(skh C.int64_t, els *C.uint64_t, n C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		gs, err := galoisElementsIn(s.ctx, els, n)
		if err != nil {
			return err
		}
		set := rlwe.NewMemEvaluationKeySet(nil, rlwe.NewKeyGenerator(s.ctx.params).GenGaloisKeysNew(gs, s.sk)...)
		*out = C.int64_t(put(&evkObj{ctx: s.ctx, set: set, eval: ckks.NewEvaluator(s.ctx.params, set)}))
		return nil
	})
}

// ----------------------------------------------------------------------------- encoding

// clg_encode: slot values (re, im; im may be NULL) -> plaintext at `level` with scale 2^logScale
// (logScale <= 0: the default scale).  tile != 0: the n values (a power of two) repeated over all
// slots, encoded at the sparse dimension log2(n) (a polynomial in X^(N/2n): bit-identical to
// encoding the repeated vector, with an FFT of n points instead of N/2).
//
//export clg_encode
func clg_encode(h C.int64_t, re *C.double, im *C.double, n C.int64_t, level C.int, logScale C.double,
	tile C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		if n < 1 || int(n) > c.params.MaxSlots() {
			return fmt.Errorf("%d values for %d slots", int64(n), c.params.MaxSlots())
		}
		if tile != 0 && n&(n-1) != 0 {
			return fmt.Errorf("tiled encoding of %d values: not a power of two", int64(n))
		}
		lvl := int(level)
		if lvl < 0 || lvl > c.params.MaxLevel() {
			return fmt.Errorf("level %d out of range [0, %d]", lvl, c.params.MaxLevel())
		}
		pt := ckks.NewPlaintext(c.params, lvl)
		if logScale > 0 {
			if logScale > 120 {
				return fmt.Errorf("log2 scale %g too large", float64(logScale))
			}
			pt.Scale = rlwe.NewScale(math.Exp2(float64(logScale)))
		}
		r := unsafe.Slice((*float64)(unsafe.Pointer(re)), int(n))
		width := c.params.MaxSlots()
		if tile != 0 {
			width = int(n)
			pt.LogDimensions = ring.Dimensions{Rows: 0, Cols: bits.Len(uint(n)) - 1}
		}
		var err error
		if im == nil {
			v := make([]float64, width)
			copy(v, r)
			err = encodeNTT(c.encoder, v, pt)
		} else {
			ii := unsafe.Slice((*float64)(unsafe.Pointer(im)), int(n))
			v := make([]complex128, width)
			for k := range r {
				v[k] = complex(r[k], ii[k])
			}
			err = encodeNTT(c.encoder, v, pt)
		}
		if err != nil {
			return err
		}
		pt.LogDimensions = c.params.LogMaxDimensions() // a full-slot plaintext from here on
		*out = C.int64_t(put(&ptObj{ctx: c, pt: pt}))
		return nil
	})
}

// clg_decode: plaintext -> the first n slot values (re, im; im may be NULL).
//
//export clg_decode
func clg_decode(ph C.int64_t, re *C.double, im *C.double, n C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(ph, "plaintext", errbuf, errlen, func(p *ptObj) error {
		slots := p.ctx.params.MaxSlots()
		if n < 1 || int(n) > slots {
			return fmt.Errorf("%d values for %d slots", int64(n), slots)
		}
		v := make([]complex128, slots)
		if err := p.ctx.encoder.Decode(p.pt, v); err != nil {
			return err
		}
		r := unsafe.Slice((*float64)(unsafe.Pointer(re)), int(n))
		var ii []float64
		if im != nil {
			ii = unsafe.Slice((*float64)(unsafe.Pointer(im)), int(n))
		}
		for k := range r {
			r[k] = real(v[k])
			if ii != nil {
				ii[k] = imag(v[k])
			}
		}
		return nil
	})
}

// ----------------------------------------------------------------------------- encrypt / decrypt

//export clg_encrypt_sk
func clg_encrypt_sk(skh C.int64_t, ph C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(skh, "secret key", ph, "plaintext", "", errbuf, errlen, func(s *skObj, p *ptObj) error {
		ct, err := s.enc.EncryptNew(p.pt)
		if err != nil {
			return err
		}
		*out = C.int64_t(put(&ctObj{ctx: s.ctx, ct: ct}))
		return nil
	})
}

// clg_encrypt_pk: public-key encryption of a plaintext (ph > 0) or of zero at `level` (ph == 0).
//
//export clg_encrypt_pk
func clg_encrypt_pk(pkh C.int64_t, ph C.int64_t, level C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(pkh, "public key", errbuf, errlen, func(k *pkObj) error {
		var ct *rlwe.Ciphertext
		var err error
		if ph == 0 {
			if level < 0 || int(level) > k.ctx.params.MaxLevel() {
				return fmt.Errorf("level %d out of range", int(level))
			}
			ct = ckks.NewCiphertext(k.ctx.params, 1, int(level))
			err = k.enc.EncryptZero(ct)
		} else {
			var p *ptObj
			if p, err = get[*ptObj](ph, "plaintext"); err != nil {
				return err
			}
			ct, err = k.enc.EncryptNew(p.pt)
		}
		if err != nil {
			return err
		}
		*out = C.int64_t(put(&ctObj{ctx: k.ctx, ct: ct}))
		return nil
	})
}

//export clg_decrypt
func clg_decrypt(skh C.int64_t, cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(skh, "secret key", cth, "ciphertext", "ciphertext and key belong to different contexts",
		errbuf, errlen, func(s *skObj, c *ctObj) error {
			if c.ct.Degree() != 1 {
				return fmt.Errorf("ciphertext of degree %d (relinearise first)", c.ct.Degree())
			}
			*out = C.int64_t(put(&ptObj{ctx: s.ctx, pt: s.dec.DecryptNew(c.ct)}))
			return nil
		})
}

// ----------------------------------------------------------------------------- evaluation

func twoCts(a, b C.int64_t) (*ctObj, *ctObj, error) {
	return pair[*ctObj, *ctObj](a, "ciphertext", b, "ciphertext", "ciphertexts belong to different contexts")
}

// inPlace: a = op(a, b) for clg_add and clg_sub, b a ciphertext or (plain != 0) a plaintext of
// a's context.
func inPlace(a C.int64_t, b C.int64_t, plain C.int, errbuf *C.char, errlen C.int,
	op func(*ckks.Evaluator, *rlwe.Ciphertext, rlwe.Operand, *rlwe.Ciphertext) error) C.int {
	return with(a, "ciphertext", errbuf, errlen, func(x *ctObj) error {
		var operand rlwe.Operand
		if plain != 0 {
			p, err := getIn[*ptObj](b, "plaintext", "different contexts", x)
			if err != nil {
				return err
			}
			operand = p.pt
		} else {
			_, y, err := twoCts(a, b)
			if err != nil {
				return err
			}
			operand = y.ct
		}
		return op(x.ctx.eval, x.ct, operand, x.ct)
	})
}

// clg_mul_plain: ct * pt (no rescale) into `into` (> 0: an existing ciphertext to overwrite) or
// a new ciphertext; the result's handle in out.
//
//export clg_mul_plain
func clg_mul_plain(cth C.int64_t, ph C.int64_t, into C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(cth, "ciphertext", ph, "plaintext", "ciphertext and plaintext belong to different contexts",
		errbuf, errlen, func(c *ctObj, p *ptObj) error {
			lvl := min(c.ct.Level(), p.pt.Level())
			var dst *ctObj
			if into > 0 {
				var err error
				if dst, err = getIn[*ctObj](into, "ciphertext", "output ciphertext belongs to another context", c); err != nil {
					return err
				}
				if dst.ct.Degree() != 1 || dst.ct.Level() < lvl {
					dst.ct = ckks.NewCiphertext(c.ctx.params, 1, lvl)
				} else if dst.ct.Level() > lvl {
					dst.ct.Resize(1, lvl)
				}
			} else {
				dst = &ctObj{ctx: c.ctx, ct: ckks.NewCiphertext(c.ctx.params, 1, lvl)}
			}
			if err := c.ctx.eval.Mul(c.ct, p.pt, dst.ct); err != nil {
				return err
			}
			if into > 0 {
				*out = into
			} else {
				*out = C.int64_t(put(dst))
			}
			return nil
		})
}

// clg_add: a += b (ciphertexts), or a += pt when plain != 0 (b is then a plaintext handle).
//
//export clg_add
func clg_add(a C.int64_t, b C.int64_t, plain C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return inPlace(a, b, plain, errbuf, errlen, (*ckks.Evaluator).Add)
}

// clg_rescale: divide by the last prime of the ciphertext's level, in place.
//
//export clg_rescale
func clg_rescale(cth C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		if c.ct.Level() == 0 {
			return errors.New("cannot rescale a ciphertext at level 0")
		}
		out := ckks.NewCiphertext(c.ctx.params, c.ct.Degree(), c.ct.Level()-1)
		if err := rescale(c.ctx.eval, c.ct, out); err != nil {
			return err
		}
		c.ct = out
		return nil
	})
}

// clg_drop_level: drop `levels` primes without dividing (the scale is unchanged), in place.
//
//export clg_drop_level
func clg_drop_level(cth C.int64_t, levels C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		if levels < 0 || int(levels) > c.ct.Level() {
			return fmt.Errorf("cannot drop %d levels from level %d", int(levels), c.ct.Level())
		}
		c.ctx.eval.DropLevel(c.ct, int(levels))
		return nil
	})
}

// clg_rotate: slot rotation to the left by step (key switching with the set's Galois key).
//
//export clg_rotate
func clg_rotate(evh C.int64_t, cth C.int64_t, step C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(evh, "Galois key set", cth, "ciphertext", "ciphertext and keys belong to different contexts",
		errbuf, errlen, func(e *evkObj, c *ctObj) error {
			if c.ct.Degree() != 1 {
				return errors.New("rotate needs a degree-1 ciphertext")
			}
			res := ckks.NewCiphertext(c.ctx.params, 1, c.ct.Level())
			if err := rotate(e.eval, c.ct, int(step), res); err != nil {
				return err
			}
			*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: res}))
			return nil
		})
}

// clg_conjugate: the complex conjugate of every slot (key switching with the set's
// conjugation key, Galois element 2N - 1).
//
//export clg_conjugate
func clg_conjugate(evh C.int64_t, cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(evh, "Galois key set", cth, "ciphertext", "ciphertext and keys belong to different contexts",
		errbuf, errlen, func(e *evkObj, c *ctObj) error {
			if c.ct.Degree() != 1 {
				return errors.New("conjugate needs a degree-1 ciphertext")
			}
			res := ckks.NewCiphertext(c.ctx.params, 1, c.ct.Level())
			if err := e.eval.Conjugate(c.ct, res); err != nil {
				return err
			}
			*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: res}))
			return nil
		})
}

// clg_rotate_hoisted: rotations of one ciphertext by each of steps[0..n), sharing one
// decomposition of c1 (RotateHoisted); out[i] receives the rotation by steps[i].
//
//export clg_rotate_hoisted
func clg_rotate_hoisted(evh C.int64_t, cth C.int64_t, steps *C.int64_t, n C.int, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(evh, "Galois key set", cth, "ciphertext", "ciphertext and keys belong to different contexts",
		errbuf, errlen, func(e *evkObj, c *ctObj) error {
			if c.ct.Degree() != 1 {
				return errors.New("rotate needs a degree-1 ciphertext")
			}
			st := i64s(steps, n)
			half := int64(c.ctx.params.MaxSlots())
			var uniq []int
			seen := map[int]bool{}
			for _, s := range st {
				if s <= -half || s >= half {
					return fmt.Errorf("rotation step %d out of range", s)
				}
				k := int(s)
				if k != 0 && !seen[k] {
					seen[k] = true
					uniq = append(uniq, k)
				}
			}
			res := map[int]*rlwe.Ciphertext{}
			for _, k := range uniq {
				res[k] = ckks.NewCiphertext(c.ctx.params, 1, c.ct.Level())
			}
			if len(uniq) > 0 {
				if err := rotateHoisted(e.eval, c.ct, uniq, res); err != nil {
					return err
				}
			}
			dst := unsafe.Slice((*int64)(unsafe.Pointer(out)), int(n))
			used := map[int]bool{}
			for i, s := range st {
				k := int(s)
				var ct *rlwe.Ciphertext
				switch {
				case k == 0:
					ct = c.ct.CopyNew()
				case used[k]:
					ct = res[k].CopyNew()
				default:
					ct, used[k] = res[k], true
				}
				dst[i] = put(&ctObj{ctx: c.ctx, ct: ct})
			}
			return nil
		})
}

// ----------------------------------------------------------------------------- linear transformations

// clg_lt_new: encode a slots x slots matrix given by its non-zero diagonals (diagonal d: the
// vector v with v[i] = M[i][(i + d) mod slots]; values: nDiag rows of `slots` float64) for the
// BSGS evaluation at `level`, plaintext scale 2^logScale (<= 0: the level's last prime, so a
// rescale brings the product back to the input's scale), log2 baby/giant ratio logRatio
// (< 0: no BSGS, one rotation per diagonal).
//
//export clg_lt_new
func clg_lt_new(h C.int64_t, diag *C.int64_t, nDiag C.int, values *C.double, level C.int, logScale C.double,
	logRatio C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		slots := c.params.MaxSlots()
		if nDiag < 1 || int(nDiag) > slots {
			return fmt.Errorf("%d diagonals (1..%d)", int(nDiag), slots)
		}
		lvl := int(level)
		if lvl < 0 || lvl > c.params.MaxLevel() {
			return fmt.Errorf("level %d out of range [0, %d]", lvl, c.params.MaxLevel())
		}
		if logRatio > 16 || logRatio < -1 {
			return fmt.Errorf("log2 baby/giant ratio %d out of range [-1, 16]", int(logRatio))
		}
		vals := unsafe.Slice((*float64)(unsafe.Pointer(values)), int(nDiag)*slots)
		diags := ltckks.Diagonals[float64]{}
		for k, d := range i64s(diag, nDiag) {
			if d <= -int64(slots) || d >= int64(slots) {
				return fmt.Errorf("diagonal index %d out of range", d)
			}
			idx := int((d + int64(slots)) % int64(slots))
			if _, dup := diags[idx]; dup {
				return fmt.Errorf("diagonal %d given twice", idx)
			}
			v := make([]float64, slots)
			copy(v, vals[k*slots:(k+1)*slots])
			diags[idx] = v
		}
		scale := rlwe.NewScale(c.params.Q()[lvl])
		if logScale > 0 {
			if logScale > 120 {
				return fmt.Errorf("log2 scale %g too large", float64(logScale))
			}
			scale = rlwe.NewScale(math.Exp2(float64(logScale)))
		}
		ltp := ltckks.Parameters{
			DiagonalsIndexList:        diags.DiagonalsIndexList(),
			LevelQ:                    lvl,
			LevelP:                    c.params.MaxLevelP(),
			Scale:                     scale,
			LogDimensions:             ring.Dimensions{Rows: 0, Cols: c.params.LogMaxSlots()},
			LogBabyStepGiantStepRatio: int(logRatio),
		}
		lt := ltckks.NewTransformation(c.params, ltp)
		if err := ltckks.Encode(c.encoder, diags, lt); err != nil {
			return err
		}
		*out = C.int64_t(put(&ltObj{ctx: c, lt: lt}))
		return nil
	})
}

// clg_lt_galois_elements: the Galois elements the transformation's evaluation needs (n of them
// written into out when n <= cap; *n is always set).
//
//export clg_lt_galois_elements
func clg_lt_galois_elements(lth C.int64_t, out *C.uint64_t, cap_ C.int, n *C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(lth, "linear transformation", errbuf, errlen, func(l *ltObj) error {
		var els []uint64
		for _, g := range l.lt.GaloisElements(l.ctx.params) {
			if g != 1 { // the identity needs no key
				els = append(els, g)
			}
		}
		*n = C.int(len(els))
		if len(els) <= int(cap_) && len(els) > 0 {
			copy(unsafe.Slice((*uint64)(unsafe.Pointer(out)), len(els)), els)
		}
		return nil
	})
}

// clg_lt_eval: M(ct) by the BSGS algorithm with hoisted baby steps (Lattigo's lintrans), no rescale.
//
//export clg_lt_eval
func clg_lt_eval(evh C.int64_t, cth C.int64_t, lth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(evh, "Galois key set", cth, "ciphertext", "", errbuf, errlen, func(e *evkObj, c *ctObj) error {
		l, err := getIn[*ltObj](lth, "linear transformation", "ciphertext, keys and transformation belong to different contexts", e, c)
		if err != nil {
			return err
		}
		if c.ct.Degree() != 1 {
			return errors.New("linear transformation needs a degree-1 ciphertext")
		}
		for _, g := range l.lt.GaloisElements(e.ctx.params) {
			if _, ok := e.set.GaloisKeys[g]; !ok && g != 1 {
				return fmt.Errorf("the key set lacks the Galois key for element %d", g)
			}
		}
		e.ltOnce.Do(func() { e.ltEval = ltckks.NewEvaluator(e.eval) })
		res := ckks.NewCiphertext(e.ctx.params, 1, min(c.ct.Level(), l.lt.LevelQ))
		if err := e.ltEval.Evaluate(c.ct, l.lt, res); err != nil {
			return err
		}
		*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: res}))
		return nil
	})
}

// ----------------------------------------------------------------------------- offload matmul

// clg_bsgs_new: an empty encoded matrix for cipherlm's offload BSGS matmul: nBlocks output
// blocks of m diagonals, g baby steps (giant steps of g slots), the chunk sum's rotation
// steps, plaintexts at `level` with scale 2^logScale.  clg_bsgs_set fills one block.  parts > 1:
// the input comes as that many ciphertexts, each with its own m diagonals per block, and every
// (block, giant step) unit sums the products of all of them before its one rescale and giant
// rotation (cipherlm/he/matmul.py MatmulPlan.in_cts).
//
//export clg_bsgs_new
func clg_bsgs_new(h C.int64_t, nBlocks C.int, m C.int, g C.int, parts C.int, chunk *C.int64_t, nChunk C.int, level C.int,
	logScale C.double, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		slots := c.params.MaxSlots()
		if nBlocks < 1 || nBlocks > 1<<16 || m < 1 || int(m) > slots || g < 1 || g > m || parts < 1 ||
			parts > 1<<12 {
			return fmt.Errorf("bad matmul shape: %d blocks, %d diagonals, %d baby steps, %d input ciphertexts",
				int(nBlocks), int(m), int(g), int(parts))
		}
		lvl := int(level)
		if lvl < 1 || lvl > c.params.MaxLevel() {
			return fmt.Errorf("level %d out of range [1, %d] (the product is rescaled)", lvl, c.params.MaxLevel())
		}
		if !(logScale > 0 && logScale <= 120) {
			return fmt.Errorf("log2 scale %g out of range", float64(logScale))
		}
		var steps []int
		if nChunk > 0 {
			for _, s := range i64s(chunk, nChunk) {
				if s <= 0 || s >= int64(slots) {
					return fmt.Errorf("chunk-sum step %d out of range", s)
				}
				steps = append(steps, int(s))
			}
		}
		b := &bsgsObj{ctx: c, nBlocks: int(nBlocks), m: int(m), g: int(g), parts: int(parts), chunkSteps: steps,
			level: lvl, scale: rlwe.NewScale(math.Exp2(float64(logScale))), maxRep: 1,
			pts: make([][]*bsgsDiag, int(nBlocks)), units: make([][][]*bsgsDiag, int(nBlocks))}
		for o := range b.pts {
			b.pts[o] = make([]*bsgsDiag, b.parts*b.m)
			b.units[o] = b.unitDiagonals(o)
		}
		*out = C.int64_t(put(b))
		return nil
	})
}

// clg_bsgs_set: encode block `block`'s parts x m diagonals (re, im: parts x m rows of `width`
// float64, input p's diagonal k in row p m + k; nonzero[k] == 0: diagonal k is all zero and not
// stored), `workers` goroutines.  width: the slots, or a power of two dividing them for diagonals
// of that period (a packed plan's with one chunk: one token lane), encoded sparse (the slot
// vector is the row repeated slots / width times).
//
//export clg_bsgs_set
func clg_bsgs_set(bh C.int64_t, block C.int, re *C.double, im *C.double, width C.int, nonzero *C.uchar, workers C.int,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(bh, "encoded matrix", errbuf, errlen, func(b *bsgsObj) error {
		if block < 0 || int(block) >= b.nBlocks {
			return fmt.Errorf("block %d out of range", int(block))
		}
		slots := int(width)
		if slots < 1 || slots > b.ctx.params.MaxSlots() || slots&(slots-1) != 0 {
			return fmt.Errorf("diagonal width %d is not a power of two dividing %d slots", slots, b.ctx.params.MaxSlots())
		}
		logSlots := bits.TrailingZeros(uint(slots))
		nd := b.parts * b.m
		r := unsafe.Slice((*float64)(unsafe.Pointer(re)), nd*slots)
		ii := unsafe.Slice((*float64)(unsafe.Pointer(im)), nd*slots)
		nz := unsafe.Slice((*byte)(unsafe.Pointer(nonzero)), nd)
		pts := make([]*bsgsDiag, nd)
		errs := make([]error, nd)
		w := max(1, min(int(workers), runtime.NumCPU()))
		var wg sync.WaitGroup
		for t := 0; t < w; t++ {
			wg.Add(1)
			go func(t int) {
				defer wg.Done()
				v := make([]complex128, slots)
				ringQ := b.ctx.params.RingQ().AtLevel(b.level)
				var compact ring.Poly // sparseDiag's scratch
				for k := t; k < nd; k += w {
					if nz[k] == 0 {
						continue
					}
					for s := 0; s < slots; s++ {
						v[s] = complex(r[k*slots+s], ii[k*slots+s])
					}
					if gap := b.ctx.params.MaxSlots() / slots; gap > 1 && gap <= b.maxRep {
						if compact.N() == 0 {
							compact = ringQ.NewPoly()
						}
						pts[k], errs[k] = sparseDiag(b.ctx.encoder, ringQ, v, logSlots, b.scale, compact)
						continue
					}
					pt := ckks.NewPlaintext(b.ctx.params, b.level)
					pt.Scale = b.scale
					pt.LogDimensions.Cols = logSlots
					if errs[k] = encodeNTT(b.ctx.encoder, v, pt); errs[k] == nil {
						// (in Montgomery form: the products skip Lattigo's per-product MForm)
						pts[k] = newDiag(ringQ, pt, b.maxRep)
					}
				}
			}(t)
		}
		wg.Wait()
		for _, e := range errs {
			if e != nil {
				return e
			}
		}
		b.pts[int(block)] = pts
		b.units[int(block)] = b.unitDiagonals(int(block))
		return nil
	})
}

// clg_bsgs_compress: store the diagonals set from now on (clg_bsgs_set) whose NTT residues come
// in runs of 2, 4, ..., up to maxRep equal values (the diagonals of a packed plan with one chunk,
// maxRep = its tokens T) as one value per run: 1/run of the memory, the same products
// (bsgsDiag).  maxRep 1: whole plaintexts (the default).
//
//export clg_bsgs_compress
func clg_bsgs_compress(bh C.int64_t, maxRep C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(bh, "encoded matrix", errbuf, errlen, func(b *bsgsObj) error {
		r := int(maxRep)
		if r < 1 || r > prodTile || r&(r-1) != 0 {
			return fmt.Errorf("run length %d is not a power of two in [1, %d]", r, prodTile)
		}
		b.maxRep = r
		return nil
	})
}

// clg_bsgs_words: the 64-bit words the stored diagonals keep (their memory / 8).
//
//export clg_bsgs_words
func clg_bsgs_words(bh C.int64_t, n *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(bh, "encoded matrix", errbuf, errlen, func(b *bsgsObj) error {
		var k int64
		for _, row := range b.pts {
			for _, p := range row {
				if p != nil {
					k += p.words()
				}
			}
		}
		*n = C.int64_t(k)
		return nil
	})
}

// clg_bsgs_plaintexts: the number of stored (non-zero) diagonal plaintexts.
//
//export clg_bsgs_plaintexts
func clg_bsgs_plaintexts(bh C.int64_t, n *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(bh, "encoded matrix", errbuf, errlen, func(b *bsgsObj) error {
		k := 0
		for _, row := range b.pts {
			for _, p := range row {
				if p != nil {
					k++
				}
			}
		}
		*n = C.int64_t(k)
		return nil
	})
}

// clg_bsgs_eval: the offload matmul of the input ciphertexts cts[0 .. nCts-1] (nCts = the matrix's
// parts; cipherlm/he/matmul.py evaluate_blocks): baby steps rot(x_p, j), j < g, of every input,
// hoisted (one decomposition per input and worker); for every (block o, giant step i)
// rot(rescale(sum_p sum_j diag_{p, ig+j} * rot(x_p, j)), ig) accumulated per block; then the chunk
// sum acc += rot(acc, s) for each chunk step.  The (o, i) units and the baby steps are shared out
// over `workers` goroutines (Lattigo v6.2's evaluator may be called concurrently).  The products
// and giant steps are bsgsGiantFast's (bsgs_kernels.go) for the offload parameters (level 1, one
// special prime), bsgsGiantGeneric's otherwise.  out[o]: the
// block's result (one level below the plaintexts), 0 when all its diagonals are zero.  counts:
// rotations, products, additions, rescales.
//
//export clg_bsgs_eval
func clg_bsgs_eval(evh C.int64_t, cths *C.int64_t, nCts C.int, bh C.int64_t, workers C.int, out *C.int64_t,
	counts *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(evh, "Galois key set", bh, "encoded matrix", "keys and matrix belong to different contexts", errbuf,
		errlen, func(e *evkObj, b *bsgsObj) error {
			if int(nCts) != b.parts {
				return fmt.Errorf("the matrix takes %d input ciphertexts, got %d", b.parts, int(nCts))
			}
			ins := make([]*rlwe.Ciphertext, b.parts)
			var c *ctObj
			for p, h := range i64s(cths, nCts) {
				cp, err := getIn[*ctObj](C.int64_t(h), "ciphertext", "ciphertext, keys and matrix belong to different contexts", e)
				if err != nil {
					return err
				}
				if cp.ct.Degree() != 1 || cp.ct.Level() != b.level {
					return fmt.Errorf("the input must be a degree-1 ciphertext at level %d (got degree %d, level %d)",
						b.level, cp.ct.Degree(), cp.ct.Level())
				}
				if p > 0 && cp.ct.Scale.Cmp(ins[0].Scale) != 0 {
					return errors.New("the input ciphertexts must have one scale")
				}
				if p == 0 {
					c = cp
				}
				ins[p] = cp.ct
			}
			params := c.ctx.params
			needed := []int{}
			for j := 1; j < b.g; j++ {
				needed = append(needed, j)
			}
			for i := 1; i*b.g < b.m; i++ {
				needed = append(needed, i*b.g)
			}
			needed = append(needed, b.chunkSteps...)
			for _, s := range needed {
				if _, ok := e.set.GaloisKeys[params.GaloisElement(s)]; !ok {
					return fmt.Errorf("the key set lacks the rotation by %d", s)
				}
			}
			w := max(1, min(int(workers), 64))
			eval := e.eval

			// baby steps of every input (input p's step j at p g + j), hoisted, in pooled scratch
			// (they live only in this call); the (input, step) pairs in contiguous shares over the
			// workers, so that a worker decomposes each input it touches once
			baby := make([]*rlwe.Ciphertext, b.parts*b.g)
			frees := make([]func(), 0, len(baby))
			var pairs [][2]int
			for p := 0; p < b.parts; p++ {
				baby[p*b.g] = ins[p]
				for j := 1; j < b.g; j++ {
					var free func()
					baby[p*b.g+j], free = scratchCiphertext(params, b.level)
					frees = append(frees, free)
					pairs = append(pairs, [2]int{p, j})
				}
			}
			defer func() {
				for _, f := range frees {
					f()
				}
			}()
			err := parallel(w, func(t int) error {
				mine := pairs[t*len(pairs)/w : (t+1)*len(pairs)/w]
				for len(mine) > 0 {
					p := mine[0][0]
					var steps []int
					res := map[int]*rlwe.Ciphertext{}
					for len(mine) > 0 && mine[0][0] == p {
						j := mine[0][1]
						steps = append(steps, j)
						res[j] = baby[p*b.g+j]
						mine = mine[1:]
					}
					if err := rotateHoisted(eval, ins[p], steps, res); err != nil {
						return err
					}
					for _, j := range steps {
						baby[p*b.g+j] = res[j]
					}
				}
				return nil
			})
			if err != nil {
				return err
			}

			// the (block, giant step) units that have a non-zero diagonal
			var units []bsgsUnit
			nGiant := (b.m + b.g - 1) / b.g
			for o := 0; o < b.nBlocks; o++ {
				for i := 0; i < nGiant; i++ {
					for _, pt := range b.diagonals(bsgsUnit{o, i}) {
						if pt != nil {
							units = append(units, bsgsUnit{o, i})
							break
						}
					}
				}
			}
			levelP := params.MaxLevelP()
			galKeys := map[int]*rlwe.GaloisKey{}
			rotIdx := map[int][]uint64{}
			for i := 1; i < nGiant; i++ {
				gk, ok := e.set.GaloisKeys[params.GaloisElement(i*b.g)]
				if !ok || gk.LevelP() != levelP {
					return fmt.Errorf("no usable key for the giant step %d", i*b.g)
				}
				galKeys[i] = gk
				rotIdx[i] = eval.AutomorphismIndex(params.GaloisElement(i * b.g))
			}
			var sums []*rlwe.Ciphertext
			var total [4]int64
			if bsgsFastPath(params, b, galKeys) {
				sums, total, err = bsgsGiantFast(eval, params, b, c.ct, baby, units, galKeys, rotIdx, w)
			} else {
				sums, total, err = bsgsGiantGeneric(eval, params, b, baby, units, galKeys, rotIdx, w)
			}
			if err != nil {
				return err
			}
			total[0] += int64(b.parts * (b.g - 1))
			var chunkCnt [2]int64
			var cmu sync.Mutex
			err = parallel(w, func(t int) error {
				var rot, add int64
				for o := t; o < b.nBlocks; o += w {
					y := sums[o]
					if y == nil {
						continue
					}
					for _, s := range b.chunkSteps {
						r := ckks.NewCiphertext(params, 1, y.Level())
						if err := rotate(eval, y, s, r); err != nil {
							return err
						}
						if err := eval.Add(y, r, y); err != nil {
							return err
						}
						rot++
						add++
					}
				}
				cmu.Lock()
				chunkCnt[0] += rot
				chunkCnt[1] += add
				cmu.Unlock()
				return nil
			})
			if err != nil {
				return err
			}
			total[0] += chunkCnt[0]
			total[2] += chunkCnt[1]
			dst := unsafe.Slice((*int64)(unsafe.Pointer(out)), b.nBlocks)
			for o, y := range sums {
				if y == nil {
					dst[o] = 0
				} else {
					dst[o] = put(&ctObj{ctx: c.ctx, ct: y})
				}
			}
			cs := unsafe.Slice((*int64)(unsafe.Pointer(counts)), 4)
			copy(cs, total[:])
			return nil
		})
}

// clg_copy: a deep copy of a ciphertext.
//
//export clg_copy
func clg_copy(cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: c.ct.CopyNew()}))
		return nil
	})
}

// clg_ct_info: level, degree, log2 scale, NTT flag of a ciphertext (kind 0) or plaintext (kind 1).
//
//export clg_ct_info
func clg_ct_info(h C.int64_t, kind C.int, level *C.int, degree *C.int, logScale *C.double, isNTT *C.int,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return call(errbuf, errlen, func() error {
		var md *rlwe.MetaData
		if kind == 0 {
			c, err := get[*ctObj](h, "ciphertext")
			if err != nil {
				return err
			}
			*level, *degree, md = C.int(c.ct.Level()), C.int(c.ct.Degree()), c.ct.MetaData
		} else {
			p, err := get[*ptObj](h, "plaintext")
			if err != nil {
				return err
			}
			*level, *degree, md = C.int(p.pt.Level()), 0, p.pt.MetaData
		}
		*logScale = C.double(math.Log2(md.Scale.Float64()))
		*isNTT = 0
		if md.IsNTT {
			*isNTT = 1
		}
		return nil
	})
}

// clg_ct_coeffs: a copy of the ciphertext's RNS coefficients, (degree+1, level+1, N) uint64, as stored
// (NTT form for CKKS).
//
//export clg_ct_coeffs
func clg_ct_coeffs(cth C.int64_t, dst *C.uint64_t, n C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		N, L := c.ctx.params.N(), c.ct.Level()+1
		want := (c.ct.Degree() + 1) * L * N
		if int(n) != want {
			return fmt.Errorf("buffer of %d words for %d", int64(n), want)
		}
		d := unsafe.Slice((*uint64)(unsafe.Pointer(dst)), want)
		for i, poly := range c.ct.Value {
			for j := 0; j < L; j++ {
				copy(d[(i*L+j)*N:(i*L+j+1)*N], poly.Coeffs[j][:N])
			}
		}
		return nil
	})
}

// ----------------------------------------------------------------------------- serialisation
//
// Ciphertext: "CLGC" | version u8 | degree u8 | level u8 | isNTT u8 | logSlots u8 | 3 zero bytes |
//             scale float64 LE | (degree+1)(level+1)N uint64 LE coefficients (poly, prime, index).
// Seeded:     "CLGS" | the same 16 header bytes | 32-byte seed of c1 | c0's rows j = 0..level,
//             each its N coefficients bit-packed with b_j = bits.Len64(q_j - 1) bits apiece
//             (coefficient i at bits i*b_j .. (i+1)*b_j - 1 of the row, LSB first, bytes in
//             order), the row zero-padded to ceil(N b_j / 8) bytes (`seededLen`).
// Public key:  "CLGP" | version u8 | 3 zero bytes | the 2 QP polys of the key, raw (prime-major).
// Galois keys: "CLGK" | version u8 | flag u8 | 2 zero bytes | count u32 | count x (galEl u64 | key).
//             flag 0: the key's polys raw; flag 2 (compressed): a 32-byte seed, then the degree-0
//             polys (the uniform halves are expanded from the seed on loading), each row
//             bit-packed as the seeded ciphertext's c0 rows (primeBits of its prime a residue).
//             (Flag 1, the compressed polys as uint64 words, is no longer written or read.)
// Key polynomials are written in Lattigo's (NTT, Montgomery) representation; their shape is the one
// rlwe.NewPublicKey / rlwe.NewGaloisKey allocate for the parameters, so the reader knows every size.
// wireVersion 2: the seeded ciphertext's c0 bit-packed (version 1 wrote it as uint64 words).

const (
	wireVersion = 2
	ctHeader    = 20
	seedLen     = 32
	keyHeader   = 8
)

func writeU64s(b []byte, v []uint64) []byte {
	for _, x := range v {
		b = binary.LittleEndian.AppendUint64(b, x)
	}
	return b
}

// readReduced fills dst from b (len(dst)*8 bytes), checking every value is < q.
func readReduced(dst []uint64, b []byte, q uint64) error {
	for i := range dst {
		x := binary.LittleEndian.Uint64(b[8*i:])
		if x >= q {
			return fmt.Errorf("coefficient %d not reduced modulo %d", x, q)
		}
		dst[i] = x
	}
	return nil
}

// primeBits: the bits of a residue modulo q, bits.Len64(q - 1).
func primeBits(q uint64) int { return bits.Len64(q - 1) }

// packedRowLen: the bytes of one bit-packed row of n residues modulo q.
func packedRowLen(n int, q uint64) int { return (n*primeBits(q) + 7) / 8 }

// seededLen: the length of a seeded ciphertext ("CLGS") at `level` with ring degree n.
func seededLen(q []uint64, n, level int) int {
	l := ctHeader + seedLen
	for j := 0; j <= level; j++ {
		l += packedRowLen(n, q[j])
	}
	return l
}

// appendPacked appends row (every value < 2^w, 1 <= w <= 64) bit-packed with w bits a value,
// LSB first, the last byte zero-padded.
func appendPacked(b []byte, row []uint64, w int) []byte {
	var acc uint64 // the pending bits, n of them (< 64 between values), emitted a word at a time
	n := 0
	for _, x := range row {
		acc |= x << n
		if n+w >= 64 {
			b = binary.LittleEndian.AppendUint64(b, acc)
			acc = x >> (64 - n) // Go: a shift by 64 gives 0
			n += w - 64
		} else {
			n += w
		}
	}
	for ; n > 0; n -= 8 {
		b = append(b, byte(acc))
		acc >>= 8
	}
	return b
}

// readPacked fills dst from b (exactly packedRowLen(len(dst), q) bytes, w = primeBits(q)),
// checking every value is < q and the padding bits are zero.
func readPacked(dst []uint64, b []byte, q uint64) error {
	w := primeBits(q)
	if len(b) != packedRowLen(len(dst), q) {
		return fmt.Errorf("packed row of %d bytes, expected %d", len(b), packedRowLen(len(dst), q))
	}
	mask := uint64(1)<<w - 1 // all ones for w = 64 (Go's shift by 64 gives 0)
	var acc uint64           // n unread bits, read a word at a time (the last one zero-padded)
	n, pos := 0, 0
	var tail [8]byte
	for i := range dst {
		v := acc
		if n < w {
			var word uint64
			if pos+8 <= len(b) {
				word = binary.LittleEndian.Uint64(b[pos:])
			} else {
				clear(tail[:])
				copy(tail[:], b[pos:])
				word = binary.LittleEndian.Uint64(tail[:])
			}
			pos += 8
			v |= word << n
			acc = word >> (w - n) // Go: a shift by 64 gives 0
			n += 64 - w
		} else {
			acc >>= w
			n -= w
		}
		v &= mask
		if v >= q {
			return fmt.Errorf("coefficient %d not reduced modulo %d", v, q)
		}
		dst[i] = v
	}
	if acc != 0 {
		return errors.New("nonzero padding bits in a packed row")
	}
	return nil
}

func qpPolys(v []ringqp.Poly) []*ring.Poly {
	var ps []*ring.Poly
	for i := range v {
		ps = append(ps, &v[i].Q)
		if v[i].P.Coeffs != nil {
			ps = append(ps, &v[i].P)
		}
	}
	return ps
}

func gkPolys(gk *rlwe.GaloisKey) []*ring.Poly { return evkPolys(&gk.EvaluationKey) }

// moduliOf: the primes of a key polynomial (Q or P part), identified by its row count and position.
func writePolys(b []byte, ps []*ring.Poly) []byte {
	for _, p := range ps {
		for _, row := range p.Coeffs {
			b = writeU64s(b, row)
		}
	}
	return b
}

func polysWords(ps []*ring.Poly) int {
	w := 0
	for _, p := range ps {
		for _, row := range p.Coeffs {
			w += len(row)
		}
	}
	return w
}

// readQPPolys fills the (already shaped) QP polynomials of the context's key shapes from b.
func readQPPolys(c *ctxObj, v []ringqp.Poly, b []byte) ([]byte, error) {
	return readQP(v, c.params.Q(), c.params.P(), b)
}

// rowFormat: how one key row of n residues modulo q is stored: its byte length and a reader that
// checks every value reduced (wordRows: 64-bit words; packedRows: bit-packed, appendPacked).
type rowFormat struct {
	size func(n int, q uint64) int
	read func(dst []uint64, b []byte, q uint64) error
}

var (
	wordRows   = rowFormat{size: func(n int, _ uint64) int { return 8 * n }, read: readReduced}
	packedRows = rowFormat{size: packedRowLen, read: readPacked}
)

// readQP fills the (already shaped) QP polynomials from b with the moduli q (Q parts) and p (P
// parts) as 64-bit words; every word must be reduced.  Returns the rest of b.
func readQP(v []ringqp.Poly, q, p []uint64, b []byte) ([]byte, error) {
	return readQPRows(v, q, p, b, wordRows)
}

// readQPRows: readQP with the rows stored in the given format.
func readQPRows(v []ringqp.Poly, q, p []uint64, b []byte, rows rowFormat) ([]byte, error) {
	for i := range v {
		for part, poly := range []*ring.Poly{&v[i].Q, &v[i].P} {
			mods := q
			if part == 1 {
				mods = p
			}
			if len(poly.Coeffs) > len(mods) {
				return nil, errors.New("key shape exceeds the moduli")
			}
			for j, row := range poly.Coeffs {
				need := rows.size(len(row), mods[j])
				if len(b) < need {
					return nil, errors.New("truncated key")
				}
				if err := rows.read(row, b[:need], mods[j]); err != nil {
					return nil, err
				}
				b = b[need:]
			}
		}
	}
	return b, nil
}

func ctHeaderBytes(magic string, ct *rlwe.Ciphertext) []byte {
	b := append([]byte(magic), wireVersion, byte(ct.Degree()), byte(ct.Level()))
	ntt := byte(0)
	if ct.IsNTT {
		ntt = 1
	}
	b = append(b, ntt, byte(ct.LogDimensions.Cols), 0, 0, 0)
	return binary.LittleEndian.AppendUint64(b, math.Float64bits(ct.Scale.Float64()))
}

//export clg_ct_to_bytes
func clg_ct_to_bytes(cth C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		bytesOut(ctBytes(c, false), out, outLen)
		return nil
	})
}

// clg_ct_to_bytes_packed: clg_ct_to_bytes with every row bit-packed at its prime's bit length
// ("CLGP"; clg_ct_from_bytes reads both): the offload results (docs/offload.md).
//
//export clg_ct_to_bytes_packed
func clg_ct_to_bytes_packed(cth C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(cth, "ciphertext", errbuf, errlen, func(c *ctObj) error {
		bytesOut(ctBytes(c, true), out, outLen)
		return nil
	})
}

// ctBytes: header ("CLGC", or "CLGP" when packed), then the rows of every polynomial, as
// 64-bit words or bit-packed at their primes' lengths.
func ctBytes(c *ctObj, packed bool) []byte {
	ct := c.ct
	N, L := c.ctx.params.N(), ct.Level()+1
	q := c.ctx.params.Q()
	magic := "CLGC"
	if packed {
		magic = "CLGP"
	}
	b := make([]byte, 0, ctHeader+8*(ct.Degree()+1)*L*N)
	b = append(b, ctHeaderBytes(magic, ct)...)
	for _, poly := range ct.Value {
		for j := 0; j < L; j++ {
			if packed {
				b = appendPacked(b, poly.Coeffs[j][:N], primeBits(q[j]))
			} else {
				b = writeU64s(b, poly.Coeffs[j][:N])
			}
		}
	}
	return b
}

// seedStream: the PRG that expands every seed of this library (seeded ciphertexts, the fhe
// refresh masks): the keystream of AES-256 in counter mode keyed by the 32-byte seed, from a
// zero counter (the expansion of Kyber's "90s" variant; crypto/aes runs on AES-NI).  It
// replaced Lattigo's KeyedPRNG (a BLAKE2b XOF), which took ~5 % of a BLB layer's CPU.
type seedStream struct{ s cipher.Stream }

func newSeedStream(seed []byte) (*seedStream, error) {
	if len(seed) != 32 {
		return nil, fmt.Errorf("seed of %d bytes (want 32)", len(seed))
	}
	b, err := aes.NewCipher(seed)
	if err != nil {
		return nil, err
	}
	return &seedStream{s: cipher.NewCTR(b, make([]byte, aes.BlockSize))}, nil
}

// Read fills out with the next bytes of the keystream.
func (p *seedStream) Read(out []byte) (int, error) {
	clear(out)
	p.s.XORKeyStream(out, out)
	return len(out), nil
}

// expandUniform: the uniform polynomial (read as NTT form) at `level` that a 32-byte seed expands to
// (`seedStream` through Lattigo's uniform sampler; both sides run this same code).
func expandUniform(c *ctxObj, seed []byte, level int) (ring.Poly, error) {
	prng, err := newSeedStream(seed)
	if err != nil {
		return ring.Poly{}, err
	}
	rq := c.params.RingQ().AtLevel(level)
	a := rq.NewPoly()
	ring.NewUniformSampler(prng, rq).Read(a)
	return a, nil
}

// clg_encrypt_seeded: symmetric encryption whose uniform half is expanded from a fresh random
// 32-byte seed, serialised as "CLGS" | the ciphertext header fields | seed | c0 bit-packed (each
// row j with bits.Len64(q_j - 1) bits a coefficient: under half the size).
// c0 = m + e - a s in NTT form, a = expandUniform(seed) (read as NTT residues, as Lattigo's own
// symmetric encryption reads its c1), e from the parameters' error distribution (Xe) drawn with
// AES-CTR under a second, secret, fresh key from crypto/rand: one sampling of a and one product,
// where a Lattigo encryption followed by the swap of c1 for a took two of each.
//
//export clg_encrypt_seeded
func clg_encrypt_seeded(skh C.int64_t, ph C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(skh, "secret key", ph, "plaintext", "", errbuf, errlen, func(s *skObj, p *ptObj) error {
		b, err := s.encryptSeeded(p.pt)
		if err == nil {
			bytesOut(b, out, outLen)
		}
		return err
	})
}

// encryptSeeded: clg_encrypt_seeded's blob for pt.
func (s *skObj) encryptSeeded(pt *rlwe.Plaintext) ([]byte, error) {
	if !pt.IsNTT || pt.IsMontgomery {
		return nil, errors.New("seeded encryption expects an NTT, non-Montgomery plaintext")
	}
	lvl := min(pt.Level(), s.ctx.params.MaxLevel())
	var keys [2 * seedLen]byte // the public seed of a, then the secret key of e's stream
	defer clear(keys[seedLen:])
	if _, err := rand.Read(keys[:]); err != nil {
		return nil, err
	}
	seed := keys[:seedLen]
	a, err := expandUniform(s.ctx, seed, lvl)
	if err != nil {
		return nil, err
	}
	noise, err := newSeedStream(keys[seedLen:])
	if err != nil {
		return nil, err
	}
	rq := s.ctx.params.RingQ().AtLevel(lvl)
	xe, err := ring.NewSampler(noise, rq, s.ctx.params.Xe(), false)
	if err != nil {
		return nil, err
	}
	ct := rlwe.NewCiphertext(s.ctx.params, 1, lvl)
	*ct.MetaData = *pt.MetaData
	c0 := ct.Value[0]
	xe.Read(c0)
	for j, sub := range rq.SubRings[:lvl+1] { // the AVX-512 transform where it is there
		nttOf(sub).Forward(c0.Coeffs[j], c0.Coeffs[j])
	}
	rq.Add(c0, pt.Value, c0)
	rq.MulCoeffsMontgomeryThenSub(a, s.sk.Value.Q, c0) // sk is in Montgomery form
	N, L, q := s.ctx.params.N(), lvl+1, s.ctx.params.Q()
	b := make([]byte, 0, seededLen(q, N, lvl))
	b = append(b, ctHeaderBytes("CLGS", ct)...)
	b = append(b, seed...)
	for j := 0; j < L; j++ {
		b = appendPacked(b, c0.Coeffs[j][:N], primeBits(q[j]))
	}
	return b, nil
}

// clg_ct_from_bytes: validate and load a peer's ciphertext; wantLevel >= 0 requires that level.
//
//export clg_ct_from_bytes
func clg_ct_from_bytes(h C.int64_t, buf *C.uchar, n C.int64_t, wantLevel C.int, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		b := bytesIn(buf, n)
		if len(b) < ctHeader {
			return fmt.Errorf("ciphertext blob of %d bytes is shorter than its %d-byte header", len(b), ctHeader)
		}
		seeded, packed := string(b[:4]) == "CLGS", string(b[:4]) == "CLGP"
		if (string(b[:4]) != "CLGC" && !seeded && !packed) || b[4] != wireVersion {
			return errors.New("not a cipherlm/Lattigo ciphertext (bad magic or version)")
		}
		degree, level, ntt, logSlots := int(b[5]), int(b[6]), b[7], int(b[8])
		if degree != 1 {
			return fmt.Errorf("ciphertext degree %d (only 1 is accepted)", degree)
		}
		if level > c.params.MaxLevel() {
			return fmt.Errorf("ciphertext level %d above the maximum %d", level, c.params.MaxLevel())
		}
		if wantLevel >= 0 && level != int(wantLevel) {
			return fmt.Errorf("ciphertext at level %d, expected %d", level, int(wantLevel))
		}
		if ntt != 1 {
			return errors.New("CKKS ciphertexts must be in NTT form")
		}
		if logSlots > c.params.LogMaxSlots() || b[9] != 0 || b[10] != 0 || b[11] != 0 {
			return errors.New("bad ciphertext header (slots / padding)")
		}
		scale := math.Float64frombits(binary.LittleEndian.Uint64(b[12:20]))
		if math.IsNaN(scale) || math.IsInf(scale, 0) || scale < 1 || scale > math.Exp2(250) {
			return fmt.Errorf("ciphertext scale %g out of range", scale)
		}
		N, L := c.params.N(), level+1
		q := c.params.Q()
		want := ctHeader + 8*(degree+1)*L*N
		if seeded {
			want = seededLen(q, N, level)
		} else if packed {
			want = ctHeader
			for j := 0; j < L; j++ {
				want += (degree + 1) * packedRowLen(N, q[j])
			}
		}
		if len(b) != want {
			kind := "ciphertext"
			if seeded {
				kind = "seeded ciphertext"
			}
			return fmt.Errorf("%s blob of %d bytes, expected %d for level %d", kind, len(b), want, level)
		}
		ct := ckks.NewCiphertext(c.params, degree, level)
		off := ctHeader
		if seeded {
			a, err := expandUniform(c, b[ctHeader:ctHeader+seedLen], level)
			if err != nil {
				return err
			}
			ct.Value[1].Copy(a)
			off += seedLen
			for j := 0; j < L; j++ {
				rl := packedRowLen(N, q[j])
				if err := readPacked(ct.Value[0].Coeffs[j][:N], b[off:off+rl], q[j]); err != nil {
					return fmt.Errorf("seeded ciphertext, c0 row %d: %w", j, err)
				}
				off += rl
			}
		} else {
			for i := 0; i <= degree; i++ {
				for j := 0; j < L; j++ {
					rl := 8 * N
					read := readReduced
					if packed {
						rl, read = packedRowLen(N, q[j]), readPacked
					}
					if err := read(ct.Value[i].Coeffs[j][:N], b[off:off+rl], q[j]); err != nil {
						return err
					}
					off += rl
				}
			}
		}
		ct.IsNTT = true
		ct.Scale = rlwe.NewScale(scale)
		ct.LogDimensions = ring.Dimensions{Rows: 0, Cols: logSlots}
		*out = C.int64_t(put(&ctObj{ctx: c, ct: ct}))
		return nil
	})
}

//export clg_pk_to_bytes
func clg_pk_to_bytes(pkh C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(pkh, "public key", errbuf, errlen, func(k *pkObj) error {
		b := []byte{'C', 'L', 'G', 'P', wireVersion, 0, 0, 0}
		bytesOut(writePolys(b, qpPolys(k.pk.Value)), out, outLen)
		return nil
	})
}

//export clg_pk_from_bytes
func clg_pk_from_bytes(h C.int64_t, buf *C.uchar, n C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		b := bytesIn(buf, n)
		pk := rlwe.NewPublicKey(c.params)
		want := keyHeader + 8*polysWords(qpPolys(pk.Value))
		if len(b) != want {
			return fmt.Errorf("public key blob of %d bytes, expected %d", len(b), want)
		}
		if string(b[:4]) != "CLGP" || b[4] != wireVersion || b[5] != 0 || b[6] != 0 || b[7] != 0 {
			return errors.New("not a cipherlm/Lattigo public key (bad header)")
		}
		if _, err := readQPPolys(c, pk.Value, b[keyHeader:]); err != nil {
			return err
		}
		*out = C.int64_t(put(&pkObj{ctx: c, pk: pk, enc: rlwe.NewEncryptor(c.params, pk)}))
		return nil
	})
}

//export clg_pk_of_sk
func clg_pk_of_sk(skh C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		pk := rlwe.NewKeyGenerator(s.ctx.params).GenPublicKeyNew(s.sk)
		*out = C.int64_t(put(&pkObj{ctx: s.ctx, pk: pk, enc: rlwe.NewEncryptor(s.ctx.params, pk)}))
		return nil
	})
}

func (c *ctxObj) galoisKeyWords() int {
	c.gkOnce.Do(func() { c.gkSize = polysWords(gkPolys(rlwe.NewGaloisKey(c.params))) })
	return c.gkSize
}

var compressedKey = rlwe.EvaluationKeyParameters{Compressed: true}

// packedKeysFlag: the Galois key blob flag of seeded keys with bit-packed rows.
const packedKeysFlag = 2

// packedGaloisKeyBytes: the bytes of one seeded Galois key's bit-packed polys (appendPackedKey).
func (c *ctxObj) packedGaloisKeyBytes() int {
	c.gkcOnce.Do(func() {
		gk := rlwe.NewGaloisKey(c.params, compressedKey)
		c.gkcSize = len(appendPackedKey(nil, &gk.EvaluationKey, c.params.Q(), c.params.P()))
	})
	return c.gkcSize
}

// appendPackedKey appends the rows of an evaluation key's QP polys (in readEvk's order), each
// bit-packed with primeBits of its prime (q for the Q parts, p for the P parts).
func appendPackedKey(b []byte, evk *rlwe.EvaluationKey, q, p []uint64) []byte {
	for i := range evk.Value {
		for j := range evk.Value[i] {
			for _, v := range evk.Value[i][j] {
				for part, poly := range []*ring.Poly{&v.Q, &v.P} {
					mods := q
					if part == 1 {
						mods = p
					}
					for r, row := range poly.Coeffs {
						b = appendPacked(b, row, primeBits(mods[r]))
					}
				}
			}
		}
	}
	return b
}

// clg_steps_to_elements: the Galois elements of slot rotations by steps (and conjugation).
//
//export clg_steps_to_elements
func clg_steps_to_elements(h C.int64_t, steps *C.int64_t, n C.int, conj C.int, out *C.uint64_t, cap_ C.int,
	nOut *C.int, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		els, err := galoisElements(c, i64s(steps, n), conj != 0)
		if err != nil {
			return err
		}
		if len(els) > int(cap_) {
			return errors.New("output buffer too small")
		}
		copy(unsafe.Slice((*uint64)(unsafe.Pointer(out)), len(els)), els)
		*nOut = C.int(len(els))
		return nil
	})
}

// clg_galois_keys_compressed: fresh seeded Galois keys for the automorphisms X -> X^g, written
// directly as bytes (flag 1 in the header): per key its element, the 32-byte seed of the uniform
// halves and the degree-0 gadget ciphertext; about half the size of the expanded keys.
//
//export clg_galois_keys_compressed
func clg_galois_keys_compressed(skh C.int64_t, els *C.uint64_t, n C.int, out **C.uchar, outLen *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		gs, err := galoisElementsIn(s.ctx, els, n)
		if err != nil {
			return err
		}
		slices.Sort(gs)
		// one key per element, made on all cores (a key generator per goroutine), written in order
		keys := make([][]byte, len(gs))
		errs := make([]error, len(gs))
		w := max(1, min(runtime.NumCPU(), len(gs)))
		var wg sync.WaitGroup
		for t := 0; t < w; t++ {
			wg.Add(1)
			go func(t int) {
				defer wg.Done()
				kg := rlwe.NewKeyGenerator(s.ctx.params)
				for i := t; i < len(gs); i += w {
					gk := kg.GenGaloisKeyNew(gs[i], s.sk, compressedKey)
					if gk.Seed == nil || !gk.IsCompressed() {
						errs[i] = errors.New("Lattigo returned an uncompressed key")
						continue
					}
					kb := binary.LittleEndian.AppendUint64(nil, gs[i])
					kb = append(kb, gk.Seed[:]...)
					keys[i] = appendPackedKey(kb, &gk.EvaluationKey, s.ctx.params.Q(), s.ctx.params.P())
				}
			}(t)
		}
		wg.Wait()
		b := []byte{'C', 'L', 'G', 'K', wireVersion, packedKeysFlag, 0, 0}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(gs)))
		for i := range gs {
			if errs[i] != nil {
				return errs[i]
			}
			b = append(b, keys[i]...)
		}
		bytesOut(b, out, outLen)
		return nil
	})
}

//export clg_evk_to_bytes
func clg_evk_to_bytes(evh C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(evh, "Galois key set", errbuf, errlen, func(e *evkObj) error {
		els := e.set.GetGaloisKeysList()
		slices.Sort(els) // deterministic bytes (the set is a map)
		b := []byte{'C', 'L', 'G', 'K', wireVersion, 0, 0, 0}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(els)))
		for _, g := range els {
			gk := e.set.GaloisKeys[g]
			b = binary.LittleEndian.AppendUint64(b, g)
			b = writePolys(b, gkPolys(gk))
		}
		bytesOut(b, out, outLen)
		return nil
	})
}

// clg_evk_from_bytes: validate and load a peer's Galois keys (at most maxKeys keys).
//
//export clg_evk_from_bytes
func clg_evk_from_bytes(h C.int64_t, buf *C.uchar, n C.int64_t, maxKeys C.int, out *C.int64_t,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		b := bytesIn(buf, n)
		if len(b) < keyHeader+4 {
			return fmt.Errorf("Galois key blob of %d bytes is shorter than its header", len(b))
		}
		if string(b[:4]) != "CLGK" || b[4] != wireVersion || (b[5] != 0 && b[5] != packedKeysFlag) || b[6] != 0 ||
			b[7] != 0 {
			return errors.New("not a cipherlm/Lattigo Galois key set (bad header)")
		}
		compressed := b[5] == packedKeysFlag
		count := int(binary.LittleEndian.Uint32(b[8:12]))
		if count < 1 || count > int(maxKeys) {
			return fmt.Errorf("%d Galois keys (allowed 1..%d)", count, int(maxKeys))
		}
		per := 8 + 8*c.galoisKeyWords()
		if compressed {
			per = 8 + seedLen + c.packedGaloisKeyBytes()
		}
		if want := keyHeader + 4 + count*per; len(b) != want {
			return fmt.Errorf("Galois key blob of %d bytes, expected %d for %d keys", len(b), want, count)
		}
		twoN := uint64(2 * c.params.N())
		set := rlwe.NewMemEvaluationKeySet(nil)
		rest := b[keyHeader+4:]
		for k := 0; k < count; k++ {
			g := binary.LittleEndian.Uint64(rest[:8])
			if g&1 == 0 || g >= twoN || g == 1 {
				return fmt.Errorf("invalid Galois element %d", g)
			}
			if _, dup := set.GaloisKeys[g]; dup {
				return fmt.Errorf("duplicate Galois element %d", g)
			}
			var gk *rlwe.GaloisKey
			rest = rest[8:]
			var seed [seedLen]byte
			if compressed {
				gk = rlwe.NewGaloisKey(c.params, compressedKey)
				copy(seed[:], rest[:seedLen])
				rest = rest[seedLen:]
			} else {
				gk = rlwe.NewGaloisKey(c.params)
			}
			gk.GaloisElement = g
			rows := wordRows
			if compressed {
				rows = packedRows
			}
			var err error
			if rest, err = readEvkRows(&gk.EvaluationKey, c.params.Q(), c.params.P(), rest, rows); err != nil {
				return err
			}
			if compressed {
				gk.Seed = &seed
				if err := gk.EvaluationKey.Expand(c.params, nil); err != nil {
					return err
				}
				if gk.Degree() != 1 {
					return errors.New("Galois key did not expand")
				}
			}
			set.GaloisKeys[g] = gk
		}
		*out = C.int64_t(put(&evkObj{ctx: c, set: set, eval: ckks.NewEvaluator(c.params, set)}))
		return nil
	})
}

func main() {}

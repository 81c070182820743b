package main

// The AVX-512 NTTs of ntt_avx512.c as ring.NumberTheoreticTransformer values (simdNTT), built
// from a Lattigo subring's own root tables (fastops.go uses them; see there why they are not
// swapped into Lattigo's rings).  A transform is used only after sameTransform found it equal
// to Lattigo's on random polynomials.  CIPHERLM_LATTIGO_SIMD_NTT=0 turns them off (A/B runs).

/*
#include <stdlib.h>
#include "ntt_avx512.h"
*/
import "C"

import (
	"math/bits"
	"math/rand"
	"os"
	"runtime"
	"unsafe"

	"github.com/tuneinsight/lattigo/v6/ring"
	"golang.org/x/sys/cpu"
)

// simdNTTAvailable: the AVX-512 transforms may run (the CPU has AVX-512F and DQ, the C code is
// compiled in, and CIPHERLM_LATTIGO_SIMD_NTT is not 0).
func simdNTTAvailable() bool {
	if os.Getenv("CIPHERLM_LATTIGO_SIMD_NTT") == "0" {
		return false
	}
	return cpu.X86.HasAVX512F && cpu.X86.HasAVX512DQ && C.clg_ntt_compiled() == 1
}

// simdNTT: one prime's tables in C memory (the C code reads them; Go memory holding them
// could not be passed through a C struct).
type simdNTT struct {
	tab *C.clg_ntt_table
	mem unsafe.Pointer
	n   int
}

func (s *simdNTT) Forward(p1, p2 []uint64)      { s.forward(p1, p2, 0) }
func (s *simdNTT) ForwardLazy(p1, p2 []uint64)  { s.forward(p1, p2, 1) }
func (s *simdNTT) Backward(p1, p2 []uint64)     { s.backward(p1, p2, 0) }
func (s *simdNTT) BackwardLazy(p1, p2 []uint64) { s.backward(p1, p2, 1) }

func (s *simdNTT) check(p1, p2 []uint64) {
	if len(p1) < s.n || len(p2) < s.n {
		panic("simdNTT: polynomial shorter than the ring degree")
	}
}

func (s *simdNTT) forward(p1, p2 []uint64, lazy C.int) {
	s.check(p1, p2)
	C.clg_ntt_forward((*C.uint64_t)(unsafe.Pointer(&p2[0])), (*C.uint64_t)(unsafe.Pointer(&p1[0])), s.tab, lazy)
	runtime.KeepAlive(s)
}

func (s *simdNTT) backward(p1, p2 []uint64, lazy C.int) {
	s.check(p1, p2)
	C.clg_ntt_backward((*C.uint64_t)(unsafe.Pointer(&p2[0])), (*C.uint64_t)(unsafe.Pointer(&p1[0])), s.tab, lazy)
	runtime.KeepAlive(s)
}

func shoup(w, q uint64) uint64 {
	quo, _ := bits.Div64(w, 0, q)
	return quo
}

// newSIMDNTT: the tables of one standard subring, from Lattigo's (Montgomery-form) roots.
func newSIMDNTT(s *ring.SubRing) *simdNTT {
	n, q := s.N, s.Modulus
	// fw, fwp, bw, bwp: n each; f4, f4p, f2, f2p, b4, b4p, b2, b2p: n/2 each
	words := 4*n + 8*(n/2)
	mem := C.malloc(C.size_t(words * 8))
	all := unsafe.Slice((*uint64)(mem), words)
	next := func(k int) []uint64 {
		r := all[:k:k]
		all = all[k:]
		return r
	}
	fw, fwp, bw, bwp := next(n), next(n), next(n), next(n)
	for i := 0; i < n; i++ {
		fw[i] = ring.IMForm(s.RootsForward[i], q, s.MRedConstant)
		bw[i] = ring.IMForm(s.RootsBackward[i], q, s.MRedConstant)
		fwp[i], bwp[i] = shoup(fw[i], q), shoup(bw[i], q)
	}
	// expanded roots of the stages t = 4 and t = 2, in the lane order of ntt_avx512.c:
	// block b of 16 coefficients, lane l; t = 4: group 2b + l/4; t = 2: group 4b + l/2
	expand := func(r, rp []uint64, t int) (e, ep []uint64) {
		e, ep = next(n/2), next(n/2)
		m := n / (2 * t) // first root of the stage; a group has t butterflies, one per lane
		for b := 0; b < n/16; b++ {
			for l := 0; l < 8; l++ {
				g := m + (8/t)*b + l/t
				e[8*b+l], ep[8*b+l] = r[g], rp[g]
			}
		}
		return
	}
	f4, f4p := expand(fw, fwp, 4)
	f2, f2p := expand(fw, fwp, 2)
	b4, b4p := expand(bw, bwp, 4)
	b2, b2p := expand(bw, bwp, 2)
	ninv := ring.IMForm(s.NInv, q, s.MRedConstant)
	ptr := func(v []uint64) *C.uint64_t { return (*C.uint64_t)(unsafe.Pointer(&v[0])) }
	tab := (*C.clg_ntt_table)(C.malloc(C.size_t(unsafe.Sizeof(C.clg_ntt_table{}))))
	*tab = C.clg_ntt_table{
		n: C.size_t(n), q: C.uint64_t(q),
		fw: ptr(fw), fwp: ptr(fwp), bw: ptr(bw), bwp: ptr(bwp),
		f4: ptr(f4), f4p: ptr(f4p), f2: ptr(f2), f2p: ptr(f2p),
		b4: ptr(b4), b4p: ptr(b4p), b2: ptr(b2), b2p: ptr(b2p),
		ninv: C.uint64_t(ninv), ninvp: C.uint64_t(shoup(ninv, q)),
	}
	t := &simdNTT{tab: tab, mem: mem, n: n}
	runtime.SetFinalizer(t, func(t *simdNTT) {
		C.free(unsafe.Pointer(t.tab))
		C.free(t.mem)
	})
	return t
}

// sameTransform: a and b agree on random polynomials (exactly, and reduced below q, for
// Forward / Backward; mod q for the lazy variants, whose output ranges differ).
func sameTransform(a, b ring.NumberTheoreticTransformer, n int, q uint64) bool {
	rng := rand.New(rand.NewSource(int64(q)))
	in := make([]uint64, n)
	x, y := make([]uint64, n), make([]uint64, n)
	for trial := 0; trial < 2; trial++ {
		for i := range in {
			in[i] = rng.Uint64() % q
		}
		if trial == 1 { // extremes
			in[0], in[n-1] = q-1, 0
		}
		for kind := 0; kind < 4; kind++ {
			switch kind {
			case 0:
				a.Forward(in, x)
				b.Forward(in, y)
			case 1:
				a.ForwardLazy(in, x)
				b.ForwardLazy(in, y)
			case 2:
				a.Backward(in, x)
				b.Backward(in, y)
			case 3:
				a.BackwardLazy(in, x)
				b.BackwardLazy(in, y)
			}
			for i := range x {
				if x[i]%q != y[i]%q || (kind%2 == 0 && (x[i] >= q || y[i] >= q)) {
					return false
				}
			}
		}
	}
	return true
}

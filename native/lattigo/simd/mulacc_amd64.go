// Package simd: the AVX-512 inner loop of the offload matmul's product kernel (cipherlm's
// native/lattigo bsgs_kernels.go).  Apart from the cgo package because a cgo package cannot
// hold Go assembly.
package simd

import "golang.org/x/sys/cpu"

// HasAVX512: MulAcc4 may be called (the CPU has AVX-512F).
var HasAVX512 = cpu.X86.HasAVX512F

// MulAcc4: (hi, lo)[c] += sum_{t<4} as[t][c] * ps[t][c] as 128-bit sums for c < n, n a
// multiple of 8, every operand < 2^60 (8 lanes; each 64-bit product from four 32x32-bit
// multiplies).  The caller keeps each 128-bit sum from overflowing.
//
//go:noescape
func MulAcc4(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int)

// MulAcc4Rep2: MulAcc4 with ps[t][c/2] in place of ps[t][c] (each ps n/2 words: a diagonal
// stored one value per run of 2, cipherlm's bsgsDiag).
//
//go:noescape
func MulAcc4Rep2(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int)

// MulAcc4Rep8: MulAcc4 with ps[t][c/8] in place of ps[t][c] (each ps n/8 words: a diagonal
// stored one value per run of 8 or more, expanded to one per 8, cipherlm's bsgsDiag).
//
//go:noescape
func MulAcc4Rep8(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int)

package main

// go test ./native/lattigo (from the repository root: cd native/lattigo && go test .)

import (
	"math/big"
	"math/rand"
	"testing"

	"cipherlm/native/lattigo/simd"
)

// kernelData: g terms of reduced operands mod a 60-bit (or 40-bit) prime, the ps in Montgomery form.
func kernelData(q uint64, g, n int, seed int64) (qInv uint64, a0s, a1s, ps [][]uint64) {
	qInv = q
	for i := 0; i < 6; i++ {
		qInv *= 2 - q*qInv
	}
	r := rand.New(rand.NewSource(seed))
	for t := 0; t < g; t++ {
		x, y, z := make([]uint64, n), make([]uint64, n), make([]uint64, n)
		for c := range x {
			x[c], y[c], z[c] = r.Uint64()%q, r.Uint64()%q, r.Uint64()%q
			if t == 0 && c < 4 { // extremes
				x[c], y[c], z[c] = q-1, q-1, q-1
			}
		}
		a0s, a1s, ps = append(a0s, x), append(a1s, y), append(ps, z)
	}
	return
}

// want: sum_t a[t][c] * p[t][c] * 2^-64 mod q, with math/big.
func want(q uint64, as, ps [][]uint64, c int) uint64 {
	Q := new(big.Int).SetUint64(q)
	rInv := new(big.Int).ModInverse(new(big.Int).Lsh(big.NewInt(1), 64), Q)
	s := new(big.Int)
	for t := range ps {
		s.Add(s, new(big.Int).Mul(new(big.Int).SetUint64(as[t][c]), new(big.Int).SetUint64(ps[t][c])))
	}
	s.Mul(s, rInv)
	return s.Mod(s, Q).Uint64()
}

// TestMulAccTile: both the Go loop and (where the CPU has AVX-512F) simd.MulAcc4, against
// math/big; tiles of a multiple of 8 coefficients (SIMD) and not (Go), moduli below and above
// 2^60 (the SIMD bound), every fold size.
func TestMulAccTile(t *testing.T) {
	has := simd.HasAVX512
	defer func() { simd.HasAVX512 = has }()
	for _, useSIMD := range []bool{false, true} {
		if useSIMD && !has {
			t.Log("no AVX-512F: the SIMD kernel is not tested here")
			continue
		}
		simd.HasAVX512 = useSIMD
		testMulAccTile(t)
	}
}

func testMulAccTile(t *testing.T) {
	for _, q := range []uint64{0xffffffffe400001, 0xffff00001, 0x7fffffd8001, 0x3fffffffffffffff} {
		for _, g := range []int{1, 3, 4, 5, 16, 17, 33, 48} {
			n := 64 + int(g%2)*3
			qInv, a0s, a1s, ps := kernelData(q, g, n, int64(g))
			o0, o1, acc := make([]uint64, n), make([]uint64, n), make([]uint64, 4*n)
			for _, fold := range []int{foldTerms(q), 1, 3} {
				mulAccTile(q, qInv, fold, a0s, a1s, ps, o0, o1, acc)
				for c := 0; c < n; c++ {
					if w0, w1 := want(q, a0s, ps, c), want(q, a1s, ps, c); o0[c] != w0 || o1[c] != w1 {
						t.Fatalf("simd=%v q=%x g=%d fold=%d c=%d: got %d %d, want %d %d", simd.HasAVX512, q, g, fold, c, o0[c], o1[c], w0, w1)
					}
				}
			}
		}
	}
}

func TestFoldTermsKeepsTheSumBelowQTimes2To64(t *testing.T) {
	for _, q := range []uint64{0xffffffffe400001, 0xffff00001, 3} {
		k := new(big.Int).SetUint64(uint64(foldTerms(q)))
		qm1 := new(big.Int).SetUint64(q - 1)
		lhs := new(big.Int).Mul(k, new(big.Int).Mul(qm1, qm1))
		rhs := new(big.Int).Lsh(new(big.Int).SetUint64(q), 64)
		if lhs.Cmp(rhs) >= 0 {
			t.Fatalf("q=%x: %d terms can reach q * 2^64", q, foldTerms(q))
		}
	}
}

func BenchmarkMulAccTile(b *testing.B) {
	q := uint64(0xffffffffe400001)
	qInv, a0s, a1s, ps := kernelData(q, 16, prodTile, 1)
	o0, o1, acc := make([]uint64, prodTile), make([]uint64, prodTile), make([]uint64, 4*prodTile)
	for i := 0; i < b.N; i++ {
		mulAccTile(q, qInv, foldTerms(q), a0s, a1s, ps, o0, o1, acc)
	}
}

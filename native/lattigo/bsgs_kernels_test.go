package main

// go test ./native/lattigo (from the repository root: cd native/lattigo && go test .)

import (
	"math/big"
	"math/bits"
	"math/rand"
	"testing"

	"cipherlm/native/lattigo/simd"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
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
				mulAccTile(q, qInv, fold, a0s, a1s, ps, o0, o1, acc, 1)
				for c := 0; c < n; c++ {
					if w0, w1 := want(q, a0s, ps, c), want(q, a1s, ps, c); o0[c] != w0 || o1[c] != w1 {
						t.Fatalf("simd=%v q=%x g=%d fold=%d c=%d: got %d %d, want %d %d", simd.HasAVX512, q, g, fold, c, o0[c], o1[c], w0, w1)
					}
				}
			}
			// the same products with the ps in runs of rep = 2 and 8, read at one value per run,
			// over a multiple of rep coefficients (66 of 67 for rep 2: the Go loop only; 64 for 8)
			for _, rep := range []int{2, 8} {
				m := n - n%rep
				h0, h1 := o0[:m], o1[:m]
				b0s, b1s := make([][]uint64, g), make([][]uint64, g)
				for k := range a0s {
					b0s[k], b1s[k] = a0s[k][:m], a1s[k][:m]
				}
				hs, full := make([][]uint64, g), make([][]uint64, g)
				for k, p := range ps {
					hs[k], full[k] = make([]uint64, m/rep), make([]uint64, m)
					for i := range hs[k] {
						hs[k][i] = p[rep*i]
						for r := 0; r < rep; r++ {
							full[k][rep*i+r] = p[rep*i]
						}
					}
				}
				for _, fold := range []int{foldTerms(q), 1, 3} {
					mulAccTile(q, qInv, fold, b0s, b1s, hs, h0, h1, acc, rep)
					for c := 0; c < m; c++ {
						if w0, w1 := want(q, b0s, full, c), want(q, b1s, full, c); h0[c] != w0 || h1[c] != w1 {
							t.Fatalf("rep %d simd=%v q=%x g=%d fold=%d c=%d: got %d %d, want %d %d", rep, simd.HasAVX512, q, g, fold, c, h0[c], h1[c], w0, w1)
						}
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
		mulAccTile(q, qInv, foldTerms(q), a0s, a1s, ps, o0, o1, acc, 1)
	}
}

// offloadParams: cipherlm's offload CKKS parameters (cipherlm/he/params.py OFFLOAD_CKKS).
func offloadParams(t testing.TB) ckks.Parameters {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40,
	})
	if err != nil {
		t.Fatal(err)
	}
	return params
}

// packedDiagonal: a diagonal of a packed plan (cipherlm/he/matmul.py diagonals, tokens T > 1):
// slot a B + t L + u (chunk a < c of B = S / c slots, token lane t < T of L = B / T slots) holds
// a value that depends on (a, u) only, pre-rotated by `shift` slots; encoded at level 1 in
// Montgomery form, as clg_bsgs_set stores it.
func packedDiagonal(t *testing.T, params ckks.Parameters, c, T, shift int, r *rand.Rand) *rlwe.Plaintext {
	S := params.MaxSlots()
	B, L := S/c, S/(c*T)
	base := make([]complex128, c*L)
	for i := range base {
		base[i] = complex(r.Float64()*2-1, r.Float64()*2-1)
	}
	v := make([]complex128, S)
	for s := 0; s < S; s++ {
		v[(s+shift)%S] = base[(s/B)*L+s%L]
	}
	pt := ckks.NewPlaintext(params, 1)
	pt.Scale = rlwe.NewScale(1 << 36)
	if err := ckks.NewEncoder(params).Encode(v, pt); err != nil {
		t.Fatal(err)
	}
	params.RingQ().AtLevel(1).MForm(pt.Value, pt.Value)
	return pt
}

// TestPeriodicDiagonalRuns: the structure bsgsDiag relies on, on Lattigo's encoder.  With one
// chunk (c = 1) a packed diagonal has period S/T in the slots, i.e. it is a polynomial in X^T
// (its coefficients off the multiples of T are exactly 0), and every limb's NTT vector comes in
// runs of exactly T equal consecutive values; with c > 1 chunks (slots [chunk | token | lane],
// not periodic as a whole) there are no runs at all.
func TestPeriodicDiagonalRuns(t *testing.T) {
	params := offloadParams(t)
	r := rand.New(rand.NewSource(1))
	ringQ := params.RingQ().AtLevel(1)
	for _, T := range []int{2, 4, 8} {
		for _, c := range []int{1, 2, 4} {
			pt := packedDiagonal(t, params, c, T, 9*r.Intn(50), r)
			want := 1
			if c == 1 {
				want = T
			}
			if got := runLength(pt.Value, 64); got != want {
				t.Fatalf("T=%d c=%d: runs of %d, want %d", T, c, got, want)
			}
			coef := ringQ.NewPoly()
			ringQ.IMForm(pt.Value, coef)
			ringQ.INTT(coef, coef)
			for l := range coef.Coeffs {
				for i, x := range coef.Coeffs[l] {
					if c == 1 && i%T != 0 && x != 0 {
						t.Fatalf("T=%d: coefficient %d of limb %d is %d, not 0", T, i, l, x)
					}
				}
			}
			// newDiag takes the NTT form and stores the Montgomery form pt holds
			raw := pt.CopyNew()
			ringQ.IMForm(raw.Value, raw.Value)
			d := newDiag(ringQ, raw, T)
			if d.rep != want || d.words()*int64(want) != int64(2*params.N()) {
				t.Fatalf("T=%d c=%d: stored with runs of %d in %d words", T, c, d.rep, d.words())
			}
			if !ringQ.Equal(d.poly(ringQ.NewPoly()), pt.Value) {
				t.Fatalf("T=%d c=%d: the stored values are not pt's Montgomery form", T, c)
			}
			// the expansion, tile by tile and whole, gives back every residue
			buf := make([]uint64, prodTile)
			for l := 0; l < 2; l++ {
				for c0 := 0; c0 < params.N(); c0 += prodTile {
					got := d.limb(l, c0, c0+prodTile, buf)
					if len(got) != prodTile {
						t.Fatalf("T=%d c=%d: a tile of %d coefficients", T, c, len(got))
					}
					for i, x := range got {
						if x != pt.Value.Coeffs[l][c0+i] {
							t.Fatalf("T=%d c=%d: limb %d coefficient %d expanded wrong", T, c, l, c0+i)
						}
					}
				}
			}
			if !ringQ.Equal(d.poly(ringQ.NewPoly()), pt.Value) {
				t.Fatalf("T=%d c=%d: whole expansion differs", T, c)
			}
		}
	}
}

// BenchmarkMulAccTileRuns: BenchmarkMulAccTile's products with the 16 diagonals stored one
// value per run of 2 (bsgsDiag), each tile expanded into scratch first (bsgsGiantFast's path).
func BenchmarkMulAccTileRuns(b *testing.B) {
	q := uint64(0xffffffffe400001)
	qInv, a0s, a1s, ps := kernelData(q, 16, prodTile, 1)
	ds := make([]*bsgsDiag, len(ps))
	for t, p := range ps {
		v := make([]uint64, len(p)/2)
		for i := range v {
			v[i] = p[2*i]
		}
		ds[t] = &bsgsDiag{rep: 2, vals: [][]uint64{v}}
	}
	exp := make([][]uint64, len(ds))
	for t := range exp {
		exp[t] = make([]uint64, prodTile)
	}
	pt := make([][]uint64, len(ds))
	o0, o1, acc := make([]uint64, prodTile), make([]uint64, prodTile), make([]uint64, 4*prodTile)
	for i := 0; i < b.N; i++ {
		for t, d := range ds {
			pt[t] = d.limb(0, 0, prodTile, exp[t])
		}
		mulAccTile(q, qInv, foldTerms(q), a0s, a1s, pt, o0, o1, acc, 1)
	}
}

// BenchmarkMulAccTileRep2: the same products read at half rate (simd.MulAcc4Rep2, bsgsGiantFast's
// path when all of a unit's diagonals are in runs of 2).
func BenchmarkMulAccTileRep2(b *testing.B) {
	q := uint64(0xffffffffe400001)
	qInv, a0s, a1s, ps := kernelData(q, 16, prodTile, 1)
	hs := make([][]uint64, len(ps))
	for t, p := range ps {
		hs[t] = make([]uint64, len(p)/2)
		for i := range hs[t] {
			hs[t][i] = p[2*i]
		}
	}
	o0, o1, acc := make([]uint64, prodTile), make([]uint64, prodTile), make([]uint64, 4*prodTile)
	for i := 0; i < b.N; i++ {
		mulAccTile(q, qInv, foldTerms(q), a0s, a1s, hs, o0, o1, acc, 2)
	}
}

// TestSparseDiagMatchesEncode: sparseDiag's compressed residues, expanded, are those of Lattigo's
// own sparse encoding (Encoder.Encode with fewer slots) in Montgomery form, bit for bit, for
// several periods.
func TestSparseDiagMatchesEncode(t *testing.T) {
	params := offloadParams(t)
	r := rand.New(rand.NewSource(2))
	ringQ := params.RingQ().AtLevel(1)
	ecd := ckks.NewEncoder(params)
	for _, T := range []int{2, 4, 8, 32, 64} {
		L := params.MaxSlots() / T
		v := make([]complex128, L)
		for i := range v {
			v[i] = complex(r.Float64()*2-1, r.Float64()*2-1)
		}
		logSlots := bits.TrailingZeros(uint(L))
		scale := rlwe.NewScale(1 << 36)
		d, err := sparseDiag(ecd, ringQ, v, logSlots, scale, ringQ.NewPoly())
		if err != nil {
			t.Fatal(err)
		}
		if d.rep != T || d.words() != int64(2*params.N()/T) {
			t.Fatalf("T=%d: runs of %d in %d words", T, d.rep, d.words())
		}
		pt := ckks.NewPlaintext(params, 1)
		pt.Scale = scale
		pt.LogDimensions.Cols = logSlots
		if err := ecd.Encode(v, pt); err != nil {
			t.Fatal(err)
		}
		ringQ.MForm(pt.Value, pt.Value)
		if !ringQ.Equal(d.poly(ringQ.NewPoly()), pt.Value) {
			t.Fatalf("T=%d: sparseDiag differs from Lattigo's sparse encoding", T)
		}
	}
}

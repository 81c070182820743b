package main

import (
	"fmt"
	"math/rand"
	"testing"

	ckkspoly "github.com/tuneinsight/lattigo/v6/circuits/ckks/polynomial"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils/bignum"
	"github.com/tuneinsight/lattigo/v6/utils/sampling"
)

// nttRing: a standard ring of degree n over primes of the given bit sizes.
func nttRing(t testing.TB, n int, sizes []int) *ring.Ring {
	var moduli []uint64
	for _, b := range sizes {
		g := ring.NewNTTFriendlyPrimesGenerator(uint64(b), uint64(2*n))
		p, err := g.NextAlternatingPrimes(1)
		if err != nil {
			t.Fatal(err)
		}
		moduli = append(moduli, p[0])
	}
	r, err := ring.NewRing(n, moduli)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestSIMDNTTMatchesLattigo(t *testing.T) {
	if !simdNTTAvailable() {
		t.Skip("no AVX-512F/DQ on this CPU (or CIPHERLM_LATTIGO_SIMD_NTT=0): Lattigo's NTT is used")
	}
	for _, n := range []int{16, 1024, 8192, 16384} {
		r := nttRing(t, n, []int{30, 40, 50, 55, 60, 61})
		rng := rand.New(rand.NewSource(int64(n)))
		for _, s := range r.SubRings {
			q := s.Modulus
			f := simdFor(s)
			if f == nil {
				t.Fatalf("n=%d q=%d: no AVX-512 transform", n, q)
			}
			in, in2q := make([]uint64, n), make([]uint64, n)
			for j := range in {
				in[j] = rng.Uint64() % q
				in2q[j] = rng.Uint64() % (2 * q) // lazy inputs of the inverse
			}
			in[0], in2q[1] = q-1, 2*q-1
			want, got := make([]uint64, n), make([]uint64, n)
			s.NTT(in, want)
			f.Forward(in, got)
			for j := range got {
				if got[j] != want[j] {
					t.Fatalf("n=%d q=%d forward [%d]: %d != %d", n, q, j, got[j], want[j])
				}
			}
			f.ForwardLazy(in, got)
			for j := range got {
				if got[j] >= 4*q || got[j]%q != want[j] {
					t.Fatalf("n=%d q=%d forward lazy [%d]: %d vs %d", n, q, j, got[j], want[j])
				}
			}
			s.INTT(in2q, want)
			f.Backward(in2q, got)
			for j := range got {
				if got[j] != want[j] {
					t.Fatalf("n=%d q=%d backward [%d]: %d != %d", n, q, j, got[j], want[j])
				}
			}
			f.BackwardLazy(in2q, got)
			for j := range got {
				if got[j] >= 2*q || got[j]%q != want[j] {
					t.Fatalf("n=%d q=%d backward lazy [%d]: %d vs %d", n, q, j, got[j], want[j])
				}
			}
			copy(got, in) // in place, round trip
			f.Forward(got, got)
			f.Backward(got, got)
			for j := range got {
				if got[j] != in[j] {
					t.Fatalf("n=%d q=%d round trip [%d]: %d != %d", n, q, j, got[j], in[j])
				}
			}
		}
	}
}

func TestSIMDNTTDisabledByEnvironment(t *testing.T) {
	t.Setenv("CIPHERLM_LATTIGO_SIMD_NTT", "0")
	if simdNTTAvailable() {
		t.Fatal("CIPHERLM_LATTIGO_SIMD_NTT=0 did not turn the AVX-512 transforms off")
	}
}

// go test -run XXX -bench NTT .: one forward + one inverse NTT of one prime, Lattigo's and the
// AVX-512 one, N = 2^13 and 2^16, a 60-bit prime.
func BenchmarkNTT(b *testing.B) {
	for _, n := range []int{1 << 13, 1 << 16} {
		r := nttRing(b, n, []int{60})
		s := r.SubRings[0]
		p := make([]uint64, n)
		for j := range p {
			p[j] = uint64(j) * 7919 % s.Modulus
		}
		b.Run("lattigo/N="+itoa(n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				s.NTT(p, p)
				s.INTT(p, p)
			}
		})
		if !simdNTTAvailable() {
			continue
		}
		f := simdFor(s)
		b.Run("avx512/N="+itoa(n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				f.Forward(p, p)
				f.Backward(p, p)
			}
		})
	}
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var d []byte
	for ; n > 0; n /= 10 {
		d = append([]byte{byte('0' + n%10)}, d...)
	}
	return string(d)
}

// fastopsParams: CKKS parameters with 60- and 40-bit primes (the offload set's shape) and two
// special primes, and an evaluator with the keys of a few rotations.
func fastopsParams(t testing.TB) (ckks.Parameters, *ckks.Evaluator, *ckks.Encoder, *rlwe.Encryptor, []int) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 12, LogQ: []int{60, 40, 40}, LogP: []int{61, 61}, LogDefaultScale: 40,
	})
	if err != nil {
		t.Fatal(err)
	}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	rots := []int{1, 5, -3, 64}
	var gks []*rlwe.GaloisKey
	for _, k := range rots {
		gks = append(gks, kg.GenGaloisKeyNew(params.GaloisElement(k), sk))
	}
	eval := ckks.NewEvaluator(params, rlwe.NewMemEvaluationKeySet(kg.GenRelinearizationKeyNew(sk), gks...))
	return params, eval, ckks.NewEncoder(params), rlwe.NewEncryptor(params, sk), rots
}

func randomCiphertext(t testing.TB, params ckks.Parameters, ecd *ckks.Encoder, enc *rlwe.Encryptor) *rlwe.Ciphertext {
	vals := make([]float64, params.MaxSlots())
	r := rand.New(rand.NewSource(7))
	for i := range vals {
		vals[i] = r.Float64()*2 - 1
	}
	pt := ckks.NewPlaintext(params, params.MaxLevel())
	if err := ecd.Encode(vals, pt); err != nil {
		t.Fatal(err)
	}
	ct, err := enc.EncryptNew(pt)
	if err != nil {
		t.Fatal(err)
	}
	return ct
}

func samePoly(t *testing.T, what string, a, b ring.Poly) {
	t.Helper()
	for i := range a.Coeffs {
		for j := range a.Coeffs[i] {
			if a.Coeffs[i][j] != b.Coeffs[i][j] {
				t.Fatalf("%s: limb %d coefficient %d: %d != %d", what, i, j, a.Coeffs[i][j], b.Coeffs[i][j])
			}
		}
	}
}

// The re-expressed operations give Lattigo's residues exactly (with or without AVX-512: the
// fallback is Lattigo's own transform).
func TestFastopsMatchLattigo(t *testing.T) {
	params, eval, ecd, enc, rots := fastopsParams(t)
	ct := randomCiphertext(t, params, ecd, enc)
	ringQ := params.RingQ().AtLevel(ct.Level())
	// rescale
	want, got := ringQ.AtLevel(ct.Level()-1).NewPoly(), ringQ.AtLevel(ct.Level()-1).NewPoly()
	ringQ.DivRoundByLastModulusNTT(ct.Value[1], want)
	divRoundByLastModulusNTT(ringQ, ct.Value[1], got)
	samePoly(t, "DivRoundByLastModulusNTT", want, got)
	// Evaluator.Rescale, out of place and in place
	wr, gr := ct.CopyNew(), ct.CopyNew()
	if err := eval.Rescale(ct, wr); err != nil {
		t.Fatal(err)
	}
	if err := rescale(eval, gr, gr); err != nil {
		t.Fatal(err)
	}
	if wr.Level() != gr.Level() || !wr.Scale.Equal(gr.Scale) {
		t.Fatal("Rescale: metadata differs")
	}
	samePoly(t, "Rescale c0", wr.Value[0], gr.Value[0])
	samePoly(t, "Rescale c1", wr.Value[1], gr.Value[1])
	// ModDown of a random QP polynomial
	levelQ, levelP := ct.Level(), params.MaxLevelP()
	src := ringqp.NewPoly(params.N(), levelQ, levelP)
	prng, err := sampling.NewKeyedPRNG([]byte{3})
	if err != nil {
		t.Fatal(err)
	}
	smp := ringqp.NewUniformSampler(prng, *params.RingQP())
	smp.Read(src)
	w, g := ringQ.NewPoly(), ringQ.NewPoly()
	eval.BasisExtender.ModDownQPtoQNTT(levelQ, levelP, src.Q, src.P, w)
	modDownQPtoQNTT(params.Parameters, eval.BasisExtender, levelQ, levelP, src.Q, src.P, g)
	samePoly(t, "ModDownQPtoQNTT", w, g)
	// hoisted rotations, at two levels
	for _, level := range []int{ct.Level(), ct.Level() - 1} {
		c := ct.CopyNew()
		c.Resize(1, level)
		wantRot, gotRot := map[int]*rlwe.Ciphertext{}, map[int]*rlwe.Ciphertext{}
		for _, k := range rots {
			wantRot[k] = ckks.NewCiphertext(params, 1, level)
			gotRot[k] = ckks.NewCiphertext(params, 1, level)
		}
		if err := eval.RotateHoisted(c, rots, wantRot); err != nil {
			t.Fatal(err)
		}
		if err := rotateHoisted(eval, c, rots, gotRot); err != nil {
			t.Fatal(err)
		}
		for _, k := range rots {
			samePoly(t, "RotateHoisted c0", wantRot[k].Value[0], gotRot[k].Value[0])
			samePoly(t, "RotateHoisted c1", wantRot[k].Value[1], gotRot[k].Value[1])
			if !wantRot[k].Scale.Equal(gotRot[k].Scale) || wantRot[k].Level() != gotRot[k].Level() {
				t.Fatal("RotateHoisted: metadata differs")
			}
		}
	}
	// one rotation, and a relinearisation (of a product, in place and out of place)
	for _, k := range rots {
		wc, gc := ckks.NewCiphertext(params, 1, ct.Level()), ckks.NewCiphertext(params, 1, ct.Level())
		if err := eval.Rotate(ct, k, wc); err != nil {
			t.Fatal(err)
		}
		if err := rotate(eval, ct, k, gc); err != nil {
			t.Fatal(err)
		}
		samePoly(t, "Rotate c0", wc.Value[0], gc.Value[0])
		samePoly(t, "Rotate c1", wc.Value[1], gc.Value[1])
	}
	prod := ckks.NewCiphertext(params, 2, ct.Level())
	if err := eval.Mul(ct, ct, prod); err != nil {
		t.Fatal(err)
	}
	wl, gl := ckks.NewCiphertext(params, 1, ct.Level()), ckks.NewCiphertext(params, 1, ct.Level())
	if err := eval.Relinearize(prod, wl); err != nil {
		t.Fatal(err)
	}
	if err := relinearize(eval, prod, gl); err != nil {
		t.Fatal(err)
	}
	if !wl.Scale.Equal(gl.Scale) || wl.Level() != gl.Level() {
		t.Fatal("Relinearize: metadata differs")
	}
	samePoly(t, "Relinearize c0", wl.Value[0], gl.Value[0])
	samePoly(t, "Relinearize c1", wl.Value[1], gl.Value[1])
	// MulRelin, a product and a square
	for _, y := range []*rlwe.Ciphertext{ct, ct.CopyNew()} {
		want := ckks.NewCiphertext(params, 1, ct.Level())
		if err := eval.MulRelin(ct, y, want); err != nil {
			t.Fatal(err)
		}
		got := ckks.NewCiphertext(params, 1, ct.Level())
		if err := mulRelin(eval, ct, y, got); err != nil {
			t.Fatal(err)
		}
		if !want.Scale.Equal(got.Scale) || want.Level() != got.Level() {
			t.Fatal("MulRelin: metadata differs")
		}
		samePoly(t, "MulRelin c0", want.Value[0], got.Value[0])
		samePoly(t, "MulRelin c1", want.Value[1], got.Value[1])
	}
}

func TestDecomposeNTTMatchesLattigo(t *testing.T) {
	params, eval, ecd, enc, _ := fastopsParams(t)
	ct := randomCiphertext(t, params, ecd, enc)
	for _, level := range []int{ct.Level(), ct.Level() - 1, 0} {
		levelP := params.MaxLevelP()
		size := params.BaseRNSDecompositionVectorSize(level, levelP)
		want, got := make([]ringqp.Poly, size), make([]ringqp.Poly, size)
		for i := range want {
			want[i] = ringqp.NewPoly(params.N(), level, levelP)
			got[i] = ringqp.NewPoly(params.N(), level, levelP)
		}
		c := ct.Value[1]
		eval.DecomposeNTT(level, levelP, levelP+1, c, true, want)
		decomposeNTT(eval, level, levelP, levelP+1, c, got)
		for i := range want {
			samePoly(t, "DecomposeNTT Q", want[i].Q, got[i].Q)
			samePoly(t, "DecomposeNTT P", want[i].P, got[i].P)
		}
	}
}

func TestEncodeNTTMatchesLattigo(t *testing.T) {
	params, _, ecd, _, _ := fastopsParams(t)
	r := rand.New(rand.NewSource(11))
	for _, logSlots := range []int{params.LogMaxSlots(), 5, 0} {
		for _, cmplx := range []bool{false, true} {
			n := 1 << logSlots
			var vals any
			if cmplx {
				v := make([]complex128, n)
				for i := range v {
					v[i] = complex(r.Float64()*2-1, r.Float64()*2-1)
				}
				vals = v
			} else {
				v := make([]float64, n)
				for i := range v {
					v[i] = r.Float64()*2 - 1
					switch i % 7 { // the quantisation's edge cases: zeros, values that round to 0, +-2^30
					case 1:
						v[i] = 0
					case 2:
						v[i] *= 1e-13
					case 3:
						v[i] *= 1 << 30
					}
				}
				vals = v
			}
			want, got := ckks.NewPlaintext(params, 1), ckks.NewPlaintext(params, 1)
			want.LogDimensions = ring.Dimensions{Rows: 0, Cols: logSlots}
			got.LogDimensions = want.LogDimensions
			if err := ecd.Encode(vals, want); err != nil {
				t.Fatal(err)
			}
			if err := encodeNTT(ecd, vals, got); err != nil {
				t.Fatal(err)
			}
			samePoly(t, fmt.Sprintf("Encode logSlots=%d complex=%v", logSlots, cmplx), want.Value, got.Value)
			if want.IsNTT != got.IsNTT || want.IsMontgomery != got.IsMontgomery || !want.Scale.Equal(got.Scale) ||
				want.LogDimensions != got.LogDimensions {
				t.Fatal("Encode: metadata differs")
			}
		}
	}
}

func TestPolynomialEvaluatorMatchesLattigo(t *testing.T) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{
		LogN: 12, LogQ: []int{60, 40, 40, 40, 40}, LogP: []int{61}, LogDefaultScale: 40,
	})
	if err != nil {
		t.Fatal(err)
	}
	kg := rlwe.NewKeyGenerator(params)
	sk := kg.GenSecretKeyNew()
	eval := ckks.NewEvaluator(params, rlwe.NewMemEvaluationKeySet(kg.GenRelinearizationKeyNew(sk)))
	ecd, enc := ckks.NewEncoder(params), rlwe.NewEncryptor(params, sk)
	ct := randomCiphertext(t, params, ecd, enc)
	// a degree-7 polynomial (power basis X, X^2, X^4, baby and giant steps, four rescales)
	coeffs := []float64{0.1, -0.3, 0.25, 0.5, -0.125, 0.0625, 0.2, -0.05}
	poly := bignum.NewPolynomial(bignum.Monomial, coeffs, nil)
	want, err := ckkspoly.NewEvaluator(params, eval).Evaluate(ct, poly, ct.Scale)
	if err != nil {
		t.Fatal(err)
	}
	got, err := polynomialEvaluator(params, eval).Evaluate(ct, poly, ct.Scale)
	if err != nil {
		t.Fatal(err)
	}
	if want.Level() != got.Level() || !want.Scale.Equal(got.Scale) {
		t.Fatal("polynomial: metadata differs")
	}
	samePoly(t, "polynomial c0", want.Value[0], got.Value[0])
	samePoly(t, "polynomial c1", want.Value[1], got.Value[1])
}

// Two rings over the same primes (two contexts, e.g. two server sessions) share one set of
// AVX-512 tables per prime.
func TestSIMDTablesSharedAcrossRings(t *testing.T) {
	if !simdNTTAvailable() {
		t.Skip("no AVX-512F/DQ on this CPU (or CIPHERLM_LATTIGO_SIMD_NTT=0)")
	}
	a, b := nttRing(t, 1024, []int{50, 60}), nttRing(t, 1024, []int{50, 60})
	for i := range a.SubRings {
		if a.SubRings[i] == b.SubRings[i] {
			t.Fatal("the two rings share a subring object: not the case under test")
		}
		if simdFor(a.SubRings[i]) == nil || simdFor(a.SubRings[i]) != simdFor(b.SubRings[i]) {
			t.Fatalf("prime %d: separate tables for the same prime", a.SubRings[i].Modulus)
		}
	}
}

// modUpOnePrime gives the residues of Lattigo's ModUpPtoQ for one special prime (the PackLWEs
// context's), on random words below 2P (the lazy inverse transform's range) and around the
// points where the centring and Lattigo's float correction term change; and modDownQPtoQNTT,
// which uses it there, stays Lattigo's ModDownQPtoQNTT bit for bit.
func TestModUpOnePrimeMatchesLattigo(t *testing.T) {
	c, _, _, e := packSetup(t, true)
	params := c.params
	eval := newPackWorker(params, e.set).ev
	ringQ, ringP := params.RingQ(), params.RingP().AtLevel(0)
	P := ringP.SubRings[0].Modulus
	n := params.N()
	r := rand.New(rand.NewSource(11))
	src := ringP.NewPoly()
	edges := []uint64{0, 1, P >> 1, P>>1 - 1, P>>1 + 1, P - 1, P, P + 1, P + P>>1, 2*P - 1}
	for k := uint64(0); k < 300; k++ {
		edges = append(edges, P>>1-k-1, P+P>>1-k-1, P-k-1) // y = x + P/2 mod P just below P
	}
	for i := range src.Coeffs[0] {
		if i < len(edges) {
			src.Coeffs[0][i] = edges[i]
		} else {
			src.Coeffs[0][i] = r.Uint64() % (2 * P)
		}
	}
	want, got := ringQ.NewPoly(), ringQ.NewPoly()
	eval.BasisExtender.ModUpPtoQ(0, params.MaxLevel(), src, want)
	modUpOnePrime(ringP.SubRings[0], ringQ, src.Coeffs[0], got)
	for j, q := range params.Q() {
		for i := 0; i < n; i++ {
			if want.Coeffs[j][i]%q != got.Coeffs[j][i] {
				t.Fatalf("prime %d, word %d (x = %d): Lattigo %d, ours %d", j, i, src.Coeffs[0][i],
					want.Coeffs[j][i]%q, got.Coeffs[j][i])
			}
		}
	}
	qp := ringqp.NewPoly(n, params.MaxLevel(), 0)
	prng, err := sampling.NewKeyedPRNG([]byte{4})
	if err != nil {
		t.Fatal(err)
	}
	smp := ringqp.NewUniformSampler(prng, *params.RingQP())
	smp.Read(qp)
	w, g := ringQ.NewPoly(), ringQ.NewPoly()
	eval.BasisExtender.ModDownQPtoQNTT(params.MaxLevel(), 0, qp.Q, qp.P, w)
	modDownQPtoQNTT(params.Parameters, eval.BasisExtender, params.MaxLevel(), 0, qp.Q, qp.P, g)
	samePoly(t, "ModDownQPtoQNTT, one special prime", w, g)
}

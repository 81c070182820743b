package main

// cd native/lattigo && go test -run PackLWEs .

import (
	"math/big"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/ring/ringqp"
)

// packSetup: FastQuery's shape (N = 2^13, four 29-bit data primes, one 60-bit special prime),
// a ternary secret imported with secretKeyFromTernary and its Galois keys for 2^k + 1.
func packSetup(t testing.TB, withKeys bool) (*ctxObj, []int64, *rlwe.SecretKey, *evkObj) {
	t.Helper()
	const logN = 13
	gq := ring.NewNTTFriendlyPrimesGenerator(29, 2<<logN)
	gp := ring.NewNTTFriendlyPrimesGenerator(60, 2<<logN)
	var q []uint64
	for len(q) < 4 {
		p, err := gq.NextDownstreamPrime()
		if err != nil {
			t.Fatal(err)
		}
		q = append(q, p)
	}
	p, err := gp.NextDownstreamPrime()
	if err != nil {
		t.Fatal(err)
	}
	c, err := newContextWithPrimes(logN, q, []uint64{p})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.params.Q(), q) || c.params.P()[0] != p {
		t.Fatalf("context primes %v %v, asked %v %v", c.params.Q(), c.params.P(), q, p)
	}
	r := rand.New(rand.NewPCG(7, 8))
	s := make([]int64, c.params.N())
	for i := range s {
		s[i] = int64(r.IntN(3)) - 1
	}
	sk, err := secretKeyFromTernary(c, s)
	if err != nil {
		t.Fatal(err)
	}
	var els []uint64
	for k := 1; k <= logN; k++ {
		if withKeys || k != 5 {
			els = append(els, uint64(1)<<k+1)
		}
	}
	set := rlwe.NewMemEvaluationKeySet(nil, rlwe.NewKeyGenerator(c.params).GenGaloisKeysNew(els, sk)...)
	return c, s, sk, &evkObj{ctx: c, set: set}
}

// mulSecret: c1 * s (k rows of coefficient-form residues, in place) with the key's NTT form.
func mulSecret(c *ctxObj, sk *rlwe.SecretKey, rows [][]uint64) {
	rq := c.params.RingQ()
	p := rq.NewPoly()
	for j := range rows {
		copy(p.Coeffs[j], rows[j])
	}
	rq.NTT(p, p)
	rq.MulCoeffsMontgomery(p, sk.Value.Q, p)
	rq.INTT(p, p)
	for j := range rows {
		copy(rows[j], p.Coeffs[j])
	}
}

// packLeaves: leaf j (j < n) encrypts Delta v_j N^-1 at coefficient 0 and uniform garbage
// elsewhere (c0 = m + e - c1 s, coefficient form); the leaves in consumption order and
// their presence flags, and the values per slot.
func packLeaves(c *ctxObj, sk *rlwe.SecretKey, n int, delta *big.Int) (data []uint64, present []byte, vals []int64) {
	q := c.params.Q()
	N, k := c.params.N(), len(q)
	logn := 0
	for 1<<logn < n {
		logn++
	}
	r := rand.New(rand.NewPCG(uint64(n), 3))
	Q := big.NewInt(1)
	for _, qi := range q {
		Q.Mul(Q, new(big.Int).SetUint64(qi))
	}
	nInv := new(big.Int).ModInverse(big.NewInt(int64(N)), Q)
	vals = make([]int64, 1<<logn)
	data = make([]uint64, (1<<logn)*2*k*N)
	present = make([]byte, 1<<logn)
	for pos := 0; pos < 1<<logn; pos++ {
		j := 0
		for b := 0; b < logn; b++ { // bit-reversed slot
			j |= ((pos >> b) & 1) << (logn - 1 - b)
		}
		if j >= n {
			continue
		}
		present[pos] = 1
		vals[j] = int64(r.IntN(1<<13)) - 1<<12
		m0 := new(big.Int).Mul(delta, big.NewInt(vals[j]))
		m0.Mul(m0, nInv).Mod(m0, Q)
		e := make([]int64, N)
		for i := range e {
			e[i] = int64(r.IntN(13)) - 6
		}
		base := pos * 2 * k * N
		cs := make([][]uint64, k)
		for jj, qi := range q {
			c1 := data[base+(k+jj)*N : base+(k+jj+1)*N]
			for i := range c1 {
				c1[i] = r.Uint64N(qi)
			}
			cs[jj] = slices.Clone(c1)
		}
		mulSecret(c, sk, cs)
		for jj, qi := range q {
			c0 := data[base+jj*N : base+(jj+1)*N]
			for i := range c0 {
				m := r.Uint64N(qi) // garbage, removed by the trace
				if i == 0 {
					m = new(big.Int).Mod(m0, new(big.Int).SetUint64(qi)).Uint64()
				}
				ei := uint64((e[i]%int64(qi) + int64(qi)) % int64(qi))
				c0[i] = (m + ei + qi - cs[jj][i]) % qi
			}
		}
	}
	return data, present, vals
}

// decryptCentred: c0 + c1 s per coefficient, CRT-reconstructed and centred.
func decryptCentred(c *ctxObj, sk *rlwe.SecretKey, ct []uint64) []*big.Int {
	q := c.params.Q()
	N, k := c.params.N(), len(q)
	Q := big.NewInt(1)
	for _, qi := range q {
		Q.Mul(Q, new(big.Int).SetUint64(qi))
	}
	half := new(big.Int).Rsh(Q, 1)
	out := make([]*big.Int, N)
	for i := range out {
		out[i] = new(big.Int)
	}
	cs := make([][]uint64, k)
	for j := range q {
		cs[j] = slices.Clone(ct[(k+j)*N : (k+j+1)*N])
	}
	mulSecret(c, sk, cs)
	for j, qi := range q {
		c0 := ct[j*N : (j+1)*N]
		Qi := new(big.Int).Div(Q, new(big.Int).SetUint64(qi))
		inv := new(big.Int).ModInverse(new(big.Int).Mod(Qi, new(big.Int).SetUint64(qi)), new(big.Int).SetUint64(qi))
		f := new(big.Int).Mul(Qi, inv)
		for i := 0; i < N; i++ {
			x := (c0[i] + cs[j][i]) % qi
			out[i].Add(out[i], new(big.Int).Mul(f, new(big.Int).SetUint64(x)))
		}
	}
	for i := range out {
		out[i].Mod(out[i], Q)
		if out[i].Cmp(half) > 0 {
			out[i].Sub(out[i], Q)
		}
	}
	return out
}

func runPacker(t *testing.T, e *evkObj, n, workers int, chunks []int, data []uint64, present []byte) []uint64 {
	t.Helper()
	o, err := newPacker(e, int64(n), workers)
	if err != nil {
		t.Fatal(err)
	}
	k, N := e.ctx.params.MaxLevel()+1, e.ctx.params.N()
	per := 2 * k * N
	pos, ci := 0, 0
	for pos < len(present) {
		m := min(chunks[ci%len(chunks)], len(present)-pos)
		ci++
		if err := o.push(data[pos*per:(pos+m)*per], present[pos:pos+m]); err != nil {
			t.Fatal(err)
		}
		pos += m
	}
	out := make([]uint64, per)
	if err := o.finish(out); err != nil {
		t.Fatal(err)
	}
	return out
}

// The packed ciphertext decrypts to Delta v_j at coefficient j N / 2^ceil(log2 n) and to
// (noise) zero elsewhere; the result is bit-identical whatever the chunking and the workers.
func TestPackLWEsMatchesDefinition(t *testing.T) {
	c, _, sk, e := packSetup(t, true)
	q := c.params.Q()
	N := c.params.N()
	Q := big.NewInt(1)
	for _, qi := range q {
		Q.Mul(Q, new(big.Int).SetUint64(qi))
	}
	delta := new(big.Int).Rsh(Q, 13) // Q / t, t = 2^13
	bound := new(big.Int).Rsh(delta, 2)
	for _, n := range []int{1, 37, 64} {
		data, present, vals := packLeaves(c, sk, n, delta)
		ref := runPacker(t, e, n, 1, []int{len(present)}, data, present)
		for j, qi := range q { // reduced output
			for p := 0; p < 2; p++ {
				for _, x := range ref[(p*len(q)+j)*N : (p*len(q)+j+1)*N] {
					if x >= qi {
						t.Fatalf("n %d: output residue %d not reduced modulo %d", n, x, qi)
					}
				}
			}
		}
		dec := decryptCentred(c, sk, ref)
		stride := N / len(present)
		for i, x := range dec {
			want := new(big.Int)
			if i%stride == 0 {
				want.Mul(delta, big.NewInt(vals[i/stride]))
			}
			diff := new(big.Int).Sub(x, want)
			if diff.CmpAbs(bound) > 0 {
				t.Fatalf("n %d: coefficient %d decrypts %v off its value (bound %v)", n, i, diff, bound)
			}
		}
		for _, cfg := range []struct {
			workers int
			chunks  []int
		}{{2, []int{len(present)}}, {3, []int{1}}, {2, []int{5, 3, 16}}, {4, []int{7}}} {
			got := runPacker(t, e, n, cfg.workers, cfg.chunks, data, present)
			if !slices.Equal(got, ref) {
				t.Fatalf("n %d, %d workers, chunks %v: result differs from the single-worker one", n, cfg.workers, cfg.chunks)
			}
		}
	}
}

// packDecompose gives decomposeNTT's residues (its fast path): FastQuery's primes at 2pc
// flooding (four 29-bit) and at 40-bit flooding (27 + 26 + 26 bits: digits of q_0 beyond the
// 26-bit primes, reduced by one conditional subtraction).
func TestPackLWEsDecomposeMatchesFastops(t *testing.T) {
	c, _, _, e := packSetup(t, true)
	checkPackDecompose(t, c, e.set)
	var q []uint64
	gens := map[int]ring.NTTFriendlyPrimesGenerator{}
	for _, bits := range []int{27, 26, 26, 60} {
		g, ok := gens[bits]
		if !ok {
			g = ring.NewNTTFriendlyPrimesGenerator(uint64(bits), 2<<12)
		}
		p, err := g.NextDownstreamPrime()
		gens[bits] = g
		if err != nil {
			t.Fatal(err)
		}
		q = append(q, p)
	}
	mixed, err := newContextWithPrimes(12, q[:3], q[3:])
	if err != nil {
		t.Fatal(err)
	}
	if q[0]>>1+1 < q[1] {
		t.Fatalf("primes %v do not exercise the conditional subtraction", q)
	}
	checkPackDecompose(t, mixed, rlwe.NewMemEvaluationKeySet(nil))
}

func checkPackDecompose(t *testing.T, c *ctxObj, set *rlwe.MemEvaluationKeySet) {
	w := newPackWorker(c.params, set)
	params := c.params
	L, LP := params.MaxLevel(), params.MaxLevelP()
	r := rand.New(rand.NewPCG(5, 6))
	c2 := params.RingQ().NewPoly()
	for j, q := range params.Q() {
		for i := range c2.Coeffs[j] {
			c2.Coeffs[j][i] = r.Uint64N(q)
		}
		c2.Coeffs[j][0], c2.Coeffs[j][1], c2.Coeffs[j][2] = 0, q-1, q>>1
	}
	want := make([]ringqp.Poly, len(w.decomp))
	for i := range want {
		want[i] = ringqp.NewPoly(params.N(), L, LP)
	}
	decomposeNTT(w.ev, L, LP, LP+1, c2, want)
	packDecompose(w.ev, L, LP, c2, w.inv, w.decomp)
	for i := range want {
		if !want[i].Equal(&w.decomp[i]) {
			t.Fatalf("digit %d differs from decomposeNTT's", i)
		}
	}
}

func TestPackLWEsRefusesBadInput(t *testing.T) {
	c, s, sk, e := packSetup(t, true)
	data, present, _ := packLeaves(c, sk, 5, new(big.Int).Lsh(big.NewInt(1), 90))
	N, k := c.params.N(), c.params.MaxLevel()+1
	per := 2 * k * N
	expect := func(err error, frag string) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), frag) {
			t.Fatalf("error %v, expected one with %q", err, frag)
		}
	}
	_, err := newPacker(e, 0, 1)
	expect(err, "packs 1..")
	_, err = newPacker(e, int64(N+1), 1)
	expect(err, "packs 1..")
	o, err := newPacker(e, 5, 2)
	if err != nil {
		t.Fatal(err)
	}
	bad := slices.Clone(data[:per])
	bad[3*N+17] = c.params.Q()[3] // part 0, prime 3: not reduced
	expect(o.push(bad, []byte{1}), "not reduced")
	expect(o.push(data[:per], []byte{2}), "presence flag")
	expect(o.push(data[:per-1], []byte{1}), "leaf buffer")
	expect(o.push(data, make([]byte, 9)), "pushed after")
	bad3 := slices.Clone(data[:3*per]) // three leaves (subtrees of 2 and 1), the last one unreduced
	bad3[2*per+5] = c.params.Q()[0]
	expect(o.push(bad3, present[:3]), "leaf 2: coefficient 5")
	if err := o.push(data[:4*per], present[:4]); err != nil {
		t.Fatal(err)
	}
	expect(o.finish(make([]uint64, per)), "got 4 leaves")
	if err := o.push(data[4*per:], present[4:]); err != nil {
		t.Fatal(err)
	}
	expect(o.finish(make([]uint64, per-1)), "output buffer")
	if err := o.finish(make([]uint64, per)); err != nil {
		t.Fatal(err)
	}
	expect(o.finish(make([]uint64, per)), "already finished")
	expect(o.push(data[:per], present[:1]), "already finished")
	// all leaves absent
	z, err := newPacker(e, 2, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := z.push(make([]uint64, 2*per), []byte{0, 0}); err != nil {
		t.Fatal(err)
	}
	expect(z.finish(make([]uint64, per)), "zero ciphertexts")
	// a missing Galois key
	_, _, _, e2 := packSetup(t, false)
	_, err = newPacker(e2, 4, 1)
	expect(err, "lack the element 33")
	// a non-ternary secret
	bs := slices.Clone(s)
	bs[9] = 2
	_, err = secretKeyFromTernary(c, bs)
	expect(err, "not ternary")
	_, err = newContextWithPrimes(13, []uint64{c.params.Q()[0]}, []uint64{4})
	expect(err, "out of range")
}

// BenchmarkPackLWEs: 256 leaves (one chunk of embedding.py's _pack_all) on 1 and 2 workers.
func BenchmarkPackLWEs(b *testing.B) {
	c, _, sk, e := packSetup(b, true)
	Q := big.NewInt(1)
	for _, qi := range c.params.Q() {
		Q.Mul(Q, new(big.Int).SetUint64(qi))
	}
	data, present, _ := packLeaves(c, sk, 256, new(big.Int).Rsh(Q, 13))
	for _, w := range []int{1, 2} {
		b.Run(itoa(w)+"workers", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				o, err := newPacker(e, 256, w)
				if err != nil {
					b.Fatal(err)
				}
				if err := o.push(data, present); err != nil {
					b.Fatal(err)
				}
				if err := o.finish(make([]uint64, len(data)/256)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

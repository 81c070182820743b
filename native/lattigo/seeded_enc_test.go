package main

import (
	"bytes"
	"math"
	"testing"

	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
)

// The seeded symmetric encryption (clg_encrypt_seeded): c0 + a s - m, with a expanded from the
// blob's seed, is a small centred error of the parameters' distribution (sigma 3.2, bounded),
// and every encryption has its own seed and error.
func TestEncryptSeededError(t *testing.T) {
	params, err := ckks.NewParametersFromLiteral(ckks.ParametersLiteral{LogN: 13, LogQ: []int{60, 40}, LogP: []int{60}, LogDefaultScale: 40})
	if err != nil {
		t.Fatal(err)
	}
	c := &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil)}
	sk := rlwe.NewKeyGenerator(params).GenSecretKeyNew()
	s := &skObj{ctx: c, sk: sk}
	pt := ckks.NewPlaintext(params, params.MaxLevel())
	vals := make([]float64, params.MaxSlots())
	for i := range vals {
		vals[i] = math.Sin(float64(i))
	}
	if err := encodeNTT(c.encoder, vals, pt); err != nil {
		t.Fatal(err)
	}
	rq := params.RingQ().AtLevel(pt.Level())
	N, q := params.N(), params.Q()
	var seeds [][]byte
	var sum, sumSq float64
	count := 0
	for trial := 0; trial < 3; trial++ {
		b, err := s.encryptSeeded(pt)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) != seededLen(q, N, pt.Level()) {
			t.Fatalf("blob of %d bytes, expected %d", len(b), seededLen(q, N, pt.Level()))
		}
		seed := b[ctHeader : ctHeader+seedLen]
		for _, old := range seeds {
			if bytes.Equal(old, seed) {
				t.Fatal("two encryptions share a seed")
			}
		}
		seeds = append(seeds, append([]byte(nil), seed...))
		c0 := rq.NewPoly()
		off := ctHeader + seedLen
		for j := 0; j <= pt.Level(); j++ {
			rl := packedRowLen(N, q[j])
			if err := readPacked(c0.Coeffs[j], b[off:off+rl], q[j]); err != nil {
				t.Fatal(err)
			}
			off += rl
		}
		a, err := expandUniform(c, seed, pt.Level())
		if err != nil {
			t.Fatal(err)
		}
		e := rq.NewPoly()
		rq.MulCoeffsMontgomery(a, sk.Value.Q, e)
		rq.Add(e, c0, e)
		rq.Sub(e, pt.Value, e)
		rq.INTT(e, e)
		for i := 0; i < N; i++ {
			v := int64(e.Coeffs[0][i])
			if e.Coeffs[0][i] > q[0]/2 {
				v = -int64(q[0] - e.Coeffs[0][i])
			}
			// the same small integer modulo every prime
			w := int64(e.Coeffs[1][i])
			if e.Coeffs[1][i] > q[1]/2 {
				w = -int64(q[1] - e.Coeffs[1][i])
			}
			if v != w || v < -20 || v > 20 {
				t.Fatalf("trial %d coefficient %d: error %d / %d, not a small integer", trial, i, v, w)
			}
			sum += float64(v)
			sumSq += float64(v * v)
			count++
		}
	}
	mean, sd := sum/float64(count), math.Sqrt(sumSq/float64(count))
	if math.Abs(mean) > 0.1 || math.Abs(sd-3.2) > 0.15 {
		t.Fatalf("error mean %.3f sd %.3f, expected about 0 and 3.2", mean, sd)
	}
}

package main

import (
	"math/rand/v2"
	"testing"
)

// The seeded ciphertext's bit packing: a round trip at every width, the packed length, the
// reduction and padding checks.
func TestPackedRows(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for w := 1; w <= 64; w++ {
		for _, n := range []int{1, 3, 7, 8, 64, 1000} {
			q := uint64(1)<<(w-1) + 1 // the smallest modulus of w bits (q - 1 = 2^(w-1))
			if w == 1 {
				q = 2
			}
			if w == 64 {
				q = ^uint64(0)
			}
			if primeBits(q) != w {
				t.Fatalf("w %d: primeBits(%d) = %d", w, q, primeBits(q))
			}
			row := make([]uint64, n)
			for i := range row {
				row[i] = r.Uint64N(q)
			}
			row[0] = q - 1 // the largest value: every bit of the width
			b := appendPacked(nil, row, w)
			if len(b) != packedRowLen(n, q) || len(b) != (n*w+7)/8 {
				t.Fatalf("w %d n %d: %d bytes, expected %d", w, n, len(b), (n*w+7)/8)
			}
			got := make([]uint64, n)
			if err := readPacked(got, b, q); err != nil {
				t.Fatalf("w %d n %d: %v", w, n, err)
			}
			for i := range row {
				if got[i] != row[i] {
					t.Fatalf("w %d n %d: value %d: %d != %d", w, n, i, got[i], row[i])
				}
			}
			if w > 1 { // q itself (w bits) must be refused
				bad := append([]uint64{q}, row[1:]...)
				if err := readPacked(got, appendPacked(nil, bad, w), q); err == nil {
					t.Fatalf("w %d n %d: unreduced value accepted", w, n)
				}
			}
			if (n*w)%8 != 0 { // a set padding bit is refused
				bb := append([]byte(nil), b...)
				bb[len(bb)-1] |= 0x80
				if err := readPacked(got, bb, q); err == nil {
					t.Fatalf("w %d n %d: nonzero padding accepted", w, n)
				}
			}
			if err := readPacked(got, b[:len(b)-1], q); err == nil {
				t.Fatalf("w %d n %d: short row accepted", w, n)
			}
		}
	}
}

//go:build !amd64

package simd

// HasAVX512 is false off amd64.
const HasAVX512 = false

// MulAcc4 is amd64 only.
func MulAcc4(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int) {
	panic("simd.MulAcc4: amd64 only")
}

// MulAcc4Rep2 is amd64 only.
func MulAcc4Rep2(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int) {
	panic("simd.MulAcc4Rep2: amd64 only")
}

// MulAcc4Rep8 is amd64 only.
func MulAcc4Rep8(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int) {
	panic("simd.MulAcc4Rep8: amd64 only")
}

// AVX-512 negacyclic NTTs, a drop-in for Lattigo's standard NTT (ntt_simd.go swaps them in
// under Lattigo's ring.SubRing).
//
// The transform is the one Lattigo computes (ring/ntt.go, NTTStandard / INTTStandard):
// Cooley-Tukey forward from natural to bit-reversed order, the root of group i at the stage
// of half-width t being R[N/(2t) + i]; Gentleman-Sande inverse with the same indexing on the
// inverse roots, then a multiplication by N^-1.  The roots come from Lattigo's own tables
// (converted out of Montgomery form in Go), so the outputs are the same residues; the Go side
// checks that on random polynomials before it swaps a ring's transform.
//
// Arithmetic (Harvey, "Faster arithmetic for number-theoretic transforms", J. Symb. Comp.
// 2014): Shoup products w y mod q in [0, 2q) with w' = floor(w 2^64 / q), lazy butterflies
// with values in [0, 4q) (forward) or [0, 2q) (inverse), which needs q < 2^62 (Lattigo's
// moduli are at most 61 bits).  Eight lanes of 64 bits; the high half of a 64 x 64-bit
// product from four 32 x 32-bit multiplies (AVX-512F has no 64-bit high multiply), the low
// halves by VPMULLQ (AVX-512DQ).  The last three stages (t = 4, 2, 1) work on 16 coefficients
// held in two registers, exchanged by lane permutations; their roots come from expanded
// tables (one root per lane) built by the Go side.
//
// Compiled for any x86-64 (function-level target attributes); the Go side calls these only
// when the CPU reports AVX-512F and AVX-512DQ.  Elsewhere the file compiles to nothing.

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "ntt_avx512.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512dq")))

// high 64 bits of a x b, lane-wise, exact
static inline AVX512 __m512i mulhi64(__m512i a, __m512i b) {
	const __m512i lo32 = _mm512_set1_epi64(0xffffffffULL);
	__m512i a1 = _mm512_srli_epi64(a, 32), b1 = _mm512_srli_epi64(b, 32);
	__m512i ll = _mm512_mul_epu32(a, b);
	__m512i lh = _mm512_mul_epu32(a, b1);
	__m512i hl = _mm512_mul_epu32(a1, b);
	__m512i hh = _mm512_mul_epu32(a1, b1);
	__m512i mid = _mm512_add_epi64(_mm512_srli_epi64(ll, 32), _mm512_and_si512(lh, lo32));
	mid = _mm512_add_epi64(mid, _mm512_and_si512(hl, lo32));
	hh = _mm512_add_epi64(hh, _mm512_srli_epi64(lh, 32));
	hh = _mm512_add_epi64(hh, _mm512_srli_epi64(hl, 32));
	return _mm512_add_epi64(hh, _mm512_srli_epi64(mid, 32));
}

// w y mod q in [0, 2q) for any y < 2^64 (Shoup; wp = floor(w 2^64 / q), w < q)
static inline AVX512 __m512i mulshoup(__m512i y, __m512i w, __m512i wp, __m512i q) {
	__m512i qt = mulhi64(y, wp);
	return _mm512_sub_epi64(_mm512_mullo_epi64(y, w), _mm512_mullo_epi64(qt, q));
}

// x in [0, 2m) -> [0, m): x - m wraps above x when x < m
static inline AVX512 __m512i red(__m512i x, __m512i m) {
	return _mm512_min_epu64(x, _mm512_sub_epi64(x, m));
}

// forward butterfly: x, y in [0, 4q) -> x + w y, x - w y + 2q, both in [0, 4q)
static inline AVX512 void fwd(__m512i *x, __m512i *y, __m512i w, __m512i wp, __m512i q, __m512i q2) {
	__m512i X = red(*x, q2);
	__m512i T = mulshoup(*y, w, wp, q);
	*x = _mm512_add_epi64(X, T);
	*y = _mm512_add_epi64(_mm512_sub_epi64(X, T), q2);
}

// inverse butterfly: x, y in [0, 2q) -> x + y, (x - y + 2q) w, both in [0, 2q)
static inline AVX512 void inv(__m512i *x, __m512i *y, __m512i w, __m512i wp, __m512i q, __m512i q2) {
	__m512i X = *x, Y = *y;
	*x = red(_mm512_add_epi64(X, Y), q2);
	*y = mulshoup(_mm512_add_epi64(_mm512_sub_epi64(X, Y), q2), w, wp, q);
}

#define LD(p) _mm512_loadu_si512((const void *)(p))
#define ST(p, v) _mm512_storeu_si512((void *)(p), (v))

// lane permutations of the last three stages, on the 16 coefficients A = a[0..8), B = a[8..16)
//   t = 4: X = A0-3 B0-3, Y = A4-7 B4-7 (128-bit chunk shuffles)
//   t = 2: X = A0 A1 A4 A5 B0 B1 B4 B5, Y = A2 A3 A6 A7 B2 B3 B6 B7
//   t = 1: X = the even coefficients, Y = the odd ones
static const int64_t T2X[8] = {0, 1, 4, 5, 8, 9, 12, 13}, T2Y[8] = {2, 3, 6, 7, 10, 11, 14, 15};
static const int64_t T2A[8] = {0, 1, 8, 9, 2, 3, 10, 11}, T2B[8] = {4, 5, 12, 13, 6, 7, 14, 15};
static const int64_t T1X[8] = {0, 2, 4, 6, 8, 10, 12, 14}, T1Y[8] = {1, 3, 5, 7, 9, 11, 13, 15};
static const int64_t T1A[8] = {0, 8, 1, 9, 2, 10, 3, 11}, T1B[8] = {4, 12, 5, 13, 6, 14, 7, 15};

AVX512 void clg_ntt_forward(uint64_t *out, const uint64_t *in, const clg_ntt_table *tb, int lazy) {
	const size_t n = tb->n;
	const __m512i q = _mm512_set1_epi64(tb->q), q2 = _mm512_set1_epi64(2 * tb->q);
	const uint64_t *R = tb->fw, *Rp = tb->fwp;
	if (out != in) {
		memcpy(out, in, n * sizeof(uint64_t));
	}
	// stages t = n/2 ... 8: one root per group of 2t coefficients
	for (size_t m = 1, t = n >> 1; t >= 8; m <<= 1, t >>= 1) {
		for (size_t i = 0; i < m; i++) {
			const __m512i w = _mm512_set1_epi64(R[m + i]), wp = _mm512_set1_epi64(Rp[m + i]);
			uint64_t *x = out + 2 * i * t, *y = x + t;
			for (size_t j = 0; j < t; j += 8) {
				__m512i X = LD(x + j), Y = LD(y + j);
				fwd(&X, &Y, w, wp, q, q2);
				ST(x + j, X);
				ST(y + j, Y);
			}
		}
	}
	// stages t = 4, 2, 1 on 16 coefficients at a time
	const __m512i t2x = LD(T2X), t2y = LD(T2Y), t2a = LD(T2A), t2b = LD(T2B);
	const __m512i t1x = LD(T1X), t1y = LD(T1Y), t1a = LD(T1A), t1b = LD(T1B);
	const uint64_t *R1 = R + (n >> 1), *R1p = Rp + (n >> 1);
	for (size_t b = 0; b < n; b += 16) {
		const size_t k = b >> 1;  // lane offset into the expanded tables (n/2 entries each)
		__m512i A = LD(out + b), B = LD(out + b + 8);
		__m512i X = _mm512_shuffle_i64x2(A, B, 0x44), Y = _mm512_shuffle_i64x2(A, B, 0xEE);
		fwd(&X, &Y, LD(tb->f4 + k), LD(tb->f4p + k), q, q2);
		A = _mm512_shuffle_i64x2(X, Y, 0x44);
		B = _mm512_shuffle_i64x2(X, Y, 0xEE);
		X = _mm512_permutex2var_epi64(A, t2x, B);
		Y = _mm512_permutex2var_epi64(A, t2y, B);
		fwd(&X, &Y, LD(tb->f2 + k), LD(tb->f2p + k), q, q2);
		A = _mm512_permutex2var_epi64(X, t2a, Y);
		B = _mm512_permutex2var_epi64(X, t2b, Y);
		X = _mm512_permutex2var_epi64(A, t1x, B);
		Y = _mm512_permutex2var_epi64(A, t1y, B);
		fwd(&X, &Y, LD(R1 + k), LD(R1p + k), q, q2);
		if (!lazy) {  // [0, 4q) -> [0, q)
			X = red(red(X, q2), q);
			Y = red(red(Y, q2), q);
		}
		ST(out + b, _mm512_permutex2var_epi64(X, t1a, Y));
		ST(out + b + 8, _mm512_permutex2var_epi64(X, t1b, Y));
	}
}

AVX512 void clg_ntt_backward(uint64_t *out, const uint64_t *in, const clg_ntt_table *tb, int lazy) {
	const size_t n = tb->n;
	const __m512i q = _mm512_set1_epi64(tb->q), q2 = _mm512_set1_epi64(2 * tb->q);
	const uint64_t *R = tb->bw, *Rp = tb->bwp;
	// stages t = 1, 2, 4 on 16 coefficients at a time (from `in`, which may be `out`)
	const __m512i t2x = LD(T2X), t2y = LD(T2Y), t2a = LD(T2A), t2b = LD(T2B);
	const __m512i t1x = LD(T1X), t1y = LD(T1Y), t1a = LD(T1A), t1b = LD(T1B);
	const uint64_t *R1 = R + (n >> 1), *R1p = Rp + (n >> 1);
	for (size_t b = 0; b < n; b += 16) {
		const size_t k = b >> 1;
		__m512i A = LD(in + b), B = LD(in + b + 8);
		__m512i X = _mm512_permutex2var_epi64(A, t1x, B), Y = _mm512_permutex2var_epi64(A, t1y, B);
		inv(&X, &Y, LD(R1 + k), LD(R1p + k), q, q2);
		A = _mm512_permutex2var_epi64(X, t1a, Y);
		B = _mm512_permutex2var_epi64(X, t1b, Y);
		X = _mm512_permutex2var_epi64(A, t2x, B);
		Y = _mm512_permutex2var_epi64(A, t2y, B);
		inv(&X, &Y, LD(tb->b2 + k), LD(tb->b2p + k), q, q2);
		A = _mm512_permutex2var_epi64(X, t2a, Y);
		B = _mm512_permutex2var_epi64(X, t2b, Y);
		X = _mm512_shuffle_i64x2(A, B, 0x44);
		Y = _mm512_shuffle_i64x2(A, B, 0xEE);
		inv(&X, &Y, LD(tb->b4 + k), LD(tb->b4p + k), q, q2);
		ST(out + b, _mm512_shuffle_i64x2(X, Y, 0x44));
		ST(out + b + 8, _mm512_shuffle_i64x2(X, Y, 0xEE));
	}
	// stages t = 8 ... n/2
	for (size_t t = 8, m = n >> 4; t < n; t <<= 1, m >>= 1) {
		for (size_t i = 0; i < m; i++) {
			const __m512i w = _mm512_set1_epi64(R[m + i]), wp = _mm512_set1_epi64(Rp[m + i]);
			uint64_t *x = out + 2 * i * t, *y = x + t;
			for (size_t j = 0; j < t; j += 8) {
				__m512i X = LD(x + j), Y = LD(y + j);
				inv(&X, &Y, w, wp, q, q2);
				ST(x + j, X);
				ST(y + j, Y);
			}
		}
	}
	// times N^-1: [0, 2q), then [0, q) unless lazy
	const __m512i ni = _mm512_set1_epi64(tb->ninv), nip = _mm512_set1_epi64(tb->ninvp);
	for (size_t j = 0; j < n; j += 8) {
		__m512i X = mulshoup(LD(out + j), ni, nip, q);
		if (!lazy) {
			X = red(X, q);
		}
		ST(out + j, X);
	}
}

int clg_ntt_compiled(void) { return 1; }

#else

void clg_ntt_forward(uint64_t *out, const uint64_t *in, const clg_ntt_table *tb, int lazy) {
	(void)out; (void)in; (void)tb; (void)lazy;
}
void clg_ntt_backward(uint64_t *out, const uint64_t *in, const clg_ntt_table *tb, int lazy) {
	(void)out; (void)in; (void)tb; (void)lazy;
}
int clg_ntt_compiled(void) { return 0; }

#endif

// Tables and entry points of the AVX-512 NTTs (ntt_avx512.c; Go side: ntt_simd.go).
#ifndef CLG_NTT_AVX512_H
#define CLG_NTT_AVX512_H

#include <stdint.h>
#include <stddef.h>

// One prime's tables, all in standard (not Montgomery) form, with their Shoup companions
// (x' = floor(x 2^64 / q)).  fw / bw: Lattigo's forward / inverse roots (n entries, bit-reversed
// order); f4, f2 / b4, b2: the roots of the stages t = 4 and t = 2 expanded to one per lane
// (n/2 entries each, see ntt_avx512.c); ninv = N^-1 mod q.
typedef struct {
	size_t n;
	uint64_t q;
	const uint64_t *fw, *fwp, *bw, *bwp;
	const uint64_t *f4, *f4p, *f2, *f2p, *b4, *b4p, *b2, *b2p;
	uint64_t ninv, ninvp;
} clg_ntt_table;

// out = NTT(in) (in may be out); values in [0, q), or in [0, 4q) when lazy.  Inputs below 4q.
void clg_ntt_forward(uint64_t *out, const uint64_t *in, const clg_ntt_table *tb, int lazy);
// out = INTT(in) (in may be out); values in [0, q), or in [0, 2q) when lazy.  Inputs below 2q.
void clg_ntt_backward(uint64_t *out, const uint64_t *in, const clg_ntt_table *tb, int lazy);
// 1 when the AVX-512 code was compiled in (x86-64 with GCC or Clang), else 0
int clg_ntt_compiled(void);

#endif

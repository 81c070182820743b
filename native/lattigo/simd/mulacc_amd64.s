#include "textflag.h"

// One term of mulAcc4AVX512: a (ar) and p (pr) 8 lanes each, split at bit 32 (a, p < 2^60):
// Z0 += lo32(a0 p0), Z1 += hi32(a0 p0) + a0 p1 + a1 p0, Z2 += a1 p1.
#define TERM(ar, pr) \
	VMOVDQU64 (ar)(AX*8), Z3; \
	VMOVDQU64 (pr)(AX*8), Z4; \
	VPSRLQ    $32, Z3, Z5; \
	VPSRLQ    $32, Z4, Z6; \
	VPMULUDQ  Z4, Z3, Z7; \
	VPMULUDQ  Z6, Z3, Z8; \
	VPMULUDQ  Z4, Z5, Z9; \
	VPMULUDQ  Z6, Z5, Z10; \
	VPADDQ    Z10, Z2, Z2; \
	VPADDQ    Z8, Z1, Z1; \
	VPADDQ    Z9, Z1, Z1; \
	VPSRLQ    $32, Z7, Z11; \
	VPADDQ    Z11, Z1, Z1; \
	VPANDQ    Z31, Z7, Z7; \
	VPADDQ    Z7, Z0, Z0

// TERM2: TERM with p read at half rate: lanes 2i, 2i+1 both take p[i] (4 words from (pr)(AX*4),
// spread by Z29 = [0 0 1 1 2 2 3 3]).
#define TERM2(ar, pr) \
	VMOVDQU64 (ar)(AX*8), Z3; \
	VMOVDQU   (pr)(AX*4), Y4; \
	VPERMQ    Z4, Z29, Z4; \
	VPSRLQ    $32, Z3, Z5; \
	VPSRLQ    $32, Z4, Z6; \
	VPMULUDQ  Z4, Z3, Z7; \
	VPMULUDQ  Z6, Z3, Z8; \
	VPMULUDQ  Z4, Z5, Z9; \
	VPMULUDQ  Z6, Z5, Z10; \
	VPADDQ    Z10, Z2, Z2; \
	VPADDQ    Z8, Z1, Z1; \
	VPADDQ    Z9, Z1, Z1; \
	VPSRLQ    $32, Z7, Z11; \
	VPADDQ    Z11, Z1, Z1; \
	VPANDQ    Z31, Z7, Z7; \
	VPADDQ    Z7, Z0, Z0

// TERM8: TERM with one p per 8 lanes: all 8 lanes take p[c / 8] (the word at byte offset c of pr,
// c = AX a multiple of 8).
#define TERM8(ar, pr) \
	VMOVDQU64 (ar)(AX*8), Z3; \
	VPBROADCASTQ (pr)(AX*1), Z4; \
	VPSRLQ    $32, Z3, Z5; \
	VPSRLQ    $32, Z4, Z6; \
	VPMULUDQ  Z4, Z3, Z7; \
	VPMULUDQ  Z6, Z3, Z8; \
	VPMULUDQ  Z4, Z5, Z9; \
	VPMULUDQ  Z6, Z5, Z10; \
	VPADDQ    Z10, Z2, Z2; \
	VPADDQ    Z8, Z1, Z1; \
	VPADDQ    Z9, Z1, Z1; \
	VPSRLQ    $32, Z7, Z11; \
	VPADDQ    Z11, Z1, Z1; \
	VPANDQ    Z31, Z7, Z7; \
	VPADDQ    Z7, Z0, Z0

// ARGS: the kernels' arguments: as in R8-R11, ps in R12, R13, SI, DI, hi in BX, lo in DX, n in CX;
// Z31 = 2^32 - 1 and Z30 = 1 in every lane.
#define ARGS \
	MOVQ as+0(FP), AX; \
	MOVQ 0(AX), R8; \
	MOVQ 8(AX), R9; \
	MOVQ 16(AX), R10; \
	MOVQ 24(AX), R11; \
	MOVQ ps+8(FP), AX; \
	MOVQ 0(AX), R12; \
	MOVQ 8(AX), R13; \
	MOVQ 16(AX), SI; \
	MOVQ 24(AX), DI; \
	MOVQ hi+16(FP), BX; \
	MOVQ lo+24(FP), DX; \
	MOVQ n+32(FP), CX; \
	MOVQ $0xFFFFFFFF, AX; \
	VPBROADCASTQ AX, Z31; \
	MOVQ $1, AX; \
	VPBROADCASTQ AX, Z30

// ACCUMULATE: (hi, lo)[AX .. AX+7] += the 128-bit sums Z2 2^64 + Z1 2^32 + Z0 (Z1 < 4 (2^61 +
// 2^32) < 2^64), with the carries.
#define ACCUMULATE \
	VPSLLQ    $32, Z1, Z12; \
	VPSRLQ    $32, Z1, Z13; \
	VPADDQ    Z12, Z0, Z14; \
	VPCMPUQ   $1, Z12, Z14, K1; \
	VPADDQ    Z13, Z2, Z15; \
	VPADDQ    Z30, Z15, K1, Z15; \
	VMOVDQU64 (DX)(AX*8), Z16; \
	VMOVDQU64 (BX)(AX*8), Z17; \
	VPADDQ    Z14, Z16, Z16; \
	VPCMPUQ   $1, Z14, Z16, K2; \
	VPADDQ    Z15, Z17, Z17; \
	VPADDQ    Z30, Z17, K2, Z17; \
	VMOVDQU64 Z16, (DX)(AX*8); \
	VMOVDQU64 Z17, (BX)(AX*8)

DATA rep2idx<>+0(SB)/8, $0
DATA rep2idx<>+8(SB)/8, $0
DATA rep2idx<>+16(SB)/8, $1
DATA rep2idx<>+24(SB)/8, $1
DATA rep2idx<>+32(SB)/8, $2
DATA rep2idx<>+40(SB)/8, $2
DATA rep2idx<>+48(SB)/8, $3
DATA rep2idx<>+56(SB)/8, $3
GLOBL rep2idx<>(SB), RODATA|NOPTR, $64

// func MulAcc4(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int)
// (hi, lo)[c] += sum_{t<4} as[t][c] * ps[t][c] as 128-bit sums, c < n, n a multiple of 8,
// every operand < 2^60.
TEXT ·MulAcc4(SB), NOSPLIT, $0-40
	ARGS
	XORQ AX, AX

loop:
	CMPQ AX, CX
	JGE  done
	VPXORQ Z0, Z0, Z0
	VPXORQ Z1, Z1, Z1
	VPXORQ Z2, Z2, Z2
	TERM(R8, R12)
	TERM(R9, R13)
	TERM(R10, SI)
	TERM(R11, DI)
	ACCUMULATE
	ADDQ      $8, AX
	JMP       loop

done:
	VZEROUPPER
	RET

// func MulAcc4Rep2(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int)
// MulAcc4 with ps[t][c / 2] in place of ps[t][c] (the ps n / 2 words long).
TEXT ·MulAcc4Rep2(SB), NOSPLIT, $0-40
	ARGS
	VMOVDQU64 rep2idx<>(SB), Z29
	XORQ AX, AX

loop2:
	CMPQ AX, CX
	JGE  done2
	VPXORQ Z0, Z0, Z0
	VPXORQ Z1, Z1, Z1
	VPXORQ Z2, Z2, Z2
	TERM2(R8, R12)
	TERM2(R9, R13)
	TERM2(R10, SI)
	TERM2(R11, DI)
	ACCUMULATE
	ADDQ      $8, AX
	JMP       loop2

done2:
	VZEROUPPER
	RET

// func MulAcc4Rep8(as *[4]*uint64, ps *[4]*uint64, hi, lo *uint64, n int)
// MulAcc4 with ps[t][c / 8] in place of ps[t][c] (the ps n / 8 words long).
TEXT ·MulAcc4Rep8(SB), NOSPLIT, $0-40
	ARGS
	XORQ AX, AX

loop8:
	CMPQ AX, CX
	JGE  done8
	VPXORQ Z0, Z0, Z0
	VPXORQ Z1, Z1, Z1
	VPXORQ Z2, Z2, Z2
	TERM8(R8, R12)
	TERM8(R9, R13)
	TERM8(R10, SI)
	TERM8(R11, DI)
	ACCUMULATE
	ADDQ      $8, AX
	JMP       loop8

done8:
	VZEROUPPER
	RET

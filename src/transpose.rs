//! Bit-matrix transposition (the "transpose" step of IKNP03 section 3).
//!
//! Layout: a matrix of `rows` x `cols` bits is stored row-major, each row
//! `cols / 8` bytes, bit j of a row at byte j/8, bit j%8 (LSB first).
//!
//! The x86_64 path uses the SSE2 `movemask` trick (as in ALSZ13, section 4):
//! gather byte c of 16 consecutive rows into one 128-bit register; `pmovmskb`
//! then yields the 16 bits of column 8c+7 for those rows in one instruction;
//! shifting every byte left by one exposes column 8c+6, and so on.  The loop
//! order (byte column outer, row blocks inner) writes each output row once and
//! keeps the strided input reads inside a few KiB of L1.

/// Transpose `rows` x `cols` bits (`rows % 16 == 0`, `cols % 8 == 0`).
pub fn transpose(inp: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert!(rows % 16 == 0 && cols % 8 == 0);
    assert_eq!(inp.len(), rows * cols / 8);
    let mut out = vec![0u8; rows * cols / 8];
    #[cfg(target_arch = "x86_64")]
    unsafe {
        transpose_sse2(inp, rows, cols, &mut out);
    }
    #[cfg(not(target_arch = "x86_64"))]
    transpose_scalar(inp, rows, cols, &mut out);
    out
}

#[allow(dead_code)]
pub fn transpose_scalar(inp: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    let in_rb = cols / 8;
    let out_rb = rows / 8;
    for r in 0..rows {
        for c in 0..cols {
            if (inp[r * in_rb + c / 8] >> (c % 8)) & 1 == 1 {
                out[c * out_rb + r / 8] |= 1 << (r % 8);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
unsafe fn transpose_sse2(inp: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    use std::arch::x86_64::*;
    // Tiles of TB byte-columns: each input row contributes one contiguous
    // TB-byte piece (one cache line) to a local tile, so the strided byte
    // gathers below hit L1 instead of thrashing the cache sets that rows at a
    // power-of-two stride would all map to.
    const TB: usize = 64;
    let in_rb = cols / 8;
    let out_rb = rows / 8;
    let op = out.as_mut_ptr();
    let mut tile = vec![0u8; rows * TB];
    let mut buf = [0u8; 16];
    let mut c0 = 0;
    while c0 < in_rb {
        let w = TB.min(in_rb - c0);
        for r in 0..rows {
            tile[r * TB..r * TB + w].copy_from_slice(&inp[r * in_rb + c0..r * in_rb + c0 + w]);
        }
        let tp = tile.as_ptr();
        // Full 16-byte column groups: 16x16 byte transposes in registers.
        let w16 = w / 16 * 16;
        for cb0 in (0..w16).step_by(16) {
            for r in (0..rows).step_by(16) {
                let mut a = [_mm_setzero_si128(); 16];
                for i in 0..16 {
                    a[i] = _mm_loadu_si128(tp.add((r + i) * TB + cb0) as *const __m128i);
                }
                let e = transpose16x16(&a);
                for c in 0..16 {
                    let mut v = e[c];
                    let orow = (c0 + cb0 + c) * 8;
                    for b in (0..8).rev() {
                        let bits = _mm_movemask_epi8(v) as u16;
                        let dst = op.add((orow + b) * out_rb + r / 8) as *mut u16;
                        dst.write_unaligned(bits.to_le());
                        v = _mm_slli_epi64(v, 1);
                    }
                }
            }
        }
        // Remaining byte columns: gather 16 bytes at a time.
        for cb in w16..w {
            for r in (0..rows).step_by(16) {
                for k in 0..16 {
                    buf[k] = *tp.add((r + k) * TB + cb);
                }
                let mut v = _mm_loadu_si128(buf.as_ptr() as *const __m128i);
                for b in (0..8).rev() {
                    let bits = _mm_movemask_epi8(v) as u16;
                    let dst = op.add(((c0 + cb) * 8 + b) * out_rb + r / 8) as *mut u16;
                    dst.write_unaligned(bits.to_le());
                    v = _mm_slli_epi64(v, 1);
                }
            }
        }
        c0 += w;
    }
}

/// Transpose a 16x16 byte matrix held as 16 row vectors: result[c] holds byte c
/// of rows 0..16.  Four interleave stages (8-, 16-, 32-, 64-bit unpacks).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose16x16(a: &[std::arch::x86_64::__m128i; 16]) -> [std::arch::x86_64::__m128i; 16] {
    use std::arch::x86_64::*;
    let z = _mm_setzero_si128();
    // b[2p + x]: rows 2p, 2p+1; x = 0 columns 0..8, x = 1 columns 8..16 (16-bit lanes)
    let mut b = [z; 16];
    for p in 0..8 {
        b[2 * p] = _mm_unpacklo_epi8(a[2 * p], a[2 * p + 1]);
        b[2 * p + 1] = _mm_unpackhi_epi8(a[2 * p], a[2 * p + 1]);
    }
    // c[4q + g]: rows 4q..4q+4, columns 4g..4g+4 (32-bit lanes)
    let mut c = [z; 16];
    for q in 0..4 {
        for x in 0..2 {
            let lo = b[2 * (2 * q) + x];
            let hi = b[2 * (2 * q + 1) + x];
            c[4 * q + 2 * x] = _mm_unpacklo_epi16(lo, hi);
            c[4 * q + 2 * x + 1] = _mm_unpackhi_epi16(lo, hi);
        }
    }
    // d[8s + h]: rows 8s..8s+8, columns 2h, 2h+1 (64-bit lanes)
    let mut d = [z; 16];
    for s in 0..2 {
        for g in 0..4 {
            let lo = c[4 * (2 * s) + g];
            let hi = c[4 * (2 * s + 1) + g];
            d[8 * s + 2 * g] = _mm_unpacklo_epi32(lo, hi);
            d[8 * s + 2 * g + 1] = _mm_unpackhi_epi32(lo, hi);
        }
    }
    let mut e = [z; 16];
    for h in 0..8 {
        e[2 * h] = _mm_unpacklo_epi64(d[h], d[8 + h]);
        e[2 * h + 1] = _mm_unpackhi_epi64(d[h], d[8 + h]);
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn matches_scalar() {
        let rows = 128;
        let cols = 48;
        let inp: Vec<u8> = (0..rows * cols / 8).map(|i| (i * 131 + 7) as u8).collect();
        let a = transpose(&inp, rows, cols);
        let mut b = vec![0u8; rows * cols / 8];
        transpose_scalar(&inp, rows, cols, &mut b);
        assert_eq!(a, b);
    }
}

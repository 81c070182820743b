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
        for cb in 0..w {
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

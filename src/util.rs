//! Small shared helpers: zero-copy views of Python buffers, bit packing.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A read-only byte view of a C-contiguous Python buffer (bytes, bytearray,
/// numpy uint8 arrays, memoryviews cast to "B").
///
/// The returned slice lives as long as the `PyBuffer`, which holds a
/// reference to the exporting object; it is read while the GIL is released,
/// exactly as numpy itself does.
pub fn view(b: &PyBuffer<u8>) -> PyResult<&[u8]> {
    if !b.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer must be C-contiguous"));
    }
    let n = b.len_bytes();
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: the buffer is contiguous, `n` bytes long and kept alive by `b`.
    Ok(unsafe { std::slice::from_raw_parts(b.buf_ptr() as *const u8, n) })
}

pub fn err<T>(msg: impl Into<String>) -> PyResult<T> {
    Err(PyValueError::new_err(msg.into()))
}

pub fn check_bits(bits: u32) -> PyResult<u64> {
    if bits == 0 || bits > 64 {
        return err(format!("bits must be in 1..=64, got {bits}"));
    }
    Ok(mask(bits))
}

#[inline]
pub fn mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

/// Bytes needed to pack `n` values of `bits` bits.
#[inline]
pub fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize + 7) / 8
}

/// Pack the low `bits` bits of each value, LSB first, into a contiguous bit
/// stream (value i occupies stream bits [i*bits, (i+1)*bits)).
pub fn pack(vals: &[u64], bits: u32) -> Vec<u8> {
    let total = packed_len(vals.len(), bits);
    let mut out = Vec::with_capacity(total + 8);
    if bits == 64 {
        for v in vals {
            out.extend_from_slice(&v.to_le_bytes());
        }
        return out;
    }
    let m = mask(bits);
    // whole 64-bit words of the stream at a time (the same LSB-first byte stream)
    let mut acc: u128 = 0;
    let mut nacc: u32 = 0;
    for &v in vals {
        acc |= ((v & m) as u128) << nacc;
        nacc += bits;
        if nacc >= 64 {
            out.extend_from_slice(&(acc as u64).to_le_bytes());
            acc >>= 64;
            nacc -= 64;
        }
    }
    out.extend_from_slice(&(acc as u64).to_le_bytes()[..((nacc + 7) / 8) as usize]);
    debug_assert_eq!(out.len(), total);
    out
}

/// Inverse of `pack`: `n` values of `bits` bits from `buf` (which must be
/// exactly `packed_len(n, bits)` bytes).
pub fn unpack(buf: &[u8], n: usize, bits: u32) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    if bits == 64 {
        for c in buf.chunks_exact(8).take(n) {
            out.push(u64::from_le_bytes(c.try_into().unwrap()));
        }
        return out;
    }
    let m = mask(bits);
    let mut acc: u128 = 0;
    let mut nacc: u32 = 0;
    let mut pos = 0usize;
    for _ in 0..n {
        if nacc < bits {
            if pos + 8 <= buf.len() {
                // a whole word of the stream (nacc < bits <= 63: it fits beside what is left)
                acc |= (u64::from_le_bytes(buf[pos..pos + 8].try_into().unwrap()) as u128) << nacc;
                pos += 8;
                nacc += 64;
            } else {
                while nacc < bits {
                    acc |= (buf[pos] as u128) << nacc;
                    pos += 1;
                    nacc += 8;
                }
            }
        }
        out.push((acc as u64) & m);
        acc >>= bits;
        nacc -= bits;
    }
    out
}

pub fn u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

pub fn u64_bytes(v: &[u64]) -> Vec<u8> {
    let mut out = vec![0u8; v.len() * 8];
    for (o, x) in out.chunks_exact_mut(8).zip(v) {
        o.copy_from_slice(&x.to_le_bytes());
    }
    out
}

/// A C-contiguous buffer of 8-byte integers (numpy uint64 / int64 viewed as uint8) as u64s,
/// without a copy; empty buffers give an empty slice.
pub fn u64_slice<'a>(b: &'a PyBuffer<u8>, what: &str) -> PyResult<&'a [u64]> {
    let v = view(b)?;
    if v.is_empty() {
        return Ok(&[]);
    }
    if v.len() % 8 != 0 || (v.as_ptr() as usize) % 8 != 0 {
        return err(format!("{what} must be an aligned array of 8-byte integers"));
    }
    // SAFETY: aligned, length a multiple of 8, alive as long as the buffer.
    Ok(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u64, v.len() / 8) })
}

/// The bytes of a u64 slice (native byte order), without a copy.
pub fn bytes_of(v: &[u64]) -> &[u8] {
    // SAFETY: plain integers, viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
}

/// The bytes of a u128 slice (native byte order), mutable, without a copy.
pub fn bytes_of_u128_mut(v: &mut [u128]) -> &mut [u8] {
    // SAFETY: plain integers, viewed as their bytes; u8 has no alignment or validity needs.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 16) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed stream bit by bit: value i's bit b is stream bit i * bits + b, LSB first.
    fn reference_pack(vals: &[u64], bits: u32) -> Vec<u8> {
        let mut out = vec![0u8; packed_len(vals.len(), bits)];
        for (i, &v) in vals.iter().enumerate() {
            for b in 0..bits as usize {
                if v >> b & 1 == 1 {
                    let at = i * bits as usize + b;
                    out[at / 8] |= 1 << (at % 8);
                }
            }
        }
        out
    }

    #[test]
    fn pack_matches_the_bit_stream_and_unpack_inverts_it() {
        let mut s: u64 = 0x9e3779b97f4a7c15;
        for bits in 1..=64u32 {
            for n in [0usize, 1, 7, 8, 9, 63, 64, 65, 200] {
                let vals: Vec<u64> = (0..n)
                    .map(|_| {
                        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        s & mask(bits)
                    })
                    .collect();
                let packed = pack(&vals, bits);
                assert_eq!(packed, reference_pack(&vals, bits), "bits {bits} n {n}");
                assert_eq!(unpack(&packed, n, bits), vals, "bits {bits} n {n}");
            }
        }
    }
}

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
    let mut out = vec![0u8; packed_len(vals.len(), bits)];
    if bits == 64 {
        for (o, v) in out.chunks_exact_mut(8).zip(vals) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        return out;
    }
    let m = mask(bits);
    let mut acc: u128 = 0;
    let mut nacc: u32 = 0;
    let mut pos = 0usize;
    for &v in vals {
        acc |= ((v & m) as u128) << nacc;
        nacc += bits;
        while nacc >= 8 {
            out[pos] = acc as u8;
            pos += 1;
            acc >>= 8;
            nacc -= 8;
        }
    }
    if nacc > 0 {
        out[pos] = acc as u8;
    }
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
        while nacc < bits {
            acc |= (buf[pos] as u128) << nacc;
            pos += 1;
            nacc += 8;
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

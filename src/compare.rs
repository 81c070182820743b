//! The leaves of the millionaires' comparison (CrypTFlow2 section 3.1, Algorithm 1;
//! `cipherlm/mpc/protocols/millionaire.py`) in one pass each, instead of a numpy pass per
//! shift, mask, comparison and XOR over (n, q, N) tables: the m-bit digits of each input
//! (`digit_blocks`, both parties) and the sender's 1-out-of-N message of every digit value
//! (`cmp_leaf_msgs`).  Pure data layout: no randomness or secret-dependent branching
//! beyond what the numpy version computed (the sender's own inputs and shares).

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::util::{check_bits, err, view};

/// The m-bit digits (m in 1..=8) of `bits`-bit values: vals (n uint64) -> n * q bytes,
/// q = ceil(bits / m), value j's digits at j q .. j q + q - 1, the least significant
/// first; bits of a value above `bits` are ignored.
#[pyfunction]
pub fn digit_blocks<'py>(py: Python<'py>, vals: PyBuffer<u8>, bits: u32, m: u32) -> PyResult<Bound<'py, PyByteArray>> {
    let keep = check_bits(bits)?;
    if !(1..=8).contains(&m) {
        return err(format!("digits of {m} bits (1..=8)"));
    }
    let v = view(&vals)?;
    if v.len() % 8 != 0 {
        return err("values must be uint64");
    }
    let q = bits.div_ceil(m) as usize;
    let low = (1u64 << m) - 1;
    let out = py.allow_threads(|| {
        let mut out = vec![0u8; v.len() / 8 * q];
        for (o, c) in out.chunks_exact_mut(q).zip(v.chunks_exact(8)) {
            let x = u64::from_le_bytes(c.try_into().unwrap()) & keep;
            for (i, d) in o.iter_mut().enumerate() {
                *d = ((x >> (i as u32 * m)) & low) as u8; // i m < bits <= 64
            }
        }
        out
    });
    Ok(PyByteArray::new_bound(py, &out))
}

/// The sender's message tables of the comparison's leaves: digits (k bytes, each < N),
/// lt0, eq0 (k bytes 0/1, its shares) -> k * N bytes, message x of leaf i
/// (lt0_i xor 1{d_i < x}) | ((eq0_i xor 1{d_i == x}) << 1), or with `want_lt` false
/// only eq0_i xor 1{d_i == x} (the equality's leaves; lt0 is then not read).
#[pyfunction]
pub fn cmp_leaf_msgs<'py>(
    py: Python<'py>,
    digits: PyBuffer<u8>,
    lt0: PyBuffer<u8>,
    eq0: PyBuffer<u8>,
    nn: usize,
    want_lt: bool,
) -> PyResult<Bound<'py, PyByteArray>> {
    if !(2..=256).contains(&nn) {
        return err(format!("N must be in 2..=256, got {nn}"));
    }
    let (d, e) = (view(&digits)?, view(&eq0)?);
    let l = if want_lt { view(&lt0)? } else { e };
    if e.len() != d.len() || l.len() != d.len() {
        return err(format!("{} digits, {} lt shares, {} eq shares", d.len(), l.len(), e.len()));
    }
    if d.iter().any(|&x| x as usize >= nn) || e.iter().chain(l.iter()).any(|&b| b > 1) {
        return err(format!("digits must be < {nn} and shares 0 or 1"));
    }
    let out = py.allow_threads(|| {
        let mut out = vec![0u8; d.len() * nn];
        for (i, row) in out.chunks_exact_mut(nn).enumerate() {
            let (di, ei) = (d[i] as usize, e[i]);
            if want_lt {
                let li = l[i];
                for (x, o) in row.iter_mut().enumerate() {
                    *o = (li ^ (di < x) as u8) | ((ei ^ (di == x) as u8) << 1);
                }
            } else {
                for (x, o) in row.iter_mut().enumerate() {
                    *o = ei ^ (di == x) as u8;
                }
            }
        }
        out
    });
    Ok(PyByteArray::new_bound(py, &out))
}

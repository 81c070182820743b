//! CRT kernels of the HE elementwise product (`cipherlm.mpc.protocols.mul_he`).
//!
//! The product runs modulo P = t_0 ... t_{m-1} (BFV batching primes, each < 2^63)
//! and its result leaves Z_P for Z_{2^k} by scaling (Cheetah's encoding of Z_{2^k}
//! inside Z_P, SPU's `ModulusSwitchHelper`):
//!
//! * `crt_encode_scaled`: x in [0, 2^k) -> round(P x / 2^k) mod t_i for every prime;
//! * `crt_rescale_pow2`: residues c_i = c mod t_i of one c in Z_P -> round(c 2^k / P) mod 2^k.
//!
//! Python passes the big-integer constants split into 64-bit words (it owns P);
//! the kernels use u128 arithmetic only.  Every function releases the GIL.
//!
//! * `multiword_residues`: a multi-word integer mod every prime of a list (the noise
//!   flooding of the HE sessions, `cipherlm.mpc.he_session`).

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::util::{err, u64_bytes, u64s, view};

fn mulmod(a: u64, b: u64, m: u64) -> u64 {
    ((a as u128 * b as u128) % m as u128) as u64
}

fn check_primes(primes: &[u64]) -> PyResult<()> {
    if primes.is_empty() || primes.iter().any(|&t| t < 2 || t >> 63 != 0) {
        return err("primes must be non-empty and each in [2, 2^63)");
    }
    Ok(())
}

fn u64_array<'a>(b: &'a PyBuffer<u8>, what: &str) -> PyResult<&'a [u8]> {
    let v = view(b)?;
    if v.len() % 8 != 0 {
        return err(format!("{what} has {} bytes, not a multiple of 8", v.len()));
    }
    Ok(v)
}

/// round(P x / 2^k) mod t_i, as m rows of n little-endian u64 (row i for prime i).
///
/// With P = A 2^k + B (B < 2^k): round(P x / 2^k) = A x + floor((B x + 2^(k-1)) / 2^k);
/// the caller passes `a_mod[i]` = A mod t_i and `b_low` = B.
#[pyfunction]
pub fn crt_encode_scaled<'py>(
    py: Python<'py>,
    x: PyBuffer<u8>,
    primes: Vec<u64>,
    a_mod: Vec<u64>,
    b_low: u64,
    k: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    check_primes(&primes)?;
    if a_mod.len() != primes.len() || a_mod.iter().zip(&primes).any(|(a, t)| a >= t) {
        return err("a_mod must hold A mod t_i (< t_i) for every prime");
    }
    if k == 0 || k > 64 || (k < 64 && b_low >> k != 0) {
        return err("k must be in 1..64 and B < 2^k");
    }
    let xs = u64s(u64_array(&x, "x")?);
    if k < 64 && xs.iter().any(|&v| v >> k != 0) {
        return err(format!("inputs must be below 2^{k}"));
    }
    let out = py.allow_threads(|| {
        let half: u128 = 1u128 << (k - 1);
        let mut out = Vec::with_capacity(xs.len() * primes.len());
        for (&t, &a) in primes.iter().zip(&a_mod) {
            for &v in &xs {
                let low = ((b_low as u128 * v as u128 + half) >> k) as u64; // < 2^64: B x < 2^(k+64)
                let hi = mulmod(a, v % t, t);
                out.push(((hi as u128 + (low % t) as u128) % t as u128) as u64);
            }
        }
        u64_bytes(&out)
    });
    Ok(PyByteArray::new_bound(py, &out))
}

/// round(c 2^k / P) mod 2^k for c given by its residues (m rows of n u64, row i mod t_i).
///
/// With a_i = c_i (P / t_i)^(-1) mod t_i, c / P = sum_i a_i / t_i - v for an integer v, so
/// c 2^k / P = sum_i a_i 2^k / t_i (mod 2^k); each term is split into its integer part
/// a_i Q_i + floor(a_i R_i / t_i) (Q_i = floor(2^k / t_i), R_i = 2^k mod t_i) and a
/// 64-bit fraction floor(2^64 (a_i R_i mod t_i) / t_i).  The caller passes `inv`, `q`, `r`.
#[pyfunction]
pub fn crt_rescale_pow2<'py>(
    py: Python<'py>,
    residues: PyBuffer<u8>,
    primes: Vec<u64>,
    inv: Vec<u64>,
    q: Vec<u64>,
    r: Vec<u64>,
    k: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    check_primes(&primes)?;
    let m = primes.len();
    if inv.len() != m || q.len() != m || r.len() != m || (0..m).any(|i| inv[i] >= primes[i] || r[i] >= primes[i]) {
        return err("inv, q, r must have one entry per prime (inv, r < t_i)");
    }
    if k == 0 || k > 64 {
        return err("k must be in 1..64");
    }
    let res = u64s(u64_array(&residues, "residues")?);
    if res.len() % m != 0 {
        return err(format!("{} residues for {m} primes", res.len()));
    }
    let n = res.len() / m;
    for i in 0..m {
        if res[i * n..(i + 1) * n].iter().any(|&c| c >= primes[i]) {
            return err("residues must be reduced mod their prime");
        }
    }
    let out = py.allow_threads(|| {
        let mask: u64 = if k == 64 { u64::MAX } else { (1u64 << k) - 1 };
        let mut int_part = vec![0u64; n];
        let mut frac = vec![0u128; n];
        for i in 0..m {
            let t = primes[i];
            for j in 0..n {
                let a = mulmod(res[i * n + j], inv[i], t);
                let u = a as u128 * r[i] as u128; // < 2^126
                int_part[j] = int_part[j].wrapping_add(a.wrapping_mul(q[i])).wrapping_add((u / t as u128) as u64);
                frac[j] += ((u % t as u128) << 64) / t as u128;
            }
        }
        let half: u128 = 1u128 << 63;
        let v: Vec<u64> = (0..n)
            .map(|j| int_part[j].wrapping_add(((frac[j] + half) >> 64) as u64) & mask)
            .collect();
        u64_bytes(&v)
    });
    Ok(PyByteArray::new_bound(py, &out))
}

/// Residues of multi-word integers: `words` holds n integers of `w` little-endian u64
/// words each (word 0 least significant); row j of the result is
/// (u mod q_j - offset_j) mod q_j.  The noise flooding of `he_session` draws u uniform
/// below 2 B_f and passes offset_j = B_f mod q_j, so each row is u - B_f mod q_j.
#[pyfunction]
pub fn multiword_residues<'py>(
    py: Python<'py>,
    words: PyBuffer<u8>,
    w: usize,
    moduli: Vec<u64>,
    offset: Vec<u64>,
) -> PyResult<Bound<'py, PyByteArray>> {
    check_primes(&moduli)?;
    if offset.len() != moduli.len() || offset.iter().zip(&moduli).any(|(o, q)| o >= q) {
        return err("offset must hold one value below q_j per modulus");
    }
    let ws = u64s(u64_array(&words, "words")?);
    if w == 0 || ws.len() % w != 0 {
        return err(format!("{} words is not a multiple of w = {w}", ws.len()));
    }
    let n = ws.len() / w;
    let out = py.allow_threads(|| {
        let mut out = Vec::with_capacity(n * moduli.len());
        for (&q, &o) in moduli.iter().zip(&offset) {
            let q128 = q as u128;
            for u in ws.chunks_exact(w) {
                let mut r: u128 = 0;
                for &word in u.iter().rev() {
                    // r < q < 2^63: r 2^64 + word < 2^127
                    r = ((r << 64) + word as u128) % q128;
                }
                out.push(((r + q128 - o as u128) % q128) as u64);
            }
        }
        u64_bytes(&out)
    });
    Ok(PyByteArray::new_bound(py, &out))
}

//! Batched ciphertext x plaintext products in NTT form (the evaluator side of the 2pc
//! linear layers' cross term, `cipherlm.protocols.linear.cross_matmul`; Cheetah, Huang et
//! al. 2022, section 3.1: each output block is a sum of input-block x weight-block products).
//!
//! In NTT form a ct x pt product is a coefficient-wise ("dyadic") product modulo each prime,
//! the same for both ciphertext components; a sum of products is a sum of those.  SEAL does
//! one `multiply_plain` and one `add_inplace` per block pair, one Python call each; this does
//! a whole layer in one call, on every core, with one modular reduction per output
//! coefficient instead of one per product:
//!
//! * products of residues below q < 2^61 are accumulated unreduced in u128 (at most
//!   `lazy_terms(q)` of them fit), then reduced by a Barrett reduction with
//!   floor(2^128 / q) (`Barrett128`);
//! * work is split into (output, prime) jobs over `std::thread::available_parallelism()`
//!   threads, with the GIL released.
//!
//! The result is the same residues as SEAL's `multiply_plain` + `add_inplace` (tested
//! against numpy's exact arithmetic and against SEAL in tests/test_linear_2pc.py).

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::ntt::{residues_reduced, Barrett128};
use crate::pool::parallel;
use crate::util::{bytes_of, err, u64_slice};

/// How many products of residues below q fit in a u128 accumulator that already holds a
/// reduced value (< q): (2^128 - 1 - q) / (q - 1)^2.
fn lazy_terms(q: u64) -> usize {
    let sq = (q as u128 - 1) * (q as u128 - 1);
    ((u128::MAX - q as u128) / sq).min(1 << 20) as usize
}

/// out[o] = sum over the pairs (i, w) of output o of x[i] * w[w], coefficient-wise mod each
/// prime, for every component of x.
///
/// * `x`: inputs, shape (n_in, comps, k, n) u64 (NTT-form ciphertexts; comps = 2);
/// * `w`: weights, shape (n_w, k, n) u64 (NTT-form plaintexts at the same primes);
/// * `offsets` (n_out + 1), `x_idx`, `w_idx`: output o sums the pairs
///   (x_idx[p], w_idx[p]) for p in offsets[o]..offsets[o+1] (CSR); an output with no pair
///   is all zero;
/// * `moduli`: the k primes, each below 2^61; every residue must be below its prime (checked
///   for `x`; `w` must come reduced).
///
/// Returns (n_out, comps, k, n) u64 as bytes.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn ntt_mul_sum<'py>(
    py: Python<'py>,
    x: PyBuffer<u8>,
    w: PyBuffer<u8>,
    offsets: Vec<usize>,
    x_idx: Vec<usize>,
    w_idx: Vec<usize>,
    moduli: Vec<u64>,
    comps: usize,
    n: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let k = moduli.len();
    if k == 0 || moduli.iter().any(|&q| q < 3 || q % 2 == 0 || q >> 61 != 0) {
        return err("moduli must be odd primes below 2^61");
    }
    if n == 0 || comps == 0 {
        return err("n and comps must be positive");
    }
    let xs = u64_slice(&x, "x")?;
    let ws = u64_slice(&w, "w")?;
    let (x_len, w_len) = (comps * k * n, k * n);
    if xs.len() % x_len != 0 || ws.len() % w_len != 0 {
        return err(format!("x must hold (.., {comps}, {k}, {n}) and w (.., {k}, {n}) u64"));
    }
    let (n_in, n_w) = (xs.len() / x_len, ws.len() / w_len);
    if offsets.is_empty() || offsets[0] != 0 || offsets.windows(2).any(|p| p[0] > p[1])
        || *offsets.last().unwrap() != x_idx.len() || x_idx.len() != w_idx.len()
    {
        return err("offsets must rise from 0 to the number of pairs; x_idx and w_idx one entry per pair");
    }
    if x_idx.iter().any(|&i| i >= n_in) || w_idx.iter().any(|&i| i >= n_w) {
        return err(format!("a pair index is out of range ({n_in} inputs, {n_w} weights)"));
    }
    // the inputs come from the peer (checked); the weights are the caller's own encodings
    // (not rescanned on every call: a residue >= q there gives a wrong sum, never unsafety)
    if !residues_reduced(xs, n, &moduli) {
        return err("every input residue must be below its prime");
    }
    let n_out = offsets.len() - 1;
    let mut out = vec![0u64; n_out * x_len];
    // each job (o, j) writes out[o][c][j][..] for every c: disjoint ranges
    let out_ptr = out.as_mut_ptr() as usize;
    py.allow_threads(|| {
        parallel(n_out * k, |job, _| {
            let (o, j) = (job / k, job % k);
            let pairs = offsets[o]..offsets[o + 1];
            let dst: Vec<&mut [u64]> = (0..comps)
                .map(|c| {
                    let at = ((o * comps + c) * k + j) * n;
                    // SAFETY: (o, c, j) ranges are disjoint between jobs and inside `out`.
                    unsafe { std::slice::from_raw_parts_mut((out_ptr as *mut u64).add(at), n) }
                })
                .collect();
            sum_products(xs, ws, &x_idx[pairs.clone()], &w_idx[pairs], j, k, n, comps, moduli[j], dst);
        });
    });
    Ok(PyByteArray::new_bound(py, bytes_of(&out)))
}

/// One (output, prime) job: dst[c][..] = sum_p x[xi[p]][c][j] * w[wi[p]][j] mod q.
#[allow(clippy::too_many_arguments)]
fn sum_products(xs: &[u64], ws: &[u64], xi: &[usize], wi: &[usize], j: usize, k: usize, n: usize,
                comps: usize, q: u64, mut dst: Vec<&mut [u64]>) {
    const CHUNK: usize = 256; // coefficients per pass: the accumulators stay in L1
    let red = Barrett128::new(q);
    let lazy = lazy_terms(q).max(1);
    let mut acc = vec![0u128; comps * CHUNK];
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        acc.iter_mut().for_each(|a| *a = 0);
        for (p, (&i, &wj)) in xi.iter().zip(wi).enumerate() {
            if p > 0 && p % lazy == 0 {
                acc.iter_mut().for_each(|a| *a = red.reduce(*a) as u128);
            }
            let wrow = &ws[(wj * k + j) * n + start..][..len];
            for c in 0..comps {
                let xrow = &xs[((i * comps + c) * k + j) * n + start..][..len];
                let a = &mut acc[c * CHUNK..c * CHUNK + len];
                for ((a, &xv), &wv) in a.iter_mut().zip(xrow).zip(wrow) {
                    *a += xv as u128 * wv as u128;
                }
            }
        }
        for (c, d) in dst.iter_mut().enumerate() {
            for (o, a) in d[start..start + len].iter_mut().zip(&acc[c * CHUNK..c * CHUNK + len]) {
                *o = red.reduce(*a);
            }
        }
        start += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn barrett_matches_u128_remainder() {
        let qs = [1152921504606830593u64, 1152921504606748673, 274877906939, 65537, 3, (1u64 << 61) - 1];
        let mut s: u128 = 0x9e3779b97f4a7c15f39cc0605cedc834;
        for &q in &qs {
            let red = Barrett128::new(q);
            for x in [0u128, 1, q as u128 - 1, q as u128, u128::MAX, u128::MAX - 1, (q as u128) * (q as u128)] {
                assert_eq!(red.reduce(x) as u128, x % q as u128, "q={q} x={x}");
            }
            for _ in 0..100_000 {
                s = s.wrapping_mul(0x2360ed051fc65da44385df649fccf645).wrapping_add(0x5851f42d4c957f2d14057b7ef767814f);
                let x = s ^ (s >> 67);
                assert_eq!(red.reduce(x) as u128, x % q as u128);
            }
        }
    }

    #[test]
    fn lazy_terms_never_overflow() {
        for q in [1152921504606830593u64, (1u64 << 61) - 1, 274877906939] {
            let t = lazy_terms(q) as u128;
            let worst = (q as u128 - 1) + t * (q as u128 - 1) * (q as u128 - 1);
            assert!(worst >= q as u128 && t >= 1); // no panic: fits in u128
        }
    }
}

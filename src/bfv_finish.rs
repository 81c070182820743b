//! The evaluator's side of the 2pc cross term after the block products, natively (the same
//! steps as `cipherlm.mpc.he_session.HESession.finish`, which runs them through SEAL one call
//! at a time; Cheetah, Huang et al. 2022, sections 3.1 and 4):
//!
//! 1. re-randomise: add a public-key encryption of zero under the peer's key,
//!    (u pk_0 + e_0, u pk_1 + e_1) with u uniform ternary and e_i centred binomial (21 + 21
//!    coins, SEAL's default noise), computed at the top data level in NTT form;
//! 2. back to coefficient form (`ntt::NttTables::inverse`);
//! 3. add the mask at the sent positions of c_0, encoded as SEAL's BFV `add_plain` does:
//!    round(q r / t) = Delta r + floor(((q mod t) r + floor((t + 1) / 2)) / t), Delta = floor(q / t);
//! 4. add the flooding noise the caller drew (residues) at those positions;
//! 5. switch down to the result primes (divide and round by each dropped prime, SEAL's
//!    `divide_and_round_q_last`), c_1 in full and c_0 at the positions only.
//!
//! The noise this encryption of zero adds, -u e_pk + e_0 + e_1 s, is at most 2 N 21 + 21, within
//! the `2 N FRESH_NOISE_MAX` the flooding bound already counts for the re-randomisation.
//! u, e_0 and e_1 come from ChaCha20 seeded by the OS (one generator per thread and call).
//! `bfv_encode_blocks` encodes the plaintext operand's blocks straight from the matrix (Cheetah's
//! layout, centred lift, NTT), so that no weight block goes through SEAL either.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use rand_chacha::ChaCha20Rng;
use rand_core::RngCore;

use crate::pool::parallel;
use crate::ntt::{add_mod, cached_tables, powmod, residues_reduced, sub_mod, Barrett128, NttTables, ScaleUp, Shoup};
use std::sync::Arc;
use crate::util::{bytes_of, err, u64_slice};

pub(crate) fn tables(moduli: &[u64], n: usize) -> PyResult<Vec<Arc<NttTables>>> {
    moduli.iter().map(|&q| cached_tables(q, n).or_else(err)).collect()
}

/// Cheetah's weight blocks (`cipherlm.protocols.linear._pack_rhs`) encoded straight from the
/// matrix: `b` (batch, d, o) int64, blocks of dw x ow, db x ob of them per batch entry; block
/// (e, di, oi) is the polynomial sum_{j, i} B[e, di dw + j, oi ow + i] X^(i dw + dw - 1 - j)
/// (zero outside the matrix), centred-lifted and in NTT form.  Returns (a byte per block: 1 if
/// it has a non-zero coefficient, the encodings (blocks with a 1, k, n) u64 in block order).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn bfv_encode_blocks<'py>(
    py: Python<'py>,
    b: PyBuffer<u8>,
    shape: (usize, usize, usize),
    block: (usize, usize),
    moduli: Vec<u64>,
    n: usize,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let tabs = tables(&moduli, n)?;
    let (batch, d, o) = shape;
    let (dw, ow) = block;
    let vals = u64_slice(&b, "b")?;
    if vals.len() != batch * d * o || dw == 0 || ow == 0 || dw * ow > n {
        return err("bfv_encode_blocks: b must hold batch x d x o int64 and dw ow <= n");
    }
    let (db, ob) = ((d + dw - 1) / dw, (o + ow - 1) / ow);
    let blocks = batch * db * ob;
    let coeff = |e: usize, di: usize, oi: usize, dst: &mut [i64]| {
        for j in 0..dw.min(d.saturating_sub(di * dw)) {
            let row = &vals[(e * d + di * dw + j) * o..(e * d + di * dw + j + 1) * o];
            for i in 0..ow.min(o.saturating_sub(oi * ow)) {
                dst[i * dw + dw - 1 - j] = row[oi * ow + i] as i64;
            }
        }
    };
    let nonzero: Vec<u8> = (0..blocks)
        .map(|blk| {
            let (e, di, oi) = (blk / (db * ob), blk / ob % db, blk % ob);
            let any = (0..dw.min(d.saturating_sub(di * dw))).any(|j| {
                let row = &vals[(e * d + di * dw + j) * o..(e * d + di * dw + j + 1) * o];
                row[oi * ow..(oi * ow + ow).min(o)].iter().any(|&v| v != 0)
            });
            any as u8
        })
        .collect();
    let rows: Vec<usize> = (0..blocks).filter(|&blk| nonzero[blk] == 1).collect();
    let k = moduli.len();
    let mut out = vec![0u64; rows.len() * k * n];
    let base = out.as_mut_ptr() as usize;
    py.allow_threads(|| {
        parallel(rows.len(), |r, _| {
            let blk = rows[r];
            let (e, di, oi) = (blk / (db * ob), blk / ob % db, blk % ob);
            let mut poly = vec![0i64; n];
            coeff(e, di, oi, &mut poly);
            for j in 0..k {
                let q = moduli[j];
                // SAFETY: row r owns its own k n outputs.
                let dst = unsafe { std::slice::from_raw_parts_mut((base as *mut u64).add((r * k + j) * n), n) };
                for (x, &v) in dst.iter_mut().zip(&poly) {
                    *x = if v.unsigned_abs() < q { lift_small(v, q) } else { lift_any(v, q) };
                }
                tabs[j].forward(dst);
            }
        });
    });
    Ok((PyByteArray::new_bound(py, &nonzero), PyByteArray::new_bound(py, bytes_of(&out))))
}

/// Rows of (k, n) residues (each < q_j) -> NTT form (`inverse`: and back), for tests and tools.
#[pyfunction]
#[pyo3(signature = (data, moduli, n, inverse=false))]
pub fn ntt_rows<'py>(py: Python<'py>, data: PyBuffer<u8>, moduli: Vec<u64>, n: usize, inverse: bool) -> PyResult<Bound<'py, PyByteArray>> {
    let tabs = tables(&moduli, n)?;
    let k = moduli.len();
    let mut v = u64_slice(&data, "data")?.to_vec();
    if v.len() % (k * n) != 0 {
        return err(format!("data must hold rows of ({k}, {n}) u64"));
    }
    if !residues_reduced(&v, n, &moduli) {
        return err("every residue must be below its prime");
    }
    for (i, row) in v.chunks_exact_mut(n).enumerate() {
        let t = &tabs[i % k];
        if inverse {
            t.inverse(row)
        } else {
            t.forward(row)
        }
    }
    Ok(PyByteArray::new_bound(py, bytes_of(&v)))
}

fn ternary(rng: &mut ChaCha20Rng, out: &mut [i8]) {
    let mut buf = [0u8; 64];
    let mut i = 0;
    while i < out.len() {
        rng.fill_bytes(&mut buf);
        for &b in &buf {
            if b < 255 && i < out.len() {
                out[i] = (b % 3) as i8 - 1;
                i += 1;
            }
        }
    }
}

pub(crate) fn cbd21(rng: &mut ChaCha20Rng, out: &mut [i8]) {
    for e in out.iter_mut() {
        let w = rng.next_u64();
        *e = ((w & 0x1f_ffff).count_ones() as i32 - ((w >> 21) & 0x1f_ffff).count_ones() as i32) as i8;
    }
}

/// Any signed value mod q.
fn lift_any(v: i64, q: u64) -> u64 {
    if v >= 0 {
        v as u64 % q
    } else {
        (q - v.unsigned_abs() % q) % q
    }
}

/// A small signed value (|v| < q) mod q.
#[inline(always)]
pub(crate) fn lift_small(v: i64, q: u64) -> u64 {
    if v >= 0 {
        v as u64
    } else {
        q - v.unsigned_abs()
    }
}

/// Finish `n_out` cross-term results (module docstring).
///
/// * `sums`: (n_out, 2, k, n) NTT-form products; `pk`: (2, k, n) the peer's public key at the
///   k data primes, NTT form;
/// * `masks`: (n_out, P) values r < t; `positions`: the P sent coefficients of c_0;
/// * `flood`: (n_out, k, P) flooding residues (each < q_j); `delta`: floor(q / t) mod q_j,
///   `q_mod_t` = q mod t, `t` the plaintext modulus (the mask's encoding);
/// * `keep`: the primes left after the switch (1..=k).
///
/// Returns (c_1 as (n_out, keep, n), c_0 at the positions as (n_out, keep, P)), u64 bytes.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn bfv_finish<'py>(
    py: Python<'py>,
    sums: PyBuffer<u8>,
    pk: PyBuffer<u8>,
    masks: PyBuffer<u8>,
    positions: Vec<usize>,
    flood: PyBuffer<u8>,
    delta: Vec<u64>,
    q_mod_t: u64,
    t: u64,
    moduli: Vec<u64>,
    n: usize,
    keep: usize,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let k = moduli.len();
    let tabs = tables(&moduli, n)?;
    let (sums, pk, masks, flood) =
        (u64_slice(&sums, "sums")?, u64_slice(&pk, "pk")?, u64_slice(&masks, "masks")?, u64_slice(&flood, "flood")?);
    let p = positions.len();
    if keep == 0 || keep > k || delta.len() != k || pk.len() != 2 * k * n || sums.len() % (2 * k * n) != 0 {
        return err("bfv_finish: keep must be in 1..=k, delta one value per prime, pk (2, k, n), sums (.., 2, k, n)");
    }
    if t < 2 || q_mod_t >= t {
        return err("bfv_finish: t must be at least 2 and q_mod_t below it");
    }
    let n_out = sums.len() / (2 * k * n);
    if masks.len() != n_out * p || flood.len() != n_out * k * p || positions.iter().any(|&i| i >= n) {
        return err("bfv_finish: masks must be (n_out, P), flood (n_out, k, P), positions below n");
    }
    if masks.iter().any(|&r| r >= t) {
        return err("bfv_finish: every mask value must be below t");
    }
    if !residues_reduced(sums, n, &moduli) || !residues_reduced(pk, n, &moduli) || !residues_reduced(flood, p, &moduli) {
        return err("bfv_finish: every residue must be below its prime");
    }
    // divide-and-round constants for each dropped prime l: q_l^-1 mod q_j and floor(q_l / 2)
    let inv: Vec<Vec<Shoup>> = (0..k)
        .map(|l| (0..l).map(|j| Shoup::new(powmod(moduli[l] % moduli[j], moduli[j] - 2, moduli[j]), moduli[j])).collect())
        .collect();
    let red: Vec<Barrett128> = moduli.iter().map(|&q| Barrett128::new(q)).collect();
    let scale = ScaleUp::new(&moduli, delta, q_mod_t, t);
    let mut c1_out = vec![0u64; n_out * keep * n];
    let mut c0_out = vec![0u64; n_out * keep * p];
    let (c1_base, c0_base) = (c1_out.as_mut_ptr() as usize, c0_out.as_mut_ptr() as usize);
    py.allow_threads(|| {
        parallel(n_out, |o, rng| {
            let mut u = vec![0i8; n];
            let mut e = vec![0i8; 2 * n];
            ternary(rng, &mut u);
            cbd21(rng, &mut e);
            // c[comp][j][..] in coefficient form after re-randomisation
            let mut c = vec![0u64; 2 * k * n];
            let mut u_ntt = vec![0u64; n];
            for j in 0..k {
                let q = moduli[j];
                for (d, &s) in u_ntt.iter_mut().zip(&u) {
                    *d = lift_small(s as i64, q);
                }
                tabs[j].forward(&mut u_ntt);
                for comp in 0..2 {
                    let row = ((o * 2 + comp) * k + j) * n;
                    let prow = (comp * k + j) * n;
                    let dst = &mut c[(comp * k + j) * n..(comp * k + j + 1) * n];
                    for i in 0..n {
                        dst[i] = add_mod(red[j].mul(u_ntt[i], pk[prow + i]), sums[row + i], q);
                    }
                    tabs[j].inverse(dst);
                    for (d, &ei) in dst.iter_mut().zip(&e[comp * n..(comp + 1) * n]) {
                        *d = add_mod(*d, lift_small(ei as i64, q), q);
                    }
                }
            }
            // c_0 at the positions: + round(q r / t) + flooding
            let fix: Vec<u64> = masks[o * p..(o + 1) * p].iter().map(|&r| scale.fix(r)).collect();
            let mut c0 = vec![0u64; k * p];
            for j in 0..k {
                let q = moduli[j];
                for (a, &pos) in positions.iter().enumerate() {
                    let masked = add_mod(c[j * n + pos], scale.at(masks[o * p + a], fix[a], j, q), q);
                    c0[j * p + a] = add_mod(masked, flood[(o * k + j) * p + a], q);
                }
            }
            let mut c1: Vec<u64> = c[k * n..].to_vec();
            // switch down: drop primes k-1, ..., keep (divide and round by each)
            for l in (keep..k).rev() {
                divide_round_last(&mut c1, n, l, &moduli, &inv[l]);
                divide_round_last(&mut c0, p, l, &moduli, &inv[l]);
            }
            // SAFETY: output o owns its own ranges of both buffers.
            let d1 = unsafe { std::slice::from_raw_parts_mut((c1_base as *mut u64).add(o * keep * n), keep * n) };
            d1.copy_from_slice(&c1[..keep * n]);
            let d0 = unsafe { std::slice::from_raw_parts_mut((c0_base as *mut u64).add(o * keep * p), keep * p) };
            for j in 0..keep {
                d0[j * p..(j + 1) * p].copy_from_slice(&c0[j * p..(j + 1) * p]);
            }
        });
    });
    Ok((PyByteArray::new_bound(py, bytes_of(&c1_out)), PyByteArray::new_bound(py, bytes_of(&c0_out))))
}

/// rows 0..l of `v` (rows of `len`, row j mod q_j) <- round(v / q_l), given row l (SEAL's
/// divide_and_round_q_last: (v_j - ((v_l + h) mod q_j - h mod q_j)) q_l^-1 mod q_j, h = floor(q_l / 2)).
fn divide_round_last(v: &mut [u64], len: usize, l: usize, moduli: &[u64], inv: &[Shoup]) {
    let ql = moduli[l];
    let half = ql >> 1;
    let last: Vec<u64> = v[l * len..(l + 1) * len].iter().map(|&x| add_mod(x, half, ql)).collect();
    for j in 0..l {
        let q = moduli[j];
        let half_j = half % q;
        let ql_fits = ql < 2 * q; // then (v_l + h) mod q_j is one conditional subtraction
        for (x, &lv) in v[j * len..(j + 1) * len].iter_mut().zip(&last) {
            let lv_j = if ql_fits { if lv >= q { lv - q } else { lv } } else { lv % q };
            let corr = sub_mod(lv_j, half_j, q);
            *x = inv[j].mul(sub_mod(*x, corr, q), q);
        }
    }
}

//! The encryptor's side of the 2pc cross term, natively (`cipherlm.mpc.he_session.HESession`,
//! `encrypt_native` / `decrypt_native`; Cheetah, Huang et al. 2022, section 3.1):
//!
//! * `bfv_encrypt_symmetric`: seeded secret-key BFV encryptions in NTT form.  For each
//!   plaintext m (values mod t): a fresh 32-byte seed, a = PRG(seed) read directly as the NTT
//!   form of the uniform c_1 (a uniform polynomial's NTT is uniform), e centred binomial
//!   (21 + 21 coins, SEAL's noise), and c_0 = NTT(e + round(q m / t)) - a s.  Only c_0
//!   (bit-packed, `ceil(log2 q_j)` bits per residue) and the seed are sent: the same size as
//!   SEAL's seeded ciphertexts less the padding of 60-bit residues in 64-bit words.
//! * `bfv_expand_seeded`: the evaluator's side of that format: unpack and check c_0, expand
//!   c_1 from the seed, giving NTT-form ciphertexts (n, 2, k, N) for `dyadic::ntt_mul_sum`
//!   without a transform.
//! * `bfv_decrypt_positions`: c_0 + c_1 s at the sent positions of results that arrive with
//!   c_1 in full and c_0 at those positions only (Cheetah section 4), in coefficient form at
//!   the result primes; the caller scales by t / q and rounds (`crt_rescale_pow2`).
//!
//! The PRG is ChaCha20 keyed by the seed, stream j for prime j, residues by rejection
//! sampling (uniform mod q_j); seeds and noise come from ChaCha20 seeded by the OS.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use rand_chacha::ChaCha20Rng;
use rand_core::{RngCore, SeedableRng};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::bfv_finish::{cbd21, lift_small, tables};
use crate::pool::parallel;
use crate::ntt::{add_mod, residues_reduced, sub_mod, Barrett128, ScaleUp};
use crate::util::{bytes_of, err, pack, packed_len, u64_slice, unpack, view};

const SEED: usize = 32;

fn bits_of(q: u64) -> u32 {
    64 - q.leading_zeros()
}

/// Bytes of one packed c_0 (every prime's residues at its own width).
fn packed_c0_len(moduli: &[u64], n: usize) -> usize {
    moduli.iter().map(|&q| packed_len(n, bits_of(q))).sum()
}

/// a mod q_j from the seed: ChaCha20(seed), stream j, rejection sampling.
fn expand_uniform(seed: &[u8], j: usize, q: u64, out: &mut [u64]) {
    let mut rng = ChaCha20Rng::from_seed(seed.try_into().expect("32-byte seed"));
    rng.set_stream(j as u64);
    let mask = if bits_of(q) == 64 { u64::MAX } else { (1u64 << bits_of(q)) - 1 };
    for x in out.iter_mut() {
        loop {
            let v = rng.next_u64() & mask;
            if v < q {
                *x = v;
                break;
            }
        }
    }
}

/// Seeded symmetric encryptions of `plain` ((m, n) u64 values < t) under `sk` ((k, n) NTT-form
/// secret key at the data primes).  `delta[j]` = floor(q / t) mod q_j, `q_mod_t` = q mod t.
/// Returns (packed c_0 of every ciphertext, seeds), each m x its own length.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn bfv_encrypt_symmetric<'py>(
    py: Python<'py>,
    plain: PyBuffer<u8>,
    sk: PyBuffer<u8>,
    delta: Vec<u64>,
    q_mod_t: u64,
    t: u64,
    moduli: Vec<u64>,
    n: usize,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let k = moduli.len();
    let tabs = tables(&moduli, n)?;
    let (plain, sk) = (u64_slice(&plain, "plain")?, u64_slice(&sk, "sk")?);
    if sk.len() != k * n || plain.len() % n != 0 || delta.len() != k || t < 2 || q_mod_t >= t {
        return err("bfv_encrypt_symmetric: sk must be (k, n), plain (m, n), delta one value per prime, q_mod_t < t");
    }
    if plain.iter().any(|&v| v >= t) {
        return err("bfv_encrypt_symmetric: every plaintext value must be below t");
    }
    let m = plain.len() / n;
    let red: Vec<Barrett128> = moduli.iter().map(|&q| Barrett128::new(q)).collect();
    let scale = ScaleUp::new(&moduli, delta, q_mod_t, t);
    let ct_len = packed_c0_len(&moduli, n);
    let mut c0_out = vec![0u8; m * ct_len];
    let mut seeds = vec![0u8; m * SEED];
    let (c0_base, seed_base) = (c0_out.as_mut_ptr() as usize, seeds.as_mut_ptr() as usize);
    py.allow_threads(|| {
        parallel(m, |i, rng| {
            // SAFETY: ciphertext i owns its own ranges of both buffers.
            let seed = unsafe { std::slice::from_raw_parts_mut((seed_base as *mut u8).add(i * SEED), SEED) };
            rng.fill_bytes(seed);
            let mut e = vec![0i8; n];
            cbd21(rng, &mut e);
            let pm = &plain[i * n..(i + 1) * n];
            let fix: Vec<u64> = pm.iter().map(|&v| scale.fix(v)).collect();
            let out = unsafe { std::slice::from_raw_parts_mut((c0_base as *mut u8).add(i * ct_len), ct_len) };
            let mut at = 0;
            let mut row = vec![0u64; n];
            let mut a = vec![0u64; n];
            for j in 0..k {
                let q = moduli[j];
                for x in 0..n {
                    row[x] = add_mod(lift_small(e[x] as i64, q), scale.at(pm[x], fix[x], j, q), q);
                }
                tabs[j].forward(&mut row);
                expand_uniform(seed, j, q, &mut a);
                let s = &sk[j * n..(j + 1) * n];
                for x in 0..n {
                    row[x] = sub_mod(row[x], red[j].mul(a[x], s[x]), q);
                }
                let bytes = pack(&row, bits_of(q));
                out[at..at + bytes.len()].copy_from_slice(&bytes);
                at += bytes.len();
            }
        });
    });
    Ok((PyByteArray::new_bound(py, &c0_out), PyByteArray::new_bound(py, &seeds)))
}

/// The evaluator's view of `bfv_encrypt_symmetric`'s output: (m, 2, k, n) u64 NTT-form
/// ciphertexts (c_0 unpacked and checked below its primes, c_1 expanded from the seed).
#[pyfunction]
pub fn bfv_expand_seeded<'py>(py: Python<'py>, c0: PyBuffer<u8>, seeds: PyBuffer<u8>, moduli: Vec<u64>, n: usize) -> PyResult<Bound<'py, PyByteArray>> {
    let k = moduli.len();
    if k == 0 || moduli.iter().any(|&q| q < 2) || n == 0 {
        return err("bfv_expand_seeded: moduli must be non-empty and n positive");
    }
    let (c0, seeds) = (view(&c0)?, view(&seeds)?);
    let ct_len = packed_c0_len(&moduli, n);
    if seeds.len() % SEED != 0 || c0.len() != seeds.len() / SEED * ct_len {
        return err(format!("bfv_expand_seeded: expected {ct_len} bytes of c0 per {SEED}-byte seed"));
    }
    let m = seeds.len() / SEED;
    let mut out = vec![0u64; m * 2 * k * n];
    let bad = AtomicUsize::new(0);
    let base = out.as_mut_ptr() as usize;
    py.allow_threads(|| {
        parallel(m, |i, _| {
            // SAFETY: ciphertext i owns its own output range.
            let dst = unsafe { std::slice::from_raw_parts_mut((base as *mut u64).add(i * 2 * k * n), 2 * k * n) };
            let src = &c0[i * ct_len..(i + 1) * ct_len];
            let mut at = 0;
            for j in 0..k {
                let q = moduli[j];
                let len = packed_len(n, bits_of(q));
                let vals = unpack(&src[at..at + len], n, bits_of(q));
                at += len;
                if vals.iter().any(|&v| v >= q) {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
                dst[j * n..(j + 1) * n].copy_from_slice(&vals);
                expand_uniform(&seeds[i * SEED..(i + 1) * SEED], j, q, &mut dst[(k + j) * n..(k + j + 1) * n]);
            }
        });
    });
    if bad.load(Ordering::Relaxed) != 0 {
        return err("bfv_expand_seeded: a c0 residue is not below its prime");
    }
    Ok(PyByteArray::new_bound(py, bytes_of(&out)))
}

/// c_0 + c_1 s at `positions` for results at the primes `moduli` (the first of the key's):
/// `c1` (r, k, n) coefficient form, `c0` (r, k, P) the values at the positions, `sk` (>= k, n)
/// NTT form (its first k rows are used).  Returns (r, k, P) u64 residues.
#[pyfunction]
pub fn bfv_decrypt_positions<'py>(
    py: Python<'py>,
    c1: PyBuffer<u8>,
    c0: PyBuffer<u8>,
    sk: PyBuffer<u8>,
    positions: Vec<usize>,
    moduli: Vec<u64>,
    n: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let k = moduli.len();
    let tabs = tables(&moduli, n)?;
    let (c1, c0, sk) = (u64_slice(&c1, "c1")?, u64_slice(&c0, "c0")?, u64_slice(&sk, "sk")?);
    let p = positions.len();
    if c1.len() % (k * n) != 0 || sk.len() < k * n || positions.iter().any(|&x| x >= n) {
        return err("bfv_decrypt_positions: c1 must be (r, k, n), sk (>= k, n), positions below n");
    }
    let r = c1.len() / (k * n);
    if c0.len() != r * k * p {
        return err("bfv_decrypt_positions: c0 must be (r, k, P)");
    }
    if !residues_reduced(c1, n, &moduli) || !residues_reduced(c0, p, &moduli) {
        return err("bfv_decrypt_positions: a residue is not below its prime");
    }
    let red: Vec<Barrett128> = moduli.iter().map(|&q| Barrett128::new(q)).collect();
    let mut out = vec![0u64; r * k * p];
    let base = out.as_mut_ptr() as usize;
    py.allow_threads(|| {
        parallel(r * k, |job, _| {
            let (o, j) = (job / k, job % k);
            let q = moduli[j];
            let mut row = c1[(o * k + j) * n..(o * k + j + 1) * n].to_vec();
            tabs[j].forward(&mut row);
            let s = &sk[j * n..(j + 1) * n];
            for x in 0..n {
                row[x] = red[j].mul(row[x], s[x]);
            }
            tabs[j].inverse(&mut row);
            // SAFETY: job (o, j) owns its own output row.
            let dst = unsafe { std::slice::from_raw_parts_mut((base as *mut u64).add((o * k + j) * p), p) };
            for (a, &pos) in positions.iter().enumerate() {
                dst[a] = add_mod(c0[(o * k + j) * p + a], row[pos], q);
            }
        });
    });
    Ok(PyByteArray::new_bound(py, bytes_of(&out)))
}

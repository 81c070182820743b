//! OT extension: IKNP03 (1-out-of-2, k = 128) and KK13 (1-out-of-N, k = 256,
//! Walsh-Hadamard code), with the ALSZ13 optimisations.
//!
//! Roles (IKNP03 section 3, "Protocol 1"): the *extension receiver* R holds
//! choices and plays base-OT **sender** with k pairs of seeds (k0^i, k1^i);
//! the *extension sender* S holds a secret Delta in {0,1}^k and plays base-OT
//! **receiver**, learning k_{Delta_i}^i.
//!
//! One extension of m OTs (m padded to a multiple of 16):
//!   R: T^i = G(k0^i), u^i = T^i xor G(k1^i) xor D^i, sends u (k x m bits).
//!      (ALSZ13 section 4.1: G(k1^i) replaces a random matrix, so only u
//!      travels; no seed is sent.)  t_j = row j of T.
//!   S: Q^i = G(k_{Delta_i}^i) xor Delta_i * u^i, q_j = row j of Q,
//!      so q_j = t_j xor (d_j AND Delta).
//! For IKNP (k = 128) d_j = c_j * 1^128 (repetition code): q_j = t_j xor c_j*Delta,
//! which *is* a correlated OT with global Delta (the raw COT).  For KK13
//! (Kolesnikov-Kumaresan, CRYPTO 2013, section 4) d_j = WH(c_j), the 256-bit
//! Walsh-Hadamard codeword of c_j in [0,256) (minimum distance 128, hence 128-bit
//! security), and S derives N keys H(j, q_j xor (WH(x) AND Delta)), x < N, of which
//! R knows exactly H(j, t_j) (the one for x = c_j).
//!
//! G is AES-128-CTR (`prg::AesPrg`); the PRG streams continue across calls, so
//! both parties must call `extend` with the same m in the same order.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::prg::AesPrg;
use crate::transpose::transpose;
use crate::util::{err, view};

pub fn pad16(m: usize) -> usize {
    (m + 15) / 16 * 16
}

/// Walsh-Hadamard codeword of c (8 bits): bit x = parity(c AND x), x in 0..256.
pub fn wh_codeword(c: u8) -> [u8; 32] {
    let mut w = [0u8; 32];
    for x in 0..256usize {
        if ((c as usize) & x).count_ones() & 1 == 1 {
            w[x / 8] |= 1 << (x % 8);
        }
    }
    w
}

fn seeds(keys: &[u8], k: usize) -> PyResult<Vec<AesPrg>> {
    if keys.len() != k * 16 {
        return err(format!("expected {} bytes of base-OT keys ({} keys), got {}", k * 16, k, keys.len()));
    }
    Ok(keys.chunks_exact(16).map(|c| AesPrg::new(c.try_into().unwrap())).collect())
}

fn check_k(k: usize) -> PyResult<()> {
    if k != 128 && k != 256 {
        return err(format!("k must be 128 (IKNP) or 256 (KK13), got {k}"));
    }
    Ok(())
}

/// Extension sender state (IKNP03 / KK13 sender S).
#[pyclass(module = "cipherlm._core")]
pub struct OtExtSender {
    k: usize,
    delta: Vec<u8>,
    prgs: Vec<AesPrg>,
}

#[pymethods]
impl OtExtSender {
    /// `delta`: k/8 bytes (S's secret, the base-OT choices); `keys`: the k
    /// base-OT keys k_{Delta_i}^i, 16 bytes each.
    #[new]
    fn new(delta: PyBuffer<u8>, keys: PyBuffer<u8>) -> PyResult<Self> {
        let delta = view(&delta)?.to_vec();
        let k = delta.len() * 8;
        check_k(k)?;
        let prgs = seeds(view(&keys)?, k)?;
        Ok(OtExtSender { k, delta, prgs })
    }

    #[getter]
    fn k(&self) -> usize {
        self.k
    }

    /// Delta as bytes (k/8 bytes).
    #[getter]
    fn delta<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        PyByteArray::new_bound(py, &self.delta)
    }

    /// Consume R's matrix u (k rows of pad16(m) bits) -> q (m rows of k/8 bytes).
    fn extend<'py>(&mut self, py: Python<'py>, u: PyBuffer<u8>, m: usize) -> PyResult<Bound<'py, PyByteArray>> {
        let u = view(&u)?;
        let mp = pad16(m);
        let rb = mp / 8;
        if u.len() != self.k * rb {
            return err(format!(
                "OT extension matrix has {} bytes, expected {} for {} OTs (k = {})",
                u.len(),
                self.k * rb,
                m,
                self.k
            ));
        }
        let q = py.allow_threads(|| {
            let mut cols = vec![0u8; self.k * rb];
            for i in 0..self.k {
                let col = &mut cols[i * rb..(i + 1) * rb];
                self.prgs[i].fill(col);
                if (self.delta[i / 8] >> (i % 8)) & 1 == 1 {
                    for (c, x) in col.iter_mut().zip(&u[i * rb..(i + 1) * rb]) {
                        *c ^= *x;
                    }
                }
            }
            let mut q = transpose(&cols, self.k, mp);
            q.truncate(m * self.k / 8);
            q
        });
        Ok(PyByteArray::new_bound(py, &q))
    }
}

/// Extension receiver state (IKNP03 / KK13 receiver R).
#[pyclass(module = "cipherlm._core")]
pub struct OtExtReceiver {
    k: usize,
    prg0: Vec<AesPrg>,
    prg1: Vec<AesPrg>,
}

#[pymethods]
impl OtExtReceiver {
    /// `keys0`, `keys1`: the k base-OT seed pairs (16 bytes each) R sent as base-OT sender.
    #[new]
    fn new(keys0: PyBuffer<u8>, keys1: PyBuffer<u8>) -> PyResult<Self> {
        let k0 = view(&keys0)?;
        let k = k0.len() / 16;
        check_k(k)?;
        Ok(OtExtReceiver { k, prg0: seeds(k0, k)?, prg1: seeds(view(&keys1)?, k)? })
    }

    #[getter]
    fn k(&self) -> usize {
        self.k
    }

    /// Choices (one byte per OT: 0/1 for k = 128, any byte for k = 256) ->
    /// (u: k x pad16(m) bits to send, t: m rows of k/8 bytes to keep).
    fn extend<'py>(
        &mut self,
        py: Python<'py>,
        choices: PyBuffer<u8>,
    ) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
        let ch = view(&choices)?;
        let m = ch.len();
        if self.k == 128 && ch.iter().any(|&c| c > 1) {
            return err("1-out-of-2 choices must be 0 or 1");
        }
        let mp = pad16(m);
        let rb = mp / 8;
        let k = self.k;
        let (u, t) = py.allow_threads(|| {
            // D^i: the columns of the code matrix.
            let dcols: Vec<u8> = if k == 128 {
                let mut r = vec![0u8; rb];
                for (j, &c) in ch.iter().enumerate() {
                    r[j / 8] |= c << (j % 8);
                }
                r // every column equals the packed choice vector
            } else {
                let mut rows = vec![0u8; mp * 32];
                let mut table = vec![[0u8; 32]; 256];
                for c in 0..256 {
                    table[c] = wh_codeword(c as u8);
                }
                for (j, &c) in ch.iter().enumerate() {
                    rows[j * 32..(j + 1) * 32].copy_from_slice(&table[c as usize]);
                }
                transpose(&rows, mp, 256)
            };
            let mut t0 = vec![0u8; k * rb];
            let mut u = vec![0u8; k * rb];
            for i in 0..k {
                let tc = &mut t0[i * rb..(i + 1) * rb];
                let uc = &mut u[i * rb..(i + 1) * rb];
                self.prg0[i].fill(tc);
                self.prg1[i].fill(uc);
                let dc = if k == 128 { &dcols[..] } else { &dcols[i * rb..(i + 1) * rb] };
                for b in 0..rb {
                    uc[b] ^= tc[b] ^ dc[b];
                }
            }
            let mut t = transpose(&t0, k, mp);
            t.truncate(m * k / 8);
            (u, t)
        });
        Ok((PyByteArray::new_bound(py, &u), PyByteArray::new_bound(py, &t)))
    }
}

//! cipherlm._core: the native core of cipherlm.
//!
//! * `random_bytes`: ChaCha20 seeded by the OS CSPRNG (or a given seed).
//! * Oblivious transfer (docs/ot.md): Chou-Orlandi base OT over Ristretto
//!   (`baseot`), IKNP03/KK13 OT extension with the ALSZ13 optimisations
//!   (`iknp`), the OT flavours built on the extension rows (`otops`),
//!   AES-CTR PRG and fixed-key AES hashing (`prg`), bit-matrix transposes
//!   (`transpose`), Ferret silent COT (`ferret`); CRT scaling kernels of the HE product (`crt`).  Rust computes the messages; Python moves them over the
//!   channel.  Every heavy function releases the GIL.

mod aesni;
mod baseot;
mod bfv_finish;
mod bfv_sym;
mod compare;
mod crt;
mod dyadic;
mod ferret;
mod iknp;
mod ntt;
mod otops;
mod pool;
mod prg;
mod transpose;
mod util;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};
use rand_chacha::ChaCha20Rng;
use rand_core::{OsRng, RngCore, SeedableRng};

/// Return `n` bytes from ChaCha20 seeded by the OS CSPRNG.
///
/// With `seed` (32 bytes) the stream is deterministic: the same seed gives the
/// same bytes, which is what seeded expansions (e.g. shared masks) need.
#[pyfunction]
#[pyo3(signature = (n, seed=None))]
fn random_bytes<'py>(py: Python<'py>, n: usize, seed: Option<&[u8]>) -> PyResult<Bound<'py, PyBytes>> {
    let mut rng = match seed {
        Some(s) => {
            let key: [u8; 32] = s
                .try_into()
                .map_err(|_| pyo3::exceptions::PyValueError::new_err("seed must be exactly 32 bytes"))?;
            ChaCha20Rng::from_seed(key)
        }
        None => {
            let mut key = [0u8; 32];
            OsRng.fill_bytes(&mut key);
            ChaCha20Rng::from_seed(key)
        }
    };
    let mut buf = vec![0u8; n];
    py.allow_threads(|| rng.fill_bytes(&mut buf));
    Ok(PyBytes::new_bound(py, &buf))
}

/// Version of the native core, so Python can check it loaded the right build.
#[pyfunction]
fn core_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Chou-Orlandi base OT, sender's first step: (secret a, A), 32 bytes each.
#[pyfunction]
fn baseot_sender_init<'py>(py: Python<'py>) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
    let (a, big_a) = py.allow_threads(baseot::sender_init);
    (PyBytes::new_bound(py, &a), PyBytes::new_bound(py, &big_a))
}

/// Chou-Orlandi base OT, receiver: (A, choices 0/1 one byte each) -> (B_i (32 bytes each), keys (16 bytes each)).
#[pyfunction]
fn baseot_receiver<'py>(
    py: Python<'py>,
    a_point: PyBuffer<u8>,
    choices: PyBuffer<u8>,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let a = util::view(&a_point)?;
    let c = util::view(&choices)?;
    let (bs, keys) = py.allow_threads(|| baseot::receiver(a, c)).map_err(pyo3::exceptions::PyValueError::new_err)?;
    Ok((PyByteArray::new_bound(py, &bs), PyByteArray::new_bound(py, &keys)))
}

/// Chou-Orlandi base OT, sender: (a, A, B_i...) -> (k0, k1), 16 bytes per OT each.
#[pyfunction]
fn baseot_sender_keys<'py>(
    py: Python<'py>,
    secret: PyBuffer<u8>,
    a_point: PyBuffer<u8>,
    bs: PyBuffer<u8>,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let (s, a, b) = (util::view(&secret)?, util::view(&a_point)?, util::view(&bs)?);
    let (k0, k1) =
        py.allow_threads(|| baseot::sender_keys(s, a, b)).map_err(pyo3::exceptions::PyValueError::new_err)?;
    Ok((PyByteArray::new_bound(py, &k0), PyByteArray::new_bound(py, &k1)))
}

/// Transpose a bit matrix of `rows` x `cols` bits (row-major, LSB first;
/// rows % 16 == 0, cols % 8 == 0) into `cols` x `rows`.
#[pyfunction]
fn transpose_bits<'py>(py: Python<'py>, data: PyBuffer<u8>, rows: usize, cols: usize) -> PyResult<Bound<'py, PyByteArray>> {
    let d = util::view(&data)?;
    if rows % 16 != 0 || cols % 8 != 0 || d.len() != rows * cols / 8 {
        return util::err("need rows % 16 == 0, cols % 8 == 0 and rows*cols/8 bytes");
    }
    let out = py.allow_threads(|| transpose::transpose(d, rows, cols));
    Ok(PyByteArray::new_bound(py, &out))
}

/// `n` bytes of AES-128-CTR keystream from a 16-byte seed (the PRG of the OT extension).
#[pyfunction]
fn aes_prg<'py>(py: Python<'py>, seed: PyBuffer<u8>, n: usize) -> PyResult<Bound<'py, PyByteArray>> {
    let s: [u8; 16] = util::view(&seed)?
        .try_into()
        .map_err(|_| pyo3::exceptions::PyValueError::new_err("seed must be 16 bytes"))?;
    let out = py.allow_threads(|| {
        let mut v = vec![0u8; n];
        prg::AesPrg::new(&s).fill(&mut v);
        v
    });
    Ok(PyByteArray::new_bound(py, &out))
}

/// AES-128 of every 16-byte block of `data` under `key` on one of the core's paths
/// ("vaes512", "aesni", "soft"; one the CPU lacks falls back to the best it has):
/// `(ciphertext, path used)`.  For tests (known answers) and the benchmarks' reports.
#[pyfunction]
fn aes128_blocks<'py>(py: Python<'py>, key: PyBuffer<u8>, data: PyBuffer<u8>, path: &str) -> PyResult<(Bound<'py, PyByteArray>, &'static str)> {
    let k: [u8; 16] = util::view(&key)?
        .try_into()
        .map_err(|_| pyo3::exceptions::PyValueError::new_err("key must be 16 bytes"))?;
    let d = util::view(&data)?;
    if d.len() % 16 != 0 {
        return util::err("data must be whole 16-byte blocks");
    }
    let want = match path {
        "vaes512" => aesni::Path::Vaes512,
        "aesni" => aesni::Path::AesNi,
        "soft" => aesni::Path::Soft,
        _ => return util::err(format!("unknown AES path {path:?} (vaes512, aesni, soft)")),
    };
    let aes = aesni::AesBatch::with_path(&k, want);
    let mut xs: Vec<u128> = d.chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap())).collect();
    py.allow_threads(|| aes.encrypt(&mut xs));
    let out: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let name = match aes.path() {
        aesni::Path::Vaes512 => "vaes512",
        aesni::Path::AesNi => "aesni",
        aesni::Path::Soft => "soft",
    };
    Ok((PyByteArray::new_bound(py, &out), name))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(random_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(core_version, m)?)?;
    m.add_function(wrap_pyfunction!(baseot_sender_init, m)?)?;
    m.add_function(wrap_pyfunction!(baseot_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(baseot_sender_keys, m)?)?;
    m.add_function(wrap_pyfunction!(transpose_bits, m)?)?;
    m.add_function(wrap_pyfunction!(aes_prg, m)?)?;
    m.add_function(wrap_pyfunction!(aes128_blocks, m)?)?;
    m.add_class::<iknp::OtExtSender>()?;
    m.add_class::<iknp::OtExtReceiver>()?;
    m.add_function(wrap_pyfunction!(otops::rot_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::rot_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(otops::chosen_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::chosen_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(otops::chosen_bytes_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::chosen_bytes_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(otops::acot_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::acot_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(otops::acot_mod_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::acot_mod_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(otops::kk13_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::kk13_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(compare::digit_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(compare::cmp_leaf_msgs, m)?)?;
    m.add_function(wrap_pyfunction!(otops::np1ofn_sender, m)?)?;
    m.add_function(wrap_pyfunction!(otops::np1ofn_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(otops::pack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(otops::unpack_bits, m)?)?;
    m.add_function(wrap_pyfunction!(ferret::ferret_sender, m)?)?;
    m.add_function(wrap_pyfunction!(ferret::ferret_receiver, m)?)?;
    m.add_function(wrap_pyfunction!(ferret::ferret_sender_trees, m)?)?;
    m.add_function(wrap_pyfunction!(ferret::ferret_sender_lpn, m)?)?;
    m.add_function(wrap_pyfunction!(ferret::ferret_receiver_lpn, m)?)?;
    m.add_function(wrap_pyfunction!(ferret::ferret_receiver_trees, m)?)?;
    m.add_function(wrap_pyfunction!(crt::crt_encode_scaled, m)?)?;
    m.add_function(wrap_pyfunction!(crt::crt_rescale_pow2, m)?)?;
    m.add_function(wrap_pyfunction!(crt::multiword_residues, m)?)?;
    m.add_function(wrap_pyfunction!(dyadic::ntt_mul_sum, m)?)?;
    m.add_function(wrap_pyfunction!(bfv_finish::bfv_encode_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(bfv_finish::ntt_rows, m)?)?;
    m.add_function(wrap_pyfunction!(bfv_finish::bfv_finish, m)?)?;
    m.add_function(wrap_pyfunction!(bfv_sym::bfv_encrypt_symmetric, m)?)?;
    m.add_function(wrap_pyfunction!(bfv_sym::bfv_expand_seeded, m)?)?;
    m.add_function(wrap_pyfunction!(bfv_sym::bfv_decrypt_positions, m)?)?;
    Ok(())
}

//! cipherlm._core: the native core of cipherlm.
//!
//! It starts small (a CSPRNG-seeded pseudo-random generator that fills
//! buffers without holding the GIL); the 2PC engine adds OT extension,
//! AES-based hashing and bit-matrix transposes here.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(random_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(core_version, m)?)?;
    Ok(())
}

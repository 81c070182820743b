//! A small job pool over the machine's cores for the native HE kernels (`dyadic`,
//! `bfv_finish`, `bfv_sym`): scoped threads taking job indices from a shared counter, each
//! with its own CSPRNG (ChaCha20 seeded by the OS) for the kernels that sample.

use rand_chacha::ChaCha20Rng;
use rand_core::{OsRng, SeedableRng};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Run `job(i, rng)` for i in 0..jobs over the machine's cores (one CSPRNG per thread).
pub fn parallel(jobs: usize, job: impl Fn(usize, &mut ChaCha20Rng) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |v| v.get()).min(jobs.max(1));
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut rng = ChaCha20Rng::from_rng(OsRng).expect("the OS random source failed");
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= jobs {
                        break;
                    }
                    job(i, &mut rng);
                }
            });
        }
    });
}


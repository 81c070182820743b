//! AES-128 encryption of many independent blocks under one key, for the fixed-key
//! hashes and GGM trees of the OT code (`prg::Tccr`, `ferret::Ggm`).
//!
//! On x86-64 CPUs with AVX-512F and VAES (e.g. Intel Ice Lake and later, AMD Zen 4)
//! the rounds run on 512-bit registers, four blocks per instruction, sixteen blocks
//! in flight; with AES-NI only, one block per instruction, eight in flight; elsewhere
//! the `aes` crate (which picks AES-NI itself where it can).  All three compute the
//! same function; `tests` checks the vector paths against the `aes` crate on the
//! FIPS-197 example and on random blocks.
//!
//! Why not only the `aes` crate: its multi-block path works on 8 blocks of 128 bits
//! and goes through a generic in/out buffer per call; on the Intel Xeon of the
//! development machine the 1-out-of-N pads (`otops::np_pads_sender`) spent more time
//! around its calls than in the rounds (docs/mpc.md "Ferret refills ahead, and fixed-key AES on VAES").

use aes::cipher::{generic_array::GenericArray, BlockEncrypt, KeyInit};
use aes::{Aes128, Block};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path {
    Vaes512,
    AesNi,
    Soft,
}

/// One AES-128 key, expanded once; `encrypt` works in place on u128 blocks (the
/// little-endian reading of the 16 bytes, as everywhere in the core).
pub struct AesBatch {
    rk: [u128; 11],
    soft: Aes128,
    path: Path,
}

impl AesBatch {
    pub fn new(key: &[u8; 16]) -> Self {
        Self::with_path(key, detect())
    }

    /// With a given path (tests: compare the paths with each other); a path the CPU
    /// lacks falls back to the best one it has.
    pub fn with_path(key: &[u8; 16], want: Path) -> Self {
        let best = detect();
        let path = match (want, best) {
            (Path::Vaes512, Path::Vaes512) => Path::Vaes512,
            (Path::Vaes512 | Path::AesNi, Path::Vaes512 | Path::AesNi) => Path::AesNi,
            _ => Path::Soft,
        };
        let soft = Aes128::new(GenericArray::from_slice(key));
        let mut rk = [0u128; 11];
        #[cfg(target_arch = "x86_64")]
        if path != Path::Soft {
            // SAFETY: path != Soft only where `detect` found AES-NI.
            rk = unsafe { x86::expand(key) };
        }
        AesBatch { rk, soft, path }
    }

    pub fn path(&self) -> Path {
        self.path
    }

    /// xs[i] <- AES_k(xs[i]) for every i.
    pub fn encrypt(&self, xs: &mut [u128]) {
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path was chosen by `detect` on this CPU.
            Path::Vaes512 => unsafe { x86::enc_vaes(&self.rk, xs) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::AesNi => unsafe { x86::enc_ni(&self.rk, xs) },
            _ => {
                // SAFETY: a u128 is 16 bytes; Block is [u8; 16]-like with align 1.
                let blocks = unsafe { std::slice::from_raw_parts_mut(xs.as_mut_ptr() as *mut Block, xs.len()) };
                for c in blocks.chunks_mut(64) {
                    self.soft.encrypt_blocks(c);
                }
            }
        }
    }
}

/// The fastest path this CPU has (checked once per call; cheap: std caches it).
pub fn detect() -> Path {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("aes") && std::is_x86_feature_detected!("sse2") {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("vaes") {
                return Path::Vaes512;
            }
            return Path::AesNi;
        }
    }
    Path::Soft
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    #[inline(always)]
    unsafe fn ld(x: u128) -> __m128i {
        _mm_loadu_si128(&x as *const u128 as *const __m128i)
    }

    #[inline(always)]
    unsafe fn st(v: __m128i) -> u128 {
        let mut x = 0u128;
        _mm_storeu_si128(&mut x as *mut u128 as *mut __m128i, v);
        x
    }

    #[target_feature(enable = "aes,sse2")]
    unsafe fn step<const RCON: i32>(k: __m128i) -> __m128i {
        let t = _mm_shuffle_epi32(_mm_aeskeygenassist_si128::<RCON>(k), 0xff);
        let mut k = k;
        k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
        k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
        k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
        _mm_xor_si128(k, t)
    }

    /// The AES-128 key schedule (FIPS-197 sec. 5.2) with AESKEYGENASSIST.
    #[target_feature(enable = "aes,sse2")]
    pub unsafe fn expand(key: &[u8; 16]) -> [u128; 11] {
        let mut k = _mm_loadu_si128(key.as_ptr() as *const __m128i);
        let mut rk = [0u128; 11];
        rk[0] = st(k);
        macro_rules! next {
            ($i:expr, $r:expr) => {
                k = step::<$r>(k);
                rk[$i] = st(k);
            };
        }
        next!(1, 0x01);
        next!(2, 0x02);
        next!(3, 0x04);
        next!(4, 0x08);
        next!(5, 0x10);
        next!(6, 0x20);
        next!(7, 0x40);
        next!(8, 0x80);
        next!(9, 0x1b);
        next!(10, 0x36);
        rk
    }

    /// AES-NI, eight blocks in flight, then one at a time.
    #[target_feature(enable = "aes,sse2")]
    pub unsafe fn enc_ni(rk: &[u128; 11], xs: &mut [u128]) {
        let mut k = [_mm_setzero_si128(); 11];
        for (d, &s) in k.iter_mut().zip(rk.iter()) {
            *d = ld(s);
        }
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let p = c.as_mut_ptr() as *mut __m128i;
            let mut b = [_mm_setzero_si128(); 8];
            for (j, v) in b.iter_mut().enumerate() {
                *v = _mm_xor_si128(_mm_loadu_si128(p.add(j)), k[0]);
            }
            for kr in &k[1..10] {
                for v in b.iter_mut() {
                    *v = _mm_aesenc_si128(*v, *kr);
                }
            }
            for (j, v) in b.iter().enumerate() {
                _mm_storeu_si128(p.add(j), _mm_aesenclast_si128(*v, k[10]));
            }
        }
        for x in chunks.into_remainder() {
            let mut v = _mm_xor_si128(ld(*x), k[0]);
            for kr in &k[1..10] {
                v = _mm_aesenc_si128(v, *kr);
            }
            *x = st(_mm_aesenclast_si128(v, k[10]));
        }
    }

    /// VAES on 512-bit registers: 4 registers x 4 blocks in flight, then one register
    /// at a time, then AES-NI for the last < 4 blocks.
    #[target_feature(enable = "avx512f,vaes,aes,sse2")]
    pub unsafe fn enc_vaes(rk: &[u128; 11], xs: &mut [u128]) {
        let mut k = [_mm512_setzero_si512(); 11];
        for (d, &s) in k.iter_mut().zip(rk.iter()) {
            *d = _mm512_broadcast_i32x4(ld(s));
        }
        let mut chunks = xs.chunks_exact_mut(16);
        for c in &mut chunks {
            let p = c.as_mut_ptr() as *mut __m512i;
            let mut b0 = _mm512_xor_si512(_mm512_loadu_si512(p as *const _), k[0]);
            let mut b1 = _mm512_xor_si512(_mm512_loadu_si512(p.add(1) as *const _), k[0]);
            let mut b2 = _mm512_xor_si512(_mm512_loadu_si512(p.add(2) as *const _), k[0]);
            let mut b3 = _mm512_xor_si512(_mm512_loadu_si512(p.add(3) as *const _), k[0]);
            for kr in &k[1..10] {
                b0 = _mm512_aesenc_epi128(b0, *kr);
                b1 = _mm512_aesenc_epi128(b1, *kr);
                b2 = _mm512_aesenc_epi128(b2, *kr);
                b3 = _mm512_aesenc_epi128(b3, *kr);
            }
            _mm512_storeu_si512(p as *mut _, _mm512_aesenclast_epi128(b0, k[10]));
            _mm512_storeu_si512(p.add(1) as *mut _, _mm512_aesenclast_epi128(b1, k[10]));
            _mm512_storeu_si512(p.add(2) as *mut _, _mm512_aesenclast_epi128(b2, k[10]));
            _mm512_storeu_si512(p.add(3) as *mut _, _mm512_aesenclast_epi128(b3, k[10]));
        }
        let rest = chunks.into_remainder();
        let mut quads = rest.chunks_exact_mut(4);
        for c in &mut quads {
            let p = c.as_mut_ptr() as *mut __m512i;
            let mut b = _mm512_xor_si512(_mm512_loadu_si512(p as *const _), k[0]);
            for kr in &k[1..10] {
                b = _mm512_aesenc_epi128(b, *kr);
            }
            _mm512_storeu_si512(p as *mut _, _mm512_aesenclast_epi128(b, k[10]));
        }
        enc_ni(rk, quads.into_remainder());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soft(key: &[u8; 16], xs: &mut [u128]) {
        AesBatch::with_path(key, Path::Soft).encrypt(xs)
    }

    #[test]
    fn fips197_example() {
        // FIPS-197 appendix C.1 (AES-128)
        let key: [u8; 16] = core::array::from_fn(|i| i as u8);
        let pt: [u8; 16] = core::array::from_fn(|i| (i as u8) * 0x11);
        let want = [0x69, 0xc4, 0xe0, 0xd8, 0x6a, 0x7b, 0x04, 0x30, 0xd8, 0xcd, 0xb7, 0x80, 0x70, 0xb4, 0xc5, 0x5a];
        for path in [Path::Vaes512, Path::AesNi, Path::Soft] {
            let mut x = [u128::from_le_bytes(pt)];
            AesBatch::with_path(&key, path).encrypt(&mut x);
            assert_eq!(x[0].to_le_bytes(), want, "{path:?}");
        }
    }

    #[test]
    fn paths_agree_on_every_length() {
        let key = *b"0123456789abcdef";
        let mut s = 0x9e3779b97f4a7c15u128;
        for n in [0usize, 1, 3, 4, 5, 15, 16, 17, 35, 100, 1027] {
            let xs: Vec<u128> = (0..n)
                .map(|_| {
                    s = s.wrapping_mul(0x2545f4914f6cdd1d2545f4914f6cdd1d).wrapping_add(1442695040888963407);
                    s
                })
                .collect();
            let mut want = xs.clone();
            soft(&key, &mut want);
            for path in [Path::Vaes512, Path::AesNi] {
                let mut got = xs.clone();
                AesBatch::with_path(&key, path).encrypt(&mut got);
                assert_eq!(got, want, "{path:?} n={n}");
            }
        }
    }
}

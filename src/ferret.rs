//! Ferret silent correlated OT, semi-honest version (Yang, Weng, Lan, Zhang,
//! Wang, "Ferret: Fast Extension for coRRElated oT with small
//! communication", CCS 2020, ePrint 2020/924).
//!
//! One *iteration* turns `k + t*h` random base COTs with a global Delta into
//! `n = t * 2^h` random COTs with the same Delta (sender: v_i, Delta;
//! receiver: u_i, w_i = v_i xor u_i*Delta):
//!
//! 1. **Single-point COT by a GGM tree** (Ferret sec. 3.2 / 4, Fig. 6, after
//!    Schoppmann-Gascon-Reichert-Raykova CCS 2019 and Boyle et al. CCS 2019):
//!    the sender expands a random root into 2^h leaves with a length-doubling
//!    PRG; for every level l it sends the two level sums K_0^l, K_1^l (the XOR of
//!    all left / all right nodes of level l+1), masked with H(q_l) and
//!    H(q_l xor Delta) using one base COT (q_l; receiver b_l, t_l) per level.
//!    The receiver learns K_{b_l}^l only, i.e. the sum of the side that is *off*
//!    its path: its punctured point is alpha = (not b_0, ..., not b_{h-1}), read
//!    MSB first.  Because the base choice bits b are uniform, alpha is uniform
//!    without sending anything (the receiver does not choose alpha; regular
//!    noise only needs it random).  The sender also sends
//!    d = Delta xor (XOR of all leaves), from which the receiver gets
//!    w_alpha = v_alpha xor Delta.  Per tree: h * 256 + 128 bits, sender ->
//!    receiver only.
//! 2. **Regular-noise MPCOT** (Ferret sec. 4, "regular noise"): t independent
//!    trees of 2^h leaves side by side; the noise vector e has exactly one 1 per
//!    block of 2^h positions.
//! 3. **Primal-LPN expansion** with a local linear code (Ferret sec. 4,
//!    eq. "x = u A + e"): every output i XORs D = 10 base COTs of the first k
//!    (uniform indices from AES-CTR on a public seed, `IndexStream`), plus the
//!    MPCOT output:
//!    sender  y_i = s_i xor XOR_j v_base[idx_ij],
//!    receiver x_i = e_i xor XOR_j u_base[idx_ij],  z_i = r_i xor XOR_j w_base[idx_ij],
//!    so z_i = y_i xor x_i * Delta.
//!
//! H is the tweakable circular correlation-robust hash of GKWY20 (`prg::Tccr`),
//! with a fresh tweak per base COT (the caller passes the first tweak; the
//! caller keeps the tweak domain of these GGM hashes disjoint from the one of
//! the OTs served to the protocols).  The GGM PRG is G(s) = (pi_0(s) xor s,
//! pi_1(s) xor s) with two fixed-key AES permutations pi_0, pi_1 (the
//! Matyas-Meyer-Oseas form, ideal-cipher model), as the authors' reference
//! implementation does with fixed-key AES.
//!
//! Parameters (n, k, t) must come from the Ferret paper's LPN table; the
//! Python pool (`cipherlm/mpc/ferret.py`) uses only those.  The functions here
//! accept any (n = t 2^h, k) so that tests can run on small instances.
//!
//! Rust computes the messages; Python moves them (same pattern as `iknp`).

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use rand_core::{OsRng, RngCore};

use crate::aesni::AesBatch;
use crate::prg::{AesPrg, Tccr};
use crate::util::{bytes_of_u128_mut, err, view};

/// Row weight of the local linear code (Ferret sec. 4 / sec. 6: d = 10).
pub const LPN_D: usize = 10;

/// Fixed public AES keys of the GGM PRG (left and right child).
const GGM_KEY0: [u8; 16] = *b"cipherlm-ggm-L-1";
const GGM_KEY1: [u8; 16] = *b"cipherlm-ggm-R-1";

/// Chunk of parents expanded per AES call (AES-NI pipelining).
const CH: usize = 64;

#[inline]
fn get(buf: &[u8], i: usize) -> u128 {
    u128::from_le_bytes(buf[i * 16..i * 16 + 16].try_into().unwrap())
}

#[inline]
fn put(buf: &mut [u8], i: usize, x: u128) {
    buf[i * 16..i * 16 + 16].copy_from_slice(&x.to_le_bytes());
}

/// Shape of one Ferret iteration: n = t * 2^h outputs, k LPN base COTs,
/// t trees of depth h; it consumes k + t*h base COTs.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub n: usize,
    pub k: usize,
    pub t: usize,
    pub h: usize,
}

impl Shape {
    pub fn new(n: usize, k: usize, t: usize, h: usize) -> Result<Self, String> {
        if h == 0 || h > 24 || t == 0 || k < LPN_D || n != t << h {
            return Err(format!("bad Ferret shape n={n} k={k} t={t} h={h} (need n = t * 2^h, 1 <= h <= 24, k >= {LPN_D})"));
        }
        Ok(Shape { n, k, t, h })
    }
    /// Base COTs consumed: k for the LPN code, h per tree.
    pub fn base(&self) -> usize {
        self.k + self.t * self.h
    }
    /// Bytes of the sender's message: per tree h pairs of masked level sums and d.
    pub fn msg_len(&self) -> usize {
        self.t * (self.h * 32 + 16)
    }
}

/// The length-doubling PRG of the GGM tree: G(s) = (pi_0(s) xor s,
/// pi_1(s) xor s) with two fixed-key AES-128 permutations (`aesni::AesBatch`:
/// VAES or AES-NI picked at run time).
pub struct Ggm {
    p0: AesBatch,
    p1: AesBatch,
}

#[cfg(not(target_endian = "little"))]
compile_error!("ferret.rs reads AES blocks as little-endian u128");

impl Ggm {
    pub fn new() -> Self {
        Ggm { p0: AesBatch::new(&GGM_KEY0), p1: AesBatch::new(&GGM_KEY1) }
    }

    /// Expand level `l` (2^l nodes at the front of `tree`) into level l+1
    /// (2^(l+1) nodes) in place; return (XOR of the even (left) children, XOR of
    /// the odd (right) children).
    pub fn expand_level(&self, tree: &mut [u128], l: usize) -> (u128, u128) {
        let np = 1usize << l;
        let mut a = [0u128; CH];
        let mut b = [0u128; CH];
        let (mut s0, mut s1) = (0u128, 0u128);
        // From the last parents to the first: children [2p, 2p+2) never overwrite
        // a parent that is still to be read (encrypted into a/b before writing).
        let mut hi = np;
        while hi > 0 {
            let lo = hi.saturating_sub(CH);
            let c = hi - lo;
            a[..c].copy_from_slice(&tree[lo..hi]);
            b[..c].copy_from_slice(&tree[lo..hi]);
            self.p0.encrypt(&mut a[..c]);
            self.p1.encrypt(&mut b[..c]);
            for j in (0..c).rev() {
                let s = tree[lo + j];
                let left = a[j] ^ s;
                let right = b[j] ^ s;
                s0 ^= left;
                s1 ^= right;
                tree[2 * (lo + j)] = left;
                tree[2 * (lo + j) + 1] = right;
            }
            hi = lo;
        }
        (s0, s1)
    }

    /// Sender: full tree of depth h from `root` into `leaves` (2^h entries);
    /// returns the level sums [(K_0^l, K_1^l) for l in 0..h].
    pub fn sender_tree(&self, root: u128, h: usize, leaves: &mut [u128]) -> Vec<(u128, u128)> {
        debug_assert_eq!(leaves.len(), 1 << h);
        leaves[0] = root;
        (0..h).map(|l| self.expand_level(leaves, l)).collect()
    }

    /// Receiver: given the sums K_{b_l}^l of the off-path side of every level
    /// (b_l = the receiver's base choice bit of level l), rebuild every leaf
    /// except the punctured one, which is left 0.  Returns alpha, the
    /// punctured leaf index (bit l of the path, MSB first, is 1 - b_l).
    pub fn receiver_tree(&self, known: &[u128], b: &[u8], leaves: &mut [u128]) -> usize {
        let h = known.len();
        debug_assert_eq!(leaves.len(), 1 << h);
        // level 1: the off-path child is exactly K_{b_0}^0.
        let mut p = 1 - b[0] as usize; // path node at level 1
        leaves[b[0] as usize] = known[0];
        leaves[p] = 0;
        for l in 1..h {
            let (s0, s1) = self.expand_level(leaves, l);
            let bl = b[l] as usize;
            let sib = 2 * p + bl; // off-path child of the path node
            let garbage = leaves[sib];
            let side = if bl == 0 { s0 } else { s1 };
            // side includes the garbage child of the placeholder: remove it.
            leaves[sib] = known[l] ^ side ^ garbage;
            p = 2 * p + (1 - bl);
            leaves[p] = 0;
        }
        p
    }
}

/// The public LPN matrix: LPN_D uniform indices in [0, k) per output row, drawn
/// in row order from AES-128-CTR keyed by the public seed (`IndexStream`).
///
/// Each index takes one 32-bit word r of the stream and is Lemire's multiply-high
/// reduction (r * k) >> 32 with rejection ("Fast random integer generation in an
/// interval", ACM TOMACS 2019): words whose low product half falls below
/// 2^32 mod k are skipped (probability < k / 2^32, 1.4e-4 at the main
/// parameters), which makes every index exactly uniform.  Both parties read the
/// same stream, so they skip the same words.  (Before: one 64-bit word per index
/// without rejection, bias < k / 2^64; 32-bit words halve the AES work, which
/// was a quarter of the encoder's time.)
pub struct IndexStream {
    prg: AesPrg,
    k: u64,
    threshold: u32,
    blocks: Vec<u128>, // the last AES-CTR refill (16-byte aligned: encrypted in place)
    pos: usize,        // next unread 32-bit word of `blocks`
}

const INDEX_WORDS: usize = 4096; // 32-bit words per AES-CTR refill (16 KiB)

impl IndexStream {
    pub fn new(seed: &[u8; 16], k: usize) -> Self {
        assert!(k > 0 && (k as u64) < (1 << 32));
        let threshold = ((1u64 << 32) % k as u64) as u32;
        IndexStream { prg: AesPrg::new(seed), k: k as u64, threshold, blocks: vec![0; INDEX_WORDS / 4], pos: INDEX_WORDS }
    }

    fn refill(&mut self) {
        self.prg.fill(bytes_of_u128_mut(&mut self.blocks));
        self.pos = 0;
    }

    /// Fill `idx` with the next idx.len() indices.
    pub fn fill(&mut self, idx: &mut [u32]) {
        let k = self.k;
        let thr = self.threshold;
        let mut i = 0;
        while i < idx.len() {
            if self.pos == INDEX_WORDS {
                self.refill();
            }
            let take = (idx.len() - i).min(INDEX_WORDS - self.pos);
            let src = &bytes_of_u128_mut(&mut self.blocks)[4 * self.pos..4 * (self.pos + take)];
            let dst = &mut idx[i..i + take];
            // fast path (vectorised): reduce the whole run, note any rejection
            if reduce_run(src, k as u32, dst) >= thr {
                self.pos += take;
                i += take;
                continue;
            }
            // a word to reject in this run: keep the outputs before it, skip it
            let bad = src
                .chunks_exact(4)
                .position(|c| ((u32::from_le_bytes(c.try_into().unwrap()) as u64 * k) as u32) < thr)
                .unwrap();
            self.pos += bad + 1;
            i += bad;
        }
    }
}

/// dst[i] = (word_i * k) >> 32 for the little-endian 32-bit words of `src`;
/// returns the smallest low half (word_i * k) mod 2^32 (rejection test).
#[inline]
fn reduce_run(src: &[u8], k: u32, dst: &mut [u32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked at run time).
            return unsafe { reduce_run_avx2(src, k, dst) };
        }
    }
    reduce_run_generic(src, k, dst)
}

#[inline(always)]
fn reduce_run_generic(src: &[u8], k: u32, dst: &mut [u32]) -> u32 {
    let mut low_min = u32::MAX;
    for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        // a 32 x 32 -> 64-bit product (k < 2^32): one vpmuludq per lane
        let m = u32::from_le_bytes(c.try_into().unwrap()) as u64 * k as u64;
        *o = (m >> 32) as u32;
        low_min = low_min.min(m as u32);
    }
    low_min
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_run_avx2(src: &[u8], k: u32, dst: &mut [u32]) -> u32 {
    reduce_run_generic(src, k, dst) // the same loop, compiled for AVX2
}

/// Rows per index batch: LPN_ROWS * LPN_D indices (40 KiB of u32) and their
/// AES-CTR input (80 KiB) stay in L1/L2 while the rows are summed.
const LPN_ROWS: usize = 1024;
/// Rows ahead whose base entries are prefetched while a row is summed
/// (LPN_D loads each; measured on the 2-vCPU EPYC: 0 to 16 rows ahead are within
/// the noise of each other, the out-of-order core already overlaps most misses).
const PREFETCH_ROWS: usize = 8;

#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// acc ^ XOR_j base[j] over the indices `ix` (one 16-byte vector load and XOR each
/// on x86-64 instead of two 64-bit ones: fewer micro-ops between the misses).
///
/// # Safety
/// Every index must be in bounds of the array `base` points to.
#[inline(always)]
unsafe fn xor_gather(acc: u128, base: *const u128, ix: &[u32]) -> u128 {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::*;
        let mut a = _mm_loadu_si128(&acc as *const u128 as *const __m128i);
        for &j in ix {
            a = _mm_xor_si128(a, _mm_load_si128(base.add(j as usize) as *const __m128i));
        }
        let mut out = 0u128;
        _mm_storeu_si128(&mut out as *mut u128 as *mut __m128i, a);
        out
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut a = acc;
        for &j in ix {
            a ^= *base.add(j as usize);
        }
        a
    }
}

/// A zeroed vector of `n` u128 whose pages the kernel may back with 2 MiB
/// transparent huge pages (madvise, Linux): the LPN encoder reads the k base
/// entries (9.4 MB at the main parameters) at random, and with 4 KiB pages
/// nearly every read would also miss the TLB.
pub fn big_u128(n: usize) -> Vec<u128> {
    let mut v: Vec<u128> = Vec::with_capacity(n);
    advise_huge(v.as_mut_ptr() as *mut u8, n * 16);
    v.resize(n, 0);
    v
}

fn advise_huge(p: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut core::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_HUGEPAGE: i32 = 14;
        const HUGE: usize = 2 << 20;
        let start = (p as usize + HUGE - 1) & !(HUGE - 1);
        let end = (p as usize + len) & !(HUGE - 1);
        if end > start {
            // SAFETY: [start, end) lies inside this allocation; the advice only
            // changes how the kernel backs it (failure is harmless and ignored).
            unsafe {
                madvise(start as *mut core::ffi::c_void, end - start, MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len);
}

/// The primal-LPN encoder: out[i] ^= XOR_j base[idx_ij] for every row i, and,
/// when `bits` is given (the receiver's choice bits of the k base COTs, one byte
/// each), bits_out[i] ^= XOR_j bits_in[idx_ij].
///
/// Layout for the cache (the encoder is a random gather from k entries,
/// 9.4 MB at the main parameters, larger than L2): the base is copied once into
/// an aligned u128 array on huge pages (no TLB miss per read); the choice bits
/// are packed 64 to a word (74 KB at the main parameters: they stay in L2
/// instead of competing with the gather as 590 KB of bytes; measured faster than
/// 32-byte entries carrying w and u in one half line, whose 19 MB footprint
/// costs more than the extra L2 hit); indices are drawn
/// for LPN_ROWS rows at a time into an L1/L2-sized buffer; and the base entries
/// of the row PREFETCH_ROWS ahead are prefetched.
pub fn lpn_apply(seed: &[u8; 16], k: usize, base: &[u8], out: &mut [u128], bits: Option<(&[u8], &mut [u8])>) {
    lpn_encode(seed, k, base, out, bits, false)
}

/// `lpn_apply`, or with `assign` the same rows written instead of XORed in
/// (out[i] = XOR_j base[idx_ij], bits_out[i] = XOR_j bits_in[idx_ij]): the
/// receiver encodes first, into an output it has not initialised, while it
/// waits for the sender's GGM message.
pub fn lpn_encode(seed: &[u8; 16], k: usize, base: &[u8], out: &mut [u128], bits: Option<(&[u8], &mut [u8])>, assign: bool) {
    let n = out.len();
    let mut stream = IndexStream::new(seed, k);
    let mut idx = vec![0u32; LPN_ROWS * LPN_D];
    let mut basew = big_u128(k);
    for (o, c) in basew.iter_mut().zip(base[..k * 16].chunks_exact(16)) {
        *o = u128::from_le_bytes(c.try_into().unwrap());
    }
    let packed: Option<(Vec<u64>, &mut [u8])> = bits.map(|(bi, bo)| {
        let mut p = vec![0u64; (k + 63) / 64];
        for (j, &b) in bi[..k].iter().enumerate() {
            p[j >> 6] |= ((b & 1) as u64) << (j & 63);
        }
        (p, bo)
    });
    let bp = basew.as_ptr();
    let mut r0 = 0;
    match packed {
        None => {
            while r0 < n {
                let rows = LPN_ROWS.min(n - r0);
                let ix = &mut idx[..rows * LPN_D];
                stream.fill(ix);
                for &j in &ix[..PREFETCH_ROWS.min(rows) * LPN_D] {
                    prefetch(bp.wrapping_add(j as usize));
                }
                let dst = &mut out[r0..r0 + rows];
                for (r, o) in dst.iter_mut().enumerate() {
                    if r + PREFETCH_ROWS < rows {
                        for &j in &ix[(r + PREFETCH_ROWS) * LPN_D..(r + PREFETCH_ROWS + 1) * LPN_D] {
                            prefetch(bp.wrapping_add(j as usize));
                        }
                    }
                    let acc = if assign { 0 } else { *o };
                    // SAFETY: every index is < k = basew.len() (`IndexStream`)
                    *o = unsafe { xor_gather(acc, bp, &ix[r * LPN_D..(r + 1) * LPN_D]) };
                }
                r0 += rows;
            }
        }
        Some((pbits, bout)) => {
            while r0 < n {
                let rows = LPN_ROWS.min(n - r0);
                let ix = &mut idx[..rows * LPN_D];
                stream.fill(ix);
                for &j in &ix[..PREFETCH_ROWS.min(rows) * LPN_D] {
                    prefetch(bp.wrapping_add(j as usize));
                }
                let dst = &mut out[r0..r0 + rows];
                let bdst = &mut bout[r0..r0 + rows];
                for (r, (o, bo)) in dst.iter_mut().zip(bdst.iter_mut()).enumerate() {
                    if r + PREFETCH_ROWS < rows {
                        for &j in &ix[(r + PREFETCH_ROWS) * LPN_D..(r + PREFETCH_ROWS + 1) * LPN_D] {
                            prefetch(bp.wrapping_add(j as usize));
                        }
                    }
                    let mut acc = if assign { 0 } else { *o };
                    let mut x = if assign { 0 } else { *bo as u64 };
                    for &j in &ix[r * LPN_D..(r + 1) * LPN_D] {
                        let j = j as usize;
                        // SAFETY: every index is < k = basew.len() (`IndexStream`), and
                        // pbits has ceil(k / 64) words
                        unsafe {
                            acc ^= *basew.get_unchecked(j);
                            x ^= *pbits.get_unchecked(j >> 6) >> (j & 63);
                        }
                    }
                    *o = acc;
                    *bo = (x & 1) as u8;
                }
                r0 += rows;
            }
        }
    }
}

/// Sender side of one iteration.  `base_v`: base COTs (k + t*h rows of 16
/// bytes: first k for the LPN code, then h per tree).  Writes v (n entries) into
/// `v` and returns the message for the receiver.  Tree roots come from the OS
/// CSPRNG.
pub fn sender_into(shape: Shape, delta: u128, base_v: &[u8], seed: &[u8; 16], tweak: u64, v: &mut [u128]) -> Vec<u8> {
    let msg = sender_trees(shape, delta, base_v, tweak, v);
    sender_lpn(shape, base_v, seed, v);
    msg
}

/// Sender, first half of an iteration: the t GGM trees written into `v` (n
/// entries, overwritten) and the message for the receiver, which depends on
/// nothing else: it can go out before the LPN encoding (`sender_lpn`), so the
/// receiver's tree work overlaps the sender's encoding.
pub fn sender_trees(shape: Shape, delta: u128, base_v: &[u8], tweak: u64, v: &mut [u128]) -> Vec<u8> {
    let Shape { n, k, t, h } = shape;
    assert_eq!(v.len(), n);
    let ggm = Ggm::new();
    let tccr = Tccr::new();
    let mut msg = vec![0u8; shape.msg_len()];
    let mut roots = vec![0u8; t * 16];
    OsRng.fill_bytes(&mut roots);
    let mut pads = vec![0u8; 2 * h * 16];
    for (tau, leaves) in v.chunks_exact_mut(1 << h).enumerate() {
        let sums = ggm.sender_tree(get(&roots, tau), h, leaves);
        // pads: H(tw_l, q_l) and H(tw_l, q_l xor Delta) for this tree's h base COTs
        let q = &base_v[(k + tau * h) * 16..(k + (tau + 1) * h) * 16];
        let tw0 = tweak.wrapping_add((tau * h) as u64);
        let (p0, p1) = pads.split_at_mut(h * 16);
        p0.copy_from_slice(q);
        for l in 0..h {
            put(p1, l, get(q, l) ^ delta);
        }
        tccr.hash_in_place(p0, tw0);
        tccr.hash_in_place(p1, tw0);
        let m = &mut msg[tau * (h * 32 + 16)..(tau + 1) * (h * 32 + 16)];
        for l in 0..h {
            put(m, 2 * l, sums[l].0 ^ get(p0, l));
            put(m, 2 * l + 1, sums[l].1 ^ get(p1, l));
        }
        // the leaves' LSBs are cleared (so that the LSB of a receiver's w is its
        // choice bit when LSB(Delta) = 1 and the base is normalised the same way,
        // `receiver_trees`); d = Delta xor the XOR of the cleared leaves, which is
        // the XOR of the two sums of the last level with its LSB cleared
        for x in leaves.iter_mut() {
            *x &= !1;
        }
        put(m, 2 * h, delta ^ ((sums[h - 1].0 ^ sums[h - 1].1) & !1));
    }
    msg
}

/// Sender, second half: v ^= the LPN encoding of the first k base COTs.
pub fn sender_lpn(shape: Shape, base_v: &[u8], seed: &[u8; 16], v: &mut [u128]) {
    assert_eq!(v.len(), shape.n);
    lpn_apply(seed, shape.k, base_v, v, None);
}

/// `sender_into` with a fresh output: (message, v as n rows of 16 bytes).
pub fn sender(shape: Shape, delta: u128, base_v: &[u8], seed: &[u8; 16], tweak: u64) -> (Vec<u8>, Vec<u8>) {
    let mut v = big_u128(shape.n);
    let msg = sender_into(shape, delta, base_v, seed, tweak, &mut v);
    (msg, u128s_to_bytes(v))
}

/// Receiver side of one iteration.  `base_u`: k + t*h choice bits (one byte
/// each, 0/1), `base_w`: the matching rows w = v xor u*Delta.  Writes u (n choice
/// bytes 0/1) and w (n entries).
#[allow(clippy::too_many_arguments)]
pub fn receiver_into(
    shape: Shape,
    base_u: &[u8],
    base_w: &[u8],
    seed: &[u8; 16],
    tweak: u64,
    msg: &[u8],
    u: &mut [u8],
    w: &mut [u128],
) {
    receiver_lpn(shape, base_u, base_w, seed, u, w, false);
    receiver_trees(shape, base_u, base_w, tweak, msg, u, w, false);
}

/// Receiver, first half (needs only the public seed, not the sender's
/// message): w = the LPN encoding of the first k base rows, u = the same code
/// applied to their choice bits (both overwritten).
///
/// With `lsb` (the choice bit carried in the LSB of w: LSB(Delta) = 1 and every
/// base row normalised so that LSB(w_j) = u_j, i.e. LSB(v_j) = 0) the choice
/// bits need no encoding of their own: the LSB of the encoded w is already
/// the encoded u, and `u` is left untouched (`receiver_trees` writes it).
/// This is the receiver's encoding at the sender's cost (no bit gather).
pub fn receiver_lpn(shape: Shape, base_u: &[u8], base_w: &[u8], seed: &[u8; 16], u: &mut [u8], w: &mut [u128], lsb: bool) {
    let k = shape.k;
    assert_eq!(w.len(), shape.n);
    assert_eq!(u.len(), shape.n);
    if lsb {
        lpn_encode(seed, k, base_w, w, None, true);
    } else {
        lpn_encode(seed, k, base_w, w, Some((&base_u[..k], u)), true);
    }
}

/// Whether every base row carries its choice bit in its LSB (`lsb` mode's input).
pub fn lsb_normalised(base_u: &[u8], base_w: &[u8]) -> bool {
    base_u.iter().zip(base_w.chunks_exact(16)).all(|(&c, row)| row[0] & 1 == c)
}

/// Receiver, second half: the punctured GGM trees from the sender's message,
/// XORed into w block by block (each tree expanded in a 2^h scratch that stays
/// in cache), and the noise (one 1 per block at the punctured leaf) into u.
#[allow(clippy::too_many_arguments)]
/// With `lsb` (see `receiver_lpn`) u is written from the LSBs of the final w.
pub fn receiver_trees(shape: Shape, base_u: &[u8], base_w: &[u8], tweak: u64, msg: &[u8], u: &mut [u8], w: &mut [u128], lsb: bool) {
    let Shape { n, k, h, .. } = shape;
    assert_eq!(w.len(), n);
    assert_eq!(u.len(), n);
    let ggm = Ggm::new();
    let tccr = Tccr::new();
    let mut pads = vec![0u8; h * 16];
    let mut known = vec![0u128; h];
    let mut leaves = vec![0u128; 1 << h];
    for (tau, wblk) in w.chunks_exact_mut(1 << h).enumerate() {
        let b = &base_u[k + tau * h..k + (tau + 1) * h];
        pads.copy_from_slice(&base_w[(k + tau * h) * 16..(k + (tau + 1) * h) * 16]);
        tccr.hash_in_place(&mut pads, tweak.wrapping_add((tau * h) as u64));
        let m = &msg[tau * (h * 32 + 16)..(tau + 1) * (h * 32 + 16)];
        for l in 0..h {
            known[l] = get(m, 2 * l + b[l] as usize) ^ get(&pads, l);
        }
        let alpha = ggm.receiver_tree(&known, b, &mut leaves);
        let mut acc = get(m, 2 * h);
        for (o, &x) in wblk.iter_mut().zip(leaves.iter()) {
            let x = x & !1; // the sender's leaves have their LSB cleared
            acc ^= x; // the punctured leaf is 0 here
            *o ^= x;
        }
        wblk[alpha] ^= acc; // leaf alpha = v_alpha xor Delta
        let ublk = &mut u[tau << h..(tau + 1) << h];
        if lsb {
            for (c, x) in ublk.iter_mut().zip(wblk.iter()) {
                *c = (*x as u8) & 1;
            }
        } else {
            ublk[alpha] ^= 1;
        }
    }
}

/// `receiver_into` with fresh outputs: (u: n choice bytes 0/1, w: n rows of 16 bytes).
pub fn receiver(shape: Shape, base_u: &[u8], base_w: &[u8], seed: &[u8; 16], tweak: u64, msg: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut w = big_u128(shape.n);
    let mut u = vec![0u8; shape.n];
    receiver_into(shape, base_u, base_w, seed, tweak, msg, &mut u, &mut w);
    (u, u128s_to_bytes(w))
}

fn u128s_to_bytes(v: Vec<u128>) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 16);
    for x in &v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn shape_arg(n: usize, k: usize, t: usize, h: usize) -> PyResult<Shape> {
    Shape::new(n, k, t, h).map_err(pyo3::exceptions::PyValueError::new_err)
}

fn seed_arg(seed: &PyBuffer<u8>) -> PyResult<[u8; 16]> {
    view(seed)?.try_into().map_err(|_| pyo3::exceptions::PyValueError::new_err("LPN seed must be 16 bytes"))
}

/// A writable, C-contiguous Python buffer of exactly `len` bytes, aligned to
/// `align` bytes, as a mutable byte slice (the caller's output array: numpy
/// arrays of this size are 16-byte aligned and on huge pages).
fn out_bytes<'a>(b: &'a PyBuffer<u8>, len: usize, align: usize, what: &str) -> PyResult<&'a mut [u8]> {
    if b.readonly() || !b.is_c_contiguous() {
        return err(format!("{what}: need a writable C-contiguous buffer"));
    }
    if b.len_bytes() != len {
        return err(format!("{what}: {} bytes, expected {len}", b.len_bytes()));
    }
    if (b.buf_ptr() as usize) % align != 0 {
        return err(format!("{what}: buffer not aligned to {align} bytes"));
    }
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: writable, contiguous, `len` bytes, kept alive by `b`; written while
    // the GIL is released, as numpy's own kernels do.
    Ok(unsafe { std::slice::from_raw_parts_mut(b.buf_ptr() as *mut u8, len) })
}

fn as_u128s(b: &mut [u8]) -> &mut [u128] {
    // SAFETY: `out_bytes` checked 16-byte alignment; len is a multiple of 16.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u128, b.len() / 16) }
}

/// Ferret iteration, sender (Delta holder): (delta 16 bytes, base_v
/// (k + t*h) * 16 bytes, n, k, t, h, public LPN seed 16 bytes, first GGM hash
/// tweak, optional `out`) -> (message t*(32h + 16) bytes, v n*16 bytes).  With
/// `out` (a writable 16-byte-aligned buffer of n*16 bytes, e.g. a numpy (n, 2)
/// uint64 array) v is written there and `out` itself is returned (no copy).
/// Releases the GIL.
#[pyfunction]
#[pyo3(signature = (delta, base_v, n, k, t, h, seed, tweak, out=None))]
#[allow(clippy::too_many_arguments)]
pub fn ferret_sender<'py>(
    py: Python<'py>,
    delta: PyBuffer<u8>,
    base_v: PyBuffer<u8>,
    n: usize,
    k: usize,
    t: usize,
    h: usize,
    seed: PyBuffer<u8>,
    tweak: u64,
    out: Option<Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyAny>)> {
    let shape = shape_arg(n, k, t, h)?;
    let delta = delta_arg(&delta)?;
    let bv = base_rows_arg(&base_v, &shape)?;
    let s = seed_arg(&seed)?;
    match out {
        Some(o) => {
            let ob = PyBuffer::<u8>::get_bound(&o)?;
            let v = as_u128s(out_bytes(&ob, n * 16, 16, "out")?);
            let msg = py.allow_threads(|| sender_into(shape, delta, bv, &s, tweak, v));
            Ok((PyByteArray::new_bound(py, &msg), o))
        }
        None => {
            let (msg, v) = py.allow_threads(|| sender(shape, delta, bv, &s, tweak));
            Ok((PyByteArray::new_bound(py, &msg), PyByteArray::new_bound(py, &v).into_any()))
        }
    }
}

/// Ferret iteration, receiver: (base_u (k + t*h) bytes 0/1, base_w
/// (k + t*h) * 16 bytes, n, k, t, h, seed, tweak, the sender's message,
/// optional `out_u`, `out_w`) -> (u n bytes 0/1, w n*16 bytes); with `out_u`
/// (n bytes) and `out_w` (n*16 bytes, 16-byte aligned) the outputs are written
/// there and those objects are returned.  Releases the GIL.
#[pyfunction]
#[pyo3(signature = (base_u, base_w, n, k, t, h, seed, tweak, msg, out_u=None, out_w=None))]
#[allow(clippy::too_many_arguments)]
pub fn ferret_receiver<'py>(
    py: Python<'py>,
    base_u: PyBuffer<u8>,
    base_w: PyBuffer<u8>,
    n: usize,
    k: usize,
    t: usize,
    h: usize,
    seed: PyBuffer<u8>,
    tweak: u64,
    msg: PyBuffer<u8>,
    out_u: Option<Bound<'py, PyAny>>,
    out_w: Option<Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let shape = shape_arg(n, k, t, h)?;
    let (bu, bw, m) = (base_bits_arg(&base_u, &shape)?, base_rows_arg(&base_w, &shape)?, msg_arg(&msg, &shape)?);
    let s = seed_arg(&seed)?;
    match (out_u, out_w) {
        (Some(ou), Some(ow)) => {
            let (bu_, bw_) = (PyBuffer::<u8>::get_bound(&ou)?, PyBuffer::<u8>::get_bound(&ow)?);
            let u = out_bytes(&bu_, n, 1, "out_u")?;
            let w = as_u128s(out_bytes(&bw_, n * 16, 16, "out_w")?);
            py.allow_threads(|| receiver_into(shape, bu, bw, &s, tweak, m, u, w));
            Ok((ou, ow))
        }
        (None, None) => {
            let (u, w) = py.allow_threads(|| receiver(shape, bu, bw, &s, tweak, m));
            Ok((PyByteArray::new_bound(py, &u).into_any(), PyByteArray::new_bound(py, &w).into_any()))
        }
        _ => err("give both out_u and out_w or neither"),
    }
}

fn delta_arg(delta: &PyBuffer<u8>) -> PyResult<u128> {
    let d: [u8; 16] =
        view(delta)?.try_into().map_err(|_| pyo3::exceptions::PyValueError::new_err("Delta must be 16 bytes"))?;
    Ok(u128::from_le_bytes(d))
}

fn base_rows_arg<'a>(base: &'a PyBuffer<u8>, shape: &Shape) -> PyResult<&'a [u8]> {
    let b = view(base)?;
    if b.len() != shape.base() * 16 {
        return err(format!("base COTs: {} bytes, expected {} ({} COTs)", b.len(), shape.base() * 16, shape.base()));
    }
    Ok(b)
}

fn msg_arg<'a>(msg: &'a PyBuffer<u8>, shape: &Shape) -> PyResult<&'a [u8]> {
    let m = view(msg)?;
    if m.len() != shape.msg_len() {
        return err(format!("Ferret message has {} bytes, expected {}", m.len(), shape.msg_len()));
    }
    Ok(m)
}

fn base_bits_arg<'a>(base_u: &'a PyBuffer<u8>, shape: &Shape) -> PyResult<&'a [u8]> {
    let b = view(base_u)?;
    if b.len() != shape.base() {
        return err(format!("base choice bits: {} bytes, expected {}", b.len(), shape.base()));
    }
    if b.iter().any(|&c| c > 1) {
        return err("base choice bits must be 0 or 1");
    }
    Ok(b)
}

/// Ferret iteration in two halves (the sender's message goes out between them):
/// sender, first half.  (delta, base_v, n, k, t, h, first GGM hash tweak, out:
/// writable 16-byte-aligned n*16 bytes) -> the message (t*(32h + 16) bytes);
/// `out` holds the GGM leaves.  Then `ferret_sender_lpn`.  Releases the GIL.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn ferret_sender_trees<'py>(
    py: Python<'py>,
    delta: PyBuffer<u8>,
    base_v: PyBuffer<u8>,
    n: usize,
    k: usize,
    t: usize,
    h: usize,
    tweak: u64,
    out: PyBuffer<u8>,
) -> PyResult<Bound<'py, PyByteArray>> {
    let shape = shape_arg(n, k, t, h)?;
    let delta = delta_arg(&delta)?;
    let bv = base_rows_arg(&base_v, &shape)?;
    let v = as_u128s(out_bytes(&out, n * 16, 16, "out")?);
    let msg = py.allow_threads(|| sender_trees(shape, delta, bv, tweak, v));
    Ok(PyByteArray::new_bound(py, &msg))
}

/// Sender, second half: out ^= the LPN encoding of base_v's first k rows
/// (public seed, 16 bytes).  Releases the GIL.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn ferret_sender_lpn(
    py: Python<'_>,
    base_v: PyBuffer<u8>,
    n: usize,
    k: usize,
    t: usize,
    h: usize,
    seed: PyBuffer<u8>,
    out: PyBuffer<u8>,
) -> PyResult<()> {
    let shape = shape_arg(n, k, t, h)?;
    let bv = base_rows_arg(&base_v, &shape)?;
    let s = seed_arg(&seed)?;
    let v = as_u128s(out_bytes(&out, n * 16, 16, "out")?);
    py.allow_threads(|| sender_lpn(shape, bv, &s, v));
    Ok(())
}

/// Receiver, first half (before the sender's message arrives): (base_u, base_w,
/// n, k, t, h, seed, out_u n bytes, out_w n*16 bytes 16-byte aligned, lsb):
/// writes the LPN encodings of the first k base COTs.  With `lsb` the choice
/// bits travel in the LSB of w (LSB(Delta) = 1, base rows normalised: checked)
/// and out_u is written by `ferret_receiver_trees` (pass the same flag there).
/// Releases the GIL.
#[pyfunction]
#[pyo3(signature = (base_u, base_w, n, k, t, h, seed, out_u, out_w, lsb=false))]
#[allow(clippy::too_many_arguments)]
pub fn ferret_receiver_lpn(
    py: Python<'_>,
    base_u: PyBuffer<u8>,
    base_w: PyBuffer<u8>,
    n: usize,
    k: usize,
    t: usize,
    h: usize,
    seed: PyBuffer<u8>,
    out_u: PyBuffer<u8>,
    out_w: PyBuffer<u8>,
    lsb: bool,
) -> PyResult<()> {
    let shape = shape_arg(n, k, t, h)?;
    let (bu, bw) = (base_bits_arg(&base_u, &shape)?, base_rows_arg(&base_w, &shape)?);
    let s = seed_arg(&seed)?;
    if lsb && !lsb_normalised(&bu[..k], &bw[..k * 16]) {
        return err("lsb mode: the base rows do not carry their choice bits in their LSBs");
    }
    let u = out_bytes(&out_u, n, 1, "out_u")?;
    let w = as_u128s(out_bytes(&out_w, n * 16, 16, "out_w")?);
    py.allow_threads(|| receiver_lpn(shape, bu, bw, &s, u, w, lsb));
    Ok(())
}

/// Receiver, second half: (base_u, base_w, n, k, t, h, tweak, the sender's
/// message, out_u, out_w as filled by `ferret_receiver_lpn`): XORs in the
/// punctured GGM trees (`lsb`: as given to `ferret_receiver_lpn`; then u = the
/// LSBs of w).  Releases the GIL.
#[pyfunction]
#[pyo3(signature = (base_u, base_w, n, k, t, h, tweak, msg, out_u, out_w, lsb=false))]
#[allow(clippy::too_many_arguments)]
pub fn ferret_receiver_trees(
    py: Python<'_>,
    base_u: PyBuffer<u8>,
    base_w: PyBuffer<u8>,
    n: usize,
    k: usize,
    t: usize,
    h: usize,
    tweak: u64,
    msg: PyBuffer<u8>,
    out_u: PyBuffer<u8>,
    out_w: PyBuffer<u8>,
    lsb: bool,
) -> PyResult<()> {
    let shape = shape_arg(n, k, t, h)?;
    let (bu, bw, m) = (base_bits_arg(&base_u, &shape)?, base_rows_arg(&base_w, &shape)?, msg_arg(&msg, &shape)?);
    let u = out_bytes(&out_u, n, 1, "out_u")?;
    let w = as_u128s(out_bytes(&out_w, n * 16, 16, "out_w")?);
    py.allow_threads(|| receiver_trees(shape, bu, bw, tweak, m, u, w, lsb));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    fn rng() -> ChaCha20Rng {
        ChaCha20Rng::from_seed([7u8; 32])
    }

    /// Random base COTs: (delta, u bytes, v rows, w rows) with w = v xor u*delta.
    fn base_cots(r: &mut ChaCha20Rng, m: usize) -> (u128, Vec<u8>, Vec<u8>, Vec<u8>) {
        let mut d = [0u8; 16];
        r.fill_bytes(&mut d);
        let delta = u128::from_le_bytes(d);
        let mut v = vec![0u8; m * 16];
        r.fill_bytes(&mut v);
        let mut ub = vec![0u8; m];
        r.fill_bytes(&mut ub);
        let u: Vec<u8> = ub.iter().map(|x| x & 1).collect();
        let mut w = v.clone();
        for i in 0..m {
            if u[i] == 1 {
                put(&mut w, i, get(&v, i) ^ delta);
            }
        }
        (delta, u, v, w)
    }

    #[test]
    fn ggm_puncture_matches_sender_leaves() {
        let ggm = Ggm::new();
        for h in 1..=9usize {
            for trial in 0..4u8 {
                let mut leaves = vec![0u128; 1 << h];
                let root = 0x1234_5678_9abc_def0_u128 * (trial as u128 + 3) + h as u128;
                let sums = ggm.sender_tree(root, h, &mut leaves);
                // choose the path bits b (off-path side) from the trial number
                let b: Vec<u8> = (0..h).map(|l| ((trial as usize * 5 + l * 3 + h) % 2) as u8).collect();
                let known: Vec<u128> = (0..h).map(|l| if b[l] == 0 { sums[l].0 } else { sums[l].1 }).collect();
                let mut rl = vec![0u128; 1 << h];
                let alpha = ggm.receiver_tree(&known, &b, &mut rl);
                let want: usize = (0..h).fold(0, |a, l| 2 * a + (1 - b[l] as usize));
                assert_eq!(alpha, want);
                for j in 0..(1usize << h) {
                    if j == alpha {
                        assert_eq!(rl[j], 0);
                        assert_ne!(leaves[j], 0);
                    } else {
                        assert_eq!(rl[j], leaves[j], "h={h} leaf {j}");
                    }
                }
                // all leaves distinct (PRG outputs)
                let mut all: Vec<u128> = leaves.clone();
                all.sort();
                all.dedup();
                assert_eq!(all.len(), 1 << h);
            }
        }
    }

    #[test]
    fn ggm_level_sums_are_xors_of_children() {
        let ggm = Ggm::new();
        let h = 5;
        let mut leaves = vec![0u128; 1 << h];
        let sums = ggm.sender_tree(99, h, &mut leaves);
        let (mut e, mut o) = (0u128, 0u128);
        for j in 0..(1usize << h) {
            if j % 2 == 0 {
                e ^= leaves[j]
            } else {
                o ^= leaves[j]
            }
        }
        assert_eq!(sums[h - 1], (e, o));
    }

    fn run(shape: Shape, seed: u8) -> (u128, Vec<u8>, Vec<u8>, Vec<u8>) {
        let mut r = rng();
        let (delta, bu, bv, bw) = base_cots(&mut r, shape.base());
        let s = [seed; 16];
        let (msg, v) = sender(shape, delta, &bv, &s, 1 << 62);
        assert_eq!(msg.len(), shape.msg_len());
        let (u, w) = receiver(shape, &bu, &bw, &s, 1 << 62, &msg);
        (delta, u, v, w)
    }

    #[test]
    fn cot_correlation_holds() {
        let shape = Shape::new(64 << 8, 1000, 64, 8).unwrap();
        let (delta, u, v, w) = run(shape, 3);
        for i in 0..shape.n {
            assert!(u[i] <= 1);
            let want = get(&v, i) ^ if u[i] == 1 { delta } else { 0 };
            assert_eq!(get(&w, i), want, "COT {i}");
        }
        // u is balanced (pseudorandom): 16384 bits, 6 sigma = 384
        let ones: usize = u.iter().map(|&x| x as usize).sum();
        assert!((ones as i64 - (shape.n as i64) / 2).abs() < 384, "ones = {ones}");
    }

    #[test]
    fn lsb_mode_gives_the_bit_gather_result() {
        // LSB(Delta) = 1 and base rows normalised (LSB(v) = 0, LSB(w) = u): the
        // halves in lsb mode give the same u and w as the bit-gather mode, and
        // u is the LSB of w
        let shape = Shape::new(32 << 7, 3000, 32, 7).unwrap();
        let mut r = rng();
        let (mut delta, bu, mut bv, mut bw) = base_cots(&mut r, shape.base());
        delta |= 1;
        for i in 0..shape.base() {
            let v = get(&bv, i) & !1;
            put(&mut bv, i, v);
            put(&mut bw, i, v ^ if bu[i] == 1 { delta } else { 0 });
        }
        assert!(lsb_normalised(&bu, &bw));
        let s = [4u8; 16];
        let (msg, v) = sender(shape, delta, &bv, &s, 9);
        let (u0, w0) = receiver(shape, &bu, &bw, &s, 9, &msg);
        let mut u1 = vec![7u8; shape.n];
        let mut w1 = vec![5u128; shape.n];
        receiver_lpn(shape, &bu, &bw, &s, &mut u1, &mut w1, true);
        receiver_trees(shape, &bu, &bw, 9, &msg, &mut u1, &mut w1, true);
        assert_eq!(u1, u0);
        assert_eq!(u128s_to_bytes(w1.clone()), w0);
        for i in 0..shape.n {
            assert_eq!(get(&v, i) & 1, 0);
            assert_eq!((w1[i] & 1) as u8, u1[i]);
            assert_eq!(w1[i], get(&v, i) ^ if u1[i] == 1 { delta } else { 0 });
        }
        let ones: usize = u1.iter().map(|&x| x as usize).sum();
        assert!((ones as i64 - (shape.n as i64) / 2).abs() < 6 * 32, "ones = {ones}");
    }

    #[test]
    fn mpcot_noise_is_regular_without_lpn_mixing() {
        // With an all-zero base for the LPN part on the receiver side the
        // choice bits are exactly the noise e: one 1 per block of 2^h.
        let shape = Shape::new(16 << 6, 16, 16, 6).unwrap();
        let mut r = rng();
        let (delta, mut bu, bv, mut bw) = base_cots(&mut r, shape.base());
        for i in 0..shape.k {
            if bu[i] == 1 {
                bu[i] = 0;
                put(&mut bw, i, get(&bv, i));
            }
        }
        let s = [1u8; 16];
        let (msg, v) = sender(shape, delta, &bv, &s, 5);
        let (u, w) = receiver(shape, &bu, &bw, &s, 5, &msg);
        for blk in u.chunks_exact(1 << 6) {
            assert_eq!(blk.iter().map(|&x| x as usize).sum::<usize>(), 1);
        }
        for i in 0..shape.n {
            assert_eq!(get(&w, i), get(&v, i) ^ if u[i] == 1 { delta } else { 0 });
        }
    }

    #[test]
    fn wrong_message_or_seed_breaks_correlation() {
        let shape = Shape::new(8 << 5, 64, 8, 5).unwrap();
        let mut r = rng();
        let (delta, bu, bv, bw) = base_cots(&mut r, shape.base());
        let (mut msg, v) = sender(shape, delta, &bv, &[2u8; 16], 0);
        let (u, w) = receiver(shape, &bu, &bw, &[9u8; 16], 0, &msg);
        let bad = (0..shape.n).filter(|&i| get(&w, i) != get(&v, i) ^ if u[i] == 1 { delta } else { 0 }).count();
        assert!(bad > shape.n / 4);
        msg[3] ^= 1;
        let (u, w) = receiver(shape, &bu, &bw, &[2u8; 16], 0, &msg);
        let bad = (0..shape.n).filter(|&i| get(&w, i) != get(&v, i) ^ if u[i] == 1 { delta } else { 0 }).count();
        assert!(bad > 0);
    }

    /// Timing of one iteration at the Ferret paper's main parameters
    /// (`cargo test --release -- --ignored --nocapture ferret_timing`).
    #[test]
    #[ignore]
    fn ferret_timing() {
        for shape in [Shape::new(649_728, 36_288, 1_269, 9).unwrap(), Shape::new(10_805_248, 589_760, 1_319, 13).unwrap()] {
            let mut r = rng();
            let (delta, bu, bv, bw) = base_cots(&mut r, shape.base());
            let s = [5u8; 16];
            let t0 = Cpu::now();
            let (msg, v) = sender(shape, delta, &bv, &s, 0);
            let t1 = t0.elapsed();
            let t0 = Cpu::now();
            let (u, w) = receiver(shape, &bu, &bw, &s, 0, &msg);
            let t2 = t0.elapsed();
            assert_eq!(get(&w, 17), get(&v, 17) ^ if u[17] == 1 { delta } else { 0 });
            println!("{shape:?}: sender {t1}, receiver {t2}, message {} bytes", msg.len());
        }
    }

    #[test]
    fn lpn_indices_in_range_and_spread() {
        let k = 36288;
        let mut idx = vec![0u32; 100_000];
        IndexStream::new(&[4u8; 16], k).fill(&mut idx);
        assert!(idx.iter().all(|&i| (i as usize) < k));
        let mut hist = vec![0usize; 8];
        for &i in &idx {
            hist[i as usize * 8 / k] += 1;
        }
        for c in hist {
            assert!((c as i64 - 12_500).abs() < 600, "{c}");
        }
    }

    // The encoder before the cache-friendly rewrite (commit c9a8031), kept as the
    // reference the new one must match bit for bit.
    /// (reference) Fill `idx` with LPN_D indices in [0, k) per output row, for rows
    /// [row0, row0 + idx.len()/LPN_D), from AES-CTR keyed by the public seed
    /// (64-bit draws reduced by multiply-high: bias < k / 2^64).
    #[allow(dead_code)]
    fn lpn_indices_ref(prg: &mut AesPrg, k: usize, idx: &mut [u32], buf: &mut Vec<u8>) {
        buf.resize(idx.len() * 8, 0);
        prg.fill(buf);
        for (o, c) in idx.iter_mut().zip(buf.chunks_exact(8)) {
            let r = u64::from_le_bytes(c.try_into().unwrap());
            *o = ((r as u128 * k as u128) >> 64) as u32;
        }
    }

    const LPN_ROWS_REF: usize = 4096;

    /// out[i] ^= XOR_j base[idx_ij] for every row i (16-byte entries), and, when
    /// `bits` is given, bits_out[i] ^= XOR_j bits_in[idx_ij].
    pub fn lpn_apply_ref(seed: &[u8; 16], k: usize, base: &[u8], out: &mut [u8], bits: Option<(&[u8], &mut [u8])>) {
        let n = out.len() / 16;
        let mut stream = IndexStream::new(seed, k);
        let mut idx = vec![0u32; LPN_ROWS_REF * LPN_D];
        let basew: Vec<u128> = base[..k * 16].chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap())).collect();
        let (bin, mut bout) = match bits {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        let mut r0 = 0;
        while r0 < n {
            let rows = LPN_ROWS_REF.min(n - r0);
            let ix = &mut idx[..rows * LPN_D];
            stream.fill(ix); // (the old encoder: lpn_indices_ref, 64-bit draws)
            for r in 0..rows {
                let row = &ix[r * LPN_D..(r + 1) * LPN_D];
                let mut acc = 0u128;
                for &j in row {
                    acc ^= basew[j as usize];
                }
                let i = r0 + r;
                put(out, i, get(out, i) ^ acc);
                if let (Some(bi), Some(bo)) = (bin, bout.as_deref_mut()) {
                    let mut x = 0u8;
                    for &j in row {
                        x ^= bi[j as usize];
                    }
                    bo[i] ^= x;
                }
            }
            r0 += rows;
        }
    }


    #[test]
    fn index_stream_is_lemire_with_rejection_and_chunking_invariant() {
        // k close to 2^32 / 3: rejections are frequent enough to be exercised
        let k = 1_431_655_000usize;
        let mut words = vec![0u8; 4 * 3 * INDEX_WORDS];
        AesPrg::new(&[6u8; 16]).fill(&mut words);
        let thr = ((1u64 << 32) % k as u64) as u32;
        let want: Vec<u32> = words
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as u64 * k as u64)
            .filter(|&m| (m as u32) >= thr)
            .map(|m| (m >> 32) as u32)
            .take(2 * INDEX_WORDS)
            .collect();
        assert!(want.len() == 2 * INDEX_WORDS);
        let mut one = vec![0u32; want.len()];
        IndexStream::new(&[6u8; 16], k).fill(&mut one);
        assert_eq!(one, want);
        let mut st = IndexStream::new(&[6u8; 16], k);
        let mut pieces = Vec::new();
        for len in [1usize, 7, 4095, 4096, 10, 3000].iter().cycle() {
            if pieces.len() >= want.len() {
                break;
            }
            let mut p = vec![0u32; (*len).min(want.len() - pieces.len())];
            st.fill(&mut p);
            pieces.extend(p);
        }
        assert_eq!(pieces, want);
    }

    #[test]
    fn lpn_matches_reference_encoder() {
        for (k, n) in [(36_288usize, 20_000usize), (1000, 5003), (589_760, 4096 * 3 + 17)] {
            let mut base = vec![0u8; k * 16];
            AesPrg::new(&[9u8; 16]).fill(&mut base);
            let bits: Vec<u8> = base.iter().take(k).map(|b| b & 1).collect();
            let mut init = vec![0u8; n * 16];
            AesPrg::new(&[8u8; 16]).fill(&mut init);
            let (mut want, mut wbits) = (init.clone(), vec![1u8; n]);
            lpn_apply_ref(&[5u8; 16], k, &base, &mut want, Some((&bits, &mut wbits)));
            let mut got: Vec<u128> = init.chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap())).collect();
            let mut gbits = vec![1u8; n];
            lpn_apply(&[5u8; 16], k, &base, &mut got, Some((&bits, &mut gbits)));
            assert_eq!(u128s_to_bytes(got), want, "k={k} n={n}");
            assert_eq!(gbits, wbits);
            let mut got2: Vec<u128> = init.chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap())).collect();
            lpn_apply(&[5u8; 16], k, &base, &mut got2, None);
            assert_eq!(u128s_to_bytes(got2), want);
        }
    }

    /// Thread CPU time (the machine is shared: wall clock is noisy).
    struct Cpu(f64);
    impl Cpu {
        fn now() -> Cpu {
            #[repr(C)]
            struct Ts {
                s: i64,
                ns: i64,
            }
            extern "C" {
                fn clock_gettime(clk: i32, ts: *mut Ts) -> i32;
            }
            let mut ts = Ts { s: 0, ns: 0 };
            // SAFETY: CLOCK_THREAD_CPUTIME_ID = 3 on Linux; ts is a valid out pointer.
            unsafe { clock_gettime(3, &mut ts) };
            Cpu(ts.s as f64 + ts.ns as f64 * 1e-9)
        }
        fn elapsed(&self) -> String {
            format!("{:.1} ms cpu", (Cpu::now().0 - self.0) * 1e3)
        }
    }

    /// Where the time of one main iteration goes
    /// (`cargo test --release -- --ignored --nocapture ferret_breakdown`).
    #[test]
    #[ignore]
    fn ferret_breakdown() {
        let (n, k, t, h) = (10_805_248usize, 589_760usize, 1_319usize, 13usize);
        let ggm = Ggm::new();
        let mut v = big_u128(n);
        let t0 = Cpu::now();
        for (tau, leaves) in v.chunks_exact_mut(1 << h).enumerate() {
            ggm.sender_tree(tau as u128 * 7919 + 1, h, leaves);
        }
        println!("ggm sender trees: {}", t0.elapsed());
        let t0 = Cpu::now();
        for (tau, leaves) in v.chunks_exact_mut(1 << h).enumerate() {
            ggm.sender_tree(tau as u128 * 7919 + 1, h, leaves);
        }
        println!("ggm sender trees (pages touched): {}", t0.elapsed());
        let mut base = vec![0u8; (k + t * h) * 16];
        AesPrg::new(&[1u8; 16]).fill(&mut base);
        let t0 = Cpu::now();
        let mut prg = AesPrg::new(&[3u8; 16]);
        let mut idx = vec![0u32; LPN_ROWS * LPN_D];
        let mut buf = Vec::new();
        let mut r0 = 0;
        while r0 < n {
            lpn_indices_ref(&mut prg, k, &mut idx, &mut buf);
            r0 += LPN_ROWS;
        }
        println!("lpn indices only, 64-bit draws (before): {}", t0.elapsed());
        let t0 = Cpu::now();
        let mut st = IndexStream::new(&[3u8; 16], k);
        let mut r0 = 0;
        while r0 < n {
            st.fill(&mut idx);
            r0 += LPN_ROWS;
        }
        println!("lpn indices only, 32-bit rejection: {}", t0.elapsed());
        let mut bytes = vec![0u8; 16384];
        let mut prg = AesPrg::new(&[3u8; 16]);
        let t0 = Cpu::now();
        for _ in 0..(n * LPN_D * 4 / 16384) {
            prg.fill(&mut bytes);
        }
        println!("  of which AES-CTR fill of the same bytes: {}", t0.elapsed());
        let t0 = Cpu::now();
        lpn_apply(&[3u8; 16], k, &base, &mut v, None);
        println!("lpn_apply (sender): {}", t0.elapsed());
        let bu: Vec<u8> = (0..k).map(|i| (i % 3 == 0) as u8).collect();
        let mut u = vec![0u8; n];
        let t0 = Cpu::now();
        lpn_apply(&[3u8; 16], k, &base, &mut v, Some((&bu, &mut u)));
        println!("lpn_apply (receiver, with bits): {}", t0.elapsed());
        let mut vb: Vec<u8> = u128s_to_bytes(v);
        let t0 = Cpu::now();
        lpn_apply_ref(&[3u8; 16], k, &base, &mut vb, None);
        println!("reference lpn_apply (sender): {}", t0.elapsed());
        let t0 = Cpu::now();
        lpn_apply_ref(&[3u8; 16], k, &base, &mut vb, Some((&bu, &mut u)));
        println!("reference lpn_apply (receiver): {}", t0.elapsed());
    }
}

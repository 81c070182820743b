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
//!    (indices from AES-CTR on a public seed), plus the MPCOT output:
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

use aes::cipher::{generic_array::GenericArray, BlockEncrypt, KeyInit};
use aes::{Aes128, Block};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use rand_core::{OsRng, RngCore};

use crate::prg::{AesPrg, Tccr};
use crate::util::{err, view};

/// Row weight of the local linear code (Ferret sec. 4 / sec. 6: d = 10).
pub const LPN_D: usize = 10;

/// Fixed public AES keys of the GGM PRG (left and right child).
const GGM_KEY0: [u8; 16] = *b"cipherlm-ggm-L-1";
const GGM_KEY1: [u8; 16] = *b"cipherlm-ggm-R-1";

/// Chunk of parents expanded per AES call (AES-NI pipelining).
const CH: usize = 64;

fn as_blocks(buf: &mut [u8]) -> &mut [Block] {
    assert!(buf.len() % 16 == 0);
    // SAFETY: Block = GenericArray<u8, U16> has the layout of [u8; 16], align 1.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut Block, buf.len() / 16) }
}

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

/// The length-doubling PRG of the GGM tree.
pub struct Ggm {
    p0: Aes128,
    p1: Aes128,
}

impl Ggm {
    pub fn new() -> Self {
        Ggm { p0: Aes128::new(GenericArray::from_slice(&GGM_KEY0)), p1: Aes128::new(GenericArray::from_slice(&GGM_KEY1)) }
    }

    /// Expand level `l` (2^l nodes at the front of `tree`, 16 bytes each) into
    /// level l+1 (2^(l+1) nodes) in place; return (XOR of the even (left)
    /// children, XOR of the odd (right) children).
    pub fn expand_level(&self, tree: &mut [u8], l: usize) -> (u128, u128) {
        let np = 1usize << l;
        let mut a = [0u8; CH * 16];
        let mut b = [0u8; CH * 16];
        let (mut s0, mut s1) = (0u128, 0u128);
        // From the last parents to the first: children [2p, 2p+2) never overwrite
        // a parent that is still to be read (copied to a/b before writing).
        let mut hi = np;
        while hi > 0 {
            let lo = hi.saturating_sub(CH);
            let c = hi - lo;
            a[..c * 16].copy_from_slice(&tree[lo * 16..hi * 16]);
            b[..c * 16].copy_from_slice(&tree[lo * 16..hi * 16]);
            self.p0.encrypt_blocks(as_blocks(&mut a[..c * 16]));
            self.p1.encrypt_blocks(as_blocks(&mut b[..c * 16]));
            for j in (0..c).rev() {
                let s = get(&tree, lo + j);
                let left = get(&a, j) ^ s;
                let right = get(&b, j) ^ s;
                s0 ^= left;
                s1 ^= right;
                put(tree, 2 * (lo + j), left);
                put(tree, 2 * (lo + j) + 1, right);
            }
            hi = lo;
        }
        (s0, s1)
    }

    /// Sender: full tree of depth h from `root` into `leaves` (2^h * 16 bytes);
    /// returns the level sums [(K_0^l, K_1^l) for l in 0..h].
    pub fn sender_tree(&self, root: u128, h: usize, leaves: &mut [u8]) -> Vec<(u128, u128)> {
        debug_assert_eq!(leaves.len(), 16 << h);
        put(leaves, 0, root);
        (0..h).map(|l| self.expand_level(leaves, l)).collect()
    }

    /// Receiver: given the sums K_{b_l}^l of the off-path side of every level
    /// (b_l = the receiver's base choice bit of level l), rebuild every leaf
    /// except the punctured one, which is left 0.  Returns alpha, the
    /// punctured leaf index (bit l of the path, MSB first, is 1 - b_l).
    pub fn receiver_tree(&self, known: &[u128], b: &[u8], leaves: &mut [u8]) -> usize {
        let h = known.len();
        debug_assert_eq!(leaves.len(), 16 << h);
        // level 1: the off-path child is exactly K_{b_0}^0.
        let mut p = 1 - b[0] as usize; // path node at level 1
        put(leaves, b[0] as usize, known[0]);
        put(leaves, p, 0);
        for l in 1..h {
            let (s0, s1) = self.expand_level(leaves, l);
            let bl = b[l] as usize;
            let sib = 2 * p + bl; // off-path child of the path node
            let garbage = get(leaves, sib);
            let side = if bl == 0 { s0 } else { s1 };
            // side includes the garbage child of the placeholder: remove it.
            put(leaves, sib, known[l] ^ side ^ garbage);
            p = 2 * p + (1 - bl);
            put(leaves, p, 0);
        }
        p
    }
}

/// Fill `idx` with LPN_D indices in [0, k) per output row, for rows
/// [row0, row0 + idx.len()/LPN_D), from AES-CTR keyed by the public seed
/// (64-bit draws reduced by multiply-high: bias < k / 2^64).
fn lpn_indices(prg: &mut AesPrg, k: usize, idx: &mut [u32], buf: &mut Vec<u8>) {
    buf.resize(idx.len() * 8, 0);
    prg.fill(buf);
    for (o, c) in idx.iter_mut().zip(buf.chunks_exact(8)) {
        let r = u64::from_le_bytes(c.try_into().unwrap());
        *o = ((r as u128 * k as u128) >> 64) as u32;
    }
}

const LPN_ROWS: usize = 4096; // rows per index batch

/// out[i] ^= XOR_j base[idx_ij] for every row i (16-byte entries), and, when
/// `bits` is given, bits_out[i] ^= XOR_j bits_in[idx_ij].
pub fn lpn_apply(seed: &[u8; 16], k: usize, base: &[u8], out: &mut [u8], bits: Option<(&[u8], &mut [u8])>) {
    let n = out.len() / 16;
    let mut prg = AesPrg::new(seed);
    let mut idx = vec![0u32; LPN_ROWS * LPN_D];
    let mut buf = Vec::new();
    let basew: Vec<u128> = base[..k * 16].chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap())).collect();
    let (bin, mut bout) = match bits {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    let mut r0 = 0;
    while r0 < n {
        let rows = LPN_ROWS.min(n - r0);
        let ix = &mut idx[..rows * LPN_D];
        lpn_indices(&mut prg, k, ix, &mut buf);
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

/// Sender side of one iteration.  `base_v`: base COTs (k + t*h rows of 16
/// bytes: first k for the LPN code, then h per tree).  Returns (message for the
/// receiver, v: n rows of 16 bytes).  Tree roots come from the OS CSPRNG.
pub fn sender(shape: Shape, delta: u128, base_v: &[u8], seed: &[u8; 16], tweak: u64) -> (Vec<u8>, Vec<u8>) {
    let Shape { n, k, t, h } = shape;
    let ggm = Ggm::new();
    let tccr = Tccr::new();
    let mut v = vec![0u8; n * 16];
    let mut msg = vec![0u8; shape.msg_len()];
    let mut roots = vec![0u8; t * 16];
    OsRng.fill_bytes(&mut roots);
    let tree_len = 16usize << h;
    let mut pads = vec![0u8; 2 * h * 16];
    for (tau, leaves) in v.chunks_exact_mut(tree_len).enumerate() {
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
        let mut total = delta;
        for j in 0..(1usize << h) {
            total ^= get(leaves, j);
        }
        put(m, 2 * h, total);
    }
    lpn_apply(seed, k, base_v, &mut v, None);
    (msg, v)
}

/// Receiver side of one iteration.  `base_u`: k + t*h choice bits (one byte
/// each, 0/1), `base_w`: the matching rows w = v xor u*Delta.  Returns
/// (u: n choice bytes 0/1, w: n rows of 16 bytes).
pub fn receiver(shape: Shape, base_u: &[u8], base_w: &[u8], seed: &[u8; 16], tweak: u64, msg: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let Shape { n, k, h, .. } = shape;
    let ggm = Ggm::new();
    let tccr = Tccr::new();
    let mut w = vec![0u8; n * 16];
    let mut u = vec![0u8; n];
    let tree_len = 16usize << h;
    let mut pads = vec![0u8; h * 16];
    let mut known = vec![0u128; h];
    for (tau, leaves) in w.chunks_exact_mut(tree_len).enumerate() {
        let b = &base_u[k + tau * h..k + (tau + 1) * h];
        pads.copy_from_slice(&base_w[(k + tau * h) * 16..(k + (tau + 1) * h) * 16]);
        tccr.hash_in_place(&mut pads, tweak.wrapping_add((tau * h) as u64));
        let m = &msg[tau * (h * 32 + 16)..(tau + 1) * (h * 32 + 16)];
        for l in 0..h {
            known[l] = get(m, 2 * l + b[l] as usize) ^ get(&pads, l);
        }
        let alpha = ggm.receiver_tree(&known, b, leaves);
        let mut acc = get(m, 2 * h);
        for j in 0..(1usize << h) {
            acc ^= get(leaves, j); // the punctured leaf is 0 here
        }
        put(leaves, alpha, acc); // = v_alpha xor Delta
        u[(tau << h) + alpha] = 1;
    }
    lpn_apply(seed, k, base_w, &mut w, Some((&base_u[..k], &mut u)));
    (u, w)
}

fn shape_arg(n: usize, k: usize, t: usize, h: usize) -> PyResult<Shape> {
    Shape::new(n, k, t, h).map_err(pyo3::exceptions::PyValueError::new_err)
}

fn seed_arg(seed: &PyBuffer<u8>) -> PyResult<[u8; 16]> {
    view(seed)?.try_into().map_err(|_| pyo3::exceptions::PyValueError::new_err("LPN seed must be 16 bytes"))
}

/// Ferret iteration, sender (Delta holder): (delta 16 bytes, base_v
/// (k + t*h) * 16 bytes, n, k, t, h, public LPN seed 16 bytes, first GGM hash
/// tweak) -> (message t*(32h + 16) bytes, v n*16 bytes).  Releases the GIL.
#[pyfunction]
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
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let shape = shape_arg(n, k, t, h)?;
    let d: [u8; 16] =
        view(&delta)?.try_into().map_err(|_| pyo3::exceptions::PyValueError::new_err("Delta must be 16 bytes"))?;
    let bv = view(&base_v)?;
    if bv.len() != shape.base() * 16 {
        return err(format!("base COTs: {} bytes, expected {} ({} COTs)", bv.len(), shape.base() * 16, shape.base()));
    }
    let s = seed_arg(&seed)?;
    let (msg, v) = py.allow_threads(|| sender(shape, u128::from_le_bytes(d), bv, &s, tweak));
    Ok((PyByteArray::new_bound(py, &msg), PyByteArray::new_bound(py, &v)))
}

/// Ferret iteration, receiver: (base_u (k + t*h) bytes 0/1, base_w
/// (k + t*h) * 16 bytes, n, k, t, h, seed, tweak, the sender's message) ->
/// (u n bytes 0/1, w n*16 bytes).  Releases the GIL.
#[pyfunction]
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
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let shape = shape_arg(n, k, t, h)?;
    let (bu, bw, m) = (view(&base_u)?, view(&base_w)?, view(&msg)?);
    if bu.len() != shape.base() || bw.len() != shape.base() * 16 {
        return err(format!(
            "base COTs: {} choice bytes and {} bytes of rows, expected {} and {}",
            bu.len(),
            bw.len(),
            shape.base(),
            shape.base() * 16
        ));
    }
    if bu.iter().any(|&c| c > 1) {
        return err("base choice bits must be 0 or 1");
    }
    if m.len() != shape.msg_len() {
        return err(format!("Ferret message has {} bytes, expected {}", m.len(), shape.msg_len()));
    }
    let s = seed_arg(&seed)?;
    let (u, w) = py.allow_threads(|| receiver(shape, bu, bw, &s, tweak, m));
    Ok((PyByteArray::new_bound(py, &u), PyByteArray::new_bound(py, &w)))
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
                let mut leaves = vec![0u8; 16 << h];
                let root = 0x1234_5678_9abc_def0_u128 * (trial as u128 + 3) + h as u128;
                let sums = ggm.sender_tree(root, h, &mut leaves);
                // choose the path bits b (off-path side) from the trial number
                let b: Vec<u8> = (0..h).map(|l| ((trial as usize * 5 + l * 3 + h) % 2) as u8).collect();
                let known: Vec<u128> = (0..h).map(|l| if b[l] == 0 { sums[l].0 } else { sums[l].1 }).collect();
                let mut rl = vec![0u8; 16 << h];
                let alpha = ggm.receiver_tree(&known, &b, &mut rl);
                let want: usize = (0..h).fold(0, |a, l| 2 * a + (1 - b[l] as usize));
                assert_eq!(alpha, want);
                for j in 0..(1usize << h) {
                    if j == alpha {
                        assert_eq!(get(&rl, j), 0);
                        assert_ne!(get(&leaves, j), 0);
                    } else {
                        assert_eq!(get(&rl, j), get(&leaves, j), "h={h} leaf {j}");
                    }
                }
                // all leaves distinct (PRG outputs)
                let mut all: Vec<u128> = (0..(1usize << h)).map(|j| get(&leaves, j)).collect();
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
        let mut leaves = vec![0u8; 16 << h];
        let sums = ggm.sender_tree(99, h, &mut leaves);
        let (mut e, mut o) = (0u128, 0u128);
        for j in 0..(1usize << h) {
            if j % 2 == 0 {
                e ^= get(&leaves, j)
            } else {
                o ^= get(&leaves, j)
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
            let t0 = std::time::Instant::now();
            let (msg, v) = sender(shape, delta, &bv, &s, 0);
            let t1 = t0.elapsed();
            let t0 = std::time::Instant::now();
            let (u, w) = receiver(shape, &bu, &bw, &s, 0, &msg);
            let t2 = t0.elapsed();
            assert_eq!(get(&w, 17), get(&v, 17) ^ if u[17] == 1 { delta } else { 0 });
            println!("{shape:?}: sender {t1:?}, receiver {t2:?}, message {} bytes", msg.len());
        }
    }

    #[test]
    fn lpn_indices_in_range_and_spread() {
        let mut prg = AesPrg::new(&[4u8; 16]);
        let k = 36288;
        let mut idx = vec![0u32; 100_000];
        let mut buf = Vec::new();
        lpn_indices(&mut prg, k, &mut idx, &mut buf);
        assert!(idx.iter().all(|&i| (i as usize) < k));
        let mut hist = vec![0usize; 8];
        for &i in &idx {
            hist[i as usize * 8 / k] += 1;
        }
        for c in hist {
            assert!((c as i64 - 12_500).abs() < 600, "{c}");
        }
    }
}

//! The negacyclic number-theoretic transform of Z_q[X]/(X^N + 1), in SEAL's convention, so that
//! arrays transformed here and ciphertexts SEAL put in NTT form can be mixed (tested against
//! SEAL's `transform_to_ntt` in tests/test_linear_2pc.py).
//!
//! SEAL (`util/ntt.cpp`) takes psi = the smallest primitive 2N-th root of unity mod q and
//! evaluates at psi^(2 bitrev(i) + 1), output in bit-reversed order: a Cooley-Tukey forward
//! pass with the powers psi^bitrev(k) and a Gentleman-Sande inverse pass with psi^-bitrev(k),
//! then a scaling by N^-1 (Longa and Naehrig 2016, algorithms 1 and 2).  Products by the
//! fixed roots use Shoup's precomputed quotients (w' = floor(w 2^64 / q)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

#[inline(always)]
pub fn mulmod(a: u64, b: u64, q: u64) -> u64 {
    ((a as u128 * b as u128) % q as u128) as u64
}

pub fn powmod(mut b: u64, mut e: u64, q: u64) -> u64 {
    let mut r = 1u64;
    b %= q;
    while e > 0 {
        if e & 1 == 1 {
            r = mulmod(r, b, q);
        }
        b = mulmod(b, b, q);
        e >>= 1;
    }
    r
}

/// The tables for (q, N), built once per process and shared (building them costs about as much
/// as a hundred transforms).
pub fn cached_tables(q: u64, n: usize) -> Result<Arc<NttTables>, String> {
    static CACHE: OnceLock<Mutex<HashMap<(u64, usize), Arc<NttTables>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(t) = cache.lock().unwrap().get(&(q, n)) {
        return Ok(t.clone());
    }
    let t = Arc::new(NttTables::new(q, n)?);
    cache.lock().unwrap().insert((q, n), t.clone());
    Ok(t)
}

/// x mod q for x < 2q (q < 2^63), without a branch.
#[inline(always)]
pub fn reduce_once(x: u64, q: u64) -> u64 {
    let d = x.wrapping_sub(q);
    d.wrapping_add(q & 0u64.wrapping_sub(d >> 63))
}

/// (a + b) mod q for a, b < q < 2^62.
#[inline(always)]
pub fn add_mod(a: u64, b: u64, q: u64) -> u64 {
    reduce_once(a + b, q)
}

/// (a - b) mod q for a, b < q < 2^62.
#[inline(always)]
pub fn sub_mod(a: u64, b: u64, q: u64) -> u64 {
    let d = a.wrapping_sub(b);
    d.wrapping_add(q & 0u64.wrapping_sub(d >> 63))
}

/// A constant w with its Shoup quotient floor(w 2^64 / q).
#[derive(Clone, Copy)]
pub struct Shoup {
    w: u64,
    wq: u64,
}

impl Shoup {
    pub fn new(w: u64, q: u64) -> Self {
        Shoup { w, wq: (((w as u128) << 64) / q as u128) as u64 }
    }

    /// x w mod q, in [0, 2q), for any 64-bit x (Shoup: the quotient estimate is off by at
    /// most one).
    #[inline(always)]
    pub fn mul_lazy(self, x: u64, q: u64) -> u64 {
        let hi = ((x as u128 * self.wq as u128) >> 64) as u64;
        x.wrapping_mul(self.w).wrapping_sub(hi.wrapping_mul(q))
    }

    /// x w mod q, in [0, q).
    #[inline(always)]
    pub fn mul(self, x: u64, q: u64) -> u64 {
        reduce_once(self.mul_lazy(x, q), q)
    }
}

/// x mod q for any 128-bit x, with r = floor(2^128 / q) precomputed (q odd, 2 < q < 2^63).
///
/// The quotient estimate drops the low partial product's carries, so it is at most the true
/// quotient and short of it by a small constant: x - q_hat q is computed modulo 2^64 (exact,
/// since the true difference is below 2^64) and corrected by conditional subtractions.
#[derive(Clone, Copy)]
pub struct Barrett128 {
    q: u64,
    r_lo: u64,
    r_hi: u64,
}

impl Barrett128 {
    pub fn new(q: u64) -> Self {
        // floor(2^128 / q) = floor((2^128 - 1) / q) for q not a power of two
        let r = u128::MAX / q as u128;
        Barrett128 { q, r_lo: r as u64, r_hi: (r >> 64) as u64 }
    }

    /// a b mod q.
    #[inline(always)]
    pub fn mul(&self, a: u64, b: u64) -> u64 {
        self.reduce(a as u128 * b as u128)
    }

    #[inline(always)]
    pub fn reduce(&self, x: u128) -> u64 {
        let (x_lo, x_hi) = (x as u64, (x >> 64) as u64);
        // q_hat = floor(x r / 2^128), dropping the low word of x_lo r_lo
        let t = (x_lo as u128 * self.r_lo as u128) >> 64;
        let mid1 = x_lo as u128 * self.r_hi as u128;
        let mid2 = x_hi as u128 * self.r_lo as u128;
        let mid = (mid1 as u64 as u128) + (mid2 as u64 as u128) + t;
        let q_hat = (x_hi as u128 * self.r_hi as u128)
            .wrapping_add(mid1 >> 64)
            .wrapping_add(mid2 >> 64)
            .wrapping_add(mid >> 64) as u64;
        let mut rem = x_lo.wrapping_sub(q_hat.wrapping_mul(self.q));
        while rem >= self.q {
            rem -= self.q;
        }
        rem
    }
}

/// Whether every row of `v` (rows of `len`, row r taken mod moduli[r % k]) is reduced: the check
/// the kernels run on residues that arrive from the peer.
pub fn residues_reduced(v: &[u64], len: usize, moduli: &[u64]) -> bool {
    len == 0 || v.chunks_exact(len).enumerate().all(|(r, row)| row.iter().all(|&x| x < moduli[r % moduli.len()]))
}

/// A plaintext value m < t scaled to round(q m / t) mod each prime q_j, as SEAL's BFV encoding
/// does: Delta m + floor(((q mod t) m + floor((t + 1) / 2)) / t), Delta = floor(q / t).
pub struct ScaleUp {
    delta: Vec<u64>,
    q_mod_t: u64,
    t: u64,
    red: Vec<Barrett128>,
}

impl ScaleUp {
    /// `delta[j]` = floor(q / t) mod q_j, `q_mod_t` = q mod t.
    pub fn new(moduli: &[u64], delta: Vec<u64>, q_mod_t: u64, t: u64) -> Self {
        ScaleUp { delta, q_mod_t, t, red: moduli.iter().map(|&q| Barrett128::new(q)).collect() }
    }

    /// The part of round(q m / t) beyond Delta m (the same for every prime).
    #[inline(always)]
    pub fn fix(&self, m: u64) -> u64 {
        ((self.q_mod_t as u128 * m as u128 + (self.t as u128 + 1) / 2) / self.t as u128) as u64
    }

    /// round(q m / t) mod q_j, given `fix(m)`.
    #[inline(always)]
    pub fn at(&self, m: u64, fix: u64, j: usize, q: u64) -> u64 {
        add_mod(self.red[j].mul(self.delta[j], m % q), fix % q, q)
    }
}

fn bitrev(x: usize, bits: u32) -> usize {
    if bits == 0 {
        0
    } else {
        x.reverse_bits() >> (usize::BITS - bits)
    }
}

/// Transform tables for one prime q = 1 mod 2N (N a power of two).
pub struct NttTables {
    pub q: u64,
    n: usize,
    roots: Vec<Shoup>,     // psi^bitrev(k)
    inv_roots: Vec<Shoup>, // psi^-bitrev(k)
    inv_n: Shoup,
}

impl NttTables {
    pub fn new(q: u64, n: usize) -> Result<Self, String> {
        if n < 2 || !n.is_power_of_two() || q >> 62 != 0 || q % (2 * n as u64) != 1 {
            return Err(format!("NTT needs N a power of two and a prime q = 1 mod 2N below 2^62 (q = {q}, N = {n})"));
        }
        let psi = minimal_primitive_root(q, 2 * n as u64)
            .ok_or_else(|| format!("{q} has no primitive {}-th root of unity", 2 * n))?;
        let psi_inv = powmod(psi, q - 2, q);
        let bits = n.trailing_zeros();
        let (mut roots, mut inv_roots) = (vec![Shoup::new(1, q); n], vec![Shoup::new(1, q); n]);
        let (mut p, mut pi) = (1u64, 1u64);
        let mut pow = vec![0u64; n];
        let mut ipow = vec![0u64; n];
        for k in 0..n {
            pow[k] = p;
            ipow[k] = pi;
            p = mulmod(p, psi, q);
            pi = mulmod(pi, psi_inv, q);
        }
        for k in 0..n {
            roots[k] = Shoup::new(pow[bitrev(k, bits)], q);
            inv_roots[k] = Shoup::new(ipow[bitrev(k, bits)], q);
        }
        let inv_n = Shoup::new(powmod(n as u64, q - 2, q), q);
        Ok(NttTables { q, n, roots, inv_roots, inv_n })
    }

    /// In place: coefficients (each < q) -> NTT form (each < q).  Harvey's lazy butterflies:
    /// values stay in [0, 4q) between stages (q < 2^62), one correction at the end.
    pub fn forward(&self, a: &mut [u64]) {
        let (q, n) = (self.q, self.n);
        let two_q = 2 * q;
        let mut t = n;
        let mut m = 1;
        while m < n {
            t >>= 1;
            for i in 0..m {
                let s = self.roots[m + i];
                let (lo, hi) = a[2 * i * t..2 * i * t + 2 * t].split_at_mut(t);
                for (x, y) in lo.iter_mut().zip(hi.iter_mut()) {
                    let u = reduce_once(*x, two_q); // [0, 2q)
                    let v = s.mul_lazy(*y, q); // [0, 2q)
                    *x = u + v;
                    *y = u + two_q - v;
                }
            }
            m <<= 1;
        }
        for x in a.iter_mut() {
            *x = reduce_once(reduce_once(*x, two_q), q);
        }
    }

    /// In place: NTT form (each < q) -> coefficients (each < q); lazy as `forward`, values in
    /// [0, 2q) between stages.
    pub fn inverse(&self, a: &mut [u64]) {
        let (q, n) = (self.q, self.n);
        let two_q = 2 * q;
        let mut t = 1;
        let mut m = n >> 1;
        while m >= 1 {
            for i in 0..m {
                let s = self.inv_roots[m + i];
                let (lo, hi) = a[2 * i * t..2 * i * t + 2 * t].split_at_mut(t);
                for (x, y) in lo.iter_mut().zip(hi.iter_mut()) {
                    let (u, v) = (*x, *y);
                    *x = reduce_once(u + v, two_q);
                    *y = s.mul_lazy(u + two_q - v, q);
                }
            }
            t <<= 1;
            m >>= 1;
        }
        for x in a.iter_mut() {
            *x = self.inv_n.mul(reduce_once(*x, two_q), q);
        }
    }
}

/// The smallest primitive `order`-th root of unity mod the prime q (order a power of two
/// dividing q - 1), as SEAL's `try_minimal_primitive_root` picks it.
fn minimal_primitive_root(q: u64, order: u64) -> Option<u64> {
    let cofactor = (q - 1) / order;
    // a primitive root of that order: g^((q-1)/order) with g^((q-1)/2) = -1 (a non-residue)
    let root = (2..q.min(1 << 20)).map(|g| powmod(g, cofactor, q)).find(|&r| powmod(r, order / 2, q) == q - 1)?;
    // every primitive order-th root is root^k for odd k
    let step = mulmod(root, root, q);
    let mut cur = root;
    let mut best = root;
    for _ in 0..order / 2 {
        best = best.min(cur);
        cur = mulmod(cur, step, q);
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[u64], q: u64, psi: u64) -> Vec<u64> {
        // a(psi^(2 bitrev(i) + 1)) for i in 0..n
        let n = a.len();
        let bits = n.trailing_zeros();
        (0..n)
            .map(|i| {
                let x = powmod(psi, 2 * bitrev(i, bits) as u64 + 1, q);
                a.iter().rev().fold(0u64, |acc, &c| (mulmod(acc, x, q) + c) % q)
            })
            .collect()
    }

    #[test]
    fn forward_is_evaluation_at_odd_powers_and_inverse_undoes_it() {
        for &(q, n) in &[(1152921504606830593u64, 16usize), (12289, 64), (1152921504606748673, 32)] {
            let t = NttTables::new(q, n).unwrap();
            let psi = minimal_primitive_root(q, 2 * n as u64).unwrap();
            assert_eq!(powmod(psi, n as u64, q), q - 1);
            let a: Vec<u64> = (0..n as u64).map(|i| (i * 0x9e3779b97f4a7c15u64.wrapping_mul(i + 1)) % q).collect();
            let mut b = a.clone();
            t.forward(&mut b);
            assert_eq!(b, naive(&a, q, psi));
            t.inverse(&mut b);
            assert_eq!(b, a);
        }
    }
}

//! Base OT: the "simplest OT" of Chou and Orlandi (LATINCRYPT 2015, figure 1)
//! over the Ristretto group of curve25519 (`curve25519-dalek`), many OTs in
//! parallel sharing the sender's first message.
//!
//! Sender: a <- Z_l, A = a*G.  Receiver (choice c_i): b_i <- Z_l,
//! B_i = b_i*G + c_i*A, key k_i = H(A, B_i, i, b_i*A).
//! Sender: k0_i = H(A, B_i, i, a*B_i), k1_i = H(A, B_i, i, a*(B_i - A)).
//! H is SHA-256 truncated to 128 bits (the keys seed AES-CTR PRGs).
//! Semi-honest security; each instance uses a fresh a (the known UC issue of
//! simplest OT concerns malicious receivers and is out of scope here).  The
//! receiver's B_i is uniform in the group whatever c_i is, which is what makes
//! the sender's view independent of the choices.

use curve25519_dalek::ristretto::{CompressedRistretto, RistrettoPoint};
use curve25519_dalek::scalar::Scalar;
use rand_core::OsRng;
use sha2::{Digest, Sha256};

pub const POINT: usize = 32;

fn kdf(a: &[u8; 32], b: &[u8; 32], i: u64, p: &RistrettoPoint) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(b"cipherlm CO15 base OT v1");
    h.update(a);
    h.update(b);
    h.update(i.to_le_bytes());
    h.update(p.compress().as_bytes());
    let d = h.finalize();
    let mut k = [0u8; 16];
    k.copy_from_slice(&d[..16]);
    k
}

pub fn decode_point(bytes: &[u8]) -> Result<RistrettoPoint, String> {
    let c = CompressedRistretto::from_slice(bytes).map_err(|_| "a group element must be 32 bytes".to_string())?;
    let p = c.decompress().ok_or_else(|| "not a valid Ristretto point encoding".to_string())?;
    if p == RistrettoPoint::default() {
        return Err("the identity is not a valid base-OT message".into());
    }
    Ok(p)
}

/// Sender, first message: (secret a (32 bytes), A (32 bytes)).
pub fn sender_init() -> ([u8; 32], [u8; 32]) {
    let a = Scalar::random(&mut OsRng);
    let big_a = RistrettoPoint::mul_base(&a);
    (a.to_bytes(), big_a.compress().to_bytes())
}

/// Receiver: from A and choices (one byte 0/1 each) -> (B_1..B_n, k_1..k_n).
pub fn receiver(a_bytes: &[u8], choices: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let big_a = decode_point(a_bytes)?;
    let a_arr: [u8; 32] = a_bytes.try_into().unwrap();
    let mut bs = Vec::with_capacity(choices.len() * POINT);
    let mut keys = Vec::with_capacity(choices.len() * 16);
    for (i, &c) in choices.iter().enumerate() {
        if c > 1 {
            return Err("base-OT choices must be 0 or 1".into());
        }
        let b = Scalar::random(&mut OsRng);
        let mut big_b = RistrettoPoint::mul_base(&b);
        if c == 1 {
            big_b += big_a;
        }
        let bb = big_b.compress().to_bytes();
        keys.extend_from_slice(&kdf(&a_arr, &bb, i as u64, &(b * big_a)));
        bs.extend_from_slice(&bb);
    }
    Ok((bs, keys))
}

/// Sender, keys: from a, A and the receiver's B_i -> (k0 (n*16), k1 (n*16)).
pub fn sender_keys(a: &[u8], a_bytes: &[u8], bs: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let a_arr: [u8; 32] = a.try_into().map_err(|_| "secret must be 32 bytes".to_string())?;
    let s = Option::<Scalar>::from(Scalar::from_canonical_bytes(a_arr)).ok_or("bad secret scalar")?;
    let big_a = decode_point(a_bytes)?;
    let aa: [u8; 32] = a_bytes.try_into().unwrap();
    if bs.len() % POINT != 0 {
        return Err(format!("base-OT reply has {} bytes, not a multiple of 32", bs.len()));
    }
    let n = bs.len() / POINT;
    let sa = s * big_a;
    let mut k0 = Vec::with_capacity(n * 16);
    let mut k1 = Vec::with_capacity(n * 16);
    for i in 0..n {
        let bb: [u8; 32] = bs[i * POINT..(i + 1) * POINT].try_into().unwrap();
        let big_b = decode_point(&bb)?;
        let p0 = s * big_b;
        let p1 = p0 - sa;
        k0.extend_from_slice(&kdf(&aa, &bb, i as u64, &p0));
        k1.extend_from_slice(&kdf(&aa, &bb, i as u64, &p1));
    }
    Ok((k0, k1))
}

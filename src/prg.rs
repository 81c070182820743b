//! PRG and correlation-robust hashing from fixed-key / seeded AES-128.
//!
//! * `AesPrg`: AES-128 in counter mode keyed by a 128-bit seed (the PRG G of
//!   IKNP03 / ALSZ13 that stretches each base-OT key into a column).  The `aes`
//!   crate selects AES-NI at run time when the CPU has it.
//! * `Tccr`: the tweakable circular correlation-robust hash of Guo, Katz,
//!   Wang, Yu (IEEE S&P 2020, section 7.4) from one fixed-key permutation pi:
//!   H(i, x) = pi(pi(x) xor i) xor pi(x).  This replaces the random oracle of
//!   IKNP03 as ALSZ13 section 4 suggests (fixed-key AES hashing), with the
//!   tweak i = the global index of the OT so every OT uses a fresh tweak.

use aes::cipher::{generic_array::GenericArray, BlockEncrypt, KeyInit};
use aes::{Aes128, Block};

use crate::aesni::AesBatch;

pub struct AesPrg {
    cipher: Aes128,
    ctr: u128,
}

const CHUNK: usize = 64; // blocks per encrypt_blocks call (lets AES-NI pipeline)

fn as_blocks(buf: &mut [u8]) -> &mut [Block] {
    assert!(buf.len() % 16 == 0);
    // SAFETY: Block = GenericArray<u8, U16> has the layout of [u8; 16], align 1.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut Block, buf.len() / 16) }
}

impl AesPrg {
    pub fn new(seed: &[u8; 16]) -> Self {
        AesPrg { cipher: Aes128::new(GenericArray::from_slice(seed)), ctr: 0 }
    }

    /// Fill `out` with the next ceil(len/16) blocks of the stream (a partial
    /// last block is discarded, so both parties stay in step as long as they
    /// ask for the same lengths).
    pub fn fill(&mut self, out: &mut [u8]) {
        let full = out.len() / 16 * 16;
        let (head, tail) = out.split_at_mut(full);
        for chunk in head.chunks_mut(CHUNK * 16) {
            for b in chunk.chunks_exact_mut(16) {
                b.copy_from_slice(&self.ctr.to_le_bytes());
                self.ctr += 1;
            }
            self.cipher.encrypt_blocks(as_blocks(chunk));
        }
        if !tail.is_empty() {
            let mut blk = Block::clone_from_slice(&self.ctr.to_le_bytes());
            self.ctr += 1;
            self.cipher.encrypt_block(&mut blk);
            tail.copy_from_slice(&blk[..tail.len()]);
        }
    }
}

/// Fixed, public AES key of the hash (the first 16 bytes of SHA-256("cipherlm fixed-key AES")
/// would do as well; any fixed public key is fine for the ideal-cipher assumption).
const FIXED_KEY: [u8; 16] = [
    0x63, 0x69, 0x70, 0x68, 0x65, 0x72, 0x6c, 0x6d, 0x2d, 0x74, 0x63, 0x63, 0x72, 0x2d, 0x76, 0x31,
];

pub struct Tccr {
    pi: AesBatch,
}

#[inline]
fn rd(b: &[u8]) -> u128 {
    u128::from_le_bytes(b.try_into().unwrap())
}

impl Tccr {
    pub fn new() -> Self {
        Tccr { pi: AesBatch::new(&FIXED_KEY) }
    }

    /// Hash `xs` (n blocks of 16 bytes) in place: xs[j] <- H(tweak0 + j, xs[j]).
    pub fn hash_in_place(&self, xs: &mut [u8], tweak0: u64) {
        let mut y = [0u128; CHUNK];
        let mut z = [0u128; CHUNK];
        let mut base = 0usize;
        for chunk in xs.chunks_mut(CHUNK * 16) {
            let nb = chunk.len() / 16;
            for (o, c) in y[..nb].iter_mut().zip(chunk.chunks_exact(16)) {
                *o = rd(c);
            }
            self.pi.encrypt(&mut y[..nb]); // y = pi(x)
            for k in 0..nb {
                z[k] = y[k] ^ (tweak0 as u128).wrapping_add((base + k) as u128);
            }
            self.pi.encrypt(&mut z[..nb]); // pi(y xor i)
            for (k, c) in chunk.chunks_exact_mut(16).enumerate() {
                c.copy_from_slice(&(y[k] ^ z[k]).to_le_bytes());
            }
            base += nb;
        }
    }

    /// out[j] = low 64 bits of H(tweak0 + j, rows[j] xor xor) AND mask, for every
    /// 16-byte row; no heap allocation (works through L1-sized chunks).
    pub fn hash_low64(&self, rows: &[u8], xor: u128, tweak0: u64, mask: u64, out: &mut [u64]) {
        let n = rows.len() / 16;
        debug_assert_eq!(out.len(), n);
        let mut y = [0u128; CHUNK];
        let mut z = [0u128; CHUNK];
        let mut j0 = 0usize;
        while j0 < n {
            let nb = CHUNK.min(n - j0);
            for (k, c) in rows[j0 * 16..(j0 + nb) * 16].chunks_exact(16).enumerate() {
                y[k] = rd(c) ^ xor;
            }
            self.pi.encrypt(&mut y[..nb]);
            for k in 0..nb {
                z[k] = y[k] ^ (tweak0 as u128).wrapping_add((j0 + k) as u128);
            }
            self.pi.encrypt(&mut z[..nb]);
            for k in 0..nb {
                out[j0 + k] = ((y[k] ^ z[k]) as u64) & mask;
            }
            j0 += nb;
        }
    }

    /// pi applied in place to every u128 (the fixed-key permutation; u128 values
    /// are the little-endian AES blocks).
    pub fn pi_u128(&self, xs: &mut [u128]) {
        self.pi.encrypt(xs);
    }
}

//! PRG and correlation-robust hashing from fixed-key / seeded AES-128.
//!
//! * `AesPrg`: AES-128 in counter mode keyed by a 128-bit seed (the PRG G of
//!   IKNP03 / ALSZ13 that stretches each base-OT key into a column; also the
//!   public LPN matrix of Ferret).  It runs on `aesni::AesBatch` (VAES, AES-NI,
//!   or the `aes` crate, chosen at run time).
//! * `Tccr`: the tweakable circular correlation-robust hash of Guo, Katz,
//!   Wang, Yu (IEEE S&P 2020, section 7.4) from one fixed-key permutation pi:
//!   H(i, x) = pi(pi(x) xor i) xor pi(x).  This replaces the random oracle of
//!   IKNP03 as ALSZ13 section 4 suggests (fixed-key AES hashing), with the
//!   tweak i = the global index of the OT so every OT uses a fresh tweak.

use crate::aesni::AesBatch;

pub struct AesPrg {
    aes: AesBatch,
    ctr: u128,
}

const CHUNK: usize = 64; // blocks per encrypt_blocks call (lets AES-NI pipeline)
/// Counter blocks per `AesBatch::encrypt` call of the PRG (16 KiB: stays in L1 while
/// VAES keeps 16 blocks in flight, or the unaligned tail is copied out).
const PRG_CHUNK: usize = 1024;

impl AesPrg {
    /// AES-128-CTR keyed by `seed`: block i of the stream is AES_seed(i) with the
    /// counter i as a little-endian 128-bit integer, from i = 0.  Runs on VAES or
    /// AES-NI when the CPU has them (`aesni::AesBatch`; the `aes` crate otherwise).
    pub fn new(seed: &[u8; 16]) -> Self {
        AesPrg { aes: AesBatch::new(seed), ctr: 0 }
    }

    /// Fill `out` with the next ceil(len/16) blocks of the stream (a partial
    /// last block is discarded, so both parties stay in step as long as they
    /// ask for the same lengths).
    pub fn fill(&mut self, out: &mut [u8]) {
        let full = out.len() / 16;
        let (head, tail) = out.split_at_mut(full * 16);
        // SAFETY: u128 has no invalid bit patterns; align_to_mut only yields the
        // aligned middle part.
        let (pre, mid, post) = unsafe { head.align_to_mut::<u128>() };
        if pre.is_empty() && post.is_empty() {
            // 16-byte aligned: counters written and encrypted in place
            for c in mid.chunks_mut(PRG_CHUNK) {
                self.counters(c);
                self.aes.encrypt(c);
            }
        } else {
            self.fill_copied(head);
        }
        if !tail.is_empty() {
            self.fill_copied(tail);
        }
    }

    /// blocks[i] = ctr + i, then ctr += blocks.len().  Within one 2^64 run of the low
    /// word (always, in practice) the low words are a vectorisable ramp.
    fn counters(&mut self, blocks: &mut [u128]) {
        let n = blocks.len() as u64;
        let lo = self.ctr as u64;
        if lo.checked_add(n).is_some() {
            let hi = self.ctr & !(u64::MAX as u128);
            for (i, b) in (lo..lo + n).zip(blocks.iter_mut()) {
                *b = hi | i as u128;
            }
        } else {
            for (i, b) in blocks.iter_mut().enumerate() {
                *b = self.ctr.wrapping_add(i as u128);
            }
        }
        self.ctr = self.ctr.wrapping_add(n as u128);
    }

    /// `fill` through a scratch buffer (unaligned output, or a partial last block).
    fn fill_copied(&mut self, out: &mut [u8]) {
        let mut buf = [0u128; CHUNK];
        for c in out.chunks_mut(CHUNK * 16) {
            let m = (c.len() + 15) / 16;
            self.counters(&mut buf[..m]);
            self.aes.encrypt(&mut buf[..m]);
            for (d, b) in c.chunks_mut(16).zip(&buf[..m]) {
                d.copy_from_slice(&b.to_le_bytes()[..d.len()]);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::bytes_of_u128_mut;
    use aes::cipher::{generic_array::GenericArray, BlockEncrypt, KeyInit};
    use aes::{Aes128, Block};

    /// The stream, block by block from the `aes` crate: AES_seed(i), i little-endian.
    fn reference(seed: &[u8; 16], blocks: usize) -> Vec<u8> {
        let c = Aes128::new(GenericArray::from_slice(seed));
        let mut out = Vec::with_capacity(blocks * 16);
        for i in 0..blocks as u128 {
            let mut b = Block::clone_from_slice(&i.to_le_bytes());
            c.encrypt_block(&mut b);
            out.extend_from_slice(&b);
        }
        out
    }

    #[test]
    fn prg_is_aes_ctr_across_calls_alignments_and_tails() {
        let seed = [0x5au8; 16];
        // lengths: across PRG_CHUNK and CHUNK boundaries, partial last blocks
        let lens = [16 * PRG_CHUNK + 48, 5, 16 * CHUNK + 16, 33, 0, 16 * 3 * PRG_CHUNK, 1];
        let blocks: usize = lens.iter().map(|l| (l + 15) / 16).sum();
        let want = reference(&seed, blocks);
        for off in [0usize, 1, 8] {
            // `off` shifts the output off 16-byte alignment (the copying path)
            let mut prg = AesPrg::new(&seed);
            let mut at = 0;
            for &len in &lens {
                let mut buf = vec![0u128; len / 16 + 2];
                let out = &mut bytes_of_u128_mut(&mut buf)[off..off + len];
                prg.fill(out);
                assert_eq!(&out[..], &want[at..at + len], "len {len} offset {off}");
                at += (len + 15) / 16 * 16;
            }
        }
    }

    #[test]
    fn prg_counter_carries_into_the_high_word() {
        let seed = [3u8; 16];
        let c = Aes128::new(GenericArray::from_slice(&seed));
        let start = (u64::MAX - 5) as u128;
        let mut prg = AesPrg::new(&seed);
        prg.ctr = start;
        let mut got = vec![0u128; 12];
        prg.fill(bytes_of_u128_mut(&mut got));
        for (i, g) in got.iter().enumerate() {
            let mut b = Block::clone_from_slice(&(start + i as u128).to_le_bytes());
            c.encrypt_block(&mut b);
            assert_eq!(g.to_le_bytes(), b.as_slice(), "block {i}");
        }
        assert_eq!(prg.ctr, start + 12);
    }
}

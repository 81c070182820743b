//! Turning raw extension rows into the OT flavours (IKNP03 section 3, ALSZ13
//! section 5, KK13 section 4).  All functions are stateless: the caller passes
//! the rows (`q` for the sender, `t` for the receiver), Delta, and the global
//! index `tweak` of the first OT (both parties count OTs the same way, so each
//! OT hashes under a fresh tweak).
//!
//! Notation: for OT j, the sender's keys are
//!   K0_j = H(tweak+j, q_j), K1_j = H(tweak+j, q_j xor Delta)   (1-out-of-2)
//! and the receiver's key is H(tweak+j, t_j) = K_{c_j, j}.  H is the fixed-key
//! AES TCCR hash (`prg::Tccr`); values of `bits` <= 64 bits are the low bits
//! of the 128-bit hash; byte strings longer than 16 bytes stretch the key by
//! AES-128-CTR.
//!
//! * random OT: outputs (K0, K1) / K_c; nothing more is sent.
//! * chosen OT: S sends y_b = m_b xor K_b (2*bits per OT).
//! * arithmetic COT over Z_2^l (ALSZ13 section 5.4, "C-OT"): S outputs
//!   r = K0 and sends d = r + corr - K1 (bits per OT); R outputs
//!   K_c + c*d = r + c*corr.
//! * arithmetic COT modulo several primes q_1..q_k (ALSZ13 section 5.4's C-OT
//!   per RNS prime, `acot_mod_*`): K0, K1 stretched by AES-CTR to 16 bytes per
//!   prime, each 128-bit value reduced mod q_i (statistical distance < 2^-64);
//!   S outputs r_i = K0'_i and sends d_i = r_i + corr_i - K1'_i mod q_i in
//!   ceil(bitlen(q_i)/8) bytes; R outputs K_c'_i + c*d_i = r_i + c*corr_i mod q_i.
//! * KK13 1-out-of-N: S sends y_x = msg_x xor H'(j, q_j xor (WH(x) AND Delta))
//!   for x < N (N*bits per OT); H' is SHA-256 (random oracle as in KK13).
//! * 1-out-of-2^m from m correlated OTs (the Ferret path, Naor-Pinkas 1999):
//!   S sends y_x = msg_x xor pad(x), pad(x) = XOR_i H(w(j, i, x), q_i xor x_i Delta)
//!   with the fixed-key AES TCCR hash and a tweak per (instance, bit, x)
//!   (`np_pads_sender`, which explains why that is secure).

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use sha2::digest::generic_array::GenericArray;

use crate::iknp::wh_codeword;
use crate::prg::{AesPrg, Tccr};
use crate::util::{check_bits, err, pack, packed_len, u64_bytes, u64s, unpack, view};

/// The checked arguments every OT-flavour function starts from.
struct OtArgs<'a> {
    /// n rows of `width` bytes (q for the sender, t for the receiver).
    rows: &'a [u8],
    n: usize,
    /// Delta (senders; `width` bytes, the rest zero).
    delta: [u8; 32],
    /// n choices below the arity (receivers).
    choices: &'a [u8],
    /// mask of the value width `bits` (all ones when no width is given).
    mask: u64,
}

impl OtArgs<'_> {
    fn delta16(&self) -> [u8; 16] {
        self.delta[..16].try_into().unwrap()
    }
}

/// The shared preamble: `rows` must be whole rows of `width` bytes (16 for
/// 1-out-of-2, 32 for KK13), `delta` (when given) exactly `width` bytes,
/// `choices` (when given, with the arity N) n values in [0, N), and `bits`
/// (when given) in 1..=64.
fn ot_args<'a>(
    rows: &'a PyBuffer<u8>,
    width: usize,
    delta: Option<&PyBuffer<u8>>,
    choices: Option<(&'a PyBuffer<u8>, usize)>,
    bits: Option<u32>,
) -> PyResult<OtArgs<'a>> {
    let rows = view(rows)?;
    if rows.len() % width != 0 {
        return err(format!("rows buffer of {} bytes is not a multiple of {width}", rows.len()));
    }
    let n = rows.len() / width;
    let mut d = [0u8; 32];
    if let Some(delta) = delta {
        let dv = view(delta)?;
        if dv.len() != width {
            return err(format!("Delta must be {width} bytes, got {}", dv.len()));
        }
        d[..width].copy_from_slice(dv);
    }
    let mut ch: &[u8] = &[];
    if let Some((c, arity)) = choices {
        ch = view(c)?;
        if ch.len() != n {
            return err(format!("{} choices for {} OTs", ch.len(), n));
        }
        if ch.iter().any(|&c| c as usize >= arity) {
            return err(if arity == 2 { "choices must be 0 or 1".to_string() } else { format!("choices must be in [0, {arity})") });
        }
    }
    let mask = match bits {
        Some(b) => check_bits(b)?,
        None => u64::MAX,
    };
    Ok(OtArgs { rows, n, delta: d, choices: ch, mask })
}

/// A message or reply buffer that must be exactly `want` bytes.
fn sized<'a>(b: &'a PyBuffer<u8>, want: usize, what: &str) -> PyResult<&'a [u8]> {
    let v = view(b)?;
    if v.len() != want {
        return err(format!("{what} has {} bytes, expected {want}", v.len()));
    }
    Ok(v)
}

/// H(tweak + j, rows_j xor xor) for every row, 16 bytes each.
fn hash_rows(rows: &[u8], xor: Option<&[u8; 16]>, tweak: u64) -> Vec<u8> {
    let mut h = rows.to_vec();
    if let Some(d) = xor {
        for r in h.chunks_exact_mut(16) {
            for b in 0..16 {
                r[b] ^= d[b];
            }
        }
    }
    Tccr::new().hash_in_place(&mut h, tweak);
    h
}

/// low 64 bits of H(tweak + j, rows_j xor xor), masked.
fn hash64(rows: &[u8], xor: Option<&[u8; 16]>, tweak: u64, m: u64) -> Vec<u64> {
    let x = xor.map(|d| u128::from_le_bytes(*d)).unwrap_or(0);
    let mut out = vec![0u64; rows.len() / 16];
    Tccr::new().hash_low64(rows, x, tweak, m, &mut out);
    out
}

fn ba<'py>(py: Python<'py>, v: &[u8]) -> Bound<'py, PyByteArray> {
    PyByteArray::new_bound(py, v)
}

/// Random OT, sender: (x0, x1) as little-endian uint64 bytes, `bits` bits each.
#[pyfunction]
pub fn rot_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    bits: u32,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let a = ot_args(&q, 16, Some(&delta), None, Some(bits))?;
    let (q, d, m) = (a.rows, a.delta16(), a.mask);
    let (a, b) = py.allow_threads(|| {
        (u64_bytes(&hash64(q, None, tweak, m)), u64_bytes(&hash64(q, Some(&d), tweak, m)))
    });
    Ok((ba(py, &a), ba(py, &b)))
}

/// Random OT, receiver: x_c as little-endian uint64 bytes.
#[pyfunction]
pub fn rot_receiver<'py>(py: Python<'py>, t: PyBuffer<u8>, tweak: u64, bits: u32) -> PyResult<Bound<'py, PyByteArray>> {
    let a = ot_args(&t, 16, None, None, Some(bits))?;
    let (t, m) = (a.rows, a.mask);
    let out = py.allow_threads(|| u64_bytes(&hash64(t, None, tweak, m)));
    Ok(ba(py, &out))
}

/// Chosen OT, sender: y = pack([m0_j xor K0_j, m1_j xor K1_j for j], bits).
#[pyfunction]
pub fn chosen_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    m0: PyBuffer<u8>,
    m1: PyBuffer<u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    let a = ot_args(&q, 16, Some(&delta), None, Some(bits))?;
    let (q, n, d, mk) = (a.rows, a.n, a.delta16(), a.mask);
    let (m0, m1) = (sized(&m0, 8 * n, "m0")?, sized(&m1, 8 * n, "m1")?);
    let y = py.allow_threads(|| {
        let k0 = hash64(q, None, tweak, mk);
        let k1 = hash64(q, Some(&d), tweak, mk);
        let (a, b) = (u64s(m0), u64s(m1));
        let mut v = Vec::with_capacity(2 * n);
        for j in 0..n {
            v.push(a[j] ^ k0[j]);
            v.push(b[j] ^ k1[j]);
        }
        pack(&v, bits)
    });
    Ok(ba(py, &y))
}

/// Chosen OT, receiver: m_c as little-endian uint64 bytes.
#[pyfunction]
pub fn chosen_receiver<'py>(
    py: Python<'py>,
    t: PyBuffer<u8>,
    choices: PyBuffer<u8>,
    tweak: u64,
    y: PyBuffer<u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    let a = ot_args(&t, 16, None, Some((&choices, 2)), Some(bits))?;
    let (t, n, ch, mk) = (a.rows, a.n, a.choices, a.mask);
    let y = sized(&y, packed_len(2 * n, bits), "chosen-OT reply")?;
    let out = py.allow_threads(|| {
        let k = hash64(t, None, tweak, mk);
        let yv = unpack(y, 2 * n, bits);
        let o: Vec<u64> = (0..n).map(|j| yv[2 * j + ch[j] as usize] ^ k[j]).collect();
        u64_bytes(&o)
    });
    Ok(ba(py, &out))
}

/// Arithmetic correlated OT over Z_2^bits, sender: (r, packed d).
#[pyfunction]
pub fn acot_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    corr: PyBuffer<u8>,
    bits: u32,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let a = ot_args(&q, 16, Some(&delta), None, Some(bits))?;
    let (q, n, d, mk) = (a.rows, a.n, a.delta16(), a.mask);
    let corr = sized(&corr, 8 * n, "correlations")?;
    let (r, dd) = py.allow_threads(|| {
        let k0 = hash64(q, None, tweak, mk);
        let k1 = hash64(q, Some(&d), tweak, mk);
        let c = u64s(corr);
        let dv: Vec<u64> = (0..n).map(|j| k0[j].wrapping_add(c[j]).wrapping_sub(k1[j]) & mk).collect();
        (u64_bytes(&k0), pack(&dv, bits))
    });
    Ok((ba(py, &r), ba(py, &dd)))
}

/// Arithmetic correlated OT, receiver: r + c*corr mod 2^bits.
#[pyfunction]
pub fn acot_receiver<'py>(
    py: Python<'py>,
    t: PyBuffer<u8>,
    choices: PyBuffer<u8>,
    tweak: u64,
    d: PyBuffer<u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    let a = ot_args(&t, 16, None, Some((&choices, 2)), Some(bits))?;
    let (t, n, ch, mk) = (a.rows, a.n, a.choices, a.mask);
    let d = sized(&d, packed_len(n, bits), "COT reply")?;
    let out = py.allow_threads(|| {
        let k = hash64(t, None, tweak, mk);
        let dv = unpack(d, n, bits);
        let o: Vec<u64> = (0..n).map(|j| k[j].wrapping_add(dv[j] * ch[j] as u64) & mk).collect();
        u64_bytes(&o)
    });
    Ok(ba(py, &out))
}

/// Keystream of `len` bytes from a 16-byte hash key (the key itself when len <= 16).
fn stretch(key: &[u8], len: usize, out: &mut [u8]) {
    if len <= 16 {
        out.copy_from_slice(&key[..len]);
    } else {
        AesPrg::new(key.try_into().unwrap()).fill(out);
    }
}

/// Chosen OT of byte strings of `len` bytes, sender: y = (m0_j xor K0_j, m1_j xor K1_j) per OT.
#[pyfunction]
pub fn chosen_bytes_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    m0: PyBuffer<u8>,
    m1: PyBuffer<u8>,
    len: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let a = ot_args(&q, 16, Some(&delta), None, None)?;
    let (q, n, d) = (a.rows, a.n, a.delta16());
    let (m0, m1) = (sized(&m0, n * len, "m0")?, sized(&m1, n * len, "m1")?);
    let y = py.allow_threads(|| {
        let k0 = hash_rows(q, None, tweak);
        let k1 = hash_rows(q, Some(&d), tweak);
        let mut y = vec![0u8; 2 * n * len];
        let mut ks = vec![0u8; len];
        for j in 0..n {
            for (b, (m, k)) in [(0usize, (m0, &k0)), (1usize, (m1, &k1))] {
                stretch(&k[16 * j..16 * j + 16], len, &mut ks);
                let o = &mut y[(2 * j + b) * len..(2 * j + b + 1) * len];
                for i in 0..len {
                    o[i] = m[j * len + i] ^ ks[i];
                }
            }
        }
        y
    });
    Ok(ba(py, &y))
}

/// Chosen OT of byte strings, receiver: m_c (n * len bytes).
#[pyfunction]
pub fn chosen_bytes_receiver<'py>(
    py: Python<'py>,
    t: PyBuffer<u8>,
    choices: PyBuffer<u8>,
    tweak: u64,
    y: PyBuffer<u8>,
    len: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let a = ot_args(&t, 16, None, Some((&choices, 2)), None)?;
    let (t, n, ch) = (a.rows, a.n, a.choices);
    let y = sized(&y, 2 * n * len, "chosen-OT reply")?;
    let out = py.allow_threads(|| {
        let k = hash_rows(t, None, tweak);
        let mut out = vec![0u8; n * len];
        let mut ks = vec![0u8; len];
        for j in 0..n {
            stretch(&k[16 * j..16 * j + 16], len, &mut ks);
            let src = &y[(2 * j + ch[j] as usize) * len..(2 * j + ch[j] as usize + 1) * len];
            for i in 0..len {
                out[j * len + i] = src[i] ^ ks[i];
            }
        }
        out
    });
    Ok(ba(py, &out))
}

/// The checked RNS primes of `acot_mod_*`: 1..=16 moduli in [2, 2^62) (any
/// modulus works; BLB's are NTT primes), with each one's reply width
/// ceil(bitlen(q)/8) bytes.
fn mod_primes(primes: &[u64]) -> PyResult<Vec<usize>> {
    if primes.is_empty() || primes.len() > 16 {
        return err(format!("need 1 to 16 primes, got {}", primes.len()));
    }
    if let Some(q) = primes.iter().find(|&&q| !(2..(1u64 << 62)).contains(&q)) {
        return err(format!("prime {q} is not in [2, 2^62)"));
    }
    Ok(primes.iter().map(|&q| (64 - q.leading_zeros() as usize).div_ceil(8)).collect())
}

/// The k values mod q_i of one key: the key stretched to 16 k bytes (`stretch`),
/// block i read as a little-endian u128 and reduced mod q_i (u128 % q: statistical
/// distance from uniform < q / 2^128 < 2^-66; a 64-bit value would be biased).
fn mod_values(key: &[u8], primes: &[u64], ks: &mut [u8], out: &mut [u64]) {
    stretch(key, ks.len(), ks);
    for (i, &q) in primes.iter().enumerate() {
        let v = u128::from_le_bytes(ks[16 * i..16 * i + 16].try_into().unwrap());
        out[i] = (v % q as u128) as u64;
    }
}

/// Arithmetic correlated OT modulo each prime q_i (ALSZ13 section 5.4 per RNS prime),
/// sender: q (n rows), Delta, corr (n*k uint64, OT j then prime i, corr_ji < q_i),
/// primes (k) -> (r (n*k uint64), y): r_ji = K0'_ji, y_ji = r_ji + corr_ji - K1'_ji
/// mod q_i, little-endian in ceil(bitlen(q_i)/8) bytes (row j: the k values in order).
#[pyfunction]
pub fn acot_mod_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    corr: PyBuffer<u8>,
    primes: Vec<u64>,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
    let widths = mod_primes(&primes)?;
    let a = ot_args(&q, 16, Some(&delta), None, None)?;
    let (q, n, d) = (a.rows, a.n, a.delta16());
    let k = primes.len();
    let c = u64s(sized(&corr, 8 * n * k, "correlations")?);
    for (x, v) in c.iter().enumerate() {
        if *v >= primes[x % k] {
            return err(format!("correlation {v} of OT {} is not below its prime {}", x / k, primes[x % k]));
        }
    }
    let row: usize = widths.iter().sum();
    let (r, y) = py.allow_threads(|| {
        let k0 = hash_rows(q, None, tweak);
        let k1 = hash_rows(q, Some(&d), tweak);
        let mut r = vec![0u64; n * k];
        let mut y = vec![0u8; n * row];
        let mut ks = vec![0u8; 16 * k];
        let mut v1 = vec![0u64; k];
        for j in 0..n {
            let rj = &mut r[j * k..(j + 1) * k];
            mod_values(&k0[16 * j..16 * j + 16], &primes, &mut ks, rj);
            mod_values(&k1[16 * j..16 * j + 16], &primes, &mut ks, &mut v1);
            let mut o = j * row;
            for i in 0..k {
                let qi = primes[i];
                let s = (rj[i] + c[j * k + i]) % qi; // both < 2^62: no overflow
                let yv = (s + qi - v1[i]) % qi;
                y[o..o + widths[i]].copy_from_slice(&yv.to_le_bytes()[..widths[i]]);
                o += widths[i];
            }
        }
        (u64_bytes(&r), y)
    });
    Ok((ba(py, &r), ba(py, &y)))
}

/// Arithmetic correlated OT modulo each prime, receiver: t (n rows), choices (n bytes
/// 0/1), y (the sender's reply, exactly n * sum_i ceil(bitlen(q_i)/8) bytes, every
/// value below its prime) -> out_ji = K_c'_ji + c_j y_ji mod q_i (n*k uint64).
#[pyfunction]
pub fn acot_mod_receiver<'py>(
    py: Python<'py>,
    t: PyBuffer<u8>,
    choices: PyBuffer<u8>,
    tweak: u64,
    y: PyBuffer<u8>,
    primes: Vec<u64>,
) -> PyResult<Bound<'py, PyByteArray>> {
    let widths = mod_primes(&primes)?;
    let a = ot_args(&t, 16, None, Some((&choices, 2)), None)?;
    let (t, n, ch) = (a.rows, a.n, a.choices);
    let k = primes.len();
    let row: usize = widths.iter().sum();
    let y = sized(&y, n * row, "COT-mod reply")?;
    let out = py.allow_threads(|| -> Result<Vec<u8>, String> {
        let kc = hash_rows(t, None, tweak);
        let mut out = vec![0u64; n * k];
        let mut ks = vec![0u8; 16 * k];
        for j in 0..n {
            let oj = &mut out[j * k..(j + 1) * k];
            mod_values(&kc[16 * j..16 * j + 16], &primes, &mut ks, oj);
            let mut o = j * row;
            for i in 0..k {
                let mut b = [0u8; 8];
                b[..widths[i]].copy_from_slice(&y[o..o + widths[i]]);
                o += widths[i];
                let yv = u64::from_le_bytes(b);
                if yv >= primes[i] {
                    return Err(format!("COT-mod reply: value {yv} of OT {j} is not below its prime {}", primes[i]));
                }
                if ch[j] != 0 {
                    oj[i] = (oj[i] + yv) % primes[i];
                }
            }
        }
        Ok(u64_bytes(&out))
    });
    match out {
        Ok(o) => Ok(ba(py, &o)),
        Err(e) => err(e),
    }
}

/// H'(j, row) = first 64 bits of SHA-256("cipherlm" || j || row): the 48-byte
/// message fits one padded block, so this is one call of the compression
/// function (SHA-NI when the CPU has it) on a block built in place.
fn kk_hash(tweak: u64, row: &[u8; 32]) -> u64 {
    const IV: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    ];
    let mut block = [0u8; 64];
    block[..8].copy_from_slice(b"cipherlm");
    block[8..16].copy_from_slice(&tweak.to_le_bytes());
    block[16..48].copy_from_slice(row);
    block[48] = 0x80;
    block[56..64].copy_from_slice(&(48u64 * 8).to_be_bytes());
    let mut st = IV;
    sha2::compress256(&mut st, &[*GenericArray::from_slice(&block)]);
    ((st[0] as u64) << 32) | st[1] as u64
}

fn check_n(nn: usize) -> PyResult<()> {
    if !(2..=256).contains(&nn) {
        return err(format!("N must be in 2..=256, got {nn}"));
    }
    Ok(())
}

/// KK13 1-out-of-N, sender: q (n rows of 32 bytes), Delta (32 bytes), msgs
/// (n*N uint64, row-major) -> pack(msgs_{j,x} xor H'(j, q_j xor (WH(x) AND Delta)), bits).
#[pyfunction]
pub fn kk13_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    nn: usize,
    msgs: PyBuffer<u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    check_n(nn)?;
    let a = ot_args(&q, 32, Some(&delta), None, Some(bits))?;
    let (q, n, d, mk) = (a.rows, a.n, a.delta, a.mask);
    let msgs = sized(&msgs, n * nn * 8, "messages")?;
    let y = py.allow_threads(|| {
        let mut cs = vec![[0u8; 32]; nn];
        for x in 0..nn {
            let w = wh_codeword(x as u8);
            for b in 0..32 {
                cs[x][b] = w[b] & d[b];
            }
        }
        let mv = u64s(msgs);
        let mut v = vec![0u64; n * nn];
        let mut row = [0u8; 32];
        for j in 0..n {
            let qj = &q[32 * j..32 * j + 32];
            for x in 0..nn {
                for b in 0..32 {
                    row[b] = qj[b] ^ cs[x][b];
                }
                v[j * nn + x] = (mv[j * nn + x] ^ kk_hash(tweak.wrapping_add(j as u64), &row)) & mk;
            }
        }
        pack(&v, bits)
    });
    Ok(ba(py, &y))
}

/// The receiver's side of every 1-out-of-N OT here: msgs_{j, c_j} = y_{j, c_j} xor key(j),
/// y the sender's reply (n*N values of `bits` bits), key(j) the pad of instance j.
fn receive_1ofn<'py, F>(py: Python<'py>, y: &PyBuffer<u8>, a: &OtArgs, nn: usize, bits: u32, key: F)
    -> PyResult<Bound<'py, PyByteArray>>
where
    F: Fn(usize) -> u64 + Sync,
{
    let (n, ch, mk) = (a.n, a.choices, a.mask);
    let y = sized(y, packed_len(n * nn, bits), "1-of-N reply")?;
    let out = py.allow_threads(|| {
        let yv = unpack(y, n * nn, bits);
        let o: Vec<u64> = (0..n).map(|j| (yv[j * nn + ch[j] as usize] ^ key(j)) & mk).collect();
        u64_bytes(&o)
    });
    Ok(ba(py, &out))
}

/// KK13 1-out-of-N, receiver: t (n rows of 32 bytes), choices (n bytes < N) -> msgs_{j, c_j}.
#[pyfunction]
pub fn kk13_receiver<'py>(
    py: Python<'py>,
    t: PyBuffer<u8>,
    choices: PyBuffer<u8>,
    tweak: u64,
    nn: usize,
    y: PyBuffer<u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    check_n(nn)?;
    let a = ot_args(&t, 32, None, Some((&choices, nn)), Some(bits))?;
    let rows = a.rows;
    receive_1ofn(py, &y, &a, nn, bits, |j| {
        let row: [u8; 32] = rows[32 * j..32 * j + 32].try_into().unwrap();
        kk_hash(tweak.wrapping_add(j as u64), &row)
    })
}

/// Pack uint64 values (little-endian bytes) to `bits` bits each.
#[pyfunction]
pub fn pack_bits<'py>(py: Python<'py>, vals: PyBuffer<u8>, bits: u32) -> PyResult<Bound<'py, PyByteArray>> {
    let v = view(&vals)?;
    if v.len() % 8 != 0 {
        return err("values must be uint64");
    }
    check_bits(bits)?;
    let out = py.allow_threads(|| pack(&u64s(v), bits));
    Ok(ba(py, &out))
}

/// Unpack `n` values of `bits` bits (inverse of `pack_bits`).
#[pyfunction]
pub fn unpack_bits<'py>(py: Python<'py>, buf: PyBuffer<u8>, n: usize, bits: u32) -> PyResult<Bound<'py, PyByteArray>> {
    check_bits(bits)?;
    let b = sized(&buf, packed_len(n, bits), "packed buffer")?;
    let out = py.allow_threads(|| u64_bytes(&unpack(b, n, bits)));
    Ok(ba(py, &out))
}

/// Tweak of the 1-out-of-N hash for instance `inst` (the session's OT index),
/// bit `i` of the index and message index `x`: its own domain (bit 100 set;
/// every other CCR-hash tweak of a session is below 2^64).
#[inline]
fn np_tweak(inst: u64, i: usize, x: usize) -> u128 {
    (1u128 << 100) | ((inst as u128) << 16) | ((i as u128) << 8) | x as u128
}

/// The pads of the 1-out-of-N OT from m = log2 N correlated OTs (Naor-Pinkas,
/// "Oblivious Transfer and Polynomial Evaluation", STOC 1999, sec. 3.1: N random
/// keys from log N 1-out-of-2 OTs, message x masked with XOR_i F_{K_i^{x_i}}(x)).
/// Here K_i^b = q_i xor b*Delta (the COT) and F_K(x) = H(w(j, i, x), K) with H
/// the tweakable circular correlation-robust hash of Guo-Katz-Wang-Yu (IEEE S&P
/// 2020, sec. 7.4; `Tccr`, one fixed-key AES permutation pi:
/// H(w, k) = pi(pi(k) xor w) xor pi(k), in the MMO form pi(y) xor y), and a tweak
/// w(j, i, x) unique to (instance, bit, message index):
///
///   pad_j(x) = low 64 bits of XOR_{i < m} H(w(j, i, x), q_{j,i} xor x_i Delta).
///
/// Why it is secure (semi-honest): the receiver with choice c holds
/// t_{j,i} = q_{j,i} xor c_i Delta; for x != c some bit i has x_i != c_i, and
/// that term is H(w, t_{j,i} xor Delta), an output of GKWY's TCCR oracle on a
/// (tweak, input) pair that is queried once only (the tweak includes x), hence
/// pseudorandom and independent of every other pad; the tweak including x is
/// what the PRF evaluation at x does in NP99 (without it the XOR of per-bit keys
/// would make the pads of four messages XOR to zero).  The sender learns nothing
/// (its view is the COT's).  This replaces SHA-256 over the concatenated keys
/// (one pad per x hashed 16 + 16 m bytes: 2 compressions at N = 16), at
/// 2m + N m AES blocks per instance for the sender (pi(K) computed once per key)
/// and 2m for the receiver.
fn np_pads_sender(q: &[u8], d: u128, tweak: u64, n: usize, m: usize, nn: usize, out: &mut [u64]) {
    let tccr = Tccr::new();
    // instances per group: a few hundred blocks per AES call
    let g = (256 / (nn * m)).max(1);
    let mut pk = vec![0u128; g * 2 * m];
    let mut z = vec![0u128; g * nn * m];
    let mut s = vec![0u64; nn];
    let mut j0 = 0;
    while j0 < n {
        let gn = g.min(n - j0);
        // the keys K_i^0 = q_i, K_i^1 = q_i xor Delta of each instance, then pi(K)
        for (k, r) in pk[..gn * 2 * m].chunks_exact_mut(2).zip(q[16 * j0 * m..16 * (j0 + gn) * m].chunks_exact(16)) {
            let qi = u128::from_le_bytes(r.try_into().unwrap());
            k[0] = qi;
            k[1] = qi ^ d;
        }
        tccr.pi_u128(&mut pk[..gn * 2 * m]);
        // z[x][i] = pi(K_i^{x_i}) xor w(j, i, x); w's instance part is shared by the
        // instance's terms and its (i, x) part sits in the low 16 bits, apart from it
        for jj in 0..gn {
            let base = np_tweak(tweak.wrapping_add((j0 + jj) as u64), 0, 0);
            let p = &pk[jj * 2 * m..(jj + 1) * 2 * m];
            for (x, zx) in z[jj * nn * m..(jj + 1) * nn * m].chunks_exact_mut(m).enumerate() {
                for (i, zi) in zx.iter_mut().enumerate() {
                    *zi = p[2 * i + ((x >> i) & 1)] ^ base ^ (((i << 8) | x) as u128);
                }
            }
        }
        tccr.pi_u128(&mut z[..gn * nn * m]);
        // pad(x) = low 64 of XOR_i pi(z[x][i]) xor pi(K_i^{x_i}); the second XOR for all x
        // by flipping one bit at a time: s[x] = s[x without its lowest 1] xor D_i
        for jj in 0..gn {
            let p = &pk[jj * 2 * m..(jj + 1) * 2 * m];
            s[0] = p.iter().step_by(2).fold(0u64, |a, &v| a ^ v as u64);
            for x in 1..nn {
                let i = x.trailing_zeros() as usize;
                s[x] = s[x & (x - 1)] ^ ((p[2 * i] ^ p[2 * i + 1]) as u64);
            }
            let o = &mut out[(j0 + jj) * nn..(j0 + jj + 1) * nn];
            for ((ox, zx), &sx) in o.iter_mut().zip(z[jj * nn * m..(jj + 1) * nn * m].chunks_exact(m)).zip(s.iter()) {
                *ox = zx.iter().fold(sx, |a, &v| a ^ v as u64);
            }
        }
        j0 += gn;
    }
}

/// The receiver's pads: pad_j(c_j) from its keys t_{j,i} (see `np_pads_sender`),
/// 64 keys per AES call through a stack buffer.
fn np_pads_receiver(t: &[u8], ch: &[u8], tweak: u64, n: usize, m: usize) -> Vec<u64> {
    const G: usize = 64;
    let tccr = Tccr::new();
    let mut out = vec![0u64; n];
    let g = (G / m).max(1); // instances per group
    let mut y = [0u128; G * 8];
    let mut z = [0u128; G * 8];
    let mut j0 = 0;
    while j0 < n {
        let gn = g.min(n - j0);
        let len = gn * m;
        for (o, c) in y[..len].iter_mut().zip(t[16 * j0 * m..16 * (j0 * m + len)].chunks_exact(16)) {
            *o = u128::from_le_bytes(c.try_into().unwrap());
        }
        tccr.pi_u128(&mut y[..len]); // pi(k)
        for jj in 0..gn {
            let inst = tweak.wrapping_add((j0 + jj) as u64);
            let x = ch[j0 + jj] as usize;
            for i in 0..m {
                z[jj * m + i] = y[jj * m + i] ^ np_tweak(inst, i, x);
            }
        }
        tccr.pi_u128(&mut z[..len]);
        for jj in 0..gn {
            let mut acc = 0u128;
            for i in 0..m {
                acc ^= z[jj * m + i] ^ y[jj * m + i];
            }
            out[j0 + jj] = acc as u64;
        }
        j0 += gn;
    }
    out
}

fn check_np(nn: usize) -> PyResult<usize> {
    if !(2..=256).contains(&nn) || !nn.is_power_of_two() {
        return err(format!("N must be a power of two in 2..=256, got {nn}"));
    }
    Ok(nn.trailing_zeros() as usize)
}

/// 1-out-of-N from log2 N correlated OTs with a global Delta (Naor-Pinkas 1999's
/// construction on random OTs; the Ferret path of `OTSession.send_1ofN`), sender:
/// q (n * m rows of 16 bytes, instance j owns rows j m .. j m + m - 1, row i for
/// bit i of the index), Delta (16 bytes), msgs (n*N words of `msg_bytes` bytes:
/// 8, uint64, or 1, uint8 for messages of at most 8 bits, as the comparison's
/// leaves have) -> pack(msgs_{j,x} xor pad_j(x), bits), pad from fixed-key AES
/// (`np_pads_sender`).
#[pyfunction]
#[pyo3(signature = (q, delta, tweak, nn, msgs, bits, msg_bytes=8))]
pub fn np1ofn_sender<'py>(
    py: Python<'py>,
    q: PyBuffer<u8>,
    delta: PyBuffer<u8>,
    tweak: u64,
    nn: usize,
    msgs: PyBuffer<u8>,
    bits: u32,
    msg_bytes: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let m = check_np(nn)?;
    let a = ot_args(&q, 16, Some(&delta), None, Some(bits))?;
    if a.n % m != 0 {
        return err(format!("{} correlated OTs is not a multiple of log2 N = {m}", a.n));
    }
    if msg_bytes != 8 && !(msg_bytes == 1 && bits <= 8) {
        return err(format!("messages of {msg_bytes} bytes (8, or 1 for at most 8 bits) at {bits} bits"));
    }
    let (q, n, d, mk) = (a.rows, a.n / m, a.delta16(), a.mask);
    let msgs = sized(&msgs, n * nn * msg_bytes, "messages")?;
    let y = py.allow_threads(|| {
        let mut v = vec![0u64; n * nn];
        np_pads_sender(q, u128::from_le_bytes(d), tweak, n, m, nn, &mut v);
        if msg_bytes == 1 {
            for (o, &x) in v.iter_mut().zip(msgs.iter()) {
                *o = (*o ^ x as u64) & mk;
            }
        } else {
            for (o, &x) in v.iter_mut().zip(u64s(msgs).iter()) {
                *o = (*o ^ x) & mk;
            }
        }
        pack(&v, bits)
    });
    Ok(ba(py, &y))
}

/// The receiver of `np1ofn_sender`: t (n * m rows of 16 bytes, t = q xor c_i Delta for
/// the bits c_i of its choice), choices (n bytes < N) -> msgs_{j, c_j}.
#[pyfunction]
pub fn np1ofn_receiver<'py>(
    py: Python<'py>,
    t: PyBuffer<u8>,
    choices: PyBuffer<u8>,
    tweak: u64,
    nn: usize,
    y: PyBuffer<u8>,
    bits: u32,
) -> PyResult<Bound<'py, PyByteArray>> {
    let m = check_np(nn)?;
    let a = ot_args(&t, 16 * m, None, Some((&choices, nn)), Some(bits))?;
    let (rows, n, ch, mk) = (a.rows, a.n, a.choices, a.mask);
    let y = sized(&y, packed_len(n * nn, bits), "1-of-N reply")?;
    let out = py.allow_threads(|| {
        let pads = np_pads_receiver(rows, ch, tweak, n, m);
        let yv = unpack(y, n * nn, bits);
        let o: Vec<u64> = (0..n).map(|j| (yv[j * nn + ch[j] as usize] ^ pads[j]) & mk).collect();
        u64_bytes(&o)
    });
    Ok(ba(py, &out))
}

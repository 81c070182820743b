"""Boolean to arithmetic conversion of shared bits (CrypTFlow2 section 4.1.1 "B2A", via COT).

b = b0 XOR b1 = b0 + b1 - 2 b0 b1.  The product b0 b1 comes from one correlated
OT: party 0 is the COT sender with correlation b0 and gets r; party 1 chooses
with b1 and gets r + b1 b0 (mod 2^l).  Shares: party 0 b0 + 2r, party 1
b1 - 2(r + b0 b1).

Cost per element: one COT of ``bits`` bits (IKNP: 128 + bits bits), 1 OT call.
Also `b2a_mod` into a prime field Z_q (a chosen-message OT carries r, r + b0 mod q),
and `b2a_mod_primes` into Z_q for several RNS primes at once (one COT modulo each
prime: one correction of ceil(|q_i| / 8) bytes per prime and bit).
"""

from __future__ import annotations

import numpy as np

from ..ring import check_modulus, mask, uniform_mod
from ..shares import AShare, BShare

__all__ = ["b2a", "b2a_bits", "b2a_mod", "b2a_mod_primes"]


def b2a_bits(ctx, b: np.ndarray, bits: int) -> np.ndarray:
    """This party's arithmetic share (uint64 mod 2^bits) of the XOR-shared bits b."""
    b = np.asarray(b).astype(np.uint64).reshape(-1)
    mk = mask(bits)
    with ctx.step("b2a"):
        if ctx.party == 0:
            r = np.asarray(ctx.ot.send_cot(b, bits), np.uint64)
            out = b + (r << np.uint64(1))
        else:
            t = np.asarray(ctx.ot.recv_cot(b.astype(bool), bits), np.uint64)
            out = b - (t << np.uint64(1))
    return out & mk


def b2a(ctx, b: BShare, bits: int | None = None, frac: int = 0) -> AShare:
    """Arithmetic sharing over Z_{2^bits} (default the ring's) of shared bits."""
    if b.bits != 1:
        raise ValueError("b2a converts shared bits (bits=1)")
    bits = ctx.ring.bits if bits is None else bits
    out = b2a_bits(ctx, b.data, bits).reshape(b.shape)
    return AShare(ctx, out, bits, frac)


def b2a_mod(ctx, b: np.ndarray, q: int) -> np.ndarray:
    """This party's share in Z_q of the XOR-shared bits b (uint8/uint64 0/1)."""
    q = check_modulus(q)
    b = np.asarray(b).astype(np.uint64).reshape(-1)
    Q = np.uint64(q)
    with ctx.step("b2a_mod"):
        if ctx.party == 0:
            r = uniform_mod(ctx.rng, b.shape, q)
            m1 = r + b
            m1 = np.where(m1 >= Q, m1 - Q, m1)
            ctx.ot.send_chosen(r, m1)
            t = (Q - r) % Q  # share of b0*b1
        else:
            t = np.asarray(ctx.ot.recv_chosen(b.astype(bool)), np.uint64)
    # b_i - 2 t_i mod q
    two_t = (t + t) % Q
    return (b + Q - two_t) % Q


def b2a_mod_primes(ctx, b: np.ndarray, primes, factors=None) -> np.ndarray:
    """This party's shares (k, n) uint64, row i mod primes[i], of the XOR-shared bits b
    (times ``factors[i]`` mod primes[i] when given: public constants, free to apply inside
    the OT's correlation instead of a product afterwards).

    Construction: b = b0 + b1 - 2 b0 b1, and the product b0 b1 modulo every prime
    at once from one arithmetic correlated OT per bit modulo each prime (ALSZ13,
    "More Efficient Oblivious Transfer and Extensions for Faster Secure
    Computation", CCS 2013, sec. 5.4 "C-OT", applied per RNS prime:
    `OTSession.send_cot_mod`).  Party 0 is the sender with correlation b0 for every
    prime and gets r (uniform mod q_i); party 1 chooses with b1 and gets
    r + b1 b0 mod q_i.  Shares of b0 b1: -r and r + b0 b1; each party outputs
    b_p - 2 t_p mod q_i.  With factors c_i: correlation c_i b0, outputs
    c_i b_p - 2 t_p (c_i b_p is 0 or c_i: no modular product).  Used by BLB's
    MPC -> CKKS conversion (Algorithm 2, section 6 / Appendix C.3) to bring the
    coefficient-wrap bits into every prime of the ciphertext level.

    Wire per bit: one correlated OT (IKNP 16 bytes, Ferret 1 bit) plus the
    sender's corrections, sum_i ceil(bitlen(q_i) / 8) bytes (a chosen OT of the k
    residues sends both messages, 16 k bytes); one round.  Channel label
    "b2a_mod".
    """
    qs_int = [check_modulus(q) for q in np.asarray(primes, dtype=object).reshape(-1)]
    qs = np.array(qs_int, np.uint64)
    b = np.asarray(b).astype(np.uint64).reshape(-1)
    n, k = b.size, qs.size
    c = np.ones(k, np.uint64) if factors is None else np.array([int(f) % q for f, q in zip(factors, qs_int)], np.uint64)
    if c.size != k:
        raise ValueError(f"{c.size} factors for {k} primes")
    cb = b[:, None] * c  # c_i b_p: b_p is 0 or 1
    with ctx.step("b2a_mod"):
        if ctx.party == 0:
            r = np.asarray(ctx.ot.send_cot_mod(cb, qs_int), np.uint64)
            t = (qs - r) % qs  # share of c b0 b1
        else:
            t = np.asarray(ctx.ot.recv_cot_mod(b.astype(bool), qs_int), np.uint64).reshape(n, k)
    two_t = (t + t) % qs  # t < q < 2^62: no overflow
    return ((cb + qs - two_t) % qs).T

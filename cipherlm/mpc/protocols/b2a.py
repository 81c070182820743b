"""Boolean to arithmetic conversion of shared bits (CrypTFlow2 section 4.1.1 "B2A", via COT).

b = b0 XOR b1 = b0 + b1 - 2 b0 b1.  The product b0 b1 comes from one correlated
OT: party 0 is the COT sender with correlation b0 and gets r; party 1 chooses
with b1 and gets r + b1 b0 (mod 2^l).  Shares: party 0 b0 + 2r, party 1
b1 - 2(r + b0 b1).

Cost per element: one COT of ``bits`` bits (IKNP: 128 + bits bits), 1 OT call.
Also `b2a_mod` into a prime field Z_q (a chosen-message OT carries r, r + b0 mod q).
"""

from __future__ import annotations

import numpy as np

from ..ring import check_modulus, mask, uniform_mod
from ..shares import AShare, BShare

__all__ = ["b2a", "b2a_bits", "b2a_mod"]


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

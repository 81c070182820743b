"""Boolean-share AND with Beaver bit triples generated from random OT (no dealer).

Triples (GMW / Beaver 1991; CrypTFlow2 section 3.1 uses them for the AND-tree
of the millionaire protocol): each party samples a_i and b_i; the cross terms
a_0 b_1 and a_1 b_0 each come from one random OT (ROT), the sender defining its
bit of b as m_0 XOR m_1 and the receiver choosing with its bit of a.
*Correlated* triples (CrypTFlow2 section 3.1.1) share ``a`` between ``k``
ANDs: a ROT with k-bit messages yields k cross terms at the price of one.

AND: open d = x XOR a and e = y XOR b (one simultaneous exchange, bit-packed);
z = c XOR (d AND b) XOR (e AND a) XOR [party 0] (d AND e).

Cost per triple: 2 ROTs (IKNP: ~2 x 128 bits, no sender payload).  Per AND: +2
bits each way (d, e), 1 round.
"""

from __future__ import annotations

import numpy as np

from ..ring import uniform_bits
from ..shares import BShare, register_kernel

__all__ = ["bit_triples", "and_", "and_bits", "pack_bits", "unpack_bits", "exchange_bits"]


def pack_bits(b: np.ndarray) -> np.ndarray:
    return np.packbits(np.asarray(b, dtype=np.uint8).reshape(-1))


def unpack_bits(p: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(np.asarray(p, dtype=np.uint8), count=n)


def exchange_bits(ctx, bits_list: list[np.ndarray]) -> list[np.ndarray]:
    """Simultaneously send 0/1 arrays packed 8 per byte; return the peer's."""
    sizes = [b.size for b in bits_list]
    flat = np.concatenate([np.asarray(b, np.uint8).reshape(-1) for b in bits_list]) if bits_list else np.zeros(0, np.uint8)
    other = ctx.exchange({"b": pack_bits(flat)})["b"]
    got = unpack_bits(other, flat.size)
    out, pos = [], 0
    for b, n in zip(bits_list, sizes):
        out.append(got[pos:pos + n].reshape(np.shape(b)))
        pos += n
    return out


def bit_triples(ctx, n: int, k: int = 1):
    """n correlated bit triples: a (n,), b (n, k), c (n, k) with c = a AND b (uint8 0/1)."""
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros((0, k), np.uint8), np.zeros((0, k), np.uint8)
    ot = ctx.ot
    with ctx.step("bit_triples"):
        a = uniform_bits(ctx.rng, n)
        own = []  # this party's shares of the two cross terms, (n, k) each
        b = None
        for sender in (1, 0):  # cross term a_{1-sender} * b_sender
            if ctx.party == sender:
                m0, m1 = ot.send_random(n, k)
                b = _low_bits(np.asarray(m0, np.uint64) ^ np.asarray(m1, np.uint64), k)
                own.append(_low_bits(m0, k))
            else:
                _, mc = ot.recv_random(a.astype(bool), k)
                own.append(_low_bits(mc, k))
        c = (a[:, None] & b) ^ own[0] ^ own[1]
    return a, b, c


def _low_bits(v: np.ndarray, k: int) -> np.ndarray:
    """The k low bits of each uint64 as a (n, k) uint8 0/1 array, bit 0 first."""
    v = np.asarray(v, np.uint64)
    if k <= 8:  # one byte per value: unpack instead of k 64-bit shifts
        return np.unpackbits(v.astype(np.uint8)[:, None], axis=1, count=k, bitorder="little")
    return ((v[:, None] >> np.arange(k, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)


def and_bits(ctx, x: np.ndarray, y: np.ndarray, triple=None) -> np.ndarray:
    """AND of XOR-shared bits: x (n,), y (n, k) -> (n, k) (x shared among the k ANDs)."""
    x = np.asarray(x, np.uint8).reshape(-1)
    y = np.asarray(y, np.uint8)
    squeeze = y.ndim == 1
    y = y.reshape(x.size, -1)
    n, k = y.shape
    a, b, c = triple if triple is not None else bit_triples(ctx, n, k)
    with ctx.step("and"):
        d_own, e_own = x ^ a, y ^ b
        d_peer, e_peer = exchange_bits(ctx, [d_own, e_own])
        d, e = d_own ^ d_peer, e_own ^ e_peer
        z = c ^ (d[:, None] & b) ^ (e & a[:, None])
        if ctx.party == 0:
            z ^= d[:, None] & e
    return z[:, 0] if squeeze else z


def and_(ctx, x: BShare, y: BShare) -> BShare:
    """Elementwise AND of two shared-bit tensors of the same shape."""
    if x.bits != 1 or y.bits != 1:
        raise ValueError("and_ works on shared bits (bits=1)")
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {x.shape} vs {y.shape}")
    z = and_bits(ctx, x.data.astype(np.uint8).reshape(-1), y.data.astype(np.uint8).reshape(-1))
    return BShare(ctx, z.reshape(x.shape).astype(np.uint64), 1)


register_kernel("and", and_)  # BShare & BShare (cipherlm.mpc.shares)

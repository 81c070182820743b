"""Conversion between shares over a prime field Z_q and over Z_{2^l}
(BLB appendix C.3, after BOLT and SiRNN's extension protocol).

`field_to_ring`: x = x0 + x1 mod q, signed (|x| < q/2).  Party 0 adds H =
floor(q/2) so u = x + H lies in [0, q); u = u0 + u1 - q w with
w = 1{u0 + u1 >= q} = 1{q - 1 - u0 < u1} (one millionaire on ceil(log2 q)
bits).  Over Z_{2^l}: u_i - q W_i (W from a COT of l bits), then party 0
subtracts H.  Exact (requires q < 2^l if the value should fit the ring).
Cost per element: millionaire(ceil(log2 q)) + COT(l).

`ring_to_field`:
  * ``method="exact"``: u = x + 2^(l-1) (party 0), w = wrap(u0, u1)
    (millionaire on l bits), u = u0 + u1 - 2^l w, so over Z_q the shares are
    u_i mod q - (2^l mod q) W_i with W a Z_q sharing of w (one chosen OT of
    log q bits), minus 2^(l-1) mod q.  Exact.
    Cost: millionaire(l) + one 1-of-2 OT of ceil(log2 q) bits.
  * ``method="local"`` (BLB C.3): each party reduces the signed
    representative of its share mod q.  Free; wrong (off by a multiple of
    2^l mod q) with probability about |x| / 2^(l-1), so only for values much
    smaller than the ring (e.g. |x| < 2^(l-41) gives < 2^-40).
  * ``method="extend"`` (BLB C.3 exactly): signed-extend to l + sigma bits
    (SiRNN), then "local".  Failure < 2^(l-(l+sigma)) relative.
"""

from __future__ import annotations

import numpy as np

from ..ring import check_modulus, mask, mulmod_scalar, to_signed
from ..shares import AShare
from .b2a import b2a_bits, b2a_mod
from .extend import sext_bits
from .millionaire import millionaire

__all__ = ["field_to_ring", "ring_to_field"]


def field_to_ring(ctx, x: np.ndarray, q: int, bits: int | None = None, frac: int | None = None, signed: bool = True) -> AShare:
    """This party's Z_q share (uint64 < q) -> AShare over Z_{2^bits} of the same (signed) integer."""
    q = check_modulus(q)
    bits = ctx.ring.bits if bits is None else bits
    x = np.asarray(x, np.uint64)
    shape = x.shape
    x = x.reshape(-1)
    Q = np.uint64(q)
    if np.any(x >= Q):
        raise ValueError("field shares must be reduced mod q")
    H = q // 2 if signed else 0
    with ctx.step("field_to_ring"):
        u = (x + np.uint64(H)) % Q if ctx.party == 0 else x
        lq = int(q - 1).bit_length()
        v = (np.uint64(q - 1) - u) if ctx.party == 0 else u
        w = millionaire(ctx, v, lq)
        W = b2a_bits(ctx, w, bits)
        out = u - np.uint64(q % (1 << 64)) * W
        if ctx.party == 0:
            out = out - np.uint64(H)
    return AShare(ctx, (out & mask(bits)).reshape(shape), bits, frac)


def ring_to_field(ctx, x: AShare, q: int, method: str = "exact", sigma: int = 40) -> np.ndarray:
    """AShare over Z_{2^l} (signed) -> this party's share in Z_q (uint64 < q)."""
    q = check_modulus(q)
    bits = x.bits
    xs = x.data.reshape(-1)
    Q = np.uint64(q)
    with ctx.step("ring_to_field"):
        if method == "local":
            out = _local_mod(to_signed(xs, bits), q)
        elif method == "extend":
            big = bits + int(sigma)
            if big > 64:
                raise ValueError(f"extend method needs l + sigma <= 64, got {bits} + {sigma}")
            y = sext_bits(ctx, xs, bits, big)
            out = _local_mod(to_signed(y, big), q)
        elif method == "exact":
            half = 1 << (bits - 1)
            u = (xs + np.uint64(half)) & mask(bits) if ctx.party == 0 else xs
            v = (mask(bits) - u) if ctx.party == 0 else u
            w = millionaire(ctx, v, bits)
            W = b2a_mod(ctx, w, q)
            out = (u % Q + Q - mulmod_scalar(W, (1 << bits) % q, q)) % Q
            if ctx.party == 0:
                out = (out + Q - np.uint64(half % q)) % Q
        else:
            raise ValueError(f"unknown method {method!r}")
    return out.reshape(x.shape)


def _local_mod(s: np.ndarray, q: int) -> np.ndarray:
    # signed int64 -> [0, q)
    return np.mod(s, np.int64(q)).astype(np.uint64)

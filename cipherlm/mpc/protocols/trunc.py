"""Truncation (right shift) of shared fixed-point values.

`trunc_faithful` (CrypTFlow2 section 5, SiRNN section 3.4 "logical/arithmetic
right shift"): exact floor(x / 2^s) for signed x.  With x_u = x + 2^(l-1)
(party 0 adds), x_u,i = 2^s u_i + lo_i:

    x_u >> s = u_0 + u_1 + c - 2^(l-s) w,
    c = 1{lo_0 + lo_1 >= 2^s}        (millionaire on s bits),
    w = 1{x_u,0 + x_u,1 >= 2^l} = lt_H XOR (eq_H AND c), with lt_H / eq_H =
        1{u_0 + u_1 >= / = 2^(l-s) [- 1]} from one millionaire on the top
        l - s bits (its eq output) and one AND,

c converted with a COT of l bits, w with a COT of s bits (only 2^(l-s) w
mod 2^l matters); finally subtract 2^(l-1-s).  Error: none.
Cost per element: millionaire(l - s) + millionaire(s) + AND + COT(l) + COT(s).

`trunc_local` (SecureML section 3.1, BLB appendix C.4): party 0 computes
x_0 >> s, party 1 computes -((-x_1) >> s); no communication.  The result is
floor(x / 2^s) + {0, 1} except with probability about |x| / 2^(l-1) (a "big"
error of about 2^(l-s)).

`trunc_extend` (BLB appendix C.4, extend-then-truncate): signed-extend x from
l to l' = l + sigma bits (SiRNN, `extend.sext`), truncate locally in
Z_{2^l'}, reduce mod 2^l.  Off by at most one, failure probability below
|x| / 2^(l'-1) = 2^-sigma relative.  Cost: one signed extension
(millionaire(l) + COT(sigma)).
"""

from __future__ import annotations

import numpy as np

from ..ring import mask
from ..shares import AShare, register_kernel
from .b2a import b2a_bits
from .bool_ops import and_bits
from .compare import wrap_bits
from .millionaire import millionaire
from .extend import sext_bits

__all__ = ["trunc_local", "trunc_faithful", "trunc_extend"]


def _check_shift(s: int, bits: int) -> int:
    s = int(s)
    if not 0 <= s < bits:
        raise ValueError(f"shift {s} must be in 0..{bits - 1}")
    return s


def trunc_local_bits(ctx, x: np.ndarray, s: int, bits: int) -> np.ndarray:
    x = np.asarray(x, np.uint64) & mask(bits)
    sh = np.uint64(s)
    if ctx.party == 0:
        return x >> sh
    neg = (np.uint64(0) - x) & mask(bits)
    return (np.uint64(0) - (neg >> sh)) & mask(bits)


def trunc_local(ctx, x: AShare, s: int) -> AShare:
    """SecureML probabilistic local truncation by s bits (free)."""
    s = _check_shift(s, x.bits)
    return AShare(ctx, trunc_local_bits(ctx, x.data, s, x.bits), x.bits, x.frac - s)


def trunc_faithful(ctx, x: AShare, s: int) -> AShare:
    """Exact arithmetic shift floor(x / 2^s) of signed x (|x| < 2^(l-1))."""
    bits = x.bits
    s = _check_shift(s, bits)
    if s == 0:
        return x
    half = np.uint64(1 << (bits - 1))
    xs = x.data.reshape(-1)
    with ctx.step("trunc"):
        xu = (xs + half) & mask(bits) if ctx.party == 0 else xs
        lo = xu & mask(s)
        hi = xu >> np.uint64(s)
        c = wrap_bits(ctx, lo, s)
        # w = 1{hi0 + hi1 >= 2^(l-s)} XOR (c AND 1{hi0 + hi1 = 2^(l-s) - 1}): a millionaire on
        # the top l - s bits only (with its eq output) and one AND (SiRNN section 3.4)
        vh = (mask(bits - s) - hi) if ctx.party == 0 else hi
        lt_h, eq_h = millionaire(ctx, vh, bits - s, want_eq=True)
        w = lt_h ^ and_bits(ctx, eq_h, c)
        C = b2a_bits(ctx, c, bits)
        W = b2a_bits(ctx, w, s)
        out = (xu >> np.uint64(s)) + C - (W << np.uint64(bits - s))
        if ctx.party == 0:
            out = out - np.uint64(1 << (bits - 1 - s))
    return AShare(ctx, (out & mask(bits)).reshape(x.shape), bits, x.frac - s)


def trunc_extend(ctx, x: AShare, s: int, sigma: int | None = None) -> AShare:
    """BLB extend-then-truncate: sext to l + sigma bits (default up to 64), local shift, mod 2^l."""
    bits = x.bits
    s = _check_shift(s, bits)
    if bits >= 64:
        raise ValueError("extend-then-truncate needs a ring narrower than 64 bits")
    big = 64 if sigma is None else min(64, bits + int(sigma))
    with ctx.step("trunc_extend"):
        y = sext_bits(ctx, x.data.reshape(-1), bits, big)
        t = trunc_local_bits(ctx, y, s, big)
    return AShare(ctx, (t & mask(bits)).reshape(x.shape), bits, x.frac - s)


register_kernel("trunc_local", trunc_local)  # AShare.mul_public_fixed (cipherlm.mpc.shares)

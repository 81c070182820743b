"""MSB, DReLU, wrap bits, comparison and ReLU (CrypTFlow2 section 4.1 "DReLU", Algorithm 3).

x = x0 + x1 mod 2^l; write x_i = msb_i 2^(l-1) + x'_i.  Then
MSB(x) = msb_0 XOR msb_1 XOR carry with carry = 1{x'_0 + x'_1 >= 2^(l-1)}
= 1{2^(l-1) - 1 - x'_0 < x'_1}: one millionaire on l-1 bits.  DReLU = 1 XOR MSB.

wrap(x0, x1) = 1{x0 + x1 >= 2^l} = 1{2^l - 1 - x0 < x1}: one millionaire on l
bits (used by truncation and extension, SiRNN section 3.1).

Costs per element: those of `millionaire.millionaire` on l-1 (MSB) or l
(wrap) bits; `relu` adds one `mux`.

Mixed bit widths (SiRNN section 3, "the bits that matter"): reduction mod 2^k is
a ring homomorphism, so the shares of x reduced mod 2^k locally are shares of
x mod 2^k, whose MSB is the sign of x whenever |x| < 2^(k-1).  `msb` and `drelu`
take ``bits = k`` for callers that know such a bound (`range_bits` turns a bound
in real units into k): the millionaire then runs on k - 1 bits instead of l - 1
(at k = 38, 40 % fewer bytes than at l = 64).  Outside the bound the result is
garbage, so the bound is part of each caller's documented input range.
"""

from __future__ import annotations

import math

import numpy as np

from ..ring import mask
from ..shares import AShare, BShare
from .millionaire import millionaire
from .mux import mux

__all__ = ["msb", "drelu", "wrap_bits", "less_than", "relu", "range_bits"]


def range_bits(bound: float, frac: int, bits: int) -> int:
    """The ring width k whose MSB gives the sign of any x with |x| <= bound (real units)
    at ``frac`` fraction bits: |x| 2^frac <= 2^(k - 2), one bit of margin; at most ``bits``."""
    if not bound > 0:
        raise ValueError(f"the bound must be positive, got {bound!r}")
    return int(min(bits, max(2, math.ceil(math.log2(bound)) + frac + 2)))


def msb_bits(ctx, x: np.ndarray, bits: int) -> np.ndarray:
    x = np.asarray(x, np.uint64)
    top = (x >> np.uint64(bits - 1)) & np.uint64(1)
    low = x & mask(bits - 1) if bits > 1 else np.zeros_like(x)
    with ctx.step("msb"):
        if bits == 1:
            carry = np.zeros(x.shape, np.uint8)
        else:
            v = (mask(bits - 1) - low) if ctx.party == 0 else low
            carry = millionaire(ctx, v, bits - 1)
    return top.astype(np.uint8) ^ carry


def msb(ctx, x: AShare, bits: int | None = None) -> BShare:
    """Boolean sharing of the most significant bit of x (1 iff x < 0 signed).
    ``bits = k``: computed on x mod 2^k, the sign of x when |x| < 2^(k-1) (module docstring)."""
    k = x.bits if bits is None else int(bits)
    if not 1 <= k <= x.bits:
        raise ValueError(f"msb: bits must be in 1..{x.bits}, got {bits!r}")
    return BShare(ctx, msb_bits(ctx, x.data & mask(k), k).astype(np.uint64), 1)


def drelu(ctx, x: AShare, bits: int | None = None) -> BShare:
    """Boolean sharing of 1{x >= 0} (signed; ``bits`` as in `msb`)."""
    return msb(ctx, x, bits) ^ 1


def wrap_bits(ctx, x: np.ndarray, bits: int) -> np.ndarray:
    """Shares (uint8) of 1{x0 + x1 >= 2^bits} for this party's share x (unsigned, bits wide)."""
    x = np.asarray(x, np.uint64) & mask(bits)
    with ctx.step("wrap"):
        v = (mask(bits) - x) if ctx.party == 0 else x
        return millionaire(ctx, v, bits)


def less_than(ctx, x: AShare, y: AShare) -> BShare:
    """1{x < y} for signed x, y with |x - y| < 2^(l-1)."""
    return msb(ctx, x - y)


def relu(ctx, x: AShare) -> AShare:
    """max(x, 0) = DReLU(x) * x."""
    return mux(ctx, drelu(ctx, x), x)

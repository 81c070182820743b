"""MSB, DReLU, wrap bits, comparison and ReLU (CrypTFlow2 section 4.1 "DReLU", Algorithm 3).

x = x0 + x1 mod 2^l; write x_i = msb_i 2^(l-1) + x'_i.  Then
MSB(x) = msb_0 XOR msb_1 XOR carry with carry = 1{x'_0 + x'_1 >= 2^(l-1)}
= 1{2^(l-1) - 1 - x'_0 < x'_1}: one millionaire on l-1 bits.  DReLU = 1 XOR MSB.

wrap(x0, x1) = 1{x0 + x1 >= 2^l} = 1{2^l - 1 - x0 < x1}: one millionaire on l
bits (used by truncation and extension, SiRNN section 3.1).

Costs per element: those of `millionaire.millionaire` on l-1 (MSB) or l
(wrap) bits; `relu` adds one `mux`.
"""

from __future__ import annotations

import numpy as np

from ..ring import mask
from ..shares import AShare, BShare
from .millionaire import millionaire
from .mux import mux

__all__ = ["msb", "drelu", "wrap_bits", "less_than", "relu"]


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


def msb(ctx, x: AShare) -> BShare:
    """Boolean sharing of the most significant bit of x (1 iff x < 0 signed)."""
    return BShare(ctx, msb_bits(ctx, x.data, x.bits).astype(np.uint64), 1)


def drelu(ctx, x: AShare) -> BShare:
    """Boolean sharing of 1{x >= 0} (signed)."""
    return msb(ctx, x) ^ 1


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

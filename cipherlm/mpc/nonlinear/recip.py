"""Reciprocal and reciprocal square root by Newton iteration from a bracket guess
(SiRNN section 5 / Bumblebee: a good initial approximation, then Newton).

Initial guess: comparisons with the powers of two 2^k covering [lo, hi] (one
batched MSB) give the one-hot bracket x in [2^k, 2^(k+1)); y0 = sum_k c_k
B2A(onehot_k) with public c_k (the minimax constant of the bracket:
1/(1.5 2^k) for 1/x, relative error <= 1/3; 2^(-k/2) / 1.2071^(1/2)... for
1/sqrt(x), relative error <= 0.19).
Newton: 1/x: y <- y (2 - x y) (relative error squares each step);
1/sqrt(x): y <- y (3 - x y^2) / 2.
Defaults: 3 iterations each (1/x: relative error <= (1/3)^8 = 1.5e-4;
1/sqrt: <= 4e-5) plus fixed-point rounding.  Inputs outside [lo, hi] give 0.
Cost per element: millionaire(63) x (#powers of two) + B2A x #brackets +
2 (reciprocal) or 3 (rsqrt) fixed-point multiplications per iteration.
"""

from __future__ import annotations

import math

import numpy as np

from ..ring import fixed_encode
from ..shares import AShare, BShare
from ..protocols.b2a import b2a_bits
from .common import compare_public, const, mulf


def _bracket_guess(ctx, x: AShare, lo: float, hi: float, value) -> AShare:
    if not 0 < lo < hi:
        raise ValueError("need 0 < lo < hi")
    k0, k1 = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    ks = list(range(k0, k1 + 1))
    b = compare_public(ctx, x, [2.0 ** k for k in ks])  # 1{x < 2^k}
    onehot = b.data[1:] ^ b.data[:-1]  # x in [2^k, 2^(k+1)) for k = ks[:-1]
    B = b2a_bits(ctx, onehot.reshape(-1), x.bits).reshape(onehot.shape)
    c = fixed_encode(np.array([value(2.0 ** k) for k in ks[:-1]]), x.frac, x.bits)
    y0 = (B * c.reshape((-1,) + (1,) * x.ndim)).sum(axis=0, dtype=np.uint64)
    return AShare(ctx, y0, x.bits, x.frac)


def reciprocal(ctx, x: AShare, lo: float = 2.0 ** -4, hi: float = 2.0 ** 12, iters: int = 3) -> AShare:
    """1/x for x in [lo, hi]."""
    y = _bracket_guess(ctx, x, lo, hi, lambda a: 1.0 / (1.5 * a))
    for _ in range(iters):
        y = mulf(ctx, y, const(ctx, x, 2.0) - mulf(ctx, x, y))
    return y


def rsqrt(ctx, x: AShare, lo: float = 2.0 ** -8, hi: float = 2.0 ** 16, iters: int = 3) -> AShare:
    """1/sqrt(x) for x in [lo, hi]."""
    y = _bracket_guess(ctx, x, lo, hi, lambda a: 2.0 / (math.sqrt(a) + math.sqrt(2 * a)))
    for _ in range(iters):
        t = mulf(ctx, mulf(ctx, x, y), y)  # (x y) y keeps precision when y is small
        y = mulf(ctx, y, const(ctx, x, 3.0) - t).mul_public_fixed(0.5)
    return y

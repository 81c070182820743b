"""Zero and signed extension of shares from Z_{2^m} to Z_{2^n}, n > m (SiRNN section 3.1, Algorithm 2 / "Zero extension").

x = x0 + x1 - 2^m w with w = wrap(x0, x1) = 1{x0 + x1 >= 2^m} (one
millionaire on m bits).  Over Z_{2^n} the shares are x_i - 2^m W_i where W is
an arithmetic sharing of w; since 2^m W only matters mod 2^n, W is needed
mod 2^(n-m) only (a COT of n - m bits, SiRNN's optimisation).

Signed extension: shift into the unsigned range by adding 2^(m-1) (party 0),
zero-extend, subtract 2^(m-1) in the larger ring.

Cost per element: millionaire(m) + one COT of n - m bits.
"""

from __future__ import annotations

import numpy as np

from ..ring import check_bits, mask
from ..shares import AShare
from .b2a import b2a_bits
from .compare import wrap_bits

__all__ = ["zext", "sext", "zext_bits", "sext_bits"]


def zext_bits(ctx, x: np.ndarray, m: int, n: int) -> np.ndarray:
    check_bits(m)
    check_bits(n)
    if n < m:
        raise ValueError(f"extension target {n} bits is smaller than the source {m} bits")
    x = np.asarray(x, np.uint64).reshape(-1) & mask(m)
    if n == m:
        return x
    with ctx.step("extend"):
        w = wrap_bits(ctx, x, m)
        W = b2a_bits(ctx, w, n - m)
    return (x - (W << np.uint64(m))) & mask(n)


def sext_bits(ctx, x: np.ndarray, m: int, n: int) -> np.ndarray:
    x = np.asarray(x, np.uint64).reshape(-1)
    half = np.uint64(1 << (m - 1))
    if ctx.party == 0:
        x = x + half
    y = zext_bits(ctx, x, m, n)
    if ctx.party == 0:
        y = y - half
    return y & mask(n)


def zext(ctx, x: AShare, n: int) -> AShare:
    """Shares over Z_{2^n} of the unsigned value of x (n >= x.bits)."""
    return AShare(ctx, zext_bits(ctx, x.data, x.bits, n).reshape(x.shape), n, x.frac)


def sext(ctx, x: AShare, n: int) -> AShare:
    """Shares over Z_{2^n} of the signed value of x (n >= x.bits)."""
    return AShare(ctx, sext_bits(ctx, x.data, x.bits, n).reshape(x.shape), n, x.frac)

"""exp on non-positive inputs (Bumblebee section 4.2 "clipped Taylor", BLB appendix B):

    exp(x) ~ 0 for x < -T,   (1 + x / 2^n)^(2^n) otherwise   (T = 14, n = 8).

x / 2^n is a local shift; n squarings (one cross term each); the clip is one
MSB and one MUX (y - 1{x < -T} y, exact in the ring, so the garbage computed
for very negative x cancels).  Max abs error on [-14, 0]: 0.0011 (n = 8) plus
fixed-point rounding; exp(-14) = 8e-7 below the clip.
Cost per element: n squarings + millionaire(63) + one MUX.
"""

from __future__ import annotations

from ..shares import AShare
from ..protocols import mux as _mux
from ..protocols.trunc import trunc_local
from .common import compare_public, sqf

T_CLIP = 14.0
N_SQUARE = 8


def exp_neg(ctx, x: AShare, n: int = N_SQUARE, clip: float = T_CLIP) -> AShare:
    """exp(x) for x <= 0 (x > 0 is not supported: the result would overflow)."""
    below = compare_public(ctx, x, [-clip])[0]
    y = AShare(ctx, trunc_local(ctx, x, n).data, x.bits, x.frac).add_public_fixed(1.0)
    for _ in range(n):
        y = sqf(ctx, y)
    return y - _mux.mux(ctx, below, y)

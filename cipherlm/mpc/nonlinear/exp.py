"""exp on non-positive inputs (Bumblebee section 4.2 "clipped Taylor", BLB
appendix B, with a fitted quadratic instead of 1 + t and fewer squarings):

    exp(x) ~ 0 for x < -T,   p(x / 2^n)^(2^n) otherwise   (T = 14, n = 4),
    p(t) = 1 + a1 t + a2 t^2.

a1 t = (a1 / 16) x and s = (sqrt(a2) / 16) x are public products of x (local,
one truncation each), s^2 = a2 t^2 one squaring; then n squarings: 5 squarings
instead of 8 for (1 + x / 2^8)^(2^8).  Range and fit: t in [-7/8, 0],
a1, a2 minimise max |p(x/16)^16 - exp(x)| / (exp(x) + 0.03) on [-14, 0]
(Lawson's weighted minimax on p(t) - e^t, weight 16 e^(15t) / (e^(16t) +
0.03), p(0) = 1): abs error <= 1.13e-3 on [-14, 0] (relative <= 4e-3 on
[-4, 0]), exp(-14) = 8e-7 below the clip.  The relative weight keeps softmax
accurate: a pure absolute minimax (equal-ripple error of both signs) of
p(x/8)^8 had the same exp error but 2.7x the old softmax error; this fit, in
real arithmetic, gives softmax errors 7e-4 on random rows of 16-128 entries
(old n = 8: 4e-3) and 6.5e-3 on the worst two-level rows [0, k1 x1, k2 x2]
(old: 1.3e-2).  Rounding: (a1/16) x, s and s^2 give |dp| <= 3.2 ulp, amplified
16 p^15 times by the powers (<= 51 ulp = 7.8e-4 where exp(x) ~ 1); the four
squarings +-1 ulp each, amplified 8, 4, 2, 1 times (15 ulp = 2.3e-4).
Total <= 2.1e-3 (bench and tests: 5e-3).  The old n = 8 had 1.1e-3 of
approximation error but its 1 + x/256 carried 1 ulp amplified 256 times
(3.9e-3 near 0; measured 4.5e-3 at 65536 with the bench inputs).
The clip is one MSB and one MUX (y - 1{x < -T} y, exact in the ring, so the
garbage computed for very negative x cancels).
Cost per element: n + 1 squarings + millionaire(63) + one MUX.
"""

from __future__ import annotations

import math

from ..shares import AShare
from ..protocols import mux as _mux
from .common import compare_public, const, sqf

T_CLIP = 14.0
N_SQUARE = 4
EXP_P = (0.9945680730127718, 0.4364287150257249)  # a1, a2 for n = 4, T = 14
_PREC = 20  # fraction bits of the public constants a1 / 16, sqrt(a2) / 16


def exp_neg(ctx, x: AShare) -> AShare:
    """exp(x) for x <= 0 (x > 0 is not supported: the result would overflow)."""
    below = compare_public(ctx, x, [-T_CLIP])[0]
    a1, a2 = EXP_P
    d = 2.0 ** N_SQUARE
    s = x.mul_public_fixed(math.sqrt(a2) / d, frac=_PREC)
    y = x.mul_public_fixed(a1 / d, frac=_PREC) + sqf(ctx, s) + const(ctx, x, 1.0)
    for _ in range(N_SQUARE):
        y = sqf(ctx, y)
    return y - _mux.mux(ctx, below, y)

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

`exp_reduced` (BLB appendix B, algorithm 4: the softmax's exp split so that
only a small core runs in MPC): exp(x) on x in [lo, 0] for a small public
lo (-1/2 <= lo < 0; the caller feeds x = (s - max) 2^-6 with lo = -14/64 or
-16/64, and the HE side squares the result 6 times, multiplying its RELATIVE
error by 64).  Inputs below lo are clipped to lo first (one MSB, one MUX:
x_c = x + 1{x < lo} (lo - x), exact), so x < lo gives exp(lo), never garbage.
Then p(x_c) = c0 + c1 x_c + x_c^2 (c2 + c3 x_c [+ c4 x_c^2]), the relative
minimax polynomial of exp on [lo, 0] (Lawson's IRLS, weight e^-x, computed
once per lo at first use, cached), of the lowest degree in (3, 4) whose
relative fit error is <= 2^-19 (1/8 ulp at f = 16): degree 3 for lo = -1/4
(fit 1.28e-6; -14/64: 7.5e-7), degree 4 down to -1/2 (5.1e-7).  Degree 4
costs the same communication as 3 (the extra term c4 x^2 is a public
product of the square): one square and one product per element, two rounds.
Rounding: the whole polynomial is summed at scale 2^(2f) and truncated to f
once, so the result carries one local truncation (stochastic rounding,
|error| < 1 ulp = 2^-f, unbiased) and little else: x_c^2 is kept at f + 6
fraction bits (error 2^-(f+6) times |c2 + ...| <= 1/2), the bracket at f + 2
(error 2^-(f+2) times x^2 <= 1/16), their product truncated to 2f; c1 x as
x 2^f (exact) + (c1 - 1) x; constants with f + 4 .. f + 8 bits.  Bound at
f = 16, lo = -1/4: |p - exp| <= 2^-16 + 3.6e-7 + 1.3e-6 = 1.7e-5 absolute,
2.2e-5 relative at x = lo.  Measured (tests/test_blb_cores.py, every
fixed-point input of [-1/4, 0]): 2.0e-5 relative (lo = -14/64: 1.9e-5;
lo = -1/2, degree 4: 2.3e-5).  After the 6 squarings: <= 64 x 2.2e-5 = 1.4e-3
relative (measured 1.6e-3 against exp(s) on s in [-10, 0], which includes the
quantisation of s / 64 to 2^-16: up to 64 x 2^-17 = 4.9e-4).
Failure probability (local truncations, |value| 2^scale / 2^(l-1) each): the
largest is the product at scale 2^(2f+8), |x^2 (c2 + ...)| <= 2^-4.9 at
lo = -1/4: about 2^-28 per element (exp_neg's constants: 2^-27).
Cost per element: millionaire (38-bit MSB) + one MUX + one square + one
product (l = 64): about 480 B both ways at 65536 elements (exp_neg: 5 squarings).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..ring import fixed_encode
from ..shares import AShare
from ..protocols import mux as _mux
from . import common as _common
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
    # for x in [-T_CLIP, 0]: s^2 <= a2 (T_CLIP / d)^2 = 0.34 and 0 < y <= 1 before and after
    # every square, so the squares run in the narrow ring of that range (`common.product`);
    # below -T_CLIP the values are wrong either way and the final MUX discards them
    y = x.mul_public_fixed(a1 / d, frac=_PREC) + sqf(ctx, s, bound=1.0) + const(ctx, x, 1.0)
    for _ in range(N_SQUARE):
        y = sqf(ctx, y, bound=1.5)
    return y - _mux.mux(ctx, below, y)


#: exp_reduced: the supported range of lo, the degrees tried and the fit tolerance (relative)
EXP_REDUCED_LO_MIN = -0.5
EXP_REDUCED_DEGREES = (3, 4)
EXP_REDUCED_FIT_TOL = 2.0 ** -19


@lru_cache(maxsize=None)
def exp_reduced_poly(lo: float) -> tuple[tuple[float, ...], float]:
    """(c0..cd, relative fit error): the relative minimax polynomial of exp on [lo, 0] of
    the lowest degree in EXP_REDUCED_DEGREES within EXP_REDUCED_FIT_TOL (Lawson's IRLS on a
    dense grid, weight e^-x; deterministic)."""
    lo = float(lo)
    if not EXP_REDUCED_LO_MIN <= lo < 0.0:
        raise ValueError(f"exp_reduced: lo must be in [{EXP_REDUCED_LO_MIN}, 0), got {lo}")
    x = np.linspace(lo, 0.0, 20001)
    y = np.exp(x)
    for deg in EXP_REDUCED_DEGREES:
        A = np.stack([x ** p for p in range(deg + 1)], axis=1)
        w = np.full(x.size, 1.0 / x.size)
        for _ in range(40):
            sw = np.sqrt(w) / y
            c, *_ = np.linalg.lstsq(A * sw[:, None], y * sw, rcond=None)
            w = w * (np.abs(A @ c - y) / y + 1e-18)
            w /= w.sum()
        err = float((np.abs(A @ c - y) / y).max())
        if err <= EXP_REDUCED_FIT_TOL:
            break
    return tuple(float(v) for v in c), err


def _rescale(ctx, v: AShare, s: int) -> AShare:
    return _common._rescale(ctx, v, s, _common.TRUNC)


def _times_public(v: AShare, c: float, prec: int) -> AShare:
    """v * c without truncation (scale v.frac + prec, exact up to c's encoding)."""
    return v._like(v.data * fixed_encode(c, prec, v.bits) & v.mask, frac=v.frac + prec)


def exp_reduced(ctx, x: AShare, lo: float) -> AShare:
    """exp(x) for x in [lo, 0], -1/2 <= lo < 0 (public); x < lo gives exp(lo) (clipped).
    Relative error <= 2.2e-5 at f = 16, lo = -1/4 (see the module doc)."""
    coeffs, _ = exp_reduced_poly(float(lo))
    lo = float(lo)
    f = x.frac
    F1, F2, P = f + 6, f + 2, f + 4  # x^2, the bracket, the bracket's constants
    xc = _common.clip_min(ctx, x, lo)
    # narrow products (`common.product`): x^2 <= lo^2 <= 1/4, |x^2 bracket| <= 1/4 (|c_i| < 1)
    q = _common.product(ctx, xc, None, 2 * f - F1, bound=lo * lo)          # x^2, frac F1
    br = _rescale(ctx, _times_public(xc, coeffs[3], P), f + P - F2)       # c3 x, frac F2
    br = br.add_public_fixed(coeffs[2])
    if len(coeffs) > 4:
        br = br + _rescale(ctx, _times_public(q, coeffs[4], P), F1 + P - F2)
    hi = _common.product(ctx, q, br, F1 + F2 - 2 * f, bound=0.5)           # x^2 (c2 + ...), frac 2f
    lin = xc._like((xc.data << np.uint64(f)) & xc.mask, frac=2 * f)         # x, frac 2f (exact)
    lin = lin + _rescale(ctx, _times_public(xc, coeffs[1] - 1.0, f + 8), 8)
    y = (hi + lin).add_public_fixed(coeffs[0])
    return _rescale(ctx, y, f)

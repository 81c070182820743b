"""Piecewise polynomials on shares: GeLU and SiLU (BOLT section 5 / BLB
appendix B: a low-degree polynomial on a central interval, ReLU outside).

`gelu` and `silu` use the symmetry both functions share: f(x) - x/2 is even
and tends to |x|/2, so with a = |x|

    f(x) = x/2 + Q(a),   Q(a) = P(a) for a < T,  a/2 for a >= T,

with P a degree-4 polynomial in a (all powers 0..4, least squares on [0, T],
fitted at import, deterministic).  That needs two comparisons (the sign of x,
then a < T), three MUXes and the powers a^2, a^3, a^4 of min(a, T) (two
squares, one product): about 7.7 kB per element at l = 64 instead of the
12.9 kB of a three-segment degree-6 `piecewise_poly`, and 3-5x smaller errors
(max abs, measured on a dense grid and in tests: GeLU <= 0.005 with T = 3,
SiLU <= 0.016 with T = 6).  BOLT's GeLU uses the same |x| form (degree 4,
T = 2.7, without the cubic term: error 0.026 here).

`piecewise_poly` (general: 0 below breaks[0], a polynomial per interval,
identity above) evaluates

    res = P_k + sum_{i=1}^{k-1} 1{x < t_i} (P_i - P_{i+1}) + 1{x < t_0} (0 - P_1)
              + 1{x >= t_k} (x - P_k)

(k+1 comparisons in one batched MSB, k+1+2 MUXes in one batched call) on x
clipped to [t_0, t_k]; powers up to degree d take ceil(log2 d) multiplication
rounds and are shared by all segments.
"""

from __future__ import annotations

from math import erf

import numpy as np

from ..shares import AShare
from .common import compare_public, const, mulf, mux_many, sqf


def _fit(f, a, b, deg):
    x = np.linspace(a, b, 4001)
    return np.polyfit(x, f(x), deg)[::-1]  # c0, c1, ...


_gelu_ref = np.vectorize(lambda v: 0.5 * v * (1.0 + erf(v / np.sqrt(2.0))))
_silu_ref = lambda v: v / (1.0 + np.exp(-v))  # noqa: E731

GELU_T = 3.0
SILU_T = 6.0
ABS_POWERS = (0, 1, 2, 3, 4)


def _fit_abs(f, T: float) -> np.ndarray:
    """Least-squares coefficients of f(a) - a/2 on [0, T] in the powers ABS_POWERS of a."""
    a = np.linspace(0.0, T, 20001)
    A = np.stack([a ** p for p in ABS_POWERS], axis=1)
    c, *_ = np.linalg.lstsq(A, f(a) - a / 2, rcond=None)
    return c


GELU_ABS = _fit_abs(_gelu_ref, GELU_T)
SILU_ABS = _fit_abs(_silu_ref, SILU_T)


def _powers(ctx, x: AShare, deg: int) -> list[AShare]:
    p = [None, x]
    for k in range(2, deg + 1):
        p.append(None)
    # square-and-multiply by rounds: p[2k] = p[k]^2, p[2k+1] = p[2k] * x
    k = 2
    while k <= deg:
        p[k] = sqf(ctx, p[k // 2]) if k % 2 == 0 else mulf(ctx, p[k - 1], x)
        k += 1
    return p


def piecewise_poly(ctx, x: AShare, breaks, polys, right_identity: bool = True) -> AShare:
    """Evaluate the piecewise polynomial (0 below breaks[0], polys[i] on
    [breaks[i], breaks[i+1]), x (or polys[-1]) above breaks[-1])."""
    k = len(polys)
    assert len(breaks) == k + 1
    lo, hi = breaks[0], breaks[-1]
    b = compare_public(ctx, x, breaks)  # 1{x < t_i}, i = 0..k
    above = b[k] ^ 1
    # clip: x_c = x + 1{x<lo}(lo - x) + 1{x>=hi}(hi - x)
    c1, c2 = mux_many(ctx, _stackb(b[0], above), [const(ctx, x, lo) - x, const(ctx, x, hi) - x])
    xc = x + c1 + c2
    deg = max(len(p) - 1 for p in polys)
    pw = _powers(ctx, xc, deg)
    P = []
    for coeffs in polys:
        acc = const(ctx, x, float(coeffs[0]))
        for j in range(1, len(coeffs)):
            acc = acc + pw[j].mul_public_fixed(float(coeffs[j]))
        P.append(acc)
    sel, vals = [b[0]], [-P[0]]
    for i in range(1, k):
        sel.append(b[i])
        vals.append(P[i - 1] - P[i])
    if right_identity:
        sel.append(above)
        vals.append(x - P[-1])
    terms = mux_many(ctx, _stackb(*sel), vals)
    res = P[-1]
    for t in terms:
        res = res + t
    return res


def _stackb(*bs):
    from ..shares import BShare
    return BShare(bs[0].ctx, np.stack([bb.data for bb in bs]), 1)


def half_plus_even(ctx, x: AShare, T: float, coeffs) -> AShare:
    """x/2 + Q(|x|), Q(a) = sum_p coeffs[p] a^p for a < T and a/2 beyond (see the module doc)."""
    neg = compare_public(ctx, x, [0.0])[0]
    (flip,) = mux_many(ctx, _stackb(neg), [x * -2])
    a = x + flip  # |x|
    inside = compare_public(ctx, a, [T])[0]  # a < T
    (d,) = mux_many(ctx, _stackb(inside), [a - const(ctx, a, T)])
    ac = const(ctx, a, T) + d  # min(a, T)
    pw = _powers(ctx, ac, max(ABS_POWERS))
    P = const(ctx, x, float(coeffs[0]))
    for p, c in zip(ABS_POWERS[1:], coeffs[1:]):
        P = P + pw[p].mul_public_fixed(float(c))
    half_a = a.mul_public_fixed(0.5)
    (out,) = mux_many(ctx, _stackb(inside ^ 1), [half_a - P])
    return x.mul_public_fixed(0.5) + P + out


def gelu(ctx, x: AShare) -> AShare:
    """GeLU(x) = x Phi(x) as x/2 + Q(|x|) (BOLT's |x| form, degree 4, T = 3); max abs error ~0.005."""
    return half_plus_even(ctx, x, GELU_T, GELU_ABS)


def silu(ctx, x: AShare) -> AShare:
    """SiLU(x) = x sigmoid(x) as x/2 + Q(|x|) (degree 4, T = 6); max abs error ~0.016."""
    return half_plus_even(ctx, x, SILU_T, SILU_ABS)


def swiglu(ctx, gate: AShare, up: AShare) -> AShare:
    """SwiGLU's elementwise part: silu(gate) * up (LLaMA MLP)."""
    from .common import mulf
    return mulf(ctx, silu(ctx, gate), up)

"""Piecewise polynomials on shares: GeLU (BOLT section 5 / BLB appendix B: zero
below, a low-degree polynomial per interval, identity above) and SiLU.

Coefficients are least-squares fits computed at import (deterministic) on the
intervals below; the polynomial is evaluated on x clipped to [t_0, t_k] so the
powers stay small (no truncation failures), and segments are selected with

    res = P_k + sum_{i=1}^{k-1} 1{x < t_i} (P_i - P_{i+1}) + 1{x < t_0} (0 - P_1)
              + 1{x >= t_k} (x - P_k)

(k+1 comparisons in one batched MSB, k+1+2 MUXes in one batched call).
Powers of the clipped input up to degree d take ceil(log2 d) multiplication
rounds and are shared by all segments.

Errors (max abs, vs the exact function, measured in tests): GeLU <= 0.02
(segments [-5, -1.97] degree 3, [-1.97, 3] degree 6); SiLU <= 0.04.
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

GELU_BREAKS = (-5.0, -1.97, 3.0)
GELU_POLYS = (_fit(_gelu_ref, -5.0, -1.97, 3), _fit(_gelu_ref, -1.97, 3.0, 6))
SILU_BREAKS = (-8.0, -2.5, 6.0)
SILU_POLYS = (_fit(_silu_ref, -8.0, -2.5, 3), _fit(_silu_ref, -2.5, 6.0, 6))


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


def gelu(ctx, x: AShare) -> AShare:
    """GeLU(x) = x Phi(x), BOLT-style piecewise polynomial; max abs error ~0.02."""
    return piecewise_poly(ctx, x, GELU_BREAKS, GELU_POLYS)


def silu(ctx, x: AShare) -> AShare:
    """SiLU(x) = x sigmoid(x); max abs error ~0.04."""
    return piecewise_poly(ctx, x, SILU_BREAKS, SILU_POLYS)


def swiglu(ctx, gate: AShare, up: AShare) -> AShare:
    """SwiGLU's elementwise part: silu(gate) * up (LLaMA MLP)."""
    from .common import mulf
    return mulf(ctx, silu(ctx, gate), up)

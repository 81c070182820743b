"""LayerNorm and RMSNorm on shares (Bumblebee section 4.3 / BLB appendix B).

Row statistics: the 1/d scaling is applied to the row sum (one value per row)
with a 24-bit encoding of 1/d and a faithful truncation (exact, cheap: per row,
not per element).  LayerNorm: mu = sum(x)/d, xc = x - mu,
var = sum(xc^2)/d, y = xc * rsqrt(var + eps) * gamma + beta.  RMSNorm:
y = x * rsqrt(mean(x^2) + eps) * gamma.  gamma/beta are public (the client
holds the norms' weights, see `split_params`).  rsqrt is called on
[var_lo, var_hi] (defaults 2^-8 .. 2^16: 12 brackets of [4^j, 4^(j+1)),
recip.py).
Error: that of rsqrt (<= 5.5e-5 rel + 3 ulp) plus fixed-point rounding of xc
and the truncations (~2^-f relative to |xc|); measured in tests.
Cost per element: one squaring (xc^2) and one product (xc r); rsqrt and the
row means are per row.
"""

from __future__ import annotations

import math

import numpy as np

from ..ring import fixed_encode
from ..shares import AShare
from ..protocols.trunc import trunc_faithful
from .common import mulf, sqf
from .recip import rsqrt

DIV_FRAC = 24


def _row_mean(ctx, x: AShare) -> AShare:
    s = x.sum(axis=-1, keepdims=True)
    d = x.shape[-1]
    p = AShare(ctx, s.data * fixed_encode(1.0 / d, DIV_FRAC, x.bits), x.bits, x.frac + DIV_FRAC)
    return trunc_faithful(ctx, p, DIV_FRAC)


def _affine(ctx, y: AShare, gamma, beta) -> AShare:
    if gamma is not None:
        y = y.mul_public_fixed(np.broadcast_to(np.asarray(gamma, np.float64), y.shape))
    if beta is not None:
        y = y.add_public_fixed(np.broadcast_to(np.asarray(beta, np.float64), y.shape))
    return y


def normalized_bound(d: int) -> float:
    """A bound on |x_i| / sqrt(mean_j x_j^2) over a row of d values (sqrt(d): one value holds
    the whole row's energy), with 10 % for rsqrt's error and the mean's roundings, plus one
    unit: the range of the normalising product (`common.product`'s narrow ring)."""
    return 1.1 * math.sqrt(d) + 1.0


def layer_norm(ctx, x: AShare, gamma=None, beta=None, eps: float = 1e-5, var_lo: float = 2.0 ** -8,
               var_hi: float = 2.0 ** 16) -> AShare:
    mu = _row_mean(ctx, x)
    xc = x - mu.broadcast_to(x.shape)
    var = _row_mean(ctx, sqf(ctx, xc)).add_public_fixed(eps)
    r = rsqrt(ctx, var, var_lo, var_hi)
    # full ring on purpose: the HE product already holds xc's upload from the square above
    # (a narrow product would upload xc mod 2^k again: 24.1 -> 25.2 MB at 128 x 768)
    return _affine(ctx, mulf(ctx, xc, r.broadcast_to(x.shape)), gamma, beta)


def rms_norm(ctx, x: AShare, gamma=None, eps: float = 1e-6, var_lo: float = 2.0 ** -8,
             var_hi: float = 2.0 ** 16) -> AShare:
    ms = _row_mean(ctx, sqf(ctx, x)).add_public_fixed(eps)
    r = rsqrt(ctx, ms, var_lo, var_hi)
    return _affine(ctx, mulf(ctx, x, r.broadcast_to(x.shape)), gamma, None)  # full ring: as in layer_norm

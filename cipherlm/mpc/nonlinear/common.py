"""Shared helpers: fixed-point multiply/square with rescaling, batched comparisons
with public thresholds, batched multiplexers."""

from __future__ import annotations

import numpy as np

from ..ring import fixed_encode
from ..shares import AShare, BShare
from ..protocols import compare, mul as _mul, mux as _mux, trunc as _trunc

TRUNC = "local"


def _rescale(ctx, p: AShare, s: int, how: str) -> AShare:
    if how == "local":
        return _trunc.trunc_local(ctx, p, s)
    if how == "faithful":
        return _trunc.trunc_faithful(ctx, p, s)
    raise ValueError(f"unknown truncation {how!r}")


def mulf(ctx, x: AShare, y: AShare, how: str | None = None) -> AShare:
    """Fixed-point x * y at x's scale (the product may be one unit off before the
    truncation, `mul` with ``exact=False``: below the truncation's own error)."""
    return _rescale(ctx, _mul.mul(ctx, x, y, exact=False), y.frac, how or TRUNC)


def sqf(ctx, x: AShare, how: str | None = None) -> AShare:
    """Fixed-point x^2 (``exact=False`` as in `mulf`)."""
    return _rescale(ctx, _mul.square(ctx, x, exact=False), x.frac, how or TRUNC)


#: the largest |x| (real units) a comparison of the nonlinear library is correct for: its
#: MSB runs on `compare.range_bits(COMPARE_BOUND + max |t|, frac, l)` bits (38 at f = 16
#: instead of 64; SiRNN's mixed bit widths).  2^20 is far above the activations the
#: functions are used on (GeLU/SiLU pre-activations, exp after the max subtraction with
#: masks at -1024, softmax sums <= the context length, variances of the norms)
COMPARE_BOUND = 2.0 ** 20


def compare_public(ctx, x: AShare, thresholds, bound: float = COMPARE_BOUND) -> BShare:
    """Shared bits 1{x < t_k} for public reals t_k, shape (K, *x.shape), one batched MSB,
    on the bits that matter for |x| <= ``bound`` (`compare.range_bits`)."""
    ts = np.asarray(thresholds, dtype=np.float64)
    enc = fixed_encode(ts, x.frac, x.bits)
    d = np.stack([(x - enc[k]).data for k in range(len(ts))])
    bits = compare.range_bits(bound + float(np.abs(ts).max(initial=0.0)), x.frac, x.bits)
    return compare.msb(ctx, AShare(ctx, d, x.bits, x.frac), bits)


def mux_many(ctx, bits: BShare, vals: list[AShare]) -> list[AShare]:
    """[bits[k] * vals[k]] in one batched MUX."""
    v = AShare(ctx, np.stack([a.data for a in vals]), vals[0].bits, vals[0].frac)
    out = _mux.mux(ctx, bits, v)
    return [out[k] for k in range(len(vals))]


def const(ctx, x: AShare, v: float) -> AShare:
    """A public constant as a share shaped like x (party 0 holds it)."""
    return AShare(ctx, np.zeros(x.shape, np.uint64), x.bits, x.frac).add_public_fixed(v)

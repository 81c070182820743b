"""Shared helpers: fixed-point multiply/square with rescaling, batched comparisons
with public thresholds, batched multiplexers."""

from __future__ import annotations

import numpy as np

from ..ring import fixed_encode, mask
from ..shares import AShare, BShare
from ..protocols import compare, mul as _mul, mux as _mux, trunc as _trunc

TRUNC = "local"


def _rescale(ctx, p: AShare, s: int, how: str) -> AShare:
    if how == "local":
        return _trunc.trunc_local(ctx, p, s)
    if how == "faithful":
        return _trunc.trunc_faithful(ctx, p, s)
    raise ValueError(f"unknown truncation {how!r}")


#: a narrow product is used when it saves at least this many ring bits
NARROW_MIN_SAVING = 8


def narrow_bits(bound: float, frac: int, bits: int) -> int:
    """The ring width k of a product p = x y at scale 2^frac with |x y| <= ``bound`` (real
    units) in `product`: |p| <= 2^(k-3) (`compare.range_bits` plus one bit), so that p plus
    the HE product's unit errors stays below 2^(k-2), the truncation's offset."""
    return compare.range_bits(2.0 * float(bound), frac, bits)


def product(ctx, x: AShare, y: AShare | None, s: int, how: str | None = None,
            bound: float | None = None) -> AShare:
    """x y (x^2 when y is None) truncated by s bits, in x's ring.

    Without ``bound``: the product in the full ring l (`mul` / `square` with
    ``exact=False``), then the truncation ``how`` (default TRUNC).

    With ``bound`` >= |x y| (real units; the caller states it per operator), the product
    runs in a narrow ring Z_{2^k}, k = `narrow_bits` (SiRNN section 3.3 / 4: operate on
    the bits that matter): each party reduces its shares mod 2^k (free; x y mod 2^k
    needs no range on the operands), multiplies there (the HE product needs P > 2^(2k-1) T:
    two 43-bit plaintext primes up to k = 42 instead of three at l = 64; Gilboa k bits
    instead of l), and one known-MSB truncation (`trunc.trunc_one_bit_error`, "exact":
    `trunc_known_sign`) both shifts by s and extends the result back to Z_{2^l} in one
    COT of l - k + s bits.  The truncation's error is as TRUNC's ({0, +1} ulp) and its
    view is that of a COT; a broken bound gives a wrong result for that element only
    (off by a multiple of 2^(k-s)), never a different view.  It falls back to the full
    ring where k would not save NARROW_MIN_SAVING bits."""
    ring = x.bits
    F = x.frac + (x.frac if y is None else y.frac)
    k = None if bound is None else max(narrow_bits(bound, F, ring), s + 3)
    narrow = k is not None and k <= ring - NARROW_MIN_SAVING
    if narrow:  # each party's shares mod 2^k (a ring homomorphism: free)
        x = AShare(ctx, x.data & mask(k), k, x.frac)
        y = None if y is None else AShare(ctx, y.data & mask(k), k, y.frac)
    p = _mul.square(ctx, x, exact=False) if y is None else _mul.mul(ctx, x, y, exact=False)  # scale 2^F
    if not narrow:
        return _rescale(ctx, p, s, how or TRUNC)
    if (how or TRUNC) == "faithful":
        return _trunc.trunc_known_sign(ctx, p, s, None, out_bits=ring)
    return _trunc.trunc_one_bit_error(ctx, p, s, None, out_bits=ring)


def mulf(ctx, x: AShare, y: AShare, how: str | None = None, bound: float | None = None) -> AShare:
    """Fixed-point x * y at x's scale (the product may be one unit off before the
    truncation, `mul` with ``exact=False``: below the truncation's own error);
    ``bound`` >= |x y| (real units): the narrow-ring product of `product`."""
    return product(ctx, x, y, y.frac, how, bound)


def sqf(ctx, x: AShare, how: str | None = None, bound: float | None = None) -> AShare:
    """Fixed-point x^2 (``exact=False`` as in `mulf`; ``bound`` >= x^2 as in `product`)."""
    return product(ctx, x, None, x.frac, how, bound)


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


def clip_min(ctx, x: AShare, lo: float) -> AShare:
    """max(x, lo) for a public real lo: one batched MSB and one MUX, x + 1{x < lo} (lo - x),
    exact in the ring (whatever x holds below lo is replaced)."""
    below = compare_public(ctx, x, [lo])[0]
    return x + _mux.mux(ctx, below, const(ctx, x, lo) - x)


def mux_many(ctx, bits: BShare, vals: list[AShare]) -> list[AShare]:
    """[bits[k] * vals[k]] in one batched MUX."""
    v = AShare(ctx, np.stack([a.data for a in vals]), vals[0].bits, vals[0].frac)
    out = _mux.mux(ctx, bits, v)
    return [out[k] for k in range(len(vals))]


def const(ctx, x: AShare, v: float) -> AShare:
    """A public constant as a share shaped like x (party 0 holds it)."""
    return AShare(ctx, np.zeros(x.shape, np.uint64), x.bits, x.frac).add_public_fixed(v)

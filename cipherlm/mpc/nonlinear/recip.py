"""Reciprocal and reciprocal square root: normalisation by a power-of-two
bracket, a low-degree polynomial on the mantissa, one Newton / Householder step
(SiRNN section 5: normalise, initial approximation, iterate; Bumblebee
section 4.2 for the bracket by comparisons with public powers of two).

Bracket: comparisons of x with the public thresholds 2^k covering [lo, hi]
(one batched MSB; k even, s = 2) give the one-hot bracket x in [2^k,
2^(k+s)).  The comparisons take `compare_public`'s bound 2^(k_top + 3) (k_top
the top threshold's exponent) instead of the library's 2^20: an MSB on 34 bits
instead of 39 for 1/x on the default range (38 instead of 39 for 1/sqrt(x));
inputs from 2^k_top up to that bound give 0 (as inputs below lo do), larger
ones are outside the contract.  One batched MUX of the candidates x 2^-k with
the one-hot gives the mantissa m = x 2^-k in [1, 2^s) (exact for k <= 0, +-1
ulp for k > 0).

1/x (s = 2: 1/x = 4^(-j) / m, m in [1, 4)): q(m) = c0 + c1 m + c2 m^2, the
minimax relative approximation of 1/m on [1, 4]: relative error e = 1 - m q
in [-E, E], E = 0.074 (one squaring).  One fourth-order step y = Y0 (a0 + a1 e
+ a2 e^2 + a3 e^3) (Taylor of 1 / (1 - e): 1, 1, 1, 1, which would leave e^4
<= 3.0e-5; a_i the minimax fit over the e of q: relative error 3.8e-6), with
Y0 = z 4^(-j) by a second batched MUX (the bracket's scale applied to z before
the last product, so that its rounding is absolute in y): products m z, e e^2,
Y0 corr and the squaring e^2.  Rounding: m z (+-1 ulp, relative 1.5e-5 through
e), m's ulp (1.5e-5), the public products of the a_i (+-1 ulp each, 4.6e-5 on
corr ~ 1), and the absolute +-1 ulp of Y0 and of the last product:
|y - 1/x| <= 8e-5 / x + 2 ulp for the encoded x on [lo, hi] (the f = 16
encoding of x adds 2^-17 / x relative: 1.1e-4 at x = 0.07; bench and tests:
2e-4 / x + 4 ulp).  iters > 1 adds Newton steps z (2 - m z) before the last
one.  Cost per element: (K + 1) MSB + 2K MUX + 2 squarings + 3 products
(K brackets of 4; default range K = 8), instead of 17 MSB + 16 B2A + 6
products (3 Newton steps from a constant per power-of-two bracket).  (A first
version with brackets of 2, E = 0.0101 and one Newton step, 1 squaring + 2
products, needed 17 MSB and 32 MUX: 1654 against 1318 bytes per element.)

1/sqrt(x) (s = 2: 1/sqrt(x) = 2^(-k/2) / sqrt(m), m in [1, 4)): q(m) =
c0 + c1 m + c2 m^2 minimax relative for 1/sqrt(m) on [1, 4]: E = 0.024; then
one third-order step with e = 1 - m z^2 in [-0.049, 0.048]: y = Y0 (a0 + a1 e +
a2 e^2), Y0 = z 2^(-k/2) (batched MUX), a_i the minimax fit of (1 - e)^(-1/2)
over the e of q (Taylor 1, 1/2, 3/8 would leave 3.5e-5): relative error
8.7e-6.  Rounding: z^2 then m z^2 (<= 5 ulp on e, m < 4), relative 3.8e-5
on y; m's ulp 0.8e-5; the absolute +-1 ulp of Y0, e^2 and the last product:
|y - 1/sqrt(x)| <= 5.5e-5 / sqrt(x) + 3 ulp (bench and tests: 1e-4 / sqrt(x)
+ 4 ulp).  Cost per element: (K + 1) MSB + 2K MUX + 3 squarings + 2
products (default range K = 12 brackets of 4), instead of 25 MSB + 24 B2A +
9 products (3 Newton steps).
"""

from __future__ import annotations

import math

import numpy as np

from ..shares import AShare, BShare
from ..protocols.trunc import trunc_local
from .common import compare_public, const, mulf, mux_many, sqf

MARGIN_BITS = 3      # comparisons exact for x <= 2^MARGIN_BITS 2^k_top
SCALE_BITS = 16      # relative precision of the public per-bracket constants

# 1/m on [1, 4], minimax relative (E = 0.074), and the fourth-order step
RECIP_Q = (1.4958925541651265, -0.6575355301299648, 0.08767140365781094)
RECIP_STEP = (0.9999962364981779, 0.9999962365286821, 1.0054983778841833, 1.0054983667759254)
# 1/sqrt(m) on [1, 4], minimax relative (E = 0.024), and the third-order step
RSQRT_Q = (1.3354192702696421, -0.41067068734612594, 0.05120542296872185)
RSQRT_STEP = (1.0000001567633452, 0.5005422205915796, 0.37506778385207923)


def _bracket(ctx, x: AShare, lo: float, hi: float, step: int):
    """(one-hot BShare (K, *x.shape), mantissa m = x 2^-k in [1, 2^step), exponents k)."""
    if not 0 < lo < hi:
        raise ValueError("need 0 < lo < hi")
    j0, j1 = math.floor(math.log2(lo) / step), math.ceil(math.log2(hi) / step)
    ks = [step * j for j in range(j0, j1 + 1)]
    # 1{x < 2^k}, on the bits of |x| <= 2^MARGIN_BITS 2^k_top (compare.range_bits)
    b = compare_public(ctx, x, [2.0 ** k for k in ks], bound=2.0 ** (ks[-1] + MARGIN_BITS))
    onehot = BShare(ctx, b.data[1:] ^ b.data[:-1], 1)  # x in [2^k, 2^(k+step)) for k = ks[:-1]
    m = _select(ctx, onehot, [_shift(ctx, x, k) for k in ks[:-1]])
    return onehot, m, ks[:-1]


def _shift(ctx, x: AShare, k: int) -> AShare:
    """x 2^-k at x's scale (left shift exact, right shift local truncation)."""
    if k <= 0:
        return x._like((x.data << np.uint64(-k)) & x.mask)
    return x._like(trunc_local(ctx, x, k).data)


def _select(ctx, onehot: BShare, vals: list[AShare]) -> AShare:
    """sum_k onehot_k vals_k (one batched MUX; the unselected, possibly wrapped, values cancel exactly)."""
    out = mux_many(ctx, onehot, vals)
    acc = out[0]
    for v in out[1:]:
        acc = acc + v
    return acc


def _scaled(z: AShare, c: float) -> AShare:
    """z c for a public c > 0, c encoded with SCALE_BITS significant bits."""
    return z.mul_public_fixed(c, frac=max(0, SCALE_BITS - math.floor(math.log2(c))))


#: a bound on every product with the mantissa m in [1, 4) (0 outside the brackets): m^2, m z,
#: m z^2 (z within 8 % of 1/m or 1/sqrt(m)); one bound, so one narrow ring, so that the HE
#: product uploads m once for all of them (`common.product`)
M_BOUND = 16.0


def _poly(ctx, m: AShare, c) -> AShare:
    m2 = sqf(ctx, m, bound=M_BOUND)
    return m.mul_public_fixed(c[1]) + m2.mul_public_fixed(c[2]) + const(ctx, m, c[0])


def reciprocal(ctx, x: AShare, lo: float = 2.0 ** -4, hi: float = 2.0 ** 12, iters: int = 1) -> AShare:
    """1/x for x in [lo, hi] (0 below lo and from the top threshold 2^k_top to 8 times it)."""
    if iters < 1:
        raise ValueError("iters >= 1")
    onehot, m, ks = _bracket(ctx, x, lo, hi, 2)
    z = _poly(ctx, m, RECIP_Q)
    for _ in range(iters - 1):
        z = mulf(ctx, z, const(ctx, x, 2.0) - mulf(ctx, m, z, bound=M_BOUND), bound=4.0)
    # ranges for the narrow products (`common.product`): m in [1, 4) and z within 8 % of 1/m
    # (m = 0, z = Q(0) < 1.5 and e = 1 outside the brackets, where y0 = 0)
    e = const(ctx, x, 1.0) - mulf(ctx, m, z, bound=M_BOUND)
    e2 = sqf(ctx, e, bound=2.0)
    a0, a1, a2, a3 = RECIP_STEP
    corr = (e.mul_public_fixed(a1) + e2.mul_public_fixed(a2) + mulf(ctx, e2, e, bound=2.0).mul_public_fixed(a3)
            + const(ctx, x, a0))
    y0 = _select(ctx, onehot, [_scaled(z, 2.0 ** -k) for k in ks])
    return mulf(ctx, y0, corr, bound=2.0 ** (1 - ks[0]))  # y0 <= 1.1 2^-k, corr <= 1.2


def rsqrt(ctx, x: AShare, lo: float = 2.0 ** -8, hi: float = 2.0 ** 16) -> AShare:
    """1/sqrt(x) for x in [lo, hi] (0 below lo and from the top threshold 2^k_top to 8 times it)."""
    onehot, m, ks = _bracket(ctx, x, lo, hi, 2)
    z = _poly(ctx, m, RSQRT_Q)
    # ranges as in `reciprocal`: z within 3 % of 1/sqrt(m) (Q(0) < 1.4 outside the brackets)
    e = const(ctx, x, 1.0) - mulf(ctx, m, sqf(ctx, z, bound=4.0), bound=M_BOUND)
    a0, a1, a2 = RSQRT_STEP
    corr = e.mul_public_fixed(a1) + sqf(ctx, e, bound=2.0).mul_public_fixed(a2) + const(ctx, x, a0)
    y0 = _select(ctx, onehot, [_scaled(z, 2.0 ** (-k / 2)) for k in ks])
    return mulf(ctx, y0, corr, bound=2.0 ** (1 - ks[0] / 2))  # y0 <= 1.1 2^(-k/2), corr <= 1.1

"""Piecewise polynomials on shares: GeLU and SiLU (BOLT section 5 / BLB
appendix B: low-degree polynomials on a central interval, ReLU outside).

`gelu` and `silu` use the symmetry both functions share: f(x) - x/2 is even
and tends to |x|/2, so with a = |x|

    f(x) = x/2 + Q(a),   Q(a) = P_i(a) on [t_(i-1), t_i) (t_0 = 0),  a/2 for a >= T = t_k,

with each P_i a degree-4 polynomial in u = a / s (all powers 0..4, near-minimax fits on
its segment by iteratively reweighted least squares, computed at import,
deterministic).  One segment needs two comparisons (the sign of x, then a < T),
two MUXes and the powers u^2, u^3, u^4 of u = a / s (two squares, one product, in
the narrow ring of u <= T / s: `common.product`); every further segment adds one
comparison (batched with a < T, same round) and one MUX (batched with the last one),
and shares the powers.  u is not clamped to T / s: beyond T the selection
P_k + 1{a >= T} (a/2 - P_k) is a/2 exactly in the ring and the segment terms are 0,
whatever the powers hold there (until 2026-11-29 a third MUX computed min(a, T)).

* GeLU: one segment, T = 3: max abs error 4.1e-3 (SPU 0.9.5's GeLU: 8.1e-3 on
  the same inputs, docs/benchmarks.md).  BOLT's GeLU uses the same |x| form
  (degree 4, T = 2.7, without the cubic term: error 0.026 here).
* SiLU: the cut-off itself costs a sigmoid(-a) at a = T (1.5e-2 at T = 6, where
  one degree-4 segment used to end), so T = 8.5 (1.7e-3) and two segments split
  at 2.5 (fit error 7.4e-4): max abs error about 1.8e-3 with the fixed-point
  rounding, against SPU's 2.8e-3.  A single degree-4 segment on [0, 8.5] would
  miss by 2.6e-2, a single degree-6 one needs two more products per element.

The activation gates of BLB appendix B (algorithm 5: GeLU(x) = x Phi(x), SiLU(x) =
x sigmoid(x), the gate evaluated in MPC, the product with x fused into HE) use the
same machinery (`abs_piecewise`: sign, |x|, segments on powers of u = a / s,
fits by `_fit_abs` with the subtracted term a parameter), for the odd symmetry
g(x) = 1/2 + sgn(x) h(|x|), h(a) = g(a) - 1/2 -> 1/2 beyond T:

    g(x) = 1/2 + h - 1{x < 0} 2h          (`half_plus_odd`: one MUX more, one round more).

* `gelu_gate` Phi(x): two degree-4 segments split at 1.5, T = 3.5, powers of a / 2
  (fit 2.6e-5; the cut-off costs 1 - Phi(3.5) = 2.3e-4): max abs error 2.3e-4
  measured on [-16, 16] (step 2^-12) and |x| up to 100.  One segment on [0, 3] would
  fit to 1.9e-3 but the cut-off alone costs 1.3e-3 there.
* `silu_gate` sigmoid(x): two degree-4 segments split at 3, T = 8, powers of a / 4
  (fit 3.4e-4, cut-off sigmoid(-8) = 3.4e-4): max abs error 3.9e-4 measured.
Cost per element (both): 3 comparisons in 2 MSBs (the sign; a < t_1 and a < T
batched), 4 MUXes in 3 calls (|x|, the 2 segment terms, the sign), two squares and
one product (u^2, u^4, u^3) in the narrow ring: `silu`'s cost plus one MUX.

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

ABS_POWERS = (0, 1, 2, 3, 4)


def _half(a):
    return a / 2


def _lawson(A: np.ndarray, y: np.ndarray, iters: int) -> np.ndarray:
    """Near-minimax c for A c ~ y on the rows of A (Lawson's iteratively reweighted least
    squares)."""
    w = np.full(y.size, 1.0 / y.size)
    for _ in range(iters):
        c, *_ = np.linalg.lstsq(A * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)
        w = w * (np.abs(A @ c - y) + 1e-15)
        w /= w.sum()
    return c


def _fit_abs(f, lo: float, hi: float, iters: int = 30, minus=_half) -> np.ndarray:
    """Near-minimax coefficients of f(a) - minus(a) (default a/2) on [lo, hi] in the powers
    ABS_POWERS of a (`_lawson` on a dense grid)."""
    a = np.linspace(lo, hi, 20001)
    return _lawson(np.stack([a ** p for p in ABS_POWERS], axis=1), f(a) - minus(a), iters)


def _segments(f, breaks, scale: int = 1, minus=_half):
    """(breaks t_1..t_k, scale s, one coefficient vector per segment [t_(i-1), t_i) (t_0 = 0)
    in the powers of u = a / s) of f(a) - minus(a).  The powers are evaluated on u, not a, so
    that u^4 and the coefficients both stay small: a coefficient's fixed-point rounding
    (2^-17) is multiplied by u^p, not by a^p (8.5^4 = 5220 for SiLU, an error of 0.03 at
    x = 8 with s = 1)."""
    lows = (0.0,) + tuple(breaks[:-1])
    coeffs = tuple(_fit_abs(f, lo, hi, minus=minus) * float(scale) ** np.array(ABS_POWERS)
                   for lo, hi in zip(lows, breaks))
    return tuple(float(t) for t in breaks), int(scale), coeffs


#: GeLU: one segment, cut-off T = 3 (see the module doc)
GELU_SEGMENTS = _segments(_gelu_ref, (3.0,))
#: SiLU: two segments, split at 2.5, cut-off T = 8.5, powers of a / 4 (see the module doc)
SILU_SEGMENTS = _segments(_silu_ref, (2.5, 8.5), scale=4)

_phi_ref = np.vectorize(lambda v: 0.5 * (1.0 + erf(v / np.sqrt(2.0))))
_sigmoid_ref = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731


def _minus_half(a):
    return 0.5


#: GeLU gate Phi: h(a) = Phi(a) - 1/2, two segments split at 1.5, T = 3.5, powers of a / 2
GELU_GATE_SEGMENTS = _segments(_phi_ref, (1.5, 3.5), scale=2, minus=_minus_half)
#: SiLU gate sigmoid: h(a) = sigmoid(a) - 1/2, two segments split at 3, T = 8, powers of a / 4
SILU_GATE_SEGMENTS = _segments(_sigmoid_ref, (3.0, 8.0), scale=4, minus=_minus_half)


def _powers(ctx, x: AShare, deg: int, bound: float | None = None) -> list[AShare]:
    """[None, x, x^2, .., x^deg]; ``bound`` >= |x| (real units) runs the products in the
    narrow ring the highest power needs (`common.product`: |x^k| <= bound^deg for bound >= 1,
    with one ulp of slack per factor for the fixed-point roundings).  One ring for all
    products, so that the HE product's cache uploads x and x^2 once each."""
    b = None if bound is None else max(1.0, float(bound) + 2.0 ** (4 - x.frac)) ** deg
    p = [None, x]
    for k in range(2, deg + 1):
        p.append(None)
    # square-and-multiply by rounds: p[2k] = p[k]^2, p[2k+1] = p[2k] * x
    k = 2
    while k <= deg:
        p[k] = sqf(ctx, p[k // 2], bound=b) if k % 2 == 0 else mulf(ctx, p[k - 1], x, bound=b)
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
    pw = _powers(ctx, xc, deg, max(abs(lo), abs(hi)))
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


def abs_piecewise(ctx, x: AShare, segments, beyond):
    """(neg, a, Q): neg = 1{x < 0} (shared bit), a = |x| and Q(a) = P_i(a) on segment i,
    beyond(a) for a >= T = the last break (`beyond`: a function of the share a, or a public
    real); `segments` = (breaks, scale, coefficient vectors), as `_segments` gives.  The
    common core of `half_plus_even` (beyond = a/2) and the gates (beyond = 1/2)."""
    breaks, scale, coeffs = segments
    k = len(breaks)
    T = breaks[-1]
    neg = compare_public(ctx, x, [0.0])[0]
    (flip,) = mux_many(ctx, _stackb(neg), [x * -2])
    a = x + flip  # |x|
    below = compare_public(ctx, a, list(breaks))  # 1{a < t_i}, i = 1..k
    inside = below[k - 1]  # a < T
    # no clamp min(a, T): beyond T the selection below gives P_k + (beyond - P_k) = beyond
    # exactly in the ring and every segment term is 0, whatever the powers hold there
    # (wrong values, from the narrow products' range or the ring, stay in those elements)
    u = a if scale == 1 else a.mul_public_fixed(1.0 / scale)
    pw = _powers(ctx, u, max(ABS_POWERS), T / scale)  # 0 <= u < T / s where it is used
    P = []
    for c in coeffs:
        acc = const(ctx, x, float(c[0]))
        for p, cp in zip(ABS_POWERS[1:], c[1:]):
            acc = acc + pw[p].mul_public_fixed(float(cp))
        P.append(acc)
    far = beyond(a) if callable(beyond) else const(ctx, a, float(beyond))
    # P_k + sum_(i<k) 1{a < t_i} (P_i - P_(i+1)) + 1{a >= T} (beyond - P_k)
    sel = [below[i] for i in range(k - 1)] + [inside ^ 1]
    vals = [P[i] - P[i + 1] for i in range(k - 1)] + [far - P[-1]]
    res = P[-1]
    for t in mux_many(ctx, _stackb(*sel), vals):
        res = res + t
    return neg, a, res


def half_plus_even(ctx, x: AShare, segments) -> AShare:
    """x/2 + Q(|x|), Q(a) = P_i(a) on segment i and a/2 beyond the last break
    (see the module doc); `segments` = (breaks, scale, coefficient vectors), as `_segments` gives."""
    _, _, q = abs_piecewise(ctx, x, segments, lambda a: a.mul_public_fixed(0.5))
    return x.mul_public_fixed(0.5) + q


def half_plus_odd(ctx, x: AShare, segments) -> AShare:
    """1/2 + sgn(x) h(|x|), h(a) = P_i(a) on segment i and 1/2 beyond the last break
    (`segments` fitted to g(a) - 1/2): 1/2 + h - 1{x < 0} 2h, one MUX after `abs_piecewise`."""
    neg, _, h = abs_piecewise(ctx, x, segments, 0.5)
    (m,) = mux_many(ctx, _stackb(neg), [h * 2])
    return (h - m).add_public_fixed(0.5)


def gelu(ctx, x: AShare) -> AShare:
    """GeLU(x) = x Phi(x) as x/2 + Q(|x|) (BOLT's |x| form, degree 4, T = 3); max abs error ~0.005."""
    return half_plus_even(ctx, x, GELU_SEGMENTS)


def silu(ctx, x: AShare) -> AShare:
    """SiLU(x) = x sigmoid(x) as x/2 + Q(|x|) (two degree-4 segments, T = 8.5); max abs error ~0.002."""
    return half_plus_even(ctx, x, SILU_SEGMENTS)


def gelu_gate(ctx, x: AShare) -> AShare:
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, GeLU's gate (BLB algorithm 5), as 1/2 + sgn(x) h(|x|)
    (two degree-4 segments split at 1.5, T = 3.5); max abs error ~3e-4 (see the module doc)."""
    return half_plus_odd(ctx, x, GELU_GATE_SEGMENTS)


def silu_gate(ctx, x: AShare) -> AShare:
    """sigmoid(x), SiLU's gate, as 1/2 + sgn(x) h(|x|) (two degree-4 segments split at 3,
    T = 8); max abs error ~4e-4 (see the module doc)."""
    return half_plus_odd(ctx, x, SILU_GATE_SEGMENTS)


# ------------------------------------------------------------------ the clamped form (BLB's HE part)
#: the activations `clamped_poly` fits (GeLU and its tanh form; SiLU needs two segments)
CLAMPED_FNS = ("gelu", "gelu_tanh")
_gelu_tanh_ref = lambda v: 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))  # noqa: E731
#: the cut-off T and degree of `clamped_poly` (max abs error 1.8e-3 for GeLU, module doc)
CLAMP_T, CLAMP_DEGREE = 3.25, 4


def _fit_clamped(f, T: float, deg: int, iters: int = 60) -> tuple[np.ndarray, float]:
    """(c_0..c_deg, max abs error): the near-minimax P with f(x) ~ x/2 + (a - min(a, T))/2 +
    P(min(a, T)), a = |x|, over a in [0, T + 12] (Lawson's IRLS on a dense grid: the points
    a <= T fit P(a) to f(a) - a/2, the points beyond T fit the one value P(T) to
    f(a) - a/2 - (a - T)/2, so the tail's error is balanced against the fit's; `_lawson`)."""
    a = np.linspace(0.0, T, 4001)
    at = np.linspace(T, T + 12.0, 2001)
    A = np.concatenate([np.stack([a ** k for k in range(deg + 1)], axis=1),
                        np.tile([T ** k for k in range(deg + 1)], (at.size, 1))])
    y = np.concatenate([f(a) - a / 2, f(at) - at / 2 - (at - T) / 2])
    c = _lawson(A, y, iters)
    return c, float(np.abs(A @ c - y).max())


_CLAMPED: dict[str, tuple[float, tuple[float, ...]]] = {}


def clamped_poly(fn: str) -> tuple[float, tuple[float, ...]]:
    """(T, (c_0..c_4)) of the clamped form of activation ``fn`` (one of CLAMPED_FNS):

        f(x) ~ lin + P(ac),   a = |x|,  ac = min(a, T),  lin = x/2 + (a - ac)/2,

    P of degree CLAMP_DEGREE fitted by `_fit_clamped` (computed once, deterministic).  The
    BLB activation split "poly" (`compile.passes.blb_decompose`) leaves only `abs_clamp`
    (lin, ac: two comparisons and two MUXes) to MPC and evaluates P in CKKS, fused with the
    next projection: no HE product on shares at all.  GeLU: max abs error 1.8e-3 (the
    whole activation `gelu`: 4.1e-3; SPU 0.9.5: 8.1e-3)."""
    if fn not in CLAMPED_FNS:
        raise ValueError(f"no clamped form for activation {fn!r} (have {CLAMPED_FNS})")
    if fn not in _CLAMPED:
        ref = _gelu_ref if fn == "gelu" else _gelu_tanh_ref
        c, _ = _fit_clamped(ref, CLAMP_T, CLAMP_DEGREE)
        _CLAMPED[fn] = (CLAMP_T, tuple(float(v) for v in c))
    return _CLAMPED[fn]


def abs_clamp(ctx, x: AShare, T: float, scale: float = 1.0) -> tuple[AShare, AShare]:
    """(lin, scale ac) with lin = x/2 + (a - ac)/2, ac = min(a, T), a = |x| (`clamped_poly`'s
    MPC part): the sign (one MSB), |x| (one MUX), 1{a < T} (one MSB) and r = 1{a >= T} (a - T)
    (one MUX); ac = a - r and lin = (x + r) / 2 are local (one local truncation by one bit,
    and one for a ``scale`` other than 1).  ac is in [0, T] for every input, so whatever
    evaluates P on it (CKKS) sees a bounded value; lin has x's range."""
    neg = compare_public(ctx, x, [0.0])[0]
    (flip,) = mux_many(ctx, _stackb(neg), [x * -2])
    a = x + flip
    inside = compare_public(ctx, a, [T])[0]
    (r,) = mux_many(ctx, _stackb(inside ^ 1), [a.add_public_fixed(-T)])
    ac = a - r
    return (x + r).mul_public_fixed(0.5), (ac if scale == 1.0 else ac.mul_public_fixed(scale))


def swiglu(ctx, gate: AShare, up: AShare) -> AShare:
    """SwiGLU's elementwise part: silu(gate) * up (LLaMA MLP)."""
    from .common import mulf
    return mulf(ctx, silu(ctx, gate), up)

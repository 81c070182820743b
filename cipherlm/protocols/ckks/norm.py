"""LayerNorm and RMSNorm on token-group packed ciphertexts (AEGIS section 2.4: the inverse
square root by polynomial approximation and Newton steps, `cipherlm.fhe.approx`).

Channel sums are rotate-and-add windows over the cpc channels of a ciphertext (the d real
channels; padding channels hold 0), replicated to every channel slot of each position.

LayerNorm, with s1 = sum x and s2 = sum x^2 over channels:

    d^2 var = d s2 - s1^2,   y = (d x - s1) * (gamma / d) * rsqrt(var + eps) + beta,

so the centring costs no level (integer products) and the 1/d goes into gamma's plaintext.
RMSNorm: y = x * gamma * rsqrt(s2 / d + eps).  Padding positions have var = 0; a public
fill (the middle of rsqrt's interval) is added there so rsqrt stays inside its interval,
and their output stays 0 (x - mean = 0 there, beta is added on real positions only).
Levels: 3 + rsqrt's depth.

Split in two (`norm_sums`, `*_finish`) so that a value whose blocks sit on several
workers (AEGIS 4.4, `runtime.aegis_executor`) sums locally, exchanges one ciphertext per
sum, and normalises its own blocks.
"""

from __future__ import annotations

import numpy as np

from .evaluator import CkksEvaluator, CkksTensor


def _fill(packing, approx) -> np.ndarray:
    """(slots,) the value added to padding positions' variance: inside rsqrt's interval."""
    row = (1.0 - packing.token_mask()) * float(np.sqrt(approx.lo * approx.hi))
    return np.tile(row, packing.cpc)


def _rsqrt(ev: CkksEvaluator, var_ct, x: CkksTensor, approx, eps: float, label: str):
    var_ct = ev.add_plain_ct(var_ct, _fill(x.packing, approx) + eps)
    v = CkksTensor([var_ct], x.packing.cpc, x.packing, approx.hi)
    r = ev.poly(v, approx, f"{label}.rsqrt", bound=float(1.0 / np.sqrt(approx.lo)) * 1.01)
    return r


def _times(ev: CkksEvaluator, parts: list, r: CkksTensor, x: CkksTensor, bound: float, label: str) -> list:
    """parts[i] * r (one level; both refreshed first when they have too few)."""
    need = 1 + ev.reserve(bound)
    p = ev.refresh(x.with_cts(parts, bound=x.bound * 2), need, f"{label}.scale")
    r = ev.refresh(r, need, f"{label}.scale").cts[0]
    return [ev.mul_ct(c, r) for c in p.cts]


def norm_sums(ev: CkksEvaluator, x: CkksTensor, centred: bool, label: str = "norm") -> tuple[CkksTensor, list]:
    """(x with the levels the norm needs, its channel sums): [sum x, sum x^2] (``centred``,
    LayerNorm) or [sum x^2] (RMSNorm), each one ciphertext.  Sums over the blocks at hand: a
    worker holding some of a value's blocks gets partial sums, and the partials of all
    holders add up to the value's (AEGIS 4.4, "local reduction before send")."""
    x = ev.refresh(x, 3, label)
    with ev.timer("norm"):
        s2 = ev.channel_sum(x.with_cts([ev.mul_ct(c, c) for c in x.cts]))
        return x, ([ev.channel_sum(x), s2] if centred else [s2])


def layer_norm_finish(ev: CkksEvaluator, x: CkksTensor, sums: list, d: int, gamma, beta, eps: float, rsqrt_approx,
                      bound: float, label: str = "layer_norm") -> CkksTensor:
    """LayerNorm of the blocks of `x` given the sums over all `d` channels (`norm_sums`);
    gamma and beta: the x.d channels of these blocks."""
    P = x.packing
    s1, s2 = sums
    with ev.timer("norm"):
        v = ev.sub_ct(ev.mul_scalar_ct(s2, d), ev.mul_ct(s1, s1))  # d^2 var
        v = ev.mul_scalar_ct(v, 1.0 / (d * d))
        g = P.channel_vector((np.ones(x.d) if gamma is None else np.asarray(gamma, np.float64)) / d, x.d)
        centred = [ev.mul_plain_ct(ev.sub_ct(ev.mul_scalar_ct(c, d), s1), g[i]) for i, c in enumerate(x.cts)]
    r = _rsqrt(ev, v, x, rsqrt_approx, eps, label)
    with ev.timer("norm"):
        out = _times(ev, centred, r, x, bound, label)
        if beta is not None:
            b = P.channel_vector(beta, x.d)
            out = [ev.add_plain_ct(c, b[i]) for i, c in enumerate(out)]
    return CkksTensor(out, x.d, P, bound)


def rms_norm_finish(ev: CkksEvaluator, x: CkksTensor, sums: list, d: int, gamma, eps: float, rsqrt_approx,
                    bound: float, label: str = "rms_norm") -> CkksTensor:
    """RMSNorm of the blocks of `x` given the sum of squares over all `d` channels."""
    P = x.packing
    with ev.timer("norm"):
        ms = ev.mul_scalar_ct(sums[0], 1.0 / d)
        g = P.channel_vector(np.ones(x.d) if gamma is None else gamma, x.d)
        scaled = [ev.mul_plain_ct(c, g[i]) for i, c in enumerate(x.cts)]
    r = _rsqrt(ev, ms, x, rsqrt_approx, eps, label)
    with ev.timer("norm"):
        out = _times(ev, scaled, r, x, bound, label)
    return CkksTensor(out, x.d, P, bound)


def layer_norm(ev: CkksEvaluator, x: CkksTensor, gamma, beta, eps: float, rsqrt_approx, bound: float,
               label: str = "layer_norm") -> CkksTensor:
    x, sums = norm_sums(ev, x, True, label)
    return layer_norm_finish(ev, x, sums, x.d, gamma, beta, eps, rsqrt_approx, bound, label)


def rms_norm(ev: CkksEvaluator, x: CkksTensor, gamma, eps: float, rsqrt_approx, bound: float,
             label: str = "rms_norm") -> CkksTensor:
    x, sums = norm_sums(ev, x, False, label)
    return rms_norm_finish(ev, x, sums, x.d, gamma, eps, rsqrt_approx, bound, label)

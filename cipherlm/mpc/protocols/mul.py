"""Elementwise multiplication of two shared tensors (Gilboa 1999 via correlated OT,
as in CrypTFlow2 section 4.1 / SecureML's OT-based triples, with the bit-width
optimisation of SiRNN section 3.3).

x y = x0 y0 + x1 y1 + x0 y1 + x1 y0; the local terms are free and each cross
term a b (a held by the sender, b by the receiver) costs l correlated OTs: for
bit i of b the receiver chooses b_i and the sender's correlation is
a mod 2^(l-i), so that sum_i 2^i (r_i + b_i a) - sum_i 2^i r_i = a b mod 2^l.
Bit i only needs l - i bits of payload (the optimisation); positions are
grouped into ``groups`` OT calls sharing the widest width of the group
(more groups: fewer bytes, more rounds).

Cost per element: 2 l COTs; payload bits sum over positions of the group width
(l = 64, 4 groups: 2 (64 * 128 + 2560) bits + IKNP); 2 * groups OT calls.
`mul` gives the product in the ring (fixed-point scales add); `mul_fixed`
truncates back by the fraction bits (faithful or local).

Two protocols for the cross terms (``method``): "ot" (the above) and "he"
(`mul_he`: BFV batching, Cheetah's HE product, one round trip, ~192 bytes per
element against ~650 on silent OT, but whole ciphertexts of N = 8192 slots).
"auto" (the default; ``CIPHERLM_MUL`` overrides it) picks whichever sends fewer
bytes for the size at hand (`choose_method`).  ``exact=False`` lets the HE
product be off by one unit in the last place (-1, 0 or +1), which the truncation
of a fixed-point product removes; ``exact=True`` (the default of `mul`) keeps it
exact except with probability 2^-40 per element (one more plaintext prime).
"""

from __future__ import annotations

import os

import numpy as np

from ..context import MPCError
from ..ring import mask
from ..shares import AShare, register_kernel

__all__ = ["mul", "mul_fixed", "square", "cross_term", "choose_method", "DEFAULT_GROUPS", "METHODS"]

DEFAULT_GROUPS = 4
METHODS = ("auto", "ot", "he")


def ot_bytes_estimate(n: int, bits: int, terms: int, groups: int = DEFAULT_GROUPS) -> float:
    """Payload bytes of ``terms`` Gilboa cross terms on n elements (COT corrections
    plus the extension's per-OT bytes, `ot.bytes_per_ot`)."""
    from ..ot import bytes_per_ot
    payload = sum((hi - lo) * (bits - lo) for lo, hi in _groups(bits, groups)) / 8
    return terms * n * (payload + bits * bytes_per_ot("random"))


def choose_method(n: int, bits: int, terms: int, exact: bool, method: str | None = None) -> str:
    """"ot" or "he" for ``terms`` cross terms on n elements: ``method`` if given, else
    ``CIPHERLM_MUL`` (auto | ot | he), else "auto": the one with fewer bytes."""
    from . import mul_he
    m = method or os.environ.get("CIPHERLM_MUL", "auto")
    if m not in METHODS:
        raise ValueError(f"unknown multiplication method {m!r} (CIPHERLM_MUL: one of {', '.join(METHODS)})")
    if m != "auto":
        return m
    he = mul_he.bytes_estimate(n, bits, terms, exact)
    return "he" if he < ot_bytes_estimate(n, bits, terms) else "ot"


def _groups(bits: int, groups: int) -> list[tuple[int, int]]:
    g = max(1, min(groups, bits))
    edges = np.linspace(0, bits, g + 1).round().astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(g) if edges[i + 1] > edges[i]]


def cross_term(ctx, v: np.ndarray, bits: int, sender: int, groups: int = DEFAULT_GROUPS) -> np.ndarray:
    """Additive shares of a*b mod 2^bits where the sender passes a and the receiver b."""
    v = np.asarray(v, np.uint64).reshape(-1)
    n = v.size
    acc = np.zeros(n, np.uint64)
    for lo, hi in _groups(bits, groups):
        width = bits - lo
        pos = np.arange(lo, hi, dtype=np.uint64)
        if ctx.party == sender:
            corr = np.broadcast_to((v & mask(width))[:, None], (n, hi - lo)).reshape(-1)
            r = np.asarray(ctx.ot.send_cot(corr, width), np.uint64).reshape(n, hi - lo)
            acc -= (r << pos).sum(axis=1, dtype=np.uint64)
        else:
            choice = ((v[:, None] >> pos) & np.uint64(1)).astype(bool).reshape(-1)
            t = np.asarray(ctx.ot.recv_cot(choice, width), np.uint64).reshape(n, hi - lo)
            acc += (t << pos).sum(axis=1, dtype=np.uint64)
    return acc & mask(bits)


def mul(ctx, x: AShare, y: AShare, groups: int = DEFAULT_GROUPS, *, exact: bool = True,
        method: str | None = None) -> AShare:
    """x * y elementwise in Z_{2^l} (no truncation; the result has scale x.frac + y.frac).
    ``exact=False``: the HE product may be off by one in the last place (module docstring)."""
    if not isinstance(x, AShare) or not isinstance(y, AShare):
        raise TypeError("mul multiplies two AShare")
    if x.shape != y.shape:
        raise ValueError(f"mul: shape mismatch {x.shape} vs {y.shape}")
    if x.bits != y.bits:
        raise MPCError(f"mul: ring mismatch {x.bits} vs {y.bits} bits")
    bits = x.bits
    xs, ys = x.data.reshape(-1), y.data.reshape(-1)
    with ctx.step("mul"):
        out = xs * ys
        if choose_method(xs.size, bits, 2, exact, method) == "he":
            from .mul_he import cross_products
            # x0 y1 + y0 x1: party 0 passes (x0, y0), party 1 (y1, x1)
            out += cross_products(ctx, [xs, ys] if ctx.party == 0 else [ys, xs], bits, exact=exact)
        else:
            # cross term x0*y1 (party 0 sends x0), then x1*y0 (party 1 sends x1)
            out += cross_term(ctx, xs if ctx.party == 0 else ys, bits, sender=0, groups=groups)
            out += cross_term(ctx, xs if ctx.party == 1 else ys, bits, sender=1, groups=groups)
    return AShare(ctx, (out & mask(bits)).reshape(x.shape), bits, x.frac + y.frac)


def mul_fixed(ctx, x: AShare, y: AShare, trunc: str = "faithful", groups: int = DEFAULT_GROUPS) -> AShare:
    """Fixed-point product rescaled to x.frac: ``trunc`` = "faithful" (exact floor of the
    product, `trunc.trunc_faithful`) or "local" (SecureML, `trunc.trunc_local`); the
    product itself may be one unit off before the truncation (``exact=False``)."""
    from .trunc import trunc_faithful, trunc_local
    p = mul(ctx, x, y, groups, exact=False)
    s = y.frac
    p = AShare(ctx, p.data, p.bits, x.frac + y.frac)
    if trunc == "faithful":
        return trunc_faithful(ctx, p, s)
    if trunc == "local":
        return trunc_local(ctx, p, s)
    raise ValueError(f"unknown truncation {trunc!r}")


def square(ctx, x: AShare, groups: int = DEFAULT_GROUPS, *, exact: bool = True,
           method: str | None = None) -> AShare:
    """x * x with one cross term: x0^2 + x1^2 + 2 x0 x1 (half the OTs of `mul`;
    ``exact=False``: off by at most 2 in the last place with the HE product)."""
    bits = x.bits
    xs = x.data.reshape(-1)
    with ctx.step("square"):
        if choose_method(xs.size, bits, 1, exact, method) == "he":
            from .mul_he import cross_products
            cross = cross_products(ctx, [xs], bits, exact=exact)
        else:
            cross = cross_term(ctx, xs, bits, sender=0, groups=groups)
        out = xs * xs + (cross << np.uint64(1))
    return AShare(ctx, (out & mask(bits)).reshape(x.shape), bits, 2 * x.frac)


register_kernel("mul", mul)  # AShare * AShare (cipherlm.mpc.shares)

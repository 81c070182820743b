"""max along the last axis (comparison tree) and softmax (Bumblebee section 4.2 / BLB appendix B).

max: pairwise max(a, b) = b + MUX(DReLU(a - b), a - b) over a tree of depth
ceil(log2 n): n - 1 comparisons and MUXes per row.
softmax(x) = e / sum(e), e = exp_neg(x - max) (exp.py), 1/sum by `reciprocal`
on [1/2, n + 1] (the row's maximum contributes exp(0) = 1; one fourth-order
step after the quadratic guess, recip.py: per row, so its cost is negligible), then
one product per element.  A causal / padding mask (public, True = keep) sets
masked inputs to -2^10 before the max (free) and multiplies their exponentials
by 0 (free).
Error: that of exp (<= 1.13e-3 abs, relative <= 4e-3 on [-4, 0], fitted for
softmax: 7e-4 in real arithmetic on random rows, exp.py) and of the reciprocal
(<= 8e-5 rel + 2 ulp) plus rounding; measured in tests and `cipherlm bench mpc`.
Cost per element: the max tree (one DReLU and one MUX), exp (5 squarings, one
MSB, one MUX: 8 squarings before) and one product.
"""

from __future__ import annotations

import numpy as np

from ..ring import fixed_encode
from ..shares import AShare, concatenate
from ..protocols import compare, mux as _mux
from .common import COMPARE_BOUND, mulf
from .exp import exp_neg
from .recip import reciprocal

MASK_VALUE = -1024.0


def max_last(ctx, x: AShare, bound: float = COMPARE_BOUND) -> AShare:
    """Maximum over the last axis, keepdims (shape (..., 1)); inputs |x| <= ``bound``: the
    comparisons run on the bits of differences up to 2 bound (`compare.range_bits`, SiRNN's
    bit widths; 39 bits instead of 64 at f = 16 and the default 2^20)."""
    bits = compare.range_bits(2 * bound, x.frac, x.bits)
    cur = x
    while cur.shape[-1] > 1:
        n = cur.shape[-1]
        h = n // 2
        a, b = cur[..., :h], cur[..., h:2 * h]
        d = a - b
        m = b + _mux.mux(ctx, compare.drelu(ctx, d, bits), d)
        cur = concatenate([m, cur[..., 2 * h:]], axis=-1) if n % 2 else m
    return cur


def softmax_parts(ctx, x: AShare, mask=None, iters: int = 1) -> tuple[AShare, AShare]:
    """(e, r): e = exp(x - max) (masked entries 0) and r = 1 / sum(e) per row (shape (..., 1)),
    so that softmax(x) = e * r.  Attention can multiply e @ V first and scale the
    (..., head_dim) result by r: fewer products than normalising (..., S) scores when S > head_dim."""
    if mask is not None:
        keep = np.broadcast_to(np.asarray(mask, bool), x.shape)
        x = x + np.where(keep, 0, fixed_encode(MASK_VALUE, x.frac, x.bits)).astype(np.uint64)
    m = max_last(ctx, x)
    e = exp_neg(ctx, x - m.broadcast_to(x.shape))
    if mask is not None:
        e = e * keep.astype(np.uint64)
    s = e.sum(axis=-1, keepdims=True)
    r = reciprocal(ctx, s, lo=0.5, hi=float(x.shape[-1] + 1), iters=iters)
    return e, r


def softmax(ctx, x: AShare, mask=None, iters: int = 1) -> AShare:
    """Softmax over the last axis; mask: public bool array broadcastable to x (True = keep)."""
    e, r = softmax_parts(ctx, x, mask, iters)
    return mulf(ctx, e, r.broadcast_to(e.shape), bound=2.0)  # e <= 1, r <= 1 (the row's max gives e = 1)

"""argmax, top-k and one-hot on shares (CryptoMoE Table 1: Pi_topk, Pi_onehot).

* `argmax_last`: the comparison tree of `softmax.max_last`, carrying the index
  as an arithmetic share (one batched MUX for value and index per level):
  n - 1 comparisons + 2 (n - 1) MUXes per row, ceil(log2 n) levels.
* `one_hot(idx, N)`: shares of idx are reduced locally to Z_{2^k}, k =
  ceil(log2 N) (reduction mod 2^k is a ring homomorphism), and compared for
  equality with each j < N (CrypTFlow2 equality on k bits: ceil(k/4) 1-of-16
  OTs + ceil(k/4) - 1 ANDs each).  Returns shared bits; `b2a` them for an
  arithmetic one-hot.
* `topk_last(x, k)`: k rounds of argmax; the winner is knocked out by
  subtracting 2^12 (fixed point) times its one-hot (B2A, free scaling), so
  inputs must lie within (-2^11, 2^11).  Ties are broken towards the higher
  index of the tree (values equal -> the later element).
"""

from __future__ import annotations

import numpy as np

from ..ring import fixed_encode, mask
from ..shares import AShare, BShare, concatenate
from ..protocols import compare, mux as _mux
from ..protocols.b2a import b2a_bits
from ..protocols.millionaire import equality
from .common import COMPARE_BOUND

KNOCKOUT = 2.0 ** 12


def argmax_last(ctx, x: AShare, bound: float = COMPARE_BOUND):
    """(max value (..., 1), argmax index (..., 1) as an integer AShare with frac 0);
    inputs |x| <= ``bound``: the comparisons run on the bits of differences up to 2 bound
    (`compare.range_bits`)."""
    bits = compare.range_bits(2 * bound, x.frac, x.bits)
    n = x.shape[-1]
    idx = AShare(ctx, np.zeros(x.shape, np.uint64), x.bits, 0) + np.broadcast_to(np.arange(n, dtype=np.uint64), x.shape)
    v, i = x, idx
    while v.shape[-1] > 1:
        m = v.shape[-1]
        h = m // 2
        d = v[..., :h] - v[..., h:2 * h]
        di = i[..., :h] - i[..., h:2 * h]
        sel = compare.drelu(ctx, d, bits)
        both = AShare(ctx, np.stack([d.data, di.data]), x.bits, 0)
        selb = BShare(ctx, np.stack([sel.data, sel.data]), 1)
        md = _mux.mux(ctx, selb, both)
        nv = v[..., h:2 * h] + AShare(ctx, md.data[0], x.bits, x.frac)
        ni = i[..., h:2 * h] + AShare(ctx, md.data[1], x.bits, 0)
        if m % 2:
            nv, ni = concatenate([nv, v[..., 2 * h:]], axis=-1), concatenate([ni, i[..., 2 * h:]], axis=-1)
        v, i = nv, ni
    return v, i


def one_hot(ctx, idx: AShare, N: int) -> BShare:
    """Shared bits of shape idx.shape + (N,): bit j = 1{idx == j} (idx an integer share)."""
    k = max(1, int(N - 1).bit_length())
    small = idx.data & mask(k)
    tgt = np.arange(N, dtype=np.uint64)
    if ctx.party == 0:
        v = (small[..., None] - tgt) & mask(k)
    else:
        v = (np.uint64(0) - small[..., None] + np.zeros(N, np.uint64)) & mask(k)
    return BShare(ctx, equality(ctx, v, k).astype(np.uint64), 1)


def topk_last(ctx, x: AShare, k: int):
    """Top-k values (..., k) in descending order and their indices (..., k)."""
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}")
    vals, idxs = [], []
    cur = x
    big = int(fixed_encode(KNOCKOUT, x.frac, x.bits))
    for _ in range(k):
        v, i = argmax_last(ctx, cur, KNOCKOUT * (k + 1))  # knocked-out values reach -2^11 - k 2^12
        vals.append(v)
        idxs.append(i)
        oh = one_hot(ctx, i[..., 0], n)
        B = b2a_bits(ctx, oh.data.reshape(-1), x.bits).reshape(oh.shape)
        cur = cur - AShare(ctx, B * np.uint64(big), x.bits, x.frac)
    return concatenate(vals, axis=-1), concatenate(idxs, axis=-1)

"""Baselines of CryptoMoE section 3 and appendix C, on the same shares and protocols.

* ``insecure`` (section 3, "Insecure Baseline"): the routing [[K]], [[W]] is
  opened to both parties; each expert runs on exactly the tokens routed to it
  (one `linear` call per expert and projection: varying token counts cannot be
  batched), outputs scaled by the public scores and scattered locally.  Leaks
  the whole routing: an upper bound on efficiency only.
* ``dense`` (section 3, "Dense baseline", Figure 2(b)): every expert on every
  token.  Masked scores Wd (m, n) = sum_slot onehot(K) * W (Pi_equal + Pi_mux);
  gate/up of all experts as one linear (d, n 2f); SwiGLU on (m, n, f); each
  expert's activations scaled by its masked score (Pi_mul) and the down
  projections of all experts summed inside one linear (m, n f) @ (n f, d).
* ``cipherprune`` (appendix C, Figure 12, with the paper's "score binding"):
  for each expert the km candidates (priority score S_i[j], embedding
  x[j // k]) are sorted by t bubble passes of oblivious compare-and-swap
  (DReLU + one MUX over the d + 1 values of both neighbours), so the top-t
  candidates end in the first t places: O(n k m t) swaps of d-dimensional
  embeddings.  Combine undoes the swaps in reverse order on the expert outputs
  (MUX only, the swap bits are kept), after scaling them by the sorted scores,
  and sums each token's k candidate slots locally.  Same selection as
  CryptoMoE's Pi_dispatch (ties aside); cost O(n k m t d) instead of
  O(n k m log(km) + n t m).
"""

from __future__ import annotations

import numpy as np

from ..mpc.nonlinear import mulf, one_hot, swiglu
from ..mpc.protocols import compare
from ..mpc.protocols.mux import mux
from ..mpc.shares import AShare, BShare, concatenate
from ..protocols.linear import linear
from .experts import experts_swiglu


def run(variant, ctx, x, K, W, w, shape, t, meter, trace, *, key=None, sample=None):
    """(t or the largest expert load, y) for a baseline (called by `layer.moe_layer`;
    ``sample``: its benchmark-only ``expert_sample``)."""
    fn = {"insecure": insecure, "dense": dense, "cipherprune": cipherprune}[variant]
    return fn(ctx, x, K, W, w, shape, t, meter, trace, key=key, sample=sample)


def _ck(key, *parts):
    return None if key is None else (key, *parts)


def insecure(ctx, x, K, W, w, shape, t, meter, trace, *, key=None, sample=None):
    n, f, d = shape.n, shape.f, shape.d
    ne = n if sample is None else sample
    m = x.shape[0]
    with meter.phase("dispatch"):
        Kp = K.reveal().astype(np.int64)     # INSECURE: the routing is opened
        Wv = W.reveal_float()
    trace.update(K_open=Kp, W_open=Wv)
    y = AShare(ctx, np.zeros((m, d), np.uint64), x.bits, x.frac)
    load = 0
    with meter.phase("experts"):
        for e in range(ne):
            rows, slots = np.nonzero(Kp == e)
            if rows.size == 0:
                continue
            load = max(load, rows.size)
            gu = None if w is None else np.concatenate([w.gate[e], w.up[e]], axis=1)
            H = linear(ctx, x[rows], gu, out_features=2 * f, cache_key=_ck(key, "gu", e))
            A = swiglu(ctx, H[:, :f], H[:, f:])
            Ye = linear(ctx, A, None if w is None else w.down[e], out_features=d, cache_key=_ck(key, "down", e))
            Ye = Ye.mul_public_fixed(Wv[rows, slots][:, None])
            np.add.at(y.data, rows, Ye.data)   # uint64 arithmetic wraps mod 2^64
    return load, y


def dense(ctx, x, K, W, w, shape, t, meter, trace, *, key=None, sample=None):
    n, f, d, k = shape.n, shape.f, shape.d, shape.k
    m = x.shape[0]
    ne = n if sample is None else sample
    with meter.phase("dispatch"):
        oh = one_hot(ctx, K.reshape(m * k), n)                          # (mk, n) bits
        S = mux(ctx, oh, W.reshape(m * k, 1).broadcast_to((m * k, n)))  # masked scores per slot
        S = S.reshape(m, k, n).sum(axis=1)                               # (m, n)
    trace.update(dense_scores=S)
    with meter.phase("experts"):
        gu = None if w is None else np.concatenate([w.gate, w.up], axis=2).transpose(1, 0, 2).reshape(d, ne * 2 * f)
        H = linear(ctx, x, gu, out_features=ne * 2 * f, cache_key=_ck(key, "dense_gu")).reshape(m, ne, 2 * f)
        A = swiglu(ctx, H[..., :f], H[..., f:])
    with meter.phase("combine"):
        A = mulf(ctx, A, S[:, :ne].reshape(m, ne, 1).broadcast_to((m, ne, f)))
    with meter.phase("experts"):
        y = linear(ctx, A.reshape(m, ne * f), None if w is None else w.down.reshape(ne * f, d), out_features=d,
                   cache_key=_ck(key, "dense_down"))
    return m, y


def _cswap(ctx, bit: BShare, a: AShare, b: AShare):
    """(a, b) swapped where bit = 1: a' = a + bit (b - a), b' = b - bit (b - a)."""
    dlt = mux(ctx, BShare(ctx, np.broadcast_to(bit.data[..., None], a.shape).copy(), 1), b - a)
    return a + dlt, b - dlt


def cipherprune(ctx, x, K, W, w, shape, t, meter, trace, *, key=None, sample=None):
    d, k = shape.d, shape.k
    n = shape.n if sample is None else sample   # sample: the swap network for the first experts only
    m = x.shape[0]
    km = m * k
    with meter.phase("dispatch"):
        M = one_hot(ctx, K.reshape(km), shape.n)
        Mt = BShare(ctx, np.ascontiguousarray(M.data.T), 1)
        S = mux(ctx, Mt[:n], W.reshape(1, km).broadcast_to((n, km)))      # (n, km) priority scores
        # candidate rows: score bound to the embedding of its token, (n, km, 1 + d)
        E = concatenate([S.reshape(n, km, 1), x.reshape(m, 1, d).broadcast_to((m, k, d)).reshape(1, km, d)
                         .broadcast_to((n, km, d))], axis=2)
        rows = [E[:, j] for j in range(km)]
        swaps = []
        for p in range(t):                      # pass p bubbles the p-th largest to place p
            for j in range(km - 1, p, -1):
                lo, hi = rows[j - 1], rows[j]
                bit = compare.drelu(ctx, hi[:, 0] - lo[:, 0])  # 1{S[j] >= S[j-1]} (ties move up)
                rows[j - 1], rows[j] = _cswap(ctx, bit, lo, hi)
                swaps.append((j, bit))
        X = AShare(ctx, np.stack([rows[j].data[:, 1:] for j in range(t)], axis=1), x.bits, x.frac)  # (n, t, d)
        Sp = AShare(ctx, np.stack([rows[j].data[:, 0] for j in range(t)], axis=1), x.bits, x.frac)   # (n, t)
    trace.update(scores=Sp, swaps=len(swaps))
    with meter.phase("experts"):
        Y = experts_swiglu(ctx, X, w, shape, key=key)
    with meter.phase("combine"):
        Y = mulf(ctx, Y, Sp.reshape(n, t, 1).broadcast_to(Y.shape))
        zero = AShare(ctx, np.zeros((n, d), np.uint64), x.bits, x.frac)
        outs = [Y[:, j] for j in range(t)] + [zero] * (km - t)
        for j, bit in reversed(swaps):          # undo the permutation (same bits, MUX only)
            outs[j - 1], outs[j] = _cswap(ctx, bit, outs[j - 1], outs[j])
        full = AShare(ctx, np.stack([o.data for o in outs], axis=1), x.bits, x.frac)  # (n, km, d)
        y = full.reshape(n, m, k, d).sum(axis=2).sum(axis=0)
    return t, y


__all__ = ["run", "insecure", "dense", "cipherprune"]

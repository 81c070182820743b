"""The expert FFNs of a MoE layer on shares (CryptoMoE section 3 step 3 and section 4.4).

SwiGLU per expert, E_i(X) = (silu(X G_i) * (X U_i)) D_i, on each expert's rows
X (n, r, d).  Used by the CryptoMoE layer (`layer.moe_layer`) and by the
CipherPrune baseline (`baselines.cipherprune`); ``w`` is a `layer.MoEWeights`
(gate, up, down: (n, d, f), (n, d, f), (n, f, d)) and ``shape`` a `layer.MoEShape`.
"""

from __future__ import annotations

import numpy as np

from ..mpc.context import MPCError
from ..mpc.nonlinear import swiglu
from ..mpc.ring import mask
from ..mpc.shares import AShare
# _to_in_frac: the same input rescaling as linear()
from ..protocols.linear import (IN_FRAC, W_BITS, W_FRAC, _to_in_frac, cross_matmul, he_session, lift_local, linear,
                               matmul_small_mod)


def expert_linear(ctx, X: AShare, weight: np.ndarray | None, *, out_features: int, cache_key=None) -> AShare:
    """Y[e] = X[e] @ weight[e] for all experts e in one batched HE cross-term call
    (the `protocols.linear.linear` protocol with a batch of weights): X (n, r, d_in)
    shares, weight (n, d_in, d_out) float at party 1 (None at party 0)."""
    if not isinstance(X, AShare) or X.ndim != 3:
        raise MPCError("expert_linear expects shares of shape (n, rows, d_in)")
    n, r, d = X.shape
    o = int(out_features)
    he = he_session(ctx)
    kbits = he.t_bits
    xk = _to_in_frac(ctx, X).data & mask(kbits)
    Wq = None
    if ctx.party == 1:
        if weight is None or np.shape(weight) != (n, d, o):
            raise MPCError(f"expert weights have shape {None if weight is None else np.shape(weight)}, "
                           f"expected {(n, d, o)}")
        Wq = np.round(np.asarray(weight, np.float64) * (1 << W_FRAC)).astype(np.int64)
    with ctx.step("linear"):
        y = cross_matmul(ctx, 0, xk if ctx.party == 0 else None, Wq, (n, r, d, o), b_bits=W_BITS,
                         cache_key=cache_key)
    if ctx.party == 1:
        y = (y + matmul_small_mod(xk, Wq, kbits)) & mask(kbits)
    return lift_local(ctx, y, kbits, IN_FRAC + W_FRAC, ctx.ring.frac)


def experts_swiglu(ctx, X: AShare, w, shape, *, key=None,
                   batched: bool = True, packing: str = "coeff") -> AShare:
    """SwiGLU of every expert on its rows: X (n, r, d) -> (n, r, d).  ``batched=False``
    runs one `linear` call per expert and projection (the per-expert packing of the
    ablation: n times the flights, the same ciphertexts).

    ``packing="simd"``: the expert products in BFV SIMD slots with BSGS
    (`protocols.linear_simd.batch_linear`); ``batched=True`` is CryptoMoE's batch
    ct-pt MatMul (section 4.4: all experts' t rows share the ciphertexts, rotations
    O(d1) instead of O(n d1)), ``batched=False`` one SIMD plan per expert.  Rotation
    counts are in `linear_simd.simd_stats(ctx)`."""
    f = shape.f
    if packing == "simd":
        from ..protocols.linear_simd import batch_linear
        gu = None if w is None else np.concatenate([w.gate, w.up], axis=2)
        GU = batch_linear(ctx, X, gu, out_features=2 * f, batched=batched,
                          cache_key=None if key is None else (key, "gu"))
        A = swiglu(ctx, GU[..., :f], GU[..., f:])
        return batch_linear(ctx, A, None if w is None else w.down, out_features=shape.d, batched=batched,
                            cache_key=None if key is None else (key, "down"))
    if packing != "coeff":
        raise ValueError(f"packing must be 'coeff' or 'simd', got {packing!r}")
    if not batched:
        outs = []
        for e in range(X.shape[0]):
            gu = None if w is None else np.concatenate([w.gate[e], w.up[e]], axis=1)
            H = linear(ctx, X[e], gu, out_features=2 * f, cache_key=None if key is None else (key, "gu", e))
            A = swiglu(ctx, H[:, :f], H[:, f:])
            outs.append(linear(ctx, A, None if w is None else w.down[e], out_features=shape.d,
                               cache_key=None if key is None else (key, "down", e)))
        return AShare(ctx, np.stack([o.data for o in outs]), outs[0].bits, outs[0].frac)
    gu = None if w is None else np.concatenate([w.gate, w.up], axis=2)
    GU = expert_linear(ctx, X, gu, out_features=2 * f, cache_key=None if key is None else (key, "gu"))
    A = swiglu(ctx, GU[..., :f], GU[..., f:])
    return expert_linear(ctx, A, None if w is None else w.down, out_features=shape.d,
                         cache_key=None if key is None else (key, "down"))


__all__ = ["expert_linear", "experts_swiglu"]

"""Pi_combine on secret shares: CryptoMoE section 4.3 and Algorithm 2 (appendix B).

For every expert i (vectorised over all n):

  line 2  onehot(K'_i)^T (m, t): a local transpose of the shared bits (Pi_trans);
  line 3  [[R_i]] = onehot(K'_i)^T * S'_i, R_i[j][s] = onehot[s][j] S'_i[s]: the
          product of a shared 0/1 matrix and shared scores.  Pi_mul of a shared
          bit and a shared value *is* the multiplexer, so it is computed with
          Pi_mux (two COTs, ~48 bytes per element, exact) instead of a general
          Gilboa multiplication (~2.7 kB); same function, same output shares;
  line 4  [[y'_i]] = R_i y_{E_i} by Pi_matmul (`matmul_shared`);
  line 6  [[y]] = sum_i [[y'_i]].

``fused=True`` (default) evaluates lines 4 and 6 as one product
[R_0 | ... | R_{n-1}] (m, n t) @ [y_{E_0}; ...; y_{E_{n-1}}] (n t, d): the sum over
experts happens inside the HE inner product, so only m x d results are converted
back to shares instead of n m d.  ``fused=False`` is Algorithm 2 line by line
(n batched products, then the local sum).
"""

from __future__ import annotations

from ..mpc.context import MPCError
from ..mpc.protocols.mux import mux
from ..mpc.shares import AShare, BShare
from ..protocols.linear import matmul_shared


def combine(ctx, Y: AShare, scores: AShare, onehot: BShare, *, fused: bool = True) -> AShare:
    """Y (n, t, d) expert outputs, scores S' (n, t), onehot (n, t, m) bits -> y (m, d)."""
    if Y.ndim != 3 or scores.shape != Y.shape[:2] or onehot.shape[:2] != Y.shape[:2]:
        raise MPCError(f"combine expects Y (n, t, d), scores (n, t), onehot (n, t, m); got "
                       f"{Y.shape}, {scores.shape}, {onehot.shape}")
    n, t, d = Y.shape
    m = onehot.shape[2]
    OHt = onehot.transpose(0, 2, 1)                                    # (n, m, t), local
    R = mux(ctx, OHt, scores.reshape(n, 1, t).broadcast_to((n, m, t)))  # scored one-hot
    if fused:
        return matmul_shared(ctx, R.transpose(1, 0, 2).reshape(m, n * t), Y.reshape(n * t, d))
    return matmul_shared(ctx, R, Y).sum(axis=0)


__all__ = ["combine"]

"""Pi_dispatch on secret shares: CryptoMoE section 4.2 and Algorithm 1 (appendix B).

Inputs: token embeddings [[x]] (m, d), routing [[K]] (m, k) expert ids (integer
shares, frac 0) and [[W]] (m, k) scores.  For every expert i (vectorised over
all n experts at once; the loop of Algorithm 1 has no dependency between
experts):

  line 2  flatten K, W to km candidates, j = token * k + slot;
  line 3  [[M_i]]^B = Pi_equal(K, i): one batched `one_hot(K, n)` computes the
          n equalities of every candidate (CrypTFlow2 equality on ceil(log2 n) bits);
  line 4  [[S_i]] = Pi_mux(M_i, W): priority scores, 0 for candidates not routed to i;
  line 5  [[K_i]], [[S'_i]] = Pi_topk(S_i, k=t) over the km candidates
          (`topk_last`: t argmax trees, Bumblebee/CipherGPT-style);
  line 6  [[K'_i]] = [[K_i]] // k: exact secure division by the public k
          (`div_public`: a local multiplication by ceil(2^s / k) and one faithful
          truncation by s bits, Granlund-Montgomery; a plain faithful shift when k is
          a power of two; the identity for k = 1);
  line 7  Pi_onehot(K'_i, m): (t, m) shared bits, then B2A;
  line 8  [[X_i]] = onehot(K'_i) x by Pi_matmul (`matmul_shared`, HE cross terms);
          all experts in one product (n t, m) @ (m, d).

Nothing is opened: every step is a protocol on shares whose message sizes
depend only on (m, k, n, t, d).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mpc.context import MPCError
from ..mpc.nonlinear.select import one_hot, topk_last
from ..mpc.protocols.b2a import b2a
from ..mpc.protocols.mux import mux
from ..mpc.protocols.trunc import trunc_faithful
from ..mpc.shares import AShare, BShare
from ..protocols.linear import matmul_shared


def div_params(k: int, bound: int) -> tuple[int, int]:
    """(c, s) with floor(x c / 2^s) = floor(x / k) for every integer 0 <= x < bound
    (s = L + ceil(log2 k), c = ceil(2^s / k), L = bit length of bound - 1)."""
    if k < 1 or bound < 1:
        raise ValueError("need k >= 1 and bound >= 1")
    L = max(1, int(bound - 1).bit_length())
    s = L + max(0, int(k - 1).bit_length())
    c = -(-(1 << s) // k)
    return c, s


def div_public(ctx, x: AShare, k: int, bound: int) -> AShare:
    """Shares of floor(x / k) for integer shares x (frac 0) with 0 <= x < bound (exact)."""
    if x.frac != 0:
        raise MPCError("div_public expects integer shares (frac 0)")
    k = int(k)
    if k == 1:
        return x
    if k & (k - 1) == 0:
        out = trunc_faithful(ctx, x, k.bit_length() - 1)
    else:
        c, s = div_params(k, bound)
        if (bound * c).bit_length() >= x.bits - 1:
            raise MPCError(f"division by {k} of values below {bound} does not fit {x.bits}-bit shares")
        out = trunc_faithful(ctx, x * c, s)
    return AShare(ctx, out.data, x.bits, 0)


@dataclass
class SecureDispatch:
    """Output of Pi_dispatch: per-expert inputs and what Pi_combine reuses.

    X (n, t, d) dispatched embeddings; scores S' (n, t); onehot (n, t, m) shared
    bits of onehot(K'_i); and, for tests only, cand K_i (n, t) and token K'_i (n, t)."""

    X: AShare
    scores: AShare
    onehot: BShare
    cand: AShare
    token: AShare


def dispatch(ctx, x: AShare, K: AShare, W: AShare, n: int, t: int) -> SecureDispatch:
    """Algorithm 1 for all n experts (module docstring)."""
    if x.ndim != 2 or K.ndim != 2 or K.shape != W.shape or K.shape[0] != x.shape[0]:
        raise MPCError(f"dispatch expects x (m, d), K and W (m, k); got {x.shape}, {K.shape}, {W.shape}")
    m, k = K.shape
    d = x.shape[1]
    km = m * k
    if not 1 <= t <= km:
        raise MPCError(f"capacity t={t} must lie in [1, m k = {km}]")
    M = one_hot(ctx, K.reshape(km), n)                         # (km, n): M[j, i] = 1{K[j] == i}
    Mt = BShare(ctx, np.ascontiguousarray(M.data.T), 1)        # (n, km): row i = M_i
    S = mux(ctx, Mt, W.reshape(1, km).broadcast_to((n, km)))   # S_i[j] = M_i[j] W[j]
    Sp, Ki = topk_last(ctx, S, t)                              # (n, t) each
    Kp = div_public(ctx, Ki, k, km)                            # token index K_i // k
    OH = one_hot(ctx, Kp.reshape(n * t), m)                    # (n t, m) bits
    OHa = b2a(ctx, OH)                                         # arithmetic 0/1, frac 0
    X = matmul_shared(ctx, OHa, x).reshape(n, t, d)            # gather by Pi_matmul
    return SecureDispatch(X=X, scores=Sp, onehot=OH.reshape(n, t, m), cand=Ki, token=Kp)


__all__ = ["SecureDispatch", "dispatch", "div_public", "div_params"]

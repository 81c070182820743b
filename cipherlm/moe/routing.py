"""Inference-time balanced expert routing in plaintext (CryptoMoE section 4.1-4.2).

Gate routing (CryptoMoE eq. 1): ``W, K = Top-K(softmax(x W_r), k)`` per token;
``norm_topk_prob`` (Mixtral, optional for Qwen2-MoE / OLMoE) renormalises the k
selected scores to sum to one.

Balanced routing: every expert takes exactly ``t`` tokens,

    t = min(m, max(1, ceil(c * m * k / n)))           (`capacity`)

for m tokens, n experts, top-k routing and a capacity factor c (the paper's
CryptoMoE_{t=c}: c = 1.0 is the expected load m k / n, c = 2.0 the paper's
default).  The m k (token, slot) candidates are flattened token-major,
candidate j = token * k + slot (Algorithm 1 line 2), so ``j // k`` is the token.
For expert i the priority of candidate j is S_i[j] = W[j] if K[j] == i else 0
(Algorithm 1 lines 3-4).  Then

* ``selection="confidence"`` (section 4.2, confidence-aware): the t candidates
  with the highest S_i (Algorithm 1 line 5);
* ``selection="random"`` (the naive variant of the ablation, Figure 9): t of
  the candidates routed to i, uniformly at random, when more than t arrive.

When fewer than t candidates are routed to an expert the remaining slots are
*dummies* (padding): the expert still processes t rows, the dummies with weight
zero, so they do not change the output.  Token-expert pairs routed to an
expert that is over capacity and not selected are *dropped*: their weight is
lost (no renormalisation), exactly what the secure protocol computes.
``Dispatch.dropped_fraction`` reports the dropped share of the m k pairs.

This module is the plaintext reference of the secure protocols in
`cipherlm.moe.dispatch` / `cipherlm.moe.combine` (same t, same selection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SELECTIONS = ("confidence", "random")


def capacity(m: int, k: int, n: int, c: float) -> int:
    """t = min(m, max(1, ceil(c m k / n))) tokens per expert (CryptoMoE section 4.1 / 5.1)."""
    m, k, n = int(m), int(k), int(n)
    if m < 1 or n < 1 or not 1 <= k <= n:
        raise ValueError(f"need m >= 1, n >= 1 and 1 <= k <= n (got m={m}, k={k}, n={n})")
    if not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
        raise ValueError(f"capacity factor c must be a positive number, got {c!r}")
    # a tiny slack so that c m k / n that is an integer up to float rounding is not rounded up
    return int(min(m, max(1, math.ceil(c * m * k / n - 1e-9))))


@dataclass(frozen=True)
class BalancedRouting:
    """Model option: balanced routing with capacity factor ``c`` and a selection rule.

    ``seed`` drives the naive random selection only (a public plaintext ablation,
    never used for anything secret)."""

    c: float = 2.0
    selection: str = "confidence"
    seed: int = 0

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        capacity(1, 1, 1, self.c)  # validates c

    def capacity(self, m: int, k: int, n: int) -> int:
        return capacity(m, k, n, self.c)


def gate_topk(probs: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """(K (m, k) expert ids, W (m, k) scores) from router probabilities (m, n), as the
    plaintext executor routes (descending score, stable on ties)."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or not 1 <= k <= probs.shape[1]:
        raise ValueError(f"probs must be (m, n) with 1 <= k <= n, got shape {probs.shape} and k={k}")
    K = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    W = np.take_along_axis(probs, K, axis=-1)
    if norm_topk_prob:
        W = W / W.sum(axis=-1, keepdims=True)
    return K, W


@dataclass
class Dispatch:
    """Result of balanced dispatch for n experts with capacity t.

    ``cand`` (n, t): selected candidate indices j in [0, m k) (dummies included);
    ``token`` (n, t) = cand // k; ``score`` (n, t): S'_i (0 for dummies);
    ``valid`` (n, t): True where the slot holds a routed (token, expert) pair;
    ``routed`` = m k pairs, ``dropped``: routed pairs not selected."""

    n: int
    t: int
    k: int
    m: int
    cand: np.ndarray
    token: np.ndarray
    score: np.ndarray
    valid: np.ndarray
    dropped: int
    load: np.ndarray  # (n,) candidates routed to each expert before capacity

    @property
    def routed(self) -> int:
        return self.m * self.k

    @property
    def dropped_fraction(self) -> float:
        return self.dropped / self.routed

    def combine(self, y: np.ndarray) -> np.ndarray:
        """Algorithm 2 in plaintext: y (n, t, d) expert outputs -> (m, d) = sum over experts
        of onehot(token)^T (score * y)."""
        y = np.asarray(y, dtype=np.float64)
        if y.shape[:2] != (self.n, self.t):
            raise ValueError(f"expert outputs must be (n={self.n}, t={self.t}, d), got {y.shape}")
        out = np.zeros((self.m, y.shape[2]))
        w = np.where(self.valid, self.score, 0.0)
        np.add.at(out, self.token.reshape(-1), (w[..., None] * y).reshape(-1, y.shape[2]))
        return out


def priority_scores(K: np.ndarray, W: np.ndarray, n: int) -> np.ndarray:
    """S (n, m k): S[i, j] = W[j] if K[j] == i else 0 (Algorithm 1 lines 2-4)."""
    Kf = np.asarray(K).reshape(-1)
    Wf = np.asarray(W, dtype=np.float64).reshape(-1)
    return np.where(Kf[None, :] == np.arange(n)[:, None], Wf[None, :], 0.0)


def balanced_dispatch(K: np.ndarray, W: np.ndarray, n: int, t: int, selection: str = "confidence",
                      rng: np.random.Generator | None = None) -> Dispatch:
    """Select exactly t candidates per expert (module docstring).  K, W: (m, k)."""
    K = np.asarray(K)
    W = np.asarray(W, dtype=np.float64)
    if K.ndim != 2 or K.shape != W.shape:
        raise ValueError(f"K and W must both be (m, k), got {K.shape} and {W.shape}")
    m, k = K.shape
    if K.size and (K.min() < 0 or K.max() >= n):
        raise ValueError(f"expert ids must lie in [0, {n})")
    if not 1 <= t <= m * k:
        raise ValueError(f"capacity t={t} must lie in [1, m k = {m * k}]")
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    S = priority_scores(K, W, n)
    Kf = K.reshape(-1)
    cand = np.zeros((n, t), np.int64)
    valid = np.zeros((n, t), bool)
    load = np.zeros(n, np.int64)
    dropped = 0
    for i in range(n):
        useful = np.nonzero(Kf == i)[0]
        load[i] = useful.size
        if selection == "confidence":
            keep = useful[np.argsort(-S[i, useful], kind="stable")][:t]
        elif useful.size > t:
            rng = rng if rng is not None else np.random.default_rng(0)
            keep = np.sort(rng.choice(useful, size=t, replace=False))
        else:
            keep = useful
        dropped += useful.size - keep.size
        dummies = np.setdiff1d(np.arange(m * k), useful)[: t - keep.size]
        cand[i, : keep.size] = keep
        cand[i, keep.size:] = dummies
        valid[i, : keep.size] = True
    score = np.where(valid, np.take_along_axis(S, cand, axis=1), 0.0)
    return Dispatch(n=n, t=t, k=k, m=m, cand=cand, token=cand // k, score=score, valid=valid,
                    dropped=int(dropped), load=load)


def balanced_moe(h: np.ndarray, K: np.ndarray, W: np.ndarray, n: int, t: int, expert_fn,
                 selection: str = "confidence", rng: np.random.Generator | None = None):
    """Plaintext balanced MoE: (out (m, d), Dispatch).  ``expert_fn(e, rows (r, d)) -> (r, d)``
    is called once per expert on its selected tokens (dummies skipped: weight zero)."""
    h = np.asarray(h, dtype=np.float64)
    disp = balanced_dispatch(K, W, n, t, selection, rng)
    out = np.zeros_like(h)
    for e in range(n):
        sel = disp.valid[e]
        if not sel.any():
            continue
        rows = disp.token[e, sel]
        y = np.asarray(expert_fn(e, h[rows]), dtype=np.float64)
        np.add.at(out, rows, disp.score[e, sel][:, None] * y)
    return out, disp


__all__ = ["BalancedRouting", "Dispatch", "SELECTIONS", "capacity", "gate_topk", "priority_scores",
           "balanced_dispatch", "balanced_moe"]

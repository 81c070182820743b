"""One MoE layer in the 2pc mode (CryptoMoE sections 3-4, Figure 3).

    [[x]] --gate routing--> [[K]], [[W]] --Pi_dispatch--> [[X_i]] --experts--> [[y_Ei]] --Pi_combine--> [[y]]

* **Gate routing** (step 1, eq. 1): logits = `linear`(x, W_router) (HE), then
  Pi_topk.  Top-k is taken on the *logits* (softmax is monotone, so the
  selected experts are those of Top-K(softmax(.))), and the scores are that
  softmax at the selected experts: W = exp(l_K - l_max) / sum_j exp(l_j - l_max)
  with l_max = the first top-k value (no separate max tree), one `exp_neg`
  batch over the n + k values and one `reciprocal` per token; with
  ``norm_topk_prob`` (Mixtral) W = softmax over the k selected logits.  The
  selection then depends only on the HE linear layer's rounding, not on the
  softmax approximation.
* **Dispatch** (`dispatch.dispatch`, Algorithm 1) with t = `routing.capacity`(m, k, n, c).
* **Experts** (step 3, `experts.py`): SwiGLU per expert, E_i(X) = (silu(X G_i) * (X U_i)) D_i.
  The n experts' products go through *one* batched HE cross-term call per
  projection (`expert_linear`: batch dimension = expert, each expert with its
  own weight; gate and up fused into one (d, 2f) weight), and `nonlinear.swiglu`.
* **Combine** (`combine.combine`, Algorithm 2).
* A shared expert (Qwen2-MoE; DeepSeek-style shared experts) is evaluated
  densely on every token and weighted by sigmoid(x w_sg), sigmoid(z) computed as
  the first entry of softmax([z, 0]).

`moe_layer(..., variant=)` also runs the baselines of `baselines.py`.  Per-phase
bytes / flights / seconds are recorded by `PhaseMeter` (channel counter
differences; the meter never looks at data).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..mpc.context import MPCError
from ..mpc.nonlinear import exp_neg, mulf, reciprocal, softmax, swiglu, topk_last
from ..mpc.shares import AShare, concatenate
from ..protocols.linear import linear
from . import baselines
from .combine import combine
from .dispatch import dispatch
from .experts import expert_linear, experts_swiglu  # re-exported: the expert FFNs live in experts.py
from .routing import capacity

VARIANTS = ("cryptomoe", "insecure", "dense", "cipherprune")


# ----------------------------------------------------------------------------- shapes and weights

@dataclass(frozen=True)
class MoEShape:
    """Public architecture of one MoE layer: hidden d, n experts, top-k, expert FFN f,
    ``norm_topk_prob``, shared-expert FFN width (0: none). A model's layers get theirs
    from the model graph (`cipherlm.runtime.twopc.moe_shape` of a ``moe`` node)."""

    d: int
    n: int
    k: int
    f: int
    norm_topk_prob: bool = False
    shared_f: int = 0

    def __post_init__(self):
        if min(self.d, self.n, self.k, self.f) < 1 or self.k > self.n or self.shared_f < 0:
            raise ValueError(f"bad MoE shape {self}")


@dataclass
class MoEWeights:
    """The server's weights of one MoE layer, in (d_in, d_out) orientation.

    router (d, n); gate, up (n, d, f); down (n, f, d); shared_* for a shared expert
    (gate/up (d, fs), down (fs, d), shared_router (d, 1)) or None."""

    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    shared_gate: np.ndarray | None = None
    shared_up: np.ndarray | None = None
    shared_down: np.ndarray | None = None
    shared_router: np.ndarray | None = None

    def check(self, shape: MoEShape, experts: int | None = None) -> None:
        """Shapes against ``shape``; ``experts``: how many experts' FFN weights are held
        (default all n; fewer only for `moe_layer`'s benchmark-only ``expert_sample``)."""
        d, n, f = shape.d, shape.n, shape.f
        ne = n if experts is None else experts
        want = {"router": (d, n), "gate": (ne, d, f), "up": (ne, d, f), "down": (ne, f, d)}
        if shape.shared_f:
            fs = shape.shared_f
            want |= {"shared_gate": (d, fs), "shared_up": (d, fs), "shared_down": (fs, d), "shared_router": (d, 1)}
        for name, shp in want.items():
            a = getattr(self, name)
            if a is None or np.shape(a) != shp:
                raise MPCError(f"MoE weight {name} has shape {None if a is None else np.shape(a)}, expected {shp}")

    @classmethod
    def random(cls, shape: MoEShape, rng: np.random.Generator, scale: float = 1.0,
               experts: int | None = None) -> "MoEWeights":
        """Random weights (std scale / sqrt(fan_in)); for tests and the benchmark
        (``experts``: FFN weights of only that many experts, for ``expert_sample``)."""
        d, n, f, fs = shape.d, shape.n, shape.f, shape.shared_f
        ne = n if experts is None else experts
        g = lambda *s: (rng.standard_normal(s, dtype=np.float32) * np.float32(scale / np.sqrt(s[-2])))
        w = cls(router=g(d, n), gate=g(ne, d, f), up=g(ne, d, f), down=g(ne, f, d))
        if fs:
            w.shared_gate, w.shared_up, w.shared_down, w.shared_router = g(d, fs), g(d, fs), g(fs, d), g(d, 1)
        return w


# ----------------------------------------------------------------------------- metering

@dataclass
class PhaseMeter:
    """Bytes / messages / flights / seconds per phase (differences of the channel counters)."""

    ctx: object
    phases: dict = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str):
        before = self.ctx.chan.totals()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            after = self.ctx.chan.totals()
            row = self.phases.setdefault(name, {k: 0 for k in after} | {"seconds": 0.0})
            for k in after:
                row[k] += after[k] - before[k]
            row["seconds"] += time.perf_counter() - t0


# ----------------------------------------------------------------------------- building blocks

def gate_routing(ctx, x: AShare, router: np.ndarray | None, shape: MoEShape, *, cache_key=None):
    """(K (m, k) integer shares, W (m, k) score shares): CryptoMoE eq. 1 (module docstring)."""
    n, k = shape.n, shape.k
    logits = linear(ctx, x, router, out_features=n, cache_key=cache_key)
    vals, K = topk_last(ctx, logits, k)
    if shape.norm_topk_prob:
        return K, softmax(ctx, vals)
    m = x.shape[0]
    lmax = vals[:, :1]
    e = exp_neg(ctx, concatenate([logits - lmax.broadcast_to((m, n)), vals - lmax.broadcast_to((m, k))], axis=1))
    r = reciprocal(ctx, e[:, :n].sum(axis=1, keepdims=True), lo=0.5, hi=float(n + 1))
    return K, mulf(ctx, e[:, n:], r.broadcast_to((m, k)), bound=2.0)  # e <= 1, r <= 1


def shared_expert(ctx, x: AShare, w: MoEWeights | None, shape: MoEShape, *, key=None) -> AShare:
    """sigmoid(x w_sg) * SwiGLU_shared(x), evaluated densely on all tokens."""
    fs = shape.shared_f
    W = None if w is None else np.concatenate([w.shared_gate, w.shared_up, w.shared_router], axis=1)
    h = linear(ctx, x, W, out_features=2 * fs + 1, cache_key=None if key is None else (key, "shared_in"))
    A = swiglu(ctx, h[:, :fs], h[:, fs:2 * fs])
    y = linear(ctx, A, None if w is None else w.shared_down, out_features=shape.d,
               cache_key=None if key is None else (key, "shared_down"))
    z = h[:, 2 * fs:]
    sig = softmax(ctx, concatenate([z, z - z], axis=1))[:, :1]   # sigmoid(z) = softmax([z, 0])_0
    return mulf(ctx, y, sig.broadcast_to(y.shape))


# ----------------------------------------------------------------------------- plaintext reference

def _silu(v):
    return v / (1.0 + np.exp(-v))


def plain_layer(X: np.ndarray, w: MoEWeights, shape: MoEShape, *, c: float | None = 2.0,
                selection: str = "confidence", rng=None):
    """The plaintext MoE layer in float64: (y (m, d), routing.Dispatch or None).

    ``c=None``: the model's own top-k routing (the insecure and dense baselines compute
    this function); otherwise balanced routing with capacity factor c (CryptoMoE)."""
    from .routing import balanced_dispatch, gate_topk

    X = np.asarray(X, np.float64)
    m = X.shape[0]
    logits = X @ w.router
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    K, W = gate_topk(p, shape.k, shape.norm_topk_prob)
    f = lambda e, R: (_silu(R @ w.gate[e]) * (R @ w.up[e])) @ w.down[e]
    disp = None
    y = np.zeros((m, shape.d))
    if c is None:
        for e in range(shape.n):
            rows, slots = np.nonzero(K == e)
            if rows.size:
                np.add.at(y, rows, W[rows, slots][:, None] * f(e, X[rows]))
    else:
        disp = balanced_dispatch(K, W, shape.n, capacity(m, shape.k, shape.n, c), selection, rng)
        Y = np.stack([f(e, X[disp.token[e]]) for e in range(shape.n)])
        y = disp.combine(Y)
    if shape.shared_f:
        sg = 1.0 / (1.0 + np.exp(-(X @ w.shared_router)))
        y = y + sg * ((_silu(X @ w.shared_gate) * (X @ w.shared_up)) @ w.shared_down)
    return y, disp


# ----------------------------------------------------------------------------- the layer

@dataclass
class MoEResult:
    """y (m, d) shares; ``t``; per-phase counters; ``trace`` (tests only: internal shares)."""

    y: AShare
    t: int
    phases: dict
    trace: dict


def moe_layer(ctx, x: AShare, weights: MoEWeights | None, shape: MoEShape, *, variant: str = "cryptomoe",
              c: float = 2.0, fused_combine: bool = True, key=None, expert_sample: int | None = None,
              batch_experts: bool = True, expert_packing: str = "coeff") -> MoEResult:
    """One MoE layer on shares x (m, d).  ``weights`` at party 1 (the server), None at
    party 0.  ``variant``: "cryptomoe" (this module), "insecure" / "dense" /
    "cipherprune" (`baselines`).  ``c``: capacity factor (t = ceil(c m k / n)).
    ``key``: a name for caching the encoded weights across calls.  ``batch_experts``:
    all experts' products in one batched HE call per projection (default) or one call
    per expert (the ablation's per-expert packing).  ``expert_packing``: "coeff"
    (Cheetah coefficient packing) or "simd" (BFV slots + BSGS; with ``batch_experts``
    CryptoMoE's batch MatMul, `experts_swiglu`).

    ``expert_sample`` (benchmark only, the output is then *not* the layer's): evaluate
    the expert FFNs of the first s experts only (the others output zeros; for
    "cipherprune" the swap network also runs for those s experts only), so that
    the per-expert costs of a shape too large for this machine can be measured
    and extrapolated by n / s (`cipherlm.bench.moe`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not isinstance(x, AShare) or x.ndim != 2 or x.shape[1] != shape.d:
        raise MPCError(f"moe_layer expects shares of shape (m, {shape.d}), got {getattr(x, 'shape', None)}")
    if expert_sample is not None and not 1 <= expert_sample <= shape.n:
        raise ValueError(f"expert_sample must lie in [1, {shape.n}]")
    if ctx.party == 1:
        if weights is None:
            raise MPCError("the server must pass the MoE weights")
        weights.check(shape, expert_sample)
    w = weights if ctx.party == 1 else None
    m = x.shape[0]
    meter = PhaseMeter(ctx)
    trace: dict = {}
    with meter.phase("gate"):
        K, W = gate_routing(ctx, x, None if w is None else w.router, shape,
                            cache_key=None if key is None else (key, "router"))
    trace.update(K=K, W=W)
    t = capacity(m, shape.k, shape.n, c)
    if variant == "cryptomoe":
        with meter.phase("dispatch"):
            disp = dispatch(ctx, x, K, W, shape.n, t)
        trace.update(cand=disp.cand, token=disp.token, scores=disp.scores)
        with meter.phase("experts"):
            if expert_sample is None:
                Y = experts_swiglu(ctx, disp.X, w, shape, key=key, batched=batch_experts,
                                   packing=expert_packing)
            else:
                Ys = experts_swiglu(ctx, disp.X[:expert_sample], w, shape, key=key, batched=batch_experts,
                                    packing=expert_packing)
                Y = concatenate([Ys, AShare(ctx, np.zeros((shape.n - expert_sample,) + Ys.shape[1:], np.uint64),
                                            Ys.bits, Ys.frac)], axis=0)
        with meter.phase("combine"):
            y = combine(ctx, Y, disp.scores, disp.onehot, fused=fused_combine)
    else:
        t, y = baselines.run(variant, ctx, x, K, W, w, shape, t, meter, trace, key=key, sample=expert_sample)
    if shape.shared_f:
        with meter.phase("shared"):
            y = y + shared_expert(ctx, x, w, shape, key=key)
    return MoEResult(y=y, t=t, phases=meter.phases, trace=trace)


__all__ = ["MoEShape", "MoEWeights", "MoEResult", "PhaseMeter", "VARIANTS", "moe_layer", "plain_layer", "gate_routing",
           "experts_swiglu", "expert_linear", "shared_expert"]

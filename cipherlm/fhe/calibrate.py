"""Input ranges of the fhe mode's approximations, measured on real inputs by the plain executor.

A polynomial approximation is only valid on its interval (AEGIS section 2.4;
`cipherlm.fhe.approx`), and outside it a Chebyshev series diverges fast, so the fhe
mode needs each nonlinear operator's input range before it compiles.  This module
runs the PLAIN graph executor (`cipherlm.runtime.plain.plain_executor`) over a few
inputs with its nonlinear backend wrapped (`RecordingBackend`): every call is passed
to the real `PlainBackend` and its result returned unchanged, and per graph node the
recorder keeps the min / max of

* ``activation``: the activation's input (kind ``gelu`` / ``silu`` / ``tanh`` / ...);
* ``softmax``: the exp input after the row max is subtracted (kind ``exp``: <= 0; the
  masked entries, -inf, are left out) and the row sum of those exps (kind ``inv``: >= 1);
* ``layer_norm`` / ``rms_norm``: the variance (LayerNorm) or mean square (RMSNorm) plus
  eps, i.e. rsqrt's input (kind ``rsqrt``).

`calibrate_ranges` adds a safety margin and returns, per kind, the range the
approximations should use.  This module is in the runtime layer (tests/test_layering.py):
it loads models and runs the executor; `cipherlm.fhe.approx` stays below it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..runtime.graph_executor import PlainBackend

_ACT_KIND = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu", "tanh": "tanh"}


class RecordingBackend:
    """Wraps a `PlainBackend`: results unchanged, ranges recorded in ``self.stats``
    ({node name: {"kind", "op", "layer", "min", "max", "count"}})."""

    def __init__(self, inner: PlainBackend):
        self.inner = inner
        self.stats: dict[str, dict] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _note(self, node, kind: str, values) -> None:
        v = np.asarray(values, np.float64)
        v = v[np.isfinite(v)]
        if v.size == 0:
            return
        key = node.name if kind not in ("exp", "inv") else f"{node.name}:{kind}"
        s = self.stats.setdefault(key, {"kind": kind, "op": node.op, "layer": node.layer, "node": node.name,
                                        "min": np.inf, "max": -np.inf, "count": 0})
        s["min"] = min(s["min"], float(v.min()))
        s["max"] = max(s["max"], float(v.max()))
        s["count"] += int(v.size)

    def activation(self, node, x, ctx):
        self._note(node, _ACT_KIND.get(node.attrs["fn"], node.attrs["fn"]), x)
        return self.inner.activation(node, x, ctx)

    def softmax(self, node, s, ctx):
        s = np.asarray(s, np.float64)
        m = np.max(s, axis=-1, keepdims=True)
        z = s - np.where(np.isfinite(m), m, 0.0)
        self._note(node, "exp", z)
        self._note(node, "inv", np.sum(np.exp(z), axis=-1))
        return self.inner.softmax(node, s, ctx)

    def layer_norm(self, node, x, ctx):
        x64 = np.asarray(x, np.float64)
        self._note(node, "rsqrt", np.var(x64, axis=-1) + node.attrs["eps"])
        return self.inner.layer_norm(node, x, ctx)

    def rms_norm(self, node, x, ctx):
        x64 = np.asarray(x, np.float64)
        self._note(node, "rsqrt", np.mean(x64 * x64, axis=-1) + node.attrs["eps"])
        return self.inner.rms_norm(node, x, ctx)


def with_margin(kind: str, lo: float, hi: float, margin: float) -> tuple[float, float]:
    """The observed [lo, hi] widened by `margin` (a fraction): activations and exp by
    margin x the span (exp's top stays 0); inv's bottom stays 1 (a row sum after max
    subtraction is >= 1) and its top grows by the factor 1 + margin; rsqrt's range is
    scaled by 1 / (1 + margin) and 1 + margin (variances span decades)."""
    span = hi - lo
    if kind == "exp":
        return float(lo - margin * max(span, 1.0)), 0.0
    if kind == "inv":
        return 1.0, float(max(hi * (1 + margin), 1.0 + margin))
    if kind == "rsqrt":
        return float(lo / (1 + margin)), float(hi * (1 + margin))
    w = margin * max(span, 1.0)
    return float(lo - w), float(hi + w)


def _encode(lm, text) -> list[int]:
    if isinstance(text, str):
        if lm.tokenizer is None:
            raise ValueError(f"{lm.name} has no tokenizer: pass token id lists instead of strings")
        return list(lm.tokenizer.encode(text).ids)
    return [int(t) for t in text]


def calibrate_ranges(model_name_or_dir, texts: Iterable[str | Sequence[int]], margin: float = 0.1,
                     max_tokens: int = 128) -> dict:
    """Run the plain executor of `model_name_or_dir` (a registered name, an HF directory or
    a `LoadedModel`) over `texts` (strings, or token id lists for a model without a
    tokenizer; each cut to `max_tokens`) and return

    {"model", "inputs", "tokens", "margin",
     "nodes": {node: {"kind", "op", "layer", "min", "max", "count"}},
     "observed": {kind: (min, max)} over all nodes,
     "ranges": {kind: (lo, hi)} = observed widened by `with_margin`}.

    The executor's outputs are those of an unwrapped one (the recorder returns what the
    plain backend returns)."""
    from ..models import load_model
    from ..runtime.plain import plain_executor

    lm = load_model(model_name_or_dir) if isinstance(model_name_or_dir, (str, bytes)) or \
        hasattr(model_name_or_dir, "__fspath__") else model_name_or_dir
    ex = plain_executor(lm)
    rec = RecordingBackend(ex.backend)
    ex.backend = rec
    n_in = n_tok = 0
    for text in texts:
        ids = _encode(lm, text)[: int(max_tokens)]
        if not ids:
            continue
        if ex.graph.kind == "decoder":
            ex.forward(ids)
        else:
            ex.forward(np.asarray(ids, np.int64))
        n_in += 1
        n_tok += len(ids)
    if n_in == 0:
        raise ValueError("no non-empty input to calibrate on")
    observed: dict[str, tuple[float, float]] = {}
    for s in rec.stats.values():
        lo, hi = observed.get(s["kind"], (np.inf, -np.inf))
        observed[s["kind"]] = (min(lo, s["min"]), max(hi, s["max"]))
    return {"model": getattr(lm, "name", str(model_name_or_dir)), "inputs": n_in, "tokens": n_tok,
            "margin": margin, "nodes": rec.stats, "observed": observed,
            "ranges": {k: with_margin(k, lo, hi, margin) for k, (lo, hi) in observed.items()}}


#: default error targets per kind (absolute for activations and exp, relative for inv and
#: rsqrt: `cipherlm.fhe.approx`)
TARGETS = {"gelu": 1e-3, "silu": 1e-3, "tanh": 1e-3, "exp": 1e-4, "inv": 1e-3, "rsqrt": 1e-3}


def approximations(calibration: dict, targets: dict | None = None, per_node: bool = False,
                   margin: float | None = None) -> dict:
    """`cipherlm.fhe.approx.approximation`s for a `calibrate_ranges` result: kind -> Approx
    over the union range of each kind, or with `per_node` node name -> {kind: Approx} over
    each node's own range (margin: the calibration's unless given); for the level pass
    (`passes.fhe_levels.run(graph, approximations=..., per_node=...)`).  Kinds the approx
    module has no polynomial for (relu, ...) are left out."""
    from .approx import OPS, approximation

    t = {**TARGETS, **(targets or {})}
    m = calibration["margin"] if margin is None else margin
    if not per_node:
        return {k: approximation(k, lo, hi, t[k]) for k, (lo, hi) in calibration["ranges"].items() if k in OPS}
    out: dict[str, dict] = {}
    for s in calibration["nodes"].values():
        if s["kind"] in OPS:
            lo, hi = with_margin(s["kind"], s["min"], s["max"], m)
            out.setdefault(s["node"], {})[s["kind"]] = approximation(s["kind"], lo, hi, t[s["kind"]])
    return out


# --------------------------------------------------------------------------- the fhe executor's ranges


def _plain_pass(ex, ids) -> tuple[dict, dict]:
    """(every value of one plain pass over token ids `ids`, the pass's ctx)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ex.graph.kind == "encoder":
        _single, _B, _T, ctx, inputs = ex._encoder_ctx(ids, None, None)
        return ex.run_nodes(ex.graph.nodes, dict(inputs), ctx), ctx
    T = ids.size
    ctx = {"pos0": 0, "T": T, "positions": np.arange(T), "last_only": False}
    inputs = {"ids": ids, "positions": np.arange(T)}
    return ex.run_nodes(ex.graph.nodes, inputs, ctx, ex.new_cache()), ctx


def fhe_ranges(ex, inputs: Iterable[Sequence[int]], margin: float = 0.25) -> dict:
    """What the fhe executor (`runtime.fhe_executor`) needs to know about values before it
    runs, measured by plain passes of the graph executor `ex` over token id lists `inputs`:

    * ``bounds``: value name -> max |value| x (1 + margin) (every value of the graph: the
      bootstrapping's input scaling, `protocols.ckks.evaluator`);
    * ``ranges``: (node name, kind) -> (lo, hi) of each approximation's input, widened by
      `with_margin`: activations and ``rsqrt`` (LayerNorm variance / RMSNorm mean square +
      eps).  Softmax needs only its scores' bound: its exp and inverse intervals follow
      from it (`protocols.ckks.attention.softmax_intervals`: an encrypted row maximum).
    """
    m = float(margin)
    bounds: dict[str, float] = {}
    raw: dict[tuple[str, str], list[float]] = {}
    nodes = ex.graph.nodes

    def note(key, v):
        v = np.asarray(v, np.float64)
        v = v[np.isfinite(v)]
        if v.size:
            r = raw.setdefault(key, [np.inf, -np.inf])
            r[0], r[1] = min(r[0], float(v.min())), max(r[1], float(v.max()))

    passes = []
    for ids in inputs:
        vals, _ctx = _plain_pass(ex, ids)
        passes.append(vals)
        for name, v in vals.items():
            if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                f = np.abs(v[np.isfinite(v)])
                if f.size:
                    bounds[name] = max(bounds.get(name, 0.0), float(f.max()))
        for n in nodes:
            if n.op == "activation":
                note((n.name, _ACT_KIND.get(n.attrs["fn"], n.attrs["fn"])), vals[n.inputs[0]])
            elif n.op == "layer_norm":
                note((n.name, "rsqrt"), np.var(vals[n.inputs[0]], axis=-1) + n.attrs["eps"])
            elif n.op == "rms_norm":
                x = vals[n.inputs[0]]
                note((n.name, "rsqrt"), np.mean(x * x, axis=-1) + n.attrs["eps"])
    if not passes:
        raise ValueError("no input to calibrate on")
    bounds = {k: v * (1 + m) + 1e-3 for k, v in bounds.items()}
    ranges = {key: with_margin(key[1], lo, hi, m) for key, (lo, hi) in raw.items()}
    return {"bounds": bounds, "ranges": ranges, "margin": m, "inputs": len(passes)}

"""Bind a graph to a checkpoint: each graph tensor from its Hugging Face source.

`bind(graph, weights)` -> {graph tensor name: float32 array}: GPT-2's Conv1D
weights are transposed to (d_out, d_in), fused expert tensors sliced per expert,
a tied LM head is the embedding array itself (no copy). The result is what the
passes rewrite and what the executors read (`linear_weights` gives the
`LinearBackend` view: {linear name: (W, b or None)}).
"""

from __future__ import annotations

import numpy as np

from .ir import Graph


def bind(graph: Graph, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in graph.tensors.items():
        if t.source not in weights:
            raise KeyError(f"checkpoint has no tensor {t.source!r} (graph tensor {name})")
        w = weights[t.source]
        if t.rows is not None:
            e, a, b = t.rows
            w = w[e, a:b]
        if t.transpose:
            w = np.ascontiguousarray(w.T)
        if tuple(w.shape) != t.shape:
            raise ValueError(f"tensor {name}: checkpoint shape {tuple(w.shape)}, graph shape {t.shape}")
        out[name] = w
    return out


def linear_weights(graph: Graph, params: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """{linear name: (W (d_out, d_in), b or None)} for every linear node of the graph."""
    out = {}
    for n in graph.linears():
        name = n.attrs["name"]
        out[name] = (params[f"{name}.weight"], params.get(f"{name}.bias") if n.attrs.get("bias") else None)
    return out

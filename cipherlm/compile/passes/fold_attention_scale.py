"""Fold the attention scale of Q K^T into whatever produces Q.

softmax(Q K^T * s) needs the product scaled by s = 1/sqrt(head_dim). On secret
shares a product by a public constant costs a truncation, so a private mode folds s
into the server's weights instead, exactly: Q is a linear function of the tensor
that produces it, through RoPE (a public linear map per position) and a split of
a fused projection (GPT-2's c_attn: only the query rows), and Q * s is that
producer with its output scaled by s:

* a linear node: its weight rows (and bias) times s (the query rows only, when Q
  is one part of a ``split`` of the node's output);
* an RMSNorm that keeps its gamma (OLMoE's q_norm, after the projection): gamma times s.

The trace stops (and the scale stays on the ``qk`` node) at anything else, or when
a value on the way is read by another node too. The folded ``qk`` node gets
``attrs["scale"] = 1.0`` and ``attrs["folded_scale"]`` (the factor moved).

This is what `cipherlm.runtime.twopc` did by hand (``scale_out`` on the stacked
q/k/v and the q_norm gamma). ``params`` None: the graph rewrite alone (a party
without the weights, whose peer ran the same pass).
"""

from __future__ import annotations

import copy

import numpy as np

from ..ir import Graph, Node


def _trace(graph: Graph, value: str, producers, consumers) -> tuple[Node, slice | None] | None:
    """(node whose parameters absorb the scale, row range of its weight or None for all)."""
    rows = None
    while True:
        if len(consumers.get(value, ())) != 1:
            return None
        n = producers.get(value)
        if n is None:
            return None
        if n.op == "rope":
            value = n.inputs[0]
            continue
        if n.op == "split" and not n.attrs.get("heads") and rows is None:
            j = n.outputs.index(value)
            sizes = n.attrs["sizes"]
            start = int(sum(sizes[:j]))
            rows = slice(start, start + int(sizes[j]))
            value = n.inputs[0]
            continue
        if n.op == "linear":
            return n, rows
        if n.op == "rms_norm" and n.attrs.get("gamma") and rows is None:
            return n, None
        return None


def plan(graph: Graph) -> dict[str, tuple[Node, slice | None]]:
    """{qk node name: (absorbing node, weight rows)} for every qk whose scale can move."""
    producers, consumers = graph.producers(), graph.consumers()
    out = {}
    for n in graph.nodes:
        if n.op == "qk" and n.attrs.get("scale", 1.0) != 1.0:
            t = _trace(graph, n.inputs[0], producers, consumers)
            if t is not None:
                out[n.name] = t
    return out


def run(graph: Graph, params: dict[str, np.ndarray] | None) -> tuple[Graph, dict | None]:
    todo = plan(graph)
    new_params = None if params is None else dict(params)
    for qk_name, (src, rows) in todo.items():
        s = float(graph.node(qk_name).attrs["scale"])
        if new_params is None:
            continue
        if src.op == "rms_norm":
            names = [(src.attrs["gamma"], slice(None))]
        else:
            name = src.attrs["name"]
            names = [(f"{name}.weight", rows or slice(None))]
            if src.attrs.get("bias"):
                names.append((f"{name}.bias", rows or slice(None)))
        for t, r in names:
            a = np.array(new_params[t], dtype=np.float64 if new_params[t].dtype != np.float32 else np.float32)
            a[r] = a[r] * s
            new_params[t] = a
    g = copy.copy(graph)
    g.nodes = []
    for n in graph.nodes:
        if n.name in todo:
            n = copy.copy(n)
            n.attrs = {**n.attrs, "scale": 1.0, "folded_scale": float(n.attrs["scale"])}
        g.nodes.append(n)
    g.meta = {**graph.meta, "folded_attention_scale": sorted(todo)}
    return g, new_params

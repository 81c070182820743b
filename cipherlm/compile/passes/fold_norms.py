"""Fold RMSNorm weights into the projections that read the norm's output.

The rule of `cipherlm.runtime.twopc.server_weights` (its ``fold_norms``): in a
pre-norm decoder RMSNorm(x) * gamma feeds only projections (q, k, v; gate, up; the
MoE router, every expert's gate and up, the shared expert and its gate; the LM
head), so gamma can scale those weights' input columns instead (through MoE dispatch and the
row selection before the head), exactly:
(x_hat * gamma) W^T = x_hat (W diag(gamma))^T. A norm whose output reaches anything
else (a residual, OLMoE's q/k norms before RoPE, BERT's and GPT-2's LayerNorms,
which the 2pc executor does not fold either) is left alone. The folded norm keeps
its place in the graph with no weight (``attrs["gamma"] = None``).

``bound``: as server_weights does for the 2pc linear protocol's public weight bound,
fold only if every folded weight stays within it (all norms or none). The 2pc
executor's extra factors (sqrt of its fixed-point RMS constant, the attention
scale folded into q) belong to that protocol and are not applied here.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from ..ir import Graph, Node


def _linear_readers(graph: Graph, value: str, consumers) -> list[Node] | None:
    """The linear nodes that read `value` directly or through an MoE dispatch; None if
    anything else reads it."""
    out = []
    for c in consumers.get(value, []):
        if c.op == "linear":
            out.append(c)
        elif c.op == "head":  # a row selection (the last position before the LM head) commutes with gamma
            sub = _linear_readers(graph, c.outputs[0], consumers)
            if sub is None:
                return None
            out += sub
        elif c.op == "dispatch" and c.inputs[0] == value:
            # the dispatched rows (output 0) must reach only linears; the selection (output 1) goes to combine
            sub = _linear_readers(graph, c.outputs[0], consumers)
            if sub is None:
                return None
            out += sub
        else:
            return None
    return out


def plan(graph: Graph) -> dict[str, list[Node]]:
    """{rms_norm node name: linear nodes whose weights absorb its gamma}."""
    consumers = graph.consumers()
    out = {}
    for n in graph.nodes:
        if n.op == "rms_norm" and n.attrs.get("gamma"):
            readers = _linear_readers(graph, n.out, consumers)
            if readers:
                out[n.name] = readers
    return out


def run(graph: Graph, params: dict[str, np.ndarray] | None, bound: float | None = None) -> tuple[Graph, dict | None]:
    """``params`` None: the graph rewrite alone (a party that holds no weights, e.g. the
    2pc client, whose plan says the server folded). Folded weights keep their dtype."""
    todo = plan(graph)
    folded: dict[str, np.ndarray] = {}
    for norm_name, readers in (todo.items() if params is not None else ()):
        gamma = np.asarray(params[graph.node(norm_name).attrs["gamma"]], np.float64)
        for r in readers:
            w = f"{r.attrs['name']}.weight"
            dtype = params[w].dtype if np.issubdtype(params[w].dtype, np.floating) else np.float32
            folded[w] = (np.asarray(params[w], np.float64) * gamma[None, :]).astype(dtype)
    if bound is not None and folded and max(float(np.max(np.abs(w))) for w in folded.values()) > bound:
        return graph, params
    g = copy.copy(graph)
    g.tensors = dict(graph.tensors)
    g.nodes = []
    for n in graph.nodes:
        if n.name in todo:
            n = copy.copy(n)
            n.attrs = {**n.attrs, "gamma": None, "folded": True}
            n.weights = ()
        g.nodes.append(n)
    g.meta = {**graph.meta, "folded_norms": sorted(todo)}
    if params is None:
        return g, None
    new_params = dict(params)
    for w, arr in folded.items():
        new_params[w] = arr
        t = g.tensors[w]
        if t.tied_to is not None:  # a tied head now has its own (folded) storage
            g.tensors[w] = dataclasses.replace(t, tied_to=None)
    return g, new_params


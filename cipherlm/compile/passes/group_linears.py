"""Projection groups: the linears that read the same value, evaluated as one stacked
matrix by a private mode (q, k, v; gate, up; per expert gate, up; Qwen2-MoE's shared
expert gate, up and its sigmoid gate).

The same groups, in the same order, as `cipherlm.runtime.linear_groups.groups_from_calls`
finds by tracing a forward with a recording backend, but read off the graph: no
forward pass, and every MoE expert is there (a trace only sees the experts its
tokens were routed to). A node with ``attrs["alone"]`` (none today) and the MoE
router (its output decides the dispatch, so it is evaluated first, on its own)
form groups of one.

Result: every linear node gets ``attrs["group"]`` (its group's index) and
``graph.meta["linear_groups"]`` lists ``(names, d_in, d_outs)`` per group, the
tuples `groups_from_calls` takes.
"""

from __future__ import annotations

import copy

from ..ir import Graph


def run(graph: Graph) -> Graph:
    g = copy.copy(graph)
    g.nodes = [copy.copy(n) for n in graph.nodes]
    for n in g.nodes:
        n.attrs = dict(n.attrs)
    g.meta = dict(graph.meta)
    groups: list[list] = []
    by_input: dict[str, int] = {}
    for n in g.nodes:
        if n.op != "linear":
            continue
        alone = n.attrs.get("alone") or n.name.endswith("moe.router")
        key = n.inputs[0]
        gi = None if alone else by_input.get(key)
        if gi is None:
            gi = len(groups)
            groups.append([(), n.attrs["d_in"], ()])
            if not alone:
                by_input[key] = gi
        grp = groups[gi]
        grp[0] += (n.attrs["name"],)
        grp[2] += (n.attrs["d_out"],)
        n.attrs["group"] = gi
    g.meta["linear_groups"] = [tuple(x) for x in groups]
    return g

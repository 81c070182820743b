"""Lower each MoE layer's subgraph to one ``moe`` node.

The builders spell an MoE layer out (router linear, ``topk``, one ``dispatch`` and
one gated FFN per expert, ``combine``, a shared expert), which is what the plain
and offload executors walk: they see the routing in the clear. In the 2pc mode the
routing is secret, so the layer is one protocol, CryptoMoE (``cryptomoe_000``
sections 3-4: gate routing, Pi_dispatch, the experts batched, Pi_combine), that
needs the whole layer at once: this pass replaces the subgraph by a single node
whose attrs carry the layer's public shape and the names of its projections.

Region of layer i: the nodes the builders name ``L{i}.moe.*`` and ``L{i}.shared.*``
(`builders.build_moe_ffn`); it reads one value (the normalised input) and one of
its values is read outside it (the layer's output). The ``moe`` node reads and
writes those two and owns every tensor of the region, so parameter counts and
`weights.linear_weights` stay as they were.

attrs: ``d``, ``n_experts``, ``k``, ``ffn``, ``norm_topk_prob``, ``scoring``,
``shared`` ("gated", "plain" or None), ``shared_ffn``, ``router`` (linear name),
``experts`` ([(gate, up, down) linear names] per expert), ``shared_linears``
({"gate", "up", "down", "router"} linear names, where present).
"""

from __future__ import annotations

import copy

from ..ir import Graph, Node


def _regions(graph: Graph) -> dict[int, list[Node]]:
    out: dict[int, list[Node]] = {}
    for n in graph.nodes:
        if n.layer is None:
            continue
        if n.name.startswith((f"L{n.layer}.moe.", f"L{n.layer}.shared.")):
            out.setdefault(n.layer, []).append(n)
    return {i: r for i, r in out.items() if any(n.op == "topk" for n in r)}


def _block(graph: Graph, layer: int, region: list[Node], consumers) -> Node:
    names = {n.name for n in region}
    made = {v for n in region for v in n.outputs}
    ins = sorted({v for n in region for v in n.inputs if v not in made})
    outs = [v for v in made if any(c.name not in names for c in consumers.get(v, ()))]
    if len(ins) != 1 or len(outs) != 1:
        raise ValueError(f"MoE layer {layer}: expected one input and one output, got {ins} -> {outs}")
    by = {n.name: n for n in region}
    p = f"L{layer}."
    topk = next(n for n in region if n.op == "topk")
    router = by[p + "moe.router"]
    n_exp = topk.attrs["n_experts"]
    experts = [tuple(by[f"{p}moe.e{e}.{part}"].attrs["name"] for part in ("gate", "up", "down"))
               for e in range(n_exp)]
    f = by[f"{p}moe.e0.gate"].attrs["d_out"]
    shared_linears = {part: by[f"{p}shared.{part}"].attrs["name"] for part in ("gate", "up", "down", "router")
                      if f"{p}shared.{part}" in by}
    shared = None
    if shared_linears:
        shared = "gated" if "router" in shared_linears else "plain"
    attrs = {
        "d": router.attrs["d_in"], "n_experts": n_exp, "k": topk.attrs["k"], "ffn": f,
        "norm_topk_prob": bool(topk.attrs.get("norm_topk_prob")), "scoring": topk.attrs.get("scoring", "softmax"),
        "shared": shared, "shared_ffn": by[f"{p}shared.gate"].attrs["d_out"] if shared else 0,
        "router": router.attrs["name"], "experts": experts, "shared_linears": shared_linears,
        "topk": dict(topk.attrs),
    }
    weights = tuple(t for n in region for t in n.weights)
    return Node("moe", f"{p}moe", (ins[0],), (outs[0],), ("T", attrs["d"]), attrs, weights, layer)


def run(graph: Graph) -> Graph:
    regions = _regions(graph)
    if not regions:
        return graph
    consumers = graph.consumers()
    blocks = {i: _block(graph, i, r, consumers) for i, r in regions.items()}
    drop = {n.name for r in regions.values() for n in r}
    g = copy.copy(graph)
    g.nodes = []
    for n in graph.nodes:
        if n.name in drop:
            b = blocks.get(n.layer)
            if b is not None and n.name == regions[n.layer][-1].name:
                g.nodes.append(b)
            continue
        g.nodes.append(n)
    g.meta = {k: v for k, v in graph.meta.items() if k != "linear_groups"}
    g.meta["moe_blocks"] = sorted(blocks)
    g.validate()
    return g

"""CKKS levels of the fhe mode: each node's multiplicative depth, the level of every value,
and the bootstraps a greedy placement needs (AEGIS sections 2.1 and 2.4, Figure 2).

AEGIS section 2.1: every product (PMult, CMult) consumes one level of the modulus chain,
Rescale drops one prime, and bootstrapping (Boot) "replenishes the modulus chain";
section 2.4: linear layers use PMult, attention and activations CMult, nonlinear
functions are polynomial approximations, and since each multiplication consumes a
level "bootstrapping (Boot) is periodically inserted".  This pass counts those levels
on the model graph (`cipherlm.compile.ir`) before anything is encrypted.

Depth per node (levels; the approximations are `cipherlm.fhe.approx.Approx`, their
``depth`` = Lattigo's ``chebyshev_levels`` + the Newton steps' levels):

=============================  ==============================================
linear                         1 (ct x pt, one rescale)
rope                           1 (x cos + rot(x) sin: ct x pt)
qk, av                         1 (ct x ct + relinearisation; the attention
                               scale is folded into q or exp's change of
                               variable)
mul (SwiGLU's act * up)        1 (ct x ct)
activation gelu / gelu_tanh,   the Approx's depth (gelu_tanh uses the erf
silu, tanh                     GeLU polynomial: |gelu - gelu_tanh| < 5e-4)
softmax                        exp + inv (of the row sum) + 1 (exp * inv);
                               the max subtraction is not counted: the exp
                               range assumes a public bound for the row max
                               (an encrypted max needs comparison
                               polynomials, a later refinement)
layer_norm, rms_norm           1 (square) + rsqrt + 1 (the centred, gamma-
                               scaled input times rsqrt: x * gamma is formed
                               alongside, mean and 1/d fold into integer
                               scalings and rsqrt's change of variable)
add, sub, reduce_sum, split,   0
concat, head, kv_cache
embed                          its output is a fresh ciphertext at level L
                               (the client encrypts the embeddings, AEGIS
                               section 2.4: "the client encrypts X")
argmax                         0: the client's, after decryption
=============================  ==============================================

Every other op (clip, relu, the MoE router / dispatch / combine, BLB's decomposed
cores) is listed in ``summary["unsupported"]`` and counted as 0 levels.

Levels: values start at ``L`` (a fresh encryption or a bootstrap's output: 9 for
Lattigo's N16QP1546H192H32 preset, whose residual chain has levels 0..9 and whose
bootstrap outputs level 9, docs/he_backend.md).  A node's inputs are brought to their
minimum level (modulus switching is free); each node runs as a sequence of stages
(an approximation's polynomial, then each Newton step; a norm's square, rsqrt pieces,
product), and before a stage that needs more levels than are left a bootstrap is
placed (greedy: just before the stage that would run out).  A bootstrap before a
node's first stage refreshes the inputs below the need (they stay refreshed for later
readers: one bootstrap per refreshed value); one inside a node refreshes the node's
running value (the auxiliary operand a Newton step or a norm's final product reads is
assumed refreshed with it: counted as one bootstrap point).  A stage needing more than
L levels is an error (lower the degree or narrow the range).  Greedy placement is not
optimal: placing bootstraps to minimise their count (or their cost, with the levels
they should output) over the whole graph is a later refinement (e.g. a shortest-path
/ dynamic programme over the cut points).

Output: a copy of the graph whose nodes carry ``attrs["fhe"]`` = {depth, stages,
level_in, level_out, bootstraps (the stages or values bootstrapped before)}, and
``meta["fhe_levels"]`` = the summary (`run`), with, per block (layer), the bootstraps
and the levels its critical path consumes in attention, FFN, norms and residuals.
"""

from __future__ import annotations

import copy

from ...fhe.approx import OPS, Approx, default_approximations
from ..ir import Graph, Node

#: the top level after a bootstrap at Lattigo's N16QP1546H192H32 (docs/he_backend.md)
DEFAULT_LEVELS = 9

_ZERO = {"add", "sub", "reduce_sum", "split", "concat", "head", "kv_cache", "argmax", "embed"}
_ONE = {"linear": "linear", "rope": "rope", "qk": "qk", "av": "av", "mul": "mul", "affine": "affine"}
_ACT = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu", "tanh": "tanh"}


def stages(node: Node, approx: dict[str, Approx]) -> list[tuple[str, int]] | None:
    """(stage name, levels) of `node` in order; None for an op this pass does not support."""
    op = node.op
    if op in _ZERO:
        return []
    if op in _ONE:
        return [(_ONE[op], 1)]
    if op == "activation":
        a = _ACT.get(node.attrs.get("fn"))
        return None if a is None else approx[a].stages
    if op == "softmax":
        return approx["exp"].stages + approx["inv"].stages + [("softmax.normalize", 1)]
    if op in ("layer_norm", "rms_norm"):
        return [("norm.square", 1)] + approx["rsqrt"].stages + [("norm.scale", 1)]
    if op == "rsqrt":
        return approx["rsqrt"].stages
    if op == "reciprocal":
        return approx["inv"].stages
    if op == "exp":
        return approx["exp"].stages
    return None


def category(node: Node) -> str:
    """attention | ffn | norm | residual | other (for the per-block summary; outside the
    layers everything but norms is "other": the LM head, BERT's pooler)."""
    if node.op in ("layer_norm", "rms_norm", "rsqrt", "affine"):
        return "norm"
    if node.layer is None:
        return "other"
    if node.op == "add":
        return "residual"
    if node.op in ("rope", "kv_cache", "qk", "softmax", "av", "exp", "reciprocal"):
        return "attention"
    if node.op in ("activation", "mul") or (node.op == "linear" and ".ffn" in node.name):
        return "ffn"
    if node.op == "linear":
        return "attention" if node.layer is not None else "other"
    return "other"


CATEGORIES = ("attention", "ffn", "norm", "residual", "other")


def _block(node: Node, seen_layer: bool) -> str:
    if node.layer is not None:
        return f"layer {node.layer}"
    return "head" if seen_layer else "embed"


def run(graph: Graph, levels: int = DEFAULT_LEVELS, approximations: dict[str, Approx] | None = None,
        per_node: dict[str, dict[str, Approx]] | None = None) -> Graph:
    """Annotate a copy of `graph` with CKKS depths and levels, place bootstraps greedily
    from the top level `levels`; the summary is ``meta["fhe_levels"]`` (see `summarise`).
    `approximations`: kind (`cipherlm.fhe.approx.OPS`) -> Approx, the defaults for the
    kinds not given; `per_node`: node name -> {kind: Approx} overriding them at that node
    (e.g. `cipherlm.fhe.calibrate.approximations(..., per_node=True)`: each norm's own
    variance range)."""
    L = int(levels)
    if L < 1:
        raise ValueError("levels must be >= 1")
    approx = dict(approximations or {})
    approx.update(default_approximations(ops=[op for op in OPS if op not in approx]))
    g = copy.deepcopy(graph)
    level: dict[str, int] = {}
    producer_layer: dict[str, int | None] = {}
    crit: dict[str, tuple[int, dict]] = {}  # value -> (critical depth within its block, levels per category)
    boots: list[dict] = []
    unsupported: list[str] = []
    seen_layer = False
    for node in g.nodes:
        seen_layer = seen_layer or node.layer is not None
        block = _block(node, seen_layer)
        st = stages(node, {**approx, **per_node[node.name]} if per_node and node.name in per_node else approx)
        if st is None:
            unsupported.append(f"{node.name} ({node.op}{':' + node.attrs['fn'] if 'fn' in node.attrs else ''})")
            st = []
        depth = sum(d for _, d in st)
        enc = [v for v in node.inputs if v in level]
        info: dict = {"depth": depth, "stages": [list(s) for s in st], "bootstraps": []}
        if node.op == "embed" or not enc:
            cur = L
        else:
            first = next((d for _, d in st if d > 0), 0)
            for v in enc:  # a bootstrap before the node: its inputs that are too low
                if level[v] < first:
                    boots.append({"block": block, "layer": node.layer, "before": node.name, "stage": "input",
                                  "value": v, "level": level[v]})
                    info["bootstraps"].append(v)
                    level[v] = L
            cur = min(level[v] for v in enc)
        info["level_in"] = cur
        for name, d in st:
            if d > L:
                raise ValueError(f"{node.name}: stage {name} needs {d} levels, more than a bootstrap gives ({L}); "
                                 f"lower the approximation's degree or narrow its range")
            if cur < d:
                boots.append({"block": block, "layer": node.layer, "before": node.name, "stage": name,
                              "value": f"{node.name}:{name}", "level": cur})
                info["bootstraps"].append(name)
                cur = L
            cur -= d
        info["level_out"] = cur
        node.attrs["fhe"] = info
        # critical path within the block: inputs from another block start at 0
        best = (0, {})
        for v in node.inputs:
            if v in crit and producer_layer.get(v) == node.layer and crit[v][0] > best[0]:
                best = crit[v]
        cats = dict(best[1])
        if depth:
            c = category(node)
            cats[c] = cats.get(c, 0) + depth
        for v in node.outputs:
            level[v] = cur
            producer_layer[v] = node.layer
            crit[v] = (best[0] + depth, cats)
    g.meta["fhe_levels"] = summarise(g, L, boots, unsupported, crit, level, approx)
    return g


def summarise(g: Graph, L: int, boots, unsupported, crit, level, approx) -> dict:
    """{"levels", "bootstraps", "bootstrap_points", "blocks": [{block, layer, bootstraps,
    depth, levels: {category: levels on the block's critical path}, level_in, level_out}],
    "min_level", "output_levels", "unsupported", "approximations"}."""
    blocks: dict[str, dict] = {}
    seen_layer = False
    for node in g.nodes:
        seen_layer = seen_layer or node.layer is not None
        name = _block(node, seen_layer)
        b = blocks.setdefault(name, {"block": name, "layer": node.layer, "bootstraps": 0, "depth": 0,
                                     "levels": {c: 0 for c in CATEGORIES}, "nodes": 0,
                                     "level_in": node.attrs["fhe"]["level_in"], "level_out": None})
        b["nodes"] += 1
        b["level_out"] = node.attrs["fhe"]["level_out"]
        for v in node.outputs:
            d, cats = crit[v]
            if d > b["depth"]:
                b["depth"] = d
                b["levels"] = {c: cats.get(c, 0) for c in CATEGORIES}
    for bt in boots:
        blocks[bt["block"]]["bootstraps"] += 1
    return {
        "levels": L,
        "bootstraps": len(boots),
        "bootstrap_points": boots,
        "blocks": list(blocks.values()),
        "min_level": min((n.attrs["fhe"]["level_out"] for n in g.nodes), default=L),
        "output_levels": {role: level.get(v) for role, v in g.outputs.items()},
        "unsupported": unsupported,
        "approximations": {op: {"lo": a.lo, "hi": a.hi, "degree": a.degree, "newton_steps": a.newton_steps,
                                "depth": a.depth, "max_abs_error": a.max_abs_error,
                                "max_rel_error": a.max_rel_error} for op, a in approx.items()},
    }


def format_summary(summary: dict) -> str:
    """The summary as text: per block its bootstraps, critical depth and levels per category."""
    lines = [(f"fhe levels: top level L = {summary['levels']} (after a bootstrap), "
              f"{summary['bootstraps']} bootstraps (greedy placement), lowest level reached {summary['min_level']}"),
             (f"  {'block':<10} {'boots':>5} {'depth':>5} {'attn':>5} {'ffn':>5} {'norm':>5} {'resid':>5} "
              f"{'other':>5} {'lvl in':>6} {'lvl out':>7}")]
    for b in summary["blocks"]:
        lv = b["levels"]
        lines.append(f"  {b['block']:<10} {b['bootstraps']:>5} {b['depth']:>5} {lv['attention']:>5} {lv['ffn']:>5} "
                     f"{lv['norm']:>5} {lv['residual']:>5} {lv['other']:>5} {b['level_in']:>6} {b['level_out']:>7}")
    lines.append("  (depth: levels on the block's critical path; attn/ffn/norm/resid: that path's levels per class)")
    if summary["unsupported"]:
        lines.append(f"  not supported, counted as 0 levels: {', '.join(summary['unsupported'])}")
    return "\n".join(lines)

"""BLB's FineGrainFusion (section 4) as a pass: classify every node (Table 2), then
group the linear operators into fused blocks by the patterns of Table 4, leaving the
nonlinear cores (max, exp, reciprocal, rsqrt, the activations' gates, lookups,
routing, argmax) to MPC.

The pass runs `blb_decompose` first (if the graph is not decomposed yet), so the
linear parts of LayerNorm, RMSNorm, softmax and GeLU / SiLU are operators of their own
and fuse with the projections around them.

**Classes** (Table 2; `classify`): over 2D (spatial x reduce) tensors,

* Identity: same dimensions in and out: elementwise add / sub / mul of equal shapes,
  the affine gamma / beta, layout (split, concat, KV-cache append, row selection);
* Expansion: a size-1 reduce dimension broadcast (a mul / add / sub with a (..., 1)
  operand: x - mean, x * rsqrt, e * 1/sum);
* Reduction: reduce dimension summed to 1 (``reduce_sum``);
* Transformation: the reduce dimension mapped to another (projections, ct-pt; Q K^T
  and P V, ct-ct; RoPE, a public linear map per position);
* Nonlinear: everything else (comparison, multiplexer, reciprocal, rsqrt [51]; the
  exp and activation-gate cores; the embedding lookup, a multiplexer on secret ids).

For a binary op with one broadcast operand the edge from that operand is an Expansion
and the edge from the full-size operand an Identity (`edge_class`).

**Fusion** (Table 4, `TABLE4`): an edge first -> second between two linear nodes is
fused when the cell (class of first, class of the edge into second) has a result type;
the empty cells (a Reduction or a Transformation followed by an Expansion, Expansion
then Expansion, Reduction then Reduction / Transformation) are cut. Edges are fused only
inside one *stage*: the stage of a node is the number of nonlinear operators on the
longest path to it, so a block never contains two nodes with an MPC core between them
(e.g. V = h Wv joins Q K^T's block, which reads the same h, not P V's, which comes two
cores later: V is carried to P V). A connected component of fused edges is a block; linear nodes of one stage that read
the same value from an MPC core join one block too (the value is converted in once:
an MoE expert's gate and up).

A block is an **HE block** (``meta["blb_blocks"]``) if it holds a product (a projection,
Q K^T, P V or an elementwise product of two secret values): those need HE (CKKS in BLB).
A component of additions and public scalings only (softmax's s - max) is local share
arithmetic and stays in MPC (``meta["blb_local"]``).

Per HE block the pass records: its nodes and their classes, the Table 4 cells it used,
its inputs (from an MPC core: the MPC->CKKS conversion; from another block: carried)
and outputs (to an MPC core: CKKS->MPC), the cores before and after it (the MPC part),
the multiplicative depth (`block_depth`; every block input counted fresh, depth 0,
as it comes through a conversion) and the packing: spatial-first throughout (section
4.2.1) with rotate-and-sum (Figure 6, Table 3) for every sum (log2 d rotations; no
mask and depth 0 when the sum's scale is 1) and broadcast (no rotation and no mask:
the sum is already replicated along the row, Figure 6's fused case, and a value from
MPC is encoded replicated by the conversion). Node attrs: ``blb_class`` and
``blb_block`` (the HE block's id, or None).

Each block's ``layer`` is the layer of its first node that is not part of a norm
(a norm's statistics end the block before the rsqrt, its scaling starts the next
one; a block of one norm's pieces only, after the first layer's blocks, is in that
norm's layer): so the norm between two layers belongs to the next layer's first block, and
``layer`` None marks the prologue (embedding sums, the first norm's statistics) and the
epilogue (the final norm's scaling, the pooler or the LM head). The 5 HE blocks per
BERT layer (Figure 10) are, in order: (1) LN scaling -> Q, K, V -> Q K^T; (2) exp
squarings -> row sum; (3) e / sum -> P V -> output projection -> residual -> LN
statistics; (4) LN scaling -> FFN up; (5) x * gate -> FFN down -> residual -> LN
statistics. docs/blb.md has the decoders' blocks.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import Counter

import numpy as np

from ..ir import Graph, Node
from . import blb_decompose

IDENTITY, EXPANSION, REDUCTION, TRANSFORMATION, NONLINEAR = (
    "identity", "expansion", "reduction", "transformation", "nonlinear")
LINEAR = (IDENTITY, EXPANSION, REDUCTION, TRANSFORMATION)

_I, _E, _R, _T = LINEAR
#: Table 4: (first, second) -> the fused operator's type; None: not fused
TABLE4 = {
    (_I, _I): _I, (_I, _E): _E, (_I, _R): _R, (_I, _T): _T,
    (_E, _I): _E, (_E, _E): None, (_E, _R): _I, (_E, _T): _E,
    (_R, _I): _R, (_R, _E): _I, (_R, _R): None, (_R, _T): None,
    (_T, _I): _T, (_T, _E): None, (_T, _R): _R, (_T, _T): _T,
}

_NONLINEAR_OPS = {
    "embed": "lookup", "layer_norm": "layer_norm", "rms_norm": "rms_norm", "softmax": "softmax",
    "activation": None, "clip": "clip", "topk": "top-k", "dispatch": "routing", "combine": "routing",
    "argmax": "argmax", "moe": "moe", "reduce_max": "max", "rsqrt": "rsqrt", "reciprocal": "reciprocal",
    "exp": "exp", "act_gate": None, "act_clamp": None, "clip_min": "exp clip",
}
_TRANSFORM_OPS = ("linear", "qk", "av", "rope")
_LAYOUT_OPS = ("split", "concat", "head", "kv_cache", "affine")
#: ops that need HE (a product with the weights or of two secret values)
_PRODUCTS = ("linear", "qk", "av", "mul", "poly")


def core_name(n: Node) -> str:
    """What an MPC core computes (for tables)."""
    c = _NONLINEAR_OPS.get(n.op)
    if n.op == "activation":
        return n.attrs.get("fn", "activation")
    if n.op == "act_gate":
        return {"gelu": "Phi (gelu gate)", "gelu_tanh": "tanh (gelu gate)", "silu": "sigmoid"}[n.attrs["fn"]]
    if n.op == "act_clamp":
        return f"{n.attrs['fn']} clamp"
    return c or n.op


#: the highest degree `monic_factors` evaluates without scalar products
MONIC_MAX_DEGREE = 4


def monic_factors(coeffs) -> list[tuple[float, float | None]] | None:
    """A monic polynomial sum_k c_k z^k (c_deg = 1, 1 <= deg <= MONIC_MAX_DEGREE) as a product
    of real factors, each ``(H, K)`` = (z + H)^2 + K or ``(H, None)`` = z + H (its roots paired:
    complex conjugates together, real ones in order), so that CKKS evaluates it with additions
    of constants, squares and products only: ceil(log2 deg) levels, no scalar product (the
    activation's clamped form scales its MPC output so that its polynomial is monic,
    `blb_decompose`).  None when the polynomial is not monic or of another degree."""
    c = [float(v) for v in coeffs]
    deg = len(c) - 1
    if not 1 <= deg <= MONIC_MAX_DEGREE or c[-1] != 1.0:
        return None
    roots = list(np.roots(c[::-1]))
    cplx = sorted([r for r in roots if r.imag > 1e-12], key=lambda r: r.real)
    real = sorted(float(r.real) for r in roots if abs(r.imag) <= 1e-12)
    quads = [(-r.real, (r.imag) ** 2) for r in cplx]  # (z - r)(z - conj r) = (z - Re r)^2 + Im r^2
    while len(real) >= 2:
        r1, r2 = real.pop(0), real.pop(0)
        quads.append((-(r1 + r2) / 2, -((r1 - r2) / 2) ** 2))
    return [(float(h), float(k)) for h, k in quads] + [(-r, None) for r in real]


def poly_depth(coeffs) -> int:
    """Levels of a public polynomial (coefficients c_0..c_deg) in CKKS
    (`runtime.blb_block._Eval.poly`): a monic one of degree <= MONIC_MAX_DEGREE by its
    `monic_factors`, ceil(log2 deg) levels; any other by the powers x^k (products of the
    highest powers of two, ceil(log2 deg) levels) and one plaintext product by the
    coefficients (one level more)."""
    deg = len(coeffs) - 1
    if deg <= 0:
        return 0
    if monic_factors(coeffs) is not None:
        return (deg - 1).bit_length()
    return (deg - 1).bit_length() + 1


def _shapes(graph: Graph) -> dict[str, tuple]:
    return {v: n.shape for n in graph.nodes for v in n.outputs}


def _broadcast(shape) -> bool:
    return bool(shape) and shape[-1] == 1


def classify(graph: Graph) -> dict[str, str]:
    """{node name: Table 2 class}."""
    shapes = _shapes(graph)
    out = {}
    for n in graph.nodes:
        if n.op in _NONLINEAR_OPS:
            k = NONLINEAR
        elif n.op in _TRANSFORM_OPS:
            k = TRANSFORMATION
        elif n.op == "reduce_sum":
            k = REDUCTION
        elif n.op == "poly":
            k = IDENTITY
        elif n.op in ("mul", "add", "sub"):
            k = EXPANSION if (any(_broadcast(shapes.get(v, ())) for v in n.inputs)
                              and not _broadcast(n.shape)) else IDENTITY
        elif n.op in _LAYOUT_OPS:
            k = IDENTITY
        else:
            raise ValueError(f"{n.name}: no BLB class for op {n.op!r}")
        out[n.name] = k
    return out


def edge_class(n: Node, value: str, classes: dict[str, str], shapes: dict[str, tuple]) -> str:
    """The class of `n` as seen from its input `value` (Expansion only for the broadcast operand)."""
    k = classes[n.name]
    if k == EXPANSION and not _broadcast(shapes.get(value, ())):
        return IDENTITY
    return k


def stages(graph: Graph, classes: dict[str, str]) -> dict[str, int]:
    """Nonlinear operators on the longest path to each node (graph inputs: 0)."""
    prod = graph.producers()
    st: dict[str, int] = {}
    for n in graph.nodes:
        s = 0
        for v in n.inputs:
            p = prod.get(v)
            if p is not None:
                s = max(s, st[p.name] + (1 if classes[p.name] == NONLINEAR else 0))
        st[n.name] = s
    return st


class _UF:
    def __init__(self, names):
        self.p = {n: n for n in names}

    def find(self, a):
        while self.p[a] != a:
            self.p[a] = self.p[self.p[a]]
            a = self.p[a]
        return a

    def union(self, a, b):
        self.p[self.find(a)] = self.find(b)


def _is_norm_piece(n: Node) -> bool:
    src = n.attrs.get("blb_from")
    return bool(src) and src[0] in ("layer_norm", "rms_norm")


#: levels of Q K^T / P V in the multi-head packing of BLB section 5 (`protocols.ckks.blb_matmul`)
#: on top of their operands': the first operand's giant-step mask (1) and the second's step-1
#: and baby-step masks (2) in parallel, then the ct-ct product and step 3's mask (2): from fresh
#: operands 4, the paper's "multiplication depth of our protocol is 4"
FUSED_A_MASKS, FUSED_B_MASKS, FUSED_AFTER = 1, 2, 2
FUSED_MATMUL_DEPTH = max(FUSED_A_MASKS, FUSED_B_MASKS) + FUSED_AFTER


def fused_matmul_depth(d_a: int, d_b: int) -> int:
    """The level of section 5's product of operands at depths d_a, d_b (`FUSED_A_MASKS`)."""
    return max(d_a + FUSED_A_MASKS, d_b + FUSED_B_MASKS) + FUSED_AFTER


def block_depth(nodes: list[Node], producers: dict[str, Node],
                fused: bool = False) -> tuple[int, dict[str, int], list[str]]:
    """(depth, {value: depth}, names of affines folded into projections). Inputs 0; a
    projection, Q K^T, P V, a product of two values, RoPE's cos / sin products and a
    gamma cost one level; a sum with a scale (a mean) one (its mask carries the 1/d);
    sums with scale 1, broadcasts, additions and layout none. A gamma / beta whose
    value reaches a projection in the block is folded into its weights there (depth of
    its input), as `fold_norms` does for RMSNorm.

    ``fused``: Q K^T and P V in section 5's multi-head packing (`runtime.blb_block`): an
    operand computed in the block in the row layout (Q, K; V) and a result read in the block
    (P V's output by the output projection) change packing through a conversion round trip
    (fresh, depth 0), and each product is at `fused_matmul_depth` of its operands."""
    names = {n.name for n in nodes}
    d: dict[str, int] = {}
    folded = []

    def din(v, for_linear=False):
        p = producers.get(v)
        if p is None or p.name not in names:
            return 0
        if for_linear and p.op == "affine":
            if p.name not in folded:
                folded.append(p.name)
            return din(p.inputs[0])
        if fused and p.op in ("qk", "av"):
            return 0  # re-packed into the row layout through the conversions
        return d[v]

    for n in nodes:
        ins = [din(v, n.op == "linear") for v in n.inputs] or [0]
        x = max(ins)
        if fused and n.op == "qk":
            x = fused_matmul_depth(0, 0)
        elif fused and n.op == "av":
            x = fused_matmul_depth(ins[0], 0)
        elif n.op in ("linear", "qk", "av", "mul", "rope"):
            x += 1
        elif n.op == "affine":
            x += 1 if n.attrs.get("gamma") else 0
        elif n.op == "reduce_sum":
            x += 1 if n.attrs.get("scale", 1.0) != 1.0 else 0
        elif n.op == "poly":
            x += poly_depth(n.attrs["coeffs"])
        for v in n.outputs:
            d[v] = x
    # an affine read only by projections (all folded) does not exist as a value of its own
    return max([d[v] for n in nodes for v in n.outputs if not _only_folded(n, nodes, folded)] or [0]), d, folded


def _only_folded(n: Node, nodes: list[Node], folded: list[str]) -> bool:
    if n.name not in folded:
        return False
    readers = [m for m in nodes if n.out in m.inputs]
    return all(m.op == "linear" for m in readers) and len(readers) > 0


def _short(nodes: list[Node], layer) -> str:
    """Compact op list: a decomposed layer's pieces as origin.piece+piece."""
    parts: list[tuple[str, list[str]]] = []
    for n in nodes:
        src = n.attrs.get("blb_from")
        origin = src[1] if src else n.name
        piece = (n.name[len(origin) + 1:] or src[0]) if src and n.name != origin else (n.op if src else "")
        if src and n.name == origin:
            piece = {"affine": "affine", "mul": "out"}.get(n.op, n.op)
        if parts and parts[-1][0] == origin:
            parts[-1][1].append(piece)
        else:
            parts.append((origin, [piece] if piece else []))
    out = []
    for origin, pieces in parts:
        if layer is not None and origin.startswith(f"L{layer}."):
            origin = origin[len(f"L{layer}."):]
        sq = [p for p in pieces if p.startswith("sq") and p[2:].isdigit()]
        if len(sq) > 2:
            pieces = [p for p in pieces if p not in sq]
            pieces.insert(0, f"sq1..{len(sq)}")
        out.append(origin + ("[" + ",".join(pieces) + "]" if pieces else ""))
    return " ".join(out)


def run(graph: Graph, exp_squarings: int = blb_decompose.EXP_SQUARINGS, activation: str = "gate",
        norms: str = "split", exp: str = "core") -> Graph:
    """The graph (decomposed if it was not, ``activation``, ``norms`` and ``exp`` as
    `blb_decompose.run` takes them) with ``attrs["blb_class"]``, ``attrs["blb_block"]`` on every node and
    ``meta["blb_blocks"]``, ``meta["blb_local"]``, ``meta["blb_mpc"]``, ``meta["blb_cuts"]``
    (module doc)."""
    g0 = blb_decompose.run(graph, exp_squarings, activation, norms, exp)
    classes = classify(g0)
    shapes = _shapes(g0)
    st = stages(g0, classes)
    prod = g0.producers()
    cons = g0.consumers()
    linear = [n for n in g0.nodes if classes[n.name] != NONLINEAR]
    uf = _UF([n.name for n in linear])
    cuts = []
    for n in linear:
        for v in n.inputs:
            p = prod.get(v)
            if p is None or classes[p.name] == NONLINEAR or st[p.name] != st[n.name]:
                continue
            if TABLE4[(classes[p.name], edge_class(n, v, classes, shapes))] is None:
                cuts.append((p.name, n.name))
                continue
            uf.union(p.name, n.name)
    # linear nodes of one stage reading the same value from MPC take it in once (one
    # conversion, one packing): an MoE expert's gate and up, both reading its dispatched rows
    for n in g0.nodes:
        if classes[n.name] != NONLINEAR:
            continue
        for v in n.outputs:
            readers = [c for c in cons.get(v, []) if classes[c.name] != NONLINEAR]
            for a, b in itertools.pairwise(readers):
                if st[a.name] == st[b.name]:
                    uf.union(a.name, b.name)
    comps: dict[str, list[Node]] = {}
    for n in linear:
        comps.setdefault(uf.find(n.name), []).append(n)
    ordered = sorted(comps.values(), key=lambda ns: g0.nodes.index(ns[0]))

    he, local = [], []
    for ns in ordered:
        (he if any(n.op in _PRODUCTS for n in ns) else local).append(ns)
    block_of = {n.name: k for k, ns in enumerate(he) for n in ns}
    local_of = {n.name: k for k, ns in enumerate(local) for n in ns}
    outputs_of = {}
    for role, v in g0.outputs.items():
        outputs_of.setdefault(v, []).append(role)

    def where(node: Node) -> str:
        if node.name in block_of:
            return f"block:{block_of[node.name]}"
        if node.name in local_of:
            return f"local:{local_of[node.name]}"
        return f"mpc:{node.name}"

    first_layer_block = None
    blocks = []
    for k, ns in enumerate(he):
        names = {n.name for n in ns}
        layer = next((n.layer for n in ns if not _is_norm_piece(n) and n.layer is not None), None)
        if layer is None and first_layer_block is not None and all(_is_norm_piece(n) for n in ns):
            layer = ns[-1].layer  # a norm's scaling alone inside a layer (OLMoE's q / k norms)
        if layer is not None and first_layer_block is None:
            first_layer_block = k
        ins, outs, mpc_in, mpc_out = [], [], [], []
        for n in ns:
            for v in n.inputs:
                p = prod.get(v)
                if p is not None and p.name in names:
                    continue
                src = "input" if p is None else where(p)
                if not any(i["value"] == v for i in ins):
                    ins.append({"value": v, "from": src})
                if p is not None and classes[p.name] == NONLINEAR and p.name not in mpc_in:
                    mpc_in.append(p.name)
            for v in n.outputs:
                to = [where(c) for c in cons.get(v, []) if c.name not in names]
                to += [f"output:{r}" for r in outputs_of.get(v, [])]
                if to:
                    outs.append({"value": v, "to": sorted(set(to))})
                for c in cons.get(v, []):
                    if c.name not in names and classes[c.name] == NONLINEAR and c.name not in mpc_out:
                        mpc_out.append(c.name)
        depth, _, folded = block_depth(ns, prod)
        pats = Counter()
        for n in ns:
            for v in n.inputs:
                p = prod.get(v)
                if p is not None and p.name in names:
                    first, second = classes[p.name], edge_class(n, v, classes, shapes)
                    pats[(first, second, TABLE4[(first, second)])] += 1
        sums = [{"node": n.name, "length": shapes[n.inputs[0]][-1],
                 "rotations": math.ceil(math.log2(max(2, int(shapes[n.inputs[0]][-1]))))
                 if isinstance(shapes[n.inputs[0]][-1], int) else None,
                 "mask": n.attrs.get("scale", 1.0) != 1.0}
                for n in ns if n.op == "reduce_sum"]
        bcasts = []
        for n in ns:
            if classes[n.name] != EXPANSION:
                continue
            for v in n.inputs:
                if _broadcast(shapes.get(v, ())):
                    p = prod.get(v)
                    how = "fused with the sum (Figure 6)" if p is not None and p.name in names else \
                        "replicated by the conversion" if p is not None and classes[p.name] == NONLINEAR else \
                        "replicated (carried sum)"
                    bcasts.append({"node": n.name, "operand": v, "rotations": 0, "how": how})
        blocks.append({
            "id": k, "layer": layer, "stage": st[ns[0].name], "nodes": [n.name for n in ns],
            "ops": _short(ns, layer), "classes": {n.name: classes[n.name] for n in ns},
            "patterns": [{"first": a, "second": b, "fused": r, "count": c} for (a, b, r), c in pats.items()],
            "inputs": ins, "outputs": outs, "mpc_in": mpc_in, "mpc_out": mpc_out,
            "mpc_in_cores": [core_name(g0.node(m)) for m in mpc_in],
            "mpc_out_cores": [core_name(g0.node(m)) for m in mpc_out],
            "depth": depth, "folded": folded,
            "products": {"ct_pt": sum(n.op == "linear" for n in ns), "ct_ct_matmul": sum(n.op in ("qk", "av") for n in ns),
                         "ct_ct_elementwise": sum(n.op == "mul" for n in ns)
                         + sum(max(0, len(n.attrs["coeffs"]) - 2) for n in ns if n.op == "poly")},
            "packing": {"layout": "spatial-first", "rotate_and_sum": sums, "broadcast": bcasts},
        })
    for b in blocks:
        if b["layer"] is None:
            b["role"] = "prologue" if first_layer_block is None or b["id"] < first_layer_block else "epilogue"
        else:
            b["role"] = "layer"

    g = copy.copy(g0)
    g.nodes = []
    for n in g0.nodes:
        n = copy.copy(n)
        n.attrs = {**n.attrs, "blb_class": classes[n.name], "blb_block": block_of.get(n.name)}
        g.nodes.append(n)
    g.meta = {**g0.meta, "blb_blocks": blocks,
              "blb_local": [{"nodes": [n.name for n in ns], "layer": next((n.layer for n in ns), None)}
                            for ns in local],
              "blb_mpc": [{"node": n.name, "core": core_name(n), "layer": n.layer}
                          for n in g0.nodes if classes[n.name] == NONLINEAR],
              "blb_cuts": cuts}
    return g


def pack_spatial_first(x, width: int | None = None):
    """A (T, d) matrix as one slot vector, spatial-first (section 4.2.1): slot j * T + t
    holds x[t, j], the reduce dimension zero-padded to `width` (default: the next power of
    two, so that rotate-and-sum wraps around cleanly)."""
    import numpy as np

    x = np.asarray(x, np.float64)
    T, d = x.shape
    w = width or 1 << max(0, (d - 1).bit_length())
    out = np.zeros(T * w)
    out[: T * d] = x.T.reshape(-1)
    return out


def rotate_and_sum(slots, T: int) -> tuple:
    """Figure 6's rotate-and-sum on a spatial-first slot vector of T-token columns: after
    log2(width) rotations by T, 2T, 4T, ... every slot j * T + t holds the row sum of
    token t, i.e. the sum already broadcast along the reduce dimension (so the
    Expansion after it needs no mask and no rotation). Returns (slots, rotations)."""
    import numpy as np

    v = np.asarray(slots, np.float64).copy()
    n, step, rots = v.size, T, 0
    while step < n:
        v = v + np.roll(v, -step)  # a left rotation by `step` slots
        step *= 2
        rots += 1
    return v, rots


def blocks_by_layer(graph: Graph) -> dict:
    """{layer (None for prologue / epilogue): [block, ...]} of a fused graph."""
    out: dict = {}
    for b in graph.meta["blb_blocks"]:
        out.setdefault(b["layer"], []).append(b)
    return out


def format_blocks(graph: Graph, all_layers: bool = False) -> str:
    """The fused blocks as a table: prologue, layer 0 (every layer with `all_layers`), epilogue."""
    blocks = graph.meta["blb_blocks"]
    per = blocks_by_layer(graph)
    n_layer_blocks = {i: len(per.get(i, [])) for i in range(graph.n_layers)}
    lines = [f"BLB fused blocks (FineGrainFusion, BLB section 4): {len(blocks)} HE blocks, "
             f"{' / '.join(str(v) for v in sorted(set(n_layer_blocks.values())))} per layer; "
             f"{len(graph.meta['blb_mpc'])} MPC cores, {len(graph.meta['blb_local'])} local segments",
             f"  {'block':<6} {'where':<9} {'depth':>5} {'sums':>4} {'pt':>3} {'ctct':>4}  "
             f"{'MPC before -> after':<34} ops"]
    shown = [b for b in blocks if all_layers or b["layer"] in (None, 0)]
    for b in shown:
        where = b["role"] if b["layer"] is None else f"L{b['layer']}"
        mpc = f"{','.join(sorted(set(b['mpc_in_cores']))) or '-'} -> {','.join(sorted(set(b['mpc_out_cores']))) or '-'}"
        p = b["products"]
        lines.append(f"  {b['id']:<6} {where:<9} {b['depth']:>5} {len(b['packing']['rotate_and_sum']):>4} "
                     f"{p['ct_pt']:>3} {p['ct_ct_matmul']:>4}  {mpc:<34} {b['ops']}")
    if not all_layers and graph.n_layers > 1:
        def sig(i):
            return [(b["depth"], b["mpc_out_cores"], b["products"]) for b in per.get(i, [])]
        same = all(sig(i) == sig(0) for i in range(1, graph.n_layers))
        lines.append(f"  (layers 1..{graph.n_layers - 1}: {'the same blocks' if same else 'not shown'}; "
                     "--all shows them)")
    lines.append("  depth: multiplicative depth from fresh inputs; sums: rotate-and-sum reductions (Figure 6); "
                 "pt / ctct: ct-pt projections / ct-ct matmuls")
    return "\n".join(lines)

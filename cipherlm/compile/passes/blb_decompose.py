"""Split the nonlinear layers into their linear and nonlinear operators (BLB, section 4
and Appendix B, Algorithms 3-5), so that `blb_fusion` can fuse the linear parts with
the projections around them and leave only the nonlinear cores to MPC.

Each rewrite is exact in the clear (the plain executor gives the original graph's
outputs, to rounding): the cores are the exact functions, not the protocols'
approximations. ``x`` has shape (..., d); ``[.]`` marks the Table 2 type of each piece,
NL the nonlinear cores that stay in MPC.

LayerNorm (Algorithm 3)::

    mean   = reduce_sum(x, scale=1/d)        [Reduction]
    center = sub(x, mean)                    [Expansion: the mean broadcast]
    square = mul(center, center)             [Identity]
    sumsq  = reduce_sum(square)              [Reduction]
    rsqrt  = rsqrt(sumsq, scale=1/d, eps)    NL (the 1/d and eps go into the core)
    norm   = mul(center, rsqrt)              [Expansion]
    out    = affine(norm, gamma, beta)       [Identity; foldable into a next projection]

RMSNorm (the decoders' LayerNorm without the mean)::

    square = mul(x, x); sumsq = reduce_sum(square); rsqrt = rsqrt(sumsq, 1/d, eps) NL;
    norm = mul(x, rsqrt); out = affine(norm, gamma)   (no affine once fold_norms moved gamma)

Softmax (Algorithm 5; the paper's exp is Bumblebee's (1 + x/2^n)^(2^n) with a clip)::

    max    = reduce_max(s)                   NL (comparisons)
    shift  = sub(s, max)                     [Expansion]
    e0     = exp(shift, scale=2^-n)          NL (the exp core on the reduced range)
    e      = n squarings of e0: mul(e_k, e_k)  [Identity; exp(z) = exp(z / 2^n)^(2^n)]
    sum    = reduce_sum(e)                   [Reduction]
    recip  = reciprocal(sum)                 NL
    out    = mul(e, recip)                   [Expansion]

GeLU (Algorithm 4) and SiLU, as x * g(x)::

    gate = act_gate(x, fn)                   NL (Phi(x), its tanh form, sigmoid(x))
    out  = mul(x, gate)                      [Identity]

A SiLU-gated FFN (Llama's silu(gate) * up) becomes gate * sigmoid(gate) * up: two
Identity products around the one sigmoid core.

``activation="whole"`` (`ACTIVATION_SPLITS`) leaves GeLU / SiLU one MPC core instead
(``activation`` itself, BOLT's x/2 + Q(|x|) form, `mpc.nonlinear.piecewise`).  The 2pc mode
measures it cheaper (`runtime.twopc.public_plan`'s default, docs/blb.md "The activation
core"): the gate's protocol is the activation's plus one MUX (its powers are MPC products
either way, they are not moved into HE), and x * g(x) in HE costs the gate's conversion
into CKKS on top, about 190 B per value at N = 16384 and six primes against the ~430 B of
the whole activation. RoPE, the attention products and the
projections are linear already and stay as they are; ReLU, tanh, sigmoid and clip stay
whole (they are comparisons / one core).

The last node of each rewrite keeps the original node's name and output value, so
everything that read the layer reads the same value name. New nodes carry
``attrs["blb_from"] = (op, name)`` of the layer they come from and
``attrs["blb_role"]``: ``"stat"`` (a norm's statistics, before the rsqrt), ``"tail"``
(a norm's scaling after it), ``"core"`` (a nonlinear core) or ``"body"``.
``graph.meta["blb_decomposed"]`` lists the rewritten nodes; `run(graph)` on a graph
that has it returns the graph unchanged.
"""

from __future__ import annotations

import copy

from ..ir import Graph, Node

#: activation names whose x * g(x) form is written out (HF's names -> act_gate's fn)
GATED = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
         "gelu_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}

#: where an activation's work goes: "gate" writes x * g(x) out (Algorithm 4: g in MPC, the
#: product fused into HE), "whole" keeps the activation one MPC core (module doc)
ACTIVATION_SPLITS = ("gate", "whole")
#: where a LayerNorm's / RMSNorm's work goes: "split" writes Algorithm 3 out (the statistics'
#: linear parts and the scaling fused into HE, rsqrt alone in MPC), "whole" keeps each norm one
#: MPC operator (the 2pc mode's protocol: its sum of squares is computed on shares).  "whole"
#: is for models whose norm inputs are too large for a block output: a sum of squares must
#: leave its block below 2^20 (Algorithm 1's q/4 promise at one prime) with 2^-17 of its
#: smallest value's precision, about 51 bits of range for SmolLM2's massive activations
#: (|x| ~ 2^15, sum of squares ~ 2^29) where one 60-bit prime carries about 45 (docs/blb.md,
#: "Models with massive activations")
NORM_SPLITS = ("split", "whole")

#: squarings after the exp core: the paper's (1 + x/2^n)^(2^n) with n = 6 (Bumblebee)
EXP_SQUARINGS = 6


class _Emit:
    def __init__(self, src: Node):
        self.src = src
        self.nodes: list[Node] = []

    def __call__(self, op: str, suffix: str | None, inputs, shape, role: str, weights=(), **attrs) -> str:
        """A node named ``<src>.<suffix>`` (suffix None: the last one, which takes the source's
        name and output value)."""
        s = self.src
        name = s.name if suffix is None else f"{s.name}.{suffix}"
        out = s.outputs[0] if suffix is None else name
        keep = {k: v for k, v in s.attrs.items() if k == "expert"}
        self.nodes.append(Node(op, name, tuple(inputs), (out,), tuple(shape), {
            **keep, **attrs, "blb_from": (s.op, s.name), "blb_role": role}, tuple(weights), s.layer))
        return out


def _reduced(shape) -> tuple:
    return tuple(shape[:-1]) + (1,)


def _norm(n: Node, rms: bool) -> list[Node]:
    e = _Emit(n)
    x, shape = n.inputs[0], n.shape
    d = int(shape[-1])
    eps = float(n.attrs["eps"])
    gamma, beta = n.attrs.get("gamma"), n.attrs.get("beta")
    if rms:
        xc = x
    else:
        mean = e("reduce_sum", "mean", [x], _reduced(shape), "stat", scale=1.0 / d)
        xc = e("sub", "center", [x, mean], shape, "stat")
    sq = e("mul", "square", [xc, xc], shape, "stat")
    ss = e("reduce_sum", "sumsq", [sq], _reduced(shape), "stat", scale=1.0)
    r = e("rsqrt", "rsqrt", [ss], _reduced(shape), "core", scale=1.0 / d, eps=eps)
    if gamma is None and beta is None:
        e("mul", None, [xc, r], shape, "tail")
    else:
        y = e("mul", "norm", [xc, r], shape, "tail")
        e("affine", None, [y], shape, "tail", [t for t in (gamma, beta) if t], gamma=gamma, beta=beta)
    return e.nodes


def _softmax(n: Node, squarings: int) -> list[Node]:
    e = _Emit(n)
    s, shape = n.inputs[0], n.shape
    m = e("reduce_max", "max", [s], _reduced(shape), "core")
    z = e("sub", "shift", [s, m], shape, "body")
    x = e("exp", "exp", [z], shape, "core", scale=2.0 ** -squarings)
    for k in range(1, squarings + 1):
        x = e("mul", f"sq{k}", [x, x], shape, "body")
    t = e("reduce_sum", "sum", [x], _reduced(shape), "body", scale=1.0)
    r = e("reciprocal", "recip", [t], _reduced(shape), "core")
    e("mul", None, [x, r], shape, "body")
    return e.nodes


def _gated(n: Node) -> list[Node]:
    e = _Emit(n)
    x = n.inputs[0]
    g = e("act_gate", "gate", [x], n.shape, "core", fn=GATED[n.attrs["fn"]])
    e("mul", None, [x, g], n.shape, "body")
    return e.nodes


def decompose_node(n: Node, exp_squarings: int = EXP_SQUARINGS, activation: str = "gate",
                   norms: str = "split") -> list[Node] | None:
    """The pieces of one node, or None when it stays as it is (``activation``: one of
    `ACTIVATION_SPLITS`; ``norms``: one of `NORM_SPLITS`)."""
    if n.op in ("layer_norm", "rms_norm") and norms == "split":
        return _norm(n, rms=n.op == "rms_norm")
    if n.op == "softmax":
        return _softmax(n, exp_squarings)
    if n.op == "activation" and activation == "gate" and n.attrs.get("fn") in GATED:
        return _gated(n)
    return None


def run(graph: Graph, exp_squarings: int = EXP_SQUARINGS, activation: str = "gate", norms: str = "split") -> Graph:
    """The graph with its softmaxes, (``norms="split"``) LayerNorms and RMSNorms and
    (``activation="gate"``) GeLU / SiLU activations split (module doc); parameters are
    unchanged (the affine nodes read the norms' tensors)."""
    if activation not in ACTIVATION_SPLITS:
        raise ValueError(f"activation must be one of {ACTIVATION_SPLITS}, got {activation!r}")
    if norms not in NORM_SPLITS:
        raise ValueError(f"norms must be one of {NORM_SPLITS}, got {norms!r}")
    if "blb_decomposed" in graph.meta:
        if graph.meta.get("blb_activation", "gate") != activation:
            raise ValueError(f"the graph is decomposed with activation={graph.meta.get('blb_activation')!r}")
        if graph.meta.get("blb_norms", "split") != norms:
            raise ValueError(f"the graph is decomposed with norms={graph.meta.get('blb_norms')!r}")
        return graph
    if exp_squarings < 0:
        raise ValueError("exp_squarings must be >= 0")
    g = copy.copy(graph)
    g.nodes, done = [], []
    for n in graph.nodes:
        parts = decompose_node(n, exp_squarings, activation, norms)
        if parts is None:
            g.nodes.append(n)
        else:
            g.nodes.extend(parts)
            done.append(n.name)
    g.outputs = dict(graph.outputs)
    g.meta = {**graph.meta, "blb_decomposed": done, "blb_exp_squarings": exp_squarings, "blb_activation": activation,
              "blb_norms": norms}
    g.validate()
    return g

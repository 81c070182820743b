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

``activation="poly"`` writes GeLU (and its tanh form) as its clamped form
(`mpc.nonlinear.piecewise.clamped_poly`, BOLT's |x| form with the cut-off moved into the
polynomial's argument)::

    lin, z  = act_clamp(x)                   NL (a = |x|, ac = min(a, T), lin = x/2 + (a - ac)/2,
                                                 z = c_4^(1/4) ac)
    p       = poly(z)                        [Identity] (P(ac) as a monic quartic in z)
    out     = add(lin, p)                    [Identity]

so that the polynomial, whose powers are the costly part of the whole activation in MPC
(three HE products on shares and their truncations per element), joins the next HE block
with the FFN's down projection, and only the sign, |x|, the cut-off comparison and one
MUX stay in MPC (docs/blb.md "The activation's polynomial in HE").  The scaling by
c_4^(1/4) (a local truncation on shares) makes the polynomial monic: CKKS evaluates it as
a product of two (z + H)^2 + K factors, two levels instead of three.  SiLU (two segments)
stays whole under "poly".

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
import math

import numpy as np

from ...mpc.nonlinear.exp import EXP_REDUCED_LO_MIN, exp_reduced_poly
from ...mpc.nonlinear.piecewise import CLAMPED_FNS, clamped_poly
from ..ir import Graph, Node

#: activation names whose x * g(x) form is written out (HF's names -> act_gate's fn)
GATED = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
         "gelu_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}

#: where an activation's work goes: "gate" writes x * g(x) out (Algorithm 4: g in MPC, the
#: product fused into HE), "whole" keeps the activation one MPC core, "poly" writes GeLU's
#: clamped form out (comparisons in MPC, the polynomial in HE; SiLU stays whole) (module doc)
ACTIVATION_SPLITS = ("gate", "whole", "poly")
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
#: the exp core's clip: s - max below -EXP_CLIP gives exp(-EXP_CLIP) (1e-7)
EXP_CLIP = 16.0
#: where the softmax's exp(z / 2^n) goes: "core" keeps it one MPC core (the clip and the
#: polynomial on shares, `mpc.nonlinear.exp.exp_reduced`), "poly" leaves the clip to MPC
#: (``clip_min``: one comparison, one MUX) and evaluates the polynomial in HE, fused with the
#: squarings (module doc)
EXP_SPLITS = ("core", "poly")


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


def _poly_max(coeffs, lo: float, hi: float) -> float:
    """max |P| on [lo, hi] (a dense grid, plus 1 % : the poly node's ``out_bound``, what the
    noise model of the next operators takes as its magnitude)."""
    z = np.linspace(lo, hi, 20001)
    return 1.01 * float(np.abs(np.polyval(np.asarray(coeffs, np.float64)[::-1], z)).max())


def exp_poly(squarings: int) -> tuple[float, ...]:
    """The coefficients in z = s - max of exp(z / 2^n) on [-EXP_CLIP, 0] (n = ``squarings``):
    `mpc.nonlinear.exp.exp_reduced_poly` on [-EXP_CLIP / 2^n, 0] (relative fit <= 2^-19, degree
    3 at n = 6), its c_k divided by 2^(n k) so that the HE side evaluates it on the clipped z
    directly (the 1 / 2^n inside the polynomial's constants: no quantisation of z / 2^n on
    shares)."""
    lo = -EXP_CLIP / 2.0 ** squarings
    if lo < EXP_REDUCED_LO_MIN:
        raise ValueError(f"exp='poly' needs at least {math.ceil(math.log2(-EXP_CLIP / EXP_REDUCED_LO_MIN))} "
                         f"squarings (the polynomial's range [-{EXP_CLIP} / 2^n, 0]), got {squarings}")
    c, _ = exp_reduced_poly(lo)
    return tuple(float(ck) / 2.0 ** (squarings * k) for k, ck in enumerate(c))


def _softmax(n: Node, squarings: int, exp: str = "core") -> list[Node]:
    e = _Emit(n)
    s, shape = n.inputs[0], n.shape
    m = e("reduce_max", "max", [s], _reduced(shape), "core")
    z = e("sub", "shift", [s, m], shape, "body")
    if exp == "poly":  # the clip in MPC, the polynomial in HE before the squarings
        zc = e("clip_min", "clip", [z], shape, "core", lo=-EXP_CLIP, bound=EXP_CLIP)
        c = exp_poly(squarings)
        x = e("poly", "exp", [zc], shape, "body", coeffs=c, out_bound=_poly_max(c, -EXP_CLIP, 0.0))
    else:
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


def _clamped(n: Node) -> list[Node]:
    """An activation's clamped form (`mpc.nonlinear.piecewise.clamped_poly`): the comparisons
    in MPC, the polynomial and the sum linear (fused into the next HE block)."""
    e = _Emit(n)
    fn = GATED[n.attrs["fn"]]
    T, coeffs = clamped_poly(fn)
    # z = scale ac with scale = c_4^(1/4): P(ac) is the monic sum_k (c_k / scale^k) z^k,
    # which CKKS evaluates by its factors without a scalar product (`blb_fusion.monic_factors`)
    if not coeffs[-1] > 0:
        raise ValueError(f"{n.name}: the clamped form's leading coefficient must be positive")
    scale = coeffs[-1] ** (1.0 / (len(coeffs) - 1))
    zc = tuple(c / scale ** k for k, c in enumerate(coeffs[:-1])) + (1.0,)
    s = e.src
    name = f"{s.name}.clamp"
    lin, ac = f"{name}.lin", f"{name}.ac"
    e.nodes.append(Node("act_clamp", name, (n.inputs[0],), (lin, ac), tuple(n.shape),
                        {"fn": fn, "T": T, "scale": scale, "blb_from": (s.op, s.name), "blb_role": "core"},
                        (), s.layer))
    p = e("poly", "poly", [ac], n.shape, "body", coeffs=zc, out_bound=_poly_max(zc, 0.0, T * scale))
    e("add", None, [lin, p], n.shape, "body")
    return e.nodes


def decompose_node(n: Node, exp_squarings: int = EXP_SQUARINGS, activation: str = "gate",
                   norms: str = "split", exp: str = "core") -> list[Node] | None:
    """The pieces of one node, or None when it stays as it is (``activation``: one of
    `ACTIVATION_SPLITS`; ``norms``: one of `NORM_SPLITS`)."""
    if n.op in ("layer_norm", "rms_norm") and norms == "split":
        return _norm(n, rms=n.op == "rms_norm")
    if n.op == "softmax":
        return _softmax(n, exp_squarings, exp)
    if n.op == "activation" and activation == "gate" and n.attrs.get("fn") in GATED:
        return _gated(n)
    if (n.op == "activation" and activation == "poly"
            and GATED.get(n.attrs.get("fn")) in CLAMPED_FNS):
        return _clamped(n)
    return None


def run(graph: Graph, exp_squarings: int = EXP_SQUARINGS, activation: str = "gate", norms: str = "split",
        exp: str = "core") -> Graph:
    """The graph with its softmaxes, (``norms="split"``) LayerNorms and RMSNorms and
    (``activation="gate"`` / ``"poly"``) GeLU / SiLU activations split, the softmax's exp as
    one core or (``exp="poly"``) its clip and polynomial (module doc); parameters are unchanged
    (the affine nodes read the norms' tensors)."""
    if activation not in ACTIVATION_SPLITS:
        raise ValueError(f"activation must be one of {ACTIVATION_SPLITS}, got {activation!r}")
    if norms not in NORM_SPLITS:
        raise ValueError(f"norms must be one of {NORM_SPLITS}, got {norms!r}")
    if exp not in EXP_SPLITS:
        raise ValueError(f"exp must be one of {EXP_SPLITS}, got {exp!r}")
    if "blb_decomposed" in graph.meta:
        if graph.meta.get("blb_activation", "gate") != activation:
            raise ValueError(f"the graph is decomposed with activation={graph.meta.get('blb_activation')!r}")
        if graph.meta.get("blb_exp", "core") != exp:
            raise ValueError(f"the graph is decomposed with exp={graph.meta.get('blb_exp', 'core')!r}")
        if graph.meta.get("blb_norms", "split") != norms:
            raise ValueError(f"the graph is decomposed with norms={graph.meta.get('blb_norms')!r}")
        return graph
    if exp_squarings < 0:
        raise ValueError("exp_squarings must be >= 0")
    if exp == "poly":
        exp_poly(exp_squarings)  # its range check
    g = copy.copy(graph)
    g.nodes, done = [], []
    for n in graph.nodes:
        parts = decompose_node(n, exp_squarings, activation, norms, exp)
        if parts is None:
            g.nodes.append(n)
        else:
            g.nodes.extend(parts)
            done.append(n.name)
    g.outputs = dict(graph.outputs)
    g.meta = {**graph.meta, "blb_decomposed": done, "blb_exp_squarings": exp_squarings, "blb_exp": exp,
              "blb_activation": activation,
              "blb_norms": norms}
    g.validate()
    return g

"""The model graph: typed operator nodes over named values and named tensors.

One `Graph` per model, built by `cipherlm.compile.builders.build_graph` from the
architecture table (`cipherlm.compile.arch`); the passes (`cipherlm.compile.passes`)
rewrite it and the runtime's executor (`cipherlm.runtime.graph_executor`) walks it
over a backend with one method per operator class.

Values are named activations; their shapes use the symbol "T" for the token count
(and "S" for the key positions held by the KV cache). Tensors are the model's
parameters under their graph names: a linear projection `name` owns the tensors
``name.weight`` (d_out, d_in) and, where the layer has one, ``name.bias``; every other
tensor keeps its Hugging Face name. Each tensor records where it comes from in the
checkpoint (`Tensor.source`, a transpose for GPT-2's Conv1D, a slice of a fused
expert tensor) and whether it is tied to another one (an LM head tied to the
embedding shares its storage and is counted once).

The operator vocabulary (`OPS`):

=================  ===========================================================
embed              table lookup (word, position, token-type rows)
linear             x @ W.T + b: attrs ``name`` (the weight group name the
                   `LinearBackend` sees), ``d_in``, ``d_out``, ``bias``; ``group``
                   once `passes.group_linears` ran
layer_norm         LayerNorm (gamma, beta); attrs eps
rms_norm           RMSNorm (gamma, or none once `passes.fold_norms` moved it)
rope               rotary embedding at the run's positions (attrs heads, head_dim,
                   rotary_dim, interleave)
kv_cache           append this pass's K and V to the layer's cache; outputs all
                   keys and values so far
qk                 Q K^T * scale with the causal / sliding-window / padding mask
softmax            row softmax
av                 probabilities times V, heads merged back to (T, H*hd)
activation         gelu, gelu_tanh, silu, relu, sigmoid, tanh
mul, add           elementwise product; sum (residual connections)
clip               clamp to [-c, c] (OLMoE's clip_qkv)
split              columns split into parts (GPT-2's fused c_attn, MLA's pieces)
concat             columns joined
topk               MoE router: scores, top-k experts and their weights
dispatch           MoE: the rows routed to one expert (and their weights)
combine            MoE: weighted sum of the experts' outputs back to (T, d)
head               row selection before a head (last position, first token)
argmax             index of the largest logit
moe                one whole MoE layer (router, top-k, dispatch, experts,
                   combine, shared expert) as a single operator: not built by
                   the builders; `passes.moe_blocks` lowers an MoE subgraph to
                   it for backends whose MoE protocol is one piece (2pc's
                   CryptoMoE); attrs: the layer's shape and tensor names
reduce_sum         sum over the last axis (kept as size 1), times attrs
                   ``scale`` (1/d for a mean); BLB's Reduction
reduce_max         maximum over the last axis (kept as size 1): comparisons
sub                a - b, b broadcast along the last axis where its size is 1
affine             x * gamma + beta (public vectors; either may be None): a
                   norm's learnable part once `passes.blb_decompose` split it
rsqrt              1 / sqrt(x * scale + eps) (attrs scale, eps)
reciprocal         1 / x
exp                exp(x * scale) (attrs scale)
act_gate           the gate g(x) of an activation x * g(x) (attrs fn: gelu ->
                   Phi(x), gelu_tanh -> its tanh form, silu -> sigmoid(x))
act_clamp          two outputs (lin, ac) = (x/2 + (|x| - ac)/2, min(|x|, T)) of
                   an activation's clamped form (attrs fn, T): comparisons
poly               sum_k c_k x^k elementwise (attrs coeffs: public reals; out_bound:
                   max |output| over the inputs it gets)
clip_min           max(x, lo) (attrs lo, bound: |output| <= bound for the inputs it
                   gets): comparisons
=================  ===========================================================

The last eleven are the pieces `passes.blb_decompose` splits LayerNorm, RMSNorm,
softmax and the GeLU / SiLU activations into (BLB, Algorithms 3-5): the builders
never make them, and only the plain backend evaluates them.

The experts of an MoE layer are explicit subgraphs (dispatch -> expert FFN linears,
tagged with ``attrs["expert"]``), so the passes see every expert projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

OPS = (
    "embed", "linear", "layer_norm", "rms_norm", "rope", "kv_cache", "qk", "softmax", "av", "activation",
    "mul", "add", "clip", "split", "concat", "topk", "dispatch", "combine", "head", "argmax", "moe",
    "reduce_sum", "reduce_max", "sub", "affine", "rsqrt", "reciprocal", "exp", "act_gate", "act_clamp", "poly",
    "clip_min",
)

#: The one operator-class vocabulary of every mode's meter, report and plot (issue 13
#: part 4): the classes of the graph's ops, then the classes only a private protocol
#: has: ``conversions`` (HE<->MPC share conversion after a linear-type product,
#: BLB section 3), ``setup`` (first-use base OTs and HE keys), ``control`` (the
#: 2pc generate loop's continue/stop message).
OP_CLASSES = ("embedding", "linear", "norm", "rope", "attention_matmul", "softmax", "activation", "moe",
              "residual", "layout", "sampling", "conversions", "setup", "control")

#: operator class of each op
OP_CLASS = {
    "embed": "embedding", "linear": "linear", "layer_norm": "norm", "rms_norm": "norm", "rope": "rope",
    "kv_cache": "attention_matmul", "qk": "attention_matmul", "softmax": "softmax", "av": "attention_matmul",
    "activation": "activation", "mul": "activation", "add": "residual", "clip": "activation",
    "split": "layout", "concat": "layout", "topk": "moe", "dispatch": "moe",
    "combine": "moe", "head": "layout", "argmax": "sampling", "moe": "moe",
    # the pieces of passes.blb_decompose: the class of the layer they usually come from
    "reduce_sum": "norm", "reduce_max": "softmax", "sub": "norm", "affine": "norm", "rsqrt": "norm",
    "reciprocal": "softmax", "exp": "softmax", "act_gate": "activation", "act_clamp": "activation",
    "poly": "activation", "clip_min": "softmax",
}


@dataclass
class Tensor:
    """A parameter. `source`: its checkpoint name; `transpose`: stored (d_in, d_out) there
    (GPT-2 Conv1D); `rows`: (expert, start, stop) slice of a fused (E, rows, cols) tensor;
    `tied_to`: another tensor whose storage this one shares (not counted again)."""

    name: str
    shape: tuple[int, ...]
    source: str
    transpose: bool = False
    rows: tuple[int, int, int] | None = None
    tied_to: str | None = None

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass
class Node:
    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shape: tuple = ()
    attrs: dict = field(default_factory=dict)
    weights: tuple[str, ...] = ()
    layer: int | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {OPS}")

    @property
    def out(self) -> str:
        return self.outputs[0]


@dataclass
class Graph:
    """Nodes in topological order, tensors by name, named graph inputs and outputs."""

    family: str
    kind: str  # "decoder" | "encoder"
    config: dict
    nodes: list[Node] = field(default_factory=list)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: dict[str, str] = field(default_factory=dict)  # role ("logits", "hidden", ...) -> value
    n_layers: int = 0
    meta: dict = field(default_factory=dict)

    # ---- queries

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def producers(self) -> dict[str, Node]:
        return {v: n for n in self.nodes for v in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v, []).append(n)
        return out

    def linears(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "linear"]

    def validate(self) -> None:
        """Every input is produced before it is read; every value is produced once; every
        tensor a node names exists."""
        seen = set(self.inputs)
        for n in self.nodes:
            for v in n.inputs:
                if v not in seen:
                    raise ValueError(f"node {n.name} reads {v!r} before it is produced")
            for v in n.outputs:
                if v in seen:
                    raise ValueError(f"value {v!r} produced twice (node {n.name})")
                seen.add(v)
            for t in n.weights:
                if t not in self.tensors:
                    raise ValueError(f"node {n.name} names unknown tensor {t!r}")
        for role, v in self.outputs.items():
            if v not in seen:
                raise ValueError(f"output {role} -> {v!r} is never produced")

    # ---- parameters

    def param_count(self, node: Node | str) -> int:
        """Parameters a node owns (tied tensors count at their owner only)."""
        n = self.node(node) if isinstance(node, str) else node
        return sum(self.tensors[t].size for t in n.weights if self.tensors[t].tied_to is None)

    def params_per_node(self) -> dict[str, int]:
        return {n.name: self.param_count(n) for n in self.nodes}

    def total_params(self) -> int:
        """Unique parameters of the model (a tied head is not counted twice)."""
        return sum(t.size for t in self.tensors.values() if t.tied_to is None)

    # ---- printing

    def summary(self, nodes: Iterable[Node] | None = None) -> str:
        lines = [f"graph {self.family} ({self.kind}): {self.n_layers} layers, {len(self.nodes)} nodes, "
                 f"{len(self.tensors)} tensors, {self.total_params():,} parameters"]
        for n in (self.nodes if nodes is None else nodes):
            shape = "(" + ", ".join(str(s) for s in n.shape) + ")"
            extra = ""
            if n.op == "linear":
                extra = f" {n.attrs['name']}"
            elif n.op in ("activation", "layer_norm", "rms_norm") and "fn" in n.attrs:
                extra = f" {n.attrs['fn']}"
            p = self.param_count(n)
            tied = [self.tensors[t].tied_to for t in n.weights if self.tensors[t].tied_to]
            if tied:
                extra += f" (tied to {tied[0]})"
            lines.append(f"  {n.name:<40} {n.op:<11} {shape:<16} {p:>12,}{extra}")
        return "\n".join(lines)

"""2pc mode executor: whole Transformers on secret shares (prompt and weights private).

The system of BLB (``blb_004``) sections 2-3 in its Bumblebee-style "BFV + MPC"
form (BLB Table 11's baseline), with CryptoMoE section 2.2's threat model:
semi-honest client (party 0) and server (party 1); the client holds the
prompt and learns only the output (the argmax token, or a classifier's
logits); the server holds every weight and learns nothing.  Activations live
as additive shares over Z_2^64 with ``f = 16`` fraction bits (`cipherlm.mpc`).

Who does what (BLB section 2.3, Figure 2):

* **linear** (every projection, the LM head, the probe): HE cross term of the
  client's share with the server's weight plus the server's local term, then
  extend-then-truncate back into the ring (`cipherlm.protocols.linear.linear`).
* **attention matmul** (Q K^T, P V, both operands secret; GQA by grouping the
  query heads that share a KV head): `cipherlm.protocols.linear.matmul_shared`.
* **embedding**: the client's one-hot times the server's table, either through
  FastQuery's private lookup (`cipherlm.protocols.embedding.embedding_lookup`,
  when present) or through `linear` with the one-hot as the client's share and
  0 as the server's (the Cheetah baseline of FastQuery Table 6).  BERT's
  position and token-type rows are the server's and public-position-indexed:
  the server adds them to its own share (free).
* **RoPE**: a public linear map (cos/sin of public positions, rotate-half is a
  permutation), applied locally to each share: free.
* **norm**: LayerNorm / RMSNorm statistics and 1/sqrt on shares
  (`cipherlm.mpc.nonlinear`).  The server's gamma (and the public constant of
  the row mean) are folded into the weights of the projections that consume the
  norm (pre-norm Llama: exact); when the residual stream needs gamma and beta
  themselves (post-norm BERT) the server's private gamma multiplies the shares
  with one Gilboa cross term (the client's share times the server's vector,
  CrypTFlow2 section 4.1) and beta is added to the server's share.
* **softmax** (public causal / padding mask), **activation** (GeLU, SwiGLU):
  `cipherlm.mpc.nonlinear`.
* **MoE** (Qwen2-MoE, OLMoE, Mixtral; dense layers and shared experts as their
  configs say): CryptoMoE (``cryptomoe_000`` sections 4.1-4.3) through
  `cipherlm.moe.layer.moe_layer`: gate routing on shares, balanced routing with
  a public capacity factor c from the plan (each expert takes exactly
  t = ceil(c m k / n) of a pass's m tokens, so no count per expert is revealed),
  secure dispatch / expert SwiGLU / combine.  With c = n / k nothing is dropped
  and the layer computes the model's own top-k function.  OLMoE's q/k RMSNorm
  runs on shares with the server's gamma as a private product.
* **argmax**: comparison tree on the logit shares; only the index is opened,
  and only to the client (``reveal(to=0)``).  The server never opens anything.

The KV cache is held in shares (each party keeps its share of every layer's
K and V); prefill processes the prompt in one pass, decode one token per pass.

**From the model graph.** Both parties build the same graph (`cipherlm.compile`)
and walk it with the one executor (`runtime.graph_executor.GraphExecutor`) over
share operators (`runtime.twopc_backend`): nothing here is written per model
family. `twopc_graph` applies the passes of this mode, in this order:
`fold_attention_scale` (1/sqrt(hd) into q's weights, or OLMoE's q_norm gamma),
`fold_norms` (RMSNorm gammas into the projections, when every folded weight fits
the linear protocol's public bound; the plan says whether), `moe_blocks`
(CryptoMoE takes a whole MoE layer) and `group_linears` (one HE product per
group of projections that read the same value: q/k/v, gate/up). The server
first scales every RMSNorm gamma by sqrt(c) (``rms_statistic``'s exact
power-of-two row mean, d = 2^k c). The client, who holds no weights, runs the
same passes on the graph alone.

Families: Llama, Mistral, Qwen2, Qwen2-MoE, OLMoE, Mixtral, GPT-2 (decoders) and
BERT (encoder). DeepSeek-V3's latent attention and clip_qkv are refused with
`TwoPCError`.

Accounting: `runtime.meter.Meter`, per operator class (`compile.ir.OP_CLASSES`)
and per graph node, from the channel's counters.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np

from cipherlm.compile import arch_from_config, bind, build_graph, passes
from cipherlm.compile.ir import Graph, Node
from cipherlm.mpc import nonlinear as nl
from cipherlm.mpc.shares import AShare

from .graph_executor import GraphExecutor
from .meter import HE_STEPS, OP_CLASSES, SETUP_STEPS, Meter, NoMeter
from .twopc_backend import (  # noqa: F401  (re-exported: the share operators' public names)
    LN_VAR_HI, LN_VAR_LO, NORM_FRAC, RMS_HI, RMS_LO, PeerInput, Proj, ShareKVCache, ShareLinear, SharesBackend,
    TwoPCError, add_private, check_ids, client_one_hot, rms_factor, rms_statistic, rope_shares, scale_private,
    stack_projections,
)

#: the meter of this mode (one class for every mode: `runtime.meter.Meter`)
OpMeter = Meter

#: "onehot-linear": the client's one-hot through `linear` (dense Cheetah baseline);
#: the others are `cipherlm.protocols.embedding.METHODS` (FastQuery and its ablation rows;
#: "exact" = 12-bit table with PackLWEs, the one that keeps real models' accuracy)
EMBEDDING_METHODS = ("auto", "onehot-linear", "exact", "fastquery", "cheetah", "+quant", "+accbits", "+packing")
#: the linear layers' packing (`cipherlm.protocols.linear.linear`): "coeff" (Cheetah
#: coefficient packing; the default, fastest here), "simd" (BOLT-style BSGS, fewer bytes),
#: "auto" (per layer, `linear_simd.choose_packing`'s cost model at the plan's network preset;
#: the choices are in `linear_packing_report`)
LINEAR_PACKINGS = ("coeff", "simd", "auto")
#: model types the 2pc executor runs (from their graphs)
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "olmoe", "mixtral", "gpt2", "bert")
ENCODER_TYPES = ("bert",)
#: MoE layers (Qwen2-MoE, OLMoE, Mixtral) run CryptoMoE (`cipherlm.moe.layer.moe_layer`)
#: with balanced routing; the capacity factor c is public (t = ceil(c m k / n) tokens
#: per expert per pass, `cipherlm.moe.routing.capacity`)
DEFAULT_MOE_CAPACITY = 2.0


# ----------------------------------------------------------------------------- the model


def check_supported(config: dict):
    """The architecture (`compile.arch.Arch`) of a config the 2pc executor runs; TwoPCError
    (a clear message) for any other."""
    mt = config.get("model_type")
    if mt not in SUPPORTED_TYPES:
        raise TwoPCError(f"the 2pc executor runs {', '.join(SUPPORTED_TYPES)} (Llama-family decoders, GPT-2, "
                         f"BERT); got {mt!r}")
    try:
        a = arch_from_config(config)
    except ValueError as exc:
        raise TwoPCError(str(exc)) from None
    if a.values.get("clip_qkv") is not None:
        raise TwoPCError("clip_qkv is not supported by the 2pc executor (OLMoE configs with clip_qkv: null are)")
    if a.values.get("act") not in ("silu", "gelu", "gelu_tanh"):
        raise TwoPCError(f"unsupported activation {a.values.get('act')!r} (SwiGLU, GeLU)")
    if a.values.get("rope_interleave"):
        raise TwoPCError("interleaved RoPE is not supported by the 2pc executor")
    return a


def model_kind(config: dict) -> tuple[str, bool, int]:
    """("encoder" | "decoder", has MoE layers, max positions) of a config the 2pc mode runs."""
    a = check_supported(config)
    return a.family.kind, bool(a.values.get("moe_layers")), int(a.values["max_positions"])


def weight_bound() -> float:
    """The linear protocol's public bound on |W| (weights are encoded with W_FRAC bits in W_BITS)."""
    from cipherlm.protocols.linear import W_BITS, W_FRAC
    return 2.0 ** (W_BITS - 1 - W_FRAC) - 2.0 ** -W_FRAC


def _rms_gammas_times_sqrt_c(graph: Graph, params: dict) -> dict:
    """Every RMSNorm gamma times sqrt(c) (`rms_statistic` computes RMSNorm / sqrt(c))."""
    out = dict(params)
    for n in graph.nodes:
        if n.op == "rms_norm" and n.attrs.get("gamma"):
            g = n.attrs["gamma"]
            out[g] = np.asarray(params[g], np.float64) * math.sqrt(rms_factor(int(n.shape[-1]))[1])
    return out


def twopc_graph(config: dict, params: dict | None = None, fold_norms: bool | None = None):
    """(graph, params, folded) of this mode: the config's graph after the 2pc passes (module
    docstring). The server passes `params` (bound float64 tensors) and `fold_norms` (None:
    fold when every folded weight fits `weight_bound`); the client passes no params and the
    plan's `fold_norms`."""
    check_supported(config)
    g = build_graph(config)
    if params is not None:
        params = _rms_gammas_times_sqrt_c(g, params)
    g, params = passes.fold_attention_scale.run(g, params)
    folded = False
    if fold_norms is not False and g.kind == "decoder":
        g2, p2 = passes.fold_norms.run(g, params, bound=None if fold_norms else weight_bound())
        folded = "folded_norms" in g2.meta
        g, params = g2, p2
    g = passes.group_linears.run(passes.moe_blocks.run(g))
    return g, params, folded


class ServerModel:
    """The server's side of one model: the 2pc graph, its non-projection tensors, each
    projection group's stacked weights (`Proj`), each MoE block's `MoEWeights`, and an
    optional "classifier" head on the sentence embedding (encoders)."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray], classifier: tuple | None = None,
                 fold_norms: bool | None = None, keep_bound: bool = False):
        check_supported(config)
        g0 = build_graph(config)
        cache: dict[int, np.ndarray] = {}
        bound = {}
        for name, a in bind(g0, weights).items():  # float64 once per storage (a tied head shares it)
            bound[name] = cache.setdefault(id(a), np.asarray(a, np.float64))
        #: the bound float64 weights of the unfused graph (BLB's blocks read them: `twopc_blb`);
        #: None unless ``keep_bound`` (they would double the server's memory)
        self.bound = bound if keep_bound else None
        self.graph, params, self.fold_norms = twopc_graph(config, bound, fold_norms)
        g = self.graph
        self.projs: dict[int, Proj] = {}
        for gi, (names, _, _) in enumerate(g.meta["linear_groups"]):
            self.projs[gi] = stack_projections(
                [(params[f"{n}.weight"], params.get(f"{n}.bias")) for n in names])
        self.moe = {n.name: moe_weights(n, params) for n in g.nodes if n.op == "moe"}
        linear_tensors = {t for n in g.nodes if n.op in ("linear", "moe") for t in n.weights}
        self.params = {k: v for k, v in params.items() if k not in linear_tensors}
        self.classifier = None
        if classifier is not None:
            self.classifier = stack_projections([(classifier[0], classifier[1])])
        elif config.get("model_type") in ENCODER_TYPES and "classifier" in weights:
            self.classifier = stack_projections([(weights["classifier.weight"], weights.get("classifier.bias"))])


def server_weights(config: dict, weights: dict[str, np.ndarray], classifier: tuple | None = None,
                   fold_norms: bool | None = None, keep_bound: bool = False) -> ServerModel:
    """The server's `ServerModel` from Hugging Face weights (bound to the graph as the
    plaintext executor binds them; ``keep_bound`` for BLB fusion)."""
    return ServerModel(config, weights, classifier, fold_norms, keep_bound)


def moe_weights(node: Node, params: dict):
    """`MoEWeights` ((d_in, d_out) orientation) of a ``moe`` node (`passes.moe_blocks`)."""
    from cipherlm.moe.layer import MoEWeights

    a = node.attrs
    if a["scoring"] != "softmax" or a["shared"] == "plain":
        raise TwoPCError(f"{node.name}: CryptoMoE runs softmax top-k routing with an optional gated shared expert")
    T = lambda name: np.asarray(params[f"{name}.weight"], np.float32).T
    w = MoEWeights(router=T(a["router"]),
                   gate=np.stack([T(g) for g, _, _ in a["experts"]]),
                   up=np.stack([T(u) for _, u, _ in a["experts"]]),
                   down=np.stack([T(d) for _, _, d in a["experts"]]))
    if a["shared"]:
        s = a["shared_linears"]
        w.shared_gate, w.shared_up, w.shared_down, w.shared_router = (T(s[p]) for p in ("gate", "up", "down", "router"))
    return w


def moe_shape(node: Node):
    from cipherlm.moe.layer import MoEShape

    a = node.attrs
    return MoEShape(a["d"], a["n_experts"], a["k"], a["ffn"], a["norm_topk_prob"], a["shared_ffn"])


#: the 2pc mode's operator fusions: "none" (layer by layer, BFV products + MPC) or "blb"
#: (BLB's fused blocks in CKKS between conversions: `runtime.twopc_blb`, encoders only so far)
FUSIONS = ("none", "blb")
#: what a server may be asked for: a fusion, or "auto" (`resolve_fusion`: BLB where it measured
#: faster on the plan's network model, else none)
FUSION_CHOICES = FUSIONS + ("auto",)
#: "auto" picks BLB on networks at or below this bandwidth.  Measured on this 2-vCPU machine
#: (docs/blb.md, "Faster HE blocks" and "The default fusion"): BFV+MPC / BLB modelled time at
#: 100 Mbps (BLB WAN2 / WAN3) 1.18 / 1.17 on BERT-base (128 tokens), 1.01 / 1.00 on MiniLM
#: (128), 1.12 / 1.10 on GPT2-base (64); at 400 Mbps (WAN1) 1.01, 0.83, 0.99 and at 3 Gbps
#: (LAN) 0.94, 0.75, 0.94: BLB sends 1.6-1.8x fewer bytes but computes up to 1.35x as long.
#: Re-measured 2026-11-29 (docs/blb.md, same section): 100 Mbps 1.35 / 1.20 / 1.17, 400 Mbps
#: 1.14 / 0.96 / 1.00, 3 Gbps 1.05 / 0.85 / 0.93 (BERT-base / MiniLM / GPT2-base): unchanged
BLB_AUTO_MAX_BANDWIDTH_BPS = 100e6
#: BLB: where GeLU / SiLU run (`compile.passes.blb_decompose.ACTIVATION_SPLITS`): "poly" (the
#: default: GeLU's clamped form, comparisons in MPC and its polynomial in the FFN-down block;
#: SiLU whole; docs/blb.md "Polynomials in HE"), "whole" (one MPC core) or "gate" (Algorithm
#: 4's x * g(x): the gate in MPC, the product in HE)
BLB_ACTIVATIONS = passes.blb_decompose.ACTIVATION_SPLITS
DEFAULT_BLB_ACTIVATION = "poly"
#: BLB: where the softmax's exp runs (`compile.passes.blb_decompose.EXP_SPLITS`): "poly" (the
#: default: the clip on shares, the polynomial in HE before the squarings) or "core" (the
#: clip and the polynomial on shares)
BLB_EXPS = passes.blb_decompose.EXP_SPLITS
DEFAULT_BLB_EXP = "poly"
#: BLB: where the LayerNorms / RMSNorms run (`compile.passes.blb_decompose.NORM_SPLITS`):
#: "split" (Algorithm 3: the statistics fused into HE, rsqrt in MPC), "whole" (each norm one MPC
#: operator), or "auto" (the server's choice, `blb_norm_split`)
BLB_NORM_SPLITS = passes.blb_decompose.NORM_SPLITS
BLB_NORMS = BLB_NORM_SPLITS + ("auto",)


#: BLB's public probe of the model's scale (`blb_probe`): seeded random token ids, and the margin
#: (two bits) a probed magnitude must keep below a bound
NORM_PROBE_TOKENS, NORM_PROBE_SEED, NORM_PROBE_MARGIN = 32, 0, 4.0
#: the least bound on |block input| a BLB plan states (``blb_value_bits``): 2^12, what the
#: conversions assumed before the bound was in the plan (`twopc_blb.in_scale_bits`)
BLB_MIN_VALUE_BITS = 12


def blb_probe(config: dict, bound: dict, tokens: int = NORM_PROBE_TOKENS, seed: int = NORM_PROBE_SEED) -> dict:
    """The model's own scale, as the server sees it with no client data: the plaintext executor
    runs the server's weights on ``tokens`` seeded random token ids and records the largest
    |value| any operator outputs (``abs``) and the largest sum of squares a norm sees (``sumsq``;
    a LayerNorm's of the centred row).  SmolLM2's massive activations (~2^15 in a few channels)
    show on any input: sums of squares 5.2e8 to 6.9e8 on random ids, consecutive ids and a
    sentence (docs/blb.md, "Models with massive activations")."""
    g = build_graph(config)
    ex = GraphExecutor(g, bound, dtype=np.float64)
    inner, peak = ex.backend, {"abs": 0.0, "sumsq": 0.0}

    def note_abs(r):
        if isinstance(r, np.ndarray) and r.size and np.issubdtype(r.dtype, np.floating):
            finite = r[np.isfinite(r)]
            if finite.size:
                peak["abs"] = max(peak["abs"], float(np.abs(finite).max()))
        return r

    def note_norm(x, centre: bool):
        a = np.asarray(x, np.float64)
        if centre:
            a = a - a.mean(axis=-1, keepdims=True)
        peak["sumsq"] = max(peak["sumsq"], float((a * a).sum(axis=-1).max()))

    class _Probe:
        def __getattr__(self, name):
            op = getattr(inner, name)
            return (lambda *a, **k: note_abs(op(*a, **k))) if callable(op) else op

        def layer_norm(self, node, x, ctx):
            note_norm(x, True)
            return note_abs(inner.layer_norm(node, x, ctx=ctx))

        def rms_norm(self, node, x, ctx):
            note_norm(x, False)
            return note_abs(inner.rms_norm(node, x, ctx=ctx))

    ex.backend = _Probe()
    kind, _, max_pos = model_kind(config)
    T = min(int(tokens), int(max_pos))
    ids = np.random.default_rng(seed).integers(0, int(config["vocab_size"]), T)
    pos = np.arange(T)
    pass_ctx = {"pos0": 0, "T": T, "positions": pos}
    if kind == "encoder":
        ex.run({"ids": ids, "positions": pos, "token_types": np.zeros(T, np.int64)}, pass_ctx, outputs=("hidden",))
    else:
        ex.run({"ids": ids, "positions": pos}, pass_ctx, ex.new_cache(), outputs=("hidden",))
    return peak


def blb_value_bits(probe: dict) -> int:
    """The plan's public bound 2^b on |block input| from `blb_probe` (`NORM_PROBE_MARGIN` above
    the largest probed value, at least 2^`BLB_MIN_VALUE_BITS`); TwoPCError when it reaches the
    block output bound 2^`blb_params.OUT_VALUE_BITS` (the conversions cannot carry the model)."""
    from cipherlm.compile.passes import blb_params

    b = max(BLB_MIN_VALUE_BITS, math.ceil(math.log2(max(probe["abs"], 1.0) * NORM_PROBE_MARGIN)))
    if b >= blb_params.OUT_VALUE_BITS:
        raise TwoPCError(f"BLB fusion: this model's activations reach {probe['abs']:.3g} on the probe, above what a "
                         f"block's conversions carry (2^{blb_params.OUT_VALUE_BITS - 2}); use --fusion none")
    return int(b)


def blb_norm_split(config: dict, server: ServerModel | None, activation: str = DEFAULT_BLB_ACTIVATION,
                   probe: dict | None = None, exp: str = DEFAULT_BLB_EXP) -> str:
    """The server's choice for ``blb_norms="auto"``: "split" when a norm's sum of squares can
    leave its block (on the public probe, `blb_probe`, it stays `NORM_PROBE_MARGIN` below the
    block output bound 2^`blb_params.OUT_VALUE_BITS`) and every fused block of the split graph
    has a secure CKKS set for the server's weights (`blb_params.run` at its default 128
    tokens); else "whole" (SmolLM2's massive activations, docs/blb.md).  Without the weights:
    "split"."""
    from cipherlm.compile.passes import blb_params

    if server is None or server.bound is None:
        return "split"
    probe = probe or blb_probe(config, server.bound)
    if probe["sumsq"] * NORM_PROBE_MARGIN >= 2.0 ** blb_params.OUT_VALUE_BITS:
        return "whole"
    g = passes.blb_fusion.run(build_graph(config), activation=activation, norms="split", exp=exp)
    sets = blb_params.run(g, params=server.bound, strict=False)
    return "split" if all(p is not None for p in sets) else "whole"


def resolve_fusion(config: dict, fusion: str, network: str = "LAN") -> str:
    """The fusion a server runs for ``fusion`` (`FUSION_CHOICES`): "none" and "blb" as they
    are; "auto" is "blb" for a dense encoder (BLB serves no decoder generation and no MoE
    layer yet) on a network preset of at most `BLB_AUTO_MAX_BANDWIDTH_BPS` when the Lattigo
    backend (BLB's CKKS) is built, else "none"."""
    from ..net.netmodel import PRESETS

    if fusion not in FUSION_CHOICES:
        raise TwoPCError(f"unknown fusion {fusion!r}; one of {FUSION_CHOICES}")
    if fusion != "auto":
        return fusion
    if network not in PRESETS:
        raise TwoPCError(f"unknown network preset {network!r}; one of {sorted(PRESETS)}")
    kind, has_moe, _ = model_kind(config)
    if kind != "encoder" or has_moe or PRESETS[network].bandwidth_bits_per_s > BLB_AUTO_MAX_BANDWIDTH_BPS:
        return "none"
    from ..he.backend import backend_unavailable_reason

    return "blb" if backend_unavailable_reason("lattigo") is None else "none"


def public_plan(config: dict, server: ServerModel | None = None, embedding: str = "auto",
                moe_capacity: float = DEFAULT_MOE_CAPACITY, linear_packing: str = "coeff",
                network: str = "LAN", fusion: str = "none", blb_activation: str = DEFAULT_BLB_ACTIVATION,
                blb_norms: str = "auto", blb_exp: str = DEFAULT_BLB_EXP) -> dict:
    """What both parties must agree on beyond the config: the structure choices that
    depend on the server's weights (folded norms, classifier width), the MoE
    capacity factor and the linear layers' packing (with the network preset its
    cost model and the SIMD plans assume), the fusion (`resolve_fusion`: "auto" becomes "none"
    or "blb" here, from the model and that network); with "blb" also ``blb_activation``
    (`BLB_ACTIVATIONS`), ``blb_exp`` (`BLB_EXPS`) and ``blb_norms`` (`BLB_NORMS`, "auto" resolved here by
    `blb_norm_split`), both of which change the fused blocks, and ``blb_value_bits`` (the public
    bound on |block input| the conversions encode for, `blb_value_bits`). JSON-able."""
    from ..net.netmodel import PRESETS

    if linear_packing not in LINEAR_PACKINGS:
        raise TwoPCError(f"unknown linear packing {linear_packing!r}; one of {LINEAR_PACKINGS}")
    if network not in PRESETS:
        raise TwoPCError(f"unknown network preset {network!r}; one of {sorted(PRESETS)}")
    kind, has_moe, _ = model_kind(config)
    fusion = resolve_fusion(config, fusion, network)
    if fusion == "blb" and has_moe:
        raise TwoPCError("BLB fusion does not run MoE layers in the 2pc mode yet; use --fusion none")
    if fusion == "blb" and server is not None and server.bound is None:
        raise TwoPCError("BLB fusion: the server model must keep its bound weights (server_weights(..., keep_bound=True))")
    plan = {"embedding": embedding_backend(embedding), "linear": {"packing": linear_packing, "network": network},
            "fusion": fusion}
    if fusion == "blb":
        if blb_activation not in BLB_ACTIVATIONS:
            raise TwoPCError(f"unknown BLB activation split {blb_activation!r}; one of {BLB_ACTIVATIONS}")
        plan["blb_activation"] = blb_activation
        if blb_exp not in BLB_EXPS:
            raise TwoPCError(f"unknown BLB exp split {blb_exp!r}; one of {BLB_EXPS}")
        plan["blb_exp"] = blb_exp
        if blb_norms not in BLB_NORMS:
            raise TwoPCError(f"unknown BLB norm split {blb_norms!r}; one of {BLB_NORMS}")
        probe = blb_probe(config, server.bound) if server is not None and server.bound is not None else None
        plan["blb_norms"] = (blb_norm_split(config, server, blb_activation, probe, blb_exp) if blb_norms == "auto"
                             else blb_norms)
        plan["blb_value_bits"] = BLB_MIN_VALUE_BITS if probe is None else blb_value_bits(probe)
    if has_moe:
        c = float(moe_capacity)
        if not (math.isfinite(c) and c > 0):
            raise TwoPCError(f"MoE capacity factor must be a positive number, got {moe_capacity!r}")
        plan["moe"] = {"variant": "cryptomoe", "capacity": c}
    if kind == "encoder":
        cls = None if server is None else server.classifier
        plan["classes"] = None if cls is None else cls.d_out
    else:
        plan["fold_norms"] = None if server is None else bool(server.fold_norms)
    return plan


def embedding_backend(method: str = "auto") -> str:
    """Resolve the embedding method: "auto" is FastQuery's protocol with the 12-bit table
    ("exact") when `cipherlm.protocols.embedding` is present, else "onehot-linear"."""
    if method not in EMBEDDING_METHODS:
        raise TwoPCError(f"unknown embedding method {method!r}; one of {EMBEDDING_METHODS}")
    if method == "onehot-linear":
        return method
    try:
        from cipherlm.protocols import embedding as E
    except ImportError:
        if method != "auto":
            raise TwoPCError("the FastQuery embedding protocol (cipherlm.protocols.embedding) is not available")
        return "onehot-linear"
    m = "exact" if method == "auto" else method
    if m not in E.METHODS:
        raise TwoPCError(f"embedding method {m!r} unknown to cipherlm.protocols.embedding")
    return m


def linear_packing_report(ctx, plan: dict) -> dict:
    """The linear layers' packing for a report: the plan's setting and, with "auto", each
    distinct layer shape's choice (`linear_simd.PackingChoice`: modelled seconds and
    bytes of both packings, SIMD rotations) and how many calls took each packing."""
    from ..protocols.linear import linear_stats

    lin = dict(plan.get("linear") or {"packing": "coeff", "network": "LAN"})
    choices = linear_stats(ctx).packings
    if choices:
        shapes: dict = {}
        for c in choices:
            shapes.setdefault((c["m"], c["d"], c["o"]), c)
        lin["choices"] = list(shapes.values())
        lin["calls"] = {p: sum(c["packing"] == p for c in choices) for p in ("coeff", "simd")}
    return lin


def _linear_fns():
    from cipherlm.protocols.linear import linear, matmul_shared
    return linear, matmul_shared


# ----------------------------------------------------------------------------- the executor


class TwoPCExecutor(GraphExecutor):
    """The 2pc graph walk of one party (0: client, holds the ids, `server` None; 1: server,
    holds the `ServerModel`): forward / generate for decoders (KV cache in shares,
    argmax opened to the client only), forward / sentence embedding / classify for
    encoders. `meter`: a `runtime.meter.Meter` on this party's channel."""

    #: see `ShareLinear`
    cache_weights = "decode"

    def __init__(self, ctx, config: dict, server: ServerModel | None, plan: dict | None = None, meter=None,
                 progress=None):
        if (ctx.party == 1) != (server is not None):
            raise TwoPCError("the server (party 1) passes the weights, the client (party 0) passes None")
        kind, has_moe, self.max_positions = model_kind(config)
        plan = dict(plan or public_plan(config, server))
        if kind == "decoder" and plan.get("fold_norms") is None:
            raise TwoPCError("the plan must say whether the norms are folded (public_plan on the server)")
        if has_moe and not isinstance(plan.get("moe"), dict):
            raise TwoPCError("an MoE model's plan must carry the MoE settings (public_plan on the server)")
        graph = server.graph if server is not None else twopc_graph(config, None, plan.get("fold_norms"))[0]
        self.ctx = ctx
        self.plan = plan
        self.server = server
        self.progress = progress
        self._linear_fn, self._matmul_fn = _linear_fns()
        lin = plan.get("linear") or {"packing": "coeff"}
        # only non-default packings are passed on
        packing = {} if lin["packing"] == "coeff" else {"packing": lin["packing"], "network": lin["network"]}
        linear = ShareLinear(ctx, graph.meta["linear_groups"], None if server is None else server.projs,
                             self._linear_fn, packing, self.cache_weights)
        backend = SharesBackend(ctx, graph, None if server is None else server.params, self._embed_word,
                                self._moe)
        super().__init__(graph, {}, linear=linear, backend=backend, meter=meter if meter is not None else NoMeter())
        self._emb_setup = None
        #: per MoE layer: the routing capacity t and the bytes/seconds of each CryptoMoE phase
        #: (gate, dispatch, experts, combine, shared) of the last pass
        self.moe_phases: dict[int, dict] = {}

    # ---- pieces the backend calls back

    def _embed_word(self, ids, n: int, table, vocab: int, dim: int) -> AShare:
        if self.ctx.party == 0:
            ids = check_ids(ids, n, vocab)
        method = self.plan["embedding"]
        if method != "onehot-linear":
            from cipherlm.protocols import embedding as E

            if self._emb_setup is None:  # once per executor: quantised, encoded table and keys
                self._emb_setup = E.setup(self.ctx, table, vocab_size=vocab, dim=dim, method=method)
            return E.lookup(self.ctx, self._emb_setup, ids if self.ctx.party == 0 else None, n_ids=n)
        x = client_one_hot(self.ctx, ids, n, vocab)
        proj = None if table is None else Proj(np.asarray(table, np.float64), None)
        return self.linear.product(x, proj, dim, "embed", planned=False)

    def _matmul(self, a: AShare, b: AShare) -> AShare:
        return self._matmul_fn(self.ctx, a, b)

    def _moe(self, node: Node, x: AShare) -> AShare:
        """CryptoMoE layer (balanced routing, secure dispatch / combine; `cipherlm.moe`)."""
        from cipherlm.moe.layer import moe_layer

        moe = self.plan["moe"]
        w = None if self.server is None else self.server.moe[node.name]
        r = moe_layer(self.ctx, x, w, moe_shape(node), variant=moe["variant"], c=float(moe["capacity"]),
                      key=self.linear.cache_key(node.name, x.shape[0]))
        self.moe_phases[node.layer] = {"t": r.t, "phases": r.phases}
        return r.y

    def _pass_ctx(self, pos0: int, T: int, **kw) -> dict:
        return {"pos0": pos0, "T": T, "positions": np.arange(pos0, pos0 + T), "matmul": self._matmul, **kw}

    def _layer_done(self, layer: int, ctx: dict) -> None:
        if self.progress is not None:
            self.progress(layer + 1, self.graph.n_layers, f"{ctx['T']} token(s)")

    def _ids_value(self, ids, n: int):
        if self.ctx.party == 0:
            return check_ids(ids, n, int(self.graph.meta["arch"]["vocab_size"]))
        return PeerInput(n)

    # ---- decoders

    def new_cache(self) -> ShareKVCache:
        return ShareKVCache(self.graph.n_layers)

    def forward(self, ids, n: int, cache: ShareKVCache | None = None, last_only: bool = False,
                outputs=("logits",)):
        """Logit shares (n or 1, vocab) for `n` tokens (ids: the client's, None at the server)
        appended after what `cache` holds (with outputs=("next_token",): the argmax, opened
        to the client)."""
        if self.graph.kind != "decoder":
            raise TwoPCError("forward(ids, n, cache) is for decoders; encoders: encode / classify")
        n = int(n)
        if n < 1:
            raise TwoPCError("at least one token is needed")
        cache = cache if cache is not None else self.new_cache()
        pos0 = cache.length
        if pos0 + n > self.max_positions:
            raise TwoPCError(f"sequence longer than {self.max_positions} positions")
        ctx = self._pass_ctx(pos0, n, last_only=last_only)
        out = self.run({"ids": self._ids_value(ids, n), "positions": ctx["positions"]}, ctx, cache, outputs=outputs)
        cache.length = pos0 + n
        return out[outputs[0]] if len(outputs) == 1 else out

    def argmax_to_client(self, logits: AShare) -> np.ndarray | None:
        """Argmax of each row of the logit shares, opened to the client only (None at the server)."""
        node = self.graph.node("argmax")
        with self.meter("sampling", node.name):
            return self.backend.argmax(node, logits, {})

    def logits_to_client(self, logits: AShare) -> np.ndarray | None:
        """The logits themselves, opened to the client only (diagnostics: the accuracy benchmark)."""
        with self.meter("sampling"):
            return logits.reveal_float(to=0)

    def generate(self, prompt_ids, n_prompt: int, max_new_tokens: int, eos_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> list[int] | None:
        """Greedy generation (`GraphExecutor.generate_loop`): the client learns each argmax
        token and tells the server whether to go on (EOS, the budget reached, or the
        client's `should_stop()`): the server learns the number of generated tokens, as the
        length of the exchange shows anyway. Returns the new ids at the client, None at
        the server."""
        eos = {int(e) for e in eos_ids}
        stop = should_stop or (lambda: False)

        def pick(ids, n, cache):
            tok = self.forward(ids, n, cache, last_only=True, outputs=("next_token",))
            return None if tok is None else int(tok[-1])

        out = self.generate_loop(prompt_ids if self.ctx.party == 0 else None, int(n_prompt), int(max_new_tokens),
                                 pick, lambda tok, more: self._agree(tok, eos, more and not stop()), on_token)
        return out if self.ctx.party == 0 else None

    def _agree(self, tok: int | None, eos: set, more: bool) -> bool:
        ctx = self.ctx
        with self.meter("control"), ctx.step("control"):
            if ctx.party == 0:
                go = tok not in eos and more
                ctx.send({"continue": bool(go)})
                return go
            msg = ctx.recv()
            go = msg.get("continue") if isinstance(msg, dict) else None
            if not isinstance(go, bool):
                raise TwoPCError("malformed control message from the client")
            return go

    # ---- encoders

    def encode_shares(self, ids, n: int) -> AShare:
        """Last hidden-state shares (n, d) of one sentence of n tokens (no padding)."""
        n = int(n)
        if not 1 <= n <= self.max_positions:
            raise TwoPCError(f"sentence length must be 1..{self.max_positions}, got {n}")
        ctx = self._pass_ctx(0, n)
        inputs = {"ids": self._ids_value(ids, n), "positions": ctx["positions"], "token_types": np.zeros(n, np.int64)}
        return self.run(inputs, ctx, outputs=("hidden",))["hidden"]

    def sentence_embedding(self, hidden: AShare) -> AShare:
        """Mean pooling (public length) and L2 normalisation (sentence-transformers), (1, d)."""
        with self.meter("norm"):
            T = hidden.shape[0]
            e = hidden.sum(axis=0, keepdims=True).mul_public_fixed(1.0 / T)
            ss = nl.sqf(self.ctx, e, how="faithful").sum(axis=-1, keepdims=True)
            r = nl.rsqrt(self.ctx, ss, 2.0 ** -8, 2.0 ** 12)
            return nl.mulf(self.ctx, e, r.broadcast_to(e.shape), bound=2.0)  # a unit vector

    def classify(self, ids, n: int) -> np.ndarray | None:
        """Class logits (n_classes,) opened to the client (None at the server)."""
        C = self.plan.get("classes")
        if not C:
            raise TwoPCError("this model has no classifier head")
        e = self.sentence_embedding(self.encode_shares(ids, n))
        with self.meter("linear", "classifier"):
            logits = self.linear.product(e, None if self.server is None else self.server.classifier, C, "classifier")
        with self.meter("sampling"):
            out = logits.reveal_float(to=0)
        return None if out is None else out.reshape(-1)

    # ---- layers (benchmarks)

    def run_layers(self, x: AShare, layers: Iterable[int], cache: ShareKVCache | None = None, pos0: int = 0,
                   attention_mask=None) -> AShare:
        """Hidden-state shares (T, d) through `layers` (decoders: a fresh KV cache unless given)."""
        if attention_mask is not None:
            raise TwoPCError("the 2pc mode runs one unpadded sentence per pass")
        if self.graph.kind == "decoder" and cache is None:
            cache = self.new_cache()
        return self.walk_layers(x, layers, self._pass_ctx(pos0, x.shape[0]), cache)


class TwoPCDecoder(TwoPCExecutor):
    """A decoder's 2pc executor (a `TwoPCExecutor` that checks the model kind)."""

    def __init__(self, ctx, config: dict, server, plan=None, meter=None, progress=None):
        if config.get("model_type") in ENCODER_TYPES:
            raise TwoPCError(f"not a decoder: {config.get('model_type')!r}")
        super().__init__(ctx, config, server, plan, meter, progress)


class TwoPCEncoder(TwoPCExecutor):
    """An encoder's 2pc executor (a `TwoPCExecutor` that checks the model kind)."""

    def __init__(self, ctx, config: dict, server, plan=None, meter=None, progress=None):
        if config.get("model_type") not in ENCODER_TYPES:
            raise TwoPCError(f"not an encoder: {config.get('model_type')!r}")
        super().__init__(ctx, config, server, plan, meter, progress)

    def forward(self, ids, n: int) -> AShare:
        return self.encode_shares(ids, n)


__all__ = ["OP_CLASSES", "OpMeter", "TwoPCExecutor", "TwoPCDecoder", "TwoPCEncoder", "ShareKVCache", "TwoPCError",
           "ServerModel", "server_weights", "public_plan", "twopc_graph", "model_kind",
           "embedding_backend", "add_private", "scale_private", "rms_statistic", "rope_shares", "client_one_hot",
           "HE_STEPS", "SETUP_STEPS"]

"""Plaintext reference pieces (numpy): the oracle of every private mode.

Every model runs from its graph (`cipherlm.compile`, walked by
`cipherlm.runtime.graph_executor`); `make_executor(config, client_params, backend)`
returns that executor (`DecoderExecutor` / `EncoderExecutor`, also importable from
here). This module holds what the executors and the private modes share (the first
two items are defined next to the graph walk, in runtime/graph_executor.py, and
re-exported here):

* `split_params`: the client-side parameters (embeddings, position embeddings, norms,
  q/k norms, router biases) and the server linears (every projection, the MoE routers
  and experts, the pooler, a "classifier" head, "lm_head");
* `LinearBackend` / `PlainLinear`: the projections, in the clear (float32 by default,
  the weights' precision, or float64 when asked); a private mode swaps the backend;
* `KVCache`, `sample_next` (greedy / temperature / top-k / top-p), `OpTimer`;
* `OpTimer`; `DecoderSpec`: the decoder config as the 2pc executor (runtime/twopc.py)
  reads it (until that executor runs from the graph too).

Operator classes, for profiling: embedding, norm, linear, attention (scores, rotary,
weighted sum), softmax, activation, moe_routing, sampling. A profiler is any object
with `add_seconds(op_class, seconds)` (e.g. `cipherlm.report.RunReport`, `OpTimer`)
or a callable `(op_class, seconds)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from cipherlm.compile import FAMILIES

from .graph_executor import (  # noqa: F401  (re-exported: the executors and their plain pieces)
    DecoderExecutor, EncoderExecutor, GraphExecutor, KVCache, LinearBackend, PlainLinear, sample_next,
)

OP_CLASSES = ("embedding", "norm", "linear", "attention", "softmax", "activation", "moe_routing", "sampling")

DECODER_TYPES = ("llama", "mistral", "qwen2", "gpt2", "qwen2_moe", "olmoe", "mixtral")
ENCODER_TYPES = ("bert",)
MOE_TYPES = ("qwen2_moe", "olmoe", "mixtral")


# --------------------------------------------------------------------------- profiling


class OpTimer:
    """Accumulates seconds and call counts per operator class."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add_seconds(self, op_class: str, seconds: float) -> None:
        self.seconds[op_class] = self.seconds.get(op_class, 0.0) + seconds
        self.counts[op_class] = self.counts.get(op_class, 0) + 1

    def __call__(self, op_class: str, seconds: float) -> None:
        self.add_seconds(op_class, seconds)


# --------------------------------------------------------------------------- params


def _gpt2_conv1d(name: str) -> bool:
    return bool(re.search(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj|attn\.q_attn)\.weight$", name))


def split_params(config: dict, weights: dict[str, np.ndarray]):
    """(client_params, server_linears).

    client_params: embeddings, position embeddings, norms (incl. OLMoE q/k norms).
    server_linears: {prefix: (W (d_out, d_in) float32, b or None)} for every projection,
    the MoE routers (`...mlp.gate`, `...mlp.shared_expert_gate`), each expert
    (`...mlp.experts.{e}.gate_proj/up_proj/down_proj`), the pooler, a "classifier" head,
    and "lm_head" (the embedding matrix itself when tied). GPT-2 Conv1D weights are
    transposed to (d_out, d_in).
    """
    mt = config.get("model_type", "")
    client: dict[str, np.ndarray] = {}
    server: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    embed_names = {
        "model.embed_tokens.weight",
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
    }
    tie = config.get("tie_word_embeddings", mt == "gpt2")
    for name, w in weights.items():
        if name == "lm_head.weight":
            continue
        if name in embed_names:
            client[name] = w
            continue
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m and w.ndim == 3:
            base = m.group(1)
            for e in range(w.shape[0]):
                if m.group(2) == "gate_up_proj":
                    half = w.shape[1] // 2
                    server[f"{base}.{e}.gate_proj"] = (w[e, :half], None)
                    server[f"{base}.{e}.up_proj"] = (w[e, half:], None)
                else:
                    server[f"{base}.{e}.down_proj"] = (w[e], None)
            continue
        if name.endswith(".weight") and w.ndim == 2:
            prefix = name[: -len(".weight")]
            bias = weights.get(prefix + ".bias")
            if mt == "gpt2" and _gpt2_conv1d(name):
                w = np.ascontiguousarray(w.T)
            server[prefix] = (w, bias)
            continue
        if name.endswith(".bias") and weights.get(name[: -len(".bias")] + ".weight") is not None and \
                weights[name[: -len(".bias")] + ".weight"].ndim == 2:
            continue  # bias of a server linear
        client[name] = w
    if mt in DECODER_TYPES or getattr(FAMILIES.get(mt), "kind", None) == "decoder":
        emb = weights["transformer.wte.weight"] if mt == "gpt2" else weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight")
        if tie or head is None:
            head = emb
        server["lm_head"] = (head, weights.get("lm_head.bias"))
    return client, server


# --------------------------------------------------------------------------- config


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg and cfg["rope_theta"] is not None:
        return float(cfg["rope_theta"])
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    return {"mixtral": 1e6}.get(cfg.get("model_type"), 10000.0)


def _rope_type(cfg: dict) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        rp = cfg.get(key)
        if isinstance(rp, dict):
            return rp.get("rope_type") or rp.get("type") or "default"
    return "default"


@dataclass
class DecoderSpec:
    family: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    eps: float
    act: str
    rope_theta: float = 10000.0
    max_positions: int = 2048
    sliding_window: int | None = None
    # MoE
    n_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = True
    moe_layers: frozenset = field(default_factory=frozenset)
    shared_expert: bool = False
    clip_qkv: float | None = None
    qk_norm: bool = False
    attn_scale_inv_layer: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> "DecoderSpec":
        mt = cfg.get("model_type", "llama")
        if mt not in DECODER_TYPES:
            raise ValueError(f"unsupported decoder model_type {mt!r}; supported: {DECODER_TYPES}")
        if mt == "gpt2":
            d = cfg.get("n_embd", 768)
            h = cfg.get("n_head", 12)
            return cls(
                family="gpt2", n_layers=cfg.get("n_layer", 12), d_model=d, n_heads=h, n_kv_heads=h,
                head_dim=d // h, vocab_size=cfg.get("vocab_size", 50257),
                eps=cfg.get("layer_norm_epsilon", 1e-5), act=cfg.get("activation_function", "gelu_new"),
                max_positions=cfg.get("n_positions", 1024),
                attn_scale_inv_layer=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
            )
        if _rope_type(cfg) != "default":
            raise ValueError(f"rope type {_rope_type(cfg)!r} is not supported (only 'default')")
        d = cfg["hidden_size"]
        h = cfg["num_attention_heads"]
        spec = cls(
            family=mt, n_layers=cfg["num_hidden_layers"], d_model=d, n_heads=h,
            n_kv_heads=cfg.get("num_key_value_heads") or h,
            head_dim=cfg.get("head_dim") or d // h, vocab_size=cfg["vocab_size"],
            eps=cfg.get("rms_norm_eps", 1e-6), act=cfg.get("hidden_act", "silu"),
            rope_theta=_rope_theta(cfg), max_positions=cfg.get("max_position_embeddings", 2048),
        )
        if mt in ("mistral", "mixtral", "qwen2", "qwen2_moe"):
            if mt in ("qwen2", "qwen2_moe") and not cfg.get("use_sliding_window", False):
                spec.sliding_window = None
            else:
                spec.sliding_window = cfg.get("sliding_window")
        if mt == "qwen2_moe":
            spec.n_experts = cfg.get("num_experts", 60)
            spec.top_k = cfg.get("num_experts_per_tok", 4)
            spec.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
            step = cfg.get("decoder_sparse_step", 1)
            only = set(cfg.get("mlp_only_layers") or [])
            spec.moe_layers = frozenset(
                i for i in range(spec.n_layers)
                if i not in only and spec.n_experts > 0 and (i + 1) % step == 0
            )
            spec.shared_expert = True
        elif mt == "olmoe":
            spec.n_experts = cfg.get("num_experts", 64)
            spec.top_k = cfg.get("num_experts_per_tok", 8)
            spec.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
            spec.moe_layers = frozenset(range(spec.n_layers))
            spec.clip_qkv = cfg.get("clip_qkv")
            spec.qk_norm = True
        elif mt == "mixtral":
            spec.n_experts = cfg.get("num_local_experts", 8)
            spec.top_k = cfg.get("num_experts_per_tok", 2)
            spec.norm_topk_prob = True
            # `mlp_only_layers` (Qwen2-MoE's key; absent from HF Mixtral configs) keeps dense
            # FFNs in those layers: used by the sparse-upcycled fixture (cipherlm.models.upcycle)
            only = set(cfg.get("mlp_only_layers") or [])
            spec.moe_layers = frozenset(i for i in range(spec.n_layers) if i not in only)
        return spec


# --------------------------------------------------------------------------- factories


def make_executor(config: dict, client_params: dict, backend: LinearBackend, profiler=None):
    """The model graph's executor (`cipherlm.runtime.graph_executor`: `DecoderExecutor` or
    `EncoderExecutor` for the config's model_type) over `backend`'s projections."""
    if config.get("model_type") in ENCODER_TYPES:
        return EncoderExecutor(config, client_params, backend, profiler=profiler)
    return DecoderExecutor(config, client_params, backend, profiler=profiler)


def plain_executor(lm, profiler=None, dtype=np.float32):
    """Executor with a PlainLinear backend for a LoadedModel (or anything with .config/.weights)."""
    client, server = split_params(lm.config, lm.weights)
    return make_executor(lm.config, client, PlainLinear(server, dtype=dtype), profiler=profiler)


def polarity_classifier(lm=None, profiler=None, retrain: bool = False):
    """(executor, tokenizer, probe): MiniLM encoder whose server linears include the
    polarity probe as the "classifier" head (`executor.classify(ids, mask)`)."""
    from cipherlm.models import load_model
    from cipherlm.models.probe import get_polarity_probe

    lm = lm or load_model("minilm-l6")
    client, server = split_params(lm.config, lm.weights)
    backend = PlainLinear(server)
    base = EncoderExecutor(lm.config, client, backend)
    probe = get_polarity_probe(lambda texts: base.embed_texts(lm.tokenizer, texts), model_name=lm.name,
                               retrain=retrain)
    server = dict(server) | probe.as_linear()
    ex = EncoderExecutor(lm.config, client, PlainLinear(server), profiler=profiler)
    return ex, lm.tokenizer, probe

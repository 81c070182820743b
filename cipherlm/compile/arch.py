"""The architecture table: per model family, the Hugging Face config fields and the
tensor-name patterns, in one place (llama.cpp's LLM_ARCH / tensor-name tables).

`FAMILIES[model_type]` says which builder makes the graph, where each architecture
parameter lives in the config (keys tried in order, then a default) and how the
tensors are named (``{i}`` the layer, ``{e}`` the expert). `arch_from_config(config)`
resolves one config into an `Arch` (every field a plain value); the builders read
nothing else.

Adding a family: add its row to `FAMILIES` (a new `model_type` with the same block
structure as an existing one is usually just field and name overrides of that row);
if its block differs, add a builder in `cipherlm.compile.builders` and name it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MISSING = object()

#: config fields shared by the Llama-style decoders: canonical name -> (config keys, default)
_LLAMA_FIELDS = {
    "d_model": (("hidden_size",), _MISSING),
    "n_layers": (("num_hidden_layers",), _MISSING),
    "n_heads": (("num_attention_heads",), _MISSING),
    "n_kv_heads": (("num_key_value_heads", "num_attention_heads"), _MISSING),
    "head_dim": (("head_dim",), None),  # None: d_model // n_heads
    "vocab_size": (("vocab_size",), _MISSING),
    "ffn": (("intermediate_size",), None),
    "eps": (("rms_norm_eps",), 1e-6),
    "act": (("hidden_act",), "silu"),
    "rope_theta": (("rope_theta", "rope_parameters.rope_theta", "rope_scaling.rope_theta"), 10000.0),
    "rope_type": (("rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type"), "default"),
    "max_positions": (("max_position_embeddings",), 2048),
    "tie": (("tie_word_embeddings",), False),
    "attn_bias": (("attention_bias",), False),
    "mlp_bias": (("mlp_bias",), False),
    "sliding_window": (("sliding_window",), None),
    "use_sliding_window": (("use_sliding_window",), True),
    "mlp_only_layers": (("mlp_only_layers",), ()),
}

_LLAMA_TENSORS = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm",
    "q": "model.layers.{i}.self_attn.q_proj",
    "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj",
    "o": "model.layers.{i}.self_attn.o_proj",
    "q_norm": "model.layers.{i}.self_attn.q_norm",
    "k_norm": "model.layers.{i}.self_attn.k_norm",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "ffn_up": "model.layers.{i}.mlp.up_proj",
    "ffn_down": "model.layers.{i}.mlp.down_proj",
    "router": "model.layers.{i}.mlp.gate",
    "experts_gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",  # fused (E, 2f, d): gate rows then up rows
    "experts_down": "model.layers.{i}.mlp.experts.down_proj",        # fused (E, d, f)
    "expert_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj",
    "expert_up": "model.layers.{i}.mlp.experts.{e}.up_proj",
    "expert_down": "model.layers.{i}.mlp.experts.{e}.down_proj",
    "shared_gate": "model.layers.{i}.mlp.shared_expert.gate_proj",
    "shared_up": "model.layers.{i}.mlp.shared_expert.up_proj",
    "shared_down": "model.layers.{i}.mlp.shared_expert.down_proj",
    "shared_router": "model.layers.{i}.mlp.shared_expert_gate",
    "out_norm": "model.norm",
    "head": "lm_head",
}


@dataclass(frozen=True)
class Family:
    """One row of the table."""

    name: str
    builder: str          # "llama" | "gpt2" | "bert" | "deepseek_v3"
    kind: str             # "decoder" | "encoder"
    norm: str             # "rms_norm" | "layer_norm"
    fields: dict          # canonical name -> (config keys, default)
    tensors: dict         # role -> name pattern
    consts: dict = field(default_factory=dict)  # fixed architecture facts (qkv bias, q/k norms, MoE kind)


def _llama(name, fields=(), tensors=(), **consts) -> Family:
    return Family(name, "llama", "decoder", "rms_norm", {**_LLAMA_FIELDS, **dict(fields)},
                  {**_LLAMA_TENSORS, **dict(tensors)}, dict(consts))


_MOE_COMMON = {"n_experts": (("num_experts",), 0), "top_k": (("num_experts_per_tok",), 1),
               "norm_topk_prob": (("norm_topk_prob",), False)}

FAMILIES: dict[str, Family] = {
    "llama": _llama("llama"),
    "mistral": _llama("mistral", sliding=True),
    "qwen2": _llama("qwen2", {"attn_bias": ((), True)}, sliding_flag=True, no_o_bias=True),
    "qwen2_moe": _llama(
        "qwen2_moe",
        {"attn_bias": (("qkv_bias",), True), **_MOE_COMMON, "moe_ffn": (("moe_intermediate_size",), 1408),
         "shared_ffn": (("shared_expert_intermediate_size",), 5632), "sparse_step": (("decoder_sparse_step",), 1)},
        moe="softmax_topk", shared_expert="gated", sliding_flag=True, no_o_bias=True),
    "olmoe": _llama("olmoe", {**_MOE_COMMON, "moe_ffn": (("intermediate_size",), _MISSING),
                              "clip_qkv": (("clip_qkv",), None)},
                    moe="softmax_topk", qk_norm="full"),
    "mixtral": _llama("mixtral", {**_MOE_COMMON, "n_experts": (("num_local_experts",), 8),
                                  "moe_ffn": (("intermediate_size",), _MISSING),
                                  "rope_theta": (("rope_theta", "rope_parameters.rope_theta"), 1e6)},
                      moe="softmax_topk", norm_topk_prob=True, sliding=True),
    "deepseek_v3": Family(
        "deepseek_v3", "deepseek_v3", "decoder", "rms_norm",
        {**_LLAMA_FIELDS, **_MOE_COMMON, "n_experts": (("n_routed_experts",), 256),
         "moe_ffn": (("moe_intermediate_size",), _MISSING), "n_shared": (("n_shared_experts",), 1),
         "first_dense": (("first_k_dense_replace",), 0), "n_group": (("n_group",), 1),
         "topk_group": (("topk_group",), 1), "routed_scale": (("routed_scaling_factor",), 1.0),
         "q_lora_rank": (("q_lora_rank",), None), "kv_lora_rank": (("kv_lora_rank",), _MISSING),
         "qk_rope_dim": (("qk_rope_head_dim",), _MISSING), "qk_nope_dim": (("qk_nope_head_dim",), _MISSING),
         "v_head_dim": (("v_head_dim",), _MISSING), "rope_interleave": (("rope_interleave",), True)},
        {**_LLAMA_TENSORS,
         "q_a": "model.layers.{i}.self_attn.q_a_proj", "q_a_norm": "model.layers.{i}.self_attn.q_a_layernorm",
         "q_b": "model.layers.{i}.self_attn.q_b_proj",
         "kv_a": "model.layers.{i}.self_attn.kv_a_proj_with_mqa",
         "kv_a_norm": "model.layers.{i}.self_attn.kv_a_layernorm",
         "kv_b": "model.layers.{i}.self_attn.kv_b_proj",
         "router_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
         "shared_gate": "model.layers.{i}.mlp.shared_experts.gate_proj",
         "shared_up": "model.layers.{i}.mlp.shared_experts.up_proj",
         "shared_down": "model.layers.{i}.mlp.shared_experts.down_proj"},
        {"moe": "sigmoid_group_topk", "shared_expert": "plain"}),
    "gpt2": Family(
        "gpt2", "gpt2", "decoder", "layer_norm",
        {"d_model": (("n_embd", "hidden_size"), 768), "n_layers": (("n_layer", "num_hidden_layers"), 12),
         "n_heads": (("n_head", "num_attention_heads"), 12), "vocab_size": (("vocab_size",), 50257),
         "ffn": (("n_inner",), None), "eps": (("layer_norm_epsilon",), 1e-5),
         "act": (("activation_function",), "gelu_new"), "max_positions": (("n_positions",), 1024),
         "tie": (("tie_word_embeddings",), True), "scale_attn_weights": (("scale_attn_weights",), True),
         "scale_inv_layer": (("scale_attn_by_inverse_layer_idx",), False)},
        {"embed": "transformer.wte.weight", "pos_embed": "transformer.wpe.weight",
         "attn_norm": "transformer.h.{i}.ln_1", "qkv": "transformer.h.{i}.attn.c_attn",
         "o": "transformer.h.{i}.attn.c_proj", "ffn_norm": "transformer.h.{i}.ln_2",
         "ffn_up": "transformer.h.{i}.mlp.c_fc", "ffn_down": "transformer.h.{i}.mlp.c_proj",
         "out_norm": "transformer.ln_f", "head": "lm_head"},
        {"conv1d": True}),
    "bert": Family(
        "bert", "bert", "encoder", "layer_norm",
        {"d_model": (("hidden_size",), 768), "n_layers": (("num_hidden_layers",), 12),
         "n_heads": (("num_attention_heads",), 12), "vocab_size": (("vocab_size",), 30522),
         "ffn": (("intermediate_size",), 3072), "eps": (("layer_norm_eps",), 1e-12),
         "act": (("hidden_act",), "gelu"), "max_positions": (("max_position_embeddings",), 512),
         "type_vocab_size": (("type_vocab_size",), 2),
         "position_embedding_type": (("position_embedding_type",), "absolute")},
        {"embed": "embeddings.word_embeddings.weight", "pos_embed": "embeddings.position_embeddings.weight",
         "type_embed": "embeddings.token_type_embeddings.weight", "embed_norm": "embeddings.LayerNorm",
         "q": "encoder.layer.{i}.attention.self.query", "k": "encoder.layer.{i}.attention.self.key",
         "v": "encoder.layer.{i}.attention.self.value", "o": "encoder.layer.{i}.attention.output.dense",
         "attn_out_norm": "encoder.layer.{i}.attention.output.LayerNorm",
         "ffn_up": "encoder.layer.{i}.intermediate.dense", "ffn_down": "encoder.layer.{i}.output.dense",
         "ffn_out_norm": "encoder.layer.{i}.output.LayerNorm", "pooler": "pooler.dense"},
        {"pooler": True}),
}

#: HF activation names -> the IR's activation functions
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}


@dataclass
class Arch:
    """One resolved config: the family row plus every field as a plain value."""

    family: Family
    config: dict
    values: dict

    def __getattr__(self, key):
        values = self.__dict__.get("values", {})
        if key in values:
            return values[key]
        consts = self.__dict__["family"].consts if "family" in self.__dict__ else {}
        if key in consts:
            return consts[key]
        raise AttributeError(key)

    def const(self, key, default=None):
        return self.family.consts.get(key, default)

    def name(self, role: str, i: int | None = None, e: int | None = None) -> str:
        return self.family.tensors[role].format(i=i, e=e)

    def has(self, role: str) -> bool:
        return role in self.family.tensors


def _lookup(cfg: dict, key: str):
    cur = cfg
    for part in key.split("."):
        if not isinstance(cur, dict) or cur.get(part) is None:
            return _MISSING
        cur = cur[part]
    return cur


def arch_from_config(config: dict) -> Arch:
    mt = config.get("model_type", "llama")
    fam = FAMILIES.get(mt)
    if fam is None:
        raise ValueError(f"unsupported model_type {mt!r}; the graph knows {sorted(FAMILIES)}")
    vals = {}
    for key, (cfg_keys, default) in fam.fields.items():
        v = _MISSING
        for k in cfg_keys:
            v = _lookup(config, k)
            if v is not _MISSING:
                break
        if v is _MISSING:
            if default is _MISSING:
                raise ValueError(f"{mt} config lacks {' / '.join(cfg_keys)} ({key})")
            v = default
        vals[key] = v
    if vals.get("n_kv_heads") is None:
        vals["n_kv_heads"] = vals["n_heads"]
    if vals.get("head_dim") is None:
        vals["head_dim"] = vals["d_model"] // vals["n_heads"]
    if vals.get("ffn") is None:
        vals["ffn"] = 4 * vals["d_model"]
    if vals.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {vals['rope_type']!r} is not supported (only 'default')")
    act = vals.get("act")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r}; known: {sorted(ACTIVATIONS)}")
    vals["act"] = ACTIVATIONS[act]
    if fam.consts.get("sliding_flag") and not vals.get("use_sliding_window"):
        vals["sliding_window"] = None
    elif not (fam.consts.get("sliding") or fam.consts.get("sliding_flag")):
        vals["sliding_window"] = None
    if "norm_topk_prob" in fam.consts:
        vals["norm_topk_prob"] = fam.consts["norm_topk_prob"]
    vals["mlp_only_layers"] = frozenset(vals.get("mlp_only_layers") or ())
    vals["moe_layers"] = _moe_layers(fam, vals)
    return Arch(fam, config, vals)


def _moe_layers(fam: Family, v: dict) -> frozenset:
    kind = fam.consts.get("moe")
    if not kind or v.get("n_experts", 0) <= 0:
        return frozenset()
    n = v["n_layers"]
    if fam.name == "qwen2_moe":
        step = v.get("sparse_step") or 1
        return frozenset(i for i in range(n) if i not in v["mlp_only_layers"] and (i + 1) % step == 0)
    if fam.name == "deepseek_v3":
        return frozenset(range(v["first_dense"], n))
    return frozenset(i for i in range(n) if i not in v["mlp_only_layers"])

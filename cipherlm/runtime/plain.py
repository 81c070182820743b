"""Plaintext reference executor (numpy): the oracle of every private mode.

The executor holds only the client-side parameters (embeddings, norms, position
embeddings, q/k norms) and sends every projection through a `LinearBackend`, so a
private mode swaps the backend and keeps everything else. Projections that share
an input go in one call: (q, k, v), (gate, up), per MoE expert (gate, up) then
(down), the router on its own, and Qwen2-MoE's shared expert with its gate.

Supported: decoders Llama (SmolLM2, Mistral, Qwen2), GPT-2, Qwen2-MoE, OLMoE,
Mixtral (`DecoderExecutor`, KV cache, generation) and the BERT encoder
(`EncoderExecutor`, sentence embeddings, a linear "classifier" head).

Nonlinear parts are computed in float64; `PlainLinear` multiplies in float32 by
default (the weights' precision), or float64 when asked.

Operator classes, for profiling: embedding, norm, linear, attention (scores, rotary,
weighted sum), softmax, activation, moe_routing, sampling. A profiler is any object
with `add_seconds(op_class, seconds)` (e.g. `cipherlm.report.RunReport`, `OpTimer`)
or a callable `(op_class, seconds)`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from . import ops

OP_CLASSES = ("embedding", "norm", "linear", "attention", "softmax", "activation", "moe_routing", "sampling")

DECODER_TYPES = ("llama", "mistral", "qwen2", "gpt2", "qwen2_moe", "olmoe", "mixtral")
ENCODER_TYPES = ("bert",)
MOE_TYPES = ("qwen2_moe", "olmoe", "mixtral")


# --------------------------------------------------------------------------- backend


class LinearBackend(Protocol):
    def linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        """x: (T, d_in); names share this input. Returns [x @ W.T + b for each name]."""
        ...


class PlainLinear:
    """LinearBackend in the clear. `server_linears[name] = (W (d_out, d_in), b or None)`."""

    def __init__(self, server_linears: dict, dtype=np.float32):
        self.server_linears = server_linears
        self.dtype = np.dtype(dtype)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}

    def _weights(self, name: str):
        wb = self._cache.get(name)
        if wb is None:
            w, b = self.server_linears[name]
            w = np.asarray(w, dtype=self.dtype)
            b = None if b is None else np.asarray(b, dtype=self.dtype)
            wb = self._cache[name] = (w, b)
        return wb

    def linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        xd = np.asarray(x, dtype=self.dtype)
        outs = []
        for name in names:
            w, b = self._weights(name)
            y = xd @ w.T
            if b is not None:
                y = y + b
            outs.append(y.astype(np.float64))
        return outs


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


class _Timed:
    __slots__ = ("sink", "op", "t0")

    def __init__(self, sink, op):
        self.sink, self.op = sink, op

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.sink(self.op, time.perf_counter() - self.t0)


class _NoTime:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOTIME = _NoTime()


class _Profiled:
    """Mixin: `with self._op("softmax"): ...` times a block when a profiler is set."""

    profiler = None

    def _set_profiler(self, profiler) -> None:
        if profiler is None:
            self._sink = None
        elif hasattr(profiler, "add_seconds"):
            self._sink = profiler.add_seconds
        elif callable(profiler):
            self._sink = profiler
        else:
            raise TypeError("profiler must have add_seconds(op_class, seconds) or be callable")
        self.profiler = profiler

    def _op(self, op_class: str):
        return _NOTIME if self._sink is None else _Timed(self._sink, op_class)

    def _linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        with self._op("linear"):
            return self.backend.linear(x, list(names))


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
    if mt in DECODER_TYPES:
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


# --------------------------------------------------------------------------- KV cache


class KVCache:
    """Per-layer keys/values (kv_heads, T, head_dim), owned by the client side."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k], axis=1)
            self.v[layer] = np.concatenate([self.v[layer], v], axis=1)
        return self.k[layer], self.v[layer]

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` positions."""
        self.length = min(self.length, length)
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :length]
                self.v[i] = self.v[i][:, :length]


# --------------------------------------------------------------------------- attention


def causal_attention(q, k, v, q_pos0: int, scale: float, sliding_window: int | None = None, op=None):
    """q: (H, T, hd); k, v: (Hkv, S, hd) holding positions 0..S-1; query t sits at q_pos0+t.
    Returns (T, H*hd). `op(op_class)` gives timing contexts."""
    op = op or (lambda _c: _NOTIME)
    H, T, hd = q.shape
    Hkv, S, _ = k.shape
    rep = H // Hkv
    with op("attention"):
        qg = q.reshape(Hkv, rep * T, hd) if rep > 1 else q
        scores = (qg @ k.transpose(0, 2, 1)).reshape(H, T, S) * scale
        qpos = q_pos0 + np.arange(T)[:, None]
        kpos = np.arange(S)[None, :]
        mask = kpos > qpos
        if sliding_window is not None:
            mask |= (qpos - kpos) >= sliding_window
        scores = np.where(mask[None], -np.inf, scores)
    with op("softmax"):
        p = ops.softmax(scores, axis=-1)
    with op("attention"):
        pg = p.reshape(Hkv, rep * T, S) if rep > 1 else p
        out = (pg @ v).reshape(H, T, hd)
        return out.transpose(1, 0, 2).reshape(T, H * hd)


# --------------------------------------------------------------------------- sampling


def sample_next(logits: np.ndarray, rng: np.random.Generator | None, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0) -> int:
    """Greedy when temperature <= 0, else temperature / top-k / top-p (nucleus) sampling."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature is None or temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k and 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = ops.softmax(z)
    if top_p is not None and 0 < top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = cum - p[order] < top_p  # smallest prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    rng = rng or np.random.default_rng()
    return int(rng.choice(p.size, p=p))


# --------------------------------------------------------------------------- decoder


class DecoderExecutor(_Profiled):
    """Causal LMs: Llama/Mistral/Qwen2 (SmolLM2), GPT-2, Qwen2-MoE, OLMoE, Mixtral."""

    def __init__(self, config: dict, client_params: dict, backend: LinearBackend, profiler=None,
                 moe_routing=None):
        self.config = config
        self.spec = DecoderSpec.from_config(config)
        # None: the model's own top-k routing; a `cipherlm.moe.routing.BalancedRouting`: CryptoMoE
        # balanced routing (each expert takes exactly t tokens per forward call)
        self.moe_routing = moe_routing
        self.last_moe_dispatch: dict = {}  # layer -> routing.Dispatch of the last forward (balanced only)
        self.backend = backend
        self._set_profiler(profiler)
        self.p = {k: np.asarray(v, dtype=np.float64) if v.ndim == 1 else v for k, v in client_params.items()}
        s = self.spec
        self.inv_freq = None if s.family == "gpt2" else ops.rope_inv_freq(s.head_dim, s.rope_theta)
        self.act = ops.activation(s.act)
        if s.family == "gpt2":
            self.embed = client_params["transformer.wte.weight"]
            self.pos_embed = client_params["transformer.wpe.weight"]
        else:
            self.embed = client_params["model.embed_tokens.weight"]
            self.pos_embed = None
        self.last_routing: dict[int, np.ndarray] = {}  # layer -> (T, top_k) expert ids of the last forward

    # ---- public API

    def new_cache(self) -> KVCache:
        return KVCache(self.spec.n_layers)

    def forward(self, ids: Sequence[int] | np.ndarray, cache: KVCache | None = None, last_only: bool = False) -> np.ndarray:
        """Logits (T, vocab) for `ids` appended after what `cache` holds (a fresh cache if None).

        With `last_only` the LM head runs on the last position only (logits (1, vocab)):
        generation needs no more, and in a private mode the head is the costliest projection."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if cache is None:
            cache = self.new_cache()
        pos0 = cache.length
        T = ids.size
        positions = np.arange(pos0, pos0 + T)
        s = self.spec
        with self._op("embedding"):
            x = np.asarray(self.embed[ids], dtype=np.float64)
            if self.pos_embed is not None:
                if pos0 + T > self.pos_embed.shape[0]:
                    raise ValueError(f"sequence longer than {self.pos_embed.shape[0]} positions")
                x = x + self.pos_embed[positions]
        for i in range(s.n_layers):
            if s.family == "gpt2":
                x = self._gpt2_block(i, x, cache, pos0)
            else:
                x = self._llama_block(i, x, cache, pos0, positions)
        with self._op("norm"):
            if s.family == "gpt2":
                x = ops.layer_norm(x, self.p["transformer.ln_f.weight"], self.p["transformer.ln_f.bias"], s.eps)
            else:
                x = ops.rms_norm(x, self.p["model.norm.weight"], s.eps)
        cache.length = pos0 + T
        if last_only:
            x = x[-1:]
        return self._linear(x, ["lm_head"])[0]

    def trace_one_token(self, token_id: int = 0) -> np.ndarray:
        """One-token forward on a fresh cache (used to discover the projection groups)."""
        return self.forward([token_id], self.new_cache())

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_ids: Iterable[int] | int | None = None,
        on_token: Callable[[int], None] | None = None,
        return_logits: bool = False,
        greedy: bool | None = None,
    ):
        """Prefill the prompt, then decode one token at a time with the KV cache.

        Greedy if temperature <= 0 (or greedy=True); sampling otherwise, reproducible
        with `seed`. Stops after max_new_tokens or at an EOS id (the EOS id is
        included in the output). `on_token(id)` is called for each new token.
        Returns new ids, or (new ids, [logits of each step]) with return_logits."""
        if greedy:
            temperature = 0.0
        if eos_token_ids is None:
            eos = self.config.get("eos_token_id")
            eos_token_ids = [] if eos is None else eos
        eos_set = {int(eos_token_ids)} if isinstance(eos_token_ids, (int, np.integer)) else {int(e) for e in eos_token_ids}
        rng = np.random.default_rng(seed)
        cache = self.new_cache()
        out: list[int] = []
        all_logits: list[np.ndarray] = []
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("empty prompt")
        for _ in range(max_new_tokens):
            logits = self.forward(ids, cache, last_only=True)[-1]
            with self._op("sampling"):
                tok = sample_next(logits, rng, temperature, top_k, top_p)
            out.append(tok)
            if return_logits:
                all_logits.append(logits)
            if on_token is not None:
                on_token(tok)
            if tok in eos_set:
                break
            ids = [tok]
        return (out, all_logits) if return_logits else out

    # ---- blocks

    def _attention_core(self, i, q, k, v, cache, pos0, positions, scale):
        s = self.spec
        T = q.shape[0]
        q = q.reshape(T, s.n_heads, s.head_dim).transpose(1, 0, 2)
        k = k.reshape(T, s.n_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = v.reshape(T, s.n_kv_heads, s.head_dim).transpose(1, 0, 2)
        if self.inv_freq is not None:
            with self._op("attention"):
                q = ops.apply_rope(q, positions, self.inv_freq)
                k = ops.apply_rope(k, positions, self.inv_freq)
        k_all, v_all = cache.extend(i, k, v)
        return causal_attention(q, k_all, v_all, pos0, scale, s.sliding_window, self._op)

    def _llama_block(self, i, x, cache, pos0, positions):
        s = self.spec
        p = f"model.layers.{i}"
        with self._op("norm"):
            h = ops.rms_norm(x, self.p[f"{p}.input_layernorm.weight"], s.eps)
        a = f"{p}.self_attn"
        q, k, v = self._linear(h, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
        if s.qk_norm:
            with self._op("norm"):
                q = ops.rms_norm(q, self.p[f"{a}.q_norm.weight"], s.eps)
                k = ops.rms_norm(k, self.p[f"{a}.k_norm.weight"], s.eps)
        if s.clip_qkv is not None:
            c = s.clip_qkv
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        ctx = self._attention_core(i, q, k, v, cache, pos0, positions, s.head_dim ** -0.5)
        x = x + self._linear(ctx, [f"{a}.o_proj"])[0]
        with self._op("norm"):
            h = ops.rms_norm(x, self.p[f"{p}.post_attention_layernorm.weight"], s.eps)
        if i in s.moe_layers:
            return x + self._moe(f"{p}.mlp", h)
        return x + self._mlp(f"{p}.mlp", h)

    def _mlp(self, p, h):
        g, u = self._linear(h, [f"{p}.gate_proj", f"{p}.up_proj"])
        with self._op("activation"):
            a = self.act(g) * u
        return self._linear(a, [f"{p}.down_proj"])[0]

    def _moe(self, p, h):
        s = self.spec
        logits = self._linear(h, [f"{p}.gate"])[0]
        with self._op("moe_routing"):
            probs = ops.softmax(logits, axis=-1)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, : s.top_k]
            w = np.take_along_axis(probs, top, axis=-1)
            if s.norm_topk_prob:
                w = w / w.sum(axis=-1, keepdims=True)
        self.last_routing[int(p.split(".")[2])] = top
        if self.moe_routing is not None:
            out = self._moe_balanced(p, h, top, w)
        else:
            out = np.zeros_like(h)
            for e in np.unique(top):
                rows, slot = np.nonzero(top == e)
                y = self._mlp(f"{p}.experts.{int(e)}", h[rows])
                with self._op("moe_routing"):
                    np.add.at(out, rows, w[rows, slot][:, None] * y)
        if s.shared_expert:
            g, u, sg = self._linear(h, [f"{p}.shared_expert.gate_proj", f"{p}.shared_expert.up_proj",
                                        f"{p}.shared_expert_gate"])
            with self._op("activation"):
                a = self.act(g) * u
            y = self._linear(a, [f"{p}.shared_expert.down_proj"])[0]
            with self._op("activation"):
                out = out + ops.sigmoid(sg) * y
        return out

    def _moe_balanced(self, p, h, top, w):
        """CryptoMoE balanced routing (cipherlm.moe.routing): each expert takes exactly
        t = ceil(c T k / n) of this call's T tokens (dummies padded, the rest dropped)."""
        from cipherlm.moe.routing import balanced_dispatch

        s, r = self.spec, self.moe_routing
        T, layer = h.shape[0], int(p.split(".")[2])
        with self._op("moe_routing"):
            rng = np.random.default_rng([r.seed, layer, T]) if r.selection == "random" else None
            disp = balanced_dispatch(top, w, s.n_experts, r.capacity(T, s.top_k, s.n_experts), r.selection, rng)
        self.last_moe_dispatch[layer] = disp
        out = np.zeros_like(h)
        for e in range(s.n_experts):
            sel = disp.valid[e]
            if not sel.any():
                continue
            rows = disp.token[e, sel]
            y = self._mlp(f"{p}.experts.{e}", h[rows])
            with self._op("moe_routing"):
                np.add.at(out, rows, disp.score[e, sel][:, None] * y)
        return out

    def _gpt2_block(self, i, x, cache, pos0):
        s = self.spec
        p = f"transformer.h.{i}"
        with self._op("norm"):
            h = ops.layer_norm(x, self.p[f"{p}.ln_1.weight"], self.p[f"{p}.ln_1.bias"], s.eps)
        qkv = self._linear(h, [f"{p}.attn.c_attn"])[0]
        d = s.d_model
        q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
        scale = s.head_dim ** -0.5
        if s.attn_scale_inv_layer:
            scale /= i + 1
        if not self.config.get("scale_attn_weights", True):
            scale = 1.0 / (i + 1) if s.attn_scale_inv_layer else 1.0
        ctx = self._attention_core(i, q, k, v, cache, pos0, None, scale)
        x = x + self._linear(ctx, [f"{p}.attn.c_proj"])[0]
        with self._op("norm"):
            h = ops.layer_norm(x, self.p[f"{p}.ln_2.weight"], self.p[f"{p}.ln_2.bias"], s.eps)
        f = self._linear(h, [f"{p}.mlp.c_fc"])[0]
        with self._op("activation"):
            f = self.act(f)
        return x + self._linear(f, [f"{p}.mlp.c_proj"])[0]


# --------------------------------------------------------------------------- encoder


class EncoderExecutor(_Profiled):
    """BERT encoder: hidden states, pooler, sentence embeddings, a linear "classifier"."""

    def __init__(self, config: dict, client_params: dict, backend: LinearBackend, profiler=None):
        mt = config.get("model_type")
        if mt not in ENCODER_TYPES:
            raise ValueError(f"unsupported encoder model_type {mt!r}")
        self.config = config
        self.backend = backend
        self._set_profiler(profiler)
        self.p = {k: np.asarray(v, dtype=np.float64) if v.ndim == 1 else v for k, v in client_params.items()}
        self.n_layers = config["num_hidden_layers"]
        self.d = config["hidden_size"]
        self.n_heads = config["num_attention_heads"]
        self.head_dim = self.d // self.n_heads
        self.eps = config.get("layer_norm_eps", 1e-12)
        self.act = ops.activation(config.get("hidden_act", "gelu"))
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")

    def forward(self, ids, attention_mask=None, token_type_ids=None) -> np.ndarray:
        """Last hidden states: (B, T, d) for (B, T) ids, (T, d) for (T,) ids."""
        ids = np.asarray(ids, dtype=np.int64)
        single = ids.ndim == 1
        if single:
            ids = ids[None]
        B, T = ids.shape
        mask = np.ones((B, T)) if attention_mask is None else np.asarray(attention_mask, dtype=np.float64).reshape(B, T)
        tt = np.zeros((B, T), dtype=np.int64) if token_type_ids is None else np.asarray(token_type_ids).reshape(B, T)
        with self._op("embedding"):
            x = (
                np.asarray(self.p["embeddings.word_embeddings.weight"][ids], dtype=np.float64)
                + self.p["embeddings.position_embeddings.weight"][np.arange(T)][None]
                + self.p["embeddings.token_type_embeddings.weight"][tt]
            )
        with self._op("norm"):
            x = ops.layer_norm(x, self.p["embeddings.LayerNorm.weight"], self.p["embeddings.LayerNorm.bias"], self.eps)
        neg = np.where(mask > 0, 0.0, np.finfo(np.float32).min)[:, None, None, :]  # (B,1,1,T)
        x = x.reshape(B * T, self.d)
        for i in range(self.n_layers):
            x = self._layer(i, x, B, T, neg)
        x = x.reshape(B, T, self.d)
        return x[0] if single else x

    def _layer(self, i, x, B, T, neg):
        p = f"encoder.layer.{i}"
        H, hd = self.n_heads, self.head_dim
        q, k, v = self._linear(x, [f"{p}.attention.self.query", f"{p}.attention.self.key", f"{p}.attention.self.value"])
        with self._op("attention"):
            q = q.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
            k = k.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
            v = v.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
            scores = (q @ k.transpose(0, 1, 3, 2)) * (hd ** -0.5) + neg
        with self._op("softmax"):
            prob = ops.softmax(scores, axis=-1)
        with self._op("attention"):
            ctx = (prob @ v).transpose(0, 2, 1, 3).reshape(B * T, self.d)
        a = self._linear(ctx, [f"{p}.attention.output.dense"])[0]
        with self._op("norm"):
            x = ops.layer_norm(a + x, self.p[f"{p}.attention.output.LayerNorm.weight"],
                               self.p[f"{p}.attention.output.LayerNorm.bias"], self.eps)
        f = self._linear(x, [f"{p}.intermediate.dense"])[0]
        with self._op("activation"):
            f = self.act(f)
        o = self._linear(f, [f"{p}.output.dense"])[0]
        with self._op("norm"):
            return ops.layer_norm(o + x, self.p[f"{p}.output.LayerNorm.weight"],
                                  self.p[f"{p}.output.LayerNorm.bias"], self.eps)

    def pooled(self, hidden: np.ndarray) -> np.ndarray:
        """BertModel's pooler output: tanh(dense(hidden[:, 0]))."""
        h = hidden if hidden.ndim == 3 else hidden[None]
        y = self._linear(h[:, 0], ["pooler.dense"])[0]
        with self._op("activation"):
            return np.tanh(y)

    def sentence_embedding(self, ids, attention_mask=None, normalize: bool = True) -> np.ndarray:
        """Mean pooling over the attention mask, then L2 normalisation (sentence-transformers)."""
        ids = np.asarray(ids, dtype=np.int64)
        single = ids.ndim == 1
        if single:
            ids = ids[None]
        mask = np.ones(ids.shape) if attention_mask is None else np.asarray(attention_mask, np.float64).reshape(ids.shape)
        hidden = self.forward(ids, mask)
        with self._op("norm"):
            emb = (hidden * mask[..., None]).sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
            if normalize:
                emb = emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
        return emb[0] if single else emb

    def classify(self, ids, attention_mask=None) -> np.ndarray:
        """Logits of the "classifier" linear head on the sentence embedding."""
        emb = self.sentence_embedding(ids, attention_mask)
        return self._linear(np.atleast_2d(emb), ["classifier"])[0]

    def trace_one_token(self, token_id: int = 101) -> np.ndarray:
        hidden = self.forward(np.array([[token_id]]))
        names = getattr(self.backend, "server_linears", None)
        if names is None or "pooler.dense" in names:
            self.pooled(hidden)
        if names is not None and "classifier" in names:
            self._linear(hidden.mean(axis=1), ["classifier"])
        return hidden

    # ---- text helpers

    @staticmethod
    def batch_encode(tokenizer, texts: Sequence[str], max_length: int = 256):
        """(ids (B, T), mask (B, T)) padded with 0 to the longest text."""
        encs = [tokenizer.encode(t) for t in texts]
        seqs = [e.ids[:max_length] for e in encs]
        T = max(len(s) for s in seqs)
        ids = np.zeros((len(seqs), T), dtype=np.int64)
        mask = np.zeros((len(seqs), T), dtype=np.float64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        return ids, mask

    def embed_texts(self, tokenizer, texts: Sequence[str], batch_size: int = 16) -> np.ndarray:
        """Sentence embeddings (N, d) of raw texts."""
        out = []
        for j in range(0, len(texts), batch_size):
            ids, mask = self.batch_encode(tokenizer, texts[j : j + batch_size])
            out.append(self.sentence_embedding(ids, mask))
        return np.concatenate(out, axis=0)


# --------------------------------------------------------------------------- factories


def make_executor(config: dict, client_params: dict, backend: LinearBackend, profiler=None):
    """DecoderExecutor or EncoderExecutor for the config's model_type."""
    mt = config.get("model_type")
    if mt in ENCODER_TYPES:
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

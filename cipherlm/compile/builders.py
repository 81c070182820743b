"""One graph builder per model family, from shared pieces (llama.cpp style).

`build_graph(config)` resolves the config through the architecture table
(`cipherlm.compile.arch`) and calls the family's builder; the builders are short
compositions of `build_norm`, `build_attn`, `build_ffn` and `build_moe_ffn`.
"""

from __future__ import annotations

from .arch import Arch, arch_from_config
from .ir import Graph, Node, Tensor


class GraphBuilder:
    """Appends nodes in order; names values ``<node name>`` (``<node name>:k`` for extra outputs)."""

    def __init__(self, graph: Graph):
        self.g = graph
        self.layer: int | None = None

    def tensor(self, name: str, shape, source: str | None = None, **kw) -> str:
        if name not in self.g.tensors:
            self.g.tensors[name] = Tensor(name, tuple(int(s) for s in shape), source or name, **kw)
        return name

    def add(self, op: str, node_name: str, inputs, shape=(), weights=(), n_out: int = 1, **attrs):
        name = node_name if self.layer is None else f"L{self.layer}.{node_name}"
        outs = (name,) + tuple(f"{name}:{k}" for k in range(1, n_out))
        self.g.nodes.append(Node(op, name, tuple(inputs), outs, tuple(shape), attrs, tuple(weights), self.layer))
        return outs[0] if n_out == 1 else outs

    def linear(self, x: str, name: str, d_in: int, d_out: int, bias: bool = False, node: str | None = None,
               transpose: bool = False, rows=None, source: str | None = None, bias_source: str | None = None,
               tied_to: str | None = None, **attrs) -> str:
        """A projection `name` (the LinearBackend's weight group name) with tensors name.weight / name.bias."""
        w = self.tensor(f"{name}.weight", (d_out, d_in), source or f"{name}.weight", transpose=transpose,
                        rows=rows, tied_to=tied_to)
        ws = [w]
        if bias:
            ws.append(self.tensor(f"{name}.bias", (d_out,), bias_source or f"{name}.bias"))
        return self.add("linear", node or name.rsplit(".", 1)[-1], [x], ("T", d_out), ws,
                        name=name, d_in=d_in, d_out=d_out, bias=bias, **attrs)


# ----------------------------------------------------------------------------- shared pieces


def build_norm(b: GraphBuilder, x: str, kind: str, prefix: str, dim: int, eps: float, node: str,
               bias: bool | None = None) -> str:
    """RMSNorm (gamma) or LayerNorm (gamma, beta) over the last axis; tensors prefix.weight/.bias."""
    ws = [b.tensor(f"{prefix}.weight", (dim,))]
    if kind == "layer_norm" and bias is not False:
        ws.append(b.tensor(f"{prefix}.bias", (dim,)))
    return b.add(kind, node, [x], ("T", dim), ws, eps=eps, gamma=ws[0], beta=ws[1] if len(ws) > 1 else None)


def build_attn(b: GraphBuilder, a: Arch, i: int, q: str, k: str, v: str, scale: float, causal: bool = True,
               rope: bool = True, qk_dim: int | None = None, v_dim: int | None = None, n_kv: int | None = None,
               rope_dims: tuple | None = None) -> str:
    """Attention core after the projections: rope, KV cache (decoders), Q K^T, softmax, P V."""
    H = a.n_heads
    Hkv = a.n_kv_heads if n_kv is None else n_kv
    hd = a.head_dim if qk_dim is None else qk_dim
    vd = hd if v_dim is None else v_dim
    if rope:
        rd = rope_dims or {}
        q = b.add("rope", "q_rope", [q], ("T", H * hd), heads=H, head_dim=hd, theta=a.rope_theta, **rd)
        k = b.add("rope", "k_rope", [k], ("T", Hkv * hd), heads=Hkv, head_dim=hd, theta=a.rope_theta, **rd)
    if causal:
        k, v = b.add("kv_cache", "kv", [k, v], (Hkv, "S", hd), n_out=2, layer=i, kv_heads=Hkv)
    s = b.add("qk", "qk", [q, k], (H, "T", "S"), heads=H, kv_heads=Hkv, head_dim=hd, scale=scale, causal=causal,
              sliding_window=getattr(a, "sliding_window", None) if causal else None)
    p = b.add("softmax", "softmax", [s], (H, "T", "S"))
    return b.add("av", "av", [p, v], ("T", H * vd), heads=H, kv_heads=Hkv, head_dim=vd)


def build_ffn(b: GraphBuilder, x: str, d: int, f: int, act: str, up: str, down: str, gate: str | None = None,
              bias: bool = False, tag: str = "ffn", **attrs) -> str:
    """Gated (act(gate) * up) or plain (act(up)) feed-forward, then down."""
    if gate is not None:
        g = b.linear(x, gate, d, f, bias, node=f"{tag}.gate", **attrs)
        u = b.linear(x, up, d, f, bias, node=f"{tag}.up", **attrs)
        ga = b.add("activation", f"{tag}.act", [g], ("T", f), fn=act, **attrs)
        h = b.add("mul", f"{tag}.mul", [ga, u], ("T", f), **attrs)
    else:
        u = b.linear(x, up, d, f, bias, node=f"{tag}.up", **attrs)
        h = b.add("activation", f"{tag}.act", [u], ("T", f), fn=act, **attrs)
    return b.linear(h, down, f, d, bias, node=f"{tag}.down", **attrs)


def build_moe_ffn(b: GraphBuilder, a: Arch, i: int, x: str) -> str:
    """Router, top-k, then per expert: dispatch -> gated FFN; combine; shared experts."""
    d, n, f = a.d_model, a.n_experts, a.moe_ffn
    kind = a.const("moe")
    r = b.linear(x, a.name("router", i), d, n, node="moe.router")
    topk_attrs = dict(k=a.top_k, n_experts=n, norm_topk_prob=bool(a.norm_topk_prob), scoring="softmax")
    weights = []
    if kind == "sigmoid_group_topk":
        bias = b.tensor(a.name("router_bias", i), (n,))
        weights = [bias]
        topk_attrs.update(scoring="sigmoid", n_group=a.n_group, topk_group=a.topk_group,
                          routed_scale=float(a.routed_scale), score_bias=bias)
    ids, w = b.add("topk", "moe.topk", [r], ("T", a.top_k), weights, n_out=2, **topk_attrs)
    ys = []
    fused_gu, fused_down = a.name("experts_gate_up", i), a.name("experts_down", i)
    for e in range(n):
        xe, sel = b.add("dispatch", f"moe.dispatch{e}", [x, ids, w], ("t", d), n_out=2, expert=e)
        g = b.linear(xe, a.name("expert_gate", i, e), d, f, node=f"moe.e{e}.gate", source=fused_gu,
                     rows=(e, 0, f), expert=e)
        u = b.linear(xe, a.name("expert_up", i, e), d, f, node=f"moe.e{e}.up", source=fused_gu,
                     rows=(e, f, 2 * f), expert=e)
        ga = b.add("activation", f"moe.e{e}.act", [g], ("t", f), fn=a.act, expert=e)
        h = b.add("mul", f"moe.e{e}.mul", [ga, u], ("t", f), expert=e)
        ys += [b.linear(h, a.name("expert_down", i, e), f, d, node=f"moe.e{e}.down", source=fused_down,
                        rows=(e, 0, d), expert=e), sel]
    out = b.add("combine", "moe.combine", ys, ("T", d), n_experts=n)
    shared = a.const("shared_expert")
    if shared == "gated":  # Qwen2-MoE: sigmoid(x w_g) * shared FFN(x); the three input-side linears share x
        fs = a.shared_ffn
        g = b.linear(x, a.name("shared_gate", i), d, fs, node="shared.gate")
        u = b.linear(x, a.name("shared_up", i), d, fs, node="shared.up")
        sg = b.linear(x, a.name("shared_router", i), d, 1, node="shared.router")
        ga = b.add("activation", "shared.act", [g], ("T", fs), fn=a.act)
        y = b.linear(b.add("mul", "shared.mul", [ga, u], ("T", fs)), a.name("shared_down", i), fs, d,
                     node="shared.down")
        sig = b.add("activation", "shared.sigmoid", [sg], ("T", 1), fn="sigmoid")
        out = b.add("add", "moe.out", [out, b.add("mul", "shared.scaled", [sig, y], ("T", d))], ("T", d))
    elif shared == "plain":  # DeepSeek-V3: n_shared experts as one FFN, added without a gate
        fs = a.moe_ffn * a.n_shared
        y = build_ffn(b, x, d, fs, a.act, a.name("shared_up", i), a.name("shared_down", i),
                      a.name("shared_gate", i), tag="shared")
        out = b.add("add", "moe.out", [out, y], ("T", d))
    return out


# ----------------------------------------------------------------------------- families


def _decoder_tail(b: GraphBuilder, a: Arch, x: str, norm_bias=None) -> None:
    g, d = b.g, a.d_model
    b.layer = None
    # the row selection (generation needs the last position only) comes before the final
    # norm: the norm is row-wise, so this is exact, and a private mode normalises one row
    x = b.add("head", "head", [x], ("T", d), select="last_or_all")
    x = build_norm(b, x, a.family.norm, a.name("out_norm"), d, a.eps, "out_norm", bias=norm_bias)
    tie = bool(a.tie)
    embed = a.name("embed")
    logits = b.linear(x, "lm_head", d, a.vocab_size, bias=False, node="lm_head",
                      source=embed if tie else "lm_head.weight", tied_to=embed if tie else None)
    g.outputs["hidden"] = x  # the final norm's output (Hugging Face's last_hidden_state)
    g.outputs["logits"] = logits
    g.outputs["next_token"] = b.add("argmax", "argmax", [logits], ("T",))


def build_llama(a: Arch) -> Graph:
    """Llama, Mistral, Qwen2 (qkv bias), Qwen2-MoE, OLMoE (q/k norms, clip_qkv), Mixtral."""
    g = Graph(a.family.name, "decoder", a.config, inputs=("ids",), n_layers=a.n_layers)
    b = GraphBuilder(g)
    d, H, Hkv, hd = a.d_model, a.n_heads, a.n_kv_heads, a.head_dim
    x = b.add("embed", "embed", ["ids"], ("T", d), [b.tensor(a.name("embed"), (a.vocab_size, d))], kind="word")
    for i in range(a.n_layers):
        b.layer = i
        h = build_norm(b, x, "rms_norm", a.name("attn_norm", i), d, a.eps, "attn_norm")
        qb = bool(a.attn_bias)
        q = b.linear(h, a.name("q", i), d, H * hd, qb, node="q")
        k = b.linear(h, a.name("k", i), d, Hkv * hd, qb, node="k")
        v = b.linear(h, a.name("v", i), d, Hkv * hd, qb, node="v")
        if a.const("qk_norm") == "full":
            q = build_norm(b, q, "rms_norm", a.name("q_norm", i), H * hd, a.eps, "q_norm")
            k = build_norm(b, k, "rms_norm", a.name("k_norm", i), Hkv * hd, a.eps, "k_norm")
        c = getattr(a, "clip_qkv", None) if "clip_qkv" in a.values else None
        if c is not None:
            q = b.add("clip", "q_clip", [q], ("T", H * hd), c=float(c))
            k = b.add("clip", "k_clip", [k], ("T", Hkv * hd), c=float(c))
            v = b.add("clip", "v_clip", [v], ("T", Hkv * hd), c=float(c))
        ctx = build_attn(b, a, i, q, k, v, hd ** -0.5)
        o = b.linear(ctx, a.name("o", i), H * hd, d, bool(a.attn_bias) and not a.const("no_o_bias"), node="o")
        x = b.add("add", "attn_res", [x, o], ("T", d))
        h = build_norm(b, x, "rms_norm", a.name("ffn_norm", i), d, a.eps, "ffn_norm")
        if i in a.moe_layers:
            y = build_moe_ffn(b, a, i, h)
        else:
            y = build_ffn(b, h, d, a.ffn, a.act, a.name("ffn_up", i), a.name("ffn_down", i), a.name("ffn_gate", i),
                          bias=bool(a.mlp_bias))
        x = b.add("add", "ffn_res", [x, y], ("T", d))
    _decoder_tail(b, a, x)
    return g


def build_gpt2(a: Arch) -> Graph:
    g = Graph("gpt2", "decoder", a.config, inputs=("ids", "positions"), n_layers=a.n_layers)
    b = GraphBuilder(g)
    d, H, hd = a.d_model, a.n_heads, a.head_dim
    x = b.add("embed", "embed", ["ids"], ("T", d), [b.tensor(a.name("embed"), (a.vocab_size, d))], kind="word")
    p = b.add("embed", "pos_embed", ["positions"], ("T", d), [b.tensor(a.name("pos_embed"), (a.max_positions, d))],
              kind="position")
    x = b.add("add", "embed_sum", [x, p], ("T", d))
    for i in range(a.n_layers):
        b.layer = i
        h = build_norm(b, x, "layer_norm", a.name("attn_norm", i), d, a.eps, "attn_norm")
        qkv = b.linear(h, a.name("qkv", i), d, 3 * d, True, node="qkv", transpose=True)
        q, k, v = b.add("split", "qkv_split", [qkv], ("T", d), n_out=3, sizes=(d, d, d))
        scale = hd ** -0.5 if a.scale_attn_weights else 1.0
        if a.scale_inv_layer:
            scale /= i + 1
        ctx = build_attn(b, a, i, q, k, v, scale, rope=False)
        o = b.linear(ctx, a.name("o", i), d, d, True, node="o", transpose=True)
        x = b.add("add", "attn_res", [x, o], ("T", d))
        h = build_norm(b, x, "layer_norm", a.name("ffn_norm", i), d, a.eps, "ffn_norm")
        f = a.ffn
        u = b.linear(h, a.name("ffn_up", i), d, f, True, node="ffn.up", transpose=True)
        u = b.add("activation", "ffn.act", [u], ("T", f), fn=a.act)
        y = b.linear(u, a.name("ffn_down", i), f, d, True, node="ffn.down", transpose=True)
        x = b.add("add", "ffn_res", [x, y], ("T", d))
    _decoder_tail(b, a, x)
    return g


def build_bert(a: Arch) -> Graph:
    if a.position_embedding_type != "absolute":
        raise ValueError("only absolute position embeddings are supported")
    g = Graph("bert", "encoder", a.config, inputs=("ids", "positions", "token_types"), n_layers=a.n_layers)
    b = GraphBuilder(g)
    d, H, hd, f = a.d_model, a.n_heads, a.head_dim, a.ffn
    x = b.add("embed", "embed", ["ids"], ("T", d), [b.tensor(a.name("embed"), (a.vocab_size, d))], kind="word")
    p = b.add("embed", "pos_embed", ["positions"], ("T", d), [b.tensor(a.name("pos_embed"), (a.max_positions, d))],
              kind="position")
    t = b.add("embed", "type_embed", ["token_types"], ("T", d),
              [b.tensor(a.name("type_embed"), (a.type_vocab_size, d))], kind="token_type")
    x = b.add("add", "embed_sum", [b.add("add", "embed_wp", [x, p], ("T", d)), t], ("T", d))
    x = build_norm(b, x, "layer_norm", a.name("embed_norm"), d, a.eps, "embed_norm")
    for i in range(a.n_layers):
        b.layer = i
        q = b.linear(x, a.name("q", i), d, d, True, node="q")
        k = b.linear(x, a.name("k", i), d, d, True, node="k")
        v = b.linear(x, a.name("v", i), d, d, True, node="v")
        ctx = build_attn(b, a, i, q, k, v, hd ** -0.5, causal=False, rope=False)
        o = b.linear(ctx, a.name("o", i), d, d, True, node="o")
        x = build_norm(b, b.add("add", "attn_res", [o, x], ("T", d)), "layer_norm", a.name("attn_out_norm", i), d,
                       a.eps, "attn_norm")
        y = build_ffn(b, x, d, f, a.act, a.name("ffn_up", i), a.name("ffn_down", i), bias=True)
        x = build_norm(b, b.add("add", "ffn_res", [y, x], ("T", d)), "layer_norm", a.name("ffn_out_norm", i), d,
                       a.eps, "ffn_norm")
    b.layer = None
    g.outputs["hidden"] = x
    first = b.add("head", "pool_first", [x], (1, d), select="first")
    pooled = b.linear(first, a.name("pooler"), d, d, True, node="pooler")
    g.outputs["pooled"] = b.add("activation", "pooler_act", [pooled], (1, d), fn="tanh")
    return g


def build_deepseek_v3(a: Arch) -> Graph:
    """DeepSeek-V3: multi-head latent attention (MLA), first_k_dense_replace dense layers, then
    MoE layers with sigmoid group-limited routing and plain (ungated) shared experts."""
    g = Graph("deepseek_v3", "decoder", a.config, inputs=("ids",), n_layers=a.n_layers)
    b = GraphBuilder(g)
    d, H = a.d_model, a.n_heads
    nope, rd, vd, r = a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim, a.kv_lora_rank
    qd = nope + rd
    x = b.add("embed", "embed", ["ids"], ("T", d), [b.tensor(a.name("embed"), (a.vocab_size, d))], kind="word")
    for i in range(a.n_layers):
        b.layer = i
        h = build_norm(b, x, "rms_norm", a.name("attn_norm", i), d, a.eps, "attn_norm")
        if a.q_lora_rank is None:
            q = b.linear(h, a.name("q", i), d, H * qd, False, node="q")  # no bias in HF either way
            kva = b.linear(h, a.name("kv_a", i), d, r + rd, a.attn_bias, node="kv_a")
        else:
            qa = b.linear(h, a.name("q_a", i), d, a.q_lora_rank, a.attn_bias, node="q_a")
            kva = b.linear(h, a.name("kv_a", i), d, r + rd, a.attn_bias, node="kv_a")
            qa = build_norm(b, qa, "rms_norm", a.name("q_a_norm", i), a.q_lora_rank, a.eps, "q_a_norm")
            q = b.linear(qa, a.name("q_b", i), a.q_lora_rank, H * qd, False, node="q_b")
        ckv, kpe = b.add("split", "kv_a_split", [kva], ("T", r), n_out=2, sizes=(r, rd))
        ckv = build_norm(b, ckv, "rms_norm", a.name("kv_a_norm", i), r, a.eps, "kv_a_norm")
        kvb = b.linear(ckv, a.name("kv_b", i), r, H * (nope + vd), False, node="kv_b")
        # per head: q = [q_nope | q_pe], kv_b = [k_nope | v]; rope on the pe parts only
        q_nope, q_pe = b.add("split", "q_split", [q], ("T", H * nope), n_out=2, sizes=(nope, rd), heads=H)
        k_nope, v = b.add("split", "kv_b_split", [kvb], ("T", H * nope), n_out=2, sizes=(nope, vd), heads=H)
        rope = dict(theta=a.rope_theta, interleave=bool(a.rope_interleave))
        q_pe = b.add("rope", "q_rope", [q_pe], ("T", H * rd), heads=H, head_dim=rd, **rope)
        kpe = b.add("rope", "k_rope", [kpe], ("T", rd), heads=1, head_dim=rd, **rope)
        q = b.add("concat", "q_cat", [q_nope, q_pe], ("T", H * qd), heads=H)
        k = b.add("concat", "k_cat", [k_nope, kpe], ("T", H * qd), heads=H, broadcast=(False, True))
        a_mla = Arch(a.family, a.config, {**a.values, "n_kv_heads": H})
        ctx = build_attn(b, a_mla, i, q, k, v, qd ** -0.5, rope=False, qk_dim=qd, v_dim=vd, n_kv=H)
        o = b.linear(ctx, a.name("o", i), H * vd, d, a.attn_bias, node="o")
        x = b.add("add", "attn_res", [x, o], ("T", d))
        h = build_norm(b, x, "rms_norm", a.name("ffn_norm", i), d, a.eps, "ffn_norm")
        if i in a.moe_layers:
            y = build_moe_ffn(b, a, i, h)
        else:
            y = build_ffn(b, h, d, a.ffn, a.act, a.name("ffn_up", i), a.name("ffn_down", i), a.name("ffn_gate", i))
        x = b.add("add", "ffn_res", [x, y], ("T", d))
    _decoder_tail(b, a, x)
    return g


BUILDERS = {"llama": build_llama, "gpt2": build_gpt2, "bert": build_bert, "deepseek_v3": build_deepseek_v3}


def build_graph(config: dict) -> Graph:
    """The model graph of a Hugging Face config (a dict, as in config.json)."""
    a = arch_from_config(config)
    g = BUILDERS[a.family.builder](a)
    g.meta["arch"] = a.values
    g.validate()
    return g

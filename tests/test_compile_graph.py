"""The model graph (cipherlm.compile) on small random-weight models of every family: the
passes (group_linears vs the traced groups, fold_norms keeps the logits), parameter
counts, the architecture table, `inspect`.  The graph executor against Hugging Face
transformers (full forward, KV-cached decode, greedy generation, float32 linears) is
tests/test_plain_decoders.py, over this module's table of families: plain mode's
`make_executor` is the graph executor."""

import numpy as np
import pytest

from _hf_oracle import build_hf, rel_err, torch_setup
from cipherlm.compile import FAMILIES, arch_from_config, bind, build_graph, linear_weights, passes
from cipherlm.compile.ir import OPS
from cipherlm.models import normalize_weights
from cipherlm.runtime.graph_executor import GraphExecutor
from cipherlm.runtime.linear_groups import RecordingLinear, groups_from_calls
from cipherlm.runtime.plain import EncoderExecutor, PlainLinear, make_executor, split_params

torch = torch_setup()
import transformers as T  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
_DSV3 = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1, initializer_range=0.1,
             max_position_embeddings=64)


def _cases():
    return {
        "llama": (T.LlamaConfig(intermediate_size=80, rope_theta=500.0, **COMMON), T.LlamaForCausalLM),
        "llama_tied_bias": (T.LlamaConfig(intermediate_size=80, tie_word_embeddings=True, attention_bias=True,
                                          mlp_bias=True, **COMMON), T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config(intermediate_size=80, **COMMON), T.Qwen2ForCausalLM),
        "mistral": (T.MistralConfig(intermediate_size=80, sliding_window=4, **COMMON), T.MistralForCausalLM),
        "gpt2": (T.GPT2Config(vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                              initializer_range=0.1), T.GPT2LMHeadModel),
        "qwen2_moe": (T.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                       **COMMON), T.Qwen2MoeForCausalLM),
        "olmoe": (T.OlmoeConfig(intermediate_size=24, num_experts=6, num_experts_per_tok=2, clip_qkv=3.0,
                                **COMMON), T.OlmoeForCausalLM),
        "mixtral": (T.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=None, **COMMON), T.MixtralForCausalLM),
        "deepseek_v3": (T.DeepseekV3Config(q_lora_rank=None, **_DSV3), T.DeepseekV3ForCausalLM),
        "deepseek_v3_qlora": (T.DeepseekV3Config(q_lora_rank=20, attention_bias=True, **_DSV3),
                              T.DeepseekV3ForCausalLM),
    }


CASES = list(_cases())


def hf_case(name: str):
    """(HF model, config dict, normalised weights) of one family of `_cases()`."""
    cfg, cls = _cases()[name]
    cfg._attn_implementation = "eager"
    model, weights = build_hf(cfg, cls, seed=CASES.index(name))
    config = cfg.to_dict()
    return model, config, normalize_weights(config, weights)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    model, config, weights = hf_case(request.param)
    graph = build_graph(config)
    params = bind(graph, weights)
    ex = GraphExecutor(graph, params, dtype=np.float64)
    return request.param, model, config, weights, ex


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def test_parameter_count_equals_the_models(case):
    name, model, _, _, ex = case
    g = ex.graph
    # every parameter and persistent buffer of the checkpoint once (a tied head shares the embedding)
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel()
    assert g.total_params() == total, name
    assert sum(g.params_per_node().values()) == total
    assert g.total_params() == sum(p.size for n, p in ex.params.items() if g.tensors[n].tied_to is None)
    assert all(n.op in OPS for n in g.nodes)
    assert g.param_count(g.nodes[0]) == 97 * 48  # the word embedding


def _trace_groups(name, config, weights):
    """groups_from_calls of the executor make_executor gives (over split_params' client
    parameters and server linears), traced with a recording backend."""
    client, server = split_params(config, weights)
    rec = RecordingLinear(PlainLinear(server, dtype=np.float64))
    ex = make_executor(config, client, rec)
    if arch_from_config(config).moe_layers:
        ex.forward(np.arange(config["vocab_size"]))  # every token: every expert is routed some rows
    else:
        ex.trace_one_token()
    return groups_from_calls(rec.calls), server


def test_group_linears_matches_the_trace(case):
    name, _, config, weights, ex = case
    traced, server = _trace_groups(name, config, weights)
    g = passes.group_linears.run(build_graph(config))
    ours = groups_from_calls(g.meta["linear_groups"])
    assert {n for grp in ours for n in grp.names} == set(server)  # the pass sees every projection
    seen = {n for grp in traced for n in grp.names}
    # a trace only sees the experts some token was routed to (all of them in most cases here)
    assert all(".experts." in n for n in set(server) - seen), name
    ours_seen = groups_from_calls([(grp.names, grp.d_in, grp.d_outs) for grp in ours if set(grp.names) <= seen])
    assert ours_seen == traced, name
    if seen == set(server):
        assert ours == traced
    assert all(n.attrs["group"] is not None for n in g.linears())


class _Recorder:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def linear(self, x, names):
        assert x.ndim == 2
        self.calls.append(tuple(names))
        return self.inner.linear(x, names)


def test_executor_calls_the_groups_in_order(case):
    """make_executor's LinearBackend calls (what a remote backend such as the offload mode's
    RemoteLinear sees) are the pass's groups, in the pass's order, each once per pass: all
    of them but the experts no token was routed to; the logits are the bound graph's."""
    name, _, config, weights, ex = case
    client, server = split_params(config, weights)
    assert linear_weights(ex.graph, ex.params).keys() == server.keys()
    rec = _Recorder(PlainLinear(server))
    ids = [7, 3, 50, 2]
    a = make_executor(config, client, rec).forward(ids)
    b = GraphExecutor(ex.graph, ex.params).forward(ids)
    groups = [names for names, _, _ in ex.graph.meta["linear_groups"]]
    index = [groups.index(c) for c in rec.calls]
    assert index == sorted(set(index)), name
    assert all(".experts." in n for i, grp in enumerate(groups) if i not in index for n in grp), name
    assert rel_err(a, b) < 1e-12


def test_run_nodes_keep_drops_values_after_their_last_read(case):
    """`GraphExecutor.run_nodes(keep=...)` (what the fhe mode's pass uses to free each
    layer's ciphertexts): only the kept values and the values no node read are left, and
    the logits are those of the walk that keeps everything."""
    name, _, _, _, ex = case
    ids = np.array([7, 3, 50, 2])
    ctx = {"pos0": 0, "T": 4, "positions": np.arange(4), "last_only": False}
    out = ex.graph.outputs["logits"]
    full = ex.run_nodes(ex.graph.nodes, {"ids": ids, "positions": np.arange(4)}, dict(ctx), ex.new_cache())
    lean = ex.run_nodes(ex.graph.nodes, {"ids": ids, "positions": np.arange(4)}, dict(ctx), ex.new_cache(),
                        keep=[out])
    read = {v for n in ex.graph.nodes for v in n.inputs}
    assert set(lean) == {v for v in full if v not in read} | {out}, name
    assert len(lean) < len(full) // 4
    assert np.array_equal(lean[out], full[out])


def test_fold_norms_keeps_the_logits(case):
    name, _, config, _, ex = case
    g, params = passes.fold_norms.run(ex.graph, ex.params)
    folded = g.meta["folded_norms"]
    a = arch_from_config(config)
    if a.family.norm == "rms_norm":
        assert len(folded) >= 2 * a.n_layers + 1  # attention and FFN norm per layer, the final norm
        assert not any("q_norm" in f or "k_norm" in f for f in folded)  # OLMoE's read by RoPE: kept
    else:
        assert folded == []
    assert all(n.attrs["gamma"] is None for n in g.nodes if n.name in folded)
    ids = [3, 17, 42, 5, 96, 0, 11]
    assert rel_err(GraphExecutor(g, params, dtype=np.float64).forward(ids), ex.forward(ids)) < 1e-6, name
    if a.tie and folded:  # the folded head did not touch the embedding
        assert params[a.name("embed")] is ex.params[a.name("embed")]
        assert g.tensors["lm_head.weight"].tied_to is None


def test_fold_norms_is_server_weights_rule():
    """The 2pc server's weights (its passes: attention scale, then fold_norms) are the rule
    written out by hand: each projection group stacked, q times 1/sqrt(hd), every input
    side of a folded RMSNorm times gamma sqrt(c) (MoE router, shared-expert gate, FFN,
    LM head)."""
    from cipherlm.runtime import twopc

    cfg, cls = _cases()["qwen2_moe"]
    _, w = build_hf(cfg, cls, seed=1)
    config = cfg.to_dict()
    w = normalize_weights(config, w)
    g0 = build_graph(config)
    params = {k: np.asarray(v, np.float64) for k, v in bind(g0, w).items()}
    sw = twopc.server_weights(config, w, fold_norms=True)
    assert sw.fold_norms
    rc = np.sqrt(twopc.rms_factor(48)[1])
    scale = 12 ** -0.5

    def gamma(name):
        return params[name][:, None] * rc

    def group(name):
        return next(sw.projs[gi] for gi, (names, _, _) in enumerate(sw.graph.meta["linear_groups"]) if name in names)

    g_in0 = gamma("model.layers.0.input_layernorm.weight")
    qkv = np.concatenate([params[f"model.layers.0.self_attn.{p}_proj.weight"].T * s
                          for p, s in (("q", scale), ("k", 1), ("v", 1))], axis=1) * g_in0
    assert np.allclose(qkv, group("model.layers.0.self_attn.q_proj").w, rtol=1e-6, atol=1e-7)
    g_post0 = gamma("model.layers.0.post_attention_layernorm.weight")
    assert np.allclose(params["model.layers.0.mlp.gate.weight"].T * g_post0, sw.moe["L0.moe"].router,
                       rtol=1e-5, atol=1e-6)
    assert np.allclose(params["model.layers.0.mlp.shared_expert_gate.weight"].T * g_post0,
                       sw.moe["L0.moe"].shared_router, rtol=1e-5, atol=1e-6)
    g_post1 = gamma("model.layers.1.post_attention_layernorm.weight")
    gu = np.concatenate([params[f"model.layers.1.mlp.{p}_proj.weight"].T for p in ("gate", "up")], axis=1) * g_post1
    assert np.allclose(gu, group("model.layers.1.mlp.gate_proj").w, rtol=1e-6, atol=1e-7)
    assert np.allclose(params["lm_head.weight"].T * gamma("model.norm.weight"), group("lm_head").w,
                       rtol=1e-6, atol=1e-7)
    # a bound nothing fits: nothing is folded
    g2, p2 = passes.fold_norms.run(g0, bind(g0, w), bound=1e-6)
    assert g2 is g0 and "folded_norms" not in g2.meta


def test_bert_matches_hf_and_the_trace():
    cfg = T.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=96, max_position_embeddings=64, initializer_range=0.1)
    cfg._attn_implementation = "eager"
    model, w = build_hf(cfg, T.BertModel, seed=5)
    config = cfg.to_dict()
    w = normalize_weights(config, w)
    g = build_graph(config)
    assert g.kind == "encoder"
    ex = GraphExecutor(g, bind(g, w), dtype=np.float64)
    ids = np.array([[2, 17, 33, 90, 5, 3, 0, 0], [2, 8, 9, 10, 11, 12, 13, 3]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    tt = np.array([[0, 0, 0, 1, 1, 1, 0, 0], [0] * 8])
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(tt))
    ref = out.last_hidden_state.double().numpy()
    hid, pooled = ex.encode(ids, mask, tt)
    assert rel_err(hid[0, :6], ref[0, :6]) < 1e-4
    assert rel_err(hid[1], ref[1]) < 1e-4
    assert rel_err(pooled, out.pooler_output.double().numpy()) < 1e-4
    h1, p1 = ex.encode(ids[0, :6], token_type_ids=tt[0, :6])  # padding does not change the sentence
    assert rel_err(h1, hid[0, :6]) < 1e-9
    assert g.total_params() == model.num_parameters()
    # projection groups: as traced from the executor make_executor gives
    client, server = split_params(config, w)
    rec = RecordingLinear(PlainLinear(server))
    EncoderExecutor(config, client, rec).trace_one_token()
    assert groups_from_calls(passes.group_linears.run(g).meta["linear_groups"]) == groups_from_calls(rec.calls)
    gf, _ = passes.fold_norms.run(g, ex.params)
    assert gf.meta["folded_norms"] == []  # post-norm LayerNorms stay (as in the 2pc executor)
    with pytest.raises(ValueError, match="encoders"):
        ex.forward([1, 2])


def test_arch_table_and_errors():
    assert {"llama", "mistral", "qwen2", "gpt2", "bert", "qwen2_moe", "olmoe", "mixtral",
            "deepseek_v3"} <= set(FAMILIES)
    with pytest.raises(ValueError, match="unsupported model_type"):
        build_graph({"model_type": "t5"})
    with pytest.raises(ValueError, match="rope type"):
        build_graph(dict(_cases()["llama"][0].to_dict(), rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    a = arch_from_config(_cases()["qwen2_moe"][0].to_dict())
    assert a.moe_layers == frozenset({0}) and a.attn_bias and a.sliding_window is None
    g = build_graph(_cases()["olmoe"][0].to_dict())
    text = g.summary()
    assert "olmoe" in text and "q_norm" in text and f"{g.total_params():,}" in text
    ops_seen = {n.op for n in g.nodes}
    assert {"embed", "linear", "rms_norm", "rope", "kv_cache", "qk", "softmax", "av", "activation", "mul", "add",
            "clip", "topk", "dispatch", "combine", "head", "argmax"} <= ops_seen


def test_cli_inspect(tmp_path, capsys):
    """`cipherlm inspect DIR` on an HF directory holding only config.json (no weights needed)."""
    import json

    from cipherlm import cli
    from cipherlm.commands import inspect_text, model_config
    from cipherlm.models import list_models
    from cipherlm.models.registry import MODELS

    cfg = _cases()["qwen2_moe"][0]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert cli.main(["inspect", str(tmp_path), "--groups"]) == 0
    out = capsys.readouterr().out
    g = build_graph(cfg.to_dict())
    assert f"{g.total_params():,} parameters" in out
    assert "L0.moe.topk" in out and "L1.q" not in out and "projection groups" in out
    assert cli.main(["inspect", str(tmp_path), "--all", "--groups"]) == 0
    out = capsys.readouterr().out
    assert "L1.q " in out
    assert "model.layers.0.mlp.shared_expert.gate_proj, model.layers.0.mlp.shared_expert.up_proj, " \
           "model.layers.0.mlp.shared_expert_gate" in out
    # the registered models: the graph's parameter count is the registry's
    for m in list_models():
        if m["available"] and m["name"] == "minilm-l6":  # an HF directory: no conversion needed
            name, config = model_config(m["name"])
            assert f"{MODELS[name].params:,} parameters" in inspect_text(config, name)


def test_registered_models_same_as_the_hand_written_executors():
    """SmolLM2-135M and MiniLM-L6 (when installed): the graph bound to the whole checkpoint
    (`GraphExecutor.from_hf`) gives make_executor's outputs (client parameters + server
    linears from split_params; same float32 linears, same float64 nonlinear parts), and the
    sampled generation of the hand-written executor this replaced (fixed ids)."""
    from cipherlm.models import list_models, load_model
    from cipherlm.runtime.plain import plain_executor

    avail = {m["name"] for m in list_models() if m["available"]}
    if not avail & {"smollm2-135m", "minilm-l6"}:
        pytest.skip("neither registered model is installed")
    if "smollm2-135m" in avail:
        lm = load_model("smollm2-135m")
        ex, gx = plain_executor(lm), GraphExecutor.from_hf(lm.config, lm.weights)
        ids = lm.tokenizer.encode("The capital of France is").ids
        assert rel_err(gx.forward(ids), ex.forward(ids)) < 1e-9
        assert gx.generate(ids, 3, eos_token_ids=[]) == ex.generate(ids, 3, eos_token_ids=[])
        # recorded from runtime/plain.py's hand-written DecoderExecutor before it was removed
        assert ex.generate(ids, 6, temperature=0.8, top_k=20, top_p=0.9, seed=3, eos_token_ids=[]) == \
            [7042, 30, 378, 3575, 282, 4649]
    if "minilm-l6" in avail:
        lm = load_model("minilm-l6")
        ex, gx = plain_executor(lm), GraphExecutor.from_hf(lm.config, lm.weights)
        ids, mask = EncoderExecutor.batch_encode(lm.tokenizer, ["a gripping, beautiful film", "dull"])
        hidden = ex.forward(ids, mask)
        h2, p2 = gx.encode(ids, mask)
        assert rel_err(h2[0], hidden[0]) < 1e-9 and rel_err(h2[1, :3], hidden[1, :3]) < 1e-9
        assert rel_err(p2, ex.pooled(hidden)) < 1e-6

"""BLB FineGrainFusion as compile passes (issue 16 item 1): `passes.blb_decompose`
(LayerNorm / RMSNorm / softmax / GeLU / SiLU split into linear pieces and nonlinear
cores, Algorithms 3-5) keeps every family's outputs in the plain executor, and
`passes.blb_fusion` (Table 2 types, Table 4 patterns) yields the 5 fused blocks per
BERT layer of Figure 10 and their equivalents for Llama and GPT-2."""

import numpy as np
import pytest

from _hf_oracle import build_hf, rel_err, torch_setup
from cipherlm.compile import bind, build_graph, passes
from cipherlm.compile.ir import OP_CLASS, OPS
from cipherlm.compile.passes import blb_decompose
from cipherlm.models import normalize_weights
from cipherlm.runtime.graph_executor import GraphExecutor, PlainBackend

torch = torch_setup()
import transformers as T  # noqa: E402

from test_compile_graph import _cases  # noqa: E402

_BERT = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64, initializer_range=0.1)
_MINILM = dict(vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, initializer_range=0.1, hidden_act="gelu")


def _bert_cases():
    return {"bert": T.BertConfig(**_BERT), "minilm": T.BertConfig(**_MINILM)}


def _model(cfg, cls, seed=3):
    cfg._attn_implementation = "eager"
    _, w = build_hf(cfg, cls, seed=seed)
    config = cfg.to_dict()
    w = normalize_weights(config, w)
    g = build_graph(config)
    return config, g, bind(g, w)


def test_new_ops_are_in_the_vocabulary():
    for op in ("reduce_sum", "reduce_max", "sub", "affine", "rsqrt", "reciprocal", "exp", "act_gate"):
        assert op in OPS and op in OP_CLASS and hasattr(PlainBackend, op)


DECODERS = ["llama", "llama_tied_bias", "gpt2", "qwen2_moe", "olmoe", "deepseek_v3"]


@pytest.mark.parametrize("name", DECODERS)
def test_decompose_keeps_decoder_outputs(name):
    cfg, cls = _cases()[name]
    config, g, p = _model(cfg, cls)
    gd = blb_decompose.run(g)
    assert not {n.op for n in gd.nodes} & {"layer_norm", "rms_norm", "softmax"}
    assert all(n.attrs.get("fn") not in blb_decompose.GATED for n in gd.nodes if n.op == "activation")
    assert gd.total_params() == g.total_params() and sum(gd.params_per_node().values()) == g.total_params()
    assert blb_decompose.run(gd) is gd
    a, b = GraphExecutor(g, p, dtype=np.float64), GraphExecutor(gd, p, dtype=np.float64)
    ids = [3, 17, 5, 60, 2, 9, 41]
    assert rel_err(b.forward(ids), a.forward(ids)) < 1e-12
    # KV-cached decoding and greedy generation on the decomposed graph
    assert b.generate(ids[:4], 4, eos_token_ids=[]) == a.generate(ids[:4], 4, eos_token_ids=[])


def test_decompose_after_fold_norms_and_attention_scale():
    cfg, cls = _cases()["llama"]
    config, g, p = _model(cfg, cls)
    g2, p2 = passes.fold_norms.run(g, p)
    g2, p2 = passes.fold_attention_scale.run(g2, p2)
    gd = blb_decompose.run(g2)
    # folded RMSNorms have no affine piece left: the norm ends with x * rsqrt
    assert gd.node("L0.attn_norm").op == "mul" and gd.node("L0.ffn_norm").op == "mul"
    ids = [3, 17, 5, 60]
    ref = GraphExecutor(g2, p2, dtype=np.float64).forward(ids)  # the folded weights: float32 again
    assert rel_err(GraphExecutor(gd, p2, dtype=np.float64).forward(ids), ref) < 1e-12


@pytest.mark.parametrize("name", ["bert", "minilm"])
def test_decompose_keeps_encoder_outputs(name):
    config, g, p = _model(_bert_cases()[name], T.BertModel)
    gd = blb_decompose.run(g)
    ids = np.array([[2, 17, 33, 90, 5, 3, 0, 0], [2, 8, 9, 10, 11, 12, 13, 3]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    tt = np.array([[0, 0, 0, 1, 1, 1, 0, 0], [0] * 8])
    h0, p0 = GraphExecutor(g, p, dtype=np.float64).encode(ids, mask, tt)
    h1, p1 = GraphExecutor(gd, p, dtype=np.float64).encode(ids, mask, tt)
    assert rel_err(h1[0, :6], h0[0, :6]) < 1e-12 and rel_err(h1[1], h0[1]) < 1e-12
    assert rel_err(p1, p0) < 1e-12
    # Algorithm 3 / 5 / 4 shapes: LayerNorm 7 pieces, softmax 7 + squarings, GeLU 2
    ln = [n for n in gd.nodes if n.attrs.get("blb_from") == ("layer_norm", "L0.attn_norm")]
    assert [n.op for n in ln] == ["reduce_sum", "sub", "mul", "reduce_sum", "rsqrt", "mul", "affine"]
    sm = [n.op for n in gd.nodes if n.attrs.get("blb_from") == ("softmax", "L0.softmax")]
    assert sm == ["reduce_max", "sub", "exp"] + ["mul"] * blb_decompose.EXP_SQUARINGS + \
        ["reduce_sum", "reciprocal", "mul"]
    assert [n.op for n in gd.nodes if n.attrs.get("blb_from") == ("activation", "L0.ffn.act")] == ["act_gate", "mul"]


def test_exp_squarings_are_exact_for_any_n():
    cfg, cls = _cases()["gpt2"]
    config, g, p = _model(cfg, cls)
    ids = [1, 2, 3, 4, 5]
    ref = GraphExecutor(g, p, dtype=np.float64).forward(ids)
    for n in (0, 3, 9):
        gd = blb_decompose.run(g, exp_squarings=n)
        assert rel_err(GraphExecutor(gd, p, dtype=np.float64).forward(ids), ref) < 1e-11

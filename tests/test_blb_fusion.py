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
    for op in ("reduce_sum", "reduce_max", "sub", "affine", "rsqrt", "reciprocal", "exp", "act_gate", "act_clamp",
               "poly", "clip_min"):
        assert op in OPS and op in OP_CLASS and hasattr(PlainBackend, op)


DECODERS = ["llama", "llama_tied_bias", "gpt2", "qwen2_moe", "olmoe", "deepseek_v3"]


@pytest.mark.parametrize("name", DECODERS)
def test_decompose_keeps_decoder_outputs(name):
    cfg, cls = _cases()[name]
    _, g, p = _model(cfg, cls)
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
    _, g, p = _model(cfg, cls)
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
    _, g, p = _model(_bert_cases()[name], T.BertModel)
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
    _, g, p = _model(cfg, cls)
    ids = [1, 2, 3, 4, 5]
    ref = GraphExecutor(g, p, dtype=np.float64).forward(ids)
    for n in (0, 3, 9):
        gd = blb_decompose.run(g, exp_squarings=n)
        assert rel_err(GraphExecutor(gd, p, dtype=np.float64).forward(ids), ref) < 1e-11


# ----------------------------------------------------------------------------- fusion

from cipherlm.compile.passes import blb_fusion  # noqa: E402

_BERT_BLOCKS = [  # Figure 10: (pieces that must be in the block, MPC core before, core after)
    ({"q", "k", "v", "qk"}, "rsqrt", "max"),
    ({"softmax.sq1", "softmax.sum"}, "exp", "reciprocal"),
    ({"softmax", "av", "o", "attn_res", "attn_norm.mean", "attn_norm.center", "attn_norm.square",
      "attn_norm.sumsq"}, "reciprocal", "rsqrt"),
    ({"attn_norm.norm", "attn_norm", "ffn.up"}, "rsqrt", "Phi (gelu gate)"),
    ({"ffn.act", "ffn.down", "ffn_res", "ffn_norm.mean", "ffn_norm.sumsq"}, "Phi (gelu gate)", "rsqrt"),
]


def _layer_blocks(g, i):
    return [b for b in g.meta["blb_blocks"] if b["layer"] == i]


def _check_invariants(g):
    blocks = g.meta["blb_blocks"]
    in_block = {n for b in blocks for n in b["nodes"]}
    for n in g.nodes:
        assert n.attrs["blb_class"] in blb_fusion.LINEAR + (blb_fusion.NONLINEAR,)
        assert (n.attrs["blb_block"] is not None) == (n.name in in_block)
        if n.attrs["blb_class"] == blb_fusion.NONLINEAR:
            assert n.attrs["blb_block"] is None  # the cores stay in MPC
        if n.op in ("linear", "qk", "av", "mul"):
            assert n.attrs["blb_block"] is not None  # every product is in an HE block
    for b in blocks:
        assert all(g.node(x).attrs["blb_block"] == b["id"] for x in b["nodes"])
        assert all(p["fused"] in blb_fusion.LINEAR for p in b["patterns"])  # a Table 4 cell with a type
        assert b["packing"]["layout"] == "spatial-first"
        for s in b["packing"]["rotate_and_sum"]:
            if isinstance(s["length"], int):
                assert s["rotations"] == int(np.ceil(np.log2(s["length"])))
            else:  # softmax's row sum: over the key positions S, known at run time
                assert s["length"] == "S" and s["rotations"] is None
    assert not g.meta["blb_cuts"]


@pytest.mark.parametrize("name", ["bert", "minilm"])
def test_bert_layers_have_the_five_blocks_of_figure_10(name):
    cfg = _bert_cases()[name]
    _, g0, p = _model(cfg, T.BertModel)
    g = blb_fusion.run(g0)
    _check_invariants(g)
    per = blb_fusion.blocks_by_layer(g)
    assert sorted(k for k in per if k is not None) == list(range(cfg.num_hidden_layers))
    for i in range(cfg.num_hidden_layers):
        blocks = _layer_blocks(g, i)
        assert len(blocks) == 5
        for b, (must, before, after) in zip(blocks, _BERT_BLOCKS):
            short = {x[len(f"L{i}."):] for x in b["nodes"] if x.startswith(f"L{i}.")}
            assert must <= short, (i, b["ops"])
            assert b["mpc_in_cores"] == [before] and b["mpc_out_cores"] == [after], b
        # the norm before the layer opens its first block (embeddings' LN for layer 0)
        prev = "embed_norm" if i == 0 else f"L{i - 1}.ffn_norm"
        assert {f"{prev}.norm", prev} <= set(blocks[0]["nodes"])
        assert [b["depth"] for b in blocks] == [3, 6, 5, 2, 4]
        assert [len(b["packing"]["rotate_and_sum"]) for b in blocks] == [0, 1, 2, 0, 2]
        assert blocks[0]["folded"] == [prev]  # gamma / beta into Q, K, V (h itself is still made: residual)
        assert blocks[0]["products"] == {"ct_pt": 3, "ct_ct_matmul": 1, "ct_ct_elementwise": 1}
        # the 6 nonlinear cores of a BERT layer stay in MPC; softmax's s - max is local
        cores = sorted(c["core"] for c in g.meta["blb_mpc"] if c["layer"] == i)
        assert cores == sorted(["max", "exp", "reciprocal", "rsqrt", "rsqrt", "Phi (gelu gate)"])
        assert [x["nodes"] for x in g.meta["blb_local"] if x["layer"] == i] == [[f"L{i}.softmax.shift"]]
    roles = [b["role"] for b in per[None]]
    assert roles == ["prologue", "epilogue"]  # embeddings + LN statistics; last LN scaling + pooler
    # the fused graph is the decomposed graph with attributes: same outputs
    ids = np.array([[2, 17, 33, 90, 5, 3]])
    h0, q0 = GraphExecutor(g0, p, dtype=np.float64).encode(ids)
    h1, q1 = GraphExecutor(g, p, dtype=np.float64).encode(ids)
    assert rel_err(h1, h0) < 1e-12 and rel_err(q1, q0) < 1e-12


@pytest.mark.parametrize("name", ["llama", "llama_tied_bias", "qwen2", "gpt2"])
def test_decoder_layers_have_five_blocks(name):
    cfg, cls = _cases()[name]
    _, g0, p = _model(cfg, cls)
    g = blb_fusion.run(g0)
    _check_invariants(g)
    gelu = name == "gpt2"
    gate = "tanh (gelu gate)" if gelu else "sigmoid"
    for i in range(cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else cfg.n_layer):
        blocks = _layer_blocks(g, i)
        assert len(blocks) == 5, [b["ops"] for b in blocks]
        short = [{x[len(f"L{i}."):] for x in b["nodes"] if x.startswith(f"L{i}.")} for b in blocks]
        assert ({"qkv", "qk"} if gelu else {"q", "k", "v", "q_rope", "k_rope", "kv", "qk"}) <= short[0]
        assert {"softmax.sq1", "softmax.sum"} == short[1] - {f"softmax.sq{k}" for k in range(2, 7)}
        assert {"softmax", "av", "o", "attn_res", "ffn_norm.square", "ffn_norm.sumsq"} <= short[2]
        assert ({"ffn.up"} if gelu else {"ffn.gate", "ffn.up"}) <= short[3]
        assert ({"ffn.act", "ffn.down", "ffn_res"} if gelu else {"ffn.act", "ffn.mul", "ffn.down", "ffn_res"}) \
            <= short[4]
        assert [b["mpc_out_cores"] for b in blocks] == [["max"], ["reciprocal"], ["rsqrt"], [gate], ["rsqrt"]]
        if not gelu:
            assert blocks[0]["depth"] == 4  # x * rsqrt, the projection, RoPE's cos / sin, Q K^T
            assert blocks[4]["products"]["ct_ct_elementwise"] == 3  # gate * sigmoid, * up, the next x * x
    epi = [b for b in g.meta["blb_blocks"] if b["role"] == "epilogue"]
    assert len(epi) == 1 and epi[0]["mpc_out_cores"] == ["argmax"] and "lm_head" in epi[0]["nodes"]
    ids = [3, 17, 5, 60]
    assert rel_err(GraphExecutor(g, p, dtype=np.float64).forward(ids),
                   GraphExecutor(g0, p, dtype=np.float64).forward(ids)) < 1e-12


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_whole_activation_is_one_core(name):
    """``activation="whole"``: GeLU / SiLU stay one MPC core, the
    FFN-out block reads its output (SiLU's act * up still fused there) and is one level
    shallower; the graph computes the same function."""
    cfg, cls = _cases()[name]
    _, g0, p = _model(cfg, cls)
    gate, whole = blb_fusion.run(g0), blb_fusion.run(g0, activation="whole")
    _check_invariants(whole)
    assert whole.meta["blb_activation"] == "whole" and gate.meta["blb_activation"] == "gate"
    assert not any(n.op == "act_gate" for n in whole.nodes)
    act = "gelu_tanh" if name == "gpt2" else "silu"
    for i in range(2):
        wb, gb = _layer_blocks(whole, i), _layer_blocks(gate, i)
        assert len(wb) == 5 and [b["mpc_out_cores"] for b in wb] == [["max"], ["reciprocal"], ["rsqrt"], [act],
                                                                    ["rsqrt"]]
        short = {x[len(f"L{i}."):] for x in wb[4]["nodes"] if x.startswith(f"L{i}.")}
        assert "ffn.act" not in short and ({"ffn.down"} if name == "gpt2" else {"ffn.mul", "ffn.down"}) <= short
        assert wb[4]["depth"] == gb[4]["depth"] - 1
        assert [b["nodes"] for b in wb[:4]] == [b["nodes"] for b in gb[:4]]
    ids = [3, 17, 5, 60]
    assert rel_err(GraphExecutor(whole, p, dtype=np.float64).forward(ids),
                   GraphExecutor(g0, p, dtype=np.float64).forward(ids)) < 1e-12
    with pytest.raises(ValueError, match="activation"):
        blb_fusion.run(g0, activation="half")
    with pytest.raises(ValueError, match="decomposed with"):
        blb_fusion.run(blb_decompose.run(g0), activation="whole")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_poly_activation_puts_the_polynomial_in_the_ffn_block(name):
    """``activation="poly"``: GeLU (GPT-2's tanh form) becomes act_clamp (one MPC core, two
    outputs) -> poly -> add, the polynomial and the sum in the FFN-down block, which is
    2 levels deeper than with the whole activation (a monic quartic: two squares and one
    product, `monic_factors`); SiLU (Llama) stays
    whole.  The graph computes GeLU's clamped form: within its fit (1.8e-3 absolute per
    activation) of the original, not exactly."""
    cfg, cls = _cases()[name]
    _, g0, p = _model(cfg, cls)
    poly, whole = blb_fusion.run(g0, activation="poly"), blb_fusion.run(g0, activation="whole")
    _check_invariants(poly)
    ids = [3, 17, 5, 60]
    ref = GraphExecutor(g0, p, dtype=np.float64).forward(ids)
    got = GraphExecutor(poly, p, dtype=np.float64).forward(ids)
    if name == "llama":
        assert not any(n.op in ("act_clamp", "poly") for n in poly.nodes)
        assert [b["nodes"] for b in poly.meta["blb_blocks"]] == [b["nodes"] for b in whole.meta["blb_blocks"]]
        assert rel_err(got, ref) < 1e-12
        return
    assert [blb_fusion.poly_depth(c) for c in ((1, 2, 3, 4, 5), (1, 2, 3), (1, 2), (1, 2, 3, 4, 1),
                                                 (1, 2, 1), (1, 1))] == [3, 2, 1, 2, 1, 0]
    for i in range(2):
        pb, wb = _layer_blocks(poly, i), _layer_blocks(whole, i)
        assert [b["mpc_out_cores"] for b in pb][3] == ["gelu_tanh clamp"]
        ops = [poly.node(x).op for x in pb[4]["nodes"]]
        assert ops[:2] == ["poly", "add"] and "linear" in ops
        assert {x["value"] for x in pb[4]["inputs"]} >= {f"L{i}.ffn.act.clamp.lin", f"L{i}.ffn.act.clamp.ac"}
        assert pb[4]["depth"] == wb[4]["depth"] + 2
        assert [b["nodes"] for b in pb[:4]] == [b["nodes"] for b in wb[:4]]
    assert 0 < rel_err(got, ref) < 2e-2


def test_poly_exp_puts_the_polynomial_before_the_squarings():
    """``exp="poly"``: the softmax's exp core becomes clip_min (MPC: max(s - max, -16)) and a
    cubic on the clipped value in the squarings' block (3 levels: not monic, its 1 / 2^n is in
    the coefficients); the graph computes exp(z / 64)^64 with that cubic (relative fit 2^-19,
    times 64 after the squarings) instead of exp; fewer than 5 squarings are refused (the
    cubic's range)."""
    _, g0, p = _model(_bert_cases()["bert"], T.BertModel)
    g, core = blb_fusion.run(g0, exp="poly"), blb_fusion.run(g0)
    _check_invariants(g)
    assert g.meta["blb_exp"] == "poly" and core.meta["blb_exp"] == "core"
    sm = [n.op for n in g.nodes if n.attrs.get("blb_from") == ("softmax", "L0.softmax")]
    assert sm == ["reduce_max", "sub", "clip_min", "poly"] + ["mul"] * blb_decompose.EXP_SQUARINGS + \
        ["reduce_sum", "reciprocal", "mul"]
    b2, c2 = _layer_blocks(g, 0)[1], _layer_blocks(core, 0)[1]
    assert b2["depth"] == c2["depth"] + 3 and b2["mpc_in_cores"] == ["exp clip"]
    c = g.node("L0.softmax.exp").attrs["coeffs"]
    z = np.linspace(-16.0, 0.0, 4001)
    rel = np.abs(np.polyval(np.asarray(c)[::-1], z) ** 64 / np.exp(z) - 1)
    assert rel.max() <= 64 * 2.0 ** -19 * 1.01, rel.max()
    ids = np.array([[2, 17, 33, 90, 5, 3, 0, 0]])
    h0, _ = GraphExecutor(g0, p, dtype=np.float64).encode(ids, np.ones_like(ids), np.zeros_like(ids))
    h1, _ = GraphExecutor(g, p, dtype=np.float64).encode(ids, np.ones_like(ids), np.zeros_like(ids))
    assert 0 < rel_err(h1, h0) < 1e-3
    with pytest.raises(ValueError, match="squarings"):
        blb_fusion.run(g0, exp="poly", exp_squarings=4)
    with pytest.raises(ValueError, match="exp"):
        blb_fusion.run(g0, exp="half")
    with pytest.raises(ValueError, match="decomposed with exp"):
        blb_fusion.run(blb_decompose.run(g0), exp="poly")


@pytest.mark.parametrize("coeffs", [(0.3, -2.0, 0.5, 1.0, 1.0), (1.2e-3, -0.0956, 3.7259, -3.3289, 1.0),
                                    (-6.0, 11.0, -6.0, 1.0), (2.0, 1.0, 1.0, 1.0), (-1.0, 0.0, 1.0), (0.5, 1.0)])
def test_monic_factors_against_numpy(coeffs):
    """(z + H)^2 + K and z + H factors multiply back to the polynomial (complex and real roots)."""
    z = np.linspace(-3.0, 3.0, 1001)
    got = np.ones_like(z)
    for h, k in blb_fusion.monic_factors(coeffs):
        got = got * ((z + h) ** 2 + k if k is not None else z + h)
    assert np.abs(got - np.polyval(np.asarray(coeffs)[::-1], z)).max() <= 1e-9
    assert blb_fusion.monic_factors((1.0, 2.0)) is None  # not monic
    assert blb_fusion.monic_factors((1.0, 2.0, 0.5)) is None and blb_fusion.monic_factors((1.0,) * 6) is None


def test_fold_norms_then_fusion():
    cfg, cls = _cases()["llama"]
    _, g0, p = _model(cfg, cls)
    gf, _ = passes.fold_norms.run(g0, p)
    g = blb_fusion.run(gf)
    _check_invariants(g)
    b0 = _layer_blocks(g, 0)
    assert len(b0) == 5 and b0[0]["folded"] == [] and "L0.attn_norm" in b0[0]["nodes"]
    assert b0[0]["depth"] == 4


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe", "deepseek_v3", "mistral"])
def test_fusion_runs_on_every_family(name):
    cfg, _ = _cases()[name]
    g = blb_fusion.run(build_graph(cfg.to_dict()))
    _check_invariants(g)
    # an MoE expert's gate and up read the dispatched rows once: one block
    for b in g.meta["blb_blocks"]:
        gates = [x for x in b["nodes"] if x.endswith(".gate") and ".e" in x]
        for x in gates:
            assert x[: -len("gate")] + "up" in b["nodes"]


def test_table4_and_classes():
    T4 = blb_fusion.TABLE4
    for k in blb_fusion.LINEAR:  # Identity fuses with anything and keeps the other's type
        assert T4[(blb_fusion.IDENTITY, k)] == k and T4[(k, blb_fusion.IDENTITY)] == k
    assert T4[("reduction", "expansion")] == "identity" and T4[("expansion", "reduction")] == "identity"
    assert T4[("transformation", "reduction")] == "reduction"
    assert T4[("transformation", "transformation")] == "transformation"
    assert T4[("expansion", "transformation")] == "expansion"
    cfg, _ = _cases()["gpt2"]
    g = blb_fusion.run(build_graph(cfg.to_dict()))
    c = {n.name: n.attrs["blb_class"] for n in g.nodes}
    assert c["L0.attn_norm.mean"] == "reduction" and c["L0.attn_norm.center"] == "expansion"
    assert c["L0.attn_norm.square"] == "identity" and c["L0.attn_norm.rsqrt"] == "nonlinear"
    assert c["L0.qkv"] == c["L0.qk"] == c["L0.av"] == "transformation"
    assert c["L0.softmax"] == "expansion" and c["L0.softmax.exp"] == "nonlinear" and c["embed"] == "nonlinear"
    text = blb_fusion.format_blocks(g)
    assert "5 per layer" in text and "L0" in text and "prologue" in text and "epilogue" in text


def test_cli_inspect_fusion_blb(tmp_path, capsys):
    import json

    from cipherlm import cli

    (tmp_path / "config.json").write_text(json.dumps(_bert_cases()["minilm"].to_dict()))
    assert cli.main(["inspect", str(tmp_path), "--fusion", "blb"]) == 0
    out = capsys.readouterr().out
    assert "BLB fused blocks" in out and "5 per layer" in out and "gelu clamp -> rsqrt" in out  # the plan's default split
    assert "layers 1..2: the same blocks" in out
    assert "CKKS parameters per block" in out and "  16384 " in out
    assert "attention packing at 16 tokens: fused" in out  # (inspect's default tokens) section 5's converts less
    assert cli.main(["inspect", str(tmp_path), "--fusion", "blb", "--tokens", "2"]) == 0
    assert "attention packing at 2 tokens: rows" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path), "--fusion", "blb", "--all"]) == 0
    blocks, params = capsys.readouterr().out.split("CKKS parameters per block")
    assert sum(" L2 " in line for line in blocks.splitlines()) == 5
    assert sum(" L2 " in line for line in params.splitlines()) == 5  # one parameter set per block
    assert cli.main(["inspect", str(tmp_path)]) == 0
    assert "BLB fused blocks" not in capsys.readouterr().out


@pytest.mark.parametrize("T_,d", [(4, 6), (3, 8), (5, 1), (2, 768)])
def test_rotate_and_sum_packing_against_numpy(T_, d):
    """Figure 6 / Table 3 in numpy: spatial-first packing, log2 d rotations for a row sum,
    the sum left broadcast along the row, so LayerNorm's x - mean and x * rsqrt keep the
    packing with no mask and no further rotation."""
    rng = np.random.default_rng(d)
    x = rng.normal(size=(T_, d))
    v = blb_fusion.pack_spatial_first(x)
    w = v.size // T_
    assert w >= d and w & (w - 1) == 0
    s, rots = blb_fusion.rotate_and_sum(v, T_)
    assert rots == max(0, int(np.ceil(np.log2(d))))
    full = np.broadcast_to(x.sum(axis=1)[:, None], (T_, w))  # every column slot: the row sum
    assert np.allclose(s, full.T.reshape(-1))
    # fused Reduction -> Expansion (Figure 6): x - mean in the same packing, no mask when the
    # row fills its slots (a power of two: the columns one ciphertext holds); a padded row
    # needs one mask product to keep its padding at zero
    want = blb_fusion.pack_spatial_first(x - x.mean(axis=1, keepdims=True))
    if w == d:
        assert np.allclose(v - s / d, want)
    else:
        assert not np.allclose(v - s / d, want)
        assert np.allclose((v - s / d) * blb_fusion.pack_spatial_first(np.ones_like(x)), want)


def test_registered_models_decomposed_and_fused():
    """MiniLM-L6 and SmolLM2-135M with their real weights (when installed): the fused
    (decomposed) graph gives the original graph's outputs; 5 HE blocks per layer."""
    from cipherlm.models import list_models, load_model

    avail = {m["name"] for m in list_models() if m["available"]}
    if not avail & {"minilm-l6", "smollm2-135m"}:
        pytest.skip("no registered model installed")
    for name in sorted(avail & {"minilm-l6", "smollm2-135m"}):
        lm = load_model(name)
        g0 = build_graph(lm.config)
        p = bind(g0, lm.weights)
        g = blb_fusion.run(g0)
        assert all(len(_layer_blocks(g, i)) == 5 for i in range(g.n_layers))
        a, b = GraphExecutor(g0, p), GraphExecutor(g, p)
        assert a.layer_io(1) == b.layer_io(1)
        if g.kind == "encoder":
            from cipherlm.runtime.plain import EncoderExecutor

            ids, mask = EncoderExecutor.batch_encode(lm.tokenizer, ["a gripping, beautiful film", "dull"])
            h0, q0 = a.encode(ids, mask)
            h1, q1 = b.encode(ids, mask)
            assert rel_err(h1, h0) < 1e-9 and rel_err(q1, q0) < 1e-9
        else:
            ids = lm.tokenizer.encode("The capital of France is").ids
            assert rel_err(b.forward(ids), a.forward(ids)) < 1e-9

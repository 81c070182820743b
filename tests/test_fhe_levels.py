"""`cipherlm.compile.passes.fhe_levels`: CKKS depth per node, the level of every value and the
greedy bootstrap placement (AEGIS sections 2.1, 2.4), checked on hand-traced examples and on
the graphs of a Llama, BERT (MiniLM-L6's shape) and GPT-2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cipherlm.compile import build_graph
from cipherlm.compile.ir import Graph, Node
from cipherlm.compile.passes import fhe_levels
from cipherlm.fhe.approx import (
    NEWTON_LEVELS,
    Approx,
    chebyshev_levels,
    default_approximations,
)


def _fake(op: str, degree: int, steps: int = 0) -> Approx:
    """An approximation on [-1, 1] of known depth (values unused by the pass)."""
    lo, hi = (0.5, 2.0) if op in ("inv", "rsqrt") else (-1.0, 1.0)
    depth = chebyshev_levels(degree, (lo, hi)) + steps * NEWTON_LEVELS.get(op, 0)
    return Approx(op, lo, hi, degree, (0.0,) * (degree + 1), steps, depth, 0.0, 0.0)


#: depth 2 each for the activations and exp ([-1, 1], degree 3); inv and rsqrt on
#: [0.5, 2]: degree 1 -> 1 + 1 = 2 levels
SMALL = {op: _fake(op, 3) for op in ("gelu", "silu", "tanh", "exp")} | {op: _fake(op, 1) for op in ("inv", "rsqrt")}

LLAMA1 = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
LLAMA = dict(LLAMA1, num_hidden_layers=2)
MINILM = dict(model_type="bert", vocab_size=30522, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
              num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
              hidden_act="gelu")
GPT2 = dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
            layer_norm_epsilon=1e-5, activation_function="gelu_new")


def _chain() -> Graph:
    """embed -> lin1 -> lin2 -> act (silu, depth 2) -> lin3 -> lin4."""
    nodes = [Node("embed", "embed", ("ids",), ("e",))]
    prev = "e"
    for name, op, attrs in (("lin1", "linear", {}), ("lin2", "linear", {}), ("act", "activation", {"fn": "silu"}),
                            ("lin3", "linear", {}), ("lin4", "linear", {})):
        nodes.append(Node(op, name, (prev,), (name,), attrs=attrs, layer=0))
        prev = name
    return Graph("test", "decoder", {}, nodes, {}, ("ids",), {"hidden": prev}, n_layers=1)


def test_chain_with_three_levels():
    """L = 3: e 3 -> lin1 2 -> lin2 1 -> act needs 2 > 1: bootstrap lin2 -> 3 - 2 = 1 -> lin3 0
    -> lin4 needs 1 > 0: bootstrap lin3 -> 2."""
    g = fhe_levels.run(_chain(), levels=3, approximations=SMALL)
    s = g.meta["fhe_levels"]
    lv = {n.name: (n.attrs["fhe"]["level_in"], n.attrs["fhe"]["level_out"]) for n in g.nodes}
    assert lv == {"embed": (3, 3), "lin1": (3, 2), "lin2": (2, 1), "act": (3, 1), "lin3": (1, 0), "lin4": (3, 2)}
    assert [(b["before"], b["value"], b["level"]) for b in s["bootstrap_points"]] == [("act", "lin2", 1),
                                                                                     ("lin4", "lin3", 0)]
    assert s["bootstraps"] == 2 and s["min_level"] == 0 and s["output_levels"] == {"hidden": 2}
    assert s["blocks"][1]["bootstraps"] == 2 and s["blocks"][1]["depth"] == 6
    # with enough levels: none
    s9 = fhe_levels.run(_chain(), levels=9, approximations=SMALL).meta["fhe_levels"]
    assert s9["bootstraps"] == 0 and s9["output_levels"] == {"hidden": 3}


def test_stage_deeper_than_a_bootstrap_is_an_error():
    with pytest.raises(ValueError, match="more than a bootstrap gives"):
        fhe_levels.run(_chain(), levels=3, approximations={"silu": _fake("silu", 15)})  # 4 levels


def test_one_llama_layer_by_hand():
    """L = 4, every approximation 2 levels (SMALL); traced by hand:
    attn_norm: 4 -square-> 3 -rsqrt-> 1 -scale-> 0; q/k/v read 0: bootstrap attn_norm (1);
    q, k, v 3; rope 2; kv 2; qk 1; softmax: exp needs 2 > 1: bootstrap qk (2), 2, inv 0,
    normalize needs 1: bootstrap (3), 3; av min(3, 2) -> 1; o 0; attn_res min(4, 0) = 0;
    ffn_norm: square needs 1: bootstrap attn_res (4), 3 -> 1 -> 0; gate/up read 0: bootstrap
    ffn_norm (5), 3; act 1; mul min(1, 3) -> 0; down: bootstrap mul (6), 3; ffn_res 3.
    head: out_norm 3 -> 2 -> 0, scale needs 1: bootstrap (7) -> 3; lm_head 2."""
    g = fhe_levels.run(build_graph(LLAMA1), levels=4, approximations=SMALL)
    s = g.meta["fhe_levels"]
    pts = [(b["before"], b["stage"]) for b in s["bootstrap_points"]]
    assert pts == [("L0.q", "input"), ("L0.softmax", "input"), ("L0.softmax", "softmax.normalize"),
                   ("L0.ffn_norm", "input"), ("L0.ffn.gate", "input"), ("L0.ffn.down", "input"),
                   ("out_norm", "norm.scale")]
    blocks = {b["block"]: b for b in s["blocks"]}
    assert blocks["layer 0"]["bootstraps"] == 6 and blocks["head"]["bootstraps"] == 1
    assert g.node("L0.ffn_res").attrs["fhe"]["level_out"] == 3 and s["output_levels"]["logits"] == 2
    # the critical path of the layer, by hand: norm 1 + 2 + 1 (twice); attention q 1, rope 1,
    # qk 1, softmax 2 + 2 + 1, av 1, o 1; ffn gate 1, act 2, mul 1, down 1
    assert blocks["layer 0"]["levels"] == {"attention": 10, "ffn": 5, "norm": 8, "residual": 0, "other": 0}
    assert blocks["layer 0"]["depth"] == 23


def test_per_layer_levels_with_the_default_approximations():
    ap = default_approximations()
    g = fhe_levels.run(build_graph(LLAMA), levels=9)
    s = g.meta["fhe_levels"]
    for b in s["blocks"]:
        if b["layer"] is None:
            continue
        norm = 2 * (1 + ap["rsqrt"].depth + 1)
        attn = 5 + ap["exp"].depth + ap["inv"].depth + 1
        ffn = 3 + ap["silu"].depth
        assert b["levels"] == {"attention": attn, "ffn": ffn, "norm": norm, "residual": 0, "other": 0}
        assert b["depth"] == norm + attn + ffn
        assert b["bootstraps"] >= b["depth"] // 9   # at most 9 levels between two bootstraps
    assert s["approximations"]["rsqrt"]["depth"] == ap["rsqrt"].depth


@pytest.mark.parametrize("config", [LLAMA, MINILM, GPT2], ids=["llama", "minilm", "gpt2"])
@pytest.mark.parametrize("levels", [7, 9, 14])
def test_levels_never_below_zero(config, levels):
    graph = build_graph(config)
    g = fhe_levels.run(graph, levels=levels)
    s = g.meta["fhe_levels"]
    assert all("fhe" not in n.attrs for n in graph.nodes)   # the input graph is left as it was
    for n in g.nodes:
        f = n.attrs["fhe"]
        if not any(b != "input" and b not in n.inputs for b in f["bootstraps"]):  # no bootstrap inside
            assert f["level_out"] == f["level_in"] - f["depth"], n.name
        assert 0 <= f["level_out"] <= levels and 0 <= f["level_in"] <= levels
        assert f["depth"] == sum(d for _, d in f["stages"])
    assert s["min_level"] >= 0 and s["bootstraps"] == len(s["bootstrap_points"]) > 0
    assert sum(b["bootstraps"] for b in s["blocks"]) == s["bootstraps"]
    n_layers = graph.n_layers
    assert [b["layer"] for b in s["blocks"] if b["layer"] is not None] == list(range(n_layers))
    # more levels per bootstrap, no more bootstraps
    if levels < 14:
        assert fhe_levels.run(graph, levels=14).meta["fhe_levels"]["bootstraps"] <= s["bootstraps"]
    assert s["unsupported"] == []   # BERT's pooler tanh included
    text = fhe_levels.format_summary(s)
    assert "layer 0" in text and f"{s['bootstraps']} bootstraps" in text


def test_cli_inspect_fhe(tiny_llama_dir, capsys, tmp_path):
    from cipherlm import cli

    out_json = tmp_path / "fhe.json"
    assert cli.main(["inspect", tiny_llama_dir, "--mode", "fhe", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    s = fhe_levels.run(build_graph(config), levels=9).meta["fhe_levels"]
    assert f"{s['bootstraps']} bootstraps" in text and "top level L = 9" in text
    for block in ("embed", "layer 0", "layer 1", "head"):
        assert f"  {block:<10} " in text
    for op in ("silu", "exp", "inv", "rsqrt"):
        assert f"  {op:<6} [" in text
    doc = json.loads(out_json.read_text())
    assert doc["mode"] == "fhe" and doc["fhe_levels"]["bootstraps"] == s["bootstraps"]
    # fewer levels per bootstrap: more bootstraps
    assert cli.main(["inspect", tiny_llama_dir, "--mode", "fhe", "--fhe-levels", "14"]) == 0
    s14 = fhe_levels.run(build_graph(config), levels=14).meta["fhe_levels"]
    assert s14["bootstraps"] < s["bootstraps"]
    assert f"{s14['bootstraps']} bootstraps" in capsys.readouterr().out


def test_per_node_approximation_overrides_the_kind():
    """The chain at L = 3 with act's own silu of depth 1 (degree 1 on [-1, 1]): act runs at
    level 1 without a bootstrap; lin3 then reads 0 and is bootstrapped: one bootstrap."""
    g = fhe_levels.run(_chain(), levels=3, approximations=SMALL, per_node={"act": {"silu": _fake("silu", 1)}})
    s = g.meta["fhe_levels"]
    assert g.node("act").attrs["fhe"]["depth"] == 1
    assert [(b["before"], b["value"]) for b in s["bootstrap_points"]] == [("lin3", "act")]
    assert s["output_levels"] == {"hidden": 1}

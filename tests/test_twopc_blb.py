"""BLB in the 2pc mode (issue 16, `runtime.twopc_blb`): a tiny BERT's forward with its fused
blocks evaluated in CKKS by the server between Algorithm 2 / Algorithm 1 conversions and the
nonlinear cores on shares, against the plaintext executor; the walk order; the client's
checks on the server's headers."""

import numpy as np
import pytest

from _hf_oracle import build_hf, torch_setup
from cipherlm.compile import bind, build_graph
from cipherlm.compile.passes import blb_fusion
from cipherlm.models import normalize_weights
from cipherlm.mpc.runner import run_inprocess
from cipherlm.runtime import twopc
from cipherlm.runtime.graph_executor import GraphExecutor

torch = torch_setup()
import transformers as T  # noqa: E402

lattigo = pytest.importorskip("cipherlm.he.lattigo_backend")
from cipherlm.runtime import twopc_blb  # noqa: E402
from cipherlm.runtime.twopc_executors import make_twopc_executor  # noqa: E402

TOKENS = 4
_BERT = dict(vocab_size=120, hidden_size=48, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64, initializer_range=0.1)


def _bert():
    cfg = T.BertConfig(**_BERT)
    cfg._attn_implementation = "eager"
    _, w = build_hf(cfg, T.BertModel, seed=3)
    config = cfg.to_dict()
    return config, normalize_weights(config, w)


@pytest.fixture(scope="module", params=[("rows", "gate", "core"), ("fused", "whole", "core"),
                                        ("fused", "poly", "poly")])
def bert_run(request):
    """The forward with Q K^T / P V on the rows' pair grid and in section 5's packing (its
    re-packs of Q, K and P V's output through conversion round trips); GeLU as Algorithm 4's
    x * Phi(x) (the gate in MPC, the product in HE), as one MPC core, and as its clamped form
    with the polynomial in HE, with the softmax's exp polynomial in HE too (the plan's default)."""
    attention, activation, exp = request.param
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    config, w = _bert()
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], TOKENS)
    g = build_graph(config)
    ref = GraphExecutor(g, bind(g, w), dtype=np.float64).run(
        {"ids": ids, "positions": np.arange(TOKENS), "token_types": np.zeros(TOKENS, np.int64)},
        {"pos0": 0, "T": TOKENS, "positions": np.arange(TOKENS)})["hidden"]
    sm = twopc_blb.server_model_blb(config, w)
    plan = twopc.public_plan(config, sm, embedding="onehot-linear", fusion="blb", blb_activation=activation,
                             blb_exp=exp)

    def party(ctx):
        meter = twopc.OpMeter(ctx.chan)
        enc = make_twopc_executor(ctx, config, sm if ctx.party == 1 else None, plan, meter=meter,
                                  attention=attention if ctx.party == 1 else "auto")
        assert isinstance(enc, twopc_blb.BLBEncoder)
        assert enc.blb_graph.meta["blb_activation"] == activation and enc.blb_graph.meta["blb_exp"] == exp
        h = enc.encode_shares(ids if ctx.party == 0 else None, TOKENS)
        return h.reveal_float(to=0), meter.summary(), enc.runner.block_stats

    r0, r1 = run_inprocess(party, timeout=1200)
    return ref, r0, r1, attention, activation, exp


def test_blb_forward_matches_plaintext(bert_run):
    ref, (h, _, _), (h1, _, _), _, _, _ = bert_run
    assert h1 is None
    assert h.shape == ref.shape == (TOKENS, _BERT["hidden_size"])
    err = np.abs(h - ref)
    # fixed point f = 16 through the cores (exp, reciprocal, rsqrt, GeLU gate ~1e-4 .. 4e-4, the
    # whole GeLU ~4e-3), CKKS noise far below (blb_params' target 2^-17); LayerNorm outputs of
    # magnitude ~3
    assert err.max() < 0.02, err.max()
    assert np.corrcoef(h.ravel(), ref.ravel())[0, 1] > 0.9999


def test_blb_bytes_are_conversions_cores_and_setup(bert_run):
    _, (_, s0, blocks), (_, s1, _), attention, activation, exp = bert_run
    for cls in ("conversions", "setup", "softmax", "norm", "activation"):
        assert s0[cls]["bytes"] > 0, cls
    # no HE product of the layer-by-layer pipeline runs: projections are inside the blocks
    assert s0.get("linear", {}).get("bytes", 0) == 0
    assert s0.get("attention_matmul", {}).get("bytes", 0) == 0
    for cls, s in s0.items():
        assert s["bytes"] == s1[cls]["bytes"], cls
    g = blb_fusion.run(build_graph(_bert()[0]), activation=activation, exp=exp)
    assert {b["block"] for b in blocks} == {b["id"] for b in g.meta["blb_blocks"]}


def test_units_put_every_input_before_its_use():
    g = blb_fusion.run(build_graph(_bert()[0]))
    made = set(g.inputs)
    prod = g.producers()
    seen_blocks = set()
    for kind, item in twopc_blb.units(g):
        nodes = [g.node(n) for n in item["nodes"]] if kind == "block" else [item]
        inside = {v for n in nodes for v in n.outputs}
        for n in nodes:
            for v in n.inputs:
                assert v in made or v in inside or prod.get(v) is None, (n.name, v)
        made |= inside
        if kind == "block":
            seen_blocks.add(item["id"])
    assert seen_blocks == {b["id"] for b in g.meta["blb_blocks"]}
    assert made >= {v for n in g.nodes for v in n.outputs}


@pytest.mark.parametrize("msg", [
    {"layout": "diagonal", "shape": [4, 8], "grid": [4], "rep": [1, 0]},
    {"layout": "row", "shape": [4, 8], "grid": [1 << 21], "rep": [1, 0]},
    {"layout": "row", "shape": "x", "grid": [4], "rep": [1, 0]},
    {"layout": "row", "shape": [4, 8], "grid": [4]},
    {"layout": "mh_diag/8/8", "shape": [4, 8, 8], "grid": [1], "rep": [1, 0], "present": b"\xff"},  # no groups
    {"layout": "mh_diag/8/8/3", "shape": [4, 8, 8], "grid": [1], "rep": [1, 0], "present": b"\xff"},  # 3 does not divide 8
    {"layout": "mh_diag/8/8/8", "shape": [4, 8, 8], "grid": [2], "rep": [1, 0], "present": b"\xff"},  # n / c = 1
    {"layout": "mh_cols/8/8/8", "shape": [4, 8, 8], "grid": [1], "rep": [1, 0], "present": b"\xff"},  # an input packing
    {"layout": "mh_diag/99999/8/1", "shape": [4, 8, 8], "grid": [1], "rep": [1, 0], "present": b"\xff"},
])
def test_client_rejects_malformed_output_headers(msg):
    ev = twopc_blb._Eval(_Ctx(), None, None, None, 64, 40, (4, 12))
    with pytest.raises(twopc_blb.BLBError):
        twopc_blb._client_packed({"op": "out", "value": "v", **msg}, ev)
    assert twopc_blb._client_packed({"op": "out", "value": "v", "layout": "mh_diag/8/8/8", "shape": [4, 8, 8],
                                     "grid": [1], "rep": [1, 0], "present": b"\x80"}, ev).layout == "mh_diag/8/8/8"


def test_client_reads_the_paired_flag_of_an_output_header():
    assert twopc_blb._header_paired({"paired": True}) is True
    assert twopc_blb._header_paired({}) is False
    for bad in (1, "yes", None, [True]):
        with pytest.raises(twopc_blb.BLBError, match="paired"):
            twopc_blb._header_paired({"paired": bad})


class _Ctx:
    slots = 8192
    max_level = 5


def test_client_checks_input_layouts():
    ev = twopc_blb._Eval(_Ctx(), None, None, None, 64, 40, (4, 12))
    for ok in ("row", "head", "mh_cols/8/12/4", "mh_rows/12/12/4"):
        assert twopc_blb._input_layout(ev, ok), ok
    for bad in ("headsum", "mh_diag/8/8/8", "mh_cols/8/12", "mh_cols/8/12/5", "mh_cols/a/b/c", None, 3):
        assert not twopc_blb._input_layout(ev, bad), bad


def test_fusion_in_the_public_plan():
    config, w = _bert()
    assert twopc.public_plan(config, None)["fusion"] == "none"
    assert twopc.public_plan(config, None, fusion="blb")["fusion"] == "blb"
    with pytest.raises(twopc.TwoPCError, match="unknown fusion"):
        twopc.public_plan(config, None, fusion="bolt")
    with pytest.raises(twopc.TwoPCError, match="bound weights"):  # BLB's blocks read the unfused weights
        twopc.public_plan(config, twopc.server_weights(config, w), fusion="blb")
    llama = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
    assert twopc.public_plan(llama, None, fusion="blb")["fusion"] == "blb"  # decoders: whole passes
    moe = dict(llama, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(twopc.TwoPCError, match="MoE"):
        twopc.public_plan(moe, None, fusion="blb")


def test_fusion_auto_follows_the_model_and_the_network():
    """"auto" (the serve default) is BLB only for a dense encoder on a network model of at most
    100 Mbps, where BLB measured faster (`twopc.BLB_AUTO_MAX_BANDWIDTH_BPS`)."""
    config, w = _bert()
    llama = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
    moe = dict(llama, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    from cipherlm.he.backend import backend_unavailable_reason

    blb_if_built = "blb" if lattigo.available() else "none"
    assert (backend_unavailable_reason("lattigo") is None) == lattigo.available()
    assert "unknown HE backend" in backend_unavailable_reason("no-such-backend")
    for network in ("LAN", "WAN", "blb-LAN", "blb-WAN1"):  # 3 Gbps, 400 Mbps, 1 Gbps, 400 Mbps
        assert twopc.resolve_fusion(config, "auto", network) == "none", network
    for network in ("blb-WAN2", "blb-WAN3", "fastquery-44Mbps"):
        assert twopc.resolve_fusion(config, "auto", network) == blb_if_built, network
        assert twopc.resolve_fusion(llama, "auto", network) == "none"  # no BLB generation yet
        assert twopc.resolve_fusion(moe, "auto", network) == "none"
    assert twopc.resolve_fusion(llama, "blb", "LAN") == "blb" and twopc.resolve_fusion(config, "none", "blb-WAN3") == "none"
    with pytest.raises(twopc.TwoPCError, match="unknown network"):
        twopc.resolve_fusion(config, "auto", "dialup")
    with pytest.raises(twopc.TwoPCError, match="unknown fusion"):
        twopc.resolve_fusion(config, "fastest", "LAN")
    # the plan carries the resolved choice, never "auto" (the client's plan check knows none / blb)
    sm = twopc_blb.server_model_blb(config, w)
    assert twopc.public_plan(config, sm, fusion="auto", network="blb-WAN2")["fusion"] == blb_if_built
    assert twopc.public_plan(config, sm, fusion="auto")["fusion"] == "none"


def test_serve_defaults_to_auto_and_takes_every_network_preset():
    from cipherlm.cli import build_parser

    args = build_parser().parse_args(["serve", "--mode", "2pc", "--model", "minilm-l6"])
    assert args.fusion == "auto" and args.packing_network == "LAN"
    args = build_parser().parse_args(["serve", "--mode", "2pc", "--packing-network", "blb-WAN3", "--model", "minilm-l6"])
    assert args.packing_network == "blb-WAN3"


def test_auto_fusion_serves_a_decoder_layer_by_layer():
    from cipherlm.models import LoadedModel
    from cipherlm.runtime.twopc_session import TwoPCHost
    from test_twopc import llama_model

    config, w = llama_model(seed=2)
    host = TwoPCHost("tiny-llama", embedding="onehot-linear", lm=LoadedModel("tiny-llama", config, w),
                     network="blb-WAN3")  # fusion "auto" by default: a decoder stays layer by layer
    assert host.plan["fusion"] == "none"


_DECODERS = {
    # GPT-2: LayerNorm, tanh-GeLU, learned positions (a server-known input), tied head
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(vocab_size=96, n_embd=48, n_layer=1, n_head=4, n_positions=64,
                                                     bos_token_id=0, eos_token_id=0, initializer_range=0.1)),
    # Llama: RMSNorm, RoPE, SiLU-gated FFN, grouped-query attention (2 KV heads for 4)
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(vocab_size=96, hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=1, num_attention_heads=4,
                                                       num_key_value_heads=2, max_position_embeddings=64,
                                                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                                                       initializer_range=0.1, bos_token_id=0, eos_token_id=0)),
}


@pytest.mark.parametrize("family,attention", [("gpt2", "auto"), ("gpt2", "rows"), ("llama", "auto")])
def test_blb_decoder_pass_matches_plaintext(family, attention):
    """A decoder's whole pass (teacher forcing: logits of every position) with BLB fusion in
    the 2pc mode against the plaintext executor: the causal scores leave Q K^T's block with
    the public mask set on the shares (section 5's packing at these sizes), the rest as for
    the encoders; with the rows packing the masked pair-grid ciphertexts are not computed and
    V comes back in as rows from its per-head cache layout on both sides.  Logits within the
    fixed-point error and the same argmax at every position;
    the next-token output opens the last argmax to the client only; generation is refused."""
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    cfg_cls, model_cls, kw = _DECODERS[family]
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    _, w = build_hf(cfg, model_cls, seed=5)
    config = cfg.to_dict()
    w = normalize_weights(config, w)
    n = 6
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], n)
    g = build_graph(config)
    ex = GraphExecutor(g, bind(g, w), dtype=np.float64)
    ref = ex.run({"ids": ids, "positions": np.arange(n)}, {"pos0": 0, "T": n, "positions": np.arange(n)},
                 ex.new_cache())["logits"]
    sm = twopc_blb.server_model_blb(config, w)
    plan = twopc.public_plan(config, sm, embedding="onehot-linear", fusion="blb")

    def party(ctx):
        dec = make_twopc_executor(ctx, config, sm if ctx.party == 1 else None, plan,
                                  attention=attention if ctx.party == 1 else "auto")
        assert isinstance(dec, twopc_blb.BLBDecoder)
        logits = dec.forward(ids if ctx.party == 0 else None, n).reveal_float(to=0)
        nxt = dec.forward(ids if ctx.party == 0 else None, n, last_only=True, outputs=("next_token",))
        hid = dec.forward(ids if ctx.party == 0 else None, n, outputs=("hidden",)).reveal_float(to=0)
        with pytest.raises(twopc_blb.BLBError, match="KV cache"):
            dec.generate(ids if ctx.party == 0 else None, n, 2)
        return logits, nxt, hid, [r for r in dec.runner.conversions if r["value"].endswith("qk")]

    (logits, nxt, hid, _), (l1, n1, _, qk) = run_inprocess(party, timeout=1200)  # the server records conversions
    href = ex.run({"ids": ids, "positions": np.arange(n)}, {"pos0": 0, "T": n, "positions": np.arange(n)},
                  ex.new_cache(), outputs=("hidden",))["hidden"]
    assert hid.shape == href.shape and np.abs(hid - href).max() < 0.02  # the final norm's output, no LM head
    assert l1 is None and n1 is None
    assert logits.shape == ref.shape == (n, config["vocab_size"])
    err = np.abs(logits - ref).max()
    assert err < 0.03 * max(1.0, np.abs(ref).max()), err
    assert (logits.argmax(-1) == ref.argmax(-1)).all()
    assert list(nxt) == [int(ref[-1].argmax())]
    assert qk and all(r["direction"] == "out" for r in qk)  # the masked scores did leave their block


def test_blb_decoder_with_massive_activations():
    """A Llama whose FFN writes a massive activation into one channel of the residual stream
    (one hidden unit with gate = up = 16 x_5, so silu(z) z = z^2 sigmoid(z) >= 0, read into
    channel 3 at 4x; up to 2750 on the probe, as SmolLM2's reach 2^15 in a few channels): the
    server's probe sees a final-norm sum of squares of 7.8e6, far above what a block output
    carries, so ``blb_norms="auto"`` keeps the RMSNorms whole in MPC, and the plan's value
    bound (2^14) lowers Algorithm 2's encoding scale to 2^48.  The logits match the plaintext
    executor; the same model without that unit keeps the split."""
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    cfg_cls, model_cls, kw = _DECODERS["llama"]
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    _, w = build_hf(cfg, model_cls, seed=5)
    config = cfg.to_dict()
    w = dict(normalize_weights(config, w))
    assert twopc.public_plan(config, twopc_blb.server_model_blb(config, w), fusion="blb")["blb_norms"] == "split"
    for name in ("gate_proj", "up_proj"):
        a = np.array(w[f"model.layers.0.mlp.{name}.weight"], np.float32)
        a[7, :] = 0.0
        a[7, 5] = 16.0
        w[f"model.layers.0.mlp.{name}.weight"] = a
    a = np.array(w["model.layers.0.mlp.down_proj.weight"], np.float32)
    a[3, 7] = 4.0
    w["model.layers.0.mlp.down_proj.weight"] = a
    n = 6
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], n)
    g = build_graph(config)
    ex = GraphExecutor(g, bind(g, w), dtype=np.float64)
    sm = twopc_blb.server_model_blb(config, w)
    plan = twopc.public_plan(config, sm, embedding="onehot-linear", fusion="blb")
    assert plan["blb_norms"] == "whole" and plan["blb_value_bits"] == 14
    assert twopc_blb.in_scale_bits(plan["blb_value_bits"]) == 48

    def party(ctx):
        dec = make_twopc_executor(ctx, config, sm if ctx.party == 1 else None, plan)
        assert not any(nd.op == "rsqrt" for nd in dec.blb_graph.nodes)  # the norms stayed whole
        return dec.forward(ids if ctx.party == 0 else None, n).reveal_float(to=0)

    logits, _ = run_inprocess(party, timeout=1200)
    ref = ex.run({"ids": ids, "positions": np.arange(n)}, {"pos0": 0, "T": n, "positions": np.arange(n)},
                 ex.new_cache())["logits"]
    err = np.abs(logits - ref).max()
    assert err < 0.03 * max(1.0, np.abs(ref).max()), err
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


def test_plan_norms_and_value_bound_are_checked():
    from cipherlm.runtime.plan_check import ProtocolError, check_twopc_plan

    config, _ = _bert()
    plan = twopc.public_plan(config, None, fusion="blb")
    assert plan["blb_norms"] == "split" and plan["blb_value_bits"] == twopc.BLB_MIN_VALUE_BITS  # no weights: the default
    for key, bad in (("blb_norms", "half"), ("blb_norms", 1), ("blb_value_bits", 11), ("blb_value_bits", 20),
                     ("blb_value_bits", 12.0), ("blb_value_bits", True)):
        with pytest.raises(ProtocolError):
            check_twopc_plan({**plan, key: bad}, config)
    assert check_twopc_plan({**plan, "blb_norms": "whole", "blb_value_bits": 17}, config)["blb_value_bits"] == 17
    with pytest.raises(twopc.TwoPCError, match="norm split"):
        twopc.public_plan(config, None, fusion="blb", blb_norms="half")
    with pytest.raises(twopc.TwoPCError, match="activations reach"):
        twopc.blb_value_bits({"abs": 2.0 ** 19, "sumsq": 0.0})


def test_client_checks_the_plans_fusion():
    from cipherlm.runtime.plan_check import ProtocolError, check_twopc_plan

    config, _ = _bert()
    plan = twopc.public_plan(config, None, fusion="blb")
    assert check_twopc_plan(plan, config) == plan
    for bad in ("bolt", 1, None):
        with pytest.raises(ProtocolError, match="fusion"):
            check_twopc_plan({**plan, "fusion": bad}, config)
    with pytest.raises(ProtocolError, match="BLB fusion in a decoder"):
        check_twopc_plan({"embedding": plan["embedding"], "linear": plan["linear"], "fold_norms": True,
                          "fusion": "blb"})
    old = {k: v for k, v in plan.items() if not k.startswith("blb_") and k != "fusion"}  # a server from before BLB
    assert check_twopc_plan(old, config) == old
    assert plan["blb_activation"] == twopc.DEFAULT_BLB_ACTIVATION == "poly"
    assert plan["blb_exp"] == twopc.DEFAULT_BLB_EXP == "poly"
    core = {**plan, "blb_exp": "core"}
    assert check_twopc_plan(core, config) == core
    for bad in ("half", 1, None):
        with pytest.raises(ProtocolError, match="exp split"):
            check_twopc_plan({**plan, "blb_exp": bad}, config)
    with pytest.raises(twopc.TwoPCError, match="exp split"):
        twopc.public_plan(config, None, fusion="blb", blb_exp="half")
    gate = {**plan, "blb_activation": "gate"}
    assert check_twopc_plan(gate, config) == gate
    for bad in ("half", 1, None):
        with pytest.raises(ProtocolError, match="activation split"):
            check_twopc_plan({**plan, "blb_activation": bad}, config)
    with pytest.raises(ProtocolError, match="without BLB fusion"):
        check_twopc_plan({**old, "blb_activation": "whole"}, config)
    with pytest.raises(twopc.TwoPCError, match="activation split"):
        twopc.public_plan(config, None, fusion="blb", blb_activation="half")
    assert "blb_activation" not in twopc.public_plan(config, None)


def test_classify_over_tcp_with_blb():
    """`serve --mode 2pc --fusion blb`'s path: the host's plan carries the fusion, the client
    builds BLBEncoder from the welcome, and the class logits match the plaintext executor."""
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    from cipherlm.models import LoadedModel
    from cipherlm.runtime.plain import EncoderExecutor, PlainLinear, split_params
    from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost
    from test_twopc import bert_model
    from test_twopc_session import _serve

    config, w, cls = bert_model()
    config = {**config, "num_hidden_layers": 1}
    w = {k: v for k, v in w.items() if ".layer.1." not in k}
    host = TwoPCHost("tiny-bert", embedding="onehot-linear", lm=LoadedModel("tiny-bert", config, w),
                     classifier=cls, labels=["neg", "pos"], fusion="blb")
    assert host.plan["fusion"] == "blb" and host.weights.bound is not None
    server = _serve(host, timeout=120)
    try:
        client_p, server_l = split_params(config, w)
        ex = EncoderExecutor(config, client_p, PlainLinear(dict(server_l) | {"classifier": cls}, dtype=np.float64))
        ids = np.array([101, 7, 9, 102])
        ref = ex.classify(ids[None])[0]
        with TwoPCClient(*server.address, timeout=120) as client:
            assert client.plan["fusion"] == "blb"
            logits = client.classify(ids)
        assert np.abs(logits - ref).max() < 0.05, (logits, ref)
    finally:
        server.shutdown()


def test_client_converts_back_only_what_it_was_given():
    """A change of packing is an "out" of a block value then an "in" of the same value: the
    client refuses an "in" of a value the block computes but did not send out first (it holds
    no share of it), and an "out" of a value that is not the block's."""
    g = blb_fusion.run(build_graph(_bert()[0]))
    blk = next(b for b in g.meta["blb_blocks"] if any(g.node(n).op == "qk" for n in b["nodes"]))
    q = next(g.node(n) for n in blk["nodes"] if g.node(n).op == "qk").inputs[0]  # Q: computed in the block
    key = (8192, (60, 40, 40), (60,))
    head = {"n": key[0], "chain": list(key[1]), "special": list(key[2]), "period": 64, "scale_bits": 40}
    for msg, why in (({"op": "in", "value": q, "layout": "mh_cols/4/12/4", "level": 0, "scale": 2.0 ** 40},
                      f"asked to convert '{q}'"),
                     ({"op": "out", "value": "L1.q", "layout": "row"}, "unexpected message")):
        class Ctx:
            party = 0

            def recv(self, msgs=[msg]):
                return msgs.pop(0)

        runner = twopc_blb.BLBRunner(Ctx(), g, None, None)
        runner.sets[key] = twopc_blb._KeySet(twopc_blb._context(*key), None)
        with pytest.raises(twopc_blb.BLBError, match=why):
            runner._answer_block(blk, {}, head)


def test_serving_a_decoder_with_blb_is_refused():
    """No generation with BLB yet (no KV cache across passes): the server refuses at start-up
    with the reason, instead of failing each session."""
    from cipherlm.models import LoadedModel
    from cipherlm.runtime.twopc_session import TwoPCHost
    from test_twopc import llama_model

    config, w = llama_model(seed=2)
    with pytest.raises(twopc.TwoPCError, match="no generation"):
        TwoPCHost("tiny-llama", embedding="onehot-linear", lm=LoadedModel("tiny-llama", config, w), fusion="blb")


def test_multi_ciphertext_values_travel_in_pairs():
    """At 16 tokens the tiny BERT's scores Q K^T fill two ciphertexts, and so do Q and K in
    section 5's packing: the inputs go in paired (one encryption, split by a conjugation), the
    scores leave paired (`twopc_blb.pairable`, `ckks_convert`'s ``paired``: one Algorithm 1
    conversion; its bytes are tests/test_ckks_convert.py's, the per-conversion totals here
    include Ferret's pool refills), and the layer still matches the plaintext."""
    from cipherlm.bench import blb as bench_blb
    out = bench_blb.run_blb_bench("tiny", layers=1, tokens=16, variants=("BLB+fused",), echo=False)
    row = out["rows"][0]
    assert row["status"] == "ok" and row["max_abs_error"] < 0.02
    conv = {c["value"]: c for c in row["conversions"] if c["direction"] == "out"}
    qk, k = conv["L0.qk"], conv["L0.k"]
    assert qk["cts"] == 2 and qk["paired"] and k["cts"] == 1 and not k["paired"]
    ins = [c for c in row["conversions"] if c["direction"] == "in"]  # Q and K into section 5's packing
    assert any(c["cts"] == 2 and c["paired"] for c in ins)
    assert all(c["paired"] == (c["cts"] > 1) for c in ins)


@pytest.mark.parametrize("conj", ["yes", 1, None])
def test_client_refuses_a_malformed_conjugation_request(conj):
    """The server asks for the conjugation key (paired inputs) with a bool; anything else is a
    malformed key request, refused before any key is made."""
    g = blb_fusion.run(build_graph(_bert()[0]))

    class Ctx:
        party = 0

        def send(self, msg):
            raise AssertionError("nothing is sent for a malformed request")

    runner = twopc_blb.BLBRunner(Ctx(), g, None, None)
    with pytest.raises(twopc_blb.BLBError, match="malformed key request"):
        runner._answer_keys({"op": "keys", "n": 8192, "chain": [60, 40, 40], "special": [60], "steps": [],
                             "conjugate": conj})
    assert not runner.sets


_BUDGET_PASSES = (4, 3, 4)


def _budget_party(ctx, budget):
    """One party of `test_server_keeps_rotation_keys_within_its_budget` (module level: it runs
    in its own process)."""
    config, w = _bert()
    sm = twopc_blb.server_model_blb(config, w)
    plan = twopc.public_plan(config, sm, embedding="onehot-linear", fusion="blb")
    meter = twopc.OpMeter(ctx.chan)
    enc = make_twopc_executor(ctx, config, sm if ctx.party == 1 else None, plan, meter=meter)
    enc.runner.key_cache_bytes = budget
    out = []
    for n in _BUDGET_PASSES:
        ids = np.random.default_rng(n).integers(0, config["vocab_size"], n)
        before = meter.summary().get("setup", {}).get("bytes", 0)
        h = enc.encode_shares(ids if ctx.party == 0 else None, n).reveal_float(to=0)
        batches = [b for ks in enc.runner.sets.values() for b in ks.batches] if ctx.party == 1 else []
        last_only = all(b.used == enc.runner._stamp for b in batches)
        out.append((h, meter.summary()["setup"]["bytes"] - before, last_only))
    return out, enc.runner.keys_evicted


def test_server_keeps_rotation_keys_within_its_budget():
    """A session of passes at 4, 3 and again 4 tokens (new rotation steps at each length), with
    no room for keys between blocks: the server drops every batch the current block does not use
    (between passes only the last block's batches stay) and asks for the 4-token keys again, so
    the third pass costs set-up bytes (with the default budget nothing is dropped: the other BLB
    tests); every pass matches the plaintext.  The parties are two processes, so that their keys
    leave with them."""
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    from cipherlm.mpc.runner import run_processes
    (r0, _), (r1, evicted) = run_processes(_budget_party, args0=(0,), args1=(0,), timeout=1200)
    config, w = _bert()
    g = build_graph(config)
    for n, (h, _, _) in zip(_BUDGET_PASSES, r0):
        ids = np.random.default_rng(n).integers(0, config["vocab_size"], n)
        ref = GraphExecutor(g, bind(g, w), dtype=np.float64).run(
            {"ids": ids, "positions": np.arange(n), "token_types": np.zeros(n, np.int64)},
            {"pos0": 0, "T": n, "positions": np.arange(n)})["hidden"]
        assert np.abs(h - ref).max() < 0.02
    setup = [s for _, s, _ in r0]
    assert setup[0] > 0 and setup[1] > 0 and setup[2] > 0  # new lengths, and the dropped keys again
    assert evicted > 0 and all(last_only for _, _, last_only in r1)


@pytest.mark.parametrize("chain, special", [((60, 40, 40, 40), (60,)), ((60, 40, 40, 40, 40, 40), (60, 60))])
def test_expanded_key_bytes_match_the_loaded_keys(chain, special):
    """The key budget's size of a batch (`_expanded_key_bytes`, from the seeded bit-packed blob)
    is the loaded keys' expanded size (their 64-bit serialisation without header and elements)."""
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    be = lattigo.LattigoBackend()
    hc = twopc_blb._context(16384, chain, special)
    wire = be.keygen(hc).galois_keys_bytes([1, 2], conjugate=True)
    full = be.galois_keys_from_bytes(hc, wire, required_steps=[1, 2], conjugate=True, max_keys=3).to_bytes()
    assert twopc_blb._expanded_key_bytes(hc, len(wire), 3) == len(full) - 12 - 3 * 8

"""2pc executor on shares vs the plaintext executor (tiny random BERT and Llama configs,
the same config dicts as tests/test_plain_*.py), KV-cached decode, outputs opened to the
client only, accounting per operator class."""

import numpy as np
import pytest

from _hf_oracle import build_hf, torch_setup
from cipherlm.models import normalize_weights
from cipherlm.mpc.runner import PartyFailed, run_inprocess
from cipherlm.runtime import twopc
from cipherlm.runtime.plain import EncoderExecutor, PlainLinear, make_executor, split_params

torch = torch_setup()
import transformers as T  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


def llama_model(seed=1, **kw):
    cfg = T.LlamaConfig(intermediate_size=80, rope_theta=500.0, **(COMMON | kw))
    _, w = build_hf(cfg, T.LlamaForCausalLM, seed=seed)
    config = cfg.to_dict()
    return config, normalize_weights(config, w)


def bert_model(seed=5):
    cfg = T.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=96, max_position_embeddings=64, initializer_range=0.1)
    _, w = build_hf(cfg, T.BertModel, seed=seed)
    config = cfg.to_dict()
    rng = np.random.default_rng(seed)
    cls = (rng.normal(size=(2, 48)).astype(np.float32), rng.normal(size=2).astype(np.float32))
    return config, normalize_weights(config, w), cls


def plain_decoder(config, w):
    client, server = split_params(config, w)
    return make_executor(config, client, PlainLinear(server, dtype=np.float64))


# fixed point (f = 16, linear inputs at 12 bits), GeLU/SiLU polynomial errors (<= 0.02 / 0.04 abs)
# and softmax (5e-3) through two layers: measured ~0.03 abs on logits of magnitude ~2.5
LOGIT_TOL = 0.1


@pytest.fixture(scope="module")
def llama():
    return llama_model()


@pytest.fixture(scope="module")
def llama_run(llama):
    """One in-process 2PC session: full forward of 6 tokens, then prefill 5 + decode 1 on a
    KV cache in shares, then the argmax of the decode step opened to the client."""
    config, w = llama
    sw = twopc.server_weights(config, w)
    plan = twopc.public_plan(config, sw, embedding="onehot-linear")
    ids = np.array([3, 17, 5, 88, 41, 60])

    def party(ctx):
        meter = twopc.OpMeter(ctx.chan)
        ex = twopc.TwoPCDecoder(ctx, config, sw if ctx.party == 1 else None, plan, meter=meter)
        mine = ids if ctx.party == 0 else None
        full = ex.forward(mine, 6).reveal_float(to=0)
        cache = ex.new_cache()
        pre = ex.forward(None if mine is None else mine[:5], 5, cache).reveal_float(to=0)
        assert cache.length == 5 and cache.k[0].shape == (2, 5, 12)
        dec = ex.forward(None if mine is None else mine[5:], 1, cache)
        dec_val = dec.reveal_float(to=0)
        tok = ex.argmax_to_client(dec)
        return full, pre, dec_val, tok, meter.summary(), cache.length

    r0, r1 = run_inprocess(party, timeout=600)
    return ids, r0, r1


def test_llama_forward_matches_plaintext(llama, llama_run):
    config, w = llama
    ids, (full, pre, _, _, _, _), _ = llama_run
    ref = plain_decoder(config, w).forward(ids)
    assert full.shape == ref.shape == (6, 97)
    err = np.abs(full - ref)
    assert err.max() < LOGIT_TOL, err.max()
    assert np.corrcoef(full.ravel(), ref.ravel())[0, 1] > 0.999
    assert np.abs(pre - ref[:5]).max() < LOGIT_TOL


def test_kv_cached_decode_equals_full_recompute(llama_run):
    _, (full, _, dec, tok, _, length), _ = llama_run
    assert length == 6
    # the decode pass on the shared cache gives the last row of the full pass, up to the
    # independent fixed-point rounding of the two runs
    assert np.abs(dec[0] - full[-1]).max() < 0.05
    assert tok.shape == (1,)
    top2 = np.sort(dec[0])[-2:]
    if top2[1] - top2[0] > 0.02:
        assert int(tok[0]) == int(np.argmax(dec[0]))


def test_outputs_opened_to_the_client_only(llama_run):
    _, r0, r1 = llama_run
    full1, pre1, dec1, tok1, _, _ = r1
    assert full1 is None and pre1 is None and dec1 is None and tok1 is None
    assert r0[3] is not None


def test_op_class_breakdown(llama_run):
    _, (_, _, _, _, summary, _), (_, _, _, _, summary1, _) = llama_run
    for cls in ("embedding", "linear", "attention_matmul", "softmax", "activation", "norm"):
        assert summary[cls]["bytes"] > 0, cls
        assert summary[cls]["seconds"] > 0, cls
        assert summary[cls]["calls"] > 0, cls
    assert summary["rope"]["bytes"] == 0  # public linear map: free
    # what one party sends the other receives
    for cls, s in summary.items():
        assert s["bytes"] == summary1[cls]["bytes"], cls


def test_rms_statistic_handles_massive_activations():
    """SmolLM2's residual stream has rows with mean square ~1e6 next to rows ~1e-2."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 48))
    x[0] *= 0.1
    x[1, :3] = [3000.0, -2500.0, 1800.0]
    k, c = twopc.rms_factor(48)
    ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) / np.sqrt(c)

    def party(ctx):
        from cipherlm.mpc.shares import share_input

        xs = share_input(ctx, x if ctx.party == 0 else None, owner=0)
        return twopc.rms_statistic(ctx, xs, 1e-5).reveal_float()

    out, _ = run_inprocess(party, timeout=120)
    assert np.abs(out - ref).max() < 5e-3


def test_bert_classifier_matches_plaintext():
    config, w, cls = bert_model()
    client, server = split_params(config, w)
    ex = EncoderExecutor(config, client, PlainLinear(dict(server) | {"classifier": cls}, dtype=np.float64))
    ids = np.array([101, 17, 5, 88, 41, 102])
    ref_h = ex.forward(ids[None])[0]
    ref = ex.classify(ids[None])[0]
    sw = twopc.server_weights(config, w, classifier=cls)
    plan = twopc.public_plan(config, sw)  # default embedding: FastQuery's protocol when present

    def party(ctx):
        enc = twopc.TwoPCEncoder(ctx, config, sw if ctx.party == 1 else None, plan)
        mine = ids if ctx.party == 0 else None
        h = enc.forward(mine, ids.size).reveal_float(to=0)
        return h, enc.classify(mine, ids.size)

    (h, logits), (h1, logits1) = run_inprocess(party, timeout=600)
    assert h1 is None and logits1 is None
    assert np.abs(h - ref_h).max() < 0.1 * np.abs(ref_h).max()
    assert logits.shape == (2,)
    assert np.abs(logits - ref).max() < 0.05


def _group(sw, name):
    """The stacked projection of the group holding linear `name`."""
    for gi, (names, _, _) in enumerate(sw.graph.meta["linear_groups"]):
        if name in names:
            return sw.projs[gi]
    raise KeyError(name)


def test_server_weights_fold_norms_exactly(llama):
    """The 2pc passes on the server's weights: RMSNorm's gamma (times sqrt(c)) folded into
    the stacked q/k/v, the attention scale into q's columns; the folded norm keeps no
    weight in the graph, and the client builds the same graph without any weights."""
    config, w = llama
    sw = twopc.server_weights(config, w)
    assert sw.fold_norms and sw.graph.node("L0.attn_norm").attrs["gamma"] is None
    assert sw.graph.node("L0.qk").attrs["scale"] == 1.0
    folded = twopc.server_weights(config, w, fold_norms=False)
    g1 = folded.params["model.layers.0.input_layernorm.weight"]
    _, c = twopc.rms_factor(config["hidden_size"])
    np.testing.assert_allclose(g1, np.asarray(w["model.layers.0.input_layernorm.weight"], np.float64) * np.sqrt(c))
    q_name = "model.layers.0.self_attn.q_proj"
    np.testing.assert_allclose(_group(sw, q_name).w, _group(folded, q_name).w * g1[:, None])
    hd = config["hidden_size"] // config["num_attention_heads"]
    q = np.asarray(w[f"{q_name}.weight"], np.float64).T
    np.testing.assert_allclose(_group(folded, q_name).w[:, : q.shape[1]], q * hd ** -0.5)
    client_graph, params, _ = twopc.twopc_graph(config, None, fold_norms=True)
    assert params is None
    assert [(n.op, n.name, n.inputs, n.attrs) for n in client_graph.nodes] == \
        [(n.op, n.name, n.inputs, n.attrs) for n in sw.graph.nodes]


def test_unfolded_norms_match_too(llama):
    """The path for weights that would exceed the linear protocol's bound when folded:
    gamma applied as a server-private product (one Gilboa cross term)."""
    config, w = llama
    sw = twopc.server_weights(config, w, fold_norms=False)
    plan = twopc.public_plan(config, sw, embedding="onehot-linear")
    ids = np.array([7, 3, 44])

    def party(ctx):
        ex = twopc.TwoPCDecoder(ctx, config, sw if ctx.party == 1 else None, plan)
        return ex.forward(ids if ctx.party == 0 else None, 3).reveal_float(to=0)

    out, _ = run_inprocess(party, timeout=600)
    ref = plain_decoder(config, w).forward(ids)
    assert np.abs(out - ref).max() < LOGIT_TOL


@pytest.mark.parametrize("packing", ["simd", "auto"])
def test_linear_packing_from_the_plan(llama, packing):
    """The plan's linear packing reaches every projection: SIMD (BSGS) layers give the
    plaintext logits too; "auto" records the cost model's choice for every projection
    (fused q/k/v and gate/up: 4 per layer, plus the LM head) and the report lists each
    shape once with both packings' modelled seconds and bytes."""
    from cipherlm.protocols.linear import linear_stats

    config, w = llama
    sw = twopc.server_weights(config, w)
    plan = twopc.public_plan(config, sw, embedding="onehot-linear", linear_packing=packing, network="WAN")
    assert plan["linear"] == {"packing": packing, "network": "WAN"}
    ids = np.array([7, 3, 44])

    def party(ctx):
        ex = twopc.TwoPCDecoder(ctx, config, sw if ctx.party == 1 else None, plan)
        out = ex.forward(ids if ctx.party == 0 else None, 3).reveal_float(to=0)
        return out, twopc.linear_packing_report(ctx, plan), len(linear_stats(ctx).packings)

    (out, report, n_choices), (_, report1, _) = run_inprocess(party, timeout=900)
    assert np.abs(out - plain_decoder(config, w).forward(ids)).max() < LOGIT_TOL
    assert report == report1  # both parties took the same choices
    if packing == "auto":
        assert n_choices == 2 * 4 + 1
        shapes = [(c["m"], c["d"], c["o"]) for c in report["choices"]]
        assert len(set(shapes)) == len(shapes) and (3, 48, 97) in shapes  # the LM head
        assert sum(report["calls"].values()) == n_choices
        for c in report["choices"]:  # the cheaper packing under the model, at the plan's network
            assert c["network"] == "WAN" and c["coeff_bytes"] > 0 and c["simd_bytes"] > 0
            assert c["packing"] == ("simd" if c["simd_seconds"] < c["coeff_seconds"] else "coeff")
    else:
        assert "choices" not in report
    with pytest.raises(twopc.TwoPCError, match="unknown linear packing"):
        twopc.public_plan(config, sw, linear_packing="dense")


def test_bad_inputs_raise_clear_errors(llama):
    config, w = llama
    sw = twopc.server_weights(config, w)
    with pytest.raises(twopc.TwoPCError, match="unknown embedding"):
        twopc.public_plan(config, sw, embedding="nope")
    with pytest.raises(twopc.TwoPCError, match="Llama-family"):
        twopc.server_weights({"model_type": "t5"}, {})
    with pytest.raises(twopc.TwoPCError, match="clip_qkv"):
        twopc.model_kind({**config, "model_type": "olmoe", "clip_qkv": 8.0})
    plan = twopc.public_plan(config, sw, embedding="onehot-linear")

    def party(ctx):
        ex = twopc.TwoPCDecoder(ctx, config, sw if ctx.party == 1 else None, plan)
        return ex.forward(np.array([3, 500]) if ctx.party == 0 else None, 2)

    with pytest.raises(PartyFailed, match="token id out of range"):
        run_inprocess(party, timeout=60)

    def wrong_side(ctx):
        return twopc.TwoPCDecoder(ctx, config, sw, plan)  # the client must not hold weights

    with pytest.raises(PartyFailed, match="passes the weights"):
        run_inprocess(wrong_side, timeout=60)

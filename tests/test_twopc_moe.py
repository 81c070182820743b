"""MoE decoders (Qwen2-MoE with a shared expert and a dense layer, OLMoE with q/k norms,
Mixtral) on shares in the 2pc executor: the CryptoMoE layer inside the whole model, against
the plaintext executor (itself checked against transformers in test_plain_decoders.py).

With capacity factor c = n / k every expert can take every token (t = m), so balanced
routing drops nothing and the 2pc model computes the unbalanced model's function; with
c = 1 it must match the plaintext executor run with the same balanced routing."""

import numpy as np
import pytest

from _hf_oracle import build_hf, torch_setup
from cipherlm.models import normalize_weights
from cipherlm.moe.routing import BalancedRouting
from cipherlm.mpc.runner import run_inprocess
from cipherlm.runtime import twopc
from cipherlm.runtime.plain import DecoderExecutor, PlainLinear, split_params

torch = torch_setup()
import transformers as T  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
# as tests/test_twopc.py: fixed point, polynomial activations and softmax through two layers,
# plus the routing scores' softmax / top-k on shares
LOGIT_TOL = 0.1
IDS = np.array([3, 17, 5, 88, 41, 60])


def _model(kind: str, seed: int = 2):
    if kind == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                               num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                               mlp_only_layers=[1], **COMMON)
        cls = T.Qwen2MoeForCausalLM
    elif kind == "olmoe":
        cfg = T.OlmoeConfig(intermediate_size=24, num_experts=6, num_experts_per_tok=2, clip_qkv=None, **COMMON)
        cls = T.OlmoeForCausalLM
    else:
        cfg = T.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=None, **COMMON)
        cls = T.MixtralForCausalLM
    _, w = build_hf(cfg, cls, seed=seed)
    config = cfg.to_dict()
    return config, normalize_weights(config, w)


def _plain(config, w, routing=None):
    client, server = split_params(config, w)
    return DecoderExecutor(config, client, PlainLinear(server, dtype=np.float64), moe_routing=routing)


def _n_over_k(config) -> float:
    n = config.get("num_experts") or config.get("num_local_experts")
    return n / config["num_experts_per_tok"]


def _run_2pc(config, w, capacity: float, decode: bool = False):
    sw = twopc.server_weights(config, w)
    plan = twopc.public_plan(config, sw, embedding="onehot-linear", moe_capacity=capacity)

    def party(ctx):
        ex = twopc.TwoPCDecoder(ctx, config, sw if ctx.party == 1 else None, plan)
        mine = IDS if ctx.party == 0 else None
        full = ex.forward(mine, len(IDS)).reveal_float(to=0)
        ts = {i: p["t"] for i, p in ex.moe_phases.items()}
        dec = None
        if decode:
            cache = ex.new_cache()
            ex.forward(None if mine is None else mine[:-1], len(IDS) - 1, cache)
            dec = ex.forward(None if mine is None else mine[-1:], 1, cache).reveal_float(to=0)
            assert all(p["t"] == 1 for p in ex.moe_phases.values())
        return full, dec, ts

    r0, r1 = run_inprocess(party, timeout=900)
    return r0, r1


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe", "mixtral"])
def test_moe_decoder_matches_plaintext_without_drops(kind):
    config, w = _model(kind)
    (full, dec, ts), (none, _, ts1) = _run_2pc(config, w, _n_over_k(config), decode=kind == "mixtral")
    assert none is None  # nothing opened to the server
    ref = _plain(config, w).forward(IDS)
    assert full.shape == ref.shape == (len(IDS), 97)
    err = np.abs(full - ref).max()
    assert err < LOGIT_TOL, err
    assert np.corrcoef(full.ravel(), ref.ravel())[0, 1] > 0.999
    # every MoE layer ran with t = m (public, the same on both sides)
    moe_layers = [0] if kind == "qwen2_moe" else [0, 1]
    assert ts == ts1 == {i: len(IDS) for i in moe_layers}
    if dec is not None:  # KV-cached decode: one token, t = 1
        assert np.abs(dec[0] - ref[-1]).max() < LOGIT_TOL


def test_moe_decoder_balanced_routing_matches_plaintext_balanced():
    config, w = _model("mixtral", seed=4)
    c = 1.0
    (full, _, ts), _ = _run_2pc(config, w, c)
    plain = _plain(config, w, BalancedRouting(c=c, selection="confidence"))
    ref = plain.forward(IDS)
    unbalanced = _plain(config, w).forward(IDS)
    # t = ceil(1.0 * 6 * 2 / 4) = 3 < 6: some pairs are dropped, so the balanced model differs
    assert ts == {0: 3, 1: 3}
    dropped = [d.dropped_fraction for d in plain.last_moe_dispatch.values()]
    assert max(dropped) > 0
    assert np.abs(ref - unbalanced).max() > 2 * LOGIT_TOL  # so the check below can tell them apart
    err = np.abs(full - ref).max()
    assert err < LOGIT_TOL, err


def test_moe_plan_and_weights_checks():
    config, w = _model("mixtral")
    sw = twopc.server_weights(config, w)
    with pytest.raises(twopc.TwoPCError, match="capacity"):
        twopc.public_plan(config, sw, moe_capacity=0.0)
    plan = twopc.public_plan(config, sw)
    assert plan["moe"] == {"variant": "cryptomoe", "capacity": twopc.DEFAULT_MOE_CAPACITY}
    no_moe = {k: v for k, v in plan.items() if k != "moe"}

    def party(ctx):
        twopc.TwoPCDecoder(ctx, config, sw if ctx.party == 1 else None, no_moe)

    with pytest.raises(Exception, match="MoE settings"):
        run_inprocess(party, timeout=60)
    clipped = dict(_model("olmoe")[0], clip_qkv=3.0)
    with pytest.raises(twopc.TwoPCError, match="clip_qkv"):
        twopc.public_plan(clipped)


def test_moe_generate_over_tcp():
    """A Mixtral served by `cipherlm serve --mode 2pc`'s host and server classes, the capacity
    from the server's plan; the client's greedy tokens against the plaintext executor's."""
    import threading

    from cipherlm.models import LoadedModel
    from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost, TwoPCServer

    config, w = _model("mixtral", seed=3)
    c = _n_over_k(config)
    host = TwoPCHost("tiny-mixtral", embedding="onehot-linear", lm=LoadedModel("tiny-mixtral", config, w),
                     moe_capacity=c)
    server = TwoPCServer(host, "127.0.0.1", 0, session_timeout=60)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ex = _plain(config, w)
        prompt = [1, 2, 3, 4]
        ref_ids, ref_logits = ex.generate(prompt, max_new_tokens=2, eos_token_ids=[], return_logits=True)
        with TwoPCClient(*server.address, model="tiny-mixtral", timeout=120) as client:
            assert client.plan["moe"] == {"variant": "cryptomoe", "capacity": c}
            ids = client.generate(prompt, 2, eos_ids=[])
            summary = client.meter.summary()
    finally:
        server.shutdown()
    # both greedy steps have a top-2 margin (0.5, 0.65) far above the fixed-point error
    margins = [np.diff(np.sort(lg)[-2:])[0] for lg in ref_logits]
    assert min(margins) > 2 * LOGIT_TOL
    assert ids == ref_ids
    assert summary["moe"]["bytes"] > 0  # the MoE layers' traffic is its own class in the report

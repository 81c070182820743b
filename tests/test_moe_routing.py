"""Balanced expert routing in plaintext (CryptoMoE section 4.1-4.2) against a
straightforward reference, the executor option, and the upcycled-MoE fixture."""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.moe.routing import (
    BalancedRouting, balanced_dispatch, balanced_moe, capacity, gate_topk, priority_scores,
)
from cipherlm.models.upcycle import upcycle
from cipherlm.runtime.plain import DecoderExecutor, PlainLinear, split_params


def _ref_select(K, W, n, t):
    """Per expert: the routed (token, slot) pairs sorted by score (descending), first t kept."""
    m, k = K.shape
    keep, dropped = [], 0
    for i in range(n):
        pairs = [(W[a, b], a * k + b) for a in range(m) for b in range(k) if K[a, b] == i]
        pairs.sort(key=lambda p: (-p[0], p[1]))
        keep.append({j for _, j in pairs[:t]})
        dropped += max(0, len(pairs) - t)
    return keep, dropped


def _routing(rng, m, n, k, skew=0.0):
    logits = rng.standard_normal((m, n)) + skew * np.linspace(3, 0, n)
    p = np.exp(logits)
    p /= p.sum(1, keepdims=True)
    return gate_topk(p, k, norm_topk_prob=False)


@pytest.mark.parametrize("m,k,n,c,want", [(64, 8, 64, 1.0, 8), (64, 8, 64, 2.0, 16), (64, 4, 60, 1.0, 5),
                                          (64, 4, 60, 2.0, 9), (1, 2, 8, 2.0, 1), (4, 2, 2, 4.0, 4)])
def test_capacity(m, k, n, c, want):
    assert capacity(m, k, n, c) == want


@pytest.mark.parametrize("args", [(0, 1, 1, 1.0), (4, 3, 2, 1.0), (4, 1, 2, 0.0), (4, 1, 2, float("nan"))])
def test_capacity_rejects_bad_input(args):
    with pytest.raises(ValueError):
        capacity(*args)


@pytest.mark.parametrize("seed,m,n,k,c,skew", [(0, 16, 4, 2, 1.0, 0.0), (1, 32, 8, 2, 1.0, 2.0),
                                               (2, 32, 8, 3, 2.0, 3.0), (3, 7, 5, 1, 1.0, 1.0)])
def test_confidence_selection_matches_reference(seed, m, n, k, c, skew):
    rng = np.random.default_rng(seed)
    K, W = _routing(rng, m, n, k, skew)
    t = capacity(m, k, n, c)
    d = balanced_dispatch(K, W, n, t)
    ref_keep, ref_dropped = _ref_select(K, W, n, t)
    assert d.cand.shape == (n, t) and d.token.shape == (n, t)
    for i in range(n):
        assert set(d.cand[i, d.valid[i]].tolist()) == ref_keep[i]
        assert d.valid[i].sum() == min(t, int((K == i).sum()))
        assert np.all(d.score[i, ~d.valid[i]] == 0)
        assert len(set(d.cand[i].tolist())) == t  # dummies are distinct candidates
    assert np.array_equal(d.token, d.cand // k)
    assert d.dropped == ref_dropped
    assert d.dropped_fraction == pytest.approx(ref_dropped / (m * k))
    assert np.array_equal(d.load, np.bincount(K.reshape(-1), minlength=n))
    # the priority scores of Algorithm 1 lines 3-4
    S = priority_scores(K, W, n)
    assert np.allclose(S.sum(0), W.reshape(-1)) and np.all((S > 0).sum(0) == 1)


def test_skewed_routing_drops_and_generous_capacity_keeps_all():
    rng = np.random.default_rng(7)
    K, W = _routing(rng, 32, 8, 2, skew=4.0)
    tight = balanced_dispatch(K, W, 8, capacity(32, 2, 8, 1.0))
    loose = balanced_dispatch(K, W, 8, capacity(32, 2, 8, 4.0))  # t = m: nothing can be dropped
    assert tight.dropped > 0 and loose.dropped == 0
    # the kept pairs of the tight capacity are the highest-scored of each overloaded expert
    for i in np.nonzero(tight.load > tight.t)[0]:
        kept = tight.score[i, tight.valid[i]]
        lost = [W.reshape(-1)[j] for j in np.nonzero(K.reshape(-1) == i)[0] if j not in set(tight.cand[i].tolist())]
        assert kept.min() >= max(lost)


def test_random_selection_is_a_uniform_subset():
    rng = np.random.default_rng(3)
    K, W = _routing(rng, 32, 4, 2, skew=3.0)
    t = capacity(32, 2, 4, 1.0)
    conf = balanced_dispatch(K, W, 4, t)
    seen = set()
    for s in range(6):
        d = balanced_dispatch(K, W, 4, t, "random", np.random.default_rng(s))
        assert d.dropped == conf.dropped
        for i in range(4):
            sel = d.cand[i, d.valid[i]]
            assert np.all(K.reshape(-1)[sel] == i) and sel.size == min(t, d.load[i])
        seen.add(d.cand.tobytes())
    assert len(seen) > 1  # different seeds, different subsets
    d1 = balanced_dispatch(K, W, 4, t, "random", np.random.default_rng(0))
    d2 = balanced_dispatch(K, W, 4, t, "random", np.random.default_rng(0))
    assert np.array_equal(d1.cand, d2.cand)


def test_balanced_moe_output_matches_direct_sum():
    rng = np.random.default_rng(11)
    m, n, k, dm = 12, 4, 2, 5
    K, W = _routing(rng, m, n, k, skew=2.0)
    h = rng.standard_normal((m, dm))
    A = rng.standard_normal((n, dm, dm))
    fn = lambda e, rows: np.tanh(rows @ A[e])
    t = capacity(m, k, n, 1.0)
    out, d = balanced_moe(h, K, W, n, t, fn)
    keep, _ = _ref_select(K, W, n, t)
    ref = np.zeros((m, dm))
    for i in range(n):
        for j in keep[i]:
            ref[j // k] += W.reshape(-1)[j] * fn(i, h[j // k][None])[0]
    assert np.allclose(out, ref)
    Y = np.stack([fn(i, h[d.token[i]]) for i in range(n)])  # dummies included: weight zero
    assert np.allclose(d.combine(Y), ref)


def test_dispatch_rejects_bad_input():
    K = np.array([[0, 1], [1, 2]])
    W = np.full((2, 2), 0.5)
    with pytest.raises(ValueError):
        balanced_dispatch(K, W, 2, 1)          # expert id 2 >= n
    with pytest.raises(ValueError):
        balanced_dispatch(K, W[:, :1], 3, 1)   # shapes differ
    with pytest.raises(ValueError):
        balanced_dispatch(K, W, 3, 0)          # t < 1
    with pytest.raises(ValueError):
        balanced_dispatch(K, W, 3, 1, "fifo")
    with pytest.raises(ValueError):
        BalancedRouting(c=-1.0)


# ----------------------------------------------------------------------------- executor option + fixture

def _tiny_llama(seed=0, L=3, d=32, f=48, vocab=61):
    rng = np.random.default_rng(seed)
    g = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)
    cfg = dict(model_type="llama", hidden_size=d, intermediate_size=f, num_hidden_layers=L, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=vocab, rms_norm_eps=1e-6, max_position_embeddings=64,
               tie_word_embeddings=True, rope_theta=10000.0)
    w = {"model.embed_tokens.weight": g(vocab, d), "model.norm.weight": 1 + g(d)}
    for i in range(L):
        p = f"model.layers.{i}"
        w |= {f"{p}.input_layernorm.weight": 1 + g(d), f"{p}.post_attention_layernorm.weight": 1 + g(d),
              f"{p}.self_attn.q_proj.weight": g(d, d), f"{p}.self_attn.k_proj.weight": g(d // 2, d),
              f"{p}.self_attn.v_proj.weight": g(d // 2, d), f"{p}.self_attn.o_proj.weight": g(d, d),
              f"{p}.mlp.gate_proj.weight": g(f, d), f"{p}.mlp.up_proj.weight": g(f, d),
              f"{p}.mlp.down_proj.weight": g(d, f)}
    return cfg, w


def _executor(cfg, w, routing=None):
    client, server = split_params(cfg, w)
    return DecoderExecutor(cfg, client, PlainLinear(server, dtype=np.float64), moe_routing=routing)


def _moe_block(ex, layer, h):
    """The graph's MoE FFN of `layer` on its input h (the post-attention norm's output)."""
    src = f"L{layer}.ffn_norm"
    outs = [n.out for n in ex.graph.nodes if n.name in (f"L{layer}.moe.out", f"L{layer}.moe.combine")]
    nodes = [n for n in ex.graph.nodes if n.name in ex.needed([outs[-1]]) - ex.needed([src])]
    return ex.run_nodes(nodes, {src: h}, {"T": h.shape[0]})[outs[-1]]


def test_upcycle_is_deterministic_and_documented():
    cfg, w = _tiny_llama()
    c1, w1 = upcycle(cfg, w, n_experts=4, top_k=2, layers=[0, 2], noise=0.05, seed=5)
    c2, w2 = upcycle(cfg, w, n_experts=4, top_k=2, layers=[0, 2], noise=0.05, seed=5)
    _, w3 = upcycle(cfg, w, n_experts=4, top_k=2, layers=[0, 2], noise=0.05, seed=6)
    assert c1 == c2 and set(w1) == set(w2) and all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert not np.array_equal(w1["model.layers.0.mlp.experts.0.up_proj.weight"],
                              w3["model.layers.0.mlp.experts.0.up_proj.weight"])
    assert c1["model_type"] == "mixtral" and c1["mlp_only_layers"] == [1]
    assert c1["cipherlm_upcycle"]["moe_layers"] == [0, 2]
    base = w["model.layers.0.mlp.gate_proj.weight"]
    e0, e1 = w1["model.layers.0.mlp.experts.0.gate_proj.weight"], w1["model.layers.0.mlp.experts.1.gate_proj.weight"]
    rel = np.std(e0 - base) / np.std(base)
    assert 0.04 < rel < 0.06 and not np.array_equal(e0, e1)   # 5 % independent perturbations
    assert "model.layers.1.mlp.gate_proj.weight" in w1 and "model.layers.0.mlp.gate_proj.weight" not in w1
    with pytest.raises(ValueError):
        upcycle(c1, w1)   # not a dense Llama


def test_executor_balanced_option():
    cfg, w = _tiny_llama(seed=1)
    ucfg, uw = upcycle(cfg, w, n_experts=4, top_k=2, layers=[0, 1, 2], noise=0.3, router_scale=3.0, seed=1)
    ids = np.random.default_rng(2).integers(0, 61, 24)
    base = _executor(ucfg, uw)
    ref = base.forward(ids)
    assert base.last_moe_dispatch == {}  # default: the model's own routing, no dispatch record
    # t = m: every expert can take every token: identical to the unbalanced MoE
    full = _executor(ucfg, uw, BalancedRouting(c=2.0))
    assert np.allclose(full.forward(ids), ref, atol=1e-10)
    assert all(dsp.dropped == 0 and dsp.t == 24 for dsp in full.last_moe_dispatch.values())
    # tight capacity: drops happen, are reported, and change the output
    tight = _executor(ucfg, uw, BalancedRouting(c=1.0))
    out = tight.forward(ids)
    dsp = tight.last_moe_dispatch
    assert set(dsp) == {0, 1, 2} and all(x.t == 12 for x in dsp.values())
    assert sum(x.dropped for x in dsp.values()) > 0
    assert not np.allclose(out, ref)
    # routing before capacity is the model's own routing
    for layer, x in dsp.items():
        assert np.array_equal(x.load, np.bincount(tight.last_routing[layer].reshape(-1), minlength=4))
    rnd = _executor(ucfg, uw, BalancedRouting(c=1.0, selection="random"))
    rnd.forward(ids)
    # same layer-0 routing, so the same number of drops; a different choice of the kept pairs
    assert rnd.last_moe_dispatch[0].dropped == dsp[0].dropped
    assert not np.array_equal(rnd.last_moe_dispatch[0].cand, dsp[0].cand)
    # near-copies with renormalised top-k weights: the upcycled model stays close to the dense one
    dense = _executor(cfg, w).forward(ids)
    close = _executor(*upcycle(cfg, w, n_experts=4, top_k=2, layers=[0, 1, 2], noise=0.0, seed=1)).forward(ids)
    assert np.allclose(close, dense, atol=1e-9)


def test_calibrated_router_is_centred_and_scaled():
    from cipherlm.runtime.upcycled import router_inputs

    cfg, w = _tiny_llama(seed=3)
    ids = np.random.default_rng(4).integers(0, 61, 40)
    calib = router_inputs(cfg, w, ids, [0, 2])
    assert set(calib) == {0, 2} and calib[0].shape == (40, 32)
    ucfg, uw = upcycle(cfg, w, n_experts=4, layers=[0, 2], router_scale=1.5, calib=calib)
    assert ucfg["cipherlm_upcycle"]["calibrated"]
    for i in (0, 2):
        R = uw[f"model.layers.{i}.mlp.gate.weight"]
        mu = calib[i].mean(0)
        assert np.allclose(R @ mu, 0, atol=1e-4 * np.linalg.norm(mu) * np.abs(R).max())
        assert np.allclose((calib[i] @ R.T).std(0), 1.5, rtol=1e-4)
    # without calibration data the router falls back to the norm-weight scaling (different rows)
    _, uw2 = upcycle(cfg, w, n_experts=4, layers=[0, 2], router_scale=1.5)
    assert not np.allclose(uw2["model.layers.0.mlp.gate.weight"], uw["model.layers.0.mlp.gate.weight"])


def test_secure_layer_weights_and_reference_match_the_executor():
    """The 2pc server's MoE weights and shape of a graph's ``moe`` node (`passes.moe_blocks`)
    + `layer.plain_layer` (the secure layer's reference) compute the executor's own MoE
    block, unbalanced and balanced."""
    from cipherlm.compile import bind, build_graph
    from cipherlm.compile.passes import moe_blocks
    from cipherlm.moe.layer import plain_layer
    from cipherlm.runtime.twopc import moe_shape, moe_weights

    cfg, w = _tiny_llama(seed=5)
    ucfg, uw = upcycle(cfg, w, n_experts=4, top_k=2, layers=[1], noise=0.3, router_scale=3.0, seed=2)
    g = build_graph(ucfg)
    node = moe_blocks.run(g).node("L1.moe")
    shape = moe_shape(node)
    assert (shape.d, shape.n, shape.k, shape.f, shape.norm_topk_prob) == (32, 4, 2, 48, True)
    from cipherlm.models import normalize_weights

    mw = moe_weights(node, bind(g, normalize_weights(ucfg, uw)))
    mw.check(shape)
    h = np.random.default_rng(6).standard_normal((10, 32))
    for routing, c in ((None, None), (BalancedRouting(c=1.0), 1.0)):
        ex = _executor(ucfg, uw, routing)
        got = _moe_block(ex, 1, h)
        ref, disp = plain_layer(h, mw, shape, c=c)
        assert np.allclose(got, ref, atol=1e-5)
        if c is not None:
            assert np.array_equal(disp.cand, ex.last_moe_dispatch[1].cand) and disp.dropped > 0

"""The secure MoE layer (CryptoMoE sections 3-4, Algorithms 1 and 2) against the
plaintext balanced-routing layer, transcript independence from the routing, the
baselines, and the exact secure division of Algorithm 1 line 6."""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.moe.dispatch import div_params, div_public
from cipherlm.moe.layer import MoEShape, MoEWeights, moe_layer, plain_layer
from cipherlm.moe.routing import capacity
from cipherlm.mpc.context import MPCError
from cipherlm.mpc.runner import PartyFailed, run_inprocess
from cipherlm.mpc.ring import fixed_decode
from cipherlm.mpc.shares import AShare, share_input
from cipherlm.protocols.linear import he_session, linear

SHAPES = {
    # small random configs shaped like the three families (norm_topk_prob, shared expert, k)
    "qwen2_moe": MoEShape(d=16, n=6, k=3, f=8, norm_topk_prob=False, shared_f=8),
    "olmoe": MoEShape(d=16, n=8, k=4, f=8, norm_topk_prob=False),
    "mixtral": MoEShape(d=16, n=4, k=2, f=8, norm_topk_prob=True),
}
ROUTER_SCALE = {"qwen2_moe": 3.0, "olmoe": 1.0, "mixtral": 3.0}  # confident, but no vanishing top-k scores
M = 8
C = 1.0  # tight capacity: drops and dummies both occur


def _silu(v):
    return v / (1 + np.exp(-v))


def _margins_ok(X, w, shape, c):
    """Plain routing decisions far from ties (the secure scores carry ~1e-2 of
    fixed-point / exp approximation error), with drops and dummies both present."""
    logits = X @ w.router
    srt = -np.sort(-logits, axis=1)
    if np.min(srt[:, shape.k - 1] - srt[:, shape.k]) < 0.05:
        return False
    _, disp = plain_layer(X, w, shape, c=c)
    if disp.score[disp.valid].min() < 0.02:
        return False
    for i in range(shape.n):   # over-capacity experts: gap between the t-th and the next routed score
        routed = np.sort(_routed_scores(X, w, shape, i))[::-1]
        if routed.size > disp.t and routed[disp.t - 1] - routed[disp.t] < 0.03:
            return False
    full, _ = plain_layer(X, w, shape, c=None)
    ref, _ = plain_layer(X, w, shape, c=c)
    # drops must matter (so that a wrong selection is visible) and dummies must occur
    return np.abs(full - ref).max() > 0.1 and bool((~disp.valid).any())


def _routed_scores(X, w, shape, i):
    from cipherlm.moe.routing import gate_topk

    lg = X @ w.router
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    K, W = gate_topk(p, shape.k, shape.norm_topk_prob)
    return W[K == i]


def _instance(name, seed0=0):
    shape = SHAPES[name]
    for seed in range(seed0, seed0 + 200):
        rng = np.random.default_rng(seed)
        w = MoEWeights.random(shape, rng)
        w.router *= ROUTER_SCALE[name]
        X = rng.standard_normal((M, shape.d))
        if _margins_ok(X, w, shape, C):
            return shape, w, X
    raise AssertionError("no instance with clear routing margins")


def _warm(ctx, x, w):
    he_session(ctx)
    linear(ctx, x[:1, :2], None if w is None else w.router[:2, :1], out_features=1)


def _party(ctx, X, w, shape, variant, c, fused=True):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    _warm(ctx, x, w)
    ctx.chan.reset_stats()
    r = moe_layer(ctx, x, w, shape, variant=variant, c=c, fused_combine=fused)
    stats = ctx.chan.stats()
    y = r.y.reveal_float()
    tr = {k: v.reveal() for k, v in r.trace.items() if isinstance(v, AShare)}
    return y, tr, stats, r.t, r.phases


def _run(X, w, shape, variant="cryptomoe", c=C, fused=True):
    (y, tr, st0, t, ph), (_, _, st1, _, _) = run_inprocess(
        _party, args0=(X, None, shape, variant, c, fused), args1=(None, w, shape, variant, c, fused), timeout=600)
    return y, tr, (st0, st1), t, ph


def _tol(X, w, shape):
    """Bound on |secure - plain|: SiLU's 0.04 abs error through up and down projections,
    score error (exp / reciprocal, <= 1e-2) times the expert outputs, fixed-point rounding."""
    U = np.einsum("md,ndf->nmf", X, w.up)
    G = np.einsum("md,ndf->nmf", X, w.gate)
    Y = np.einsum("nmf,nfd->nmd", _silu(G) * U, w.down)
    colsum = np.abs(w.down).sum(axis=1).max()
    tol = 0.04 * np.abs(U).max() * colsum * shape.k + 1e-2 * shape.k * np.abs(Y).max() + 1e-2
    if shape.shared_f:
        Us = X @ w.shared_up
        tol += 0.04 * np.abs(Us).max() * np.abs(w.shared_down).sum(0).max() + 1e-2 * 5
    return tol


@pytest.mark.parametrize("name", list(SHAPES))
def test_secure_layer_matches_plain_balanced_routing(name):
    shape, w, X = _instance(name)
    ref, disp = plain_layer(X, w, shape, c=C)
    y, tr, _, t, phases = _run(X, w, shape)
    assert t == disp.t == capacity(M, shape.k, shape.n, C)
    # same selection: per expert the routed tokens kept, with their scores; dummies score 0
    tok = tr["token"].astype(np.int64)
    cand = tr["cand"].astype(np.int64)
    scores = fixed_decode(tr["scores"], 16, 64)
    assert np.array_equal(tok, cand // shape.k)
    for i in range(shape.n):
        real = scores[i] > 1e-3
        assert set(tok[i, real].tolist()) == set(disp.token[i, disp.valid[i]].tolist())
        assert set(cand[i, real].tolist()) == set(disp.cand[i, disp.valid[i]].tolist())
        assert np.allclose(np.sort(scores[i, real]), np.sort(disp.score[i, disp.valid[i]]), atol=1e-2)
        assert np.all(np.abs(scores[i, ~real]) <= 1e-3)
    err = np.abs(y - ref).max()
    assert err < _tol(X, w, shape), (err, _tol(X, w, shape))
    # the unbalanced layer differs (drops happened), so the comparison can fail
    full, _ = plain_layer(X, w, shape, c=None)
    assert np.abs(full - ref).max() > 3 * err
    assert set(phases) >= {"gate", "dispatch", "experts", "combine"}


def test_unfused_combine_is_algorithm_2_line_by_line():
    shape, w, X = _instance("mixtral")
    ref, _ = plain_layer(X, w, shape, c=C)
    y, *_ = _run(X, w, shape, fused=False)
    assert np.abs(y - ref).max() < _tol(X, w, shape)


def _loads(X, w, shape, c):
    return plain_layer(X, w, shape, c=c)[1].load


def test_transcript_does_not_depend_on_the_routing():
    shape = SHAPES["mixtral"]
    rng = np.random.default_rng(5)
    w = MoEWeights.random(shape, rng)
    w.router *= 3.0
    XA = rng.standard_normal((M, shape.d))
    u = w.router[:, 0] / np.linalg.norm(w.router[:, 0])
    XB = np.tile(6.0 * u, (M, 1)) + 0.01 * rng.standard_normal((M, shape.d))   # every token to expert 0
    la, lb = _loads(XA, w, shape, C), _loads(XB, w, shape, C)
    assert lb[0] == M and la.max() < M and np.count_nonzero(lb) < np.count_nonzero(la)
    _, _, (a0, a1), _, pa = _run(XA, w, shape)
    _, _, (b0, b1), _, pb = _run(XB, w, shape)
    for sa, sb in ((a0, b0), (a1, b1)):   # each party's view: per step, every counter identical
        assert sa == sb
    assert {k: {c: v for c, v in p.items() if c != "seconds"} for k, p in pa.items()} == \
           {k: {c: v for c, v in p.items() if c != "seconds"} for k, p in pb.items()}
    assert sum(s["bytes_sent"] for s in a0.values()) > 0


@pytest.mark.parametrize("variant", ["insecure", "dense"])
def test_baselines_match_the_unbalanced_layer(variant):
    shape, w, X = _instance("qwen2_moe")
    ref, _ = plain_layer(X, w, shape, c=None)
    y, tr, _, t, _ = _run(X, w, shape, variant=variant)
    assert np.abs(y - ref).max() < _tol(X, w, shape)
    assert t == (M if variant == "dense" else max(np.bincount(tr["K"].astype(np.int64).reshape(-1))))


def test_cipherprune_dispatch_matches_balanced_routing():
    shape, w, X = _instance("mixtral")
    ref, _ = plain_layer(X, w, shape, c=C)
    y, _, _, t, ph = _run(X, w, shape, variant="cipherprune")
    assert t == capacity(M, shape.k, shape.n, C)
    assert np.abs(y - ref).max() < _tol(X, w, shape)
    _, _, _, _, pc = _run(X, w, shape)
    # O(kmt) swaps of whole embeddings: more flights than Pi_dispatch's top-k
    assert ph["dispatch"]["rounds"] > pc["dispatch"]["rounds"]


@pytest.mark.parametrize("k,bound", [(3, 48), (6, 1 << 9), (5, 7), (7, 1 << 12)])
def test_division_constants_are_exact(k, bound):
    c, s = div_params(k, bound)
    x = np.arange(bound, dtype=object)
    assert all(int(v) * c >> s == int(v) // k for v in x)


def _div_party(ctx, vals, k, bound):
    x = share_input(ctx, vals if ctx.party == 0 else None, owner=0, frac=0)
    return div_public(ctx, x, k, bound).reveal()


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_secure_division_by_public_k(k):
    bound = 8 * k
    vals = np.arange(bound, dtype=np.uint64)
    out, _ = run_inprocess(_div_party, args0=(vals, k, bound), args1=(None, k, bound), timeout=120)
    assert np.array_equal(out.astype(np.int64), np.arange(bound) // k)


def _bad_party(ctx, shape, w, X, variant="cryptomoe"):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    return moe_layer(ctx, x, w, shape, variant=variant)


def test_bad_input_is_rejected():
    shape = SHAPES["mixtral"]
    w = MoEWeights.random(shape, np.random.default_rng(0))
    with pytest.raises(PartyFailed, match="expects shares of shape"):
        run_inprocess(_bad_party, args0=(shape, None, np.zeros((4, 7))), args1=(shape, w, None), timeout=60)
    bad = MoEWeights.random(shape, np.random.default_rng(0))
    bad.down = bad.down[:, :, :3]
    with pytest.raises(PartyFailed, match="MoE weight down"):
        run_inprocess(_bad_party, args0=(shape, None, np.zeros((4, 16))), args1=(shape, bad, None), timeout=60)
    with pytest.raises(PartyFailed, match="variant"):
        run_inprocess(_bad_party, args0=(shape, None, np.zeros((4, 16)), "sparse"),
                      args1=(shape, w, None, "sparse"), timeout=60)
    with pytest.raises(ValueError):
        MoEShape(d=8, n=2, k=3, f=4)
    with pytest.raises(MPCError, match="integer shares"):
        run_inprocess(_div_party_fixed, timeout=60)


def _div_party_fixed(ctx):
    return div_public(ctx, share_input(ctx, np.ones(3) if ctx.party == 0 else None, owner=0), 3, 8)


def _sample_party(ctx, X, w, shape, sample, batched):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    _warm(ctx, x, w)
    r = moe_layer(ctx, x, w, shape, c=C, expert_sample=sample, batch_experts=batched)
    return r.y.reveal_float(), r.phases


def test_per_expert_calls_and_expert_sample():
    shape, w, X = _instance("mixtral")
    ref, _ = plain_layer(X, w, shape, c=C)
    (y, ph), _ = run_inprocess(_sample_party, args0=(X, None, shape, None, False), args1=(None, w, shape, None, False),
                               timeout=300)
    assert np.abs(y - ref).max() < _tol(X, w, shape)   # unbatched experts: same function
    w1 = MoEWeights(router=w.router, gate=w.gate[:1], up=w.up[:1], down=w.down[:1])
    (_, ph1), _ = run_inprocess(_sample_party, args0=(X, None, shape, 1, True), args1=(None, w1, shape, 1, True),
                                timeout=300)
    (_, phb), _ = run_inprocess(_sample_party, args0=(X, None, shape, None, True), args1=(None, w, shape, None, True),
                                timeout=300)
    # one expert's FFN costs less than all four; per-expert calls cost more flights than one batch
    assert ph1["experts"]["bytes_sent"] < phb["experts"]["bytes_sent"]
    assert ph["experts"]["rounds"] > phb["experts"]["rounds"]
    assert ph1["dispatch"]["bytes_sent"] == phb["dispatch"]["bytes_sent"]


def test_secure_layer_as_two_processes():
    from cipherlm.mpc.runner import run_processes

    shape, w, X = _instance("mixtral")
    ref, _ = plain_layer(X, w, shape, c=C)
    (y, *_), _ = run_processes(_party, args0=(X, None, shape, "cryptomoe", C), args1=(None, w, shape, "cryptomoe", C),
                               timeout=300)
    assert np.abs(y - ref).max() < _tol(X, w, shape)


def _one_token_party(ctx, X, w, shape):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    r = moe_layer(ctx, x, w, shape, c=2.0)
    return r.y.reveal_float(), r.t


def test_decode_step_one_token():
    """m = 1 (KV-cached decoding): t = 1, every expert processes one (possibly dummy) row,
    nothing is dropped, so the output is the unbalanced layer's."""
    shape = SHAPES["qwen2_moe"]
    rng = np.random.default_rng(9)
    w = MoEWeights.random(shape, rng)
    X = rng.standard_normal((1, shape.d))
    (y, t), _ = run_inprocess(_one_token_party, args0=(X, None, shape), args1=(None, w, shape), timeout=300)
    ref, _ = plain_layer(X, w, shape, c=None)
    assert t == 1
    assert np.abs(y - ref).max() < _tol(X, w, shape)


def _simd_party(ctx, X, w, shape, batched):
    from cipherlm.protocols.linear_simd import simd_stats
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    r = moe_layer(ctx, x, w, shape, c=C, batch_experts=batched, expert_packing="simd")
    st = simd_stats(ctx)
    return r.y.reveal_float(), st.rotations, st.done_rotations


def test_simd_batch_matmul_experts():
    """The expert FFNs with SIMD/BSGS packing, per expert and CryptoMoE's batch MatMul
    (section 4.4): the same function as the plaintext layer; batching needs fewer rotations."""
    shape, w, X = _instance("mixtral")
    ref, _ = plain_layer(X, w, shape, c=C)
    rots = {}
    for batched in (False, True):
        (y, planned, _), (_, _, done) = run_inprocess(_simd_party, args0=(X, None, shape, batched),
                                                      args1=(None, w, shape, batched), timeout=600)
        assert np.abs(y - ref).max() < _tol(X, w, shape)
        assert planned == done
        rots[batched] = planned
    assert rots[True] < rots[False]

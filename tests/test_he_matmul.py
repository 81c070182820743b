import multiprocessing as mp

import numpy as np
import pytest

from cipherlm.he import (
    ClientKeys,
    HEContext,
    HEError,
    HEOpCounter,
    OFFLOAD_CKKS,
    apply,
    decrypt_output,
    encode_group,
    encode_matrix,
    encrypt_input,
    load_galois_keys,
    plan_matmul,
)
from cipherlm.he.matmul import split_output
from cipherlm.he.serialize import params_from_bytes, params_to_bytes

# max |y - Wx| relative to max(max_r sum_j |W_rj x_j|, max|W| max|x|).  The giant-step
# rotations run at one prime after the early rescale (docs/he_matmul.md), so each adds
# key-switching noise of about 2^-25 of the output scale; with a large bias lowering the
# weight scale (the 5000x64 case) the error reaches ~1.6e-7, so the bound is 1e-6.
TOL = 1e-6


@pytest.fixture(scope="module")
def ck():
    ctx = HEContext(OFFLOAD_CKKS)
    return ctx, ClientKeys(ctx)


def _run(ck, W, b, x, counter=None, **kw):
    ctx, keys = ck
    enc = encode_matrix(ctx, W, b, **kw)
    gk = load_galois_keys(ctx, keys.galois_keys_bytes(enc.plan.rotation_steps or [1]), [enc.plan])
    ct = encrypt_input(keys, x, enc.plan, counter)
    out = apply(enc, ct, gk, counter)
    return enc, decrypt_output(keys, out, enc.plan, counter)


def _check(y, W, b, x):
    ref = W.astype(np.float64) @ x + (0 if b is None else b)
    bound = np.max(np.abs(W) @ np.abs(x) + (0 if b is None else np.abs(b)))
    bound = max(bound, np.max(np.abs(W)) * np.max(np.abs(x)))
    err = np.max(np.abs(y - ref)) / bound
    assert err < TOL, err
    return err


@pytest.mark.parametrize(
    "d_out,d_in,bias",
    [(8, 8, False), (8, 8, True), (576, 576, False), (576, 1536, True), (5000, 64, False), (7, 3, True)],
)
def test_matmul_vs_numpy(ck, d_out, d_in, bias):
    rng = np.random.default_rng(d_out * 7 + d_in)
    W = rng.standard_normal((d_out, d_in)).astype(np.float32) * 0.05
    b = rng.standard_normal(d_out) if bias else None
    x = rng.standard_normal(d_in) * 2
    enc, y = _run(ck, W, b, x)
    assert y.shape == (d_out,)
    _check(y, W, b, x)
    if d_out > ck[0].slots:
        assert enc.plan.n_blocks > 1


def test_large_range_and_negative_inputs(ck):
    rng = np.random.default_rng(5)
    d = 64
    W = rng.standard_normal((48, d)) * np.logspace(-3, 2, d)[None, :]
    x = -np.abs(rng.standard_normal(d)) * np.logspace(3, -4, d)
    x[3] = -1e4
    b = rng.standard_normal(48) * 100
    _, y = _run(ck, W, b, x)
    err = _check(y, W, b, x)
    # CKKS error scales with max|W| max|x| (here 3.5e6, |y| ~ 40); the plan (c = 32) sums its
    # chunks on the server with 5 one-prime rotations, each adding key-switching noise
    # (~1e-8 of max|W| max|x|; measured up to 5.2e-8 here, 1e-7 on SmolLM2 shapes before and after)
    assert err < 2e-7
    _, y2 = _run(ck, W, None, x)
    _check(y2, W, None, x)


def test_zero_input_and_zero_rows(ck):
    W = np.zeros((10, 6))
    W[2, 1] = 3.0
    # the plan rotates at one prime (a giant step and the server's chunk sum): key-switching
    # noise ~1e-8 of max|W| max|x| per slot, as on every real shape (docs/he_matmul.md)
    _, y = _run(ck, W, None, np.zeros(6))
    np.testing.assert_allclose(y, 0.0, atol=1e-6)
    _, y = _run(ck, W, None, np.arange(6.0))
    np.testing.assert_allclose(y, W @ np.arange(6.0), atol=1e-6)


def test_grouped_qkv_like_1536x576(ck):
    ctx, keys = ck
    rng = np.random.default_rng(11)
    Ws = [rng.standard_normal((n, 576)) * 0.04 for n in (768, 576, 192)]
    bs = [rng.standard_normal(768), None, rng.standard_normal(192)]
    enc = encode_group(ctx, Ws, bs)
    assert enc.plan.d_out == 1536 and enc.plan.splits == (768, 576, 192)
    gk = keys.galois_keys(enc.plan.rotation_steps)
    x = rng.standard_normal(576)
    counter = HEOpCounter()
    out = apply(enc, encrypt_input(keys, x, enc.plan, counter), gk, counter)
    ys = decrypt_output(keys, out, enc.plan, counter, split=True)
    assert [y.shape[0] for y in ys] == [768, 576, 192]
    for y, W, b in zip(ys, Ws, bs):
        _check(y, W, b, x)
    ops = enc.plan.op_counts()
    assert counter.rotations == ops["rotations"]
    assert counter.multiply_plain == ops["multiply_plain"]
    assert counter.rescale == ops["rescale"]  # one per giant step (rescaled before rotating)
    assert enc.plan.n_blocks == counter.decrypt
    assert counter.encrypt == 1 and counter.bytes_in > 0 and counter.bytes_out > 0
    assert len(split_output(enc.plan, np.zeros(1536))) == 3


def test_plan_fits_and_rotations(ck):
    S = ck[0].slots
    for d_out, d_in in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (8, 8)]:
        p = plan_matmul(d_out, d_in, S)
        assert p.c * p.stride <= S
        assert p.n_blocks * p.rows >= d_out
        assert p.c * p.m >= p.n and p.g * p.b >= p.m
        assert p.c & (p.c - 1) == 0 and (p.c == 1 or p.c * p.stride == S)
        assert p.chunk_steps == [p.stride << i for i in range(p.c.bit_length() - 1)]
        assert all(0 < s < p.m for s in set(p.rotation_steps) - set(p.chunk_steps))


def test_rejects_wrong_input_and_keys(ck):
    ctx, keys = ck
    enc = encode_matrix(ctx, np.ones((4, 40)))
    with pytest.raises(HEError):
        encrypt_input(keys, np.ones(39), enc.plan)
    ct = encrypt_input(keys, np.ones(40), enc.plan)
    if enc.plan.rotation_steps:
        with pytest.raises(HEError, match="lack"):
            load_galois_keys(ctx, keys.galois_keys_bytes([ctx.slots - 1]), [enc.plan])
    other_keys = ClientKeys(ctx)
    gk = other_keys.galois_keys(enc.plan.rotation_steps or [1])
    out = apply(enc, ct, gk)  # wrong keys: garbage, but no crash
    assert decrypt_output(keys, out, enc.plan).shape == (4,)


def _server_proc(params_blob, W, gk_blob, ct_blob, q):
    from cipherlm.he import HEContext, apply, encode_matrix, load_galois_keys
    from cipherlm.he.serialize import params_from_bytes

    ctx = HEContext(params_from_bytes(params_blob))
    enc = encode_matrix(ctx, W)
    gk = load_galois_keys(ctx, gk_blob, [enc.plan])
    q.put(apply(enc, ct_blob, gk))


def test_separate_processes(ck):
    ctx, keys = ck
    rng = np.random.default_rng(2)
    W = rng.standard_normal((96, 200))
    x = rng.standard_normal(200)
    params_blob = params_to_bytes(ctx.params)
    plan = plan_matmul(96, 200, params_from_bytes(params_blob).slot_count)
    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    p = mpc.Process(
        target=_server_proc,
        args=(params_blob, W, keys.galois_keys_bytes(plan.rotation_steps or [1]), encrypt_input(keys, x, plan), q),
    )
    p.start()
    out = q.get(timeout=60)
    p.join(30)
    _check(decrypt_output(keys, out, plan), W, None, x)


# --------------------------------------------------------------------------- the backend's cost model
#: plan_matmul's choice (c, m, rows, n_blocks, g, b) for (d_out, d_in, has_bias, slots, workers),
#: recorded at f00ea77 when the constants were he.matmul.CostModel's defaults; the SEAL
#: backend's cost model (HEBackend.cost_model.offload) must give exactly the same plans
PLANS_BEFORE = {
    (576, 576, False, 4096, 1): (4, 72, 576, 1, 8, 9),
    (192, 576, True, 4096, 1): (16, 19, 192, 1, 4, 5),
    (1536, 576, False, 4096, 1): (2, 144, 1536, 1, 9, 16),
    (576, 1536, False, 4096, 1): (4, 192, 576, 1, 12, 16),
    (1536, 384, True, 4096, 2): (2, 97, 1536, 1, 7, 14),
    (384, 384, True, 4096, 4): (8, 25, 384, 1, 2, 13),
    (2048, 2048, False, 8192, 1): (8, 128, 683, 3, 16, 8),
    (64, 200, False, 4096, 1): (32, 4, 64, 1, 2, 2),
    (3, 10, False, 4096, 1): (4, 2, 3, 1, 1, 2),
}


def test_plans_unchanged_with_the_seal_cost_model():
    from cipherlm.he.backend import get_backend
    from cipherlm.he.matmul import CostModel

    seal_costs = get_backend("seal").cost_model.offload
    assert seal_costs == CostModel()  # the constants that were he.matmul.CostModel's defaults
    for (d_out, d_in, bias, slots, w), want in PLANS_BEFORE.items():
        for kw in ({}, {"backend": "seal"}, {"cost_model": seal_costs}):
            p = plan_matmul(d_out, d_in, slots, has_bias=bias, workers=w, **kw)
            assert (p.c, p.m, p.rows, p.n_blocks, p.g, p.b) == want, (d_out, d_in, kw)


def test_planner_reads_the_backends_cost_model(monkeypatch):
    """Another backend's constants change the plan: with baby-step rotations 100x dearer
    the planner takes fewer baby steps (the backend's ``cost_model.offload`` is what it reads)."""
    from cipherlm.he.backend import HECostModel, OffloadCostModel, get_backend
    from cipherlm.he.seal_backend import SealBackend

    before = plan_matmul(576, 576, 4096)
    slow = HECostModel(offload=OffloadCostModel(rotate=0.14))
    monkeypatch.setattr(SealBackend, "cost_model", slow)
    assert get_backend("seal").cost_model is slow
    after = plan_matmul(576, 576, 4096)
    assert after.g < before.g and after.cost() < before.cost()
    assert after.cost() == after.cost(slow.offload) and before.cost() > before.cost(OffloadCostModel())
    assert plan_matmul(576, 576, 4096, cost_model=OffloadCostModel()) == before

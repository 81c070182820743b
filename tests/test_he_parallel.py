"""ApplyPool (cipherlm.he.parallel): parallel apply == in-process apply, sessions, crashes, shutdown."""

import os
import signal
import threading
import time

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
    encrypt_input,
    load_galois_keys,
    plan_matmul,
)
from cipherlm.he.parallel import ApplyPool, split_units

TOL = 1e-6  # as tests/test_he_matmul.py

# (d_out per member, d_in, bias): n_blocks 1 and > 1, groups, a plan with fewer units than workers
SHAPES = [([576], 576, False), ([48, 16, 16], 64, True), ([5000], 64, True), ([7], 3, True), ([8], 8, False)]


@pytest.fixture(scope="module")
def setup():
    ctx = HEContext(OFFLOAD_CKKS)
    rng = np.random.default_rng(11)
    mats = []
    for outs, d_in, bias in SHAPES:
        Ws = [(rng.standard_normal((o, d_in)) * 0.05).astype(np.float32) for o in outs]
        bs = [rng.standard_normal(o) if bias else None for o in outs]
        plan = plan_matmul(sum(outs), d_in, ctx.slots, has_bias=bias, splits=outs, workers=2)
        mats.append((Ws, bs, plan))
    pool = ApplyPool(OFFLOAD_CKKS, workers=2, timeout=60)
    for gid, (Ws, bs, plan) in enumerate(mats):
        pool.add_matrix(gid, Ws, bs, plan)
    steps = sorted({s for _, _, p in mats for s in p.rotation_steps})
    yield ctx, pool, mats, steps
    pool.close()


def _ref(Ws, bs, x):
    W = np.concatenate(Ws).astype(np.float64)
    b = None if bs[0] is None else np.concatenate(bs)
    return W, b, W @ x + (0 if b is None else b)


def _check(y, W, b, x):
    ref = W @ x + (0 if b is None else b)
    bound = max(np.max(np.abs(W) @ np.abs(x) + (0 if b is None else np.abs(b))), np.max(np.abs(W)) * np.max(np.abs(x)))
    err = np.max(np.abs(y - ref)) / bound
    assert err < TOL, err


def test_split_units_cover_plan():
    for d_out, d_in in [(576, 576), (49152, 576), (3072, 576), (7, 3)]:
        p = plan_matmul(d_out, d_in, 4096, workers=2)
        for w in (1, 2, 3, 8):
            parts = split_units(p, w)
            flat = [u for part in parts for u in part]
            assert flat == [(o, i) for o in range(p.n_blocks) for i in range(p.b) if i * p.g < p.m]
            assert all(parts) and len(parts) <= w


def test_plan_workers_one_unchanged():
    for d_out, d_in in [(960, 576), (49152, 576), (576, 1536)]:
        assert plan_matmul(d_out, d_in, 4096) == plan_matmul(d_out, d_in, 4096, workers=1)


def test_parallel_equals_single_process(setup):
    ctx, pool, mats, steps = setup
    keys = ClientKeys(ctx)
    blob = keys.galois_keys_bytes(steps)
    sess = pool.open_session(blob)
    gk = load_galois_keys(ctx, blob)
    rng = np.random.default_rng(3)
    try:
        for gid, (Ws, bs, plan) in enumerate(mats):
            x = rng.standard_normal(plan.d_in) * 2
            ct = encrypt_input(keys, x, plan)
            c_par, c_one = HEOpCounter(), HEOpCounter()
            out = pool.apply(gid, ct, sess, c_par)
            enc = encode_group(ctx, Ws, bs, plan=plan)
            out1 = apply(enc, ct, gk, c_one)
            y = decrypt_output(keys, out, plan)
            y1 = decrypt_output(keys, out1, plan)
            W, b, _ = _ref(Ws, bs, x)
            _check(y, W, b, x)
            _check(y1, W, b, x)
            assert len(out) == len(out1)  # same framing: n_blocks one-prime ciphertexts
            assert c_par.multiply_plain == c_one.multiply_plain
            assert c_par.rotations >= c_one.rotations  # baby steps repeated per worker
            assert c_par.rescale >= plan.n_blocks
        assert sum(c.multiply_plain for c in pool.worker_counters) > 0
    finally:
        sess.close()


def test_concurrent_sessions_different_keys(setup):
    ctx, pool, mats, steps = setup
    clients = [ClientKeys(ctx) for _ in range(2)]
    sessions = [pool.open_session(k.galois_keys_bytes(steps)) for k in clients]
    errors = []

    def run(i):
        try:
            keys, sess = clients[i], sessions[i]
            rng = np.random.default_rng(100 + i)
            for rep in range(3):
                for gid in (0, 1, 2):
                    Ws, bs, plan = mats[gid]
                    x = rng.standard_normal(plan.d_in)
                    y = decrypt_output(keys, pool.apply(gid, encrypt_input(keys, x, plan), sess), plan)
                    W, b, _ = _ref(Ws, bs, x)
                    _check(y, W, b, x)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    for s in sessions:
        s.close()
    # a closed session cannot be used; the pool stays usable
    Ws, bs, plan = mats[4]
    ct = encrypt_input(clients[0], np.ones(plan.d_in), plan)
    with pytest.raises(HEError, match="session"):
        pool.apply(4, ct, sessions[0])


def test_bad_inputs_keep_pool_usable(setup):
    ctx, pool, mats, steps = setup
    keys = ClientKeys(ctx)
    with pytest.raises(HEError, match="lack rotation steps"):
        pool.open_session(keys.galois_keys_bytes([1]))
    sess = pool.open_session(keys.galois_keys_bytes(steps))
    Ws, bs, plan = mats[0]
    with pytest.raises(HEError):
        pool.apply(0, b"garbage", sess)
    with pytest.raises(HEError):
        pool.apply(99, b"garbage", sess)
    x = np.linspace(-1, 1, plan.d_in)
    y = decrypt_output(keys, pool.apply(0, encrypt_input(keys, x, plan), sess), plan)
    W, b, _ = _ref(Ws, bs, x)
    _check(y, W, b, x)
    sess.close()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_worker_crash_raises_not_hangs(how):
    ctx = HEContext(OFFLOAD_CKKS)
    keys = ClientKeys(ctx)
    W = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    plan = plan_matmul(256, 256, ctx.slots, workers=2)
    with ApplyPool(OFFLOAD_CKKS, workers=2, timeout=30) as pool:
        pool.add_matrix(0, [W], None, plan)
        sess = pool.open_session(keys.galois_keys_bytes(plan.rotation_steps))
        ct = encrypt_input(keys, np.ones(256), plan)
        pool.apply(0, ct, sess)
        if how == "exit":
            pool.crash_worker_for_test(1)
        else:
            os.kill(pool.worker_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(HEError, match="died"):
            pool.apply(0, ct, sess)
        assert time.monotonic() - t0 < 10
        with pytest.raises(HEError, match="broken"):
            pool.apply(0, ct, sess)
        procs = list(pool._procs)
    assert not any(p.is_alive() for p in procs)


def test_clean_shutdown():
    pool = ApplyPool(OFFLOAD_CKKS, workers=2)
    procs = list(pool._procs)
    assert all(p.is_alive() for p in procs)
    pool.close()
    pool.close()  # idempotent
    assert not any(p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)  # exited on request, not terminated
    with pytest.raises(HEError, match="closed"):
        pool.open_session(b"x")


def test_server_engine_workers():
    from cipherlm.runtime.linear_groups import LinearGroup
    from cipherlm.runtime.offload_engine import ClientEngine, ServerEngine

    rng = np.random.default_rng(5)
    groups = [LinearGroup(0, ("l.q", "l.k"), 320, (240, 80)), LinearGroup(1, ("l.o",), 240, (320,))]
    lin = {
        "l.q": (rng.standard_normal((240, 320)).astype(np.float32), rng.standard_normal(240).astype(np.float32)),
        "l.k": (rng.standard_normal((80, 320)).astype(np.float32), None),
        "l.o": (rng.standard_normal((320, 240)).astype(np.float32), None),
    }
    with ServerEngine(groups, lin, workers=2) as eng:
        assert eng.pool is not None and eng.plaintext_bytes > 0
        client = ClientEngine(eng.public_setup(), groups)
        sk = eng.load_client_keys(client.galois_keys_blob())
        for gid, g in enumerate(groups):
            x = rng.standard_normal(g.d_in)
            y = client.decrypt(gid, eng.apply(gid, client.encrypt(gid, x), sk))
            W = np.concatenate([lin[n][0] for n in g.names]).astype(np.float64)
            b = np.concatenate([lin[n][1] if lin[n][1] is not None else np.zeros(lin[n][0].shape[0]) for n in g.names])
            _check(y, W, b, x)
        assert sk.he_ops()[groups[0].op_class]["multiply_plain"] > 0
        eng.release(sk)
        with pytest.raises(HEError, match="released"):
            eng.apply(0, client.encrypt(0, np.ones(320)), sk)


def test_split_units_unchanged_with_the_seal_cost_model():
    """split_units under the SEAL backend's offload constants, recorded at f00ea77 (when
    they were he.matmul.CostModel's defaults)."""
    from cipherlm.he.backend import get_backend

    p = plan_matmul(1536, 384, 4096, has_bias=True, workers=2)
    want = [[(0, i) for i in range(8)], [(0, i) for i in range(8, 14)]]
    assert split_units(p, 2) == want
    assert split_units(p, 2, get_backend("seal").cost_model.offload) == want

"""SIMD/BSGS linear layers and CryptoMoE batch MatMul (cipherlm.protocols.linear_simd).

Checked against numpy: the diagonal/BSGS bookkeeping on plain slot vectors,
linear layers over random shapes (non-power-of-two dimensions, t = 1 decode),
batch MatMul across experts; counts (rotations, products, bytes) equal to the
plan; the client's decrypted values uniform and independent of the weights;
malformed replies rejected; one two-process run; the parameters' security.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from test_linear_2pc import assert_uniform_and_alike, client_views_for_two_weights

from cipherlm.he.params import check_security
from cipherlm.mpc.runner import PartyFailed, run_inprocess, run_processes
from cipherlm.mpc.shares import share_input
from cipherlm.protocols import linear_simd as S


def test_parameters_are_secure_and_batching():
    check_security(S.SIMD_BFV)  # 300 <= 438 bits for N = 16384
    p = S.SIMD_PRIME
    assert sympy.isprime(p) and p % (2 * S.SIMD_N) == 1 and 58 < np.log2(p) < 59
    from cipherlm.he.context import HEContext
    he = HEContext(S.SIMD_BFV)
    assert p not in he.coeff_moduli


@pytest.mark.parametrize("m,d,o,n,E", [(1, 5, 3, 64, 1), (3, 7, 10, 64, 1), (2, 20, 9, 128, 2),
                                       (5, 13, 40, 256, 3), (1, 33, 70, 128, 1), (4, 9, 6, 64, 2)])
def test_bsgs_packing_matches_numpy(m, d, o, n, E):
    """The packing and BSGS sums evaluated on slot vectors (no HE), for the planned and
    for forced (c, b) choices: equal to X @ W[expert] mod p."""
    rng = np.random.default_rng(m * d * o)
    p = S.SIMD_PRIME
    X = rng.integers(0, p, (m * E, d), dtype=np.uint64)
    W = rng.integers(-100, 100, (E, d, o))
    widx = np.repeat(np.arange(E), m)
    ref = np.stack([(X[r].astype(object) @ W[widx[r]].astype(object)) % p for r in range(m * E)])
    plans = [S.plan_simd(m * E, d, o, n)]
    tp = S._pow2(m * E)
    for c in (1, 2, 4, 8):
        if c * tp <= n // 2:
            plans += [S.plan_simd(m * E, d, o, n, c=c, b=b) for b in {1, 2, c} if b <= c]
    for plan in plans:
        got = S.simd_matmul_numpy(plan, X, W, widx, p)
        assert np.array_equal(got.astype(object), ref), (plan.c, plan.b)


def _linear_party(ctx, X, W, b, o):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    y = S.linear_simd(ctx, x, W if ctx.party == 1 else None, b if ctx.party == 1 else None, out_features=o,
                      cache_key="w")
    y2 = S.linear_simd(ctx, x, W if ctx.party == 1 else None, None, out_features=o, cache_key="w")
    st = S.simd_stats(ctx)
    return y.reveal_float(), y2.reveal_float(), (st.rotations, st.products, st.done_rotations, st.done_products,
                                                   st.galois_keys)


def _tol(d, xmax, wmax):
    return d * (xmax * 2.0 ** -(S.W_FRAC + 1) + wmax * 2.0 ** -(S.IN_FRAC + 1)) + 2.0 ** -14


@pytest.mark.parametrize("shape,d,o", [((1,), 24, 10), ((3,), 37, 50), ((2, 3), 40, 33)])
def test_linear_simd_matches_numpy(shape, d, o):
    rng = np.random.default_rng(d * o)
    X = rng.normal(size=shape + (d,))
    W = rng.normal(size=(d, o)) * 0.3
    b = rng.normal(size=o)
    (y, y2, c0), (_, _, c1) = run_inprocess(_linear_party, args0=(X, None, None, o), args1=(None, W, b, o),
                                            timeout=300)
    tol = _tol(d, np.abs(X).max(), np.abs(W).max())
    assert y.shape == shape + (o,)
    assert np.abs(y - (X @ W + b)).max() < tol
    assert np.abs(y2 - X @ W).max() < tol
    plan = S.plan_simd(int(np.prod(shape)), d, o, encode_weights=False)  # cache_key given
    # the server did exactly the planned rotations and products, twice; keys sent once
    assert c1[:4] == (2 * plan.rotations, 2 * plan.products, 2 * plan.rotations, 2 * plan.products)
    assert c0[4] == c1[4] == len(plan.steps)


def _bytes_party(ctx, X, W, o, plan):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    S.simd_session(ctx)
    S.ensure_galois_keys(ctx, S.simd_session(ctx), plan.steps)
    t0 = ctx.chan.totals()
    S.linear_simd(ctx, x, W if ctx.party == 1 else None, out_features=o, plan=plan)
    t1 = ctx.chan.totals()
    return t1["bytes_sent"] - t0["bytes_sent"] + t1["bytes_received"] - t0["bytes_received"]


@pytest.mark.parametrize("m,d,o,c,b", [(1, 30, 20, 8, 2), (4, 16, 40, 4, 4)])
def test_bytes_match_the_plan(m, d, o, c, b):
    rng = np.random.default_rng(1)
    X, W = rng.normal(size=(m, d)), rng.normal(size=(d, o)) * 0.1
    plan = S.plan_simd(m, d, o, c=c, b=b)
    got, _ = run_inprocess(_bytes_party, args0=(X, None, o, plan), args1=(None, W, o, plan), timeout=300)
    # ciphertexts (seeded inputs at 4 primes, results at 2) plus message framing
    assert abs(got - plan.bytes_estimate()) < 2e-3 * plan.bytes_estimate(), (got, plan.bytes_estimate())


def _batch_party(ctx, X, W, o, batched):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    y = S.batch_linear(ctx, x, W if ctx.party == 1 else None, out_features=o, batched=batched)
    st = S.simd_stats(ctx)
    return y.reveal_float(), st.done_rotations, st.done_products


@pytest.mark.parametrize("n,t,d,o", [(4, 2, 24, 20), (3, 1, 17, 9)])
def test_batch_linear_matches_numpy_and_saves_rotations(n, t, d, o):
    rng = np.random.default_rng(n * t * d)
    X = rng.normal(size=(n, t, d))
    W = rng.normal(size=(n, d, o)) * 0.3
    out = {}
    for batched in (True, False):
        (y, _, _), (_, rot, prod) = run_inprocess(_batch_party, args0=(X, None, o, batched),
                                                  args1=(None, W, o, batched), timeout=300)
        assert np.abs(y - np.einsum("etd,edo->eto", X, W)).max() < _tol(d, np.abs(X).max(), np.abs(W).max())
        out[batched] = (rot, prod)
    counts = S.batch_rotation_counts(n, t, d, o)
    assert out[True][0] == counts["batched"]["rotations"]
    assert out[False][0] == counts["per_expert"]["rotations"]
    assert counts["batched"]["rotations"] < counts["per_expert"]["rotations"]


def test_batch_rotations_scale_like_the_paper():
    """CryptoMoE appendix D: per-expert BSGS grows with n, batched with sqrt(n)."""
    per, bat = [], []
    for n in (4, 16, 64):
        c = S.batch_rotation_counts(n, 2, 256, 256)
        per.append(c["per_expert"]["rotations"])
        bat.append(c["batched"]["rotations"])
    assert per[2] / per[0] > 10 and bat[2] / bat[0] < 6, (per, bat)


# ----------------------------------------------------------------------------- views
def _view_party(ctx, reps, W):
    out = []
    for _ in range(reps):
        A = np.zeros((4, 16), np.uint64) if ctx.party == 0 else None
        out.append(S.cross_matmul_simd(ctx, A, W, np.zeros(4, np.int64), (4, 16, 12)))
    return np.stack(out) if ctx.party == 0 else None


def test_client_values_are_uniform_and_independent_of_weights():
    """With x_0 = 0 the client decrypts X W + R = R: uniform mod p, identically
    distributed for two very different weights (top and low bits, chi-square)."""
    assert_uniform_and_alike(client_views_for_two_weights(_view_party), S.SIMD_PRIME)


def _bad_reply_party(ctx, kind):
    he = S.simd_session(ctx)
    plan = S.plan_simd(2, 4, 3)
    if ctx.party == 1:  # a faulty evaluator
        S.ensure_galois_keys(ctx, he, plan.steps)
        ctx.recv()
        shape = (plan.out_cts + (kind == "count"), 2, he.n)
        c = np.zeros(shape, np.uint64)
        if kind == "range":
            c[...] = np.uint64(he.he.coeff_moduli[0])  # not reduced mod q
        ctx.send({"c1": c, "c0": c})
        return None
    return S.cross_matmul_simd(ctx, np.zeros((2, 4), np.uint64), None, np.zeros(2, np.int64), (2, 4, 3))


@pytest.mark.parametrize("kind,msg", [("count", "reply has shapes"), ("range", "reduced")])
def test_malformed_reply_is_rejected(kind, msg):
    with pytest.raises(PartyFailed, match=msg):
        run_inprocess(_bad_reply_party, args0=(kind,), args1=(kind,), timeout=120)


def _few_cts_party(ctx):
    he = S.simd_session(ctx)
    plan = S.plan_simd(2, 40, 3, c=4, b=2)
    if ctx.party == 0:  # a faulty client: one ciphertext short
        S.ensure_galois_keys(ctx, he, plan.steps)
        ctx.send({"cts": []})
        return None
    return S.cross_matmul_simd(ctx, None, np.zeros((1, 40, 3), np.int64), np.zeros(2, np.int64), (2, 40, 3),
                               plan=plan)


def test_wrong_ciphertext_count_is_rejected():
    with pytest.raises(PartyFailed, match="expected"):
        run_inprocess(_few_cts_party, timeout=120)


def test_linear_simd_two_processes():
    rng = np.random.default_rng(9)
    X = rng.normal(size=(3, 20))
    W = rng.normal(size=(20, 6)) * 0.2
    (y, _, _), _ = run_processes(_linear_party, args0=(X, None, None, 6), args1=(None, W, None, 6), timeout=300)
    assert np.abs(y - X @ W).max() < _tol(20, np.abs(X).max(), np.abs(W).max())


# ----------------------------------------------------------------------------- per-layer choice
def test_cost_model_choice():
    """Coefficient packing on a fast link, SIMD where bytes dominate (a 9 Mbit/s link):
    prefill shapes of docs/linear_2pc.md; the choice carries both estimates."""
    lan = S.choose_packing(128, 384, 1152, "LAN")
    slow = S.choose_packing(128, 384, 1152, "fastquery-9Mbps")
    assert lan.packing == "coeff" and lan.coeff_seconds < lan.simd_seconds
    assert slow.packing == "simd" and slow.simd_bytes < slow.coeff_bytes and slow.simd_rotations > 0


def _packing_party(ctx, X, W, o, packing):
    from cipherlm.protocols import linear as L
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    y = L.linear(ctx, x, W if ctx.party == 1 else None, out_features=o, packing=packing, network="fastquery-9Mbps")
    return y.reveal_float(), L.linear_stats(ctx).packings, S.simd_stats(ctx).calls


@pytest.mark.parametrize("packing", ["simd", "auto"])
def test_linear_packing_option(packing):
    rng = np.random.default_rng(2)
    X, W = rng.normal(size=(2, 3, 30)), rng.normal(size=(30, 11)) * 0.2
    (y, packs, calls), _ = run_inprocess(_packing_party, args0=(X, None, 11, packing), args1=(None, W, 11, packing),
                                         timeout=300)
    assert np.abs(y - X @ W).max() < _tol(30, np.abs(X).max(), np.abs(W).max())
    if packing == "auto":
        assert len(packs) == 1 and packs[0]["packing"] in ("coeff", "simd")
        assert calls == (packs[0]["packing"] == "simd")
    else:
        assert calls == 1 and packs == []


# ----------------------------------------------------------------------------- noise
def _noise_party(ctx, flood):
    """Encryptor: the remaining noise budget of one SIMD result before the modulus switch."""
    import tenseal.sealapi as seal

    from cipherlm.he import serialize

    he = S.simd_session(ctx)
    plan = S.plan_simd(1, 16, 16, c=16, b=4)
    S.ensure_galois_keys(ctx, he, plan.steps)
    if ctx.party == 0:
        pt = he.backend.encode_slots(he.he, S.pack_input(plan, np.arange(16, dtype=np.uint64)[None])[0])
        ctx.send({"ct": he.keys.encrypt_seeded(pt)})
        reply = ctx.recv()
        ct = serialize.numpy_to_ciphertext(he.he, np.stack([reply["c0"], reply["c1"]]), parms_id=he.top,
                                           is_ntt_form=False)
        return he.keys._decryptor.invariant_noise_budget(ct)
    if not flood:
        he.flood_bound = lambda bound: 1  # a test-only evaluator that does not flood
    ev = he.he.evaluator
    ct = serialize.ciphertext_from_bytes(he.he, bytes(ctx.recv()["ct"]), parms_id=he.top)
    rot = seal.Ciphertext()
    ev.rotate_rows(ct, plan.steps[0], S._keys_for(he, plan.steps[0]), rot)   # a baby step
    ev.transform_to_ntt_inplace(rot)
    rng = np.random.default_rng(0)
    # a plaintext with coefficients up to p / 2, like a weight diagonal
    pt = he.backend.encode_slots(he.he, rng.integers(0, S.SIMD_PRIME, he.n, dtype=np.uint64), level=he.top, ntt=True)
    acc = seal.Ciphertext()
    ev.multiply_plain(rot, pt, acc)
    ev.transform_from_ntt_inplace(acc)
    ev.rotate_rows_inplace(acc, plan.steps[-1], S._keys_for(he, plan.steps[-1]))  # a giant step
    c1, c0, _ = he.finish(acc, np.arange(he.n), S.simd_noise_bound(he, plan), send_level=he.top, ntt=False)
    ctx.send({"c1": c1, "c0": c0})
    return None


def test_simd_result_noise_is_flooded():
    """A rotated, slot-plaintext-multiplied, rotated result: flooding costs >= 40 bits of
    noise budget and the result still decrypts; without flooding the noise is below
    the worst-case bound `simd_noise_bound` uses (budget >= log q/p - log bound - 2)."""
    budgets = [run_inprocess(_noise_party, args0=(f,), args1=(f,), timeout=120)[0] for f in (False, True)]
    assert budgets[0] - budgets[1] >= 40, budgets
    assert budgets[1] > 0, budgets
    assert budgets[0] >= 240 - 59 - 105, budgets

"""The client-aided refresh of the fhe mode (cipherlm/protocols/ckks/refresh.py, Lattigo's
clg_ct_add_mask / clg_ct_refresh_plaintext) at the INSECURE N = 2^10 test preset: correctness
against numpy, the client's view statistically independent of the server's value, bad
input, and the evaluator running a tiny model with client refreshes instead of
bootstrapping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cipherlm.he.errors import HEError
from cipherlm.he.lattigo_backend import TEST_INSECURE_PRESET, LattigoBackend, LattigoContext, available
from cipherlm.protocols.ckks import refresh
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor
from cipherlm.protocols.ckks.packing import TokenPacking

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")


@pytest.fixture(scope="module")
def env():
    be = LattigoBackend()
    ctx = LattigoContext.from_preset(TEST_INSECURE_PRESET, allow_insecure_for_tests=True)
    return be, ctx, be.keygen(ctx)


def _encrypt_at(env, values, level):
    be, ctx, sk = env
    ct = sk.encrypt(be.encode_slots(ctx, values))
    be.mod_switch_to_inplace(ctx, ct, level)
    return ct


def _decode(env, ct):
    be, ctx, sk = env
    return be.decode_slots(ctx, sk.decrypt(ct))


def _roundtrip(env, ct, bound):
    """Steps 1-3 of the protocol, the bytes as they would travel."""
    be, ctx, sk = env
    masked, m = refresh.mask(be, ctx, ct, bound)
    back = refresh.reencrypt_blobs(be, ctx, sk, [be.ciphertext_to_bytes(masked)])
    fresh = be.ciphertext_from_bytes(ctx, back[0], level=ctx.max_level)
    return masked, refresh.unmask(be, ctx, fresh, m)


@pytest.mark.parametrize("level", [3, 6])  # the product below leaves it at 2 / 5
def test_refresh_returns_the_value_at_the_top_level(env, level):
    be, ctx, _ = env
    rng = np.random.default_rng(level)
    x = rng.uniform(-30, 30, ctx.slots)
    ct = _encrypt_at(env, x, level)
    y = be.multiply_scalar(ctx, ct, 0.5)  # a rescaled product: a scale that is not the default
    be.rescale_inplace(ctx, y)
    _masked, fresh = _roundtrip(env, y, bound=16.0)
    assert fresh.level == ctx.max_level
    assert abs(fresh.scale_bits - ctx.default_scale_bits) < 1e-9
    assert np.abs(_decode(env, fresh) - x / 2).max() < 1e-4
    # the fresh ciphertext computes like any other: a product and a rescale
    z = be.multiply_scalar(ctx, fresh, 0.25)
    be.rescale_inplace(ctx, z)
    assert np.abs(_decode(env, z) - x / 8).max() < 1e-4


def test_masked_ciphertext_decrypts_to_noise_the_value_cannot_be_read(env):
    """What the client decrypts is m + e + u: its slots are nowhere near the value, and the
    mask is as wide as the protocol says (lambda bits above the message)."""
    be, ctx, _ = env
    x = np.full(ctx.slots, 3.0)
    ct = _encrypt_at(env, x, 3)
    masked, m = refresh.mask(be, ctx, ct, bound=4.0)
    assert m.bits == refresh.mask_bits(ct.scale, 4.0) >= refresh.STATISTICAL_BITS + 40
    seen = _decode(env, masked)
    assert np.abs(seen).min() > 1e6 and np.abs(seen - x).max() > 2.0 ** (m.bits - 60)


def _coefficient0(ctx, pt) -> int:
    """The decrypted polynomial's constant coefficient, centred (what a client reads)."""
    res = pt.coefficients()[:, 0]
    qs = ctx.q_moduli[: len(res)]
    Q = math.prod(qs)
    v = sum(int(r) * (Q // q) * pow(Q // q, -1, q) for r, q in zip(res, qs)) % Q
    return v - Q if v > Q // 2 else v


def _ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b))))


def _client_view(env, value, samples, bound):
    """The constant coefficient of what the client decrypts (mask over value * Delta), over
    `samples` masks, in units of the mask's range 2^bits."""
    be, ctx, sk = env
    ct = _encrypt_at(env, np.full(ctx.slots, float(value)), 2)  # constant slots: coefficient 0 = value Delta
    out = []
    for _ in range(samples):
        masked, m = refresh.mask(be, ctx, ct, bound)
        out.append(_coefficient0(ctx, sk.decrypt(masked)) / 2.0 ** m.bits)
    return np.array(out)


@pytest.mark.parametrize("lam, leaks", [(refresh.STATISTICAL_BITS, False), (0, True)])
def test_client_view_is_independent_of_the_value(env, monkeypatch, lam, leaks):
    """The client's view (the constant coefficient it decrypts, where a constant value sits)
    for value 0 and value = bound: a two-sample KS test at the 0.01 % level finds no
    difference with the protocol's lambda = 80; with lambda = 0 (a mask only as wide as the
    message) the same test does find it, so it has the power to see a leak (bound 31: 2^bits
    = 64 Delta exactly, the value shifts the view by 24 % of its range, ~6 sigma above the
    critical value at n = 1500)."""
    monkeypatch.setattr(refresh, "STATISTICAL_BITS", lam)
    n, bound = 1500, 31.0
    a, b = _client_view(env, 0.0, n, bound), _client_view(env, bound, n, bound)
    assert np.abs(a).max() <= 1.0 and np.abs(b).max() <= 1.0 + 2.0 ** -lam
    crit = math.sqrt(-math.log(1e-4 / 2) / 2) * math.sqrt(2 / n)  # alpha = 1e-4
    assert (_ks(a, b) > crit) == leaks, _ks(a, b)


def test_mask_needs_room_in_the_modulus(env):
    be, ctx, _ = env
    ct = _encrypt_at(env, np.zeros(ctx.slots), 0)
    with pytest.raises(HEError, match="refresh from level 2"):
        refresh.mask(be, ctx, ct, bound=1.0)
    ct = _encrypt_at(env, np.zeros(ctx.slots), 2)
    with pytest.raises(HEError, match="cannot hide"):
        refresh.mask(be, ctx, ct, bound=2.0 ** 40)
    with pytest.raises(HEError, match="seed must be 32 bytes"):
        be.add_mask_inplace(ctx, ct, b"short", 100)
    with pytest.raises(HEError, match="does not fit"):
        be.add_mask_inplace(ctx, ct, bytes(32), 400)


def test_refresher_rejects_what_the_client_sends_back(env):
    be, ctx, sk = env
    ct = _encrypt_at(env, np.ones(ctx.slots), 3)
    good = refresh.ClientRefresher(be, ctx, lambda blobs: refresh.reencrypt_blobs(be, ctx, sk, blobs))
    assert np.abs(_decode(env, good([ct], 1.0)[0]) - 1).max() < 1e-4 and good.rounds == 1
    for back, msg in [(lambda b: [], "refreshed 0 ciphertexts"), (lambda b: ["x"], "not a byte blob"),
                      (lambda b: [b"\0" * 100], "lattigo"),
                      (lambda b: b, "expected 9")]:  # the masked ciphertexts themselves: wrong level
        with pytest.raises(HEError, match=msg):
            refresh.ClientRefresher(be, ctx, back)([ct], 1.0)


def test_reencrypt_refuses_garbage_from_the_server(env):
    be, ctx, sk = env
    with pytest.raises(HEError):
        refresh.reencrypt_blobs(be, ctx, sk, [b"CLGC" + b"\0" * 50])
    with pytest.raises(HEError, match="not a byte blob"):
        refresh.reencrypt_blobs(be, ctx, sk, [None])


def test_evaluator_keeps_the_floor_and_refreshes_through_the_client(env):
    be, ctx, sk = env
    ek = sk.eval_keys(relin=True)
    calls = []

    def exchange(blobs):
        calls.append(len(blobs))
        return refresh.reencrypt_blobs(be, ctx, sk, blobs)

    ev = CkksEvaluator(be, ctx, ek, refresher=refresh.ClientRefresher(be, ctx, exchange))
    assert ev.floor == refresh.MIN_LEVEL and ev.refresh_path == "client" and ev.reserve(1e6) == 0
    P = TokenPacking(ctx.slots, 4)
    x = np.random.default_rng(0).uniform(-1, 1, ctx.slots)
    t = CkksTensor([_encrypt_at(env, x, ctx.max_level)], 1, P, bound=1.0)
    # square 12 times: more levels than one ciphertext has, so the client refreshes
    want = x.copy()
    for _ in range(12):
        t = ev.refresh(t, 1, "sq")
        assert t.level >= 1 + ev.floor
        t = t.with_cts([ev.mul_ct(t.cts[0], t.cts[0])])
        want = want * want
    assert np.abs(_decode(env, t.cts[0]) - want).max() < 1e-3
    assert ev.stats.counts["client_refresh"] == len(calls) >= 1 and "bootstrap" not in ev.stats.counts
    with pytest.raises(HEError, match="needs 9 levels"):
        ev.refresh(t, 9, "deep")
    with pytest.raises(HEError, match="bootstrapping or by the client"):
        CkksEvaluator(be, ctx, ek, bootstrap_keys=object(), refresher=lambda c, b: c)


def test_mask_bits_formula():
    assert refresh.mask_bits(2.0 ** 40, 1.0) == math.ceil(math.log2(2 * 2.0 ** 40 * 2)) + 80
    with pytest.raises(HEError):
        refresh.mask_bits(float("nan"), 1.0)


@pytest.mark.parametrize("spare", [-1, 0, 1])
def test_polynomial_after_a_client_refresh_folds_its_change_of_variable(env, spare):
    """A polynomial on [lo, hi] != [-1, 1] whose input has too few levels is refreshed with
    the change of variable folded in; around the boundary (the input has depth - 1 + spare
    levels above the floor) the result is the function, whichever path was taken."""
    from cipherlm.fhe.approx import approximation
    from cipherlm.runtime.ops import activation

    be, ctx, sk = env
    ev = CkksEvaluator(be, ctx, sk.eval_keys(relin=True),
                       refresher=refresh.ClientRefresher(be, ctx, lambda b: refresh.reencrypt_blobs(be, ctx, sk, b)))
    a = approximation("silu", -6.0, 6.0, 1e-3)
    x = np.random.default_rng(4).uniform(-6, 6, ctx.slots)
    level = ev.floor + a.poly_depth - 1 + spare
    t = CkksTensor([_encrypt_at(env, x, level)], 1, TokenPacking(ctx.slots, 4), bound=6.0)
    y = ev.poly(t, a, "silu")
    assert np.abs(_decode(env, y.cts[0]) - activation("silu")(x)).max() < a.max_abs_error + 1e-4
    assert ev.stats.counts.get("client_refresh", 0) == (1 if spare < 1 else 0)

"""The fhe mode's CKKS operators (cipherlm/protocols/ckks) against numpy, at the INSECURE
N = 2^10 test preset (512 slots, levels 0..9 like the production preset; bootstrapping
keys in 0.3 s).  Every operator also keeps the layout's invariant: padding positions and
padding channels decrypt to 0."""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.fhe.approx import approximation
from cipherlm.he.errors import HEError
from cipherlm.he.lattigo_backend import TEST_INSECURE_PRESET, LattigoBackend, LattigoContext, available
from cipherlm.protocols.ckks import attention as A
from cipherlm.protocols.ckks import linear as L
from cipherlm.protocols.ckks import norm as NM
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor, pow2_at_least
from cipherlm.protocols.ckks.packing import TokenPacking, next_pow2
from cipherlm.runtime import ops

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")

T, HD = 5, 8


@pytest.fixture(scope="module")
def env():
    be = LattigoBackend()
    ctx = LattigoContext.from_preset(TEST_INSECURE_PRESET, allow_insecure_for_tests=True)
    sk = be.keygen(ctx)
    bk = sk.bootstrapping_keys()
    P = TokenPacking(ctx.slots, T)
    steps = L.rotation_steps(P) | A.rotation_steps(P, HD, [HD // 2, 1])
    k = 1
    while k < P.cpc:
        steps.add(k * P.tp)
        k *= 2
    ek = sk.eval_keys(relin=True, steps=sorted(steps))
    yield be, ctx, sk, ek, bk, P
    bk.close()


@pytest.fixture
def ev(env):
    be, ctx, sk, ek, bk, P = env
    return CkksEvaluator(be, ctx, ek, bk)


def enc(env, X, bound=1.0, level=None, packing=None):
    """X (T, d) encrypted in the env's packing (or ``packing``)."""
    be, ctx, sk, *_rest, P = env
    P = P if packing is None else packing
    cts = [sk.encrypt(be.encode_slots(ctx, r, level=level)) for r in P.pack(X)]
    return CkksTensor(cts, X.shape[1], P, bound)


def slots_of(env, t):
    be, ctx, sk, *_ = env
    return np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in t.cts])


def dec(env, t):
    return t.packing.unpack(slots_of(env, t), t.d)


def padding_max(env, t):
    P = t.packing
    v = slots_of(env, t).reshape(-1, P.tp)
    m = np.ones(v.shape, bool)
    m[: t.d, : P.tokens] = False
    return float(np.abs(v[m]).max())


def test_packing_layout_roundtrip():
    P = TokenPacking(512, 5)
    assert (P.tp, P.cpc) == (16, 32)
    X = np.arange(5 * 40, dtype=float).reshape(5, 40)
    s = P.pack(X)
    assert s.shape == (2, 512)
    assert s[0, 3 * 16 + 2] == X[2, 3] and s[1, 7 * 16 + 4] == X[4, 32 + 7]
    assert np.array_equal(P.unpack(s, 40), X)
    assert TokenPacking(512, 5, tp_min=32).tp == 32
    with pytest.raises(ValueError, match="slots"):
        TokenPacking(512, 300)


def test_linear_blocks_bias_and_position(env, ev):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(T, 40))  # two input blocks of 32 channels
    W, b = rng.normal(size=(70, 40)) / 6, rng.normal(size=70)  # three output blocks
    x = enc(env, X, 4)
    y = L.EncodedLinear(W, b, env[-1])(ev, x, bound=6)
    assert y.d == 70 and y.level == x.level - 1
    assert np.abs(dec(env, y) - (X @ W.T + b)).max() < 1e-6
    assert padding_max(env, y) < 1e-6
    mask = np.zeros(env[-1].tp)
    mask[T - 1] = 1
    z = L.EncodedLinear(W, b, env[-1], positions=mask)(ev, x, bound=6)
    s = slots_of(env, z).reshape(-1, env[-1].tp)
    assert np.abs(s[:70, T - 1] - (X[-1] @ W.T + b)).max() < 1e-6
    s[:70, T - 1] = 0
    assert np.abs(s).max() < 1e-6  # nothing else reaches the client
    with pytest.raises(HEError, match="channels"):
        L.EncodedLinear(W[:, :30], None, env[-1])(ev, x)


@pytest.mark.parametrize("shape", [(70, 40), (32, 96), (8, 8)])
def test_native_linear_equals_the_reference_path(env, ev, shape):
    """The one-call native projection (Lattigo's clg_tg_linear) and the per-diagonal Python
    path give the same values (and numpy's), with the same levels; sparse and all-zero
    output blocks included."""
    rng = np.random.default_rng(sum(shape))
    d_out, d_in = shape
    X = rng.normal(size=(T, d_in))
    W, b = rng.normal(size=(d_out, d_in)) / 6, rng.normal(size=d_out)
    W[: min(8, d_out), :] = 0  # a zero band
    x = enc(env, X, 4)
    outs = []
    for native in (True, False):
        lin = L.EncodedLinear(W, b, env[-1])
        lin.native = native
        outs.append(lin(ev, x, bound=6))
    a, r = outs
    assert a.level == r.level == x.level - 1 and a.d == r.d == d_out
    assert np.abs(dec(env, a) - dec(env, r)).max() < 1e-6
    assert np.abs(dec(env, a) - (X @ W.T + b)).max() < 1e-6
    assert padding_max(env, a) < 1e-6
    z = L.EncodedLinear(np.zeros((40, d_in)), None, env[-1])(ev, x)  # every block all zero
    assert np.abs(dec(env, z)).max() < 1e-6


def test_bootstrap_refresh_scales_large_values(env, ev):
    rng = np.random.default_rng(1)
    X = rng.uniform(-20, 20, size=(T, 32))
    x = enc(env, X, bound=20.0, level=1)
    y = ev.refresh(x, 5, "test")
    assert ev.stats.counts["bootstrap"] == 1 and y.level >= 5
    assert np.abs(dec(env, y) - X).max() < 1e-3
    assert ev.refresh(y, 5) is y  # enough levels: untouched
    assert pow2_at_least(20.0) == 32.0 and pow2_at_least(0.3) == 1.0
    with pytest.raises(HEError, match="levels"):
        ev.refresh(y, 50, "too deep")


@pytest.mark.parametrize("fn,lo,hi", [("gelu", -6.0, 6.0), ("silu", -6.0, 6.0)])
def test_activation_polynomials(env, ev, fn, lo, hi):
    X = np.random.default_rng(2).uniform(lo, hi, size=(T, 32))
    a = approximation(fn, lo, hi, 1e-3)
    y = ev.poly(enc(env, X, hi), a, fn)
    assert np.abs(dec(env, y) - ops.activation(fn)(X)).max() < a.max_abs_error + 1e-4
    assert padding_max(env, y) < 1e-4


def test_inverse_and_rsqrt_with_newton_steps(env, ev):
    X = np.random.default_rng(3).uniform(1.0, 30.0, size=(T, 32))
    for op, f in (("inv", lambda x: 1 / x), ("rsqrt", lambda x: 1 / np.sqrt(x))):
        a = approximation(op, 0.9, 33.0, 1e-3)
        y = ev.poly(enc(env, X, 33.0), a, op)
        got = dec(env, y)
        assert np.max(np.abs(got - f(X)) / f(X)) < 2 * a.max_rel_error + 1e-4, op


def test_layer_norm_and_rms_norm(env, ev):
    rng = np.random.default_rng(4)
    X = rng.normal(size=(T, 40)) * 2 + 0.5
    g, b = rng.normal(size=40), rng.normal(size=40)
    var = X.var(-1)
    a = approximation("rsqrt", var.min() / 2, var.max() * 2, 1e-3)
    y = NM.layer_norm(ev, enc(env, X, 8), g, b, 1e-5, a, bound=10)
    assert np.abs(dec(env, y) - ops.layer_norm(X, g, b, 1e-5)).max() < 1e-2
    assert padding_max(env, y) < 1e-4
    ms = (X * X).mean(-1)
    a2 = approximation("rsqrt", ms.min() / 2, ms.max() * 2, 1e-3)
    z = NM.rms_norm(ev, enc(env, X, 8), g, 1e-5, a2, bound=10)
    assert np.abs(dec(env, z) - ops.rms_norm(X, g, 1e-5)).max() < 1e-2
    assert padding_max(env, z) < 1e-4


@pytest.mark.parametrize("interleave", [False, True])
def test_rope(env, ev, interleave):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(T, 32))
    pos = np.arange(7, 7 + T)
    y = dec(env, A.rope(ev, enc(env, X, 4), pos, HD, 10000.0, interleave))
    H = 32 // HD
    h = X.reshape(T, H, HD).transpose(1, 0, 2)
    if interleave:  # the plain executor's halves layout = a per-head permutation of the pairs
        h = h.reshape(H, T, HD // 2, 2).transpose(0, 1, 3, 2).reshape(H, T, HD)
    want = ops.apply_rope(h, pos, ops.rope_inv_freq(HD, 10000.0))
    if interleave:
        want = want.reshape(H, T, 2, HD // 2).transpose(0, 1, 3, 2).reshape(H, T, HD)
    assert np.abs(y - want.transpose(1, 0, 2).reshape(T, 32)).max() < 1e-6


def test_attention_rotation_keys():
    """The keys the attention asks for: the shifts <= 0, and not causal the groups' +-T and
    +-p for the powers of two p < T (a shorter pass's spacing); no other positive shift
    (half the keys of every shift at 128 tokens); a causal model never rotates by a
    positive shift."""
    P = TokenPacking(512, T)
    full, causal = A.rotation_steps(P, HD), A.rotation_steps(P, HD, causal=True)
    assert {r % 512 for r in range(-(T - 1), 0)} | {T, 512 - T, 1, 2, 4, 512 - 4} <= full
    assert 3 not in full
    assert {r % 512 for r in range(-(T - 1), 0)} <= causal
    assert not causal & set(range(1, T + 1)) and 512 - T not in causal
    big = TokenPacking(1 << 15, 128)
    shifts = {s for s in A.rotation_steps(big, 32) if s < big.tp or s > big.slots - big.tp}
    assert len(shifts) == 127 + 1 + 8  # -127..-1, -128, +1, +2, ..., +128


def test_refit_drops_to_the_levels_asked_or_refreshes(env, ev):
    """`CkksEvaluator.refit`: a tensor above the levels asked is dropped to exactly them (the
    attention's products then run at the fewest primes), one below is refreshed first;
    the values are kept either way."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(T, 16))
    high = enc(env, X, 4)
    assert high.level > 3
    got = ev.refit(high, 3)
    assert got.level == 3 and high.level > 3  # the input is not modified
    assert np.abs(dec(env, got) - X).max() < 1e-6
    low = enc(env, X, 4, level=1)
    before = len(ev.stats.refreshes)
    got = ev.refit(low, 3)
    assert got.level == 3 and len(ev.stats.refreshes) == before + 1
    assert np.abs(dec(env, got) - X).max() < 1e-3


@pytest.mark.parametrize("T,offset,keys,tp_min,causal,spacing", [
    (5, 0, 5, 0, False, None), (32, 0, 32, 0, False, None), (3, 0, 3, 64, False, None), (1, 7, 8, 0, True, None),
    (4, 9, 13, 0, True, None), (6, 0, 6, 0, True, None),
    # a shorter pass of a session grouped at a power of two (or the session's T) above its T
    (5, 0, 5, 0, False, 8), (3, 0, 3, 64, False, 4), (20, 0, 20, 64, False, 32), (20, 0, 20, 64, False, 27),
    (1, 20, 21, 0, True, 16), (4, 9, 13, 0, True, 6)])
def test_shift_groups_give_every_diagonal_in_slots(T, offset, keys, tp_min, causal, spacing):
    """The grouping's slot arithmetic in numpy (np.roll for a slot rotation) over four
    channels, so that reads past a frame land in a neighbour's: every diagonal S_r of the
    grouped products equals Q[p] K[p + r] (0 out of range), and P.V's fold gives the sum."""
    rng = np.random.default_rng(T + offset)
    P = TokenPacking(4 * 64 if tp_min else 4 * next_pow2(2 * (offset + T)), T, tp_min, offset)
    Q = np.zeros((4, P.tp))
    K = np.zeros((4, P.tp))
    Q[:, offset:offset + T] = rng.normal(size=(4, T))
    K[:, :keys] = rng.normal(size=(4, keys))
    q, k = Q.reshape(-1), K.reshape(-1)
    rot = lambda x, r: np.roll(x, -r)  # noqa: E731 (slot i <- slot i + r)
    rs = A.shifts(T, offset, keys, causal)
    g = A.shift_groups(P, rs, spacing, keys)
    qg = sum(rot(q, -j * g.spacing) for j in range(g.count))
    got = {}
    for r in g.base:
        prod = qg * rot(k, r)
        for j, shift in g.members(r):
            got[shift] = rot(prod, j * g.spacing).reshape(4, P.tp)[:, offset:offset + T]
    assert sorted(got) == rs
    pos = np.arange(offset, offset + T)
    for r in rs:
        ok = (pos + r >= 0) & (pos + r < keys)
        want = np.where(ok, Q[:, pos] * K[:, np.clip(pos + r, 0, P.tp - 1)], 0.0)
        assert np.allclose(got[r], want)
    # P.V: P_r (any values at the pass's rows) placed at its group's positions, times rot(V, r)
    V = np.zeros((4, P.tp))
    V[:, :keys] = rng.normal(size=(4, keys))
    Pr = {r: np.zeros((4, P.tp)) for r in rs}
    for r in rs:
        Pr[r][:, pos] = rng.normal(size=(4, T))
    acc = 0
    for r in g.base:
        placed = sum(rot(Pr[shift].reshape(-1), -j * g.spacing) for j, shift in g.members(r))
        acc = acc + placed * rot(V.reshape(-1), r)
    out = sum(rot(acc, j * g.spacing) for j in range(g.count)).reshape(4, P.tp)[:, pos]
    want = sum(Pr[r][:, pos] * np.where((pos + r >= 0) & (pos + r < keys), V[:, np.clip(pos + r, 0, P.tp - 1)], 0)
               for r in rs)
    assert np.allclose(out, want)
    s = spacing or T
    if not causal and offset == 0:  # K and V rotated by shifts <= 0 only
        assert g.count >= 2 and len(g.base) == min(s, 2 * T - 1) and max(g.base) == 0
    if spacing == 16:  # a decoding step: 21 shifts on 16 rotations
        assert (g.count, len(g.base)) == (2, 16)


def _attention_oracle(seed: int, t: int, causal: bool = False, spread: float = 1.0, d: int = 32):
    """(Q, K, V, scale, S, want) of a numpy attention over t tokens, d channels, heads of HD:
    S the scaled scores (-inf where causal masks them), want the attention output (t, d)."""
    rng = np.random.default_rng(seed)
    Q, K, V = (rng.normal(size=(t, d)) * spread for _ in range(3))
    scale = 1 / np.sqrt(HD)
    qh, kh, vh = (m.reshape(t, d // HD, HD).transpose(1, 0, 2) for m in (Q, K, V))
    S = qh @ kh.transpose(0, 2, 1) * scale
    if causal:
        S = np.where(np.tril(np.ones((t, t)))[None] > 0, S, -np.inf)
    want = (ops.softmax(S, axis=-1) @ vh).transpose(1, 0, 2).reshape(t, d)
    return Q, K, V, scale, S, want


@pytest.mark.parametrize("causal", [False, True])
def test_attention_scores_softmax_values(env, ev, causal):
    d = 32
    Q, K, V, scale, S, want = _attention_oracle(6 + causal, T, causal)
    bound = float(np.abs(S[np.isfinite(S)]).max()) * 1.2
    s = A.scores(ev, enc(env, Q, 4), enc(env, K, 4), HD, scale, bound)
    assert sorted(s.cts) == list(range(-(T - 1), T))
    r1 = s.packing.unpack(slots_of(env, CkksTensor(s.cts[1], d, s.packing)), d)  # shift +1, head 0
    assert np.abs(r1[: T - 1, 0] - np.diagonal(Q[:, :HD] @ K[:, :HD].T * scale, 1)).max() < 1e-6
    e_iv, i_iv = A.softmax_intervals(bound, causal, HD, T, len(s.cts))
    p = A.softmax(ev, s, approximation("exp", *e_iv, 1e-6), approximation("inv", *i_iv, 1e-4), causal=causal)
    assert p.compact and len({id(c) for row in p.cts.values() for c, _j in row}) == 2  # 9 shifts in 2 chunks of 8
    before = ev.stats.counts.get("mul", 0)
    out = A.attend(ev, p, enc(env, V, 4), bound=4)
    assert np.abs(dec(env, out) - want).max() < 1e-3
    # grouped two shifts to a product (T = 5 queries, 16 positions: 9 shifts on 5 products)
    groups = A.shift_groups(s.packing, sorted(s.cts))
    assert (groups.count, len(groups.base)) == (2, 5)
    assert ev.stats.counts["mul"] - before == len(groups.base)
    # outside the pass's positions: the other group's partial sums, which the projection
    # after attention drops with its token mask
    y = L.EncodedLinear(np.eye(d), None, s.packing)(ev, out, bound=4)
    assert np.abs(dec(env, y) - want).max() < 1e-3
    assert padding_max(env, y) < 1e-4
    with pytest.raises(HEError, match="exp approximated"):
        A.softmax(ev, s, approximation("exp", -4.0, 0.0, 1e-4), approximation("inv", 0.5, 10.0, 1e-3))
    rel, over = A.relu_series(10.0)
    x = np.linspace(-10, 10, 10001)
    assert np.all(rel(x) >= np.maximum(x, 0) - 1e-9) and np.all(rel(x) <= np.maximum(x, 0) + over + 1e-9)


def test_attention_of_a_shorter_pass_groups_at_a_power_of_two(env, ev):
    """A pass of 3 tokens in a session whose keys were made for T = 5 (no key for +-3, and
    no positive shift but the powers of two): grouped 4 apart, on 4 rotations of K (5
    shifts), and equal to numpy."""
    ctx, P5 = env[1], env[-1]
    t = 3
    P = TokenPacking(ctx.slots, t, tp_min=P5.tp)
    d = 32
    Q, K, V, scale, S, want = _attention_oracle(31, t)
    bound = float(np.abs(S).max()) * 1.2

    g = A._grouping(ev, P, A.shifts(t), t)
    assert (g.spacing, g.count, g.base) == (4, 2, (-3, -2, -1, 0))
    before = ev.stats.counts.get("mul", 0)
    s = A.scores(ev, enc(env, Q, 4, packing=P), enc(env, K, 4, packing=P), HD, scale, bound)
    assert ev.stats.counts["mul"] - before == 4 and sorted(s.cts) == [-2, -1, 0, 1, 2]
    e_iv, i_iv = A.softmax_intervals(bound, False, HD, t, len(s.cts))
    p = A.softmax(ev, s, approximation("exp", *e_iv, 1e-6), approximation("inv", *i_iv, 1e-4))
    out = A.attend(ev, p, enc(env, V, 4, packing=P), bound=4)
    y = L.EncodedLinear(np.eye(d), None, P)(ev, out, bound=4)
    assert np.abs(P.unpack(slots_of(env, y), d) - want).max() < 1e-3


def test_softmax_of_scores_at_level_0_with_a_large_comparison_range(env, ev):
    """Regression (found running MiniLM at 8 tokens on two workers): scores that arrive at
    level 0 with a small bound, but a comparison range R + MASK_GAP above LEVEL0_MAX_FACTOR:
    the masked scores and the running maximum must keep the level their bootstrap needs
    (it was refused: "bound 36.4 at level 0 is too large to bootstrap")."""
    Q, K, V, scale, S, want = _attention_oracle(12, T, spread=1.6)
    bound = max(float(np.abs(S).max()) * 1.2, 8.0)
    assert ev.reserve(bound) == 0 and ev.reserve(A.relu_range(bound, False) + A.MASK_GAP) == 1
    s = A.scores(ev, enc(env, Q, 8, level=2), enc(env, K, 8, level=2), HD, scale, bound)
    assert s.level == 0
    e_iv, i_iv = A.softmax_intervals(bound, False, HD, T, len(s.cts))
    p = A.softmax(ev, s, approximation("exp", *e_iv, 1e-6), approximation("inv", *i_iv, 1e-4))
    out = A.attend(ev, p, enc(env, V, 8), bound=8)
    assert np.abs(dec(env, out) - want).max() < 1e-2

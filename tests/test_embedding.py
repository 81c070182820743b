"""Private embedding lookup (FastQuery, fastquery_002 sections 4.2-4.3; Cheetah baseline).

Small tables, N = 4096, in process (one run as two OS processes).  Every lookup
is compared with the quantised table in numpy; the ablation's bytes must
decrease row by row; view tests check that the client's decrypted values are
uniform and that flooding hides the table-dependent noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cipherlm.he.backend import backend_unavailable_reason
from cipherlm.mpc.ot import OTSession
from cipherlm.mpc.runner import PartyFailed, run_inprocess
from cipherlm.protocols import embedding as E
from cipherlm.protocols import embedding_he as H

ROWS = [m.name for m in E.ABLATION] + ["exact"]
P_MIN = 1e-6
#: PackLWEs packers (`E.PACKERS`): SEAL's always, the Go/Lattigo one when its library is built
_LATTIGO_WHY = backend_unavailable_reason("lattigo")
_NEEDS_LATTIGO = pytest.mark.skipif(_LATTIGO_WHY is not None,
                                    reason=f"the Lattigo library is not built or does not load: {_LATTIGO_WHY}")
PACKERS = ["seal", pytest.param("lattigo", marks=_NEEDS_LATTIGO)]


def _chi2_sf(x: float, df: int) -> float:
    """Chi-square upper tail (Wilson-Hilferty normal approximation)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _p_uniform(counts) -> float:
    c = np.asarray(counts, float)
    e = c.sum() / c.size
    return _chi2_sf(float(((c - e) ** 2 / e).sum()), c.size - 1)


def _p_homogeneous(table) -> float:
    t = np.asarray(table, float)
    t = t[:, t.sum(0) > 0]
    e = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
    return _chi2_sf(float(((t - e) ** 2 / e).sum()), (t.shape[0] - 1) * (t.shape[1] - 1))


def _p_same_variance(a, b) -> float:
    """Two-sided p of equal variances (log variance ratio, normal approximation)."""
    z = math.log(np.var(a, ddof=1) / np.var(b, ddof=1)) / math.sqrt(2 / (a.size - 1) + 2 / (b.size - 1))
    return math.erfc(abs(z) / math.sqrt(2))


def _table(V, d, seed=0, scale=0.05):
    rng = np.random.default_rng(seed)
    t = rng.normal(0, scale, (V, d))
    t[:, 0] *= 8  # one channel with much larger values (mixed precision picks it)
    return t


ONLINE_STEPS = ("embedding.query", "embedding.response", "embedding.select")


def _run_steps(table, ids, method, flood_bits=0, runner=run_inprocess, packer=None):
    """One lookup; (values, server's setup, client's and server's per-step channel statistics)."""
    V, d = table.shape

    def f(ctx):
        st = E.setup(ctx, table if ctx.party == 1 else None, vocab_size=V, dim=d, method=method,
                     flood_bits=flood_bits, packer=packer)
        before = ctx.chan.stats()
        out = E.lookup(ctx, st, ids if ctx.party == 0 else None)
        after = ctx.chan.stats()
        steps = {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in ("bytes_sent", "bytes_received", "rounds")}
                 for k, v in after.items()}
        return out.data, st, steps

    (a, st0, s0), (b, st1, s1) = runner(f, timeout=600)
    return (a + b).view(np.int64).astype(np.float64) / 2.0 ** st0.frac, st1, s0, s1


def _run(table, ids, method, flood_bits=0, runner=run_inprocess, packer=None):
    """One lookup; (values, server's setup, online bytes both ways)."""
    val, st, s0, s1 = _run_steps(table, ids, method, flood_bits, runner, packer)
    return val, st, sum(s[k]["bytes_sent"] for s in (s0, s1) for k in ONLINE_STEPS if k in s)


def _with_packers(methods):
    """(method, packer) cases: every packer for the PackLWEs rows, SEAL's (unused) for the others."""
    cases = []
    for m in methods:
        cases.append((m, "seal"))
        if E.METHODS[m].packlwe:
            cases.append(pytest.param(m, "lattigo", marks=_NEEDS_LATTIGO))
    return cases


@pytest.mark.parametrize("method,packer", _with_packers(ROWS))
def test_lookup_matches_quantised_table(method, packer):
    table = _table(300, 7)
    ids = np.array([299, 0, 17, 17, 123])
    val, st, _ = _run(table, ids, method, packer=packer)
    assert st.packer == (packer if E.METHODS[method].packlwe else "")
    ref = E.quantized_rows(table[ids], st)
    assert np.array_equal(val, ref)
    # and the quantised rows approximate the table within half a step per channel
    step = np.exp2(st.exp)
    assert np.all(np.abs(ref - table[ids]) <= step[None, :] / 2 + 1e-12)


def test_fastquery_with_40_bit_flooding_correct():
    table = _table(5000, 10, seed=3)  # two input blocks
    ids = np.array([4999, 4096, 4095, 1])
    val, st, _ = _run(table, ids, "fastquery", flood_bits=40)
    assert st.plan.flood > 2**40 and st.shape.blocks == 2
    assert np.array_equal(val, E.quantized_rows(table[ids], st))


@pytest.mark.parametrize("method", ["exact", "cheetah"])
def test_default_session_flooding_correct_and_counted(method):
    """The default flooding is the 2pc mode's per-session width (he_session.FLOOD_SIGMA,
    N = 8192, flooding wider than 2^93 drawn in limbs) and the server counts what it floods."""
    from cipherlm.mpc.he_session import FLOOD_SIGMA, flood_counter

    table = _table(300, 7)
    ids = np.array([299, 0, 17])

    def f(ctx):
        st = E.setup(ctx, table if ctx.party == 1 else None, vocab_size=300, dim=7, method=method)
        out = E.lookup(ctx, st, ids if ctx.party == 0 else None)
        return out.data, st, flood_counter(ctx).count

    (a, st0, n0), (b, st1, n1) = run_inprocess(f, timeout=600)
    assert st1.plan.flood_bits == FLOOD_SIGMA and st1.plan.n == 8192
    assert st1.plan.flood >= 2 ** FLOOD_SIGMA * st1.plan.bound_out
    val = (a + b).view(np.int64).astype(np.float64) / 2.0 ** st0.frac
    assert np.array_equal(val, E.quantized_rows(table[ids], st1))
    assert n0 == 0 and n1 > 0


def test_block_ot_sends_one_query_ciphertext_per_token():
    """+blockot: one query ciphertext per token (not ceil(V / N)), the block chosen by
    OT; every id (each of the 3 blocks, the partly filled last one included) exact."""
    table = _table(9000, 10, seed=3)
    ids = np.array([8999, 4096, 4095, 1, 8192])
    val, st, c_steps, _ = _run_steps(table, ids, "+blockot", flood_bits=40)
    assert st.sel_blocks == 3 and st.shape.blocks == 1 and st.plan.flood > 2**40
    assert np.array_equal(val, E.quantized_rows(table[ids], st))
    one_ct = H.packed_size(st.plan.n, st.rns.bits)  # c0 of one seeded ciphertext
    assert c_steps["embedding.query"]["bytes_sent"] < len(ids) * one_ct + 200
    _, st_fq, fq_steps, _ = _run_steps(table, ids, "fastquery", flood_bits=40)
    assert fq_steps["embedding.query"]["bytes_sent"] > 2.5 * c_steps["embedding.query"]["bytes_sent"]


def test_block_ot_over_groups_of_blocks():
    """+blockot2: two query ciphertexts per token cover a group of two blocks, the group chosen
    by OT: 4 blocks make 2 groups, the last one partly filled; every id exact, the query twice
    +blockot's, the server's leaves (packed values) half of them."""
    table = _table(3 * 4096 + 5, 10, seed=5)
    ids = np.array([3 * 4096 + 4, 8192, 8191, 0, 4100])
    val, st, c_steps, _ = _run_steps(table, ids, "+blockot2", flood_bits=40)
    assert st.sel_blocks == 2 and st.shape.blocks == 2 and st.shape.vocab == 2 * 4096
    assert np.array_equal(val, E.quantized_rows(table[ids], st))
    _, st1, c1_steps, _ = _run_steps(table, ids, "+blockot", flood_bits=40)
    assert st1.sel_blocks == 4 and st.shape.n_cols * 2 == st1.shape.n_cols
    q1, q2 = (s["embedding.query"]["bytes_sent"] for s in (c1_steps, c_steps))
    assert 1.9 * q1 < q2 < 2.1 * q1 + 200


def test_block_table_groups_k_blocks():
    """`_block_table`: row r, column g c + j of the k = 2 layout holds W[2 g N + r, j]."""
    n, c = 8, 3
    W = np.arange(5 * n * c).reshape(5 * n, c)[: 5 * n - 2]
    out = E._block_table(W, n, 2)
    assert out.shape == (2 * n, 3 * c)
    for r in range(2 * n):
        for g in range(3):
            v = g * 2 * n + r
            assert np.array_equal(out[r, g * c:(g + 1) * c], W[v] if v < len(W) else np.zeros(c))


def test_view_block_selection(monkeypatch):
    """The client's view in +blockot: the decrypted rows of every block (u_b = W_b[a] -
    S_b) and its final share (u_blk + m_blk = W[id] - R) are uniform mod t and do not
    depend on the table (two constant tables; chi-square on the top and low 4 bits);
    the server's transcript (bytes and rounds of every step) is the same whichever
    block the client's ids fall in."""
    decrypted = _capture_client(monkeypatch)
    finals = []
    orig = E._extend

    def spy(ctx, st, share):
        if ctx.party == 0:
            finals.append(np.asarray(share, np.uint64).copy())
        return orig(ctx, st, share)

    monkeypatch.setattr(E, "_extend", spy)
    V, d = 2 * 4096 + 10, 3 * 100
    ids = np.array([5, 5, 4101, 8195])
    views = []
    for const in (0.0, 0.9):
        table = np.full((V, d), const)
        table[:, ::7] = -0.45  # fix the scales
        _run_steps(table, ids, "+blockot")
        u = decrypted[-1][3]
        assert u.shape == (len(ids), 3 * 100)
        views.append((u.reshape(-1).astype(np.int64), finals[-1].reshape(-1).astype(np.int64)))
    tb = decrypted[-1][0].plan.t_bits
    for k in range(2):
        for v in (views[0][k], views[1][k]):
            for bins in (v >> (tb - 4), v & 15):
                assert _p_uniform(np.bincount(bins, minlength=16)) > P_MIN
        for sh in (tb - 4, 0):
            assert _p_homogeneous([np.bincount((views[j][k] >> sh) & 15, minlength=16) for j in range(2)]) > P_MIN
    table = _table(V, d, seed=4)
    server = [_run_steps(table, np.array(b), "+blockot")[3] for b in ([0, 1], [8200, 4096])]
    assert server[0] == server[1]


@pytest.mark.parametrize("packer", PACKERS)
def test_packlwes_over_several_ciphertexts(packer):
    """5 tokens x 820 columns = 4100 values: two PackLWEs output ciphertexts."""
    table = _table(40, 820, seed=7)
    ids = np.array([39, 0, 5, 5, 20])
    val, st, _ = _run(table, ids, "exact", packer=packer)
    assert st.packer == packer
    assert -(-len(ids) * st.shape.n_cols // st.plan.n) == 2
    assert np.array_equal(val, E.quantized_rows(table[ids], st))


def test_two_processes_through_the_bench_row():
    from cipherlm.bench.embedding import run_row

    # 77 bits: the 2pc session's default flooding, whose bound exceeds 2^64 (the row's log2
    # of it once failed on numpy)
    row = run_row("fastquery", 200, 6, 77, np.array([3, 199]), seed=5, processes=True, timeout=300)
    assert row["correct"] and row["max_abs_error_vs_quantized"] == 0.0
    assert row["flood_bound_log2"] > 64
    assert row["query_bytes"] > 0 and row["response_bytes"] > 0 and row["extension_bytes"] > 0


def test_bytes_decrease_along_the_ablation():
    table = _table(6000, 96, seed=1)
    ids = np.array([5])
    sizes = {m: _run(table, ids, m)[2] for m in (r.name for r in E.ABLATION)}
    order = [r.name for r in E.ABLATION]
    assert sizes["+quant"] == sizes["cheetah"]  # quantisation alone changes nothing (Table 6)
    for a, b in zip(order[1:], order[2:]):
        assert sizes[b] < sizes[a], (a, b, sizes)
    assert sizes["fastquery"] * 5 < sizes["cheetah"]


def test_mixed_precision_quantiser_and_packing():
    table = _table(64, 10, seed=2)
    qt = E.quantize(table, "mixed433")
    absmean = np.abs(table).mean(axis=0)
    four = set(np.argsort(-absmean)[:4])  # ceil(10/3) = 4 channels at 4 bits
    assert {int(c) for c in np.nonzero(qt.bits == 4)[0]} == four
    assert set(qt.bits.tolist()) == {3, 4}
    for c in range(10):
        b = int(qt.bits[c])
        assert qt.q[:, c].min() >= -(2 ** (b - 1)) and qt.q[:, c].max() <= 2 ** (b - 1) - 1
    assert np.all(np.abs(qt.dequantize() - table) <= np.exp2(qt.exp)[None, :] / 2 + 1e-12)
    lay = E.make_layout(qt.bits, qt.absmean, E.METHODS["fastquery"])
    assert lay.t_bits == 13 and lay.n_coeff == 4
    assert np.all(lay.width[:, 0] == 4) and list(lay.off[0]) == [0, 5, 9]
    W = lay.pack(qt)
    assert W.max() < 2**12  # the top (spare) bit of the 13-bit coefficient stays zero
    for s in range(3):  # every field reads back, its spare bit zero
        ch = lay.chan[:, s]
        ok = ch >= 0
        field = (W[:, ok] >> lay.off[ok, s][None, :]) & ((1 << (lay.width[ok, s] + 1)) - 1)
        assert np.array_equal(field - (1 << (lay.width[ok, s] - 1))[None, :], qt.q[:, ch[ok]])


def test_parameters_secure_and_noise_bound():
    from cipherlm.he.params import HES_128_CLASSIC_MAX_LOGQ

    for lam in (0, 40):
        p = H.plan_params(t_bits=13, w_abs=2**11, nnz=4096, blocks=8, packlwe=True, flood_bits=lam,
                          in_count=8, out_count=1)
        assert p.logq + p.special_bits <= HES_128_CLASSIC_MAX_LOGQ[4096]
        # correctness: bound + flooding below q'/(2t)
        assert p.bound_out + p.flood < 2.0 ** (p.out_bits - 1 - p.t_bits - 0.2 * p.out_k)
        if lam:
            assert p.flood >= 2**lam * p.bound_out
    with pytest.raises(ValueError, match="no 109-bit modulus"):
        H.plan_params(t_bits=37, w_abs=2**15, nnz=4096, blocks=250, packlwe=False, flood_bits=40)


def test_rns_helpers():
    primes, _ = H.primes_for([20, 25, 28], 4096)
    rns = H.RNS(primes, 4096)
    rng = np.random.default_rng(0)
    x = [int(v) for v in rng.integers(0, 2**62, 16)]
    x = [v * 977 % rns.Q for v in x]
    res = np.array([[v % p for v in x] for p in rns.primes], np.uint64)
    down = rns.drop_last(res)
    for j, v in enumerate(x):
        want = (v + primes[-1] // 2) // primes[-1]
        got = [int(down[i, j]) for i in range(2)]
        assert all(g % p == want % p for g, p in zip(got, primes[:2])) or \
            all(g % p == (want - 1) % p for g, p in zip(got, primes[:2]))
    t = 1 << 13
    dec = rns.decode_top(res, t)
    assert np.array_equal(dec, np.array([round(t * v / rns.Q) % t for v in x]))
    packed = H.pack_bits(res[None], rns.bits)
    assert len(packed) == sum((16 * b + 7) // 8 for b in rns.bits)
    assert np.array_equal(H.unpack_bits(packed, rns.bits, (1,), 16)[0], res)
    # exact FFT product against the schoolbook one
    a = rng.integers(0, primes[0], 4096).astype(np.uint64)
    s = rng.integers(-1, 2, 4096)
    got = H.conv_small(a[None, :], H.fft_fwd(s), np.array(primes[:1], np.uint64))[0]
    assert np.array_equal(got.astype(np.int64), np.mod(H.negacyclic(a.astype(np.int64), s), primes[0]))


# --------------------------------------------------------------------------- views
def _capture_client(monkeypatch):
    """Record what the client decrypts: (setup, response message, u) per run."""
    seen = []
    orig = E._decrypt

    def spy(st, msg, T):
        u = orig(st, msg, T)
        seen.append((st, msg, T, u))
        return u

    monkeypatch.setattr(E, "_decrypt", spy)
    return seen


def _client_noise(st, msg, T):
    """The decryption noise the client sees at the packed positions, in units of q'
    (the modulus the server flooded at), and the bound R of the final switch's rounding."""
    plan, n = st.plan, st.plan.n
    out = st.rns.sub(plan.out_k)
    groups = E._packed_positions(T * st.shape.n_cols, n)
    c0, c1s = E._response_parts(st, msg, (len(groups),), n)
    k0, k1, tb = plan.k0_bits, plan.k1_bits, plan.t_bits
    ph = (((c0 << np.uint64(k1 - k0)) + c1s) & np.uint64((1 << k1) - 1)).astype(np.int64)
    u = H.decode_pow2(c0, c1s, k0, k1, tb)
    e = np.mod(ph - (u << (k1 - tb)), 1 << k1)
    e = np.where(e >= 1 << (k1 - 1), e - (1 << k1), e).astype(np.float64) * (out.Q / 2.0**k1)
    g, cnt, stride = groups[0]
    R = out.Q * (2.0 ** (-k0 - 1) + H.TAIL * math.sqrt(n / 12) * 2.0 ** (-k1))
    return e[g, : cnt * stride : stride], R


def test_view_client_values_uniform(monkeypatch):
    """u = W - S mod t is uniform whatever the table: two constant tables give the same
    (uniform) distribution of the client's decrypted values (chi-square, 16 bins by the
    top 4 bits and 16 by the low 4 bits)."""
    seen = _capture_client(monkeypatch)
    d, T = 3 * 700, 4
    ids = np.arange(T)
    us = []
    for const in (0.0, 0.9):
        table = np.full((8, d), const)
        table[:, ::7] = -0.45  # fix the scales
        _run(table, ids, "+packing")  # same masking as the PackLWEs row, without its run time
        us.append(seen[-1][3].reshape(-1))
    for u in us:
        for bins in (u >> 9, u & 15):
            counts = np.bincount(bins, minlength=16)
            assert _p_uniform(counts) > P_MIN
    for sh in (9, 0):
        f = [np.bincount((u >> sh) & 15, minlength=16) for u in us]
        assert _p_homogeneous(f) > P_MIN


def test_view_flooding_hides_table_noise(monkeypatch):
    """With flooding the client's decryption noise is ~uniform on [-F, F] and its
    distribution does not depend on the table; without flooding (flood_bits = 0) the
    same test tells the two tables apart (the table-dependent noise shows)."""
    seen = _capture_client(monkeypatch)
    V, d, T = 4096, 3 * 700, 1
    ids = np.array([4095])
    small = np.zeros((V, d))  # packed W - centre = 136 in every column
    big = -np.ones((V, d))  # packed W - centre = -956: 7x the table-dependent noise

    def noise(tab, lam):
        _run(tab, ids, "fastquery", flood_bits=lam)
        st, msg, TT, _u = seen[-1]
        e, R = _client_noise(st, msg, TT)
        return e, st.plan, R

    flooded = [noise(small, 12), noise(big, 12)]  # 12 bits: small parameters, same formula as 40
    lim = max(p.flood + p.bound_out + R for _e, p, R in flooded)
    for e, plan, R in flooded:
        assert e.size == T * 700
        assert np.abs(e).max() <= plan.flood + plan.bound_out + R
        assert np.abs(e).max() > plan.flood / 2  # the flooding is present
        assert np.std(e) > 0.9 * plan.flood / math.sqrt(3)
    bins = [np.histogram(e, bins=16, range=(-lim, lim))[0] for e, _p, _R in flooded]
    assert _p_homogeneous(bins) > P_MIN
    assert _p_same_variance(flooded[0][0], flooded[1][0]) > P_MIN
    # the statistics have power at this sample size: a 30% larger noise level is flagged
    assert _p_same_variance(flooded[0][0], 1.3 * flooded[1][0]) < P_MIN
    e0, plan0, R0 = noise(big, 0)
    assert np.abs(e0).max() <= plan0.bound_out + R0  # the documented bound holds
    assert plan0.flood == 0


# --------------------------------------------------------------------------- bad input
def _expect_failure(fn, match):
    with pytest.raises(PartyFailed, match=match):
        run_inprocess(fn, timeout=60)


@pytest.mark.parametrize("ids, match", [
    (np.array([0, 300]), "out of range"),
    (np.array([-1]), "out of range"),
    (np.array([[1, 2]]), "1-D"),
    (np.array([1.5]), "integers"),
    (np.array([], np.int64), "empty"),
])
def test_bad_ids(ids, match):
    table = _table(300, 4)

    def f(ctx):
        st = E.setup(ctx, table if ctx.party == 1 else None, vocab_size=300, dim=4, method="+packing", flood_bits=0)
        return E.lookup(ctx, st, ids if ctx.party == 0 else None)

    _expect_failure(f, match)


def test_bad_table_and_method():
    def wrong_shape(ctx):
        return E.embedding_lookup(ctx, np.array([1]) if ctx.party == 0 else None,
                                  np.zeros((10, 5)) if ctx.party == 1 else None, vocab_size=10, dim=4)

    _expect_failure(wrong_shape, "expected \\(vocab_size, dim\\)")

    def nan_table(ctx):
        t = np.zeros((10, 4))
        t[3, 1] = np.nan
        return E.embedding_lookup(ctx, np.array([1]) if ctx.party == 0 else None, t if ctx.party == 1 else None,
                                  vocab_size=10, dim=4)

    _expect_failure(nan_table, "non-finite")

    def unknown(ctx):
        return E.embedding_lookup(ctx, np.array([1]) if ctx.party == 0 else None,
                                  np.zeros((10, 4)) if ctx.party == 1 else None, vocab_size=10, dim=4, method="x")

    _expect_failure(unknown, "unknown embedding method")

    def mismatch(ctx):  # client and server ask for different methods
        return E.embedding_lookup(ctx, np.array([1]) if ctx.party == 0 else None,
                                  np.ones((10, 4)) if ctx.party == 1 else None, vocab_size=10, dim=4,
                                  method="fastquery" if ctx.party == 0 else "+packing", flood_bits=0)

    _expect_failure(mismatch, "disagree")


def test_pow2_switch_and_wide_flooding():
    primes, _ = H.primes_for([30, 30, 30], 4096)
    rns = H.RNS(primes, 4096)
    rng = np.random.default_rng(4)
    x = [int(v) * int(w) % rns.Q for v, w in zip(rng.integers(1, 2**62, 64), rng.integers(1, 2**40, 64))]
    res = np.array([[v % p for v in x] for p in primes], np.uint64)
    for K in (16, 25, 49):
        got = rns.to_pow2(res, K)
        want = np.array([((v << K) + rns.Q // 2) // rns.Q % (1 << K) for v in x], np.uint64)
        assert np.all((got == want) | (got == (want + np.uint64(1)) % np.uint64(1 << K))
                      | (got == (want - np.uint64(1)) % np.uint64(1 << K)))
        assert np.mean(got == want) > 0.9
    # flooding wider than int64: values uniform on about [-F, F]
    F = 1 << 70

    class _St:  # the two fields _mask_and_flood reads
        plan = type("P", (), {"flood": F, "t_bits": 13})()
        layout = type("L", (), {"centre": 0})()

    zero = np.zeros((3, 4096), np.uint64)
    S = np.zeros(4096, np.int64)
    c0 = E._mask_and_flood(_St, rns, zero, S, rng)
    vals = np.array([int(sum(int(c0[i, j]) * (rns.Q // p) * pow(rns.Q // p, -1, p) for i, p in enumerate(primes))
                         % rns.Q) for j in range(4096)], dtype=object)
    vals = np.array([v - rns.Q if v > rns.Q // 2 else v for v in vals], dtype=object)
    assert max(abs(v) for v in vals) <= F + (1 << 32)
    assert max(vals) > F // 2 and min(vals) < -F // 2
    assert _p_uniform(np.histogram(np.array(vals, float), bins=16, range=(-float(F), float(F)))[0]) > P_MIN


# --------------------------------------------------------------------------- bytes pinned
#: one lookup (table _table(300, 7), ids [299, 0, 17, 17, 123], no flooding): per party,
#: (bytes sent, bytes received, rounds) of the online steps `PINNED_STEPS`, and the setup
#: bytes where they are deterministic (None: SEAL's compressed Galois keys vary run to
#: run).  Measured at f00ea77, before the numpy RLWE engine moved behind the HE backend
#: interface (he/numpy_rlwe.py); must stay exactly equal.
PINNED_STEPS = ("embedding.query", "embedding.response", "embedding.extend")
PINNED_BYTES = {
    # method: (client per step, server per step, setup bytes)
    "cheetah": (((197264, 0, 0), (0, 251160, 0), (352, 904, 1)), ((0, 197264, 0), (251160, 0, 1), (904, 352, 1)), 39952),
    "+packing": (((94864, 0, 0), (0, 128120, 0), (432, 904, 1)), ((0, 94864, 0), (128120, 0, 1), (904, 432, 1)), 19504),
    "fastquery": (((97424, 0, 0), (0, 21072, 0), (432, 904, 1)), ((0, 97424, 0), (21072, 0, 1), (904, 432, 1)), None),
    "exact": (((97424, 0, 0), (0, 21072, 0), (352, 904, 1)), ((0, 97424, 0), (21072, 0, 1), (904, 352, 1)), None),
}


def _iknp_runner(f, **kw):
    return run_inprocess(f, ot_factory=lambda chan, party: OTSession(chan, party, ferret=False), **kw)


def test_lookup_bytes_default_ot():
    """With the default OT (Ferret): the HE steps are byte for byte the pinned ones, and
    the OT step (extend) sends fewer bytes than with IKNP, in the same rounds."""
    method = "exact"
    _val, _st, c, s = _run_steps(_table(300, 7), np.array([299, 0, 17, 17, 123]), method)
    client, server, _ = PINNED_BYTES[method]
    for party, want in ((c, client), (s, server)):
        got = tuple((party[k]["bytes_sent"], party[k]["bytes_received"], party[k]["rounds"]) for k in PINNED_STEPS)
        assert got[:2] == want[:2]
        ext, ext_iknp = got[2], want[2]
        assert ext[0] + ext[1] < ext_iknp[0] + ext_iknp[1] and ext[2] == ext_iknp[2], (ext, ext_iknp)


@pytest.mark.parametrize("method,packer", _with_packers(sorted(PINNED_BYTES)))
def test_lookup_bytes_unchanged(method, packer):
    # pinned with IKNP (the default OT is Ferret since 2026-11-27; its extend step is
    # checked against these in test_lookup_bytes_default_ot); the same online bytes with
    # either PackLWEs packer
    _val, st, c, s = _run_steps(_table(300, 7), np.array([299, 0, 17, 17, 123]), method, runner=_iknp_runner,
                                packer=packer)
    client, server, setup = PINNED_BYTES[method]
    for party, want in ((c, client), (s, server)):
        got = tuple((party[k]["bytes_sent"], party[k]["bytes_received"], party[k]["rounds"]) for k in PINNED_STEPS)
        assert got == want
    if setup is not None:
        assert st.setup_bytes == setup


@_NEEDS_LATTIGO
@pytest.mark.parametrize("method", ["exact", "+blockot2"])
def test_prepared_weights_change_nothing_on_the_wire(method):
    """The Lattigo server prepares its table's weights at set-up (`_prepare_weights`) unless
    the budget is 0; either way the client gets the same bytes and exact rows (the packed
    ciphertexts are the same words; only the server's uniform masks differ)."""
    table = _table(4096 + 300, 12, seed=9)
    ids = np.array([4096 + 299, 7, 4100, 7])
    out = []
    for budget in (None, 0):
        def f(ctx):
            st = E.setup(ctx, table if ctx.party == 1 else None, vocab_size=table.shape[0], dim=12, method=method,
                         flood_bits=40, packer="lattigo", weight_cache_bytes=budget)
            before = ctx.chan.totals()
            sh = E.lookup(ctx, st, ids if ctx.party == 0 else None)
            after = ctx.chan.totals()
            return sh.data, st.weights is not None, after["bytes_sent"] - before["bytes_sent"]

        (a, _, sent0), (b, prepared, sent1) = run_inprocess(f, timeout=600)
        out.append(((a + b).view(np.int64), prepared, sent0, sent1))
    (v0, p0, *bytes0), (v1, p1, *bytes1) = out
    assert p0 and not p1
    assert bytes0 == bytes1 and np.array_equal(v0, v1)

"""The Go/Lattigo PackLWEs packer of the embedding lookup (``native/lattigo/pack_lwes.go``;
CDKS 2021 Algorithms 1-2, FastQuery section 2.3 "PackLWEs optimization").

Its output must decrypt, with the client's numpy secret, to exactly what SEAL's packer
(`cipherlm.he.packlwe`) gives; the lookup with it must return the quantised rows; a
client's malformed Galois keys and unreduced leaves must give errors, never a crash.
"""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.he.backend import backend_unavailable_reason, get_backend
from cipherlm.he.errors import HEError
from cipherlm.mpc.he_session import FLOOD_SIGMA
from cipherlm.mpc.runner import PartyFailed, run_inprocess
from cipherlm.protocols import embedding as E
from cipherlm.protocols import embedding_he as H

_WHY = backend_unavailable_reason("lattigo")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"the Lattigo library is not built or does not load: {_WHY}")


def _exact_plan():
    """The "exact" row's plan at the 2pc flooding (N = 8192, 4 data primes, 1 special prime)."""
    m = E.METHODS["exact"]
    lay = E.make_layout(np.full(7, 12, np.int64), None, m)
    _shape, plan = E._plan_any_n(m, lay, 300, None, FLOOD_SIGMA)
    primes, _special = E._primes(plan)
    return plan, H.RNS(primes, plan.n)


@pytest.fixture(scope="module")
def pk():
    """`_exact_plan`, SEAL's and Lattigo's keys (each with its client secret as numpy
    coefficients) and the server-side Galois key sets loaded from the client's bytes."""
    plan, rns = _exact_plan()
    _primes, special = E._primes(plan)
    seal = get_backend()
    hectx = E._he_context(plan, rns)
    skeys = seal.keygen(hectx)
    s_seal = E._secret_from_keys(hectx, skeys, rns, plan)
    els = seal.pack_lwes_elements(plan.n)
    gk_seal = seal.galois_keys_from_bytes(hectx, skeys.galois_keys_bytes_for_elements(els))
    lat = get_backend("lattigo")
    lctx = E._lattigo_context(plan, rns)
    s_lat = H.sample_ternary(np.random.default_rng(11), plan.n)
    lkeys = lat.secret_keys_from_ternary(lctx, s_lat)
    gk_bytes = lkeys.galois_keys_bytes_for_elements(els)
    gk_lat = lat.galois_keys_from_bytes(lctx, gk_bytes, max_keys=len(els))
    return dict(plan=plan, rns=rns, special=special, hectx=hectx, s_seal=s_seal, gk_seal=gk_seal, lctx=lctx,
                s_lat=s_lat, gk_lat=gk_lat, gk_bytes=gk_bytes, els=els)


def _leaves(rns, plan, s, vals, rng):
    """Leaf j: a numpy encryption under s of Delta vals[j] N^-1 at coefficient 0 and uniform
    garbage elsewhere (the trace removes it), coefficient form, (m, 2, k, N)."""
    n, m = plan.n, len(vals)
    t = 1 << plan.t_bits
    delta = rns.Q // t
    ninv = pow(n, -1, rns.Q)
    c1 = np.stack([rng.integers(0, q, size=(m, n), dtype=np.int64) for q in rns.primes], axis=1).astype(np.uint64)
    msg = np.stack([rng.integers(0, q, size=(m, n), dtype=np.int64) for q in rns.primes], axis=1).astype(np.uint64)
    for j, v in enumerate(vals):
        msg[j, :, 0] = rns.from_int(delta * int(v) * ninv)
    e = rns.from_signed(H.sample_error(rng, (m, n)))
    c0 = rns.sub_(rns.add(msg, e), H.conv_small(c1, H.fft_fwd(s), rns.q))
    return np.stack([c0, c1], axis=1)


def _decode(rns, plan, s, ct):
    """round(t (c0 + c1 s) / Q) mod t per coefficient (the client's decryption)."""
    u = rns.add(ct[0], H.conv_small(ct[1], H.fft_fwd(s), rns.q))
    return rns.to_pow2(u, plan.t_bits)


def _pack_seal(pk, x, present, cnt):
    be = get_backend()
    leaves = (be.numpy_to_ciphertext(pk["hectx"], x[i], ntt=False) if present[i] else None for i in range(len(x)))
    return be.ciphertext_to_numpy(be.pack_lwes_stream(pk["hectx"], pk["gk_seal"], cnt, leaves))


def _pack_lattigo(pk, x, present, cnt, chunk, workers=0):
    packer = get_backend("lattigo").pack_lwes_packer(pk["gk_lat"], cnt, workers=workers)
    for p0 in range(0, len(x), chunk):
        packer.push(x[p0 : p0 + chunk], present[p0 : p0 + chunk])
    return packer.finish()


@pytest.mark.parametrize("cnt, chunk, workers", [(37, 16, 0), (64, 64, 2), (1, 1, 1), (100, 7, 3)])
def test_lattigo_packer_decrypts_like_seal(pk, cnt, chunk, workers):
    """Random leaves in the tree's order (bit-reversed slots; slots >= cnt and a few others
    absent): both packers' outputs decrypt to the same values, Delta v_j at coefficient
    j N / 2^ceil(log2 cnt) and 0 elsewhere."""
    plan, rns = pk["plan"], pk["rns"]
    rng = np.random.default_rng(cnt)
    order = np.array(get_backend().pack_lwes_order(cnt), np.int64)
    vals = rng.integers(0, 1 << plan.t_bits, size=order.size)
    present = order < cnt
    if cnt > 4:
        present[rng.choice(np.nonzero(present)[0], 3, replace=False)] = False  # absent (None) leaves
    slot_vals = np.zeros(order.size, np.int64)
    slot_vals[order[present]] = vals[present]
    want = np.zeros(plan.n, np.uint64)
    want[:: plan.n // order.size] = slot_vals
    got = {}
    for name, s in (("seal", pk["s_seal"]), ("lattigo", pk["s_lat"])):
        x = _leaves(rns, plan, s, vals, rng)
        out = _pack_seal(pk, x, present, cnt) if name == "seal" else _pack_lattigo(pk, x, present, cnt, chunk, workers)
        assert out.shape == (2, rns.k, plan.n) and np.all(out < rns.q[None, :, None])
        got[name] = _decode(rns, plan, s, out)
    assert np.array_equal(got["lattigo"], got["seal"])
    assert np.array_equal(got["lattigo"], want)


def _table(V, d, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.normal(0, 0.05, (V, d))
    t[:, 0] *= 8
    return t


def _lookup(table, ids, method, packer="lattigo"):
    V, d = table.shape

    def f(ctx):
        st = E.setup(ctx, table if ctx.party == 1 else None, vocab_size=V, dim=d, method=method, packer=packer)
        return E.lookup(ctx, st, ids if ctx.party == 0 else None).data, st

    (a, st0), (b, st1) = run_inprocess(f, timeout=600)
    return (a + b).view(np.int64).astype(np.float64) / 2.0 ** st0.frac, st0, st1


@pytest.mark.parametrize("method", ["exact", "fastquery"])
def test_lookup_with_lattigo_packer(method):
    table = _table(300, 7)
    ids = np.array([299, 0, 17, 17, 123])
    val, st0, st1 = _lookup(table, ids, method)
    assert st0.packer == st1.packer == "lattigo"
    assert np.array_equal(val, E.quantized_rows(table[ids], st1))


def test_default_packer_is_lattigo_when_built():
    assert E.default_packer() == "lattigo"
    _val, st0, st1 = _lookup(_table(50, 3), np.array([1]), "exact", packer=None)
    assert st0.packer == st1.packer == "lattigo"


@pytest.mark.parametrize("mangle, match", [
    (lambda b: b[:-1], "bytes, expected"),  # truncated
    (lambda b: b[:12], "bytes, expected"),  # header only
    (lambda b: b"XXXX" + b[4:], "bad header"),
    (lambda b: b[:8] + (99).to_bytes(4, "little") + b[12:], "Galois keys"),  # key count
    (lambda b: b[:12] + (4).to_bytes(8, "little") + b[20:], "invalid Galois element"),
    (lambda b: b[:-8] + (2**64 - 1).to_bytes(8, "little"), "not reduced"),
])
def test_malformed_galois_keys_refused(pk, mangle, match):
    bad = mangle(pk["gk_bytes"])
    with pytest.raises(HEError, match=match):
        get_backend("lattigo").galois_keys_from_bytes(pk["lctx"], bad, max_keys=len(pk["els"]))


def _with_client_keys(monkeypatch, mangle):
    """The client's Galois key bytes, mangled on their way out."""
    from cipherlm.he.lattigo_backend import LattigoSecretKeys

    orig = LattigoSecretKeys.galois_keys_bytes_for_elements
    monkeypatch.setattr(LattigoSecretKeys, "galois_keys_bytes_for_elements", lambda self, els: mangle(orig(self, els)))


@pytest.mark.parametrize("mangle, match", [
    (lambda b: b[: len(b) // 2], "bytes, expected"),
    (lambda b: b"", "shorter than its header"),
    # the last row is the special prime's, bit-packed: its last coefficient all ones is >= p
    (lambda b: b[:-8] + b"\xff" * 8, "not reduced"),
])
def test_lookup_refuses_malformed_client_keys(monkeypatch, mangle, match):
    _with_client_keys(monkeypatch, mangle)
    with pytest.raises(PartyFailed, match=match):
        _lookup(_table(50, 3), np.array([1]), "exact")


def test_lookup_refuses_keys_missing_an_element(monkeypatch):
    from cipherlm.he.lattigo_backend import LattigoSecretKeys

    orig = LattigoSecretKeys.galois_keys_bytes_for_elements
    monkeypatch.setattr(LattigoSecretKeys, "galois_keys_bytes_for_elements",
                        lambda self, els: orig(self, list(els)[:-1]))
    with pytest.raises(PartyFailed, match="lack some of the PackLWEs automorphisms"):
        _lookup(_table(50, 3), np.array([1]), "exact")


def test_client_refuses_a_packer_it_cannot_run(monkeypatch):
    """The server announces a packer; a client that cannot run it stops with MPCError."""
    calls = []
    real = E._packer_unavailable

    def fake(name):  # the server's check runs first (before it sends), the client's after
        calls.append(name)
        return real(name) if len(calls) == 1 else "not built here (test)"

    monkeypatch.setattr(E, "_packer_unavailable", fake)
    with pytest.raises(PartyFailed, match="which this client cannot run"):
        _lookup(_table(50, 3), np.array([1]), "exact")


def test_client_and_server_packer_disagree():
    def f(ctx):
        return E.setup(ctx, _table(50, 3) if ctx.party == 1 else None, vocab_size=50, dim=3, method="exact",
                       packer="seal" if ctx.party == 0 else "lattigo")

    with pytest.raises(PartyFailed, match="the client asked for 'seal'"):
        run_inprocess(f, timeout=120)


def test_unreduced_leaf_refused(pk):
    plan, rns = pk["plan"], pk["rns"]
    x = _leaves(rns, plan, pk["s_lat"], [5, 6], np.random.default_rng(1))
    packer = get_backend("lattigo").pack_lwes_packer(pk["gk_lat"], 2)
    bad = x.copy()
    bad[1, 1, 2, 77] = rns.primes[2]  # c1, prime 2: equal to its prime
    with pytest.raises(HEError, match="not reduced modulo"):
        packer.push(bad, [True, True])
    with pytest.raises(HEError, match=r"expected \(m, 2, 4, 8192\)"):
        packer.push(x[:, :, :3], [True, True])
    with pytest.raises(HEError, match="presence flags"):
        packer.push(x, [True])
    with pytest.raises(HEError, match="got 0 leaves"):
        packer.finish()
    packer.push(x, [True, True])  # the refused pushes left the packer as it was
    with pytest.raises(HEError, match="pushed after"):
        packer.push(x[:1], [True])
    out = packer.finish()
    vals = _decode(rns, plan, pk["s_lat"], out)
    assert vals[0] == 5 and vals[plan.n // 2] == 6
    with pytest.raises(HEError, match="already finished"):
        packer.finish()


def test_packer_refuses_bad_arguments(pk):
    lat = get_backend("lattigo")
    with pytest.raises(HEError, match="packs 1..8192"):
        lat.pack_lwes_packer(pk["gk_lat"], 0)
    with pytest.raises(HEError, match="packs 1..8192"):
        lat.pack_lwes_packer(pk["gk_lat"], 8193)
    partial = lat.galois_keys_from_bytes(pk["lctx"], lat.secret_keys_from_ternary(pk["lctx"], pk["s_lat"])
                                         .galois_keys_bytes_for_elements(pk["els"][:3]), max_keys=13)
    assert not partial.has_elements(pk["els"]) and pk["gk_lat"].has_elements(pk["els"])
    with pytest.raises(HEError, match="lack the element"):
        lat.pack_lwes_packer(partial, 4)
    with pytest.raises(HEError, match="not ternary"):
        lat.secret_keys_from_ternary(pk["lctx"], np.full(8192, 2))
    with pytest.raises(HEError, match="secret coefficients"):
        lat.secret_keys_from_ternary(pk["lctx"], np.zeros(100))
    with pytest.raises(HEError, match="did not keep|out of range|prime"):
        lat.pack_context(8192, [4], [pk["special"]])
    assert lat.pack_context(8192, pk["rns"].primes, [pk["special"]]).q_moduli == list(pk["rns"].primes)



@pytest.mark.parametrize("T, B, wscale", [(1, 1, 1), (3, 2, 997), (2, 2, 2**29 + 3)])
def test_product_leaves_pack_like_coefficient_leaves(pk, T, B, wscale):
    """`push_products` (the Go packer makes each leaf -N^-1 X sum_b query[t, b] w[c, b]: its c1
    part in the NTT domain, its c0 part as the constant, an exact dot product) packs bit for bit
    what `push` packs from the same leaves made here in coefficient form with numpy's exact
    convolution (c0: the constant only, as the old numpy path made them).  Weights below the
    primes (the tables' case: reduced by a conditional add, c0's dot products in int64) and up to
    2^31 (reduced by division, 128-bit dot products)."""
    rns, n = pk["rns"], pk["plan"].n
    rng = np.random.default_rng(T * 10 + B)
    C, m = 3, 16  # the packer takes 2^ceil(log2 n) leaves
    query = np.stack([rng.integers(0, q, size=(T, B, 2, n), dtype=np.int64) for q in rns.primes], axis=3)
    query = query.astype(np.uint64)  # (T, B, 2, k, N)
    w_small = rng.integers(-3, 4, size=(C, B, n))
    w = w_small * wscale  # signed weights beyond the small-convolution range: by linearity below
    tok, col = rng.integers(0, T, m), rng.integers(0, C, m)
    present = np.ones(m, bool)
    present[[2, 7]] = False
    ninv = pow(n, -1, rns.Q)
    x = np.zeros((m, 2, rns.k, n), np.uint64)
    for i in np.flatnonzero(present):
        acc = np.zeros((2, rns.k, n), np.uint64)
        for b in range(B):
            prod = H.conv_small(query[tok[i], b], H.fft_fwd(w_small[col[i], b]), rns.q)
            acc = (acc + prod * (rns.from_int(wscale)[:, None])) % rns.q[:, None]
        shifted = np.roll(acc[1], 1, axis=-1)  # times X: coefficient N-1 wraps to 0 negated
        shifted[:, 0] = (rns.q - shifted[:, 0]) % rns.q
        x[i, 1] = (shifted * rns.from_int(-ninv)[:, None]) % rns.q[:, None]
        x[i, 0, :, 0] = (acc[0, :, n - 1] * rns.from_int(ninv)) % rns.q
    a = get_backend("lattigo").pack_lwes_packer(pk["gk_lat"], m)
    a.push(x, present)
    b = get_backend("lattigo").pack_lwes_packer(pk["gk_lat"], m)
    b.set_query(query)
    b.push_products(w, tok, col, present)
    want, got = a.finish(), b.finish()
    assert got.any() and np.array_equal(got, want)


def test_product_leaves_refuse_bad_arguments(pk):
    rns, n = pk["rns"], pk["plan"].n
    p = get_backend("lattigo").pack_lwes_packer(pk["gk_lat"], 4)
    w = np.zeros((1, 1, n), np.int64)
    with pytest.raises(HEError, match="query first"):
        p.push_products(w, [0, 0], [0, 0], [True, True])
    bad = np.zeros((1, 1, 2, rns.k, n), np.uint64)
    bad[0, 0, 1, 1, 5] = rns.primes[1]
    with pytest.raises(HEError, match="not reduced"):
        p.set_query(bad)
    with pytest.raises(HEError, match="expected"):
        p.set_query(bad[:, :, 0])
    p.set_query(np.zeros((1, 1, 2, rns.k, n), np.uint64))
    with pytest.raises(HEError, match="out of range"):
        p.push_products(w, [0, 1], [0, 0], [True, True])  # token 1 of 1
    with pytest.raises(HEError, match="out of range"):
        p.push_products(w, [0, 0], [0, 3], [True, True])  # column 3 of 1
    with pytest.raises(HEError, match="weight buffer"):
        p.push_products(np.zeros((1, 2, n), np.int64), [0, 0], [0, 0], [True, True])
    big = w.copy()
    big[0, 0, 9] = -(1 << 32)
    with pytest.raises(HEError, match="beyond 2"):
        p.push_products(big, [0, 0], [0, 0], [True, True])
    p.push_products(w, [1, 0, 0, 0], [0] * 4, [False, True, True, True])  # absent: its token is not read
    p.finish()
    with pytest.raises(HEError, match="set before the first leaf"):
        p.set_query(np.zeros((1, 1, 2, rns.k, n), np.uint64))


@pytest.mark.parametrize("T, B", [(1, 1), (3, 2)])
def test_prepared_weights_pack_like_product_leaves(pk, T, B):
    """`push_cached` (the weights reduced and transformed once, `pack_weights`) packs bit for bit
    what `push_products` packs from the same weights, with leaves of several tokens and columns
    over two pushes; freeing the prepared weights releases their Go object."""
    rns, n = pk["rns"], pk["plan"].n
    lat = get_backend("lattigo")
    rng = np.random.default_rng(5 + T)
    C, m = 5, 16
    query = np.stack([rng.integers(0, q, size=(T, B, 2, n), dtype=np.int64) for q in rns.primes], axis=3)
    query = query.astype(np.uint64)
    w = rng.integers(-(1 << 15) + 1, 1 << 15, size=(C, B, n))
    tok, col = rng.integers(0, T, m), rng.integers(0, C, m)
    present = np.ones(m, bool)
    present[[3, 11]] = False
    from cipherlm.he import lattigo_backend

    lib = lattigo_backend._load()
    before = lib.clg_live_objects()
    pw = lat.pack_weights(pk["gk_lat"], C, B)
    pw.add(w[:2])
    pw.add(w[2:])
    a = lat.pack_lwes_packer(pk["gk_lat"], m)
    a.set_query(query)
    b = lat.pack_lwes_packer(pk["gk_lat"], m)
    b.set_query(query)
    for lo, hi in ((0, 6), (6, m)):
        a.push_products(w, tok[lo:hi], col[lo:hi], present[lo:hi])
        b.push_cached(pw, tok[lo:hi], col[lo:hi], present[lo:hi])
    want, got = a.finish(), b.finish()
    assert got.any() and np.array_equal(got, want)
    del a, b, pw
    assert lib.clg_live_objects() == before


def test_prepared_weights_refuse_bad_arguments(pk):
    rns, n = pk["rns"], pk["plan"].n
    lat = get_backend("lattigo")
    pw = lat.pack_weights(pk["gk_lat"], 2, 1)
    with pytest.raises(HEError, match="beyond 2\\^15"):
        pw.add(np.full((1, 1, n), 1 << 15))
    with pytest.raises(HEError, match="expected weights"):
        pw.add(np.zeros((1, 2, n), np.int64))
    pw.add(np.ones((1, 1, n), np.int64))
    p = lat.pack_lwes_packer(pk["gk_lat"], 2)
    p.set_query(np.zeros((1, 1, 2, rns.k, n), np.uint64))
    with pytest.raises(HEError, match="do not fit"):
        p.push_cached(pw, [0, 0], [0, 0], [True, True])  # 1 of 2 columns filled
    with pytest.raises(HEError, match="more columns"):
        pw.add(np.zeros((2, 1, n), np.int64))
    pw.add(np.ones((1, 1, n), np.int64))
    with pytest.raises(HEError, match="out of range"):
        p.push_cached(pw, [0, 0], [0, 2], [True, True])  # column 2 of 2
    two = lat.pack_weights(pk["gk_lat"], 1, 2)
    two.add(np.zeros((1, 2, n), np.int64))
    with pytest.raises(HEError, match="do not fit"):
        p.push_cached(two, [0, 0], [0, 0], [True, True])  # 2 blocks, the query has 1
    p.push_cached(pw, [0, 0], [0, 1], [True, True])
    assert p.finish().shape == (2, rns.k, n)

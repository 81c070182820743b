"""The 2pc linear protocol (cipherlm.protocols.linear): HE cross terms on shares.

Checked against numpy: the coefficient packing (pure numpy negacyclic
products), linear layers and shared matrix products; the encryptor's view
(uniform output shares, independent of the weights; flooded noise); bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_mpc_views import P_MIN, p_same, p_uniform

from cipherlm.mpc.context import MPCError
from cipherlm.mpc.runner import PartyFailed, run_inprocess, run_processes
from cipherlm.mpc.shares import share_input
from cipherlm.protocols import linear as L
from cipherlm.mpc.he_session import he_session, u64_bytes_view


def _negacyclic(a: np.ndarray, b: np.ndarray, t: int) -> np.ndarray:
    n = a.size
    full = np.zeros(2 * n, dtype=object)
    for i in np.nonzero(a)[0]:
        full[i:i + n] += int(a[i]) * b.astype(object)
    return (full[:n] - full[n:]) % t


@pytest.mark.parametrize("m,d,o,n", [(3, 5, 4, 64), (2, 7, 3, 32), (1, 16, 2, 32)])
def test_coefficient_packing_matches_numpy(m, d, o, n):
    rng = np.random.default_rng(m + d + o)
    t = 1 << 20
    A = rng.integers(0, t, (1, m, d), dtype=np.uint64)
    B = rng.integers(-50, 50, (1, d, o))
    plan = L.plan_blocks(m, d, o, n)
    assert plan.mw * plan.dw * plan.ow <= n
    pos = plan.positions()
    assert len(set(pos.tolist())) == pos.size and pos.max() < n
    pa, pb = L._pack_lhs(plan, A), L._pack_rhs(plan, B)
    out = np.zeros((1, plan.mb, plan.ob, pos.size), np.uint64)
    for mi in range(plan.mb):
        for oi in range(plan.ob):
            acc = np.zeros(n, dtype=object)
            for di in range(plan.db):
                acc = acc + _negacyclic(pa[0, mi, di], pb[0, di, oi], t)
            out[0, mi, oi] = np.array([int(v) % t for v in acc[pos]], np.uint64)
    got = L._unpack_out(plan, out)[0]
    ref = (A[0].astype(object) @ B[0].astype(object)) % t
    assert np.array_equal(got.astype(object), ref)


def _linear_party(ctx, X, W, b, o):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    y = L.linear(ctx, x, W if ctx.party == 1 else None, b if ctx.party == 1 else None, out_features=o,
                 cache_key="w")
    y2 = L.linear(ctx, x, W if ctx.party == 1 else None, None, out_features=o, cache_key="w")  # cached blocks
    return y.reveal_float(), y2.reveal_float()


def _tol(d: int, xmax: float, wmax: float) -> float:
    # input and weight rounding at 2^-(IN_FRAC+1) / 2^-(W_FRAC+1), plus the output truncation
    return d * (xmax * 2.0 ** -(L.W_FRAC + 1) + wmax * 2.0 ** -(L.IN_FRAC + 1)) + 2.0 ** -14


@pytest.mark.parametrize("shape,d,o", [((4,), 24, 10), ((2, 3), 40, 33), ((1,), 300, 5)])
def test_linear_matches_numpy(shape, d, o):
    rng = np.random.default_rng(d * o)
    X = rng.normal(size=shape + (d,))
    W = rng.normal(size=(d, o)) * 0.3
    b = rng.normal(size=o)
    (y, y2), _ = run_inprocess(_linear_party, args0=(X, None, None, o), args1=(None, W, b, o), timeout=300)
    tol = _tol(d, np.abs(X).max(), np.abs(W).max())
    assert y.shape == shape + (o,)
    assert np.abs(y - (X @ W + b)).max() < tol
    assert np.abs(y2 - X @ W).max() < tol


def _matmul_party(ctx, A, B):
    a = share_input(ctx, A if ctx.party == 0 else None, owner=0)
    b = share_input(ctx, B if ctx.party == 1 else None, owner=1)
    ab = L.matmul_shared(ctx, a, b)
    c = L.matmul_shared(ctx, a + a, b)  # both operands shared by both parties' contributions
    return ab.reveal_float(), c.reveal_float()


def test_matmul_shared_matches_numpy():
    rng = np.random.default_rng(3)
    A = rng.normal(size=(3, 5, 16))
    B = rng.normal(size=(3, 16, 7))
    (ab, c), _ = run_inprocess(_matmul_party, args0=(A, None), args1=(None, B), timeout=300)
    tol = _tol(16, 2 * np.abs(A).max(), np.abs(B).max())
    assert np.abs(ab - A @ B).max() < tol
    assert np.abs(c - 2 * A @ B).max() < 2 * tol


def test_linear_two_processes():
    rng = np.random.default_rng(9)
    X = rng.normal(size=(3, 20))
    W = rng.normal(size=(20, 6)) * 0.2
    (y, _), _ = run_processes(_linear_party, args0=(X, None, None, 6), args1=(None, W, None, 6), timeout=300)
    assert np.abs(y - X @ W).max() < _tol(20, np.abs(X).max(), np.abs(W).max())


# ----------------------------------------------------------------------------- views
def _view_party(ctx, reps, W):
    """The encryptor's (client's) output shares of x_0 W for a fixed x_0 = 0."""
    he_session(ctx)
    out = []
    for _ in range(reps):
        A = np.zeros((1, 8, 16), np.uint64) if ctx.party == 0 else None
        out.append(L.cross_matmul(ctx, 0, A, W, (1, 8, 16, 12), b_bits=L.W_BITS))
    return np.stack(out) if ctx.party == 0 else None


def client_views_for_two_weights(view_party) -> list[np.ndarray]:
    """What the client decrypts (x_0 = 0, 6 runs) for two very different (1, 16, 12)
    weights, all zero and random 17-bit: ``view_party(ctx, reps, W)`` as `_view_party`."""
    W2 = np.random.default_rng(5).integers(-(1 << 16), 1 << 16, (1, 16, 12))
    return [run_inprocess(view_party, args0=(6, None), args1=(6, W), timeout=300)[0].reshape(-1)
            for W in (np.zeros((1, 16, 12), np.int64), W2)]


def assert_uniform_and_alike(views: list[np.ndarray], modulus: int) -> None:
    """Top 4 bits (floor(16 v / modulus)) and low 4 bits of each view uniform, and the
    two views identically distributed (chi-square), all values below the modulus."""
    top = [(v.astype(object) * 16 // modulus).astype(np.int64) for v in views]
    low = [(v & np.uint64(15)) for v in views]
    for v in top + low:
        assert p_uniform(v, 16) > P_MIN
    assert p_same(top[0], top[1], 16) > P_MIN
    assert p_same(low[0], low[1], 16) > P_MIN
    assert all(int(v.max()) < modulus for v in views)


def test_encryptor_output_share_is_uniform_and_independent_of_weights():
    """With x_0 = 0 the client's decrypted values are A W + r = r: they must be
    uniform mod t and distributed identically for two very different weights."""
    assert_uniform_and_alike(client_views_for_two_weights(_view_party), 1 << 59)


def _noise_party(ctx, flood, native=False):
    """Encryptor: the remaining noise budget of one result ciphertext (all of c0 sent)."""
    import tenseal.sealapi as seal

    from cipherlm.he import serialize

    he = he_session(ctx)
    plan = L.plan_blocks(2, 8, 4, he.n)
    if ctx.party == 0:
        A = np.zeros((1, 2, 8), np.uint64)
        ctx.send({"cts": he.encrypt_polys(L._pack_lhs(plan, A).reshape(-1, he.n))})
        reply = ctx.recv()
        arr = np.stack([reply["c0"], reply["c1"]])
        ct = serialize.numpy_to_ciphertext(he.he, arr, parms_id=he.top, is_ntt_form=False)
        return he.keys._decryptor.invariant_noise_budget(ct)
    if not flood:
        he.flood_bound = lambda bound: 1  # a test-only evaluator that does not flood
    ct = he.load_input(bytes(ctx.recv()["cts"][0]))
    acc = seal.Ciphertext()
    he.he.evaluator.multiply_plain(ct, he.encode_plain(np.arange(he.n) % 7 - 3), acc)
    if native:  # the same product, finished by `_core.bfv_finish`
        c1, c0, _ = he.finish_native(he.backend.ciphertext_to_numpy(acc)[None], np.arange(he.n),
                                     L.noise_bound(he.n, 3), keep=len(he.he.coeff_moduli))
        c1, c0 = c1[0], c0[0]
    else:
        c1, c0, _ = he.finish(acc, np.arange(he.n), L.noise_bound(he.n, 3), send_level=he.top)
    ctx.send({"c1": c1, "c0": c0})
    return None


@pytest.mark.parametrize("native", [False, True], ids=["backend", "native"])
def test_result_noise_is_flooded(native):
    """Before the modulus switch, the noise of a result is >= 2^40 times larger with
    flooding than without (the remaining noise budget drops by >= 40 bits), and
    the result still decrypts (budget > 0).  (After the switch to two primes both
    are below the switch's own rounding noise, which is why this looks earlier.)"""
    budgets = [run_inprocess(_noise_party, args0=(flood,), args1=(flood, native), timeout=120)[0]
               for flood in (False, True)]
    assert budgets[0] - budgets[1] >= 40, budgets
    assert budgets[1] > 0, budgets


# ----------------------------------------------------------------------------- bad input
def _bad_weight_party(ctx, W):
    x = share_input(ctx, np.ones((2, 4)) if ctx.party == 0 else None, owner=0)
    return L.linear(ctx, x, W, out_features=3).reveal_float()


@pytest.mark.parametrize("W,msg", [(np.ones((5, 3)), "shape"), (np.full((4, 3), 100.0), "bound")])
def test_bad_weights_are_rejected(W, msg):
    with pytest.raises(PartyFailed, match=msg):
        run_inprocess(_bad_weight_party, args0=(None,), args1=(W,), timeout=120)


def _short_reply_party(ctx):
    he = he_session(ctx)
    if ctx.party == 1:  # a faulty evaluator: too few result ciphertexts
        ctx.recv()
        ctx.send({"c1": np.zeros((0, 2, he.n), np.uint64), "c0": np.zeros((0, 2, 1), np.uint64)})
        return None
    return L.cross_matmul(ctx, 0, np.zeros((1, 2, 4), np.uint64), None, (1, 2, 4, 3), b_bits=L.W_BITS)


def test_malformed_reply_is_an_error():
    with pytest.raises(PartyFailed, match="reply has shapes"):
        run_inprocess(_short_reply_party, timeout=120)


def test_empty_product_is_an_error():
    with pytest.raises(MPCError):
        L.plan_blocks(0, 3, 4, 64)


# ----------------------------------------------------------------------------- the native block products
def _exact_mul_sum(xs, ws, offsets, x_idx, w_idx, moduli):
    """Python-integer reference of `_core.ntt_mul_sum`."""
    n_out = len(offsets) - 1
    out = np.zeros((n_out,) + xs.shape[1:], np.uint64)
    for o in range(n_out):
        for j, q in enumerate(moduli):
            acc = np.zeros((xs.shape[1], xs.shape[3]), dtype=object)
            for p in range(offsets[o], offsets[o + 1]):
                acc += xs[x_idx[p], :, j].astype(object) * ws[w_idx[p], j].astype(object)
            out[o, :, j] = (acc % q).astype(np.uint64)
    return out


def test_ntt_mul_sum_matches_exact_integers():
    """Sums of up to 300 products of residues just below 60-bit primes (past the lazy
    accumulator's limit, so the partial reductions run) equal Python's exact arithmetic."""
    from cipherlm import _core

    rng = np.random.default_rng(5)
    moduli = [1152921504606830593, 1152921504606748673, 274877906939]
    n, comps = 16, 2
    xs = np.stack([np.stack([rng.integers(q - 1000, q, (comps, n), dtype=np.uint64) for q in moduli], axis=1)
                   for _ in range(7)])
    ws = np.stack([np.stack([rng.integers(q - 1000, q, n, dtype=np.uint64) for q in moduli]) for _ in range(5)])
    pairs = [[(i % 7, i % 5) for i in range(300)], [], [(3, 1)], [(i, i % 5) for i in range(7)]]
    offsets = np.cumsum([0] + [len(p) for p in pairs]).tolist()
    x_idx = [i for p in pairs for i, _ in p]
    w_idx = [w for p in pairs for _, w in p]
    got = np.frombuffer(_core.ntt_mul_sum(u64_bytes_view(xs), u64_bytes_view(ws), offsets, x_idx, w_idx, moduli,
                                          comps, n), np.uint64).reshape(len(pairs), comps, len(moduli), n)
    np.testing.assert_array_equal(got, _exact_mul_sum(xs, ws, offsets, x_idx, w_idx, moduli))
    assert not got[1].any()


def test_ntt_mul_sum_refuses_bad_input():
    from cipherlm import _core

    q = [1152921504606830593]
    x = np.zeros((1, 2, 1, 8), np.uint64)
    w = np.zeros((1, 1, 8), np.uint64)
    ok = dict(offsets=[0, 1], x_idx=[0], w_idx=[0], moduli=q, comps=2, n=8)
    _core.ntt_mul_sum(u64_bytes_view(x), u64_bytes_view(w), **ok)
    for bad in ({"x_idx": [1]}, {"w_idx": [3]}, {"offsets": [0, 2]}, {"moduli": [2 ** 62 + 1]}, {"n": 3}):
        with pytest.raises(ValueError):
            _core.ntt_mul_sum(u64_bytes_view(x), u64_bytes_view(w), **{**ok, **bad})
    x[0, 1, 0, 3] = q[0]  # an unreduced input residue (the peer's bytes)
    with pytest.raises(ValueError, match="below its prime"):
        _core.ntt_mul_sum(u64_bytes_view(x), u64_bytes_view(w), **ok)


def _seal_block_products_party(ctx):
    """Evaluator's block products: the native kernel against SEAL's multiply_plain + add."""
    he = he_session(ctx)
    rng = np.random.default_rng(ctx.party)
    plan = L.plan_blocks(4, 64, 300, he.n)
    if ctx.party == 0:
        A = rng.integers(0, he.t, (1, 4, 64), dtype=np.uint64)
        ctx.send({"cts": he.encrypt_polys(L._pack_lhs(plan, A).reshape(-1, he.n))})
        return None
    blobs = ctx.recv()["cts"]
    B = rng.integers(-(1 << 18), 1 << 18, (1, 64, 300))
    B[:, :, :plan.ow] = 0  # an all-zero output block column
    cts = [he.load_input(bytes(b)) for b in blobs]
    xs = np.stack([he.backend.ciphertext_to_numpy(c) for c in cts])
    rhs = L._encoded_rhs(he, plan, B, L.W_BITS, None)
    native = [s for sums in L._block_products(he, plan, xs, rhs) for s in sums]
    be, hectx, k, zero_blocks = he.backend, he.he, 0, 0
    for mi in range(plan.mb):
        for oi in range(plan.ob):
            acc = None
            for di in range(plan.db):
                w = rhs.index[0, di, oi]
                if w < 0:
                    continue
                pt = he.encode_plain(L._pack_rhs(plan, B)[0, di, oi])
                prod = be.multiply_plain(hectx, cts[mi * plan.db + di], pt)
                acc = prod if acc is None else (be.add_inplace(hectx, acc, prod) or acc)
            if acc is not None:
                np.testing.assert_array_equal(native[k], be.ciphertext_to_numpy(acc))
            else:  # no products: a zero sum (the finishing re-randomises it)
                assert (rhs.index[0, :, oi] < 0).all() and not native[k].any()
                zero_blocks += 1
            k += 1
    return k, zero_blocks


def test_native_block_products_equal_seal():
    """The native kernel gives the same residues as SEAL's multiply_plain + add_inplace on
    real encrypted inputs and encoded weights (including an all-zero weight column)."""
    _, (k, zero_blocks) = run_inprocess(_seal_block_products_party, timeout=120)
    assert k > 2 and zero_blocks >= 1


# ----------------------------------------------------------------------------- the native encryptor side
def _local_sessions():
    """Two HE sessions (party 0 and 1) that exchanged public keys, in this thread."""
    out = {}

    def party(ctx):
        he = he_session(ctx)
        out[ctx.party] = he
        return he.native

    assert run_inprocess(party, timeout=60) == (True, True)
    return out[0], out[1]


def test_native_encryption_decrypts_with_seal():
    """A native seeded encryption, expanded by the evaluator and handed to SEAL as a
    ciphertext, decrypts under SEAL to the plaintext (an oracle that shares no code)."""
    enc, _ = _local_sessions()
    rng = np.random.default_rng(11)
    polys = rng.integers(0, enc.t, (3, enc.n), dtype=np.uint64)
    msg = enc.encrypt_native(polys)
    assert len(msg["c0"]) == 3 * sum(-(-enc.n * int(q).bit_length() // 8) for q in enc.he.coeff_moduli)
    xs = enc.load_native(msg, 3)  # this party can expand its own seeds too
    be = enc.backend
    for i in range(3):
        ct = be.numpy_to_ciphertext(enc.he, xs[i], level=enc.top, ntt=True)
        be.from_ntt_inplace(enc.he, ct)
        got = be.plaintext_to_numpy(enc.keys.decrypt(ct))
        np.testing.assert_array_equal(np.pad(got, (0, enc.n - got.size)), polys[i])


def test_native_decryption_matches_seal():
    """decrypt_native equals SEAL's decrypt_compact on finished results (both switched down)."""
    enc, ev = _local_sessions()
    rng = np.random.default_rng(12)
    xs = ev.load_native(enc.encrypt_native(rng.integers(0, enc.t, (2, enc.n), dtype=np.uint64)), 2)
    positions = np.sort(rng.choice(enc.n, 300, replace=False))
    c1, c0, _ = ev.finish_native(xs, positions, L.noise_bound(1, 1))
    native = enc.decrypt_native(c1, c0, positions)
    seal_vals = np.stack([enc.decrypt_compact(c1[i], c0[i], positions) for i in range(2)])
    np.testing.assert_array_equal(native, seal_vals)


def test_native_inputs_refuse_malformed_messages():
    from cipherlm.he.errors import HEError as E

    enc, ev = _local_sessions()
    msg = enc.encrypt_native(np.zeros((2, enc.n), np.uint64))
    with pytest.raises(E, match="seeds"):
        ev.load_native(msg, 3)
    with pytest.raises(E):
        ev.load_native({"c0": msg["c0"][:-1], "seeds": msg["seeds"]}, 2)
    with pytest.raises(E):
        ev.load_native({"c0": "not bytes", "seeds": msg["seeds"]}, 2)
    bad = bytearray(msg["c0"])
    bad[:8] = b"\xff" * 8  # the first residue above its prime
    with pytest.raises(E, match="below its prime"):
        ev.load_native({"c0": bytes(bad), "seeds": msg["seeds"]}, 2)
    c1 = np.full((1, 2, enc.n), np.uint64(2 ** 63))
    with pytest.raises(E, match="below its prime"):
        enc.decrypt_native(c1, np.zeros((1, 2, 4), np.uint64), np.arange(4))


def test_evaluator_view_of_native_inputs_is_uniform_and_plaintext_independent():
    """What the server receives (c_0 residues of the first prime) is uniform and identically
    distributed for an all-zero and an all-(t - 1) plaintext."""
    enc, ev = _local_sessions()
    q0 = int(enc.he.coeff_moduli[0])
    views = []
    for fill in (0, enc.t - 1):
        xs = ev.load_native(enc.encrypt_native(np.full((4, enc.n), fill, np.uint64)), 4)
        views.append(xs[:, 0, 0].reshape(-1))
    assert_uniform_and_alike(views, q0)


@pytest.mark.parametrize("d,wbits", [(576, 20), (1536, 20), (40, 40)])
def test_small_matmul_through_blas_is_exact(d, wbits):
    """The server's local term x_1 W through float64 limbs equals the integer product mod 2^59
    (and falls back to it where a double could not hold the sums: 40-bit weights)."""
    rng = np.random.default_rng(d)
    a = rng.integers(0, 1 << 59, (7, d), dtype=np.uint64)
    w = rng.integers(-(1 << (wbits - 1)) + 1, 1 << (wbits - 1), (d, 33))
    w[0, 0] = -(1 << (wbits - 1)) + 1
    np.testing.assert_array_equal(L.matmul_small_mod(a, w, 59), L._matmul_mod(a, w.astype(np.uint64), 59))


@pytest.mark.parametrize("wide", [False, True], ids=["n8192", "n16384"])
def test_native_ntt_is_seals(wide):
    """`_core.ntt_rows` gives SEAL's NTT form bit for bit (both 2pc parameter sets), and its
    inverse undoes it."""
    from cipherlm import _core
    from cipherlm.he import serialize
    from cipherlm.he.backend import get_backend
    from cipherlm.mpc.he_session import TWOPC_BFV, TWOPC_BFV_WIDE

    be = get_backend("seal")
    hectx = be.context(TWOPC_BFV_WIDE if wide else TWOPC_BFV)
    keys = be.keygen(hectx)
    k = len(hectx.coeff_moduli)
    ct = be.encrypt_zero(hectx, be.load_public_key(hectx, keys.public_key_bytes()), be.level(hectx, k))
    coeff = serialize.ciphertext_to_numpy(ct)
    be.to_ntt_inplace(hectx, ct)
    moduli = [int(q) for q in hectx.coeff_moduli]
    mine = np.frombuffer(_core.ntt_rows(u64_bytes_view(coeff), moduli, hectx.n), np.uint64).reshape(coeff.shape)
    np.testing.assert_array_equal(mine, serialize.ciphertext_to_numpy(ct))
    back = np.frombuffer(_core.ntt_rows(u64_bytes_view(mine), moduli, hectx.n, True), np.uint64)
    np.testing.assert_array_equal(back.reshape(coeff.shape), coeff)

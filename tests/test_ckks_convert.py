"""BLB section 6: the CKKS <-> MPC conversions (`cipherlm.protocols.ckks_convert`).

* the canonical embedding (decode / encode) against SEAL's CKKS encoder;
* the decode of field shares with the wrap term and local truncation against numpy;
* Algorithm 1 (CKKS -> shares), Algorithm 2 (shares -> CKKS) and both in a row,
  against the plaintext values (fixed-point + CKKS precision), bytes and rounds;
* the client's view: its decrypted polynomial is uniform over Z_q and distributed
  the same whatever the message (chi-square, as tests/test_mpc_views.py);
* the MP2ML leak: with a CKKS-*encoded* uniform mask the client recovers the high
  bits of the message; with the uniform polynomial mask it cannot.
"""

import math

import numpy as np
import pytest

tenseal = pytest.importorskip("tenseal")
import tenseal.sealapi as seal

from cipherlm.he.backend import get_backend
from cipherlm.he.params import HEParams, check_security
from cipherlm.mpc.runner import run_inprocess
from cipherlm.protocols import ckks_convert as cc
from test_mpc_views import p_same, p_uniform  # the project's chi-square helpers

P_MIN = 1e-6
SMALL = HEParams("blb-conv-4096", "ckks", 4096, (60, 49))  # 109 <= 109 bits: data level = one 60-bit prime
WIDE = HEParams("blb-conv-8192", "ckks", 8192, (60, 40, 60))  # two data primes (conversion switches to q0)
TINY = HEParams("blb-conv-1024", "ckks", 1024, (27,))  # view statistics on a small ring
F = 16
ULP = 2.0 ** -F


_HE = {}


def he(params):
    """(backend, client context, keys, server context), cached per parameter set."""
    if params.name not in _HE:
        check_security(params)
        b = get_backend("seal")
        hc = b.context(params)
        _HE[params.name] = (b, hc, b.keygen(hc), b.context(params))
    return _HE[params.name]


def seal_encrypt(params, z, scale_bits=40, n_primes=None):
    _b, hc, keys, _ = he(params)
    pt = seal.Plaintext()
    pid = hc.parms_id_at(n_primes) if n_primes else hc.first_parms_id
    hc.encoder.encode(np.asarray(z, float).tolist(), pid, 2.0 ** scale_bits, pt)
    return keys.encrypt(pt)


def seal_decrypt(params, ct, n):
    _b, hc, keys, _ = he(params)
    return np.array(hc.encoder.decode_double(keys.decrypt(ct)))[:n]


def signed(x, q):
    x = np.asarray(x, np.uint64)
    return np.where(x > np.uint64(q // 2), x.astype(np.int64) - np.int64(q), x.astype(np.int64))


def top(v, q, bins):
    """The bin of each residue in [0, q) (floats: v * bins overflows uint64)."""
    return np.minimum((np.asarray(v, np.float64).reshape(-1) / q * bins).astype(np.int64), bins - 1)


def reveal(y0, y1):
    return (y0 + y1).view(np.int64) / 2.0 ** F


def run(params, server_fn, client_fn):
    """Party 0 = client (key holder), party 1 = server; returns (client, server, stats)."""
    b, hc_c, keys, hc_s = he(params)

    def party(ctx):
        side = cc.setup(ctx, b, hc_s if ctx.party == 1 else hc_c, keys if ctx.party == 0 else None)
        base = ctx.chan.stats()
        out = (server_fn if ctx.party == 1 else client_fn)(ctx, side)
        st = ctx.chan.stats()
        return out, {k: {kk: v[kk] - base.get(k, {}).get(kk, 0) for kk in v} for k, v in st.items()}

    r0, r1 = run_inprocess(party, timeout=300)
    return r0, r1


# ----------------------------------------------------------------------------- embedding
def test_canonical_embedding_matches_seal():
    b, hc, keys, _ = he(SMALL)
    n = SMALL.poly_modulus_degree
    z = np.random.default_rng(1).uniform(-8, 8, n // 2)
    m = b.decrypt_coeffs(hc, keys, seal_encrypt(SMALL, z))[0]
    q = hc.coeff_moduli[0]
    assert np.abs(cc.canonical_decode(signed(m, q)) / 2.0 ** 40 - z).max() < 1e-6
    # encode: SEAL's coefficients are round(Delta * encode(z)) (+ the fresh encryption noise)
    assert np.abs(cc.canonical_encode(z, n) * 2.0 ** 40 - signed(m, q)).max() < 200
    # the backend's residue NTT round-trips
    x = np.random.default_rng(2).integers(0, q, (1, n), dtype=np.uint64)
    assert (b.ntt_inverse(hc, b.ntt_forward(hc, x)) == x).all()


def test_decode_shares_against_numpy():
    """The FFT decode of field shares (wrap term + guard bits + local truncation) against
    numpy's canonical embedding of the reconstructed polynomial."""
    n, q, scale = 4096, he(SMALL)[1].coeff_moduli[0], 2.0 ** 40
    rng = np.random.default_rng(3)
    z = rng.uniform(-100, 100, n // 2)
    z[:4] = [0.0, -100.0, 100.0, ULP]
    m = np.rint(cc.canonical_encode(z, n) * scale).astype(np.int64) + rng.integers(-50, 50, n)
    r = rng.integers(0, q, n, dtype=np.uint64)
    x_c = ((m % q).astype(np.uint64) + r) % np.uint64(q)
    x_s = (np.uint64(q) - r) % np.uint64(q)
    want = cc.canonical_decode(m) / scale

    def f(ctx):
        return cc.decode_shares(ctx, x_c if ctx.party == 0 else x_s, q, scale, n // 2).data

    y0, y1 = run_inprocess(f, timeout=120)
    got = reveal(y0, y1)
    assert np.abs(got - want).max() < 3 * ULP, np.abs(got - want).max()


@pytest.mark.parametrize("n", [16, 1024, 8192])
def test_fast_wrap_maps_equal_the_dense_ones(n):
    """The O(N log N) Rader-style evaluation of the decode / encode integer maps is bit-exact
    with the dense products, over Z_2^64 (cos and sin tables, full and partial slot counts)."""
    rng = np.random.default_rng(n)
    i = np.arange(n, dtype=np.int64)
    for table in (cc._cos_table(n, 2.0 ** 43), cc._cos_table(n, 2.0 ** 20, np.sin)):
        W = rng.integers(0, 2 ** 64, n, dtype=np.uint64)
        for ns in (n // 2, max(1, n // 6)):
            e = cc.slot_exponents(n, ns)
            assert (cc._wrap_fast(table, n, W, ns, encode=False) == cc._wrap_product(table, e, i, W)).all()
            Y = W[:ns]
            assert (cc._wrap_fast(table, n, Y, None, encode=True) == cc._wrap_product(table, i, e, Y)).all()
            # batched rows: each row's map, one table for all
            W2 = np.stack([W, W[::-1]])
            assert (cc._wrap_fast(table, n, W2, ns, encode=False)[1] == cc._wrap_product(table, e, i, W[::-1])).all()
            assert (cc._wrap_fast(table, n, W2[:, :ns], None, encode=True)[1]
                    == cc._wrap_product(table, i, e, W[::-1][:ns])).all()


@pytest.mark.parametrize("modulus,lbits", [(1152921504606830593, 60), (2 ** 64, 64), (134215681, 27)])
def test_wrap_small_against_exact(modulus, lbits):
    """The wrap of shares of a value within modulus/2 +- modulus/4 from the top 6 bits of
    each share (one 8-bit millionaire) equals the exact wrap, edges included."""
    rng = np.random.default_rng(6)
    n = 4000
    quarter = modulus // 4 - 1
    m = [int(v) for v in rng.integers(-(2 ** 62), 2 ** 62, n)]
    m = [v % (2 * quarter + 1) - quarter for v in m]
    m[:4] = [quarter, -quarter, 0, -1]
    u = [(v + modulus // 2) % modulus for v in m]
    u0 = [int(v) for v in rng.integers(0, 2 ** 62, n)]
    u0 = [v % modulus for v in u0]
    u0[4:8] = [0, modulus - 1, (modulus - u[6]) % modulus, (modulus - u[7] - 1) % modulus]
    u1 = [(a - b) % modulus for a, b in zip(u, u0)]
    want = np.array([int(a + b >= modulus) for a, b in zip(u0, u1)])
    a0, a1 = np.array(u0, np.uint64), np.array(u1, np.uint64)

    def f(ctx):
        return cc.wrap_small(ctx, a0 if ctx.party == 0 else a1, modulus, lbits)

    w0, w1 = run_inprocess(f, timeout=60)
    assert ((w0 ^ w1).astype(int) == want).all()
    assert 0 < want.sum() < n


# ----------------------------------------------------------------------------- Algorithms 1-2
@pytest.mark.parametrize("params", [SMALL, WIDE], ids=["n4096-1prime", "n8192-2primes"])
def test_algorithm1_ckks_to_shares(params):
    n = params.poly_modulus_degree
    slots = n // 2 if params is SMALL else 512
    z = np.random.default_rng(4).uniform(-8, 8, n // 2)
    ct = seal_encrypt(params, z)
    b = he(params)[0]
    data = b.ciphertext_to_bytes(ct)

    def server(ctx, side):
        return cc.ckks_to_shares(ctx, b.ciphertext_from_bytes(side.hectx, data), side, n_slots=slots).data

    def client(ctx, side):
        return cc.ckks_to_shares(ctx, None, side, n_slots=slots).data

    (y0, st0), (y1, st1) = run(params, server, client)
    err = np.abs(reveal(y0, y1) - z[:slots]).max()
    assert err < 4 * ULP, err
    ck = st1["ckks2mpc"]  # the masked ciphertext, server -> client, one message
    assert ck["messages_sent"] == 1 and 2 * n * 8 < ck["bytes_sent"] < 2 * n * 8 + 1024
    assert sum(v["rounds"] for v in st0.values()) <= 12


def test_algorithm1_after_a_plaintext_product():
    """The use case: the server's ciphertext is x * W (ct x pt product, rescaled: the scale is
    2^80 / q1, not a power of two; the noise depends on W), default flooding."""
    params = WIDE
    n = params.poly_modulus_degree
    rng = np.random.default_rng(12)
    x = rng.uniform(-4, 4, n // 2)
    wv = rng.uniform(-4, 4, n // 2)
    b, _hc, _keys, hs = he(params)
    data = b.ciphertext_to_bytes(seal_encrypt(params, x))
    slots = 256

    def server(ctx, side):
        ct = b.ciphertext_from_bytes(hs, data)
        pt = seal.Plaintext()
        hs.encoder.encode(wv.tolist(), list(ct.parms_id()), 2.0 ** 40, pt)
        hs.evaluator.multiply_plain_inplace(ct, pt)
        hs.evaluator.rescale_to_next_inplace(ct)
        assert b.ciphertext_scale(ct) != 2.0 ** 40
        return cc.ckks_to_shares(ctx, ct, side, n_slots=slots).data

    def client(ctx, side):
        return cc.ckks_to_shares(ctx, None, side, n_slots=slots).data

    (y0, _), (y1, _) = run(params, server, client)
    err = np.abs(reveal(y0, y1) - (x * wv)[:slots]).max()
    assert err < 4 * ULP, err


@pytest.mark.parametrize("scale_bits,value_bits,ring_to_field", [(40, None, "wrap"), (50, 4, "wrap"),
                                                                   (40, None, "local"), (50, None, "local")])
def test_algorithm2_shares_to_ckks_and_back(scale_bits, value_bits, ring_to_field):
    params = SMALL
    n = params.poly_modulus_degree
    rng = np.random.default_rng(5)
    z = rng.uniform(-8, 8, n // 2)
    Z = np.rint(z * 2 ** F).astype(np.int64)
    s0 = rng.integers(0, 2 ** 64, n // 2, dtype=np.uint64)
    s1 = Z.astype(np.uint64) - s0
    b = he(params)[0]
    from cipherlm.mpc.shares import AShare

    def server(ctx, side):
        ct = cc.shares_to_ckks(ctx, AShare(ctx, s1, 64, F), side, scale_bits=scale_bits, value_bits=value_bits,
                               ring_to_field=ring_to_field)
        back = cc.ckks_to_shares(ctx, ct, side).data
        return b.ciphertext_to_bytes(ct), back

    def client(ctx, side):
        assert cc.shares_to_ckks(ctx, AShare(ctx, s0, 64, F), side, scale_bits=scale_bits,
                                value_bits=value_bits, ring_to_field=ring_to_field) is None
        return None, cc.ckks_to_shares(ctx, None, side).data, ctx.chan.stats()

    (c, st0), (s, _st1) = run(params, server, client)
    hc = he(params)[1]
    ct = b.ciphertext_from_bytes(hc, s[0])
    assert b.ciphertext_scale(ct) == 2.0 ** scale_bits
    got = seal_decrypt(params, ct, n // 2)
    # encode rounding: ~0.3 (N/2) |y| 2^f / Delta per slot
    tol = 2e-3 if scale_bits == 40 else 4e-6
    assert np.abs(got - Z / 2 ** F).max() < tol
    assert np.abs(reveal(c[1], s[1]) - Z / 2 ** F).max() < tol + 4 * ULP
    enc = st0["mpc2ckks"]  # the client's seeded encryption: about half a ciphertext
    assert enc["messages_sent"] == 1 and n * 8 < enc["bytes_sent"] < n * 8 + 1024
    if ring_to_field == "local":  # C.3's local change of modulus: nothing else before Algorithm 1
        before = {k: v for k, v in c[2].items() if k not in ("ckks2mpc",) and v["bytes_sent"]}
        assert set(before) <= {"mpc2ckks", "ckks_setup", "ot.base", "ot.ferret", "ot.iknp", "millionaire_leaves",
                               "bit_triples", "and", "b2a"}
        assert "b2a_mod" not in c[2] and "ring_to_field" not in c[2]


def _dense_encode(Y, n, scale, frac, q):
    """The integer encode A Y mod q with Python integers (the oracle): A_ij =
    round(scale 2^(1-frac) / N cos(pi e_j i / N)), Y read as signed 64-bit integers."""
    e = cc.slot_exponents(n, Y.size)
    A = np.rint(scale * 2.0 ** (1 - frac) / n * np.cos(np.pi * np.outer(np.arange(n), e) / n)).astype(np.int64)
    Ys = [int(v) for v in Y.view(np.int64)]
    return np.array([sum(int(a) * y for a, y in zip(row, Ys)) % q for row in A], dtype=object)


def test_local_ring_to_field_encodes_each_share_exactly_mod_every_prime():
    """`encode_mod_primes`: one party's share, read as a signed 64-bit integer, encoded exactly
    over the integers (the dense Python-integer product) and reduced mod each prime, for
    shares that fill all 64 bits (negative and positive top limbs)."""
    n = 64
    primes = ((1 << 60) - 93, 1099511627689)  # any odd moduli below 2^61: no NTT is involved
    rng = np.random.default_rng(3)
    Y = rng.integers(0, 2 ** 64, n // 2, dtype=np.uint64)
    Y[:4] = np.array([0, 2 ** 63, 2 ** 63 - 1, 2 ** 64 - 1], np.uint64)  # the extremes of the signed range
    got = cc.encode_mod_primes(Y, n, 2.0 ** 50, F, primes)
    for i, q in enumerate(primes):
        assert [int(v) for v in got[i]] == list(_dense_encode(Y, n, 2.0 ** 50, F, q))
    batched = cc.encode_mod_primes(np.stack([Y[::-1], Y]), n, 2.0 ** 50, F, primes)  # (m, k, N), one call
    assert batched.shape == (2, len(primes), n) and (batched[1] == got).all()
    for i, q in enumerate(primes):
        assert [int(v) for v in batched[0, i]] == list(_dense_encode(Y[::-1].copy(), n, 2.0 ** 50, F, q))
    with pytest.raises(ValueError, match="ring_to_field='wrap'"):
        cc.encode_mod_primes(Y, n, 2.0 ** 100, F, primes)


def test_local_ring_to_field_fails_only_in_the_window_it_states():
    """The two parties' local encodings add up to the encoding of y unless the client's share,
    read as a signed integer, lies in the window [-2^63, -2^63 + Y] of |Y| + 1 values
    (probability (|Y| + 1) / 2^64): just outside it the sum is right, at its edge it is off by
    2^64 in Y."""
    n, q = 64, (1 << 60) - 93
    Y = np.zeros(n // 2, np.int64)
    Y[0] = 5 << F  # y_0 = 5
    want = _dense_encode(Y.astype(np.uint64), n, 2.0 ** 50, F, q)

    def total(s0_first):
        s0 = np.random.default_rng(1).integers(0, 2 ** 64, n // 2, dtype=np.uint64)
        s0[0] = np.uint64(s0_first)
        s1 = Y.astype(np.uint64) - s0
        return [int(a + b) % q for a, b in zip(cc.encode_mod_primes(s0, n, 2.0 ** 50, F, (q,))[0],
                                                cc.encode_mod_primes(s1, n, 2.0 ** 50, F, (q,))[0])]

    edge = 2 ** 63 + int(Y[0])  # s0 = -2^63 + Y: s1 = Y - s0 = 2^63 does not fit, it wraps
    assert total(edge + 1) == list(want)  # s1 = 2^63 - 1: no wrap
    assert total(edge) != list(want)
    off = Y.astype(object)
    off[0] -= 2 ** 64
    assert total(edge) == _dense_encode_obj(off, n, 2.0 ** 50, F, q)


def _dense_encode_obj(Ys, n, scale, frac, q):
    e = cc.slot_exponents(n, len(Ys))
    A = np.rint(scale * 2.0 ** (1 - frac) / n * np.cos(np.pi * np.outer(np.arange(n), e) / n)).astype(np.int64)
    return [sum(int(a) * int(y) for a, y in zip(row, Ys)) % q for row in A]


def test_complex_slots_round_trip():
    """N real values per ciphertext: real parts then imaginary parts of the N/2 slots.
    Algorithm 2 -> SEAL's complex decode, then Algorithm 1 back."""
    params = SMALL
    n = params.poly_modulus_degree
    rng = np.random.default_rng(11)
    z = rng.uniform(-8, 8, n)
    Z = np.rint(z * 2 ** F).astype(np.int64)
    s0 = rng.integers(0, 2 ** 64, n, dtype=np.uint64)
    s1 = Z.astype(np.uint64) - s0
    b, hc = he(params)[0], he(params)[1]
    from cipherlm.mpc.shares import AShare

    def server(ctx, side):
        ct = cc.shares_to_ckks(ctx, AShare(ctx, s1, 64, F), side, value_bits=4, complex_slots=True)
        data = b.ciphertext_to_bytes(ct)
        return data, cc.ckks_to_shares(ctx, ct, side, complex_slots=True).data

    def client(ctx, side):
        cc.shares_to_ckks(ctx, AShare(ctx, s0, 64, F), side, value_bits=4, complex_slots=True)
        return None, cc.ckks_to_shares(ctx, None, side, complex_slots=True).data

    (c, _), (s, st1) = run(params, server, client)
    keys = he(params)[2]
    got = np.array(hc.encoder.decode_complex(keys.decrypt(b.ciphertext_from_bytes(hc, s[0]))))
    want = (Z[: n // 2] + 1j * Z[n // 2:]) / 2 ** F
    assert np.abs(got - want).max() < 1e-5
    assert np.abs(reveal(c[1], s[1]) - Z / 2 ** F).max() < 4 * ULP
    # the same masked ciphertext as for real slots: twice the values per byte
    assert st1["ckks2mpc"]["messages_sent"] == 1


def test_batched_conversions_equal_single_ones_in_one_set_of_rounds(monkeypatch):
    """`shares_to_ckks_many` / `ckks_to_shares_many`: m ciphertexts give the values of m single
    conversions, in the rounds of one (one message of ciphertexts each way, one millionaire and
    one OT batch), for the bytes of m; past `batch_size` they split into batches."""
    params = SMALL
    n = params.poly_modulus_degree
    rng = np.random.default_rng(12)
    m = 3
    Z = np.rint(rng.uniform(-8, 8, (m, n // 2)) * 2 ** F).astype(np.int64)
    s0 = rng.integers(0, 2 ** 64, Z.shape, dtype=np.uint64)
    s1 = Z.astype(np.uint64) - s0
    b = he(params)[0]
    from cipherlm.mpc.shares import AShare

    def both(share, many):
        def fn(ctx, side):
            y = AShare(ctx, share[:m if many else 1], 64, F)
            cts = cc.shares_to_ckks_many(ctx, y, side, value_bits=4)
            return cc.ckks_to_shares_many(ctx, cts, side, m if many else 1).data
        return fn

    for many in (True, False):
        (c, st0), (s, st1) = run(params, both(s1, many), both(s0, many))
        k = m if many else 1
        assert c.shape == (k, n // 2)
        assert np.abs(reveal(c, s) - Z[:k] / 2 ** F).max() < 4 * ULP
        assert st0["mpc2ckks"]["messages_sent"] == 1 and st1["ckks2mpc"]["messages_sent"] == 1
        if many:
            batched = (st0, st1)
    single = (st0, st1)
    for label in ("mpc2ckks", "ckks2mpc", "millionaire_leaves"):
        for side in (0, 1):
            a = batched[side].get(label, {}).get("bytes_sent", 0)
            one = single[side].get(label, {}).get("bytes_sent", 0)
            assert abs(a - m * one) <= 0.02 * m * one + 64, (label, side, a, one)
    for side in (0, 1):  # the rounds of one conversion for m ciphertexts
        assert sum(v["rounds"] for v in batched[side].values()) == sum(v["rounds"] for v in single[side].values())
    monkeypatch.setattr(cc, "BATCH_COEFFS", n)  # one ciphertext per batch: m batches
    (c, st0), (s, _) = run(params, both(s1, True), both(s0, True))
    assert np.abs(reveal(c, s) - Z / 2 ** F).max() < 4 * ULP
    assert st0["mpc2ckks"]["messages_sent"] == m
    assert sum(v["rounds"] for v in st0.values()) > sum(v["rounds"] for v in single[0].values())


@pytest.mark.parametrize("params,m", [(SMALL, 3), (WIDE, 2)])
def test_paired_conversion_carries_two_real_ciphertexts_in_one(params, m):
    """`ckks_to_shares_many(..., paired=True)`: m real-slot ciphertexts travel as ceil(m / 2)
    (the second of a pair times X^(N/2) in the imaginary parts, SEAL's slot order flipping
    the sign of every other one); the shares equal the values as for m single conversions, for
    half the ciphertext bytes and half the millionaire's."""
    n = params.poly_modulus_degree
    rng = np.random.default_rng(2)
    z = rng.uniform(-8, 8, (m, n // 2))
    b, _, _, hs = he(params)

    def both(paired):
        def server(ctx, side):
            cts = [b.ciphertext_from_bytes(hs, b.ciphertext_to_bytes(seal_encrypt(params, v, 40))) for v in z]
            return cc.ckks_to_shares_many(ctx, cts, side, m, paired=paired).data

        def client(ctx, side):
            return cc.ckks_to_shares_many(ctx, None, side, m, paired=paired).data
        return run(params, server, client)

    stats = {}
    for paired in (True, False):
        (c, st0), (s, st1) = both(paired)
        assert c.shape == (m, n // 2)
        assert np.abs(reveal(c, s) - z).max() < 4 * ULP + 1e-5
        stats[paired] = (st1["ckks2mpc"]["bytes_sent"], st0["millionaire_leaves"]["bytes_sent"])
    pairs = (m + 1) // 2
    assert stats[True][0] * m == pytest.approx(stats[False][0] * pairs, rel=0.01)
    assert stats[True][1] < stats[False][1] * pairs / m * 1.05 + 64
    assert set(np.unique(cc.imaginary_signs(n, n // 2, 3))) == {-1, 1}  # SEAL's order: both signs
    assert (cc.imaginary_signs(n, n // 2, 5) == 1).all()  # Lattigo's: 5^j = 1 mod 4


def test_paired_conversion_refuses_different_scales():
    params = SMALL
    n = params.poly_modulus_degree
    b, _, _, hs = he(params)

    def server(ctx, side):
        cts = [b.ciphertext_from_bytes(hs, b.ciphertext_to_bytes(seal_encrypt(params, np.zeros(n // 2), sb)))
               for sb in (40, 41)]
        with pytest.raises(ValueError, match="different scales"):
            cc.ckks_to_shares_many(ctx, cts, side, 2, paired=True)
        ctx.send({"cts": []})

    def client(ctx, side):
        with pytest.raises(ValueError, match="expected a list of 1 ciphertexts"):
            cc.ckks_to_shares_many(ctx, None, side, 2, paired=True)

    run(params, server, client)


@pytest.mark.parametrize("msg", [{"cts": b"x"}, {"cts": []}, {"cts": [b"a", b"b", b"c"]}, {}])
def test_batched_conversion_refuses_a_malformed_message(msg):
    """A peer's message of ciphertexts without a list of the announced count gives the
    module's ValueError (the channel itself refuses a message that is not a dict)."""
    def server(ctx, side):
        ctx.send(msg)

    def client(ctx, side):
        with pytest.raises(ValueError, match="expected a list of 2 ciphertexts"):
            cc.ckks_to_shares_many(ctx, None, side, 2)

    run(SMALL, server, client)


# ----------------------------------------------------------------------------- views
def _client_views(params, messages, mask="uniform", R=2.0 ** 12, scale_bits=None):
    """The client's decrypted polynomial (N,) for each message (slot vector)."""
    b, hc, keys, hs = he(params)
    side_s = cc.CKKSSide(b, hs, None, b.load_public_key(hs, keys.public_key_bytes()), 1)
    side_c = cc.CKKSSide(b, hc, keys, None, 1)
    n = params.poly_modulus_degree
    q = hc.coeff_moduli[0]
    sb = scale_bits if scale_bits is not None else 40
    rng = np.random.default_rng(7)
    out = []
    for z in messages:
        ct = b.ciphertext_from_bytes(hs, b.ciphertext_to_bytes(seal_encrypt(params, z, sb)))
        if mask == "uniform":  # BLB Algorithm 1, the server's step
            data, _, _ = cc.mask_ciphertext(side_s, ct, rng, flood_bits=0)
        else:  # MP2ML: Encode(s) for a uniform slot vector s in [-R, R]
            s = rng.uniform(-R, R, n // 2)
            enc = np.mod(np.rint(cc.canonical_encode(s, n) * 2.0 ** sb).astype(np.int64), q).astype(np.uint64)
            arr = b.ciphertext_to_numpy(ct)
            arr[0, 0] = (arr[0, 0] + b.ntt_forward(hs, enc[None])[0]) % np.uint64(q)
            data = b.ciphertext_to_bytes(b.numpy_to_ciphertext(hs, arr, ntt=True, scale=2.0 ** sb))
        out.append(cc.client_decrypt(side_c, data)[0])
    return np.array(out), q


def test_client_view_uniform_and_independent_of_message():
    """Theorem 1: the client's decryption m + e + r is uniform over Z_q, the same for a zero
    message and a large one (N = 1024, q of 27 bits; top 6 bits of every coefficient)."""
    n = TINY.poly_modulus_degree
    rng = np.random.default_rng(8)
    zero = [np.zeros(n // 2)] * 8
    big = [rng.uniform(500, 1000, n // 2) for _ in range(8)]  # large expectation: MP2ML's bad case
    va, q = _client_views(TINY, zero, scale_bits=10)
    vb, _ = _client_views(TINY, big, scale_bits=10)
    bins = 64
    ba, bb = top(va, q, bins), top(vb, q, bins)
    assert min(p_uniform(ba, bins), p_uniform(bb, bins)) > P_MIN
    assert p_same(ba, bb, bins) > P_MIN
    # the low bits too (uniform over the whole of Z_q, not only the top)
    assert p_uniform(va.reshape(-1) % 64, 64) > P_MIN


def test_client_view_of_a_paired_conversion_is_uniform():
    """Algorithm 1 with two ciphertexts in one (``imag``: the second times X^(N/2)): the
    client's decryption is still uniform over Z_q and the same for zero messages and large
    ones in both halves (N = 1024, q of 27 bits)."""
    b, hc, keys, hs = he(TINY)
    n = TINY.poly_modulus_degree
    side_s = cc.CKKSSide(b, hs, None, b.load_public_key(hs, keys.public_key_bytes()), 1)
    side_c = cc.CKKSSide(b, hc, keys, None, 1)
    rng = np.random.default_rng(9)

    def views(make):
        out = []
        for _ in range(8):
            re, im = (b.ciphertext_from_bytes(hs, b.ciphertext_to_bytes(seal_encrypt(TINY, make(), 10)))
                      for _ in range(2))
            data, _, _ = cc.mask_ciphertext(side_s, re, rng, flood_bits=0, imag=im)
            out.append(cc.client_decrypt(side_c, data)[0])
        return np.array(out)

    va = views(lambda: np.zeros(n // 2))
    vb = views(lambda: rng.uniform(500, 1000, n // 2))
    q, bins = hc.coeff_moduli[0], 64
    ba, bb = top(va, q, bins), top(vb, q, bins)
    assert min(p_uniform(ba, bins), p_uniform(bb, bins)) > P_MIN
    assert p_same(ba, bb, bins) > P_MIN


def test_client_view_independent_of_weights():
    """The acceptance case: the server's ciphertext is Enc(x) * W (ct x pt, W the server's
    weights; the product's noise and c1 depend on W).  The client's decryption after BLB's
    masking is uniform over Z_q and distributed the same for two very different W."""
    b, hc, keys, hs = he(SMALL)
    n = SMALL.poly_modulus_degree
    side_s = cc.CKKSSide(b, hs, None, b.load_public_key(hs, keys.public_key_bytes()), 1)
    side_c = cc.CKKSSide(b, hc, keys, None, 1)
    rng = np.random.default_rng(10)
    x = rng.uniform(-4, 4, n // 2)
    W1, W2 = np.zeros(n // 2) + 0.001, rng.uniform(8, 16, n // 2)  # tiny vs large, far from zero
    views = []
    for W in (W1, W2):
        vs = []
        for _ in range(4):
            ct = seal_encrypt(SMALL, x, 20)
            pt = seal.Plaintext()
            hs.encoder.encode(W.tolist(), list(ct.parms_id()), 2.0 ** 20, pt)
            hs.evaluator.multiply_plain_inplace(ct, pt)  # scale 2^40, weight-dependent c1 and noise
            data, _, _ = cc.mask_ciphertext(side_s, ct, rng)
            vs.append(cc.client_decrypt(side_c, data)[0])
        views.append(np.array(vs))
    q = hc.coeff_moduli[0]
    bins = 64
    a, c = top(views[0], q, bins), top(views[1], q, bins)
    assert min(p_uniform(a, bins), p_uniform(c, bins)) > P_MIN
    assert p_same(a, c, bins) > P_MIN


def test_mp2ml_leak_and_uniform_mask():
    """MP2ML (section 6.2): a uniform *slot* mask s in [-2^12, 2^12], CKKS-encoded, is bell
    shaped in the coefficient domain (std ~ Delta 2^12 / sqrt(1.5 N) << q): the client reads
    the message's mean slot value c (coefficient 0 = Delta * mean) off its decryption.  With
    BLB's uniform polynomial mask the same estimate is noise."""
    n = SMALL.poly_modulus_degree
    rng = np.random.default_rng(9)
    cs = rng.uniform(-1000, 1000, 24)
    msgs = [c + rng.uniform(-1, 1, n // 2) for c in cs]
    v_mp2ml, q = _client_views(SMALL, msgs, mask="encoded")
    v_blb, _ = _client_views(SMALL, msgs, mask="uniform")
    est_mp2ml = signed(v_mp2ml[:, 0], q) / 2.0 ** 40
    est_blb = signed(v_blb[:, 0], q) / 2.0 ** 40
    sigma = 2.0 ** 12 / math.sqrt(1.5 * n)  # ~52
    assert np.abs(est_mp2ml - cs).max() < 6 * sigma  # the high bits of m_0 leak
    assert np.corrcoef(est_mp2ml, cs)[0, 1] > 0.95
    assert abs(np.corrcoef(est_blb, cs)[0, 1]) < 0.7
    assert np.median(np.abs(est_blb - cs)) > 1000 * sigma  # estimates spread over all of Z_q
    # and the views themselves: MP2ML's is far from uniform over Z_q, BLB's is uniform
    bins = 64
    assert p_uniform(top(v_mp2ml, q, bins), bins) < P_MIN
    assert p_uniform(top(v_blb, q, bins), bins) > P_MIN

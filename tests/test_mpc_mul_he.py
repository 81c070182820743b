"""The HE elementwise product (`cipherlm.mpc.protocols.mul_he`, Cheetah section 3):
the native CRT kernels against Python big integers, products against numpy (exact
and one-unit modes, rings of 64 and 16 bits, more than one ciphertext), the
fixed-point product, the views (chi-square on a small ring), the flooding budget and
counter, bytes against the formula, bad input, two OS processes, and `mul`'s choice."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cipherlm.mpc import he_session as HS
from cipherlm.mpc.context import MPCError
from cipherlm.mpc.protocols import mul, mul_he
from cipherlm.mpc.ring import RingConfig, mask, to_signed
from cipherlm.mpc.runner import PartyFailed, run_inprocess, run_processes
from cipherlm.mpc.shares import AShare, share_input

sys.path.insert(0, str(Path(__file__).parent))
from test_mpc_views import P_MIN, p_same, p_uniform  # noqa: E402  the project's chi-square helpers

N = mul_he.N


def _big_encode(a, primes, bits):
    P = math.prod(primes)
    return np.array([[(P * int(x) + (1 << (bits - 1))) // (1 << bits) % t for x in a] for t in primes], np.uint64)


def _big_rescale(cs, primes, bits):
    P = math.prod(primes)
    return np.array([((c << bits) + P // 2) // P % (1 << bits) for c in cs], np.uint64)


@pytest.mark.parametrize("bits", [64, 37, 8])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_crt_kernels_match_big_integers(bits, m):
    rng = np.random.default_rng(bits + m)
    primes = mul_he.plain_primes(m)
    P = math.prod(primes)
    a = rng.integers(0, 1 << min(bits, 63), 500, dtype=np.uint64) << np.uint64(max(0, bits - 63) if bits == 64 else 0)
    a = np.concatenate([a, np.array([0, 1, int(mask(bits))], np.uint64)]) & mask(bits)
    assert (mul_he.encode_scaled(a, primes, bits) == _big_encode(a, primes, bits)).all()
    cs = [int.from_bytes(rng.bytes(32), "little") % P for _ in range(500)] + [0, P - 1, P // 2]
    res = np.array([[c % t for c in cs] for t in primes], np.uint64)
    assert (mul_he.rescale(res, primes, bits) == _big_rescale(cs, primes, bits)).all()


def test_multiword_residues_match_big_integers():
    """The flooding's reduction (`_core.multiword_residues`, used by `HESession`)."""
    from cipherlm import _core

    rng = np.random.default_rng(2)
    moduli = [(1 << 60) - 93, 8796092858369, 3]
    words = rng.integers(0, 1 << 63, (300, 3), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    off = [5, 7, 2]
    got = np.frombuffer(_core.multiword_residues(words.view(np.uint8).reshape(-1), 3, moduli, off), np.uint64)
    ints = [sum(int(v) << (64 * i) for i, v in enumerate(row)) for row in words]
    want = np.array([[(u - o) % q for u in ints] for q, o in zip(moduli, off)], np.uint64)
    assert (got.reshape(3, 300) == want).all()
    with pytest.raises(ValueError, match="offset"):
        _core.multiword_residues(words.view(np.uint8).reshape(-1), 3, moduli, [5, 7, 3])


def test_crt_kernels_reject_bad_arguments():
    from cipherlm import _core

    primes = list(mul_he.plain_primes(2))
    with pytest.raises(ValueError, match="reduced"):
        _core.crt_rescale_pow2(np.array([primes[0], 0], np.uint64).view(np.uint8), primes, [1, 1], [0, 0], [1, 1], 64)
    with pytest.raises(ValueError, match="one entry per prime"):
        _core.crt_rescale_pow2(np.zeros(2, np.uint64).view(np.uint8), primes, [1], [0, 0], [1, 1], 64)
    with pytest.raises(ValueError, match="below 2"):
        _core.crt_encode_scaled(np.array([256], np.uint64).view(np.uint8), primes, [0, 0], 0, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        _core.crt_encode_scaled(b"\x00" * 7, primes, [0, 0], 0, 64)


def _products(ctx, X, Y, bits, exact):
    # party 0 owns X, party 1 owns Y: both shared, then multiplied and squared
    x = share_input(ctx, X if ctx.party == 0 else None, 0, bits=bits, frac=0)
    y = share_input(ctx, Y if ctx.party == 1 else None, 1, bits=bits, frac=0)
    return (mul.mul(ctx, x, y, exact=exact, method="he").reveal(),
            mul.square(ctx, x, exact=exact, method="he").reveal())


@pytest.mark.parametrize("bits", [64, 16])
def test_products_against_numpy(bits):
    rng = np.random.default_rng(bits)
    n = N + 37  # two ciphertexts, the second one almost empty
    X = rng.integers(0, 1 << 62, n, dtype=np.uint64) * np.uint64(3) & mask(bits)
    Y = rng.integers(0, 1 << 62, n, dtype=np.uint64) * np.uint64(5) & mask(bits)
    want_xy, want_xx = (X * Y) & mask(bits), (X * X) & mask(bits)
    (xy, xx), _ = run_inprocess(_products, args0=(X, Y, bits, True), args1=(X, Y, bits, True),
                                ring=RingConfig(bits, 0), timeout=300)
    assert (xy == want_xy).all() and (xx == want_xx).all()
    (xy, xx), _ = run_inprocess(_products, args0=(X, Y, bits, False), args1=(X, Y, bits, False),
                                ring=RingConfig(bits, 0), timeout=300)
    d1, d2 = to_signed((xy - want_xy) & mask(bits), bits), to_signed((xx - want_xx) & mask(bits), bits)
    assert set(np.unique(d1)) <= {-1, 0, 1} and set(np.unique(d2)) <= {-2, 0, 2}
    assert (d1 == 0).mean() > 0.5  # the error is rare, not systematic


def _fixed(ctx, U, V):
    x = share_input(ctx, U if ctx.party == 0 else None, 0)
    y = share_input(ctx, V if ctx.party == 1 else None, 1)
    return mul.mul_fixed(ctx, x, y).reveal_float()


def test_fixed_point_product_through_he(monkeypatch):
    monkeypatch.setenv("CIPHERLM_MUL", "he")
    rng = np.random.default_rng(5)
    U, V = rng.uniform(-100, 100, 3000), rng.uniform(-100, 100, 3000)
    got, _ = run_inprocess(_fixed, args0=(U, V), args1=(U, V), timeout=300)
    f = 16
    # as test_mpc_protocols.test_fixed_point_mul_error_bound, plus the product's unit (2^-2f) before truncation
    bound = 2 * 100 * 2.0 ** -(f + 1) + 2 * 2.0 ** -(2 * f) + 2.0 ** -f
    assert np.abs(got - U * V).max() <= bound


def test_a_zero_operand_is_still_hidden():
    """Party 1's operand all zero (a public constant's share): no transparent ciphertext,
    party 0 still receives a masked, flooded result and the product is right."""
    def party(ctx):
        a = np.arange(10, dtype=np.uint64) + np.uint64(1 << 40)
        v = a if ctx.party == 0 else np.zeros(10, np.uint64)
        return mul_he.cross_products(ctx, [v, v], 64, exact=True)
    a, b = run_inprocess(party, timeout=120)
    assert ((a + b) == 0).all() and a.any()


# ------------------------------------------------------------------ views
BITS = 8
#: one ciphertext (one-way flow) and two (each party encrypts one, evaluates the other)
VIEW_SIZES = (4000, N + 4000)


def _view_party(ctx, own, varied, log, n):
    """Party ``ctx.party`` multiplies constant shares; the other party's shares are ``varied``."""
    x0, y0 = own[ctx.party] if varied[0] != ctx.party else varied[1]
    x = AShare(ctx, np.full(n, x0, np.uint64), BITS, 0)
    y = AShare(ctx, np.full(n, y0, np.uint64), BITS, 0)
    z = mul.mul(ctx, x, y, exact=True, method="he")
    log[threading.current_thread().name] = ctx.party
    return z.data


def _view(observer, varied_value, monkeypatch, n):
    seen = []
    real = mul_he.rescale

    def spy(residues, primes, bits):
        seen.append((threading.current_thread().name, np.array(residues)))
        return real(residues, primes, bits)

    monkeypatch.setattr(mul_he, "rescale", spy)
    own = {0: (77, 201), 1: (145, 33)}
    log = {}
    a, b = run_inprocess(_view_party, args0=(own, (1 - observer, varied_value), log, n),
                         args1=(own, (1 - observer, varied_value), log, n), ring=RingConfig(BITS, 0), timeout=300)
    residues = next(r for name, r in seen if log[name] == observer)
    return (a, b)[observer], residues


@pytest.mark.parametrize("n", VIEW_SIZES)
@pytest.mark.parametrize("observer", [0, 1])
def test_views_are_uniform_and_independent_of_the_peer(observer, n, monkeypatch):
    """What each party holds after the product (its decrypted or mask residues mod every
    prime, top 8 bits, and its output share) is uniform and the same for two different
    inputs of the other party, in the one-way and the two-way flow."""
    sa, ra = _view(observer, (3, 250), monkeypatch, n)
    sb, rb = _view(observer, (200, 7), monkeypatch, n)
    items = [("share", sa, sb)]
    for i, t in enumerate(mul_he.plain_primes(ra.shape[0])):
        top = lambda r: (r[i].astype(object) * 256 // t).astype(np.int64)  # noqa: E731
        items.append((f"residue mod t_{i}", top(ra), top(rb)))
    for name, a, b in items:
        assert p_uniform(a, 256) > P_MIN, name
        assert p_same(a, b, 256) > P_MIN, name


# ------------------------------------------------------------------ flooding, bytes
@pytest.mark.parametrize("terms", [1, 2])
def test_flooding_fits_every_prime(terms):
    """FLOOD_SIGMA bits over the mean noise fit every plaintext prime, at the top level and
    after the switch to one prime (the check `finish` runs), and the flooding is that wide."""
    def party(ctx):
        out = []
        for s in mul_he.sessions(ctx, 4):
            correct, mean = mul_he.product_noise(s.t, terms)
            b_f = s.flood_bound(mean)
            s.check_budget(b_f, correct)
            out.append(math.log2(b_f) - math.log2(mean))
        return out
    a, _ = run_inprocess(party, timeout=120)
    assert min(a) >= HS.FLOOD_SIGMA


def _bytes_party(ctx, n, terms, exact):
    mul_he.setup(ctx)
    before = HS.flood_counter(ctx).count
    ctx.chan.reset_stats()
    mul_he.cross_products(ctx, [np.arange(n, dtype=np.uint64) + np.uint64(j) for j in range(terms)], 64, exact=exact)
    t = ctx.chan.totals()
    return t["bytes_sent"] + t["bytes_received"], t["rounds"], HS.flood_counter(ctx).count - before


@pytest.mark.parametrize("n,terms,exact", [(1, 1, False), (N + 1, 2, False), (100, 2, True)])
def test_bytes_match_the_formula(n, terms, exact):
    a, b = run_inprocess(_bytes_party, args0=(n, terms, exact), args1=(n, terms, exact), timeout=300)
    m, cts = mul_he.primes_needed(64, terms, exact), -(-n // N)
    payload = cts * m * (terms * mul_he.DATA_PRIMES * 8 * N + 2 * mul_he.RESULT_PRIMES * 8 * N)
    assert payload <= a[0] <= payload + cts * m * terms * 300 + 1024
    assert abs(a[0] - mul_he.bytes_estimate(n, 64, terms, exact)) <= 0.001 * payload
    assert b[0] == a[0]
    if cts == 1:  # party 0 encrypts, party 1 evaluates: one round each way
        assert a[1] == 1 and b[1] == 1
        assert b[2] == m * N and a[2] == 0  # the evaluator floods every result coefficient
    else:  # each party encrypts half the ciphertexts and evaluates the other half: two exchanges
        half = cts // 2
        assert a[1] == 2 and b[1] == 2
        assert a[2] == m * half * N and b[2] == m * (cts - half) * N


# ------------------------------------------------------------------ bad input
def _setup_then(ctx, fn):
    mul_he.setup(ctx)
    return fn(ctx)


def _honest(ctx):
    return mul_he.cross_products(ctx, [np.arange(5, dtype=np.uint64), np.arange(5, dtype=np.uint64) + np.uint64(9)],
                                 64, exact=True)


@pytest.mark.parametrize("payload", ["count", "junk", "reference", "order", "type"])
def test_evaluator_rejects_bad_ciphertexts(payload):
    def liar(ctx):
        ops = [[0, 1], [1, 1]]
        if payload == "count":
            ctx.send({"prime": 0, "cts": [b"\x00" * 64] * 3, "ops": ops, "drop": []})
        elif payload == "junk":
            ctx.send({"prime": 0, "cts": [b"\x00" * 64] * 2, "ops": ops, "drop": []})
        elif payload == "reference":  # an operand party 1 never received
            ctx.send({"prime": 0, "cts": [], "ops": [[7, 0], [8, 0]], "drop": []})
        elif payload == "order":  # prime 1's ciphertexts first
            ctx.send({"prime": 1, "cts": [b"\x00" * 64] * 2, "ops": ops, "drop": []})
        else:
            ctx.send({"cts": "nope"})
        return None

    with pytest.raises(PartyFailed) as e:
        run_inprocess(_setup_then, _setup_then, args0=(liar,), args1=(_honest,), timeout=60)
    assert e.value.party == 1
    assert "Error" in str(e.value)


def _honest_two_way(ctx):
    n = N + 5
    return mul_he.cross_products(ctx, [np.arange(n, dtype=np.uint64), np.arange(n, dtype=np.uint64) + np.uint64(9)],
                                 64, exact=True)


@pytest.mark.parametrize("payload", ["count", "primes", "reply"])
def test_two_way_rejects_bad_messages(payload):
    """The two-way flow (two ciphertexts: each party encrypts one): a peer whose upload
    has the wrong number of ciphertexts, or whose reply has the wrong shape, is refused."""
    def liar(ctx):
        ops = [[0, 1], [1, 1]]
        m = mul_he.primes_needed(64, 2, True)
        if payload == "count":  # 2 operands x 1 ciphertext per prime, one missing
            ctx.exchange({"cts": [b"\x00" * 64] * (2 * m - 1), "ops": ops, "drop": []})
        elif payload == "primes":  # junk blobs of the right count
            ctx.exchange({"cts": [b"\x00" * 64] * (2 * m), "ops": ops, "drop": []})
        else:  # an honest upload, then a reply of the wrong shape
            up = mul_he._encrypt(ctx, mul_he.sessions(ctx, m), mul_he.plain_primes(m),
                                 [np.arange(N + 5, dtype=np.uint64)] * 2, 64, N + 5, 1, 2)
            head = next(up)
            ctx.exchange({**head, "cts": [b for blobs in up for b in blobs]})
            ctx.exchange({"c1": np.zeros((m, 1, 1, 8), np.uint64), "c0": np.zeros((m, 1, 1, 8), np.uint64)})
        return None

    with pytest.raises(PartyFailed) as e:
        run_inprocess(_setup_then, _setup_then, args0=(_honest_two_way,), args1=(liar,), timeout=60)
    assert e.value.party == 0
    assert ("reply has shapes" if payload == "reply" else "Error") in str(e.value)


@pytest.mark.parametrize("bad,match", [("shape", "HE product reply has shapes"),
                                       ("order", "expected the reply for prime 0")])
def test_encryptor_rejects_a_bad_reply(bad, match):
    def liar(ctx):
        for _ in range(mul_he.primes_needed(64, 2, True)):
            ctx.recv()
        if bad == "shape":
            ctx.send({"prime": 0, "c1": np.zeros((1, 1, 8), np.uint64), "c0": np.zeros((1, 1, 8), np.uint64)})
        else:  # the right shapes for the wrong prime
            ctx.send({"prime": 1, "c1": np.zeros((1, 1, N), np.uint64), "c0": np.zeros((1, 1, N), np.uint64)})
        return None

    with pytest.raises(PartyFailed, match=match):
        run_inprocess(_setup_then, _setup_then, args0=(_honest,), args1=(liar,), timeout=60)


def test_bad_arguments():
    def party(ctx):
        out = []
        for args in ([], [np.zeros(3, np.uint64)] * 3, [np.zeros(3, np.uint64), np.zeros(4, np.uint64)]):
            try:
                mul_he.cross_products(ctx, args, 64, exact=True)
                out.append("no error")
            except MPCError as e:
                out.append(str(e))
        return out
    a, b = run_inprocess(party, timeout=30)
    assert all(m != "no error" for m in a + b), (a, b)
    with pytest.raises(ValueError, match="CIPHERLM_MUL"):
        mul.choose_method(10, 64, 2, True, "fast")


# ------------------------------------------------------------------ processes, choice
def _two_proc(ctx, X, Y):
    return _products(ctx, X, Y, 64, True)


def test_two_processes():
    rng = np.random.default_rng(9)
    X = rng.integers(0, 1 << 63, 300, dtype=np.uint64)
    Y = rng.integers(0, 1 << 63, 300, dtype=np.uint64)
    (xy, xx), _ = run_processes(_two_proc, args0=(X, Y), args1=(X, Y), timeout=300)
    assert (xy == X * Y).all() and (xx == X * X).all()


def test_auto_picks_the_protocol_with_fewer_bytes(monkeypatch):
    monkeypatch.delenv("CIPHERLM_MUL", raising=False)
    assert mul.choose_method(100, 64, 2, False) == "ot"
    assert mul.choose_method(1 << 16, 64, 2, False) == "he"
    for n in (100, 3000, 1 << 16):
        he = mul_he.bytes_estimate(n, 64, 2, False)
        ot = mul.ot_bytes_estimate(n, 64, 2)
        assert mul.choose_method(n, 64, 2, False) == ("he" if he < ot else "ot")
    monkeypatch.setenv("CIPHERLM_MUL", "ot")
    assert mul.choose_method(1 << 16, 64, 2, False) == "ot"


# ------------------------------------------------------------------ repeated operands
def _repeat_party(ctx, X, Y, Z):
    x = share_input(ctx, X if ctx.party == 0 else None, 0, frac=0)
    y = share_input(ctx, Y if ctx.party == 1 else None, 1, frac=0)
    z = share_input(ctx, Z if ctx.party == 1 else None, 1, frac=0)
    mul_he.setup(ctx)
    out, sent = [], []
    for a, b in ((x, y), (x, z), (y, z), (x, y)):
        ctx.chan.reset_stats()
        p = mul.mul(ctx, a, b, method="he")
        sent.append(ctx.chan.totals()["bytes_sent"] if ctx.party == 0 else 0)
        out.append(p.reveal())
    return out, sent


@pytest.mark.parametrize("n", [1000, 2 * N + 5])
@pytest.mark.parametrize("cap", [None, 4])
def test_repeated_operands_travel_once(cap, n, monkeypatch):
    """x y, then x z: party 0's x0 is not encrypted again (one upload instead of two),
    and the products stay right when the store has room for one operand only (cap 4).
    With 3 ciphertexts party 0 encrypts 2 of them (and party 1 the third)."""
    if cap is not None:
        monkeypatch.setattr(mul_he, "MAX_CACHED_CTS", cap)
    rng = np.random.default_rng(4)
    X, Y, Z = (rng.integers(0, 1 << 63, n, dtype=np.uint64) for _ in range(3))
    (out, sent), _ = run_inprocess(_repeat_party, args0=(X, Y, Z), args1=(X, Y, Z), timeout=300)
    assert (out[0] == X * Y).all() and (out[1] == X * Z).all() and (out[2] == Y * Z).all() and (out[3] == X * Y).all()
    cts, m = -(-n // N), mul_he.primes_needed(64, 2, True)
    mine = mul_he._halves(cts)[0] if cts > 1 else (0, 1)
    # one operand's ciphertexts (party 0's range); party 0's replies for the rest (two-way)
    one = m * mul_he.DATA_PRIMES * 8 * N * (mine[1] - mine[0])
    replies = m * 2 * mul_he.RESULT_PRIMES * 8 * N * (cts - (mine[1] - mine[0]))
    sent = [v - replies for v in sent]
    if cap is None:
        assert sent[0] - sent[1] >= 0.99 * one and sent[3] < 0.01 * one  # x0 cached, then x0 and y0
    else:  # room for one operand: the store keeps this call's and drops older ones, in step on both sides
        assert all(v <= sent[0] for v in sent)

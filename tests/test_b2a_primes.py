"""Shared bits to shares modulo several RNS primes (`b2a_mod_primes`, BLB Algorithm 2)
by one arithmetic correlated OT modulo each prime (`OTSession.send_cot_mod` /
`recv_cot_mod`, `_core.acot_mod_*`): correctness against numpy under both OT
extensions, the bytes on the wire (the sender's corrections are exactly
n * sum_i ceil(bitlen(q_i) / 8) bytes, fewer in all than the chosen-OT version),
the receiver's view (uniform, the same whatever the sender's correlation), and
malformed replies (OTError)."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest

from cipherlm.he.lattigo_ntt import _is_prime as is_prime  # Miller-Rabin, deterministic below 3.3e24
from cipherlm import _core
from cipherlm.mpc.ot import OTError, OTSession, bytes_per_ot, cot_mod_row_bytes
from cipherlm.mpc.protocols.b2a import b2a_mod_primes
from cipherlm.mpc.runner import run_inprocess
from cipherlm.net.channel import inprocess_pair
from test_mpc_views import p_same, p_uniform

RNG = np.random.default_rng(20261127)  # test inputs only; OT randomness is the OS CSPRNG
KINDS = ("iknp", "ferret")


@functools.lru_cache(maxsize=None)
def ntt_prime(bits: int, skip: int = 0) -> int:
    """The (skip+1)-th largest prime q < 2^bits with q = 1 mod 2^16 (NTT-friendly up to N = 32768)."""
    q = (1 << bits) - (1 << 16) + 1
    while True:
        if is_prime(q):
            if skip == 0:
                return q
            skip -= 1
        q -= 1 << 16


def primes_of(bits) -> list[int]:
    seen: dict[int, int] = {}
    out = []
    for b in bits:
        out.append(ntt_prime(b, seen.get(b, 0)))
        seen[b] = seen.get(b, 0) + 1
    return out


PRIMES = {1: primes_of([61]), 3: primes_of([40, 52, 61]), 7: primes_of([60, 48, 48, 41, 56, 44, 59])}


def test_primes_are_ntt_primes():
    for ps in PRIMES.values():
        assert len(set(ps)) == len(ps)
        for q in ps:
            assert is_prime(q) and q % (1 << 16) == 1 and 40 <= q.bit_length() <= 61


def _factory(kind):
    return functools.partial(OTSession, ferret=(kind == "ferret"))


def _two(kind, f0, f1, batch=1 << 16, timeout=60):
    """f0(session 0), f1(session 1) on two threads; (results, errors, channels)."""
    a, b = inprocess_pair(timeout=timeout)
    s = (OTSession(a, 0, batch=batch, ferret=kind == "ferret"), OTSession(b, 1, batch=batch, ferret=kind == "ferret"))
    res, errs = [None, None], [None, None]

    def work(i, f):
        try:
            res[i] = f(s[i])
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errs[i] = e
            s[i].chan.close()

    th = [threading.Thread(target=work, args=(i, f), daemon=True) for i, f in enumerate((f0, f1))]
    for t in th:
        t.start()
    for t in th:
        t.join(90)
        assert not t.is_alive(), "OT call hung"
    return res, errs, (a, b)


# --------------------------------------------------------------- correctness


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", sorted(PRIMES))
def test_b2a_mod_primes_matches_numpy(kind, k):
    ps = PRIMES[k]
    n = 5003
    b0 = RNG.integers(0, 2, n).astype(np.uint8)
    b1 = RNG.integers(0, 2, n).astype(np.uint8)
    s0, s1 = run_inprocess(b2a_mod_primes, args0=(b0, ps), args1=(b1, ps), ot_factory=_factory(kind), timeout=60)
    assert s0.shape == s1.shape == (k, n) and s0.dtype == s1.dtype == np.uint64
    qs = np.array(ps, np.uint64)[:, None]
    assert (s0 < qs).all() and (s1 < qs).all()
    np.testing.assert_array_equal((s0 + s1) % qs, np.broadcast_to((b0 ^ b1).astype(np.uint64), (k, n)))
    # the shares themselves look random (not the bits): most are large
    assert (s0[:, :100] > 2).mean() > 0.9


@pytest.mark.parametrize("kind", KINDS)
def test_b2a_mod_primes_with_factors(kind):
    """factors c_i: shares of c_i (b0 xor b1) mod q_i (the wrap's 2^l in BLB Algorithm 2)."""
    ps = PRIMES[3]
    n = 2001
    f = [(1 << 53) % q for q in ps[:2]] + [ps[2] - 1]
    b0 = RNG.integers(0, 2, n).astype(np.uint8)
    b1 = RNG.integers(0, 2, n).astype(np.uint8)
    s0, s1 = run_inprocess(b2a_mod_primes, args0=(b0, ps, f), args1=(b1, ps, f), ot_factory=_factory(kind), timeout=60)
    want = [((b0 ^ b1).astype(object) * c) % q for c, q in zip(f, ps)]
    for i, q in enumerate(ps):
        got = (s0[i].astype(object) + s1[i].astype(object)) % q
        assert (got == want[i]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_cot_mod_correlation(kind):
    ps = PRIMES[7]
    n, k = 3001, len(ps)
    qs = np.array(ps, np.uint64)
    corr = np.stack([RNG.integers(0, q, n, dtype=np.uint64) for q in ps], axis=1)
    corr[0] = qs - 1  # the largest correlation of every prime
    c = RNG.integers(0, 2, n).astype(bool)
    (r, out), errs, _ = _two(kind, lambda s: s.send_cot_mod(corr, ps), lambda s: s.recv_cot_mod(c, ps), batch=1000)
    assert errs == [None, None]
    assert r.shape == out.shape == (n, k) and (r < qs).all() and (out < qs).all()
    want = np.where(c[:, None], (r + corr) % qs, r)
    np.testing.assert_array_equal(out, want)
    # a second call continues with fresh OTs; n = 0 works
    (r2, out2), errs, _ = _two(kind, lambda s: (s.send_cot_mod(corr[:5], ps), s.send_cot_mod(corr[:0], ps)),
                                lambda s: (s.recv_cot_mod(c[:5], ps), s.recv_cot_mod(c[:0], ps)))
    assert errs == [None, None]
    np.testing.assert_array_equal(out2[0], np.where(c[:5, None], (r2[0] + corr[:5]) % qs, r2[0]))
    assert r2[1].shape == out2[1].shape == (0, k)


def test_cot_mod_bad_arguments():
    a, _b = inprocess_pair(timeout=5)
    s = OTSession(a, 0, ferret=False)
    with pytest.raises(ValueError):
        s.send_cot_mod(np.zeros((4, 2), np.uint64), [257])  # k mismatch
    with pytest.raises(ValueError):
        s.send_cot_mod(np.full((4, 1), 257, np.uint64), [257])  # corr >= q
    with pytest.raises(ValueError):
        s.send_cot_mod(np.zeros((4, 1), np.uint64), [1 << 62])
    with pytest.raises(ValueError):
        s.send_cot_mod(np.zeros((4, 0), np.uint64), [])
    with pytest.raises(ValueError):
        s.recv_cot_mod(np.zeros(4, bool), [257] * 17)
    # the native core checks too
    q16 = bytes(16 * 4)
    with pytest.raises(ValueError):
        _core.acot_mod_sender(q16, bytes(16), 0, np.full(4, 300, np.uint64).view(np.uint8), [257])
    with pytest.raises(ValueError):
        _core.acot_mod_sender(q16, bytes(16), 0, np.zeros(4, np.uint64).view(np.uint8), [1])
    with pytest.raises(ValueError):
        _core.acot_mod_receiver(q16, bytes(4), 0, bytes(4 * 2 + 1), [257])


# --------------------------------------------------------------- bytes on the wire


def _old_b2a_primes(ctx, b, primes):
    """The chosen-OT version this replaces (ckks_convert.b2a_primes before): party 0 sends
    both (r, r + b0) mod every prime, 8 k bytes each, party 1 chooses with b1."""
    b = np.asarray(b).astype(np.uint64).reshape(-1)
    qs = np.array([int(q) for q in primes], np.uint64)
    k, n = qs.size, b.size
    with ctx.step("b2a_mod"):
        if ctx.party == 0:
            r = np.stack([ctx.rng.integers(0, int(q), n, dtype=np.uint64) for q in qs], axis=1)
            m1 = (r + b[:, None]) % qs
            ctx.ot.send_chosen_bytes(np.ascontiguousarray(r).view(np.uint8), np.ascontiguousarray(m1).view(np.uint8))
            t = (qs - r) % qs
        else:
            t = ctx.ot.recv_chosen_bytes(b.astype(bool), 8 * k).view(np.uint64).reshape(n, k)
    return ((b[:, None] + qs - (t + t) % qs) % qs).T


def _measure(ctx, b, primes, fns):
    """Run each of `fns` on the same session; per function: (bytes of the "b2a_mod"
    step, both directions; payload bytes of the OT replies), seen by party 0."""
    ctx.ot.setup()
    sent = []
    send = ctx.chan.send

    def rec(msg, *a, **kw):
        if isinstance(msg, dict) and str(msg.get("op", "")).endswith("_y") and "y" in msg:
            sent.append(int(np.asarray(msg["y"]).size))
        return send(msg, *a, **kw)
    ctx.chan.send = rec
    out = []
    for f in fns:
        f(ctx, b[:16], primes)  # warm: the Ferret pools, outside the measured bytes
        before = ctx.chan.stats().get("b2a_mod", {})
        del sent[:]
        res = f(ctx, b, primes)
        after = ctx.chan.stats()["b2a_mod"]
        tot = sum(after[key] - before.get(key, 0) for key in ("bytes_sent", "bytes_received"))
        out.append((tot, sum(sent), res))
    return out


def measure_b2a_bytes(kind: str, n: int, primes) -> dict:
    """b2a_mod bytes of the chosen-OT version (old) and of `b2a_mod_primes` (new) in one run."""
    b0 = RNG.integers(0, 2, n).astype(np.uint8)
    b1 = RNG.integers(0, 2, n).astype(np.uint8)
    fns = (_old_b2a_primes, b2a_mod_primes)
    m0, m1 = run_inprocess(_measure, args0=(b0, primes, fns), args1=(b1, primes, fns), ot_factory=_factory(kind),
                           timeout=120)
    qs = np.array(primes, np.uint64)[:, None]
    for (_t, _y, r0), (_t1, _y1, r1) in zip(m0, m1):
        np.testing.assert_array_equal((r0 + r1) % qs, np.broadcast_to((b0 ^ b1).astype(np.uint64), r0.shape))
    (old, old_y, _), (new, new_y, _) = m0
    return {"old": old, "old_y": old_y, "new": new, "new_y": new_y}


@pytest.mark.parametrize("kind", KINDS)
def test_b2a_mod_bytes(kind):
    ps = PRIMES[7]
    n = 4099
    row = cot_mod_row_bytes(ps)
    assert row == sum((q.bit_length() + 7) // 8 for q in ps) == 8 + 6 + 6 + 6 + 7 + 6 + 8
    m = measure_b2a_bytes(kind, n, ps)
    assert m["new_y"] == n * row  # the sender's corrections: exactly the model
    assert m["old_y"] == 2 * n * 8 * len(ps)  # the chosen OT: both messages of 8 k bytes
    # the rest (extension messages, headers) is the same OT extension for both
    ext_new, ext_old = m["new"] - m["new_y"], m["old"] - m["old_y"]
    assert abs(ext_new - ext_old) < 64, (ext_new, ext_old)
    per_ot = bytes_per_ot("cot_mod", length=row, ferret=kind == "ferret")
    assert n * per_ot <= m["new"] <= n * per_ot + 600, (m, n * per_ot)
    assert m["new"] < m["old"] / 2


# --------------------------------------------------------------- the receiver's view


def test_receiver_view_independent_of_sender_correlation():
    """Receiver with choice 1, the sender's correlation b0 = 0 or 1 (mod q = 257): its output
    r + b0 and every correction it receives are uniform mod q, the same for both b0."""
    q, n = 257, 20_000
    views = {}
    for b0 in (0, 1):
        corr = np.full((n, 1), b0, np.uint64)

        def recv(s):
            ys = []
            orig = s.chan.recv

            def rec(*a, **kw):
                m = orig(*a, **kw)
                if isinstance(m, dict) and m.get("op") == "cot_mod_y":
                    ys.append(np.asarray(m["y"]).copy())
                return m
            s.chan.recv = rec
            out = s.recv_cot_mod(np.ones(n, bool), [q])
            return out[:, 0], np.frombuffer(np.concatenate(ys).tobytes(), "<u2")

        (r, (out, y)), errs, _ = _two("ferret", lambda s: s.send_cot_mod(corr, [q]), recv)
        assert errs == [None, None]
        np.testing.assert_array_equal(out, (r[:, 0] + b0) % q)
        assert y.size == n and (y < q).all()
        views[b0] = (out, y)
    for b0 in (0, 1):
        for v in views[b0]:
            assert p_uniform(v, q) > 1e-6
    assert p_same(views[0][0], views[1][0], q) > 1e-6
    assert p_same(views[0][1], views[1][1], q) > 1e-6


# --------------------------------------------------------------- malformed replies


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["short", "long", "too_big"])
def test_malformed_reply_raises_oterror(kind, fault):
    ps = [ntt_prime(41), 257]  # 6 + 2 bytes per OT
    n, w = 100, cot_mod_row_bytes(ps)

    def bad_sender(s):
        for _q, _tw, _lo, _hi in s.ext.send_cot("cot_mod", n, nprimes=2, ybytes=w):
            pass
        y = np.zeros(n * w, np.uint8)
        if fault == "short":
            y = y[:-1]
        elif fault == "long":
            y = np.zeros(n * w + 1, np.uint8)
        else:
            y[w * 7 + 6:w * 7 + 8] = [0x01, 0x01]  # OT 7, second prime: 257 >= q
        s.chan.send({"op": "cot_mod_y", "y": y})

    _res, errs, _ = _two(kind, bad_sender, lambda s: s.recv_cot_mod(np.ones(n, bool), ps))
    assert errs[0] is None
    assert isinstance(errs[1], OTError), errs[1]
    if fault == "too_big":
        assert "not below" in str(errs[1])
    # a 41-bit prime's 6 bytes can hold values >= q too
    ps2 = [ntt_prime(41)]

    def bad2(s):
        for _ in s.ext.send_cot("cot_mod", 4, nprimes=1, ybytes=6):
            pass
        s.chan.send({"op": "cot_mod_y", "y": np.full(24, 0xFF, np.uint8)})

    _res, errs, _ = _two(kind, bad2, lambda s: s.recv_cot_mod(np.zeros(4, bool), ps2))
    assert isinstance(errs[1], OTError) and "not below" in str(errs[1])

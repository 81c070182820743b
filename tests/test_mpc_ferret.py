"""Ferret silent COT (src/ferret.rs, cipherlm/mpc/ferret.py) and the
OTSession hook (``ferret=True``): the raw iteration's correlation
w = v xor u*Delta and the uniformity of u, the pool (bootstrap from IKNP,
refills, reserve), every 1-out-of-2 OT kind served from Ferret, bytes per
OT, and bad input.  Small and fast: only the paper's setup parameter set
(n = 649,728) runs here; the main set is timed by `cargo test -- --ignored`."""

from __future__ import annotations

import secrets
import threading

import numpy as np
import pytest

from cipherlm import _core
from cipherlm.mpc import ferret
from cipherlm.mpc.ferret import FERRET_MAIN, FERRET_SETUP, LPNParams
from cipherlm.mpc.ot import OTError, OTSession, bytes_per_ot
from cipherlm.net.channel import inprocess_pair
from test_mpc_ot_views import P_MIN, p_independent
from _threads import run_pair

RNG = np.random.default_rng(4321)  # test inputs only


def _base(m: int):
    """Random base COTs with a random Delta: (delta bytes, u, v rows, w rows)."""
    delta = secrets.token_bytes(16)
    d64 = np.frombuffer(delta, np.uint64)
    v = np.frombuffer(secrets.token_bytes(16 * m), np.uint64).reshape(-1, 2)
    u = np.frombuffer(secrets.token_bytes(m), np.uint8) & 1
    w = v ^ (u.astype(np.uint64)[:, None] * d64)
    return delta, np.ascontiguousarray(u), np.ascontiguousarray(v), np.ascontiguousarray(w)


def _iteration(P: LPNParams):
    delta, u, v, w = _base(P.base)
    seed = secrets.token_bytes(16)
    msg, vo = _core.ferret_sender(delta, v.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 1 << 62)
    assert len(msg) == P.msg_len
    uo, wo = _core.ferret_receiver(u, w.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 1 << 62, msg)
    return (np.frombuffer(delta, np.uint64), np.frombuffer(uo, np.uint8),
            np.frombuffer(vo, np.uint64).reshape(-1, 2), np.frombuffer(wo, np.uint64).reshape(-1, 2))


def test_iteration_correlation_and_uniform_choices():
    d, u, v, w = _iteration(FERRET_SETUP)
    n = FERRET_SETUP.n
    assert u.shape == (n,) and set(np.unique(u)) <= {0, 1}
    np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))
    # u uniform: overall balance (6 sigma) and chi-square of 8-bit patterns
    ones = int(u.sum())
    assert abs(ones - n / 2) < 6 * np.sqrt(n / 4), ones
    bytes_ = np.packbits(u[: n // 8 * 8], bitorder="little")
    counts = np.bincount(bytes_, minlength=256)
    exp = bytes_.size / 256
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert chi2 < 255 + 6 * np.sqrt(2 * 255), chi2
    # no structure left from the regular noise: every tree block is mixed
    blocks = u.reshape(FERRET_SETUP.t, -1).sum(axis=1)
    assert blocks.min() > 150 and blocks.max() < 362
    # v is not trivially related to w (Delta actually applied on ~half)
    assert 0.45 < float((w != v).any(axis=1).mean()) < 0.55


def test_iteration_rejects_bad_input():
    P = FERRET_SETUP
    delta, u, v, w = _base(P.base)
    seed = bytes(16)
    with pytest.raises(ValueError, match="base COTs"):
        _core.ferret_sender(delta, v.view(np.uint8).reshape(-1)[:-16], P.n, P.k, P.t, P.h, seed, 0)
    with pytest.raises(ValueError, match="shape"):
        _core.ferret_sender(delta, v.view(np.uint8).reshape(-1), P.n + 1, P.k, P.t, P.h, seed, 0)
    msg, _ = _core.ferret_sender(delta, v.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 0)
    with pytest.raises(ValueError, match="message"):
        _core.ferret_receiver(u, w.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 0, bytes(msg)[:-1])
    bad_u = u.copy()
    bad_u[0] = 2
    with pytest.raises(ValueError, match="0 or 1"):
        _core.ferret_receiver(bad_u, w.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 0, msg)


def test_iteration_in_halves_matches_and_receiver_lpn_needs_no_message():
    """The pipelined halves (what the pools run): the receiver's LPN half runs before
    the sender's message exists; sender trees + LPN and receiver LPN + trees give
    w = v xor u*Delta; the same inputs through the one-call kernels give the same
    receiver output for the same message (the halves compute the same function)."""
    P = FERRET_SETUP
    delta, u, v, w = _base(P.base)
    seed = secrets.token_bytes(16)
    bv, bw = v.view(np.uint8).reshape(-1), w.view(np.uint8).reshape(-1)
    uo = np.full(P.n, 7, np.uint8)  # garbage: the LPN half must overwrite, not XOR into, its outputs
    wo = ferret._rows(P.n)
    wo[:] = 12345
    _core.ferret_receiver_lpn(u, bw, P.n, P.k, P.t, P.h, seed, uo, wo.view(np.uint8).reshape(-1))
    assert set(np.unique(uo)) <= {0, 1}
    vo = ferret._rows(P.n)
    msg = _core.ferret_sender_trees(delta, bv, P.n, P.k, P.t, P.h, 99, vo.view(np.uint8).reshape(-1))
    assert len(msg) == P.msg_len
    _core.ferret_sender_lpn(bv, P.n, P.k, P.t, P.h, seed, vo.view(np.uint8).reshape(-1))
    _core.ferret_receiver_trees(u, bw, P.n, P.k, P.t, P.h, 99, msg, uo, wo.view(np.uint8).reshape(-1))
    d = np.frombuffer(delta, np.uint64)
    np.testing.assert_array_equal(wo, vo ^ (uo.astype(np.uint64)[:, None] * d))
    # regular noise: exactly one flipped choice per tree block relative to the LPN half alone
    u_lpn = np.empty(P.n, np.uint8)
    w_lpn = ferret._rows(P.n)
    _core.ferret_receiver_lpn(u, bw, P.n, P.k, P.t, P.h, seed, u_lpn, w_lpn.view(np.uint8).reshape(-1))
    assert ((uo ^ u_lpn).reshape(P.t, -1).sum(axis=1) == 1).all()
    u1, w1 = _core.ferret_receiver(u, bw, P.n, P.k, P.t, P.h, seed, 99, msg)
    np.testing.assert_array_equal(np.frombuffer(u1, np.uint8), uo)
    np.testing.assert_array_equal(np.frombuffer(w1, np.uint64).reshape(-1, 2), wo)
    # bad input on the halves
    with pytest.raises(ValueError, match="message"):
        _core.ferret_receiver_trees(u, bw, P.n, P.k, P.t, P.h, 99, bytes(msg)[:-1], uo, wo.view(np.uint8).reshape(-1))
    with pytest.raises(ValueError, match="out_w"):
        _core.ferret_receiver_lpn(u, bw, P.n, P.k, P.t, P.h, seed, uo, wo.view(np.uint8).reshape(-1)[:-16])
    with pytest.raises(ValueError, match="base COTs"):
        _core.ferret_sender_trees(delta, bv[:-16], P.n, P.k, P.t, P.h, 99, vo.view(np.uint8).reshape(-1))
    bad_u = u.copy()
    bad_u[0] = 2
    with pytest.raises(ValueError, match="0 or 1"):
        _core.ferret_receiver_lpn(bad_u, bw, P.n, P.k, P.t, P.h, seed, uo, wo.view(np.uint8).reshape(-1))


def test_parameters_are_the_papers():
    assert (FERRET_MAIN.n, FERRET_MAIN.k, FERRET_MAIN.t, FERRET_MAIN.h) == (10_805_248, 589_760, 1_319, 13)
    assert (FERRET_SETUP.n, FERRET_SETUP.k, FERRET_SETUP.t, FERRET_SETUP.h) == (649_728, 36_288, 1_269, 9)
    # one setup iteration is enough to bootstrap a main one
    assert FERRET_SETUP.n >= FERRET_MAIN.base


def run_both(f0, f1, *, ferret_on=True, batch=1 << 16, timeout=60.0, record: list | None = None, **kw):
    """f0 / f1 on OT sessions of parties 0 / 1; ``record``: a list that receives every
    message party 0 receives (its view)."""
    a, b = inprocess_pair(timeout=timeout)
    if record is not None:
        recv = a.recv

        def logged(timeout=None):
            m = recv(timeout)
            record.append(m)
            return m

        a.recv = logged
    s = (OTSession(a, 0, batch=batch, ferret=ferret_on, **kw), OTSession(b, 1, batch=batch, ferret=ferret_on, **kw))
    res = run_pair(s, f0, f1)
    return res, (a, b), s


def test_session_every_kind_from_ferret():
    n = 3000
    c = RNG.integers(0, 2, n).astype(bool)
    m0 = RNG.integers(0, 2**63, n, dtype=np.uint64)
    m1 = RNG.integers(0, 2**63, n, dtype=np.uint64)
    corr = RNG.integers(0, 2**40, n, dtype=np.uint64)
    s0 = RNG.integers(0, 256, (n, 5), dtype=np.uint8)
    s1 = RNG.integers(0, 256, (n, 5), dtype=np.uint8)

    def p0(ot):
        r = {"rot": ot.send_random(n, bits=64), "bcot": ot.send_bool_cot(n)}
        r["cot"] = ot.send_cot(corr, bits=41)
        ot.send_chosen(m0, m1, bits=64)
        ot.send_chosen_bytes(s0, s1)
        r["rev"] = ot.recv_random(c, bits=17)  # other direction
        return r

    def p1(ot):
        r = {"rot": ot.recv_random(c, bits=64), "bcot": ot.recv_bool_cot(c)}
        r["cot"] = ot.recv_cot(c, bits=41)
        r["chosen"] = ot.recv_chosen(c, bits=64)
        r["bytes"] = ot.recv_chosen_bytes(c, 5)
        r["rev"] = ot.send_random(n, bits=17)
        return r

    (r0, r1), _, sess = run_both(p0, p1)
    a, b = r0["rot"]
    _, mc = r1["rot"]
    np.testing.assert_array_equal(mc, np.where(c, b, a))
    assert not np.array_equal(a, b)
    q, d = r0["bcot"]
    np.testing.assert_array_equal(r1["bcot"], q ^ (c.astype(np.uint64)[:, None] * d))
    m41 = np.uint64((1 << 41) - 1)
    np.testing.assert_array_equal(r1["cot"], (r0["cot"] + c.astype(np.uint64) * corr) & m41)
    np.testing.assert_array_equal(r1["chosen"], np.where(c, m1, m0))
    np.testing.assert_array_equal(r1["bytes"], np.where(c[:, None], s1, s0))
    cc, got = r0["rev"]
    x0, x1 = r1["rev"]
    np.testing.assert_array_equal(got, np.where(cc, x1, x0))
    # the Delta of the Ferret pool is the IKNP Delta of that direction
    assert sess[0]._ferret_send.delta == bytes(sess[0]._as_sender[128].delta)
    assert sess[0]._ferret_send.iterations == 1 and sess[1]._ferret_recv.iterations == 1


def test_pool_choice_bit_in_lsb_of_w():
    """The pools carry the receiver's choice bit in the LSB of w: LSB(Delta) = 1,
    the sender's rows have LSB 0, u = LSB(w) for every served COT (across a refill
    from the reserve), and u is still balanced; an IKNP extension whose Delta has
    LSB 0 cannot be wrapped."""
    n = FERRET_SETUP.usable + 50_000

    (v, (u, w)), _, sess = run_both(lambda ot: ot.send_rcot(n)[0], lambda ot: ot.recv_rcot(n))
    delta = sess[0]._ferret_send.delta
    assert delta[0] & 1 == 1 and sess[0]._ferret_send.iterations == 2
    d = np.frombuffer(delta, np.uint64)
    np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))
    assert not (v[:, 0] & np.uint64(1)).any()
    np.testing.assert_array_equal((w[:, 0] & np.uint64(1)).astype(bool), u)
    assert abs(int(u.sum()) - n / 2) < 6 * np.sqrt(n / 4)
    # the rest of Delta is not fixed: its other 127 bits vary between sessions
    (_, _), _, sess2 = run_both(lambda ot: ot.send_rcot(10), lambda ot: ot.recv_rcot(10))
    assert sess2[0]._ferret_send.delta != delta
    # wrapping an IKNP extension that already has an even Delta is refused
    from cipherlm.mpc.ot_extension import FerretExtension, IknpExtension

    class _D:
        delta = b"\x00" * 16

    ik = IknpExtension(None, 0)
    ik.as_sender[128] = _D()
    with pytest.raises(ValueError, match="LSB"):
        FerretExtension(ik)


def test_pool_refills_and_bytes_per_ot():
    """More OTs than one setup iteration serves: a second iteration runs from
    the reserve (no new IKNP bootstrap); bytes per random OT ~1 bit + refills."""
    n = FERRET_SETUP.usable + 70_000
    c = RNG.integers(0, 2, n).astype(bool)

    def p0(ot):
        ot.setup()
        ot.chan.reset_stats()
        out = ot.send_random(n, bits=8)
        t = ot.chan.totals()
        return out, t

    def p1(ot):
        ot.setup()
        ot.chan.reset_stats()
        return ot.recv_random(c, bits=8), ot.chan.totals()

    ((m, t0), ((_, mc), t1)), _, sess = run_both(p0, p1)
    np.testing.assert_array_equal(mc, np.where(c, m[1], m[0]))
    assert sess[0]._ferret_send.iterations == 2
    total = t0["bytes_sent"] + t0["bytes_received"]
    boot = FERRET_SETUP.base * 16  # IKNP bootstrap matrix
    ferret_msgs = 2 * FERRET_SETUP.msg_len
    derand = n / 8
    assert boot + ferret_msgs + derand < total < (boot + ferret_msgs + derand) * 1.02 + 20_000, total
    # compare with IKNP on the same n: 16 bytes per OT
    assert total < n * bytes_per_ot("random", ferret=False) / 4


def test_prime_fills_both_directions_on_the_main_set():
    """`OTSession.prime` (both parties, mirrored order inside): each direction is on
    the main set with a main iteration's base in reserve and a full pool, reached
    by the IKNP bootstrap, one setup iteration (reserve only) and one main
    iteration; then requests in both directions are served from the pool (no
    further iteration) and keep the COT correlation; IKNP sessions accept the call."""
    def p0(ot):
        ot.prime()
        primed = ot.chan.totals()
        return primed, ot.send_rcot(5000)[0], ot.recv_rcot(7000)

    def p1(ot):
        ot.prime()
        return ot.chan.totals(), ot.recv_rcot(5000), ot.send_rcot(7000)[0]

    ((t0, v01, (u10, w10)), (_, (u01, w01), v10)), _, sess = run_both(p0, p1, timeout=120.0)
    for pool in (sess[0]._ferret_send, sess[0]._ferret_recv, sess[1]._ferret_send, sess[1]._ferret_recv):
        assert pool.main and pool.iterations == 2
        assert pool._reserve_len() == FERRET_MAIN.base
    served = FERRET_MAIN.n - (FERRET_MAIN.base - (FERRET_SETUP.n - FERRET_MAIN.base))
    assert sess[0]._ferret_send.pool.avail == served - 5000
    assert sess[0]._ferret_recv.pool.avail == served - 7000
    for v, (u, w), sender in ((v01, (u01, w01), sess[0]), (v10, (u10, w10), sess[1])):
        d = np.frombuffer(sender._ferret_send.delta, np.uint64)
        np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))
    # traffic of the priming, both directions: IKNP bootstrap rows, the two Ferret
    # messages of each iteration (seed and trees), headers
    body = 2 * (FERRET_SETUP.base * 16 + FERRET_SETUP.msg_len + FERRET_MAIN.msg_len + 2 * 16)
    total = t0["bytes_sent"] + t0["bytes_received"]
    assert body < total < body * 1.01 + 20_000, total
    (_, _), _, _ = run_both(lambda ot: ot.prime(), lambda ot: ot.prime(), ferret_on=False)


def test_main_parameter_switch_is_deterministic():
    """With a tiny switch threshold both pools move to the main set at the same
    call (run only the decision logic: no main iteration here)."""
    class Dummy:
        pass

    for cls in (ferret._FerretSide,):
        s = cls.__new__(cls)
        ferret._FerretSide.__init__(s, Dummy(), main_after=100)
        s._avail = lambda: 0
        calls = []
        s._reserve_len = lambda: 0 if not calls else FERRET_SETUP.base
        s._bootstrap = lambda m: calls.append(("boot", m))
        s._iterate = lambda P, serve: calls.append((P, serve))
        s._refill_step(50)
        assert calls[-1] == (FERRET_SETUP, True) and not s.main
        s.served = 60
        s._refill_step(50)
        assert s.main and calls[-1] == (FERRET_SETUP, False)  # reserve first fed by a setup iteration


def test_bytes_per_ot_formula(monkeypatch):
    assert bytes_per_ot("random", ferret=True) == 1 / 8
    assert bytes_per_ot("cot", 64, ferret=True) == (1 + 64) / 8
    assert bytes_per_ot("chosen", 64, ferret=True) == (1 + 128) / 8
    assert bytes_per_ot("1ofN", 2, 16, ferret=True) == (4 + 16 * 2) / 8
    assert bytes_per_ot("1ofN", 2, 16, ferret=False) == (256 + 16 * 2) / 8
    assert bytes_per_ot("1ofN", 2, 10, ferret=True) == bytes_per_ot("1ofN", 2, 10, ferret=False)  # not 2^m: KK13
    # the default (no CIPHERLM_OT) is Ferret's formula; CIPHERLM_OT=iknp gives IKNP's
    monkeypatch.delenv("CIPHERLM_OT", raising=False)
    assert bytes_per_ot("random") == 1 / 8
    assert bytes_per_ot("cot", 64) == (1 + 64) / 8
    assert bytes_per_ot("1ofN", 2, 16) == (4 + 16 * 2) / 8
    monkeypatch.setenv("CIPHERLM_OT", "iknp")
    assert bytes_per_ot("random") == 16
    assert bytes_per_ot("1ofN", 2, 16) == (256 + 16 * 2) / 8


@pytest.mark.parametrize("N,batch,dtype", [(2, 1 << 16, np.uint64), (8, 16, np.uint64), (16, 1 << 16, np.uint64),
                                           (256, 64, np.uint64), (8, 16, np.uint8), (16, 1 << 16, np.uint8)])
def test_1ofN_from_correlated_ots(N, batch, dtype):
    """Naor-Pinkas 1-out-of-N from log2 N Ferret COTs: the chosen message arrives, batches
    split only between instances, and the wire carries m + N l bits per OT (uint8 messages
    go to the kernel one byte each; the bits above `bits` are dropped as for uint64)."""
    n, bits = 2000, 5
    msgs = RNG.integers(0, 2**63, (n, N), dtype=np.uint64).astype(dtype)
    ch = RNG.integers(0, N, n)
    (_, got), (a, _), _ = run_both(lambda ot: ot.send_1ofN(msgs, bits), lambda ot: ot.recv_1ofN(ch, N, bits),
                                   batch=batch, step="ot")
    np.testing.assert_array_equal(got, msgs[np.arange(n), ch].astype(np.uint64) & np.uint64(31))
    step = a.stats()["ot"]
    m = N.bit_length() - 1
    payload = step["bytes_sent"] + step["bytes_received"]
    assert payload >= n * (m + N * bits) / 8
    assert payload <= n * (m + N * bits) / 8 + 600 * step["messages_sent"] + 600 * step["messages_received"]


def test_1ofN_sender_view_independent_of_choices():
    """What the 1-out-of-N sender receives online (e = c xor u per correlated OT) is
    uniform and independent of the receiver's choice."""
    n, N = 1 << 13, 16
    ch = RNG.integers(0, N, n)
    log = []
    (_, _), _, _ = run_both(lambda ot: ot.send_1ofN(np.zeros((n, N), np.uint64), 2),
                            lambda ot: ot.recv_1ofN(ch, N, 2), record=log)
    e = np.concatenate([m["e"] for m in log if isinstance(m, dict) and m.get("op") == "1ofN"])
    bits = np.unpackbits(e, bitorder="little")[: 4 * n].reshape(n, 4)
    nibble = bits @ (1 << np.arange(4))
    assert p_independent(ch, nibble, N, N) > P_MIN
    # power: the choices' own bits fail the same test
    assert p_independent(ch, ch, N, N) < P_MIN


def test_env_selects_ferret(monkeypatch):
    a, _b = inprocess_pair(timeout=5)
    monkeypatch.delenv("CIPHERLM_OT", raising=False)
    assert OTSession(a, 0).ferret  # the default: Ferret (docs/ot.md, "Which default")
    assert not OTSession(a, 0, ferret=False).ferret
    monkeypatch.setenv("CIPHERLM_OT", "ferret")
    assert OTSession(a, 0).ferret
    monkeypatch.setenv("CIPHERLM_OT", "iknp")
    assert not OTSession(a, 0).ferret
    assert OTSession(a, 0, ferret=True).ferret
    monkeypatch.setenv("CIPHERLM_OT", "silent")
    with pytest.raises(ValueError):
        OTSession(a, 0)


def test_tampered_ferret_message_detected_or_mismatch():
    """A Ferret message of the wrong size is an OTError; corrections whose
    count does not match are rejected by the header checks."""
    def p0(ot):
        ot.send_random(100)

    def p1(ot):
        ot.recv_random(n=100)

    # sender in Ferret mode, receiver in IKNP mode: mismatched messages -> OTError
    a, b = inprocess_pair(timeout=10)
    s0, s1 = OTSession(a, 0, ferret=True), OTSession(b, 1, ferret=False)
    errs = [None, None]

    def work(i, f, s):
        try:
            f(s)
        except BaseException as e:  # noqa: BLE001
            errs[i] = e
            (a if i == 0 else b).close()

    th = [threading.Thread(target=work, args=(0, p0, s0), daemon=True),
          threading.Thread(target=work, args=(1, p1, s1), daemon=True)]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
        assert not t.is_alive()
    assert any(isinstance(e, OTError) for e in errs), errs

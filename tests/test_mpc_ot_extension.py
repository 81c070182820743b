"""The OT-extension interface (cipherlm.mpc.ot_extension): both implementations
(IKNP, Ferret) give the correlations they promise, checked against numpy:
chosen-input COT t = q xor c*Delta, random COT w = v xor u*Delta with uniform u,
1-out-of-N; the wire cost per COT; the selection by CIPHERLM_OT; and the Ferret
pools run on a bare `IknpExtension` (no `OTSession`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cipherlm.mpc import ot_extension as ox
from cipherlm.mpc.ferret import FERRET_SETUP, FerretReceiver, FerretSender
from cipherlm.mpc.ot import OTSession
from cipherlm.net.channel import inprocess_pair
from _threads import run_pair

RNG = np.random.default_rng(777)  # test inputs only


def both(kind, f0, f1, batch=1 << 14):
    a, b = inprocess_pair(timeout=60)
    e = (ox.make_extension(a, 0, batch=batch, kind=kind), ox.make_extension(b, 1, batch=batch, kind=kind))
    res = run_pair(e, f0, f1)
    return res, (a, b), e


def _rows(batches, n):
    out = np.empty((n, 2), np.uint64)
    for rows, _tw, lo, hi in batches:
        out[lo:hi] = np.frombuffer(rows, np.uint64).reshape(-1, 2)
    return out


@pytest.mark.parametrize("kind", ox.KINDS)
def test_chosen_input_cot(kind):
    n = 40_000
    c = RNG.integers(0, 2, n).astype(np.uint8)

    def s(e):
        return _rows(list(e.send_cot("bcot", n)), n), np.frombuffer(e.sender_delta(), np.uint64)

    (got, t), _, ext = both(kind, s, lambda e: _rows(e.recv_cot("bcot", c), n))
    q, d = got
    np.testing.assert_array_equal(t, q ^ (c.astype(np.uint64)[:, None] * d))
    assert len(np.unique(q[:, 0])) == n  # fresh rows
    assert ext[0].name == kind


@pytest.mark.parametrize("kind", ox.KINDS)
def test_random_cot(kind):
    n = 50_000
    (v, (u, w)), (a, _), ext = both(kind, lambda e: e.send_rcot(n), lambda e: e.recv_rcot(n))
    d = np.frombuffer(ext[0].sender_delta(), np.uint64)
    assert v.shape == w.shape == (n, 2) and u.shape == (n,)
    assert set(np.unique(u)) <= {0, 1}
    np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))
    assert abs(int(u.sum()) - n / 2) < 6 * np.sqrt(n / 4)
    # a second call continues with fresh COTs
    (v2, (u2, w2)), _, _ = both(kind, lambda e: e.send_rcot(10), lambda e: e.recv_rcot(10))
    assert v2.shape == (10, 2) and w2.shape == (10, 2)


@pytest.mark.parametrize("kind", ox.KINDS)
@pytest.mark.parametrize("N", [4, 10, 16])
def test_1ofN(kind, N):
    n, bits = 3000, 3
    msgs = RNG.integers(0, 8, (n, N), dtype=np.uint64)
    ch = RNG.integers(0, N, n).astype(np.uint8)

    def s(e):
        for y in e.send_1ofN(msgs, bits):
            e.chan.send({"op": "1ofN_y", "y": y})

    (_, got), _, _ = both(kind, s, lambda e: e.recv_1ofN(ch, N, bits))
    np.testing.assert_array_equal(got, msgs[np.arange(n), ch])


def test_wire_bits_per_cot_through_the_channel():
    """Chosen-input COT: IKNP 128 bits per COT, Ferret 1 bit (+ headers); random
    COT from a warm Ferret pool: no traffic at all."""
    n = 64_000
    c = RNG.integers(0, 2, n).astype(np.uint8)
    for kind, want in (("iknp", 128), ("ferret", 1)):
        def s(e):
            e.setup()
            e.send_rcot(1)  # warm: base OTs and (Ferret) the first refill
            e.chan.reset_stats()
            list(e.send_cot("bcot", n))
            t = e.chan.totals()
            e.chan.reset_stats()
            e.send_rcot(1000)
            return t, e.chan.totals()

        def r(e):
            e.setup()
            e.recv_rcot(1)
            list(e.recv_cot("bcot", c))
            e.recv_rcot(1000)

        ((t, t_r), _), _, ext = both(kind, s, r, batch=1 << 16)
        bits = 8 * (t["bytes_sent"] + t["bytes_received"]) / n
        assert ext[0].wire_bits("cot") == want
        assert want <= bits < want + 0.1, (kind, bits)
        if kind == "ferret":
            assert t_r["bytes_sent"] + t_r["bytes_received"] == 0


def test_selection_and_session_wiring(monkeypatch):
    a, _ = inprocess_pair(timeout=5)
    monkeypatch.delenv("CIPHERLM_OT", raising=False)
    assert ox.extension_kind() == "ferret"  # the default
    assert isinstance(OTSession(a, 0).ext, ox.FerretExtension)
    assert isinstance(OTSession(a, 0, ferret=False).ext, ox.IknpExtension)
    monkeypatch.setenv("CIPHERLM_OT", "iknp")
    assert ox.extension_kind() == "iknp"
    assert isinstance(OTSession(a, 0).ext, ox.IknpExtension)
    assert isinstance(ox.make_extension(a, 0), ox.IknpExtension)
    monkeypatch.setenv("CIPHERLM_OT", "ferret")
    assert ox.extension_kind() == "ferret"
    e = OTSession(a, 0).ext
    assert isinstance(e, ox.FerretExtension) and isinstance(e.iknp, ox.IknpExtension)
    assert isinstance(OTSession(a, 0, ferret=False).ext, ox.IknpExtension)
    monkeypatch.setenv("CIPHERLM_OT", "bogus")
    with pytest.raises(ValueError):
        ox.make_extension(a, 0)


def test_ferret_pools_on_a_bare_iknp_extension():
    """The Ferret pools need only the public raw-COT methods of `IknpExtension`."""
    a, b = inprocess_pair(timeout=60)
    ia, ib = ox.IknpExtension(a, 0), ox.IknpExtension(b, 1)
    out = [None, None]

    def s():
        p = FerretSender(ia)
        out[0] = (p.take(1000), p.delta)

    def r():
        out[1] = FerretReceiver(ib).take(1000)

    th = [threading.Thread(target=f) for f in (s, r)]
    [t.start() for t in th]
    [t.join(60) for t in th]
    (v, delta), (u, w) = out
    d = np.frombuffer(delta, np.uint64)
    np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))
    assert delta == ia.sender_delta()
    assert a.stats()["ot.ferret"]["bytes_received"] >= FERRET_SETUP.msg_len


@pytest.mark.parametrize("N", [2, 4, 16, 256])
def test_np1ofN_fixed_key_aes_pads(N):
    """The Ferret path's 1-out-of-N from log2 N COTs (pads from fixed-key AES,
    src/otops.rs np_pads_*), straight on synthetic COTs: the receiver gets its
    message, and the N - 1 messages it did not choose stay hidden (their masked
    values are uniform and independent of the messages)."""
    from cipherlm import _core
    from test_mpc_ot_views import P_MIN, p_independent, p_uniform

    m = N.bit_length() - 1
    n, bits = 4096, 2
    delta = np.frombuffer(np.random.default_rng(1).bytes(16), np.uint64)
    q = RNG.integers(0, 2**63, (n * m, 2), dtype=np.uint64)
    ch = RNG.integers(0, N, n).astype(np.uint8)
    cbits = ((ch[:, None] >> np.arange(m, dtype=np.uint8)) & 1).reshape(-1).astype(np.uint64)
    t = q ^ (cbits[:, None] * delta)
    msgs = RNG.integers(0, 4, (n, N), dtype=np.uint64)
    tw = 12345
    y = _core.np1ofn_sender(q.view(np.uint8).reshape(-1), delta.view(np.uint8), tw, N, msgs.view(np.uint8).reshape(-1), bits)
    got = np.frombuffer(_core.np1ofn_receiver(t.view(np.uint8).reshape(-1), ch, tw, N, y, bits), np.uint64)
    np.testing.assert_array_equal(got, msgs[np.arange(n), ch])
    # the same messages one byte each (msg_bytes = 1): the same reply; refused above 8 bits or mis-sized
    y8 = _core.np1ofn_sender(q.view(np.uint8).reshape(-1), delta.view(np.uint8), tw, N,
                             msgs.astype(np.uint8).reshape(-1), bits, 1)
    assert bytes(y8) == bytes(y)
    with pytest.raises(ValueError, match="messages of 1 bytes"):
        _core.np1ofn_sender(q.view(np.uint8).reshape(-1), delta.view(np.uint8), tw, N,
                            np.zeros(n * N, np.uint8), 9, 1)
    with pytest.raises(ValueError, match="messages has"):
        _core.np1ofn_sender(q.view(np.uint8).reshape(-1), delta.view(np.uint8), tw, N,
                            np.zeros(n * N - 1, np.uint8), bits, 1)
    # a different tweak gives other pads (the receiver's message is then wrong)
    bad = np.frombuffer(_core.np1ofn_receiver(t.view(np.uint8).reshape(-1), ch, tw + 1, N, y, bits), np.uint64)
    assert (bad != got).mean() > 0.6
    yv = np.frombuffer(_core.unpack_bits(y, n * N, bits), np.uint64).reshape(n, N)
    other = np.ones((n, N), bool)
    other[np.arange(n), ch] = False
    assert p_uniform(yv[other][:200_000], 4) > P_MIN
    assert p_independent(msgs[other][:200_000], yv[other][:200_000], 4, 4) > P_MIN
    if N >= 4:
        # the XOR of per-bit keys alone would make the pads of x, x^1, x^2, x^3 cancel:
        # with the tweak including x, those four masked values XOR to a uniform value
        x4 = yv[:, 0] ^ yv[:, 1] ^ yv[:, 2] ^ yv[:, 3] ^ msgs[:, 0] ^ msgs[:, 1] ^ msgs[:, 2] ^ msgs[:, 3]
        assert p_uniform(x4[ch >= 4] if N > 4 else x4, 4) > P_MIN


@pytest.mark.slow  # three main iterations per run (~20 s on the 2-vCPU machine)
def test_ferret_ahead_same_messages(monkeypatch):
    """With the next main iteration computed in the background (the sender's whole
    iteration, ``FerretSender.ahead``; the receiver's LPN half from the announced seed,
    ``FerretReceiver.ahead``), the COTs are correct, the Ferret messages are the same in
    number, order and size as without it, and every receiver iteration after the first
    main one uses the half computed ahead."""
    from cipherlm.mpc import ferret as fm

    used = []
    matches = fm._ReceiverAhead.matches
    monkeypatch.setattr(fm._ReceiverAhead, "matches", lambda self, *a: used.append(matches(self, *a)) or used[-1])

    def run(ahead):
        monkeypatch.setattr(fm.FerretSender, "ahead", ahead)
        monkeypatch.setattr(fm.FerretReceiver, "ahead", ahead)
        used.clear()
        n = 2 * fm.FERRET_MAIN.usable + 10

        def r(e):
            u, w = e.recv_rcot(n)
            return u[-1000:], w[-1000:]

        (v, (u, w)), (a, _), ext = both("ferret", lambda e: e.send_rcot(n)[-1000:], r)
        d = np.frombuffer(ext[0].sender_delta(), np.uint64)
        np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))
        return ext[0].sender_pool.iterations, a.stats()["ot.ferret"], list(used)

    it0, st0, used0 = run(False)
    it1, st1, used1 = run(True)
    assert it0 == it1 >= 3
    assert st0["messages_sent"] == st1["messages_sent"] and st0["bytes_sent"] == st1["bytes_sent"]
    # iteration 0 is the small one that feeds the reserve, 1 .. it1 - 1 are main ones: each
    # after the first uses the LPN half computed ahead
    assert used0 == [] and used1 == [True] * (it1 - 2)


def test_ferret_next_seed_field_checked():
    """The announced seed of the next iteration must be a 16-byte vector (or absent)."""
    from cipherlm.mpc import ferret as fm
    from cipherlm.mpc.ot_common import OTError

    assert fm._next_seed({}) is None
    assert fm._next_seed({"next": np.arange(16, dtype=np.uint8)}) == bytes(range(16))
    for bad in (np.zeros(15, np.uint8), np.zeros(16, np.int64), b"x" * 16, [0] * 16):
        with pytest.raises(OTError, match="next"):
            fm._next_seed({"next": bad})

"""Statistical view tests for OT (semi-honest security, checked empirically).

Each test records what one party *receives* and checks with a chi-square test
that it is uniform and independent of the other party's private input:

* sender's view (the IKNP / KK13 extension matrix u) vs the receiver's choices;
* receiver's view of the unchosen message in chosen OT vs that message;
* receiver's view in arithmetic COT vs the sender's correlation;
* receiver's view of the N-1 unchosen KK13 messages vs those messages.

Thresholds: p > 1e-6 (false alarm rate ~1e-6 per test; the OT randomness comes
from the OS, so runs differ).  Each test also checks that the same statistic
*does* flag an obvious leak, so a vacuous test would fail.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from cipherlm import _core
from cipherlm.mpc.ot import OTSession
from cipherlm.net.channel import inprocess_pair

P_MIN = 1e-6
RNG = np.random.default_rng(2024)  # inputs only


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty approximation)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def p_uniform(values: np.ndarray, bins: int) -> float:
    counts = np.bincount(values.astype(np.int64).ravel(), minlength=bins).astype(float)
    exp = counts.sum() / bins
    return chi2_sf(((counts - exp) ** 2 / exp).sum(), bins - 1)


def p_independent(a: np.ndarray, b: np.ndarray, na: int, nb: int) -> float:
    """Chi-square test of independence of two categorical samples."""
    t = np.zeros((na, nb))
    np.add.at(t, (a.astype(np.int64).ravel(), b.astype(np.int64).ravel()), 1)
    exp = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
    keep = exp > 0
    stat = ((t - exp)[keep] ** 2 / exp[keep]).sum()
    return chi2_sf(stat, (na - 1) * (nb - 1))


class Recorder:
    """Wraps a channel and keeps every message this party receives."""

    def __init__(self, chan):
        self.chan = chan
        self.log: list[dict] = []

    def recv(self, timeout=None):
        m = self.chan.recv(timeout)
        self.log.append(m)
        return m

    def __getattr__(self, k):
        return getattr(self.chan, k)


def run(f0, f1, record: int):
    """f0 on party 0, f1 on party 1; party `record`'s incoming messages are kept."""
    a, b = inprocess_pair(timeout=60)
    rec = Recorder((a, b)[record])
    chans = [a, b]
    chans[record] = rec
    s = [OTSession(chans[0], 0, ferret=False), OTSession(chans[1], 1, ferret=False)]  # IKNP views (Ferret: test_mpc_ferret.py)
    res = [None, None]
    errs = []

    def w(i, f):
        try:
            res[i] = f(s[i])
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = [threading.Thread(target=w, args=(i, f)) for i, f in enumerate((f0, f1))]
    [t.start() for t in th]
    [t.join(120) for t in th]
    assert not errs, errs
    return res, [m for m in rec.log if m.get("op") not in ("base_A", "base_B")]


def _u_rows(log, n, k=128):
    """The extension matrix u received by the sender, as n rows (per OT) of k/8 bytes."""
    u = np.concatenate([m["u"] for m in log])
    mp = (n + 15) // 16 * 16
    return np.frombuffer(_core.transpose_bits(u, k, mp), np.uint8).reshape(mp, k // 8)[:n]


def test_sender_view_independent_of_choices():
    """IKNP: the matrix u (k x m) the sender receives is uniform whatever the
    choices: bytes of u for all-zero vs all-one choices, and per-OT columns of u
    for OTs with choice 0 vs choice 1."""
    n = 1 << 13
    m = np.zeros(n, np.uint64)
    views = {}
    for bit in (0, 1):
        c = np.full(n, bool(bit))
        _, log = run(lambda s: s.send_chosen(m, m, 8), lambda s, c=c: s.recv_chosen(c, 8), record=0)
        views[bit] = np.concatenate([x["u"] for x in log])
        assert p_uniform(views[bit], 256) > P_MIN
    both = np.concatenate([views[0], views[1]])
    label = np.repeat([0, 1], [views[0].size, views[1].size])
    assert p_independent(label, both, 2, 256) > P_MIN
    # the test has power: the plain choice vector (what u would be without the PRG masks) fails it
    leak = np.concatenate([np.zeros(4096, np.uint8), np.full(4096, 255, np.uint8)])
    assert p_independent(np.repeat([0, 1], 4096), leak, 2, 256) < P_MIN

    # per-OT columns of u against the choice bit of that OT
    n = 1 << 14
    c = RNG.integers(0, 2, n).astype(bool)
    _, log = run(lambda s: s.send_random(n, 8), lambda s: s.recv_random(c, 8), record=0)
    rows = _u_rows(log, n)
    for byte in (0, 7, 15):
        assert p_independent(c.astype(int), rows[:, byte], 2, 256) > P_MIN


def test_kk13_sender_view_independent_of_choices():
    n = 1 << 13
    N = 16
    msgs = np.zeros((n, N), np.uint64)
    ch = RNG.integers(0, N, n)
    _, log = run(lambda s: s.send_1ofN(msgs, 2), lambda s: s.recv_1ofN(ch, N, 2), record=0)
    rows = _u_rows(log, n, k=256)
    for byte in (0, 13, 31):
        assert p_independent(ch, rows[:, byte], N, 256) > P_MIN
    # power: the Walsh-Hadamard codewords themselves (what u hides) are far from independent
    code = np.array([[bin(x & y).count("1") & 1 for y in range(8)] for x in range(N)], np.uint8)
    leak = np.packbits(code[ch], axis=1, bitorder="little")[:, 0]
    assert p_independent(ch, leak, N, 256) < P_MIN


def test_receiver_view_unchosen_message_chosen_ot():
    """Chosen OT, 4-bit messages: the receiver's y_{1-c} is uniform and
    independent of m_{1-c} (the message it must not learn)."""
    n = 1 << 14
    bits = 4
    c = RNG.integers(0, 2, n).astype(bool)
    m0 = RNG.integers(0, 16, n, dtype=np.uint64)
    m1 = RNG.integers(0, 16, n, dtype=np.uint64)
    (_, out), log = run(lambda s: s.send_chosen(m0, m1, bits), lambda s: s.recv_chosen(c, bits), record=1)
    assert (out == np.where(c, m1, m0)).all()
    y = np.frombuffer(_core.unpack_bits(np.concatenate([x["y"] for x in log]), 2 * n, bits), np.uint64).reshape(n, 2)
    idx = np.arange(n)
    y_unchosen = y[idx, 1 - c.astype(int)]
    m_unchosen = np.where(c, m0, m1)
    assert p_uniform(y_unchosen, 16) > P_MIN
    assert p_independent(m_unchosen, y_unchosen, 16, 16) > P_MIN
    # joint with what the receiver legitimately holds (its output)
    assert p_independent(m_unchosen, (y_unchosen ^ out) & np.uint64(15), 16, 16) > P_MIN
    # power: the statistic flags a view that does carry the message (the output itself)
    assert p_independent(np.where(c, m1, m0), out, 16, 16) < P_MIN


def test_receiver_view_arith_cot():
    """Arithmetic COT over Z_16: with choice 0 the receiver sees r and
    d = r + corr - K1, so d - r must be independent of corr; with choice 1 it
    learns r + corr only, which must be independent of corr."""
    n = 1 << 14
    bits = 4
    corr = RNG.integers(0, 16, n, dtype=np.uint64)
    c = RNG.integers(0, 2, n).astype(bool)
    (r, out), log = run(lambda s: s.send_cot(corr, bits), lambda s: s.recv_cot(c, bits), record=1)
    d = np.frombuffer(_core.unpack_bits(np.concatenate([x["y"] for x in log]), n, bits), np.uint64)
    z = ~c
    assert p_independent(corr[z], (d[z] - out[z]) & np.uint64(15), 16, 16) > P_MIN
    assert p_independent(corr[c], out[c], 16, 16) > P_MIN
    assert p_independent(corr[c], d[c], 16, 16) > P_MIN
    # power: the sender's own pair (r, r + corr) would reveal corr
    assert p_independent(corr, (out - r) & np.uint64(15), 16, 16) < P_MIN


def test_receiver_view_unchosen_kk13():
    """KK13 1-out-of-16 with 2-bit messages: the 15 unchosen masked messages are
    independent of those messages."""
    n = 1 << 12
    N, bits = 16, 2
    msgs = RNG.integers(0, 4, (n, N), dtype=np.uint64)
    ch = RNG.integers(0, N, n)
    (_, out), log = run(lambda s: s.send_1ofN(msgs, bits), lambda s: s.recv_1ofN(ch, N, bits), record=1)
    assert (out == msgs[np.arange(n), ch]).all()
    y = np.frombuffer(_core.unpack_bits(np.concatenate([x["y"] for x in log]), n * N, bits), np.uint64).reshape(n, N)
    other = np.ones((n, N), bool)
    other[np.arange(n), ch] = False
    assert p_uniform(y[other], 4) > P_MIN
    assert p_independent(msgs[other], y[other], 4, 4) > P_MIN
    # power: the chosen slot unmasked by the receiver's key reveals its message
    assert p_independent(msgs[~other], msgs[~other], 4, 4) < P_MIN

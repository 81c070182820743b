"""Statistical view tests for the 2PC primitives (semi-honest security, checked empirically).

In the OT-hybrid model a party's view of a primitive is what it gets out of the
OT calls plus the protocol messages it receives (the OT layer's own messages
are checked by tests/test_mpc_ot_views.py).  On the ring Z_{2^8}, with this
party's shares held fixed and the *other* party's share set to A in one run and
to B in another (the same value for all n elements, so elements are n
independent samples), every recorded value must be

* uniform over its range (chi-square goodness of fit), and
* identically distributed in the A and B runs (chi-square homogeneity),

for multiplication, comparison (MSB), faithful truncation and equality.
Threshold p > 1e-6 per check; the statistic is also shown to flag a leak.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cipherlm.mpc.ring import RingConfig
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import AShare
from cipherlm.mpc.protocols import compare, millionaire, mul, trunc
from cipherlm.mpc.ot import OTSession

P_MIN = 1e-6
BITS = 8
N = 4096


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty)."""
    if df <= 0:
        return 1.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def p_uniform(v: np.ndarray, bins: int) -> float:
    c = np.bincount(v.astype(np.int64), minlength=bins).astype(float)
    e = c.sum() / bins
    return chi2_sf(((c - e) ** 2 / e).sum(), bins - 1)


def p_same(a: np.ndarray, b: np.ndarray, bins: int) -> float:
    t = np.stack([np.bincount(a.astype(np.int64), minlength=bins), np.bincount(b.astype(np.int64), minlength=bins)]).astype(float)
    t = t[:, t.sum(0) > 0]
    e = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
    return chi2_sf(((t - e) ** 2 / e).sum(), t.shape[1] - 1)


class _RecordingOT:
    """Proxy recording every array an OT call returns to this party."""

    def __init__(self, ot, log):
        self._ot, self._log = ot, log

    def __getattr__(self, name):
        f = getattr(self._ot, name)

        def call(*a, **k):
            out = f(*a, **k)
            for v in (out if isinstance(out, tuple) else (out,)):
                if v is not None:
                    self._log.append((f"ot.{name}", np.asarray(v).astype(np.uint64).ravel()))
            return out
        return call


def _record(ctx, log):
    ctx._ot = _RecordingOT(OTSession(ctx.chan, ctx.party), log)
    recv = ctx.chan.recv

    def rec(*a, **k):
        m = recv(*a, **k)
        if "op" not in m:  # protocol messages (OT-internal ones carry "op")
            for key, v in m.items():
                if isinstance(v, np.ndarray) and v.size >= 64:
                    log.append((f"msg.{key}", v.astype(np.uint64).ravel()))
        return m
    ctx.chan.recv = rec


def _party(ctx, op, own, other_val):
    """Each party's shares are constants: party `ctx.party` uses own[party] (x, y)."""
    log = []
    _record(ctx, log)
    x0, y0 = own[ctx.party] if ctx.party != other_val[0] else other_val[1]
    x = AShare(ctx, np.full(N, x0, np.uint64), BITS, 0)
    y = AShare(ctx, np.full(N, y0, np.uint64), BITS, 0)
    if op == "mul":
        mul.mul(ctx, x, y)
    elif op == "msb":
        compare.msb(ctx, x)
    elif op == "trunc":
        trunc.trunc_faithful(ctx, x, 3)
    elif op == "equal":
        millionaire.equality(ctx, x.data, BITS)
    return log


def _views(op, observer, varied_value):
    """The observer's log when the other party's shares are `varied_value`."""
    other = 1 - observer
    own = {0: (77, 201), 1: (145, 33)}
    a, b = run_inprocess(_party, args0=(op, own, (other, varied_value)), args1=(op, own, (other, varied_value)),
                         ring=RingConfig(BITS, 0), ot_factory=None, timeout=60)
    return (a, b)[observer]


def _bins(*arrays) -> int:
    m = int(max(int(a.max()) for a in arrays if a.size))
    return 1 << max(1, m.bit_length())


@pytest.mark.parametrize("op", ["mul", "msb", "trunc", "equal"])
@pytest.mark.parametrize("observer", [0, 1])
def test_view_uniform_and_independent_of_peer_input(op, observer):
    checked = check_views(_views(op, observer, (3, 250)), _views(op, observer, (200, 7)), op)
    assert checked >= 2, f"{op}: too few view items checked ({checked})"


def check_views(va: list, vb: list, label: str) -> int:
    """Two views of one party (name, values) under two different peer inputs: the same
    messages and sizes, every item with enough samples uniform and equally distributed in
    both (chi-square, P_MIN).  Returns the number of items tested."""
    assert [k for k, _ in va] == [k for k, _ in vb], "message structure depends on the peer's input"
    assert [v.size for _, v in va] == [v.size for _, v in vb]
    checked = 0
    for (name, a), (_, b) in zip(va, vb):
        bins = _bins(a, b)
        if bins > 256 or a.size < 5 * bins:
            continue
        pu, ps = min(p_uniform(a, bins), p_uniform(b, bins)), p_same(a, b, bins)
        assert pu > P_MIN, f"{label}: {name} not uniform (p={pu:.2e})"
        assert ps > P_MIN, f"{label}: {name} depends on the peer's input (p={ps:.2e})"
        checked += 1
    return checked


def test_statistic_flags_a_leak():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 256, N)
    leaky = (u + (rng.random(N) < 0.1) * 3) % 256  # slightly biased
    assert p_uniform(u, 256) > P_MIN
    assert p_same(u, np.where(rng.random(N) < 0.3, 0, u), 256) < P_MIN
    assert p_uniform(np.minimum(u, 200), 256) < P_MIN
    del leaky

"""Fixed-point products in a narrow ring (`nonlinear.common.product` with a bound; issue 14
item 3, SiRNN's bit widths): against numpy on the Gilboa (small n) and HE (two
ciphertexts and more) paths, the bytes through the channel below the full-ring product's
on the same inputs, the fallback where the bound saves too few bits, and what a broken
bound does (only the elements beyond it are wrong)."""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.mpc import nonlinear as nl
from cipherlm.mpc.nonlinear import common
from cipherlm.mpc.protocols import mul_he
from cipherlm.mpc.ring import fixed_encode
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import share_input

F = 16
ULP = 2.0 ** -F


def _inputs(n: int, mag: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    X, Y = rng.uniform(-mag, mag, n), rng.uniform(-mag, mag, n)
    X[:4], Y[:4] = [0.0, mag, -mag, ULP], [mag, mag, -mag, -ULP]
    return X, Y


def _party(ctx, X, Y, bound, how):
    x = share_input(ctx, fixed_encode(X, F, 64) if ctx.party == 0 else None, 0, bits=64, frac=F)
    y = share_input(ctx, fixed_encode(Y, F, 64) if ctx.party == 1 else None, 1, bits=64, frac=F)
    # one-time costs outside the measurement: the HE product's keys (every prime either
    # width uses), Ferret's base in both directions, a first product of each kind
    mul_he.setup(ctx)
    ctx.ot.prime()
    nl.mulf(ctx, x[:8], y[:8], how=how, bound=bound)
    nl.sqf(ctx, x[:8], how=how, bound=bound)
    out = {}
    for name, fn in (("mul", lambda: nl.mulf(ctx, x, y, how=how, bound=bound)),
                     ("square", lambda: nl.sqf(ctx, x, how=how, bound=bound))):
        ctx.chan.send({"sync": 1})
        ctx.chan.recv()
        ctx.chan.reset_stats()
        r = fn()
        tot = ctx.chan.totals()
        assert r.bits == 64 and r.frac == F and r.shape == x.shape
        out[name] = (r, tot["bytes_sent"] + tot["bytes_received"])
    return {k: (r.reveal_float(), nb) for k, (r, nb) in out.items()}


def _run(X, Y, bound, how=None):
    a, _ = run_inprocess(_party, args0=(X, Y, bound, how), args1=(X, Y, bound, how), timeout=300)
    return a


def _fixed(v):
    return np.round(v * 2 ** F) / 2 ** F


@pytest.mark.parametrize("n", [300, 2 * 8192 + 5], ids=["gilboa", "he"])
@pytest.mark.parametrize("how", [None, "faithful"])
def test_narrow_products_against_numpy_and_below_the_full_ring(n, how):
    X, Y = _inputs(n, 3.0, seed=n)
    narrow, full = _run(X, Y, 9.0, how), _run(X, Y, None, how)
    Xf, Yf = _fixed(X), _fixed(Y)
    for name, want in (("mul", Xf * Yf), ("square", Xf * Xf)):
        for got, _ in (narrow[name], full[name]):
            assert np.abs(got - want).max() <= 3 * ULP, (name, n, how, np.abs(got - want).max() / ULP)
        # exact bytes through the channel, both directions: the narrow ring sends fewer
        print(f"\n{name} n={n} how={how}: narrow {narrow[name][1] / n:.1f} B/elem, "
              f"full ring {full[name][1] / n:.1f} B/elem")
        assert narrow[name][1] < full[name][1], (name, narrow[name][1], full[name][1])


def test_narrow_width_and_fallback():
    # |xy| <= 9 at scale 2^32: 2 x 9 -> 5 bits + 32 + 2 = 39 bits (two 43-bit primes for the HE product)
    assert common.narrow_bits(9.0, 32, 64) == 39
    # a bound that saves fewer than NARROW_MIN_SAVING bits runs the full-ring product, same bytes
    X, Y = _inputs(300, 3.0, seed=1)
    wide, full = _run(X, Y, 2.0 ** 24), _run(X, Y, None)
    assert common.narrow_bits(2.0 ** 24, 32, 64) > 64 - common.NARROW_MIN_SAVING
    for name in ("mul", "square"):
        assert wide[name][1] == full[name][1]
        assert np.abs(wide[name][0] - full[name][0]).max() <= 2 * ULP


def test_a_broken_bound_spoils_only_the_elements_beyond_it():
    X, Y = _inputs(400, 2.0, seed=2)
    X[10:20], Y[10:20] = 300.0, -200.0  # |xy| = 6e4, far above the promised 4
    got = _run(X, Y, 4.0)["mul"][0]
    want = _fixed(X) * _fixed(Y)
    bad = np.zeros(X.size, bool)
    bad[10:20] = True
    assert np.abs(got[~bad] - want[~bad]).max() <= 3 * ULP
    assert (np.abs(got[bad] - want[bad]) > 1.0).all()

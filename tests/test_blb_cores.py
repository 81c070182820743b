"""BLB appendix B's MPC cores (algorithms 4-5) against numpy, two parties in process
(l = 64, f = 16): `exp_reduced` (softmax's exp on (s - max) 2^-6, squared 6 times
on the HE side afterwards), the activation gates `gelu_gate` / `silu_gate` and GeLU's
clamped form (`abs_clamp` on shares, its polynomial `clamped_poly` evaluated here in numpy
as the HE block would)."""

from math import erf

import numpy as np
import pytest

from cipherlm.mpc import nonlinear as nl
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import share_input

ULP = 2.0 ** -16
RNG = np.random.default_rng(2024)


def _q(v):
    """The fixed-point value the parties actually hold (oracles run on it)."""
    return np.rint(np.asarray(v, np.float64) / ULP) * ULP


def _phi(v):
    return 0.5 * (1.0 + np.vectorize(erf)(v / np.sqrt(2.0)))


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


# exp_reduced: every fixed-point value of [-16/64, 0] (16385 of them), random ones, far below lo
EXP_GRID = -np.arange(0, 16385) * ULP
EXP_FAR = np.array([-0.25 - ULP, -0.3, -1.0, -5.0, -50.0, -1000.0, -5.0 / 64, -50.0 / 64, -1000.0 / 64])
EXP_RAND = _q(RNG.uniform(-0.25, 0.0, 2000))
S64 = np.linspace(-10.0, 0.0, 2001)  # s = score - max; the core sees s / 64
EXP_IN = np.concatenate([EXP_GRID, EXP_FAR, EXP_RAND, _q(S64 / 64)])
LO_MID = -14.0 / 64
MID_IN = _q(np.concatenate([np.linspace(-0.3, 0.0, 4001), RNG.uniform(LO_MID, 0, 1000), [-1000.0]]))
WIDE_IN = _q(np.concatenate([np.linspace(-0.5, 0.0, 2001), [-0.6, -9.0]]))  # degree 4 (lo = -1/2)

# gates: [-16, 16] in steps of 2^-9, random ones, |x| up to 100
GATE_IN = _q(np.concatenate([np.arange(-16 * 512, 16 * 512 + 1) / 512.0, RNG.uniform(-16, 16, 4000),
                             RNG.uniform(-100, 100, 500), [-100.0, -50.0, -16.0, 16.0, 50.0, 100.0]]))


def _run(ctx):
    sh = lambda v: share_input(ctx, v if ctx.party == 0 else None, 0)  # noqa: E731
    e, m, w, g = sh(EXP_IN), sh(MID_IN), sh(WIDE_IN), sh(GATE_IN)
    return {
        "exp": nl.exp_reduced(ctx, e, -16.0 / 64).reveal_float(),
        "exp_mid": nl.exp_reduced(ctx, m, LO_MID).reveal_float(),
        "exp_wide": nl.exp_reduced(ctx, w, -0.5).reveal_float(),
        "gelu_gate": nl.gelu_gate(ctx, g).reveal_float(),
        "silu_gate": nl.silu_gate(ctx, g).reveal_float(),
        "clamp": tuple(v.reveal_float() for v in nl.abs_clamp(ctx, g, nl.clamped_poly("gelu")[0])),
    }


@pytest.fixture(scope="module")
def out():
    a, _ = run_inprocess(_run, timeout=300)
    return a


def _rel(got, x, lo):
    ref = np.exp(np.maximum(x, lo))
    return np.abs(got - ref) / ref


def test_exp_reduced_relative_error(out):
    rel = _rel(out["exp"], EXP_IN, -0.25)
    assert rel.max() <= 3e-5, rel.max()
    rel = _rel(out["exp_mid"], MID_IN, LO_MID)
    assert rel.max() <= 3e-5, rel.max()
    rel = _rel(out["exp_wide"], WIDE_IN, -0.5)  # degree 4; exp(-1/2) = 0.61: 1 ulp = 2.5e-5 relative
    assert rel.max() <= 4e-5, rel.max()


def test_exp_reduced_clips_below_lo(out):
    n0 = EXP_GRID.size
    far = out["exp"][n0:n0 + EXP_FAR.size]
    below = EXP_FAR < -0.25
    assert np.abs(far[below] - np.exp(-0.25)).max() <= 2e-5
    assert np.abs(out["exp_mid"][-1] - np.exp(LO_MID)) <= 2e-5
    assert np.abs(out["exp_wide"][-2:] - np.exp(-0.5)).max() <= 2e-5


def test_exp_reduced_64th_power(out):
    """What the HE side does next: 6 squarings, exp(s / 64)^64 ~ exp(s) on s in [-10, 0]."""
    y = out["exp"][-S64.size:]
    rel = np.abs(y ** 64 - np.exp(S64)) / np.exp(S64)
    assert rel.max() <= 1e-2, rel.max()


def test_exp_reduced_degree_by_bound():
    c, err = nl.exp.exp_reduced_poly(-0.25)
    assert len(c) == 4 and err <= 2.0 ** -19
    c, err = nl.exp.exp_reduced_poly(-0.5)
    assert len(c) == 5 and err <= 2.0 ** -19
    with pytest.raises(ValueError):
        nl.exp.exp_reduced_poly(-1.0)


def test_gates(out):
    eg = np.abs(out["gelu_gate"] - _phi(GATE_IN))
    es = np.abs(out["silu_gate"] - _sigmoid(GATE_IN))
    assert eg.max() <= 2e-3, eg.max()
    assert es.max() <= 2e-3, es.max()
    # the documented levels (2.3e-4, 3.9e-4 measured)
    assert eg.max() <= 5e-4 and es.max() <= 6e-4
    far = np.abs(GATE_IN) >= 16
    assert np.abs(out["gelu_gate"][far] - (GATE_IN[far] > 0)).max() <= 1e-4
    assert np.abs(out["silu_gate"][far] - (GATE_IN[far] > 0)).max() <= 1e-4


def _gelu(v):
    return v * _phi(v)


def test_clamped_poly_fit_against_erf():
    """The clamped form in real arithmetic: within 1.8e-3 of GeLU on [-40, 40] (the whole
    activation's one segment: 4.1e-3), both forms, and the tanh form against its formula."""
    x = np.linspace(-40.0, 40.0, 400001)
    for fn, ref in (("gelu", _gelu(x)),
                    ("gelu_tanh", 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))))):
        T, c = nl.clamped_poly(fn)
        a = np.abs(x)
        ac = np.minimum(a, T)
        y = x / 2 + (a - ac) / 2 + np.polyval(c[::-1], ac)
        assert np.abs(y - ref).max() <= 1.8e-3, (fn, np.abs(y - ref).max())
    with pytest.raises(ValueError):
        nl.clamped_poly("silu")


def test_abs_clamp_on_shares(out):
    """(lin, ac) against numpy on the fixed-point inputs: ac = min(|x|, T) exactly and lin
    within one ulp (one local truncation by one bit), so lin + P(ac) is GeLU within the fit."""
    lin, ac = out["clamp"]
    T, c = nl.clamped_poly("gelu")
    a = np.abs(GATE_IN)
    want_ac = np.minimum(a, T)
    assert np.abs(ac - want_ac).max() <= ULP / 2, np.abs(ac - want_ac).max()
    assert np.abs(lin - (GATE_IN / 2 + (a - want_ac) / 2)).max() <= 1.5 * ULP
    y = lin + np.polyval(c[::-1], ac)
    assert np.abs(y - _gelu(GATE_IN)).max() <= 1.8e-3 + 4 * ULP

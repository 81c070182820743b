"""Nonlinear library against numpy, inside each function's documented input range
and error bound (l = 64, f = 16, real OT when available): in-process (two
threads) and, for every function, as two OS processes over TCP."""

from math import erf

import numpy as np
import pytest

from cipherlm.mpc import nonlinear as nl
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import share_input

OT = None  # Context's default: the real cipherlm.mpc.ot.OTSession
RNG = np.random.default_rng(11)
X = RNG.uniform(-8, 8, (4, 64))
X[0, :6] = [-8, -5, -1.97, 0, 3, 8]
NEG = -RNG.uniform(0, 20, 256)
POS = np.exp(RNG.uniform(np.log(0.07), np.log(4000), 256))
LN = RNG.normal(0.5, 3, (4, 96))
CAUSAL = np.tril(np.ones((8, 8), bool))


def _gelu(v):
    return 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2)))


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _run(ctx):
    sh = lambda v: share_input(ctx, v if ctx.party == 0 else None, 0)  # noqa: E731
    x, neg, pos, ln = sh(X), sh(NEG), sh(POS), sh(LN)
    g, b = np.linspace(0.5, 1.5, 96), np.linspace(-1, 1, 96)
    return {
        "gelu": nl.gelu(ctx, x).reveal_float(), "silu": nl.silu(ctx, x).reveal_float(),
        "exp": nl.exp_neg(ctx, neg).reveal_float(), "recip": nl.reciprocal(ctx, pos).reveal_float(),
        "rsqrt": nl.rsqrt(ctx, pos).reveal_float(), "max": nl.max_last(ctx, x).reveal_float(),
        "softmax": nl.softmax(ctx, x).reveal_float(),
        "causal": nl.softmax(ctx, sh(X[:1, :8].repeat(8, 0)), mask=CAUSAL).reveal_float(),
        "parts": [p.reveal_float() for p in nl.softmax_parts(ctx, x)],
        "ln": nl.layer_norm(ctx, ln, g, b).reveal_float(), "rms": nl.rms_norm(ctx, ln, g).reveal_float(),
    }


@pytest.fixture(scope="module")
def out():
    a, b = run_inprocess(_run, ot_factory=OT, timeout=120)
    return a


def test_gelu_silu(out):
    assert np.abs(out["gelu"] - _gelu(X)).max() <= 0.005
    assert np.abs(out["silu"] - X / (1 + np.exp(-X))).max() <= 0.0025


def test_exp(out):
    assert np.abs(out["exp"] - np.exp(NEG)).max() <= 5e-3


def test_reciprocal_rsqrt(out):
    assert (np.abs(out["recip"] - 1 / POS) <= 2e-4 / POS + 4 * 2.0 ** -16).all()
    assert (np.abs(out["rsqrt"] - 1 / np.sqrt(POS)) <= 1e-4 / np.sqrt(POS) + 4 * 2.0 ** -16).all()


def test_max_softmax(out):
    assert np.abs(out["max"] - X.max(-1, keepdims=True)).max() <= 2.0 ** -16
    assert np.abs(out["softmax"] - _softmax(X)).max() <= 5e-3
    ref = _softmax(np.where(CAUSAL, X[:1, :8].repeat(8, 0), -np.inf))
    assert np.abs(out["causal"] - ref).max() <= 5e-3
    assert (out["causal"][~CAUSAL] == 0).all()
    e, r = out["parts"]  # unnormalised exponentials and the row reciprocal
    ex = np.exp(X - X.max(-1, keepdims=True))
    assert e.shape == X.shape and r.shape == (X.shape[0], 1)
    assert np.abs(e - ex).max() <= 5e-3  # exp_neg's bound
    assert np.abs(r * e.sum(-1, keepdims=True) - 1).max() <= 1e-3  # reciprocal of the computed sum


def test_norms(out):
    g, b = np.linspace(0.5, 1.5, 96), np.linspace(-1, 1, 96)
    mu, var = LN.mean(-1, keepdims=True), LN.var(-1, keepdims=True)
    assert np.abs(out["ln"] - ((LN - mu) / np.sqrt(var + 1e-5) * g + b)).max() <= 2e-3
    assert np.abs(out["rms"] - LN / np.sqrt((LN ** 2).mean(-1, keepdims=True) + 1e-6) * g).max() <= 2e-3


def _select(ctx, V, I):
    x = share_input(ctx, V if ctx.party == 0 else None, 0)
    i = share_input(ctx, I if ctx.party == 1 else None, 1, frac=0)
    v, ix = nl.argmax_last(ctx, x)
    tv, ti = nl.topk_last(ctx, x, 8)
    return v.reveal_float(), ix.reveal_signed(), nl.one_hot(ctx, i, 40).reveal(), tv.reveal_float(), ti.reveal_signed()


def test_argmax_topk_onehot():
    V = RNG.permutation(np.linspace(-10, 10, 5 * 64)).reshape(5, 64)  # distinct values
    I = RNG.integers(0, 40, 7)
    (v, ix, oh, tv, ti), _ = run_inprocess(_select, args0=(V, I), args1=(V, I), ot_factory=OT)
    assert np.abs(v[:, 0] - V.max(1)).max() <= 2.0 ** -16 and (ix[:, 0] == V.argmax(1)).all()
    assert (oh == np.eye(40, dtype=int)[I]).all()
    order = np.argsort(-V, 1)[:, :8]
    assert (ti == order).all() and np.abs(tv - np.take_along_axis(V, order, 1)).max() <= 2.0 ** -16


def _two_proc(ctx, V, I, T):
    """Every nonlinear function once, the parties being two OS processes over TCP."""
    sh = lambda v: share_input(ctx, v if ctx.party == 0 else None, 0)  # noqa: E731
    x, neg, pos, ln, t = sh(V), sh(NEG[:32]), sh(POS[:32]), sh(LN[:2]), sh(T)
    u = share_input(ctx, V[::-1] / 2 if ctx.party == 1 else None, 1)
    idx = share_input(ctx, I if ctx.party == 1 else None, 1, frac=0)
    g, b = np.linspace(0.5, 1.5, 96), np.linspace(-1, 1, 96)
    am, ai = nl.argmax_last(ctx, t)
    tv, ti = nl.topk_last(ctx, t, 3)
    return {
        # reveal to one party only: the other must get None
        "softmax": nl.softmax(ctx, x).reveal_float(to=0), "gelu": nl.gelu(ctx, x).reveal_float(to=1),
        "causal": nl.softmax(ctx, sh(X[:1, :8].repeat(8, 0)), mask=CAUSAL).reveal_float(),
        "parts": [p.reveal_float() for p in nl.softmax_parts(ctx, x)],
        "silu": nl.silu(ctx, x).reveal_float(), "swiglu": nl.swiglu(ctx, x, u).reveal_float(),
        "exp": nl.exp_neg(ctx, neg).reveal_float(), "recip": nl.reciprocal(ctx, pos).reveal_float(),
        "rsqrt": nl.rsqrt(ctx, pos).reveal_float(), "max": nl.max_last(ctx, x).reveal_float(),
        "argmax": (am.reveal_float(), ai.reveal_signed()), "topk": (tv.reveal_float(), ti.reveal_signed()),
        "ln": nl.layer_norm(ctx, ln, g, b).reveal_float(), "rms": nl.rms_norm(ctx, ln, g).reveal_float(),
        "onehot": nl.one_hot(ctx, idx, 12).reveal(),
    }


def test_every_nonlinear_function_two_processes():
    from cipherlm.mpc.runner import run_processes
    V = RNG.uniform(-6, 6, (3, 16))
    I = RNG.integers(0, 12, 5)
    T = RNG.permutation(np.linspace(-10, 10, 2 * 16)).reshape(2, 16)  # distinct values
    o0, o1 = run_processes(_two_proc, args0=(V, I, T), args1=(V, I, T), ot_factory=OT, timeout=180)
    assert o0["gelu"] is None and o1["softmax"] is None
    assert np.abs(o0["softmax"] - _softmax(V)).max() <= 5e-3 and np.abs(o1["gelu"] - _gelu(V)).max() <= 0.005
    for o in (o0, o1):
        ref = _softmax(np.where(CAUSAL, X[:1, :8].repeat(8, 0), -np.inf))
        assert np.abs(o["causal"] - ref).max() <= 5e-3 and (o["causal"][~CAUSAL] == 0).all()
        sig = V / (1 + np.exp(-V))
        assert np.abs(o["silu"] - sig).max() <= 0.0025
        assert np.abs(o["swiglu"] - sig * V[::-1] / 2).max() <= 0.0025 * 3 + 1e-3
        assert np.abs(o["exp"] - np.exp(NEG[:32])).max() <= 5e-3
        p = POS[:32]
        assert (np.abs(o["recip"] - 1 / p) <= 2e-4 / p + 4 * 2.0 ** -16).all()
        assert (np.abs(o["rsqrt"] - 1 / np.sqrt(p)) <= 1e-4 / np.sqrt(p) + 4 * 2.0 ** -16).all()
        assert np.abs(o["max"] - V.max(-1, keepdims=True)).max() <= 2.0 ** -16
        (mv, mi), (tv, ti) = o["argmax"], o["topk"]
        assert np.abs(mv[:, 0] - T.max(1)).max() <= 2.0 ** -16 and (mi[:, 0] == T.argmax(1)).all()
        order = np.argsort(-T, 1)[:, :3]
        assert (ti == order).all() and np.abs(tv - np.take_along_axis(T, order, 1)).max() <= 2.0 ** -16
        g, b, L = np.linspace(0.5, 1.5, 96), np.linspace(-1, 1, 96), LN[:2]
        mu, var = L.mean(-1, keepdims=True), L.var(-1, keepdims=True)
        assert np.abs(o["ln"] - ((L - mu) / np.sqrt(var + 1e-5) * g + b)).max() <= 2e-3
        assert np.abs(o["rms"] - L / np.sqrt((L ** 2).mean(-1, keepdims=True) + 1e-6) * g).max() <= 2e-3
        assert (o["onehot"] == np.eye(12, dtype=int)[I]).all()


def _swiglu(ctx, G, U):
    g = share_input(ctx, G if ctx.party == 0 else None, 0)
    u = share_input(ctx, U if ctx.party == 1 else None, 1)
    return nl.swiglu(ctx, g, u).reveal_float()


def test_swiglu():
    G, U = RNG.uniform(-8, 8, 200), RNG.uniform(-4, 4, 200)
    out, _ = run_inprocess(_swiglu, args0=(G, U), args1=(G, U), ot_factory=OT)
    assert np.abs(out - G / (1 + np.exp(-G)) * U).max() <= 0.0025 * 4 + 1e-3


def _edges(ctx, R, S, E):
    sh = lambda v: share_input(ctx, v if ctx.party == 0 else None, 0)  # noqa: E731
    r, s, e = sh(R), sh(S), sh(E)
    return (nl.reciprocal(ctx, r).reveal_float(), nl.reciprocal(ctx, r, iters=2).reveal_float(),
            nl.rsqrt(ctx, s).reveal_float(), nl.exp_neg(ctx, e).reveal_float())


def test_bracket_edges_and_clip():
    """The one-hot bracket at and next to its thresholds (2^k +- 1 ulp), the range
    ends, the zero outputs above the top threshold; exp at 0 and around the clip."""
    u = 2.0 ** -16
    R = np.array([2.0 ** k + d for k in range(-4, 12) for d in (0, -u, u) if k > -4 or d >= 0] + [4096.0, 5000.0, 30000.0])
    S = np.array([2.0 ** k + d for k in range(-8, 16) for d in (0, -u, u) if k > -8 or d >= 0] + [65536.0, 70000.0, 500000.0])
    E = np.array([0.0, -u, -1.0, -2.0, -13.99, -14.0, -14.01, -20.0, -1024.0])
    (r, r2, s, e), _ = run_inprocess(_edges, args0=(R, S, E), args1=(R, S, E), ot_factory=OT)
    inr, ins = R < 4096, S < 65536
    for got in (r, r2):
        assert (np.abs(got - 1 / R)[inr] <= 2e-4 / R[inr] + 4 * u).all()
        assert (got[~inr] == 0).all()  # above the top threshold (below 8 times it)
    assert (np.abs(s - S ** -0.5)[ins] <= 1e-4 / np.sqrt(S[ins]) + 4 * u).all() and (s[~ins] == 0).all()
    assert np.abs(e - np.exp(E)).max() <= 5e-3 and (e[E < -14] == 0).all()

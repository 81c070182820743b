"""The fhe mode's polynomial approximations (`cipherlm.fhe.approx`, AEGIS section 2.4) and the
range calibration (`cipherlm.fhe.calibrate`): every stated error is re-measured here
against numpy on an independent grid; the depth is Lattigo's `chebyshev_levels`
formula (docs/he_backend.md) plus the Newton steps' levels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numpy.polynomial import chebyshev as C

from cipherlm.fhe import approx as A

TARGETS = {op: t for op, (_, _, t) in A.DEFAULT_RANGES.items()}
REF = {
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "tanh": np.tanh,
    "exp": np.exp,
    "inv": lambda x: 1 / x,
    "rsqrt": lambda x: 1 / np.sqrt(x),
}


def _independent_errors(a: A.Approx) -> tuple[float, float]:
    """Max abs and rel error on a grid not used to build `a`: 100,003 uniform points and
    5,000 random ones; the polynomial evaluated through numpy's Chebyshev class."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(a.lo, a.hi, 100_003), rng.uniform(a.lo, a.hi, 5000)])
    y = C.Chebyshev(a.coeffs, domain=[a.lo, a.hi])(x)
    for _ in range(a.newton_steps):
        y = y * (2 - x * y) if a.op == "inv" else 0.5 * y * (3 - x * y * y)
    f = REF[a.op](x)
    err = np.abs(y - f)
    keep = np.abs(f) >= (A.REL_FLOOR if a.op in ("gelu", "silu", "tanh", "exp") else 0)
    return float(err.max()), float((err[keep] / np.abs(f[keep])).max())


def test_chebyshev_levels_formula():
    # docs/he_backend.md: ceil(log2(d + 1)), + 1 off [-1, 1] (measured on Lattigo for d = 1..32)
    assert [A.chebyshev_levels(d) for d in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32)] == [1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert A.chebyshev_levels(15, (-8, 8)) == 5 and A.chebyshev_levels(16, (0, 1)) == 6
    assert A.chebyshev_levels(0, (0, 1)) == 0
    with pytest.raises(ValueError):
        A.chebyshev_levels(-1)


def test_chebyshev_levels_matches_lattigo_when_built():
    try:
        from cipherlm.he.lattigo_backend import LattigoBackend
        lattigo = LattigoBackend.chebyshev_levels
        lattigo(3, (-1.0, 1.0))
    except Exception as e:  # noqa: BLE001  (the Go library is not built here)
        pytest.skip(f"Lattigo backend not available: {e}")
    for d in range(1, 33):
        for iv in ((-1.0, 1.0), (-8.0, 8.0)):
            assert A.chebyshev_levels(d, iv) == lattigo(d, iv)


@pytest.mark.parametrize("op", A.OPS)
def test_default_approximations_meet_their_targets(op):
    a = A.default_approximations()[op]
    lo, hi, target = A.DEFAULT_RANGES[op]
    assert (a.op, a.lo, a.hi) == (op, lo, hi) and len(a.coeffs) == a.degree + 1
    abs_e, rel_e = _independent_errors(a)
    err = rel_e if op in ("inv", "rsqrt") else abs_e
    assert err <= 1.02 * target, (op, err, target)
    # the stated errors are what numpy measures (to the grids' difference)
    assert abs_e == pytest.approx(a.max_abs_error, rel=0.05)
    assert rel_e == pytest.approx(a.max_rel_error, rel=0.05)
    assert a.depth == A.chebyshev_levels(a.degree, (lo, hi)) + a.newton_steps * A.NEWTON_LEVELS.get(op, 0)
    assert sum(d for _, d in a.stages) == a.depth
    # __call__ is the same function as the independent evaluation
    x = np.linspace(lo, hi, 101)
    assert np.allclose(a(x), REF[op](x), atol=1.02 * target * (1 if op not in ("inv", "rsqrt") else REF[op](x)))


@pytest.mark.parametrize("op,lo,hi,target", [("gelu", -8, 8, 1e-3), ("silu", -8, 8, 1e-3), ("exp", -8, 0, 1e-4),
                                             ("tanh", -4, 4, 1e-3)])
def test_direct_degree_is_the_smallest(op, lo, hi, target):
    a = A.approximation(op, lo, hi, target)
    assert a.newton_steps == 0 and a.max_abs_error <= target
    below = A.interpolant(op, a.degree - 1, lo, hi)
    assert A.measure(op, below, lo, hi)[0] > target   # one degree less misses the target
    assert _independent_errors(a)[0] <= 1.02 * target


def test_inverse_initial_polynomial_is_the_chebyshev_minimax():
    """1 - x p(x) = T_n(t(x)) / T_n(t(0)): max relative error exactly 1 / T_n((b + a)/(b - a))."""
    lo, hi = 1.0, 1024.0
    for d in (1, 3, 7, 15):
        c = A.inv_initial(d, lo, hi)
        _, rel = A.measure("inv", c, lo, hi)
        expect = 1 / C.chebval((hi + lo) / (hi - lo), [0] * (d + 1) + [1])
        assert rel == pytest.approx(expect, rel=1e-6)
        assert rel > 0.5  # far from 1e-3: why Newton steps are needed


@pytest.mark.parametrize("op", ["inv", "rsqrt"])
def test_wide_ranges_need_newton_steps(op):
    lo, hi, target = A.DEFAULT_RANGES[op]
    a = A.approximation(op, lo, hi, target)
    assert a.newton_steps >= 1
    assert A.measure(op, a.coeffs, lo, hi, 0)[1] > target              # the polynomial alone misses
    assert A.measure(op, a.coeffs, lo, hi, a.newton_steps - 1)[1] > target  # one step fewer misses
    assert a.max_rel_error <= target
    # a narrow range is reached by the polynomial alone
    assert A.approximation(op, 0.5, 2.0, 1e-3).newton_steps == 0


def test_bad_requests():
    with pytest.raises(ValueError):
        A.approximation("inv", 0.0, 4.0, 1e-3)
    with pytest.raises(ValueError):
        A.approximation("relu", -1.0, 1.0, 1e-3)
    with pytest.raises(ValueError):
        A.approximation("gelu", 2.0, -2.0, 1e-3)
    with pytest.raises(ValueError):
        A.approximation("gelu", -30.0, 30.0, 1e-9, max_degree=15)


# ---------------------------------------------------------------- calibration


def test_calibrate_tiny_llama(tiny_llama_dir):
    from cipherlm.fhe.calibrate import RecordingBackend, calibrate_ranges
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(tiny_llama_dir)
    texts = [[1, 5, 9, 33, 70, 2, 11], list(range(3, 40))]
    r = calibrate_ranges(lm, texts, margin=0.1)
    assert r["inputs"] == 2 and r["tokens"] == 44
    assert set(r["observed"]) == {"silu", "exp", "inv", "rsqrt"}
    kinds = {}
    for s in r["nodes"].values():
        kinds.setdefault(s["kind"], []).append(s["node"])
    assert sorted(kinds["silu"]) == ["L0.ffn.act", "L1.ffn.act"]
    assert len(kinds["rsqrt"]) == 5   # 2 norms per layer + the final norm
    lo, hi = r["observed"]["exp"]
    assert lo < 0 and hi == 0.0
    assert r["observed"]["inv"][0] == pytest.approx(1.0) and r["observed"]["inv"][1] <= 37  # <= the key count
    assert r["ranges"]["inv"][0] == 1.0 and r["ranges"]["exp"][1] == 0.0
    assert 0 < r["ranges"]["rsqrt"][0] < r["observed"]["rsqrt"][0]
    slo, shi = r["observed"]["silu"]
    assert r["ranges"]["silu"][0] < slo < shi < r["ranges"]["silu"][1]
    # the recorder changes nothing
    ex = plain_executor(lm)
    ref = ex.forward(texts[1])
    ex.backend = RecordingBackend(ex.backend)
    assert np.array_equal(ex.forward(texts[1]), ref)
    # the calibrated ranges give approximations that meet their targets
    for op, target in (("silu", 1e-3), ("exp", 1e-4), ("inv", 1e-3), ("rsqrt", 1e-3)):
        a = A.approximation(op, *r["ranges"][op], target)
        err = _independent_errors(a)[1 if op in ("inv", "rsqrt") else 0]
        assert err <= 1.02 * target


def test_calibrate_minilm_when_installed():
    from cipherlm.fhe.calibrate import calibrate_ranges
    from cipherlm.models import list_models

    if "minilm-l6" not in {m["name"] for m in list_models() if m["available"]}:
        pytest.skip("minilm-l6 not installed")
    r = calibrate_ranges("minilm-l6", ["The movie was wonderful and moving.",
                                       "I hated every minute of this dull, overlong film."])
    assert set(r["observed"]) == {"gelu", "exp", "inv", "rsqrt"}
    glo, ghi = r["observed"]["gelu"]
    assert glo < -1 and ghi > 1
    assert len([s for s in r["nodes"].values() if s["kind"] == "rsqrt"]) == 13  # embedding norm + 2 x 6 layers


def test_calibrated_approximations_per_node_feed_the_level_pass(tiny_llama_dir):
    from cipherlm.compile import build_graph
    from cipherlm.compile.passes import fhe_levels
    from cipherlm.fhe.calibrate import approximations, calibrate_ranges
    from cipherlm.models import load_model

    lm = load_model(tiny_llama_dir)
    r = calibrate_ranges(lm, [list(range(1, 30))])
    per_kind = approximations(r)
    assert set(per_kind) == {"silu", "exp", "inv", "rsqrt"}
    pn = approximations(r, per_node=True)
    assert set(pn) == {s["node"] for s in r["nodes"].values()}
    for node, d in pn.items():
        for kind, a in d.items():
            s = r["nodes"][node if kind not in ("exp", "inv") else f"{node}:{kind}"]
            assert a.lo <= s["min"] and s["max"] <= a.hi   # each node's range holds what it saw
            assert a.depth <= per_kind[kind].depth   # a node's range lies within the union
    g = fhe_levels.run(build_graph(lm.config), levels=9, approximations=per_kind, per_node=pn)
    for name in ("L0.attn_norm", "L1.ffn_norm", "out_norm"):
        assert g.node(name).attrs["fhe"]["depth"] == 2 + pn[name]["rsqrt"].depth
    assert g.node("L1.softmax").attrs["fhe"]["depth"] == pn["L1.softmax"]["exp"].depth + \
        pn["L1.softmax"]["inv"].depth + 1
    assert g.meta["fhe_levels"]["min_level"] >= 0


def test_best_effort_within_a_depth():
    """A range too wide for the target within the levels: the deepest series that fits, its
    error measured (SmolLM2's layer-28 SiLU range at the client-refresh path's 8 levels)."""
    from cipherlm.fhe.approx import approximation, chebyshev_levels, max_degree_within

    lo, hi = -41.4, 66.2
    assert approximation("silu", lo, hi, 1e-3).poly_depth == 9
    d = max_degree_within(8, (lo, hi))
    assert d == 127 and chebyshev_levels(d, (lo, hi)) == 8 and chebyshev_levels(d + 1, (lo, hi)) == 9
    with pytest.raises(ValueError, match="no degree"):
        approximation("silu", lo, hi, 1e-3, max_degree=d)
    a = approximation("silu", lo, hi, 1e-3, max_degree=d, best_effort=True)
    assert a.degree == d and a.poly_depth == 8 and 1e-3 < a.max_abs_error < 2e-3
    assert approximation("silu", -8, 6, 1e-3, max_degree=d, best_effort=True).max_abs_error <= 1e-3

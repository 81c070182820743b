"""Polynomial approximations of the fhe mode's nonlinear operators (AEGIS section 2.4).

CKKS evaluates only additions and products (AEGIS section 2.1: each product consumes
one level of the modulus chain), so every nonlinear operator of a Transformer is
replaced by a polynomial on a bounded input range ("nonlinear functions are
approximated by high-degree polynomials", section 2.4).  Here each one is a Chebyshev
series p(x) = sum_k c_k T_k((2x - lo - hi) / (hi - lo)) on [lo, hi]: exactly the form
`cipherlm.he.lattigo_backend.LattigoBackend.evaluate_chebyshev` evaluates, so
`Approx.coeffs` can be passed to it as they are.

Operators (`OPS`) and what ``target_error`` bounds:

=======  =====================================  =================================
op       f(x)                                   target bounds
=======  =====================================  =================================
gelu     x Phi(x) (erf form)                    max |p - f| on [lo, hi]
silu     x sigmoid(x)                           max |p - f|
tanh     tanh(x) (BERT's pooler)                max |p - f|
exp      exp(x) on [lo, hi] with hi <= 0 (the   max |p - f| (values in (0, 1]:
         softmax input after max subtraction)   softmax needs absolute error)
inv      1 / x on [lo, hi], 0 < lo (softmax     max |p - f| / f (relative)
         denominators)
rsqrt    1 / sqrt(x), 0 < lo (norm variances)   max |p - f| / f (relative)
=======  =====================================  =================================

gelu, silu, tanh, exp: the Chebyshev interpolant at degree + 1 Chebyshev nodes (numpy's
``chebinterpolate``) of the smallest degree whose error on a dense grid meets the target.

inv, rsqrt: over the wide ranges softmax sums and variances take (1..1024, 1e-3..1e3),
no polynomial of reasonable degree reaches 1e-3 relative error (the relative error
of the best degree-d polynomial to 1/x on [a, b] is 1/T_{d+1}((b + a)/(b - a)), about
0.64 at d = 15 for b/a = 1000).  The standard way out: a low-degree initial polynomial
y0 with relative error e0 < 1, then Newton iterations, each of which squares (about)
the relative error:

* inv:   y <- y (2 - x y);           1 - x y' = (1 - x y)^2; 2 levels per step (x*y, then y*(.));
* rsqrt: y <- y (3 - x y^2) / 2;     with s = x y^2 (the error e = 1 - s):
  s' = s (3 - s)^2 / 4 and 1 - s' = (1 - s)^2 (4 - s) / 4 = (3 e^2 + e^3) / 4;
  3 levels per step (y*y, x*(y^2), (y/2)*(3 - .), y/2 computed alongside y*y).

The initial polynomial for inv is the minimax-relative one in closed form (the
extremal property of Chebyshev polynomials): 1 - x p(x) = T_n(t(x)) / T_n(t(0)),
n = d + 1, t(x) = (b + a - 2x) / (b - a); for rsqrt it is a Lawson (iteratively
reweighted least squares) fit of the relative error.  `approximation` picks, among the
depth-efficient degrees 2^k - 1 and 0..`MAX_NEWTON` steps, the combination of least
depth that meets the target (then the smaller degree).

Depth (levels consumed): `chebyshev_levels(d, (lo, hi))` = ceil(log2(d + 1)), plus one
for the change of variable when [lo, hi] is not [-1, 1]: the formula docs/he_backend.md
states for the Lattigo backend's ``chebyshev_levels`` (measured there against what
Lattigo's polynomial evaluator consumes, d = 1..32), plus the Newton steps' levels.

Every error stated is measured on a dense grid (`GRID` points, uniform, plus the
Chebyshev-distributed points near the ends) against numpy's f in float64; the tests
re-measure them (tests/test_fhe_approx.py).  ``max_rel_error`` of gelu / silu / tanh / exp is
taken where |f(x)| >= `REL_FLOOR` (f crosses or nears 0 there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numpy.polynomial import chebyshev as C

OPS = ("gelu", "silu", "tanh", "exp", "inv", "rsqrt")
GRID = 20001
REL_FLOOR = 1e-2
MAX_DEGREE = 255
MAX_NEWTON = 10
#: depth-efficient degrees for the Newton initial polynomial: 2^k - 1 fills its levels
NEWTON_DEGREES = (1, 3, 7, 15, 31)
#: levels per Newton step (module docstring)
NEWTON_LEVELS = {"inv": 2, "rsqrt": 3}


def _erf(x):
    # numpy has no erf; math.erf per element (the grids are small) -- vectorised
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _gelu(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _silu(x):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-x))


FUNCS = {
    "gelu": _gelu,
    "silu": _silu,
    "tanh": lambda x: np.tanh(np.asarray(x, np.float64)),
    "exp": lambda x: np.exp(np.asarray(x, np.float64)),
    "inv": lambda x: 1.0 / np.asarray(x, np.float64),
    "rsqrt": lambda x: 1.0 / np.sqrt(np.asarray(x, np.float64)),
}


def chebyshev_levels(degree: int, interval: tuple[float, float] = (-1.0, 1.0)) -> int:
    """Levels a degree-`degree` Chebyshev series on `interval` consumes in CKKS:
    ceil(log2(degree + 1)), + 1 for the change of variable off [-1, 1] (docs/he_backend.md,
    ``chebyshev_levels``, as Lattigo's polynomial evaluator really consumes; degree 0: 0)."""
    d = int(degree)
    if d < 0:
        raise ValueError("degree must be >= 0")
    if d == 0:
        return 0
    lo, hi = interval
    return math.ceil(math.log2(d + 1)) + (0 if (float(lo), float(hi)) == (-1.0, 1.0) else 1)


def grid(lo: float, hi: float, n: int = GRID) -> np.ndarray:
    """The dense error grid: n uniform points plus n // 4 Chebyshev-distributed points
    (denser near the ends, where interpolation errors peak), sorted."""
    u = np.linspace(lo, hi, n)
    t = np.cos(np.pi * (np.arange(n // 4) + 0.5) / (n // 4))
    return np.unique(np.concatenate([u, (hi - lo) / 2 * t + (hi + lo) / 2]))


def _to_unit(x, lo, hi):
    return (2.0 * np.asarray(x, np.float64) - lo - hi) / (hi - lo)


@dataclass(frozen=True)
class Approx:
    """One operator's approximation: p on [lo, hi] (Chebyshev coefficients `coeffs` for
    the interval's change of variable), then `newton_steps` Newton iterations (inv,
    rsqrt); `depth` levels in all; errors measured on `grid(lo, hi)`."""

    op: str
    lo: float
    hi: float
    degree: int
    coeffs: tuple[float, ...]
    newton_steps: int
    depth: int
    max_abs_error: float
    max_rel_error: float

    @property
    def poly_depth(self) -> int:
        return chebyshev_levels(self.degree, (self.lo, self.hi))

    @property
    def stages(self) -> list[tuple[str, int]]:
        """(name, levels) of the pieces a bootstrap may sit between: the polynomial (one
        piece), then each Newton step."""
        out = [(f"{self.op}.poly", self.poly_depth)]
        out += [(f"{self.op}.newton{i + 1}", NEWTON_LEVELS[self.op]) for i in range(self.newton_steps)]
        return out

    def __call__(self, x) -> np.ndarray:
        """The approximation evaluated in float64, as the encrypted circuit would."""
        return evaluate(self.op, self.coeffs, self.lo, self.hi, self.newton_steps, x)

    def row(self) -> str:
        return (f"{self.op:<6} [{self.lo:g}, {self.hi:g}]  degree {self.degree:>3}  newton {self.newton_steps}  "
                f"depth {self.depth:>2}  max abs err {self.max_abs_error:.2e}  max rel err {self.max_rel_error:.2e}")


def evaluate(op: str, coeffs, lo: float, hi: float, newton_steps: int, x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    y = C.chebval(_to_unit(x, lo, hi), np.asarray(coeffs, np.float64))
    for _ in range(newton_steps):
        if op == "inv":
            y = y * (2.0 - x * y)
        elif op == "rsqrt":
            y = 0.5 * y * (3.0 - x * y * y)
        else:
            raise ValueError(f"no Newton iteration for {op!r}")
    return y


def measure(op: str, coeffs, lo: float, hi: float, newton_steps: int = 0, x=None, f=None) -> tuple[float, float]:
    """(max abs error, max rel error) of the approximation against numpy's f on the grid
    (or on `x`; `f`: f(x) when already computed)."""
    x = grid(lo, hi) if x is None else np.asarray(x, np.float64)
    f = FUNCS[op](x) if f is None else f
    err = np.abs(evaluate(op, coeffs, lo, hi, newton_steps, x) - f)
    big = np.abs(f) >= (REL_FLOOR if op in ("gelu", "silu", "tanh", "exp") else 0.0)
    rel = float(np.max(err[big] / np.abs(f[big]))) if big.any() else float("nan")
    return float(np.max(err)), rel


def interpolant(op: str, degree: int, lo: float, hi: float) -> np.ndarray:
    """Chebyshev coefficients of f's interpolant at degree + 1 Chebyshev nodes on [lo, hi]."""
    f = FUNCS[op]
    return C.chebinterpolate(lambda t: f((hi - lo) / 2 * t + (hi + lo) / 2), int(degree))


def inv_initial(degree: int, lo: float, hi: float) -> np.ndarray:
    """The degree-`degree` polynomial p minimising max |1 - x p(x)| on [lo, hi] (0 < lo):
    1 - x p(x) = T_n(t(x)) / T_n(t(0)), n = degree + 1, t(x) = (hi + lo - 2x)/(hi - lo).
    p is a polynomial of degree `degree`, so interpolating it at degree + 1 nodes is exact."""
    n = int(degree) + 1
    t0 = (hi + lo) / (hi - lo)
    Tn0 = C.chebval(t0, [0] * n + [1])

    def p(t):
        x = (hi - lo) / 2 * t + (hi + lo) / 2
        return (1.0 - C.chebval((hi + lo - 2 * x) / (hi - lo), [0] * n + [1]) / Tn0) / x

    return C.chebinterpolate(p, int(degree))


def rsqrt_initial(degree: int, lo: float, hi: float, iters: int = 20) -> np.ndarray:
    """A degree-`degree` p with small max |1 - sqrt(x) p(x)| on [lo, hi]: Lawson's
    iteratively reweighted least squares on 2000 Chebyshev-distributed points."""
    m = 2000
    t = np.cos(np.pi * (np.arange(m) + 0.5) / m)
    x = (hi - lo) / 2 * t + (hi + lo) / 2
    s = np.sqrt(x)
    A = s[:, None] * C.chebvander(t, int(degree))
    w = np.full(m, 1.0 / m)
    c = None
    for _ in range(iters):
        sw = np.sqrt(w)
        c = np.linalg.lstsq(A * sw[:, None], sw, rcond=None)[0]
        r = np.abs(1.0 - A @ c)
        w = w * (r + 1e-300)
        w /= w.sum()
    # Newton's iteration converges from s = x p^2 in (0, 3) only (s' = s (3 - s)^2 / 4 maps
    # (0, 3) into (0, 1]); scale p by sqrt(q) so that the worst s after one step is largest
    r = s * (C.chebvander(t, int(degree)) @ c)
    if r.min() <= 0:
        raise ValueError(f"rsqrt initial polynomial of degree {degree} on [{lo}, {hi}] is not positive")
    m, M = float(r.min() ** 2), float(r.max() ** 2)
    q = np.linspace(1e-6, 3.0 / M, 4001)[:-1]

    def g(z):
        return z * (3.0 - z) ** 2 / 4.0

    best = q[np.argmax(np.minimum(g(q * m), g(q * M)))]
    return c * math.sqrt(best)


def _make(op, lo, hi, degree, coeffs, steps) -> Approx:
    abs_e, rel_e = measure(op, coeffs, lo, hi, steps)
    depth = chebyshev_levels(degree, (lo, hi)) + steps * NEWTON_LEVELS.get(op, 0)
    return Approx(op, float(lo), float(hi), int(degree), tuple(float(c) for c in coeffs), int(steps), int(depth),
                  abs_e, rel_e)


def _check_range(op: str, lo: float, hi: float) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(f"need a finite range lo < hi, got [{lo}, {hi}]")
    if op in ("inv", "rsqrt") and lo <= 0:
        raise ValueError(f"{op} needs 0 < lo, got [{lo}, {hi}]")


@functools.lru_cache(maxsize=256)
def max_degree_within(levels: int, interval: tuple[float, float] = (-1.0, 1.0)) -> int:
    """The largest degree whose Chebyshev series on `interval` consumes at most `levels` levels
    (`chebyshev_levels`; 0 when not even degree 1 fits)."""
    off = 0 if tuple(map(float, interval)) == (-1.0, 1.0) else 1
    return max(0, (1 << max(0, int(levels) - off)) - 1) if levels > off else 0


def approximation(op: str, lo: float, hi: float, target_error: float, max_degree: int = MAX_DEGREE,
                  best_effort: bool = False) -> Approx:
    """The cheapest approximation of `op` on [lo, hi] whose error (absolute for gelu, silu,
    tanh, exp; relative for inv, rsqrt: see the module docstring) is <= target_error on the dense
    grid.  gelu / silu / tanh / exp: the smallest degree (<= max_degree); inv / rsqrt: the least
    depth over degrees `NEWTON_DEGREES` and 0..`MAX_NEWTON` Newton steps.  ValueError when
    nothing within those bounds meets the target, unless ``best_effort`` (gelu / silu / tanh /
    exp): then the degree-``max_degree`` interpolant, its error recorded in the result."""
    lo, hi, target = float(lo), float(hi), float(target_error)
    _check_range(op, lo, hi)
    if target <= 0:
        raise ValueError("target_error must be > 0")
    if op in ("inv", "rsqrt"):
        return _newton_search(op, lo, hi, target)
    x = grid(lo, hi)
    fx = FUNCS[op](x)

    def err(d):
        return measure(op, interpolant(op, d, lo, hi), lo, hi, 0, x, fx)[0]

    # bracket with the depth-efficient degrees 2^k - 1, then the smallest degree inside
    prev, d = 0, 1
    while d <= max_degree and err(d) > target:
        prev, d = d, 2 * d + 1
    if d > max_degree:
        d = max_degree
        if err(d) > target:
            if best_effort:
                return _make(op, lo, hi, d, interpolant(op, d, lo, hi), 0)
            raise ValueError(f"{op} on [{lo}, {hi}]: no degree <= {max_degree} reaches {target:g}")
    for k in range(prev + 1, d + 1):
        if err(k) <= target:
            return _make(op, lo, hi, k, interpolant(op, k, lo, hi), 0)
    return _make(op, lo, hi, d, interpolant(op, d, lo, hi), 0)  # pragma: no cover (d met it)


def _newton_search(op: str, lo: float, hi: float, target: float) -> Approx:
    x = grid(lo, hi)
    fx = FUNCS[op](x)
    best = None
    for d in NEWTON_DEGREES:
        c = inv_initial(d, lo, hi) if op == "inv" else rsqrt_initial(d, lo, hi)
        for steps in range(MAX_NEWTON + 1):
            depth = chebyshev_levels(d, (lo, hi)) + steps * NEWTON_LEVELS[op]
            if best is not None and depth >= best[0]:
                break
            rel = measure(op, c, lo, hi, steps, x, fx)[1]
            if rel <= target:
                best = (depth, d, c, steps)
                break
    if best is None:
        raise ValueError(f"{op} on [{lo}, {hi}]: no degree in {NEWTON_DEGREES} with <= {MAX_NEWTON} Newton steps "
                         f"reaches relative error {target:g}")
    _, d, c, steps = best
    return _make(op, lo, hi, d, c, steps)


#: The fhe mode's default ranges and targets before calibration (`cipherlm.fhe.calibrate`
#: measures a model's own): op -> (lo, hi, target_error).  Activations and exp: absolute
#: error; inv (softmax sums: >= 1 after max subtraction, <= the key count) and rsqrt
#: (norm variances): relative error.
DEFAULT_RANGES = {
    "gelu": (-16.0, 16.0, 1e-3),
    "silu": (-16.0, 16.0, 1e-3),
    "tanh": (-8.0, 8.0, 1e-3),
    "exp": (-16.0, 0.0, 1e-4),
    "inv": (1.0, 1024.0, 1e-3),
    "rsqrt": (1e-2, 1e3, 1e-3),
}


def default_approximations(ranges: dict | None = None, ops=OPS) -> dict[str, Approx]:
    """op -> `Approx` for `DEFAULT_RANGES` (entries of `ranges`, op -> (lo, hi, target),
    replace them), for the operators `ops`."""
    r = dict(DEFAULT_RANGES)
    r.update(ranges or {})
    return {op: approximation(op, *r[op]) for op in ops}


def table(approxes) -> str:
    """Rows op / range / degree / Newton steps / depth / errors."""
    return "\n".join("  " + a.row() for a in (approxes.values() if isinstance(approxes, dict) else approxes))

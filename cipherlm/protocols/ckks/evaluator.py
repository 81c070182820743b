"""Encrypted tensors and the CKKS evaluator of the fhe mode: levels, bootstrapping,
slot-wise arithmetic, rotations and polynomial approximations.

AEGIS section 2.1 (CKKS: every product consumes a level, rescaling after it) and 2.4
(nonlinear functions by polynomial approximation; bootstrapping replenishes the modulus
chain).  A `CkksTensor` is a (T, d) activation in the token-group layout of
`packing.TokenPacking`, with a public ``bound`` on |value| (from calibration).

Level management is lazy and greedy, as `compile.passes.fhe_levels` plans it: every
operation asks `refresh(t, levels)` for the levels it is about to consume, and only when
the tensor has fewer is it bootstrapped.  Bootstrapping needs |message| <= 1 (Lattigo's
EvalMod; docs/he_backend.md), so a tensor of bound B > 1 is first read as message / 2^k
with 2^k >= B (`scale_message_inplace`: scale metadata, no level) and multiplied back by
the integer 2^k afterwards (no level).  With a ``refresher`` the ciphertexts go to it
instead (the client-aided refresh, `refresh.ClientRefresher`): it needs no message bound,
but a ciphertext is refreshed from level `refresh.MIN_LEVEL` or above (room for the mask),
so that path keeps that many levels unused (`floor`).

Counters (``stats``): rotations, ct x ct and ct x pt products, rescales, bootstraps,
polynomial evaluations, and seconds per kind.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from cipherlm.he.errors import HEError

from .packing import TokenPacking
from .refresh import MIN_LEVEL


@dataclass
class CkksTensor:
    """A (T, d) activation: ciphertexts of `packing` (one per block of cpc channels)."""

    cts: list
    d: int
    packing: TokenPacking
    bound: float = 1.0
    #: the one position that carries a result (the heads), or None: every real position
    position: int | None = None

    @property
    def level(self) -> int:
        return min(c.level for c in self.cts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packing.tokens, self.d)

    def with_cts(self, cts, d: int | None = None, bound: float | None = None) -> "CkksTensor":
        return CkksTensor(list(cts), self.d if d is None else d, self.packing,
                          self.bound if bound is None else float(bound), self.position)


@dataclass
class EvalStats:
    counts: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    #: (label, level before) of every bootstrap (or client refresh)
    refreshes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"counts": dict(self.counts), "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "refreshes": len(self.refreshes)}


#: the largest bound a level-0 ciphertext may carry into bootstrapping (read as message / f
#: through its scale metadata; Lattigo's bootstrapping checks that q0 / scale leaves room for
#: its message ratio, which at the test preset allows 2^6).  Above it, an operation keeps one
#: level in reserve (`CkksEvaluator.reserve`) so the division is a rescaled product instead.
LEVEL0_MAX_FACTOR = 32.0
#: at most this many plaintexts kept by `CkksEvaluator.mul_plain_ct` (~1.5-2.5 MB each at
#: N = 16384-32768 and a BLB block's levels)
PLAINTEXT_CACHE = 128


def pow2_at_least(x: float) -> float:
    """The smallest power of two >= x (>= 1)."""
    return float(2.0 ** max(0, math.ceil(math.log2(max(float(x), 1.0)))))


class CkksEvaluator:
    """The server's CKKS operations over `CkksTensor`s (a Lattigo backend and context,
    evaluation keys with the relinearisation key and every rotation the plan needs,
    bootstrapping keys or a client refresher).

    Refresh by bootstrapping (``bootstrap_keys``) or, given ``refresher``, by the callable
    ``refresher(list of ciphertexts, bound) -> list of ciphertexts at the top level``
    (the client-aided refresh, `refresh.ClientRefresher`)."""

    def __init__(self, backend, ctx, eval_keys, bootstrap_keys=None, refresher: Callable | None = None, *,
                 levels_only: bool = False):
        self.be, self.ctx, self.keys = backend, ctx, eval_keys
        self.bootstrap_keys = bootstrap_keys
        self.refresher = refresher
        #: ``levels_only``: no refresh at all (a BLB block sized by its depth, `runtime.blb_block`):
        #: an operation that would need one raises HEError
        self.levels_only = bool(levels_only)
        if levels_only and (bootstrap_keys is not None or refresher is not None):
            raise HEError("a levels-only evaluator takes no bootstrapping keys or refresher")
        if bootstrap_keys is None and refresher is None and not levels_only:
            raise HEError("the fhe evaluator needs bootstrapping keys or a client refresher")
        if bootstrap_keys is not None and refresher is not None:
            raise HEError("the fhe evaluator refreshes by bootstrapping or by the client, not both")
        self.top = bootstrap_keys.output_level if bootstrap_keys is not None else ctx.max_level
        #: levels never consumed: a client refresh masks at refresh.MIN_LEVEL or above
        self.floor = 0 if refresher is None else MIN_LEVEL
        #: "bootstrap", "client" or "none" (levels only)
        self.refresh_path = "none" if levels_only else ("bootstrap" if refresher is None else "client")
        self.stats = EvalStats()
        self._count_lock = threading.Lock()
        self._prime_bits = [math.log2(q) for q in ctx.q_moduli]
        #: encoded plaintexts kept by `mul_plain_ct`'s ``cache_key`` (with the level), at most
        #: `PLAINTEXT_CACHE` of them; a full cache is emptied (masks of one product reused
        #: across its ciphertexts, not across the model)
        self._plaintexts: dict = {}
        self.plaintext_hits = 0
        self._can_rotate: dict = {}

    # ---- bookkeeping

    def _count(self, kind: str, n: int = 1) -> None:
        with self._count_lock:  # operations may run on several threads (`blb_matmul.fused_matmul`'s pool)
            self.stats.counts[kind] += n

    class _Timer:
        def __init__(self, ev, kind):
            self.ev, self.kind = ev, kind

        def __enter__(self):
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            self.ev.stats.seconds[self.kind] += time.perf_counter() - self.t0

    def timer(self, kind: str):
        return self._Timer(self, kind)

    # ---- plaintexts

    def encode(self, values, level: int, scale_bits: float | None = None):
        """Slot values at `level`; scale 2^scale_bits (default: the level's last prime, so a
        product followed by `rescale` keeps the ciphertext's scale)."""
        sb = self._prime_bits[level] if scale_bits is None else scale_bits
        return self.be.encode_slots(self.ctx, np.asarray(values, np.float64), level=level, scale_bits=sb)

    # ---- levels

    def drop_to(self, ct, level: int):
        if ct.level > level:
            self.be.mod_switch_to_inplace(self.ctx, ct, level)
        return ct

    def copy(self, ct):
        out = self.be.multiply_scalar(self.ctx, ct, 1)  # an integer product at scale 1: a copy
        return out

    def reserve(self, bound: float) -> int:
        """Levels an operation whose result has this bound leaves unused (bootstrapping: 1
        above `LEVEL0_MAX_FACTOR`, the result's bootstrapping divides it by a rescaled
        product; the client refresh masks any bound and needs none beyond `floor`)."""
        return 1 if self.refresher is None and pow2_at_least(bound) > LEVEL0_MAX_FACTOR else 0

    def refresh(self, t: CkksTensor, levels: int, label: str = "", factor: float = 1.0) -> CkksTensor:
        """`t` with at least `levels` levels left: unchanged when it has them, else every
        ciphertext bootstrapped (or refreshed by the client) to the top level.  ``factor``
        (client refresh only; 1 otherwise): the values multiplied by it for free
        (`refresh.ClientRefresher`); a factor other than 1 always refreshes."""
        if levels + self.floor > self.top:
            raise HEError(f"{label or 'an operation'} needs {levels} levels; a refreshed ciphertext has "
                          f"{self.top - self.floor}: split it (approximation too deep)")
        if t.level >= levels + self.floor and factor == 1.0:
            return t
        if self.levels_only:
            raise HEError(f"{label or 'an operation'} needs {levels} levels, {t.level} left, and this evaluator "
                          "does not refresh")
        f = pow2_at_least(t.bound)
        with self.timer("bootstrap" if self.refresher is None else "client_refresh"):
            self.stats.refreshes.append((label, t.level))
            if self.refresher is not None:
                if t.level < self.floor:
                    raise HEError(f"{label or 'a value'} at level {t.level}: a client refresh needs level "
                                  f">= {self.floor} (an operation consumed levels it did not ask for)")
                cts = self.refresher(t.cts, t.bound, factor)
                self._count("client_refresh", len(t.cts))
            else:
                if factor != 1.0:
                    raise HEError("only the client refresh folds a factor in")
                cts = []
                for ct in t.cts:
                    if f > 1 and ct.level >= 1:
                        c = self.mul_scalar_ct(ct, 1.0 / f)
                    elif f > LEVEL0_MAX_FACTOR:
                        raise HEError(f"{label or 'a value'}: bound {t.bound:g} at level 0 is too large to "
                                      "bootstrap (the operation before it should have kept a level: reserve())")
                    else:
                        c = self.copy(ct)
                        if f > 1:
                            self.be.scale_message_inplace(self.ctx, c, f)
                    r = self.be.bootstrap(self.ctx, c, self.bootstrap_keys)
                    if f > 1:
                        r = self.be.multiply_scalar(self.ctx, r, int(f))
                    cts.append(r)
                self._count("bootstrap", len(t.cts))
        return t.with_cts(cts, bound=t.bound * abs(factor))

    def refit(self, t: CkksTensor, levels: int, label: str = "") -> CkksTensor:
        """`refresh(t, levels)`, then every ciphertext dropped to exactly ``levels`` above the
        floor: for an operation whose output's reader refreshes anyway (the attention's
        products), so that it runs at the fewest primes (faster key switches) instead of at the
        level a refresh or an earlier operation happened to leave."""
        t = self.refresh(t, levels, label)
        want = levels + self.floor
        if all(c.level <= want for c in t.cts):
            return t
        return t.with_cts([self.lowered(c, want) for c in t.cts])

    def needs_refresh(self, t: CkksTensor, levels: int) -> bool:
        """Whether `refresh(t, levels)` would refresh."""
        return t.level < levels + self.floor

    # ---- slot-wise arithmetic (each returns new ciphertexts)

    def rescale(self, ct):
        self.be.rescale_inplace(self.ctx, ct)
        self._count("rescale")
        return ct

    def lowered(self, ct, level: int):
        """``ct`` itself at ``level``, else a copy dropped to it."""
        return ct if ct.level <= level else self.drop_to(self.copy(ct), level)

    def add_ct(self, a, b):
        """a + b for two ciphertexts (the higher one dropped to the lower level)."""
        lvl = min(a.level, b.level)
        out = self.drop_to(self.copy(a), lvl)
        self.be.add_inplace(self.ctx, out, self.lowered(b, lvl))
        return out

    def sub_ct(self, a, b):
        lvl = min(a.level, b.level)
        out = self.drop_to(self.copy(a), lvl)
        if b.level > lvl:
            b = self.drop_to(self.copy(b), lvl)
        self.be.sub_inplace(self.ctx, out, b)
        return out

    def add(self, a: CkksTensor, b: CkksTensor, bound: float | None = None) -> CkksTensor:
        """a + b; when the sum's bound needs a reserve level (`reserve`) that the operands,
        of smaller bounds, did not keep, they are refreshed first."""
        if a.d != b.d or a.packing != b.packing:
            raise HEError(f"cannot add tensors of {a.d} and {b.d} channels / other layouts")
        bound = a.bound + b.bound if bound is None else bound
        keep = self.reserve(bound)
        a, b = self.refresh(a, keep, "add"), self.refresh(b, keep, "add")
        return a.with_cts([self.add_ct(x, y) for x, y in zip(a.cts, b.cts)], bound=bound)

    def mul_ct(self, a, b):
        """a * b (ciphertexts), relinearised and rescaled: one level."""
        lvl = min(a.level, b.level)
        if lvl < 1:
            raise HEError("a product at level 0: refresh first")
        out = self.be.multiply(self.ctx, self.lowered(a, lvl), self.lowered(b, lvl), self.keys)
        self._count("mul")
        return self.rescale(out)

    def dot_ct(self, xs, ys):
        """sum_i xs[i] * ys[i] (ciphertexts), relinearised once and rescaled once: one level (the
        degree-2 products summed before the key switch: the backend's ``multiply_sum``).  Needs
        every product at one scale."""
        xs, ys = list(xs), list(ys)
        lvl = min(c.level for c in xs + ys)
        if lvl < 1:
            raise HEError("a product at level 0: refresh first")
        out = self.be.multiply_sum(self.ctx, [self.lowered(c, lvl) for c in xs], [self.lowered(c, lvl) for c in ys],
                                   self.keys)
        self._count("mul", len(xs))
        return self.rescale(out)

    def mul_plain_ct(self, ct, values, cache_key=None):
        """ct * values (a slot vector, encoded at the ciphertext's level), rescaled: one level.
        ``cache_key`` (hashable, naming the values): the encoded plaintext is kept for the next
        product with the same key at the same level, and ``values`` may be a callable that
        makes the vector, called only when the plaintext is not kept."""
        if cache_key is None:
            pt = self.encode(values, ct.level)
        else:
            key = (cache_key, ct.level)
            pt = self._plaintexts.get(key)
            if pt is None:
                if len(self._plaintexts) >= PLAINTEXT_CACHE:
                    self._plaintexts.clear()
                pt = self._plaintexts[key] = self.encode(values() if callable(values) else values, ct.level)
            else:
                self.plaintext_hits += 1
        out = self.be.multiply_plain(self.ctx, ct, pt)
        self._count("mul_plain")
        return self.rescale(out)

    def mul_scalar_ct(self, ct, c: float):
        """ct * c: an integer costs no level, any other constant one (rescaled)."""
        if float(c) == int(c) and abs(c) < 2**30:
            return self.be.multiply_scalar(self.ctx, ct, int(c))
        out = self.be.multiply_scalar(self.ctx, ct, float(c))
        self._count("mul_scalar")
        return self.rescale(out)

    def add_plain_ct(self, ct, values):
        """ct + values (encoded at the ciphertext's level and scale)."""
        out = self.copy(ct)
        self.be.add_plain_inplace(self.ctx, out, self.encode(values, ct.level, scale_bits=ct.scale_bits))
        return out

    def add_scalar_ct(self, ct, c: float):
        out = self.copy(ct)
        self.be.add_scalar_inplace(self.ctx, out, float(c))
        return out

    # ---- rotations

    def rot(self, ct, step: int):
        """Slots rotated left by `step` (0: the ciphertext itself)."""
        step = int(step) % self.ctx.slots
        if step == 0:
            return ct
        self._count("rotate")
        return self.be.rotate_rows(self.ctx, ct, step, self.keys)

    def can_rotate(self, steps) -> bool:
        """Whether the evaluation keys hold every slot rotation of ``steps`` (a key set that
        cannot say is taken to hold none)."""
        want = tuple(sorted({int(s) % self.ctx.slots for s in steps} - {0}))
        if want not in self._can_rotate:
            has = getattr(self.keys, "has_steps", None)
            self._can_rotate[want] = bool(has is not None and has(list(want)))
        return self._can_rotate[want]

    def rot_many(self, ct, steps: Sequence[int]) -> list:
        """Rotations of one ciphertext by each step, hoisted (one key-switch decomposition)."""
        steps = [int(s) % self.ctx.slots for s in steps]
        nz = sorted({s for s in steps if s})
        got = dict(zip(nz, self.be.rotate_hoisted(self.ctx, ct, nz, self.keys))) if nz else {}
        self._count("rotate", len(nz))
        return [ct if s == 0 else got[s] for s in steps]

    def window_sum(self, ct, width: int, unit: int, backward: bool = False):
        """Slot i <- sum_{k < width} slot (i + k*unit) (``backward``: i - k*unit), by log2(width)
        rotate-and-adds (width a power of two)."""
        if width & (width - 1):
            raise HEError(f"window width {width} is not a power of two")
        acc, span = ct, 1
        while span < width:
            acc = self.add_ct(acc, self.rot(acc, (-1 if backward else 1) * span * unit))
            span *= 2
        return acc

    def channel_sum(self, t: CkksTensor):
        """One ciphertext holding, at every channel slot of position p, the sum over the d
        channels at p (padding channels are 0)."""
        acc = t.cts[0]
        for c in t.cts[1:]:
            acc = self.add_ct(acc, c)
        return self.window_sum(acc, t.packing.cpc, t.packing.tp)

    # ---- polynomial approximations (cipherlm.fhe.approx.Approx)

    def poly(self, t: CkksTensor, approx, label: str = "", bound: float | None = None) -> CkksTensor:
        """approx(t) slot-wise: the Chebyshev series on [approx.lo, approx.hi], then its Newton
        steps (inv: y(2 - xy), 2 levels; rsqrt: y(3 - xy^2)/2, 3 levels).  Refreshes before each
        stage that would run out of levels.  ``bound``: of the result (default: max |approx| on
        its interval)."""
        lo, hi = float(approx.lo), float(approx.hi)
        if bound is None:
            g = np.linspace(lo, hi, 2001)
            bound = float(np.max(np.abs(approx(g))))
        keep = self.reserve(bound)  # every stage's output has about this bound
        interval = (lo, hi)
        if self.refresher is not None and (lo, hi) != (-1.0, 1.0) and self.needs_refresh(t, approx.poly_depth + keep):
            # a client refresh multiplies by 2 / (hi - lo) for free: the change of variable to
            # [-1, 1] then costs no level (the series' coefficients are those of that variable)
            u = self.refresh(t, approx.poly_depth - 1 + keep, f"{label}.poly", factor=2.0 / (hi - lo))
            shift = -(lo + hi) / (hi - lo)
            u = u.with_cts([self.add_scalar_ct(c, shift) if shift else c for c in u.cts], bound=1.0)
            interval = (-1.0, 1.0)
            x = t
        else:
            x = u = self.refresh(t, approx.poly_depth + keep, f"{label}.poly")
        with self.timer("poly"):
            y = [self.be.evaluate_chebyshev(self.ctx, c, approx.coeffs, interval, self.keys) for c in u.cts]
        self._count("poly", len(y))
        y = x.with_cts(y, bound=bound)
        for i in range(approx.newton_steps):
            need = (2 if approx.op == "inv" else 3) + keep
            y = self.refresh(y, need, f"{label}.newton{i + 1}")
            x = self.refresh(x, need, f"{label}.newton{i + 1}")
            y = y.with_cts([self._newton(approx.op, xc, yc) for xc, yc in zip(x.cts, y.cts)])
        return y

    def _newton(self, op: str, x, y):
        if op == "inv":  # y (2 - x y)
            e = self.mul_ct(x, y)
            e = self.mul_scalar_ct(e, -1)
            e = self.add_scalar_ct(e, 2.0)
            return self.mul_ct(y, e)
        if op == "rsqrt":  # (y / 2) (3 - x y^2)
            y2 = self.mul_ct(y, y)
            e = self.mul_scalar_ct(self.mul_ct(x, y2), -1)
            e = self.add_scalar_ct(e, 3.0)
            return self.mul_ct(self.mul_scalar_ct(y, 0.5), e)
        raise HEError(f"no Newton iteration for {op!r}")

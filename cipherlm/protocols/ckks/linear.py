"""ct x pt matrix products of the fhe mode: Y = X W^T + b on token-group packed X
(AEGIS section 2.3, "the weights are pre-encoded plaintexts"; the diagonal method of
Halevi-Shoup with baby-step giant-step, as in NEXUS / AEGIS's per-worker kernels).

In the layout of `packing.TokenPacking` a slot rotation by k * tp moves every channel by
k and leaves positions alone, so one matrix-vector product over the cpc channels of a
ciphertext applies the same matrix to all T tokens at once.  For output block o and
input block i, M = W[o-block, i-block] (cpc x cpc, zero-padded) has diagonals

    diag_k[c * tp + t] = M[c, (c + k) mod cpc] * mask[t],   k = 0..cpc-1,

and Y_o = sum_i sum_k diag_k * rot(X_i, k tp).  With k = j g + b (g baby steps):

    Y_o = sum_j rot( sum_i sum_b rot(diag_{jg+b}, -j g tp) * rot(X_i, b tp), j g tp ),

the g - 1 baby rotations of each input ciphertext are hoisted (one decomposition) and
shared by every output block, each (output block, j) costs one giant rotation, and
one rescale per output block: one level.  All-zero diagonals are skipped.  ``mask``
keeps padding positions at 0 (the bias is added on real positions only); the pooled
heads pass a mask of position 0 alone, so the client's output holds nothing else.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from cipherlm.he.errors import HEError

from .evaluator import CkksEvaluator, CkksTensor
from .packing import TokenPacking


#: goroutines of the native projection (this project's machines have 2 cores)
NATIVE_WORKERS = 2


def baby_steps(cpc: int) -> int:
    """g: the power of two nearest sqrt(cpc) from above."""
    return 1 << math.ceil(math.log2(max(cpc, 1)) / 2)


def rotation_steps(packing: TokenPacking) -> set[int]:
    """The slot rotations `EncodedLinear` uses for this packing (baby and giant steps)."""
    cpc, tp = packing.cpc, packing.tp
    g = min(baby_steps(cpc), cpc)
    return {b * tp for b in range(1, g)} | {j * g * tp for j in range(1, -(-cpc // g))}


class EncodedLinear:
    """W (d_out, d_in), b (d_out,) or None, for one packing; plaintext diagonals are encoded
    on first use at the level the input arrives at, and kept (``cache``) per level."""

    def __init__(self, w: np.ndarray, b: np.ndarray | None, packing: TokenPacking, *,
                 positions: np.ndarray | None = None, cache: bool = True):
        w = np.asarray(w, np.float64)
        if w.ndim != 2:
            raise HEError(f"expected a (d_out, d_in) matrix, got {w.shape}")
        self.d_out, self.d_in = w.shape
        self.packing = packing
        self.b = None if b is None else np.asarray(b, np.float64).reshape(-1)
        cpc, tp = packing.cpc, packing.tp
        self.g = min(baby_steps(cpc), cpc)
        self.n_giant = -(-cpc // self.g)
        mask = packing.token_mask() if positions is None else np.asarray(positions, np.float64)
        self.mask = mask
        no, ni = packing.n_cts(self.d_out), packing.n_cts(self.d_in)
        wp = np.zeros((no * cpc, ni * cpc))
        wp[: self.d_out, : self.d_in] = w
        self._wp = wp
        self.n_out, self.n_in = no, ni
        self.cache = cache
        #: evaluate in one native call where the backend has one (`_native`); False: the
        #: per-diagonal reference path below (tests compare the two)
        self.native = True
        self._pts: dict[tuple[int, int, int, int], object] = {}

    @functools.cached_property
    def _diag(self) -> set[tuple[int, int, int]]:
        """The (o, i, k) of the diagonals that are not all zero (the reference path's; the
        native one finds them itself).  Their slot vectors (`_diagonal`) are made when
        encoded, not kept: at 2^15 slots they would be GBs for a model."""
        cpc = self.packing.cpc
        rows = np.arange(cpc)
        out = set()
        for o in range(self.n_out):
            for i in range(self.n_in):
                blk = self._wp[o * cpc:(o + 1) * cpc, i * cpc:(i + 1) * cpc]
                if not blk.any():
                    continue
                for k in range(cpc):
                    if blk[rows, (rows + k) % cpc].any():
                        out.add((o, i, k))
        return out

    @property
    def n_diagonals(self) -> int:
        return len(self._diag)

    def _diagonal(self, key) -> np.ndarray:
        """Diagonal k of block (o, i) as a slot vector, pre-rotated for its giant step."""
        o, i, k = key
        cpc, tp = self.packing.cpc, self.packing.tp
        rows = np.arange(cpc)
        dk = self._wp[o * cpc + rows, i * cpc + (rows + k) % cpc]
        vec = (dk[:, None] * self.mask[None, :]).reshape(-1)
        return np.roll(vec, (k // self.g) * self.g * tp)

    def _pt(self, ev: CkksEvaluator, key, level: int):
        k = key + (level,)
        pt = self._pts.get(k)
        if pt is None:
            pt = ev.encode(self._diagonal(key), level)
            if self.cache:
                self._pts[k] = pt
        return pt

    def __call__(self, ev: CkksEvaluator, x: CkksTensor, bound: float = 1.0, label: str = "linear",
                 out_level: int | None = None) -> CkksTensor:
        """Y = X W^T + b.  ``out_level``: the highest output level the caller can use (0: the
        client decrypts it; the other operand's level for a residual add); the input is
        dropped (modulus switching, free) to what that needs, at least the one level this
        product consumes, so the diagonals are encoded and multiplied at fewer primes."""
        if x.d != self.d_in or x.packing != self.packing:
            raise HEError(f"{label}: input of {x.d} channels, expected {self.d_in} in this layout")
        need = 1 + ev.reserve(bound)
        x = ev.refresh(x, need, label)
        tp, g = self.packing.tp, self.g
        lvl = x.level
        if out_level is not None:
            lvl = min(lvl, max(out_level + 1, need + ev.floor))
        cts = [ev.drop_to(ev.copy(c), lvl) if c.level > lvl else c for c in x.cts]
        if self.native and hasattr(ev.be, "token_group_linear"):
            return self._native(ev, cts, bound)
        with ev.timer("linear"):
            baby = [ev.rot_many(c, [b * tp for b in range(g)]) for c in cts]
            outs = []
            for o in range(self.n_out):
                acc_o = None
                for j in range(self.n_giant):
                    acc_j = None
                    for i in range(self.n_in):
                        for b in range(g):
                            key = (o, i, j * g + b)
                            if key not in self._diag:
                                continue
                            p = ev.be.multiply_plain(ev.ctx, baby[i][b], self._pt(ev, key, lvl))
                            ev._count("mul_plain")
                            if acc_j is None:
                                acc_j = p
                            else:
                                ev.be.add_inplace(ev.ctx, acc_j, p)
                    if acc_j is None:
                        continue
                    acc_j = ev.rot(acc_j, j * g * tp)
                    if acc_o is None:
                        acc_o = acc_j
                    else:
                        ev.be.add_inplace(ev.ctx, acc_o, acc_j)
                outs.append(self._finish(ev, o, None if acc_o is None else ev.rescale(acc_o), cts[0]))
        return CkksTensor(outs, self.d_out, self.packing, bound)

    def _finish(self, ev: CkksEvaluator, o: int, acc, x0):
        """Output block o from its rescaled sum (None: an all-zero block, an encryption of 0
        made from the input ciphertext x0), plus the bias on the real positions."""
        if acc is None:
            acc = ev.rescale(ev.be.multiply_plain(ev.ctx, x0, ev.encode(np.zeros(ev.ctx.slots), x0.level)))
        if self.b is not None:
            acc = ev.add_plain_ct(acc, self._bias_vector(o))
        return acc

    def _native(self, ev: CkksEvaluator, cts: list, bound: float) -> CkksTensor:
        """The same product in one backend call (`LattigoBackend.token_group_linear`: the
        diagonals made and encoded natively, on both cores; nothing cached)."""
        with ev.timer("linear"):
            outs, counts = ev.be.token_group_linear(ev.ctx, cts, self._wp, self.mask, tp=self.packing.tp, g=self.g,
                                                    keys=ev.keys, workers=NATIVE_WORKERS)
            for k, n in counts.items():
                ev._count(k, n)
            res = [self._finish(ev, o, acc, cts[0]) for o, acc in enumerate(outs)]
        return CkksTensor(res, self.d_out, self.packing, bound)

    def _bias_vector(self, o: int) -> np.ndarray:
        cpc, tp = self.packing.cpc, self.packing.tp
        cols = np.zeros(self.n_out * cpc)
        cols[: self.d_out] = self.b
        return (cols[o * cpc:(o + 1) * cpc, None] * self.mask[None, :tp]).reshape(-1)

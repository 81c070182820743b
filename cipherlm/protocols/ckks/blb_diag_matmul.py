"""BLB's diagonal ciphertext-plaintext MatMul for the output projection (BLB Appendix C.2).

What it computes.  The fused P V of `blb_matmul` (section 5.2) leaves X_h = P_h V_h (n x d_h,
H heads) in multi-head *diagonal* packing, padded to n x n (columns d_h..n-1 are zero): in
output ciphertext q, segment sigma' = g H + h (n slots, g < c groups) holds diagonal
delta = q c + g of head h, slot t = X_h[t, (t + delta) mod n].  The output projection is

    O = concat_h(X_h) W,   W (H d_h x D) in the clear on the server (row h d_h + i: head h,
                           feature i, the concatenation order of multi-head attention),

and the next block wants O in *spatial-first* packing: output ciphertext m holds columns
j = m s + sigma (sigma < s = floor(S / n)) as segments of n consecutive slots, O[t, j] at
slot sigma n + t.  Appendix C.2: "the j-th column of O can be represented as a combination of
diagonals in X, multiplied by the elements of the j-th column in W": with
w_(h, delta, j)[t] = W[h d_h + (t + delta) mod n, j] when (t + delta) mod n < d_h, else 0,

    O[:, j] = sum_(h, delta) D_(h, delta) * w_(h, delta, j)            (D: the diagonals).

The paper adjusts W "to a duplicated spatial-first packing", then rotates and multiplies: the
diagonal (Halevi-Shoup) method over whole segments.  Input segment sigma' reaches output
segment sigma by a rotation of (sigma' - sigma) n slots, so for every offset u of the segment
shift, one ct-pt product of the input ciphertext rotated by u n with the plaintext W_(q, m, u)
holding w_(h, delta, j) at the segments that shift brings together:

    out_m = sum_q sum_u rot(X_q, u n) * W_(q, m, u).

Offsets: when n divides S (s_v = S / n segments, the usual case) the slot rotation is cyclic
over the segments and u runs over Z_(s_v) (u = sigma' - sigma mod s_v: shifts that coincide
mod S are one product); otherwise u = sigma' - sigma + (s - 1) >= 0 and the rotation is by
(u - (s - 1)) n.

BSGS (Appendix C.2: "this step can also utilize BSGS"; the BSGS of Appendix C.1 for plaintext
accumulation): u = b + beta G; the beta - 1 baby rotations of every input ciphertext are
hoisted, each plaintext is pre-rotated (free: it is in the clear) so that

    out_m = sum_G rot( sum_q sum_b rot(X_q, b n) * roll(W_(q, m, b + beta G), K_G),  K_G ),
    K_G = (beta G + base) n   (base = 0 cyclic, -(s - 1) otherwise),

one giant rotation per (m, G) with K_G != 0 mod S.  `best_baby` picks beta by minimising the
rotations.

Dense diagonals (Figure 15 (b): "if zero padding is exactly doubled, we can add adjacent
ciphertexts of X to obtain the output in a dense diagonal packing"): with n = r d_h and c | d_h,
input ciphertexts q and q + k d_h / c (k < r) hold the diagonals delta + k d_h, and exactly one
of them is nonzero at each position t (the one with (t + delta + k d_h) mod n < d_h, of column
((t + delta) mod n) mod d_h), so their sum is dense: (r - 1) d_h / c ciphertext additions, and
r times fewer input ciphertexts (J_in = d_h / c) and products.  The default where it applies.

Cost (`counts`, exact for this implementation; J_in = n / c input ciphertexts (d_h / c dense),
M = ceil(D / s) output ciphertexts, U the offsets with a non-empty segment pair):

* rotations = J_in |{b n mod S != 0}| + sum_m |{K_G mod S != 0}|;
* ct-pt     = J_in sum_m |U_m| (one per input ciphertext, output ciphertext and offset);
* rescales  = ct-pt; depth 1.  No ct-ct product, no mask beyond the weights: the padding
  columns of X meet zero weights, so "the padding is inherently handled in the ciphertext
  domain" (C.2).

Against BOLT's ct-pt MatMul (spatial-first input of H d_h columns, s per ciphertext: H d_h / s
input ciphertexts): dense, the input has H d_h columns' worth of segments too, c H per
ciphertext instead of s, so the products are BOLT's times s / (c H) (4/3 at BERT-base, S = 8192:
c H = 48 of 64 segments used); without the folding (n not a multiple of d_h) they grow by n / d_h
more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .blb_matmul import MHLayout
from .evaluator import CkksEvaluator

__all__ = [
    "DiagLayout",
    "best_baby",
    "counts",
    "can_densify",
    "make_diag_layout",
    "outproj",
    "plaintexts",
    "rotation_steps",
    "unpack_spatial",
]


@dataclass(frozen=True)
class DiagLayout:
    """The output projection of H heads' diagonal-packed n x n outputs (P V's `MHLayout`
    ``pv``, of which the first ``head_dim`` columns are real) to D = ``cols`` columns, s =
    ``per_ct`` columns per output ciphertext."""

    pv: MHLayout
    head_dim: int
    cols: int
    per_ct: int
    #: Figure 15 (b): with n = r d_h (r >= 2, the zero padding of P V) and c | d_h, the r
    #: ciphertexts q + k d_h / c (k < r) hold the diagonals delta + k d_h, whose supports
    #: ((t + delta) mod n < d_h) split the n positions: their sum is a dense diagonal packing
    #: (ciphertext additions only), r times fewer input ciphertexts and products
    dense: bool = False

    def __post_init__(self):
        L = self.pv
        if L.k != L.n:
            raise ValueError("the input must be P V's output (a square n x n product per head)")
        if not 1 <= self.head_dim <= L.n:
            raise ValueError(f"head dim {self.head_dim} not in 1..{L.n}")
        if not 1 <= self.per_ct <= L.slots // L.n:
            raise ValueError(f"{self.per_ct} columns of {L.n} tokens do not fit {L.slots} slots")
        if self.cols < 1:
            raise ValueError("no output columns")
        if self.dense and not can_densify(L, self.head_dim):
            raise ValueError(f"dense diagonals need n = r d_h (r >= 2) and c | d_h: n = {L.n}, "
                             f"d_h = {self.head_dim}, c = {L.groups}")

    @property
    def slots(self) -> int:
        return self.pv.slots

    @property
    def n(self) -> int:
        return self.pv.n

    @property
    def s_in(self) -> int:
        """Segments per input ciphertext (c H)."""
        return self.pv.groups * self.pv.heads

    @property
    def fold(self) -> int:
        """r: diagonal ciphertexts summed into one (1 without ``dense``)."""
        return self.n // self.head_dim if self.dense else 1

    @property
    def n_in(self) -> int:
        """Input ciphertexts after the dense folding (n / c, or d_h / c with ``dense``)."""
        return self.pv.n_out // self.fold

    @property
    def n_out(self) -> int:
        return -(-self.cols // self.per_ct)

    @property
    def cyclic(self) -> bool:
        return self.slots % self.n == 0

    @property
    def base(self) -> int:
        return 0 if self.cyclic else -(self.per_ct - 1)

    def out_cols(self, m: int) -> int:
        return min(self.per_ct, self.cols - m * self.per_ct)

    def offset(self, src: int, dst: int) -> int:
        """u for input segment ``src`` reaching output segment ``dst``."""
        d = src - dst
        return d % (self.slots // self.n) if self.cyclic else d - self.base

    def offsets(self, m: int) -> dict[int, list[tuple[int, int]]]:
        """u -> the (input segment, output segment) pairs it joins, for output ciphertext m."""
        out: dict[int, list[tuple[int, int]]] = {}
        for dst in range(self.out_cols(m)):
            for src in range(self.s_in):
                out.setdefault(self.offset(src, dst), []).append((src, dst))
        return out


def can_densify(pv: MHLayout, head_dim: int) -> bool:
    """Whether Figure 15 (b)'s dense diagonal packing applies: n = r d_h, r >= 2, c | d_h."""
    return pv.n % head_dim == 0 and pv.n // head_dim >= 2 and head_dim % pv.groups == 0


def make_diag_layout(pv: MHLayout, head_dim: int, cols: int, per_ct: int | None = None,
                     dense: bool | None = None) -> DiagLayout:
    """``per_ct`` defaults to floor(S / n) (every segment of an output ciphertext used);
    ``dense`` to whether it applies (`can_densify`)."""
    dense = can_densify(pv, head_dim) if dense is None else bool(dense)
    return DiagLayout(pv, int(head_dim), int(cols), int(pv.slots // pv.n if per_ct is None else per_ct), dense)


def unpack_spatial(vecs, layout: DiagLayout) -> np.ndarray:
    """Output slot vectors (M, S) in spatial-first packing -> O (n x D)."""
    L = layout
    v = np.asarray(vecs, np.float64)
    O = np.zeros((L.n, L.cols))
    for m in range(L.n_out):
        k = L.out_cols(m)
        O[:, m * L.per_ct: m * L.per_ct + k] = v[m, : k * L.n].reshape(k, L.n).T
    return O


# ------------------------------------------------------------------------------- schedule
def _schedule(L: DiagLayout, beta: int) -> list[dict[int, set[int]]]:
    """Per output ciphertext: giant G -> the babies b with b + beta G an offset it uses."""
    out = []
    for m in range(L.n_out):
        s: dict[int, set[int]] = {}
        for u in L.offsets(m):
            s.setdefault(u // beta, set()).add(u % beta)
        out.append(s)
    return out


def _max_offset(L: DiagLayout) -> int:
    return max(max(L.offsets(m)) for m in range(L.n_out))


def _giant_step(L: DiagLayout, beta: int, G: int) -> int:
    return (beta * G + L.base) * L.n


def _counts(L: DiagLayout, beta: int) -> dict:
    S = L.slots
    sched = _schedule(L, beta)
    babies = {b for s in sched for bs in s.values() for b in bs}
    rot = L.n_in * len({(b * L.n) % S for b in babies} - {0})
    rot += sum(len({_giant_step(L, beta, G) % S for G in s} - {0}) for s in sched)
    pt = L.n_in * sum(len(L.offsets(m)) for m in range(L.n_out))
    return {"rotate": rot, "mul": 0, "mul_plain": pt, "rescale": pt, "depth": 1, "baby": beta,
            "giant": -(-(_max_offset(L) + 1) // beta), "in_cts": L.n_in, "out_cts": L.n_out}


def best_baby(L: DiagLayout) -> int:
    """The baby-step size beta with the fewest rotations (ties: the smaller beta)."""
    return min(range(1, _max_offset(L) + 2), key=lambda b: (_counts(L, b)["rotate"], b))


def _beta(L: DiagLayout, bsgs: bool, baby: int | None) -> int:
    if not bsgs:
        return _max_offset(L) + 1  # every offset a baby step: hoisted rotations of the inputs only
    beta = best_baby(L) if baby is None else int(baby)
    if beta < 1:
        raise ValueError(f"baby step {beta} < 1")
    return beta


def counts(layout: DiagLayout, bsgs: bool = True, baby: int | None = None) -> dict:
    """Predicted operations of `outproj`: ``rotate`` (hoisted ones counted one by one),
    ``mul_plain``, ``rescale`` (``mul`` = 0), ``depth``, ``baby`` / ``giant``, ``in_cts`` and
    ``out_cts``."""
    return _counts(layout, _beta(layout, bsgs, baby))


def rotation_steps(layout: DiagLayout, bsgs: bool = True, baby: int | None = None) -> set[int]:
    """Every slot rotation (left, in [1, S)) `outproj` uses: the Galois keys to generate."""
    L, S = layout, layout.slots
    beta = _beta(L, bsgs, baby)
    out = set()
    for s in _schedule(L, beta):
        for G, bs in s.items():
            out |= {(b * L.n) % S for b in bs} | {_giant_step(L, beta, G) % S}
    return out - {0}


# ------------------------------------------------------------------------------ plaintexts
def plaintexts(W, layout: DiagLayout, q: int, m: int) -> dict[int, np.ndarray]:
    """u -> W_(q, m, u) (S slots): at output segment sigma (column j = m s + sigma), slot t, the
    weight W[h d_h + (t + delta) mod n, j] of the input segment sigma' = g H + h (diagonal
    delta = q c + g of head h) that offset u brings there; 0 where that column is padding."""
    L, P = layout, layout.pv
    W = np.asarray(W, np.float64)
    if W.shape != (P.heads * L.head_dim, L.cols):
        raise ValueError(f"expected weights ({P.heads * L.head_dim}, {L.cols}), got {W.shape}")
    t = np.arange(L.n)
    out = {}
    for u, pairs in L.offsets(m).items():
        v = np.zeros(L.slots)
        for src, dst in pairs:
            g, h = divmod(src, P.heads)
            col = (t + q * P.groups + g) % L.n
            if L.dense:  # the diagonals delta + k d_h summed: column ((t + delta) mod n) mod d_h
                col = col % L.head_dim
            ok = col < L.head_dim
            seg = np.zeros(L.n)
            seg[ok] = W[h * L.head_dim + col[ok], m * L.per_ct + dst]
            v[dst * L.n: (dst + 1) * L.n] += seg
        out[u] = v
    return out


# -------------------------------------------------------------------------------- protocol
def _sum(ev: CkksEvaluator, cts: Sequence):
    acc = cts[0]
    for c in cts[1:]:
        acc = ev.add_ct(acc, c)
    return acc

def outproj(ev: CkksEvaluator, x_cts: Sequence, W, layout: DiagLayout, bsgs: bool = True,
            baby: int | None = None) -> list:
    """O = concat_h(X_h) W from P V's diagonal-packed ciphertexts ``x_cts`` (`blb_matmul.fused_av`'s
    output, n / c of them) and the server's weights W (H d_h x D): M ciphertexts in
    spatial-first packing (`unpack_spatial`).  ``bsgs``: baby-step giant-step over the segment
    offsets (``baby``: beta, default `best_baby`)."""
    L = layout
    if len(x_cts) != L.pv.n_out:
        raise ValueError(f"expected {L.pv.n_out} ciphertexts, got {len(x_cts)}")
    if L.fold > 1:  # Figure 15 (b): dense diagonal packing by additions
        x_cts = [_sum(ev, [x_cts[q + k * L.n_in] for k in range(L.fold)]) for q in range(L.n_in)]
    beta = _beta(L, bsgs, baby)
    sched = _schedule(L, beta)
    babies = sorted({b for s in sched for bs in s.values() for b in bs})
    rots = []
    for x in x_cts:  # baby steps, hoisted per input ciphertext
        r = ev.rot_many(x, [b * L.n for b in babies])
        rots.append(dict(zip(babies, r)))
    out = []
    for m, s in enumerate(sched):
        acc_m = None
        pts = [plaintexts(W, L, q, m) for q in range(L.n_in)]
        for G in sorted(s):
            K = _giant_step(L, beta, G)
            acc = None
            for q in range(L.n_in):
                for b in sorted(s[G]):
                    term = ev.mul_plain_ct(rots[q][b], np.roll(pts[q][b + beta * G], K % L.slots))
                    acc = term if acc is None else ev.add_ct(acc, term)
            acc = ev.rot(acc, K)
            acc_m = acc if acc_m is None else ev.add_ct(acc_m, acc)
        out.append(acc_m)
    return out

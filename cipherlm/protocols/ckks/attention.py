"""Attention on token-group packed ciphertexts: RoPE, Q.K^T, softmax and P.V, all on the
server with no client help (AEGIS section 2.3-2.4: ct x ct products for Q.K^T and .V,
softmax by polynomial approximation).

Scores are kept by **diagonals**: for a shift r the ciphertext S_r holds, at every channel
slot of head h and position p, the scaled score of the query at position p against the key
at position p + r of head h (replicated over the head's hd channels):

    S_r = replicate_h( sum_{c in head h} Q[c, p] * K[c, p + r] ) * scale,

for r from -(last query position) to (last key position - first query position); causal
models need only r <= 0.  Queries and keys are packed by absolute position
(`packing.TokenPacking.offset`), so a decoding step's queries meet the KV cache's keys,
which stay encrypted on the server (`runtime.fhe_executor.FheKVCache`).

`packing.TokenPacking` keeps tp >= 2T with zero padding positions, so a plain slot
rotation of K by r brings key t + r under query t, with zeros where t + r is out of
range: one hoisted rotation set of K (and of V) covers all shifts.  The per-head sum is
a rotate-and-add window over hd channels (log2 hd rotations), a plaintext product keeps
the head's first channel (with the 1/sqrt(hd) scale folded in), and a backward window
replicates it over the head (one level).

Softmax needs no encrypted maximum: with a calibrated bound S >= |score|, each row is
exp(s - S) summed over its valid shifts, then multiplied by an approximate inverse of the
sum (`cipherlm.fhe.approx`: exp on [L, 0], inv on the calibrated range of the sums).  A
public additive mask moves every invalid entry (out of range, causal, sliding window)
to about -14 - 2S below the valid ones (exp ~ 0 there), and makes padding rows attend to
themselves only (their V rows are 0, so their output stays 0 and their row sum is 1).

P.V is sum_r P_r * rot(V, r): one ct x ct product per shift.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cipherlm.he.errors import HEError

from .evaluator import CkksEvaluator, CkksTensor
from .packing import TokenPacking

#: how far below the valid entries the additive mask puts the invalid ones (e^-14 ~ 8e-7)
MASK_GAP = 14.0


@dataclass
class Scores:
    """Score diagonals: ``cts[r]`` (one list of channel-block ciphertexts per shift r)."""

    cts: dict
    packing: TokenPacking
    d: int
    bound: float
    #: the number of key positions (0..keys-1)
    keys: int = 0

    @property
    def level(self) -> int:
        return min(c.level for row in self.cts.values() for c in row)


def shifts(T: int, offset: int = 0, keys: int | None = None, causal: bool = False) -> list[int]:
    """The shifts r with a valid (query, key) pair: queries at offset..offset+T-1, keys at
    0..keys-1 (default offset + T); r <= 0 only when causal."""
    end = offset + T
    keys = end if keys is None else keys
    hi = 0 if causal else keys - 1 - offset
    return list(range(-(end - 1), hi + 1))


def rotation_steps(packing: TokenPacking, head_dim: int, rope_partners=()) -> set[int]:
    """Slot rotations the attention of this packing uses."""
    tp = packing.tp
    out = {r for r in shifts(packing.tokens) if r}
    k = 1
    while k < head_dim:
        out |= {k * tp, -k * tp}
        k *= 2
    for p in rope_partners:
        out |= {p * tp, -p * tp}
    return {s % packing.slots for s in out if s % packing.slots}


def _valid(packing: TokenPacking, keys: int, r: int, causal: bool, window: int | None) -> np.ndarray:
    """(T,) whether the query at position offset + t may see the key at that position + r."""
    t = np.arange(packing.offset, packing.end)
    k = t + r
    ok = (k >= 0) & (k < keys)
    if causal:
        ok &= k <= t
    if window is not None:
        ok &= (t - k) < window
    return ok


def softmax_mask(packing: TokenPacking, d: int, r: int, bound: float, causal: bool = False,
                 window: int | None = None, key_keep: np.ndarray | None = None, keys: int | None = None) -> np.ndarray:
    """(n_cts(d), slots) additive mask of shift r: -S on valid entries of the pass's rows, -S -
    gap - S on invalid ones, 0 at r = 0 of the other rows and of padding channels (they attend
    to themselves).  ``keys``: key positions 0..keys-1 (default: up to the pass's end)."""
    tp = packing.tp
    keys = packing.end if keys is None else keys
    invalid = -2.0 * bound - MASK_GAP
    ok = _valid(packing, keys, r, causal, window)
    if key_keep is not None:  # encoders: padding tokens of the batch's mask
        k = np.arange(packing.offset, packing.end) + r
        kk = np.zeros(k.size, bool)
        inr = (k >= 0) & (k < keys)
        kk[inr] = np.asarray(key_keep, bool)[k[inr]]
        ok &= kk
    row = np.full(tp, 0.0 if r == 0 else invalid)
    row[packing.offset:packing.end] = np.where(ok, -bound, invalid)
    grid = np.tile(row, (d, 1))
    out = packing.grid(grid, d)
    if r == 0:  # padding channels: 0 (attend to themselves)
        pass
    else:
        n = packing.n_cts(d)
        full = out.reshape(n * packing.cpc, tp)
        full[d:] = invalid
        out = full.reshape(n, packing.slots)
    return out


def exp_interval(bound: float) -> tuple[float, float]:
    """The interval exp must be accurate on for scores of bound S: [-3S - gap, 0]."""
    return (-3.0 * bound - MASK_GAP, 0.0)


def rope(ev: CkksEvaluator, x: CkksTensor, positions: np.ndarray, head_dim: int, theta: float,
         interleave: bool = False, label: str = "rope") -> CkksTensor:
    """Rotary embedding (rotate-half convention; ``interleave``: pairs (2j, 2j+1), which
    gives the plain executor's halves layout up to a per-head permutation that Q.K^T does
    not see): x cos + rot(x, p tp) (-sin on the first of each pair) + rot(x, -p tp) (sin on
    the second), p = hd/2 (or 1): three plaintext products, one rescale, one level."""
    P, T, o = x.packing, x.packing.tokens, x.packing.offset
    if x.d % head_dim:
        raise HEError(f"{label}: {x.d} channels are not whole heads of {head_dim}")
    positions = np.asarray(positions, np.float64).reshape(-1)
    if positions.size != T:
        raise HEError(f"{label}: {positions.size} positions for {T} tokens")
    half = head_dim // 2
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = positions[:, None] * inv[None, :]  # (T, hd/2)
    j = np.arange(head_dim)
    if interleave:
        freq_of, first = j // 2, (j % 2 == 0)
        partner = 1
    else:
        freq_of, first = j % half, j < half
        partner = half
    cos = np.cos(ang[:, freq_of]).T  # (hd, T)
    sin = np.sin(ang[:, freq_of]).T
    heads = x.d // head_dim

    def grid(per_head):  # (hd, T) -> (n_cts, slots) over all heads, padding positions 0
        g = np.zeros((x.d, P.tp))
        g[:, o:o + T] = np.tile(per_head, (heads, 1))
        return P.grid(g, x.d)

    cos_g = grid(cos)
    minus_g = grid(np.where(first[:, None], -sin, 0.0))
    plus_g = grid(np.where(first[:, None], 0.0, sin))
    x = ev.refresh(x, 1 + ev.reserve(x.bound), label)
    out = []
    with ev.timer("rope"):
        for i, c in enumerate(x.cts):
            fwd, back = ev.rot_many(c, [partner * P.tp, -partner * P.tp])
            lvl = c.level
            acc = ev.be.multiply_plain(ev.ctx, c, ev.encode(cos_g[i], lvl))
            ev.be.add_inplace(ev.ctx, acc, ev.be.multiply_plain(ev.ctx, fwd, ev.encode(minus_g[i], lvl)))
            ev.be.add_inplace(ev.ctx, acc, ev.be.multiply_plain(ev.ctx, back, ev.encode(plus_g[i], lvl)))
            ev._count("mul_plain", 3)
            out.append(ev.rescale(acc))
    return x.with_cts(out)


def scores(ev: CkksEvaluator, q: CkksTensor, k: CkksTensor, head_dim: int, scale: float, bound: float,
           causal: bool = False, label: str = "qk") -> Scores:
    """The score diagonals S_r of queries `q` against keys `k` (positions 0..k.packing.end-1:
    the pass's own, or the KV cache's); two levels."""
    if q.d != k.d or q.packing.layout() != k.packing.layout() or k.packing.offset != 0:
        raise HEError(f"{label}: q has {q.d} channels, k {k.d} (expand grouped K/V heads first), "
                      f"or another layout")
    P = q.packing
    if P.cpc % head_dim:
        raise HEError(f"{label}: head dim {head_dim} does not divide {P.cpc} channels per ciphertext")
    q = ev.refresh(q, 2 + ev.reserve(bound), label)
    k = ev.refresh(k, 2 + ev.reserve(bound), label)
    rs = shifts(P.tokens, P.offset, k.packing.end, causal)
    start = np.zeros((P.n_cts(q.d) * P.cpc, P.tp))
    start[: q.d][np.arange(q.d) % head_dim == 0] = scale
    start = start.reshape(-1, P.slots)
    out: dict[int, list] = {r: [] for r in rs}
    with ev.timer("qk"):
        for i, (qc, kc) in enumerate(zip(q.cts, k.cts)):
            rot = ev.rot_many(kc, rs)
            for r, kr in zip(rs, rot):
                s = ev.mul_ct(qc, kr)
                s = ev.window_sum(s, head_dim, P.tp)
                s = ev.mul_plain_ct(s, start[i])
                out[r].append(ev.window_sum(s, head_dim, P.tp, backward=True))
    return Scores(out, P, q.d, bound, k.packing.end)


def softmax(ev: CkksEvaluator, s: Scores, exp_approx, inv_approx, *, causal: bool = False,
            window: int | None = None, key_keep=None, label: str = "softmax") -> Scores:
    """Row-wise softmax of the score diagonals (module docstring)."""
    P = s.packing
    lo, hi = exp_interval(s.bound)
    if exp_approx.lo > lo + 1e-9 or exp_approx.hi < hi - 1e-9:
        raise HEError(f"{label}: exp approximated on [{exp_approx.lo}, {exp_approx.hi}], needs [{lo}, {hi}]")
    e: dict[int, CkksTensor] = {}
    total = None
    for r, row in s.cts.items():
        mask = softmax_mask(P, s.d, r, s.bound, causal, window, key_keep, s.keys)
        z = CkksTensor([ev.add_plain_ct(c, mask[i]) for i, c in enumerate(row)], s.d, P, 3 * s.bound + MASK_GAP)
        e[r] = ev.poly(z, exp_approx, f"{label}.exp", bound=1.0)
        total = e[r] if total is None else ev.add(total, e[r], bound=total.bound + 1.0)
    inv = ev.poly(total, inv_approx, f"{label}.inv")
    out = {}
    for r, er in e.items():
        er = ev.refresh(er, 1, f"{label}.normalise")
        iv = ev.refresh(inv, 1, f"{label}.normalise")
        inv = iv
        out[r] = [ev.mul_ct(a, b) for a, b in zip(er.cts, iv.cts)]
    return Scores(out, P, s.d, 1.0, s.keys)


def attend(ev: CkksEvaluator, p: Scores, v: CkksTensor, bound: float, label: str = "av") -> CkksTensor:
    """sum_r P_r * rot(V, r): the attention output (T, d) in the queries' packing; one level.
    Rows outside the pass hold sums of their own V rows (a KV cache's): the projection after
    attention keeps the pass's rows only (`linear.EncodedLinear`'s mask)."""
    if v.d != p.d or v.packing.layout() != p.packing.layout():
        raise HEError(f"{label}: v has {v.d} channels, the scores {p.d}")
    v = ev.refresh(v, 1 + ev.reserve(bound), label)
    rs = sorted(p.cts)
    if p.level < 1 + ev.reserve(bound):
        p = Scores({r: ev.refresh(CkksTensor(row, p.d, p.packing, 1.0), 1 + ev.reserve(bound), label).cts
                    for r, row in p.cts.items()},
                   p.packing, p.d, 1.0, p.keys)
    out = []
    with ev.timer("av"):
        for i, vc in enumerate(v.cts):
            rot = ev.rot_many(vc, rs)
            acc = None
            for r, vr in zip(rs, rot):
                t = ev.mul_ct(p.cts[r][i], vr)
                acc = t if acc is None else ev.add_ct(acc, t)
            out.append(acc)
    return CkksTensor(out, v.d, p.packing, bound)

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

P.V is sum_r P_r * rot(V, r), relinearised once per block (the degree-2 products summed).

**Shift groups** (`ShiftGroups`) use the padding positions: with the queries at positions
offset..end-1 and tp >= 2 end, copies of Q at offset + j s (j < k, spacing s >= T) fit in
the frame, and one product (sum_j rot(Q, -j s)) * rot(K, r) holds the diagonals r, r + s,
..., r + (k-1) s at once, since position p + j s of the copy meets key p + j s + r, that is
key p + (r + j s) of query p.  One rotation of K, one relinearisation and one head window
then serve k shifts (k = 2 for a full prefill: s = T, shifts -(T-1)..0 and 1..T-1), and a
rotation by j s returns each diagonal to the queries' positions.  P.V mirrors it: the
replicated P_{r + j s} are placed at offset + j s and multiplied by the same rot(V, r);
the products are summed and folded back by rotations by j s.  Its positions outside the
pass then hold other groups' partial sums, which the projection after attention (whose
diagonals carry the pass's token mask, `linear.EncodedLinear`) drops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from cipherlm.he.errors import HEError

from .evaluator import CkksEvaluator, CkksTensor
from .packing import TokenPacking

#: how far below the valid entries the additive mask puts the invalid ones (e^-14 ~ 8e-7)
MASK_GAP = 14.0
#: products summed before one relinearisation in `attend`, and rotations of V held at once
DOT_BATCH = 16
#: degree of the relu interpolant of the encrypted row maximum (`softmax`)
RELU_DEGREE = 127


@dataclass
class Scores:
    """Score diagonals: ``cts[r]`` (one list of channel-block ciphertexts per shift r)."""

    cts: dict
    packing: TokenPacking
    d: int
    bound: float
    #: the number of key positions (0..keys-1)
    keys: int = 0
    head_dim: int = 1
    #: normalised form (`softmax`): cts[r] = [(compact chunk ciphertext, offset j) per block]
    compact: bool = False

    @property
    def level(self) -> int:
        return min((c[0] if isinstance(c, tuple) else c).level for row in self.cts.values() for c in row)


def shifts(T: int, offset: int = 0, keys: int | None = None, causal: bool = False) -> list[int]:
    """The shifts r with a valid (query, key) pair: queries at offset..offset+T-1, keys at
    0..keys-1 (default offset + T); r <= 0 only when causal."""
    end = offset + T
    keys = end if keys is None else keys
    hi = 0 if causal else keys - 1 - offset
    return list(range(-(end - 1), hi + 1))


@dataclass(frozen=True)
class ShiftGroups:
    """The shifts of one attention pass, ``count`` to a product (module docstring): the
    product of K rotated by r in ``base`` holds the diagonals r + j ``spacing`` (j < count) at
    positions shifted by j ``spacing``."""

    shifts: tuple[int, ...]
    spacing: int
    count: int
    #: the lowest rotation of K (the base is first..first + spacing - 1, those with a member)
    first: int = 0

    @property
    def base(self) -> tuple[int, ...]:
        """The rotations of K (and V): the shifts of the first group (all of them ungrouped)."""
        if self.count == 1:
            return self.shifts
        return tuple(r for r in range(self.first, self.first + self.spacing) if self.members(r))

    def members(self, r: int) -> list[tuple[int, int]]:
        """(j, shift r + j spacing) for each group j that has that shift (the shifts are
        contiguous, `shift_groups`)."""
        lo, hi = self.shifts[0], self.shifts[-1]
        return [(j, r + j * self.spacing) for j in range(self.count) if lo <= r + j * self.spacing <= hi]

    def steps(self) -> set[int]:
        """The rotations the grouping adds: +-j spacing, 0 < j < count."""
        return {sign * j * self.spacing for j in range(1, self.count) for sign in (1, -1)}


def shift_groups(packing: TokenPacking, rs, spacing: int | None = None, keys: int | None = None) -> ShiftGroups:
    """The grouping of the contiguous shifts ``rs`` for queries at packing.offset..end-1 and
    keys at 0..keys-1 (default end), ``spacing`` (default T, at least T) apart.  The base
    ends at shift 0 where it can (first = min(rs[0], 1 - spacing)), so that K and V are
    rotated by shifts <= 0 only: a non-causal pass then needs no positive-shift keys.  k
    copies need (a) the last copy inside the frame (end + (k-1) spacing <= tp: the positions
    below a copy read the previous channel's padding), (b) the keys read by the last group
    inside the frame (end - 1 + (k-1) spacing + first + spacing - 1 < tp, beyond the keys
    they are zeros) and (c) the reads below position 0 in the previous channel's zeros (tp +
    offset + first >= keys); where the copies that fit cannot cover every shift, none is
    grouped (count 1)."""
    rs = tuple(int(r) for r in rs)
    if list(rs) != list(range(rs[0], rs[0] + len(rs))):
        raise HEError(f"attention shifts {rs[0]}..{rs[-1]} are not contiguous")
    T, end, tp, off = packing.tokens, packing.end, packing.tp, packing.offset
    s = T if spacing is None else int(spacing)
    if s < T:
        raise HEError(f"attention groups {s} apart overlap the {T} queries")
    keys = end if keys is None else keys
    lo, hi = rs[0], rs[-1]
    first = min(lo, min(hi, 0) - s + 1)
    k = -(-(hi - first + 1) // s)
    fits = k > 1 and end + (k - 1) * s <= tp and end + k * s + first - 2 < tp and tp + off + first >= keys
    return ShiftGroups(rs, s, k, first) if fits else ShiftGroups(rs, s, 1, lo)


def rotation_steps(packing: TokenPacking, head_dim: int, rope_partners=(), causal: bool = False) -> set[int]:
    """Slot rotations the attention of this packing uses: its own pass from position 0
    grouped by `shift_groups` (the shifts <= 0 and +-T), and, not causal, +-p for each power
    of two p < T, which group a shorter pass of the session (`_grouping`: p >= its T).  A
    causal model asks for no positive shift (its decoding steps' keys are at or before their
    queries); neither does a non-causal one whose pass groups (half the keys of every shift)."""
    tp = packing.tp
    T = packing.tokens
    rs = shifts(T, causal=causal)
    own = shift_groups(TokenPacking(packing.slots, T, packing.tp), rs)
    out = set(own.base) | own.steps()
    if not causal:
        p = 1
        while p < T:
            out |= {p, -p}
            p *= 2
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


def _start_mask(P: TokenPacking, d: int, head_dim: int, value: float = 1.0, rows_only: bool = False) -> np.ndarray:
    """(n_cts(d), slots): `value` at the first channel of each head, else 0: at all positions,
    or (``rows_only``) at the pass's positions alone."""
    m = np.zeros((P.n_cts(d) * P.cpc, P.tp))
    heads = np.arange(m.shape[0]) < d
    heads &= np.arange(m.shape[0]) % head_dim == 0
    m[heads] = value * (P.token_mask() if rows_only else 1.0)
    return m.reshape(-1, P.slots)


def _batches(rs) -> list:
    """``rs`` in runs of `DOT_BATCH`: the rotations of V held at once (hoisted per run)."""
    return [rs[b:b + DOT_BATCH] for b in range(0, len(rs), DOT_BATCH)]


def _grouping(ev: CkksEvaluator, P: TokenPacking, rs, keys: int) -> ShiftGroups:
    """The grouping with the smallest spacing >= T whose rotations the evaluation keys hold
    (the fewest rotations of K: min(spacing, #shifts)): T for the pass the keys were made
    for, a power of two for a shorter one (`rotation_steps`); the shifts ungrouped when none
    is held."""
    for s in range(P.tokens, P.tp - P.end + 1):
        g = shift_groups(P, rs, s, keys)
        if g.count == 1:
            break
        if ev.can_rotate(set(g.base) | g.steps()):
            return g
    return ShiftGroups(tuple(int(r) for r in rs), P.tokens, 1, int(rs[0]))


def scores(ev: CkksEvaluator, q: CkksTensor, k: CkksTensor, head_dim: int, scale: float, bound: float,
           causal: bool = False, label: str = "qk") -> Scores:
    """The score diagonals S_r of queries `q` against keys `k` (positions 0..k.packing.end-1:
    the pass's own, or the KV cache's), each held at the first channel of its head (the other
    channels 0); two levels."""
    if q.d != k.d or q.packing.layout() != k.packing.layout() or k.packing.offset != 0:
        raise HEError(f"{label}: q has {q.d} channels, k {k.d} (expand grouped K/V heads first), "
                      f"or another layout")
    P = q.packing
    if P.cpc % head_dim:
        raise HEError(f"{label}: head dim {head_dim} does not divide {P.cpc} channels per ciphertext")
    q = ev.refit(q, 2 + ev.reserve(bound), label)
    k = ev.refit(k, 2 + ev.reserve(bound), label)
    rs = shifts(P.tokens, P.offset, k.packing.end, causal)
    g = _grouping(ev, P, rs, k.packing.end)
    start = _start_mask(P, q.d, head_dim, scale, rows_only=True)
    out: dict[int, list] = {r: [] for r in rs}
    with ev.timer("qk"):
        for i, (qc, kc) in enumerate(zip(q.cts, k.cts)):
            copies = ev.rot_many(qc, [-j * g.spacing for j in range(g.count)])
            qg = functools.reduce(ev.add_ct, copies)
            for r, kr in zip(g.base, ev.rot_many(kc, g.base)):
                s = ev.window_sum(ev.mul_ct(qg, kr), head_dim, P.tp)
                members = g.members(r)
                for (_j, shift), sj in zip(members, ev.rot_many(s, [j * g.spacing for j, _ in members])):
                    out[shift].append(ev.mul_plain_ct(sj, start[i],
                                                      cache_key=(label, "start", P.offset, P.tokens, P.tp, i)))
    return Scores(out, P, q.d, bound, k.packing.end, head_dim)


@dataclass
class Series:
    """A Chebyshev series on [lo, hi] (what `CkksEvaluator.poly` evaluates)."""

    op: str
    lo: float
    hi: float
    coeffs: tuple
    newton_steps: int = 0

    @property
    def poly_depth(self) -> int:
        d = len(self.coeffs) - 1
        return int(np.ceil(np.log2(d + 1))) + 1 if d > 0 else 0

    def __call__(self, x):
        return np.polynomial.chebyshev.chebval((2 * np.asarray(x) - self.lo - self.hi) / (self.hi - self.lo),
                                               self.coeffs)


@functools.lru_cache(maxsize=64)
def relu_series(R: float, degree: int = RELU_DEGREE) -> tuple[Series, float]:
    """(max(x, 0) on [-R, R] by its Chebyshev interpolant, raised by its largest shortfall so it
    never underestimates, the largest overestimate): max(a, b) = b + relu(a - b) then errs
    upward only, by at most that much per comparison."""
    c = np.polynomial.chebyshev.chebinterpolate(lambda t: np.maximum(t, 0.0), degree)
    t = np.linspace(-1, 1, 400001)
    e = np.polynomial.chebyshev.chebval(t, c) - np.maximum(t, 0.0)
    c = c.copy()
    c[0] -= e.min()
    over = float((e - e.min()).max())
    return Series("relu", -R, R, tuple(float(v) * R for v in c)), over * R


def relu_range(bound: float, strict: bool) -> float:
    """R of the comparisons: scores in [-S, S], invalid entries at -S (out of range: score 0)
    or, ``strict`` (causal, window, padded keys: real scores), in [-3S - 1, -S - 1]; with room
    for the estimates' own upward error."""
    return ((4.0 if strict else 2.0) * bound + 1.0) * 1.1 + 2.0


def max_error(bound: float, strict: bool, head_dim: int, n_diagonals: int) -> float:
    """The most the encrypted row maximum may exceed the true one (`softmax`)."""
    R = relu_range(bound, strict)
    rounds = int(np.ceil(np.log2(max(1, -(-n_diagonals // head_dim))))) + int(np.log2(head_dim))
    return rounds * relu_series(R)[1]


def softmax_intervals(bound: float, strict: bool, head_dim: int, keys: int, n_diagonals: int):
    """(exp's interval, inv's interval) of `softmax` for scores of bound S (``strict``: causal,
    sliding window or padded keys)."""
    err = max_error(bound, strict, head_dim, n_diagonals)
    lo = -(4.0 * bound + 1.0 if strict else 2.0 * bound) - err - MASK_GAP - 1.0
    return (lo, 1.0), (float(np.exp(-err)) / 1.2, keys + 2.0)


def _compact_mask(P: TokenPacking, d: int, head_dim: int, chunk: list[int], keys: int, bound: float,
                  causal: bool, window: int | None, key_keep, gap: float) -> np.ndarray:
    """(n_cts(d), slots) additive mask of one compact chunk (slot (head h, offset j, position p)
    holds diagonal chunk[j]): 0 on valid entries, the invalid offset M (below every valid
    score) minus `gap` elsewhere; the rows outside the pass, and padding heads, keep one
    valid entry (shift 0, whose score is 0 there)."""
    strict = causal or window is not None or key_keep is not None
    M = -(2.0 * bound + 1.0) if strict else -bound
    n = P.n_cts(d)
    out = np.full((n * P.cpc, P.tp), M - gap)
    for c in range(n * P.cpc):
        h0, j = c - c % head_dim, c % head_dim
        if h0 >= d:  # a padding head: its shift-0 slot of the first chunk stays valid
            if j == 0 and 0 in chunk:
                out[c] = 0.0
            continue
        if j >= len(chunk):
            continue
        r = chunk[j]
        row = np.full(P.tp, 0.0 if r == 0 else M - gap)
        m = softmax_mask(P, 1, r, 1.0, causal, window, key_keep, keys)[0].reshape(P.cpc, P.tp)[0]
        row[P.offset:P.end] = np.where(m[P.offset:P.end] == -1.0, 0.0, M - gap)
        out[c] = row
    return out.reshape(n, P.slots)


def _gather(ev: CkksEvaluator, items: list, tp: int):
    """sum_j rot(items[j], -j tp) (item j's first channels moved to offset j), by a binary
    tree of rotations by powers of two channels (None: an absent item)."""
    span = 1
    while len(items) > 1:
        nxt = []
        for a, b in zip(items[0::2], items[1::2]):
            if b is not None:
                b = ev.rot(b, -span * tp)
            nxt.append(b if a is None else a if b is None else ev.add_ct(a, b))
        items, span = nxt, span * 2
    return items[0]


def _spread(ev: CkksEvaluator, ct, n: int, tp: int) -> list:
    """[rot(ct, j tp) for j < n], each from an earlier one by a power-of-two rotation."""
    out = [ct]
    for j in range(1, n):
        low = j & -j
        out.append(ev.rot(out[j - low], low * tp))
    return out


def _max_ct(ev: CkksEvaluator, a, b, relu: Series, bound: float):
    """b + relu(a - b) >= max(a, b) (a, b of bound `bound`)."""
    # a level in reserve where a bootstrap must divide by a rescaled product: a - b's (in relu),
    # and the maximum's own (its bound is `bound`, which the sum b + relu(.) keeps)
    keep = max(ev.reserve(relu.hi), ev.reserve(bound))
    a, b = (ev.refresh(CkksTensor([c], 1, None, bound), keep, "softmax.max").cts[0] for c in (a, b))
    d = ev.sub_ct(a, b)
    r = ev.poly(CkksTensor([d], 1, None, relu.hi), relu, "softmax.max", bound=bound).cts[0]
    return ev.add_ct(b, r)


def softmax(ev: CkksEvaluator, s: Scores, exp_approx, inv_approx, *, causal: bool = False,
            window: int | None = None, key_keep=None, label: str = "softmax") -> Scores:
    """Row-wise softmax of the score diagonals, in compact form: the diagonals of each head are
    gathered hd at a time into one ciphertext (diagonal j of a chunk at the head's channel j:
    rotations only), so the maximum, exp and the inverse run on ceil(#shifts / hd)
    ciphertexts instead of one per shift.

    1. A public additive mask puts invalid entries (out of range, causal, sliding window,
       padded keys) below every valid score (at M = -S, or -2S - 1 when causal).
    2. The row maximum m by a tournament of max(a, b) = b + relu(a - b), relu a Chebyshev
       interpolant on [-R, R] raised so it never underestimates (`relu_series`): across the
       chunks, then over the hd channels of each head (rotations by 1..hd/2 channels); the
       head's first channel is kept and broadcast over the head.  m >= the true maximum, by
       at most `max_error`.
    3. e = exp(z - m - gap on invalid entries) (exp on `softmax_intervals`), the row sum by
       adding the chunks and a window over the head's channels, its inverse (inv on the
       interval [e^-max_error / 1.2, keys + 2]) broadcast, P = e * inverse.
    The result is compact too; `attend` expands each shift again."""
    P, hd = s.packing, s.head_dim
    rs = sorted(s.cts)
    chunks = [rs[g:g + hd] for g in range(0, len(rs), hd)]
    nb = len(s.cts[rs[0]])
    strict = causal or window is not None or key_keep is not None
    (elo, ehi), _inv = softmax_intervals(s.bound, strict, hd, s.keys, len(rs))
    if exp_approx.lo > elo + 1e-9 or exp_approx.hi < ehi - 1e-9:
        raise HEError(f"{label}: exp approximated on [{exp_approx.lo}, {exp_approx.hi}], needs [{elo}, {ehi}]")
    R = relu_range(s.bound, strict)
    relu, _over = relu_series(R)
    zbound = R + MASK_GAP
    start = _start_mask(P, s.d, hd)
    with ev.timer("softmax"):
        comp, masks_gap = [], []
        for chunk in chunks:
            cmask = _compact_mask(P, s.d, hd, chunk, s.keys, s.bound, causal, window, key_keep, 0.0)
            gmask = _compact_mask(P, s.d, hd, chunk, s.keys, s.bound, causal, window, key_keep, MASK_GAP) - cmask
            row = []
            for i in range(nb):
                acc = _gather(ev, [s.cts[r][i] for r in chunk] + [None] * (hd - len(chunk)), P.tp)
                # the masked scores have the comparisons' bound zbound: keep the level their
                # bootstrap needs while the bound is still the scores' own
                acc = ev.refresh(CkksTensor([acc], 1, P, s.bound), ev.reserve(zbound), f"{label}.max").cts[0]
                row.append(ev.add_plain_ct(acc, cmask[i]))
            comp.append(row)
            masks_gap.append(gmask)
    out_chunks = []
    for i in range(nb):
        m = comp[0][i]
        for g in range(1, len(comp)):
            m = _max_ct(ev, comp[g][i], m, relu, zbound)
        k = 1
        while k < hd:
            m = _max_ct(ev, ev.rot(m, k * P.tp), m, relu, zbound)
            k *= 2
        mt = ev.refresh(CkksTensor([m], 1, P, zbound), 1 + ev.reserve(zbound), f"{label}.max")
        m = ev.window_sum(ev.mul_plain_ct(mt.cts[0], start[i]), hd, P.tp, backward=True)
        es, total = [], None
        keep = ev.reserve(zbound + MASK_GAP)  # z's bootstrap (in exp) divides by a product
        m = ev.refresh(CkksTensor([m], 1, P, zbound), keep, f"{label}.exp").cts[0]
        for g in range(len(comp)):
            cg = ev.refresh(CkksTensor([comp[g][i]], 1, P, zbound), keep, f"{label}.exp").cts[0]
            z = ev.add_plain_ct(ev.sub_ct(cg, m), masks_gap[g][i])
            e = ev.poly(CkksTensor([z], 1, P, zbound + MASK_GAP), exp_approx, f"{label}.exp", bound=np.e).cts[0]
            es.append(e)
            total = e if total is None else ev.add_ct(total, e)
        total = ev.window_sum(total, hd, P.tp)
        inv = ev.poly(CkksTensor([total], 1, P, s.keys + 2.0), inv_approx, f"{label}.inv")
        inv = ev.refresh(inv, 1 + ev.reserve(inv.bound), f"{label}.inv")
        inv = ev.window_sum(ev.mul_plain_ct(inv.cts[0], start[i]), hd, P.tp, backward=True)
        et = ev.refresh(CkksTensor(es, 1, P, np.e), 1, f"{label}.normalise")
        it = ev.refresh(CkksTensor([inv], 1, P, 1.1 / inv_approx.lo), 1, f"{label}.normalise")
        out_chunks.append([ev.mul_ct(e, it.cts[0]) for e in et.cts])
    # out[r] = [block i: the compact chunk holding r, its offset]
    out = {}
    for g, chunk in enumerate(chunks):
        for j, r in enumerate(chunk):
            out[r] = [(out_chunks[i][g], j) for i in range(nb)]
    return Scores(out, P, s.d, 1.0, s.keys, hd, compact=True)


def attend(ev: CkksEvaluator, p: Scores, v: CkksTensor, bound: float, label: str = "av") -> CkksTensor:
    """sum_r P_r * rot(V, r): the attention output (T, d) in the queries' packing.  Each P_r is
    taken out of its compact chunk (a rotation, the heads' first channels of the pass's
    positions kept, a window back over the head: one level) and placed at its group's
    positions (`ShiftGroups`); the products with the rotations of V are summed before one
    relinearisation per block, and the groups folded back.  Only the pass's positions are
    the output: the others hold other groups' partial sums, which the projection after
    attention drops (`linear.EncodedLinear`'s token mask)."""
    if v.d != p.d or v.packing.layout() != p.packing.layout() or not p.compact:
        raise HEError(f"{label}: v has {v.d} channels, the scores {p.d} (or scores not normalised)")
    P, hd = p.packing, p.head_dim
    g = _grouping(ev, P, sorted(p.cts), p.keys)
    need = 2 + ev.reserve(bound)
    start = _start_mask(P, p.d, hd, rows_only=True)
    v = ev.refit(v, 1 + ev.reserve(bound), label)
    out = []
    with ev.timer("av"):
        spread: dict[int, list] = {}

        def placed(shift: int, i: int, j: int):
            """P_shift of block i (its heads' first channels) at positions offset + j s."""
            ct, jj = p.cts[shift][i]
            if id(ct) not in spread:
                fresh = ev.refit(CkksTensor([ct], 1, P, 1.0), need, label).cts[0]
                spread[id(ct)] = _spread(ev, fresh, hd, P.tp)
            masked = ev.mul_plain_ct(spread[id(ct)][jj], start[i], cache_key=(label, "start", P.offset, P.tokens, P.tp, i))
            return ev.rot(masked, -j * g.spacing)

        for i, vc in enumerate(v.cts):
            spread.clear()  # block i's chunks serve block i only
            acc = None
            for rs_b in _batches(g.base):
                ps = [ev.window_sum(functools.reduce(ev.add_ct, [placed(shift, i, j) for j, shift in g.members(r)]),
                                    hd, P.tp, backward=True) for r in rs_b]
                t = ev.dot_ct(ps, ev.rot_many(vc, rs_b))
                acc = t if acc is None else ev.add_ct(acc, t)
            out.append(functools.reduce(ev.add_ct, ev.rot_many(acc, [j * g.spacing for j in range(g.count)])))
    return CkksTensor(out, v.d, P, bound)

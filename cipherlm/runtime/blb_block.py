"""One BLB fused block evaluated in CKKS (BLB section 4, fused blocks; section 7.1, the
per-block parameters of `compile.passes.blb_params`; issue 16 item 2).

`evaluate_block(graph, block, inputs, params, ctx, be, keys)` takes one HE block of a
`passes.blb_fusion` graph (``graph.meta["blb_blocks"]``), the plaintext values of its inputs
(numpy arrays, as `runtime.graph_executor` has them) and the bound weights, and returns its
outputs {value name: array} computed on Lattigo CKKS ciphertexts at the block's parameters
(``LattigoContext(blb_params.run(...)[i].he_params)``).

**What stands in for the conversions.**  The block's inputs are encoded and encrypted here
with the block's scale 2^s (Algorithm 2, MPC -> CKKS, of the paper: there both parties
encode their shares and the client encrypts; `protocols.ckks_convert` has the real one)
and the outputs are decrypted and decoded here (Algorithm 1, CKKS -> MPC).  The noise of
this stand-in is the model's ``fresh_input`` (one encoding rounding less than Algorithm 2).
An input is encrypted where it is first used: at the block's start level (the top, or its
own depth above the output primes in a shared set: ``start_level``), or, for an addition /
subtraction / product with a value computed in the block, at that value's level and (for
additions) exact scale; a ciphertext encrypted lower has the same error, and the scales of
both operands match exactly without a level spent on matching them.

**Packing** (rows stacked, not the paper's spatial-first packing; every value of the block
uses one slot period P, the smallest power of two >= every width in the block (d, d_ff, S,
heads x head_dim), and a ciphertext holds R = N / (2P) periods):

* ``row``: a value of shape (..., C) has its leading axes flattened into rows; row i sits in
  slots [r P, r P + C) of ciphertext i // R (r = i mod R), zeros in [r P + C, (r + 1) P).
  Rotations are rotations of the whole slot vector, so every operator that rotates keeps
  what crosses into a neighbouring row out of the result: the projections multiply it by
  the zeros of their (non-cyclic) diagonals, a row sum (rotate-and-sum over the period)
  is read in the row's first slot only.  A (..., 1) value from MPC is encoded replicated
  over its row's period (as the paper's conversion does).
* ``head`` (the probabilities entering P V): value (H, T, S) on the *pair grid* (nq, nk, U):
  ciphertext (a, b, u) holds, in row r and head segment [h hd, (h + 1) hd), p[h, t, s] for
  t = a R + r and s = b R + (r + u) mod R, with U the row shifts u that meet some (t, s)
  (`pair_shifts`: every pair once); (H, T, 1) on a grid (nq, 1, 1).  P V for query
  ciphertext a is then sum_(b, u) P_(a, b, u) * rot(V_b, u P) (ct-ct, V in ``row``), already
  in ``row`` for the output projection.
* ``headsum`` (Q K^T): the same pair grid, score[h, t, s] in slot r P + h hd (Q_a * rot(K_b,
  u P), then a rotate-and-sum over hd slots); it only leaves the block (to the max core).

The old layout (one row per ciphertext, repeated over all its periods) is the case R = 1 of
this one; stacking divides the ciphertexts of a (T, C) value by R and the products of Q K^T
and P V by R, for d_in + d_out - 1 diagonals per projection instead of P.

**Section 5's packing for Q K^T and P V** (``attention="fused"``, or "auto" where it converts
fewer ciphertexts: `blb_params.attention_packing`; `attention_layouts`): the operands in BLB's
multi-head packings (`protocols.ckks.blb_matmul`; layout names ``mh_cols/n/k/c``,
``mh_rows/...``, ``mh_diag/...``: `mh_layout`) and the products by its fused ct-ct MatMul
with BSGS (`_Eval.fused`).  The projections stay in stacked rows, so Q and K and P V's
output change packing where they are read (`_Eval.relayout`: out through the io and back
in, fresh at the start level; in the 2pc mode a conversion round trip whose repack is a local
permutation of the shares, section 5.2).  Depth and noise: `blb_fusion.block_depth(...,
fused=True)`, `blb_params.output_errors(..., fused=True)`.  A causal mask (a decoder's
prefill, keys = queries): every pair is computed and the mask applies at the output (below).

**Operators** (levels: every product is rescaled once, so a block uses exactly its
`blb_fusion.block_depth` levels and ends at the output modulus `blb_params` reserves;
additions bring both operands to the lower level, whose scales agree by construction):

* ``linear``: y = x W^T + b by the diagonal method with baby-step giant-step rotations
  over the d_in + d_out - 1 non-cyclic diagonals (diagonals encoded at the scale of the prime
  the rescale drops, so the scale is unchanged; the baby steps of one input computed once
  for all its projections: Q, K, V; gate, up); an ``affine`` read by the projection is
  folded into it (W diag(gamma), b + W beta: `blb_fusion.block_depth` counts it so) and is
  evaluated on its own only when something else reads it;
* ``affine``: gamma as a plaintext product, beta as a plaintext addition;
* ``add`` / ``sub`` / ``mul``: slot-wise (a (..., 1) operand broadcast: already replicated);
* ``poly``: a public polynomial slot-wise (`_Eval.poly`: a monic one of degree <= 4 by its
  real factors, ceil(log2 deg) levels, no plaintext product; any other by its powers and
  one plaintext product by the coefficients);
* ``reduce_sum``: rotate-and-sum over the period (the row's sum in its first slot); with a
  scale (a mean's 1/d) that slot is masked with the scale and spread back over the row's C
  slots by a rotate-and-sum the other way, before the rescale (one level, the broadcast of
  Figure 6); without one the sum stays in the first slot, for a block output only;
* ``qk``: per pair-grid cell (a, b, u), Q_a * rot(K_b, u P), relinearised, summed over each
  head's hd slots, the public scale (1 / sqrt(hd)) applied to the ciphertext's scale (no
  level); K's row shifts by chains of rotations by +-P (two rotation keys);
* ``av``: as ``head`` above;
* ``head`` (select "first"): the first ciphertext (its row 0 is the value);
* ``rope``: per row t, x cos + rot(x, a) sin' + rot(x, -a) sin'' (a = hd / 2, or 1 for
  interleaved pairs; signs and masks in the plaintexts at position t), one level;
* ``kv_cache``: prefill into an empty cache (its values are this block's K and V: the same
  ciphertexts, decoded as (H, S, hd));
* a causal mask on ``qk``: public (`score_mask`), so a pair-grid ciphertext none of whose
  pairs is kept is not computed (the rows packing), and the masked (t, s) decode as -inf
  (``Packed.keep``; the 2pc mode's conversion sets them to a public constant on the shares,
  `runtime.twopc_blb.MASKED_SCORE`: -inf cannot be a share).

* grouped-query attention: K and V are carried with each KV head repeated for its H / H_kv
  query heads, by repeating the projection's rows (no extra operation, the same noise) or,
  for a K / V entering the block, by the encoding; decoded back to H_kv heads.

Not supported (NotImplementedError naming the op): partial RoPE, a non-empty KV cache
(decoding), any other op (split, concat, softmax, ...), and layouts the above cannot
produce.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from typing import Any

import numpy as np

from ..compile.ir import Graph
from ..compile.passes import blb_fusion, blb_params
from ..compile.passes.blb_fusion import _only_folded, _shapes, block_depth
from ..protocols.ckks import blb_matmul
from ..protocols.ckks.evaluator import CkksEvaluator

SUPPORTED = ("linear", "affine", "add", "sub", "mul", "reduce_sum", "qk", "av", "head", "rope", "kv_cache", "split",
             "poly")


@dataclasses.dataclass
class Packed:
    """A value of the block as a grid of ciphertexts (``cts``: numpy object array)."""

    cts: np.ndarray
    layout: str           # "row" | "head" | "headsum"
    shape: tuple          # logical shape
    dirty: bool = False   # row layout: slots [C, P) of a row may be nonzero (a (..., 1) value: replicated
    #                       over the row's whole period, not only over the C slots of the rows it meets)
    heads: bool = False   # row layout of a KV-cache value: (S, H hd) rows read as (H, S, hd)
    rep: tuple[int, int] = (1, 0)  # grouped-query K / V: (H / H_kv, hd), each KV head repeated per query head
    keep: np.ndarray | None = None  # headsum: the (T, S) pairs wanted (a causal mask: the rest -inf)
    start: bool = False   # a row sum left in the first slot of each row only (`_Eval.reduce_sum`, scale 1)
    shifts: tuple[int, ...] = ()    # head / headsum: the row shifts u of the grid's last axis (`pair_shifts`)
    present: np.ndarray | None = None  # an output's ciphertexts that exist (the 2pc conversions' header)

    @property
    def first(self):
        return next(c for c in self.cts.flat if c is not None)


#: threads that encode a projection's weight diagonals (`_Eval.pts`) and evaluate its giant steps
_ENCODE_WORKERS = max(1, min(8, os.cpu_count() or 1))
_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, pool)
_POOL_LOCK = threading.Lock()


def _encode_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's encoding threads (made again in a forked child: a parent's threads do
    not exist there)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), concurrent.futures.ThreadPoolExecutor(_ENCODE_WORKERS,
                                                                       thread_name_prefix="blb-encode"))
        return _POOL[1]


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def rot_sum_steps(length: int) -> list[int]:
    """The rotation steps of `_Eval.rot_sum` over ``length`` slots."""
    if length <= 1:
        return []
    out = rot_sum_steps(length // 2) + [length // 2]
    if length % 2:
        out.append(length - 1)
    return out


def bsgs_split(d: int) -> tuple[int, int]:
    """(baby steps b, giant steps g) of a product with ``d`` diagonals: b a power of two near
    sqrt(d), g = ceil(d / b)."""
    b = _pow2(int(math.ceil(math.sqrt(d))))
    return b, max(1, -(-d // b))


def linear_plan(d_in: int, d_out: int) -> tuple[int, int, int]:
    """(b, g, k0) of `_Eval.linear` for a d_out x d_in block: b baby steps (a power of two near
    sqrt(d_in + d_out - 1)), the diagonals k0 .. d_in - 1 with k0 the multiple of b at or below
    -(d_out - 1) (so every giant step k0 + j b is a multiple of b: blocks of other shapes with
    the same b share their rotation keys), g = ceil((d_in - k0) / b) giant steps."""
    b, _ = bsgs_split(d_in + d_out - 1)
    k0 = -b * (-(-(d_out - 1) // b))
    return b, max(1, -(-(d_in - k0) // b)), k0


def linear_steps(d_in: int, d_out: int, slots: int) -> list[int]:
    """The rotations of `_Eval.linear` for a d_out x d_in block: baby steps 1..b-1 and the
    giant steps k0 + j b (mod the slots), `linear_plan`."""
    b, g, k0 = linear_plan(d_in, d_out)
    return list(range(1, b)) + [(k0 + j * b) % slots for j in range(g) if (k0 + j * b) % slots]


def pair_shifts(rows_per_ct: int, T: int, S: int) -> tuple[int, ...]:
    """The row shifts u (signed, |u| < R) for which some query row t and key row s meet in the
    pair layouts: query ciphertext a's row r faces key ciphertext b's row (r + u) mod R, i.e.
    t = a R + r, s = b R + (r + u) mod R (every pair (t, s) once over the (a, b, u) grid)."""
    R = rows_per_ct
    used = set()
    for u in range(R):
        r = np.arange(R)
        s_row = (r + u) % R
        if (r < T).any() and any(((r < T) & (b * R + s_row < S)).any() for b in range(-(-S // R))):
            used.add(u if u <= R // 2 else u - R)
    return tuple(sorted(used, key=lambda u: (abs(u), u)))


def _pair_index(R: int, nq: int, nk: int, shifts, T: int, S: int):
    """(t, s, valid) of every (a, b, u, r) of the pair layouts (arrays of shape (nq, nk, U, R))."""
    A, B, U, Rr = np.meshgrid(np.arange(nq), np.arange(nk), np.asarray(shifts, np.int64), np.arange(R),
                              indexing="ij")
    t = A * R + Rr
    s = B * R + (Rr + U) % R
    return t, s, (t < T) & (s < S)


#: section 5's multi-head packings (`protocols.ckks.blb_matmul`), as layout names
#: "kind/n/k/groups": mh_cols (spatial-first: Q, K, P), mh_rows (reduce-first: V), mh_diag
#: (the fused MatMul's diagonal packing: Q K^T's scores, P V's output)
MH_KINDS = ("mh_cols", "mh_rows", "mh_diag")


def mh_name(kind: str, L: "blb_matmul.MHLayout") -> str:
    return f"{kind}/{L.n}/{L.k}/{L.groups}"


def mh_layout(layout: str, slots: int, heads: int) -> tuple[str, "blb_matmul.MHLayout"] | None:
    """(kind, MHLayout) of a layout name of `MH_KINDS`, None for the other layouts; ValueError
    for a malformed one (a peer's header)."""
    kind, _, rest = str(layout).partition("/")
    if kind not in MH_KINDS:
        return None
    try:
        n, k, groups = (int(x) for x in rest.split("/"))
    except ValueError:
        raise ValueError(f"malformed packing {layout!r}") from None
    if not (0 < n <= slots and 0 < k <= slots):
        raise ValueError(f"packing {layout!r} out of range")
    return kind, blb_matmul.MHLayout(int(slots), int(heads), n, k, groups)


def attention_layouts(graph: Graph, block: dict, slots: int, tokens: int,
                      attention: str = "auto") -> dict[str, "blb_matmul.MHLayout"]:
    """{qk / av node name: its MHLayout} when the block's attention runs in section 5's packing
    (`blb_params.block_fused`; Q K^T: n = T, k = head_dim; P V: n = k = max(T, head_dim), so that
    V's head_dim columns fit the n x n output), else {}.  A causal mask is applied at the output
    (`score_mask`); keys other than the queries (a KV cache that is not empty) keep the rows
    packing."""
    if not blb_params.block_fused(graph, block, attention, tokens):
        return {}
    out = {}
    for name in block["nodes"]:
        n = graph.node(name)
        if n.op not in ("qk", "av"):
            continue
        qk, av = blb_params.attention_mh_layouts(slots, tokens, int(n.attrs["heads"]), int(n.attrs["head_dim"]))
        out[n.name] = qk if n.op == "qk" else av
    return out


def value_shape(x) -> tuple:
    """The shape of a block input: an array, an `AShare`, or anything with ``shape`` / ``rows``."""
    if hasattr(x, "shape"):
        return tuple(x.shape)
    rows = getattr(x, "rows", None)
    if rows is not None:
        return tuple(np.shape(rows))
    return tuple(np.shape(x))


def score_mask(attrs: dict, T: int, S: int, pos0: int = 0) -> np.ndarray:
    """The (T, S) scores a Q K^T node keeps (public): all, or the causal ones (key position <=
    query position pos0 + t), within a sliding window if the model has one."""
    keep = np.ones((T, S), bool)
    if attrs.get("causal"):
        qpos, kpos = pos0 + np.arange(T)[:, None], np.arange(S)[None, :]
        keep = kpos <= qpos
        if attrs.get("sliding_window") is not None:
            keep &= (qpos - kpos) < int(attrs["sliding_window"])
    return keep


#: the narrowest period `block_period` considers for a block whose values can all be split into
#: column chunks (narrower periods only add chunks: more rotations for no fewer ciphertexts)
MIN_PERIOD = 16


def core_period(graph: Graph, block: dict, fused=()) -> int:
    """The smallest period the block can run at: a power of two holding every width that has
    to sit in one period, heads x head_dim of the attention nodes in the rows packing (not
    those named in ``fused``, in section 5's packing: their operands are re-packed,
    `attention_layouts`) and RoPE's width; `MIN_PERIOD` for a block with none.  Every other
    value can be split into column chunks of P (`_Eval`: a projection runs per (output chunk,
    input chunk), a row sum adds the chunks before its rotate-and-sum, an element-wise
    operation runs per chunk)."""
    shapes = _shapes(graph)
    core = []
    for name in block["nodes"]:
        n = graph.node(name)
        if n.op in ("qk", "av") and n.name not in fused:
            core.append(int(n.attrs["heads"]) * int(n.attrs["head_dim"]))
        elif n.op == "rope":
            w = shapes[n.inputs[0]][-1]
            core.append(int(w) if isinstance(w, int) else int(n.attrs["heads"]) * int(n.attrs["head_dim"]))
    return _pow2(max(core)) if core else MIN_PERIOD


def block_period(graph: Graph, block: dict, inputs: dict[str, np.ndarray], slots: int, fused=()) -> int:
    """P, the slots per row of the block's row layout: among the powers of two from
    `core_period` up to the widest value, the one whose block inputs and outputs fill the
    fewest ciphertexts of ``slots`` slots, since every conversion moves whole ciphertexts (a
    larger P on a tie: fewer chunks, fewer rotations).  For BERT-base's FFN-in block at 128
    tokens and 8192 slots: 73 ciphertexts at P = 64 against 256 at P = 4096, the smallest
    power of two that holds d_ff (the (T, 1) rsqrt input alone: 1 against 64).  A period
    below a mean's width must divide it (`spread_widths`)."""
    lo = core_period(graph, block, fused)
    widths = [value_shape(inputs[i["value"]])[-1] for i in block["inputs"] if i["value"] in inputs]
    for name in block["nodes"]:
        n = graph.node(name)
        last = n.shape[-1] if n.shape else 1
        if isinstance(last, int):
            widths.append(last)
        if n.op == "linear":
            widths += [int(n.attrs["d_in"]), int(n.attrs["d_out"])]
    hi = min(max(lo, _pow2(max(widths, default=1))), slots)
    rows = _row_values(graph, block, inputs)
    spread = spread_widths(graph, block, block_tokens(inputs))
    best = (None, hi)
    for P in (1 << k for k in range(lo.bit_length() - 1, hi.bit_length())):
        if not spread_fits(P, spread):
            continue
        cts = sum(-(-n // (slots // P)) * -(-c // P) for n, c in rows)
        if best[0] is None or cts <= best[0]:
            best = (cts, P)
    return best[1]


def spread_widths(graph: Graph, block: dict, tokens: int) -> list[int]:
    """The widths C of the values the block's scaled row sums (a mean: `_Eval.reduce_sum`
    with a scale) spread their result back over.  The spread covers P slots of every column
    chunk, so a period P < C must divide C: otherwise the last, narrower chunk's padding
    would hold the mean, and the next row sum over it (a LayerNorm's sum of squares) would
    add it in (MiniLM's 384 channels at P = 256, which the fewest-ciphertexts rule picked at
    8 tokens)."""
    shapes = _shapes(graph)
    out = []
    for name in block["nodes"]:
        n = graph.node(name)
        if n.op == "reduce_sum" and float(n.attrs.get("scale", 1.0)) != 1.0:
            c = (shapes.get(n.inputs[0]) or (1,))[-1]
            out.append(int(c) if isinstance(c, (int, np.integer)) else int(tokens))
    return out


def spread_fits(period: int, widths: list[int]) -> bool:
    """Whether a period suits the means spread over ``widths`` (`spread_widths`): each width
    at most P, or a multiple of it (a narrower last chunk would keep the mean in its padding)."""
    return all(c <= period or c % period == 0 for c in widths)


def _row_values(graph: Graph, block: dict, inputs: dict) -> list[tuple[int, int]]:
    """(rows, width) of the block's inputs and outputs in the row layout (leading axes
    flattened into rows): what its conversions carry.  A symbolic axis of an output's shape
    (T, or S without a cache) reads as the inputs' tokens."""
    shapes = _shapes(graph)
    tokens = block_tokens(inputs)
    out = []
    for v in [i["value"] for i in block["inputs"]] + [o["value"] for o in block["outputs"]]:
        sh = value_shape(inputs[v]) if v in inputs else shapes.get(v)
        if not sh:
            continue
        dims = [int(d) if isinstance(d, (int, np.integer)) else tokens for d in sh]
        out.append((int(np.prod(dims[:-1])) if len(dims) > 1 else 1, dims[-1]))
    return out


def chunk_widths(width: int, period: int) -> list[int]:
    """The column chunks of a value of ``width`` at period P (the last one may be narrower)."""
    return [min(period, width - k) for k in range(0, max(1, width), period)]


def block_steps(graph: Graph, block: dict, period: int, slots: int, tokens: int | None = None,
                attention: str = "rows") -> list[int]:
    """Every rotation step `evaluate_block` uses for this block at period P on ``slots`` slots
    (steps in [1, slots)); with ``tokens`` and an ``attention`` packing, section 5's steps
    (`attention_layouts`) as well."""
    steps: set[int] = set()
    mh = attention_layouts(graph, block, slots, tokens, attention) if tokens else {}
    for L in mh.values():
        steps.update(blb_matmul.rotation_steps(L))
    shapes = _shapes(graph)
    expand = kv_expansion(graph, block)
    for name in block["nodes"]:
        n = graph.node(name)
        if n.op == "linear":
            r = expand.get(n.out, (1, 0))[0]
            d_in = min(int(n.attrs["d_in"]), period)
            sp = split_of(graph, block, n)
            for size in (sp.attrs["sizes"] if sp is not None else (int(n.attrs["d_out"]) * r,)):
                for d_out in set(chunk_widths(int(size), period)):
                    steps.update(linear_steps(d_in, d_out, slots))
        elif n.op == "reduce_sum":
            steps.update(rot_sum_steps(period))
            if float(n.attrs.get("scale", 1.0)) != 1.0:
                steps.update(-s for s in rot_sum_steps(min(period, int(shapes[n.inputs[0]][-1]))))
        elif n.op in ("qk", "av") and n.name in mh:
            continue
        elif n.op in ("qk", "av"):
            if n.op == "qk":
                steps.update(rot_sum_steps(int(n.attrs["head_dim"])))
            if slots > period:
                steps.update((period, -period))
        elif n.op == "rope":
            a = 1 if n.attrs.get("interleave") else int(n.attrs["head_dim"]) // 2
            steps.update((a, -a))
    return sorted({s % slots for s in steps} - {0})


def assign_layouts(graph: Graph, block: dict, mh: dict | None = None) -> dict[str, str]:
    """{value: layout} for the block's values and inputs (default ``row``): P V's
    probabilities and whatever slot-wise operations produce them are ``head``; Q K^T's
    output ``headsum``.  With section 5's packing (``mh``, `attention_layouts`): the
    probabilities and their slot-wise producers' inputs ``mh_cols``, Q K^T's block inputs
    ``mh_cols``, P V's V input ``mh_rows``, both outputs ``mh_diag`` (a Q / K / V computed
    in the block is re-packed where the product reads it: `_Eval.relayout`)."""
    names = list(block["nodes"])
    prod = {v: graph.node(n) for n in names for v in graph.node(n).outputs}
    lay: dict[str, str] = {}
    mh = mh or {}
    for name in names:
        n = graph.node(name)
        if n.name in mh:
            L = mh[n.name]
            lay[n.out] = mh_name("mh_diag", L)
            ins = n.inputs[:2] if n.op == "qk" else n.inputs[1:2]
            for v, kind in zip(ins, ("mh_cols", "mh_cols") if n.op == "qk" else ("mh_rows",)):
                if v not in prod:
                    lay[v] = mh_name(kind, L)
        elif n.op == "qk":
            lay[n.out] = "headsum"
    todo = [(graph.node(n).inputs[0], mh_name("mh_cols", mh[n]) if n in mh else "head")
            for n in names if graph.node(n).op == "av"]
    while todo:
        v, want = todo.pop()
        if lay.get(v, want) != want:
            raise NotImplementedError(f"{v}: needed in the {want!r} layout of P V but produced as {lay[v]}")
        lay[v] = want
        p = prod.get(v)
        if p is None:
            continue  # a block input: encoded in that layout
        if p.op not in ("mul", "add", "sub"):
            raise NotImplementedError(f"{p.name} ({p.op}): cannot produce the probabilities of P V in the {want!r} "
                                      "layout (only slot-wise mul / add / sub of block inputs can)")
        todo.extend((u, want) for u in p.inputs)
    for name in names:
        for v in graph.node(name).inputs + graph.node(name).outputs:
            lay.setdefault(v, "row")
    return lay


class _Eval:
    #: projections by the backend's one native call (Lattigo's `blb_linear`: `_native_linear`); False:
    #: diagonal by diagonal from Python (`_linear_by_diagonals`, the reference)
    native = True

    def __init__(self, ctx, be, io, evk, period: int, scale_bits: int, attrs_of_head: tuple[int, int] | None):
        self.ctx, self.be, self.io, self.evk = ctx, be, io, evk
        self.P = period
        self.slots = ctx.slots
        if self.slots % period:
            raise ValueError(f"period {period} does not divide {self.slots} slots")
        self.R = self.slots // period  # rows per ciphertext
        self.scale = 2.0 ** scale_bits
        #: the level fresh inputs are encrypted at (`evaluate_block`'s ``start_level``)
        self.top = ctx.max_level
        self.hh = attrs_of_head  # (heads, head_dim) of the block's attention, for the pair layouts
        self.stats = {"ct_ct": 0, "ct_pt": 0, "rotations": 0, "rescales": 0, "relayouts": 0,
                      "encode_weights_s": 0.0, "native_linear_s": 0.0}
        self._babies: dict[tuple, tuple] = {}  # (id(ct), b) -> (ct, its baby-step rotations), shared by projections
        self._ck: CkksEvaluator | None = None   # section 5's products (`fused`)
        self._relaid: dict[tuple[str, str], Packed] = {}

    # ---- primitives
    def pt(self, vec, level: int, scale: float):
        """A plaintext of a full slot vector, or of a period vector (the same for every row)."""
        v = np.asarray(vec, np.float64)
        if v.size == self.P:  # repeated over the R rows: a sparse (tiled) encoding, the same plaintext
            return self.be.encode_slots(self.ctx, v, level=level, scale_bits=math.log2(scale), tile=True)
        return self.be.encode_slots(self.ctx, v, level=level, scale_bits=math.log2(scale))

    def pts(self, vecs: list, level: int, scale: float) -> list:
        """`pt` of many vectors, encoded on all cores: the backend's encoder may be called from
        several threads (Lattigo >= 6.2), and its calls release the GIL."""
        if len(vecs) < 2 * _ENCODE_WORKERS:
            return [self.pt(v, level, scale) for v in vecs]
        return list(_encode_pool().map(lambda v: self.pt(v, level, scale), vecs))

    def copy(self, ct):
        """A copy through the backend interface: an integer product by 1 (scale 1, exact, no level)."""
        return self.be.multiply_scalar(self.ctx, ct, 1)

    def rot(self, ct, k: int):
        k %= self.slots
        if k == 0:
            return self.copy(ct)
        self.stats["rotations"] += 1
        return self.be.rotate_rows(self.ctx, ct, k, self.evk)

    def rescale(self, ct):
        self.stats["rescales"] += 1
        self.be.rescale_inplace(self.ctx, ct)
        return ct

    def rot_sum(self, ct, length: int, sign: int = 1):
        """sum_{k < length} rot(ct, sign k) (log rotations; a fresh ciphertext)."""
        if length <= 1:
            return self.copy(ct)
        half = self.rot_sum(ct, length // 2, sign)
        out = self.copy(half)
        self.be.add_inplace(self.ctx, out, self.rot(half, sign * (length // 2)))
        if length % 2:
            self.be.add_inplace(self.ctx, out, self.rot(ct, sign * (length - 1)))
        return out

    def shifted(self, cts: np.ndarray, shifts) -> list[dict[int, Any]]:
        """Per ciphertext, {u: rot(ct, u P)} for the row shifts u (chains of rotations by +-P:
        two rotation keys)."""
        out = []
        for ct in cts:
            d = {0: ct}
            for sign in (1, -1):
                prev = ct
                for m in range(1, max([abs(u) for u in shifts if u * sign > 0], default=0) + 1):
                    prev = self.rot(prev, sign * self.P)
                    d[sign * m] = prev
            out.append(d)
        return out

    def q(self, level: int) -> float:
        return float(self.ctx.q_moduli[level])

    def n_cts(self, rows: int) -> int:
        return max(1, -(-int(rows) // self.R))

    # ---- encoding / decoding (what the conversions move)
    def slot_vectors(self, arr: np.ndarray, layout: str) -> tuple[np.ndarray, bool, tuple]:
        """(grid of slot vectors (grid shape + (slots,)), dirty, shifts) of a value in
        ``layout``.  A linear map made of copies and zeros only, so it applies as well to one
        party's additive shares (uint64 arrays keep their dtype: 0 is a share of 0).

        *row*: row i of the (rows, C) value (leading axes flattened) in slots [r P, r P + C) of
        ciphertext i // R (r = i mod R), zeros after; a (..., 1) value replicated over its
        row's period; a value wider than P in column chunks of P (grid (ciphertexts, chunks)).  *head*: P V's probabilities (H, T, S) on the pair grid (`pair_shifts`):
        ciphertext (a, b, u), row r, head segment [h hd, (h + 1) hd) holds p[h, a R + r,
        b R + (r + u) mod R]; (H, T, 1) on a grid (nq, 1, 1) (the same for every key)."""
        a = np.asarray(arr)
        if a.dtype != np.uint64:
            a = a.astype(np.float64)
        P, R = self.P, self.R
        mh = mh_layout(layout, self.slots, self.hh[0]) if self.hh else None
        if mh is not None:
            return self._mh_vectors(a, *mh), False, ()
        if layout == "row":
            C = a.shape[-1]
            rows = a.reshape(-1, C)
            m = self.n_cts(rows.shape[0])
            K = len(chunk_widths(C, P))
            out = np.zeros((m * R, K * P), a.dtype)
            out[:rows.shape[0], :P if C == 1 else C] = rows
            return out.reshape(m, R, K, P).transpose(0, 2, 1, 3).reshape(m, K, R * P), C == 1, ()
        if layout == "head":
            H, hd = self.hh
            if a.ndim != 3 or a.shape[0] != H:
                raise NotImplementedError(f"head layout for a value of shape {a.shape} (expected (H, T, S|1))")
            _, T, S = a.shape
            nq = self.n_cts(T)
            if S == 1:
                nk, shifts = 1, (0,)
            else:
                nk, shifts = self.n_cts(S), pair_shifts(R, T, S)
            t, s, ok = _pair_index(R, nq, nk, shifts, T, S if S > 1 else 1)
            if S == 1:
                s = np.zeros_like(s)
                ok = t < T
            v = a[:, np.where(ok, t, 0), np.where(ok, s, 0)]  # (H, nq, nk, U, R)
            v = np.where(ok[None], v, np.zeros((), a.dtype))
            seg = np.repeat(np.moveaxis(v, 0, -1), hd, axis=-1)  # (nq, nk, U, R, H hd)
            out = np.zeros(seg.shape[:-1] + (P,), a.dtype)
            out[..., :H * hd] = seg
            return out.reshape(nq, nk, len(shifts), R * P), False, tuple(shifts)
        raise NotImplementedError(f"cannot encode a block input in the {layout!r} layout")

    def _mh_heads(self, a: np.ndarray) -> np.ndarray:
        """(H, T, C) of a value given as rows (T, H hd) or per head (H, T, C)."""
        H = self.hh[0]
        if a.ndim == 2:
            if a.shape[-1] % H:
                raise NotImplementedError(f"a value of width {a.shape[-1]} split into {H} heads")
            return a.reshape(a.shape[0], H, -1).transpose(1, 0, 2)
        if a.ndim == 3 and a.shape[0] != H and H % a.shape[0] == 0:  # grouped-query K / V: each KV head per query head
            a = np.repeat(a, H // a.shape[0], axis=0)
        if a.ndim != 3 or a.shape[0] != H:
            raise NotImplementedError(f"section 5's packing for a value of shape {a.shape}")
        return a

    def _mh_vectors(self, a: np.ndarray, kind: str, L: "blb_matmul.MHLayout") -> np.ndarray:
        """Slot vectors (J, slots) of a value in section 5's packing (`blb_matmul.pack_columns`:
        Q, K, P, with the query / token axis padded to n, and a (H, T, 1) reciprocal as one
        vector with it in every group; `pack_rows`: V).  Copies and zeros only (shares keep their dtype)."""
        m = self._mh_heads(a)
        if kind == "mh_rows":
            return blb_matmul.pack_rows(m, L)
        if kind != "mh_cols":
            raise NotImplementedError(f"cannot encode a block input in the {kind!r} layout")
        if m.shape[-1] == 1 and L.k > 1:
            # a (H, T, 1) value (the softmax's reciprocal): the same in every column, so one
            # ciphertext (each group holding it) serves all J of the other operand (`binary`)
            m = np.broadcast_to(m, m.shape[:2] + (L.groups,))
            L = blb_matmul.MHLayout(L.slots, L.heads, L.n, L.groups, L.groups)
        if m.shape[1] > L.n:
            raise ValueError(f"{m.shape[1]} rows for a packing of n = {L.n}")
        full = np.zeros((m.shape[0], L.n, m.shape[2]), m.dtype)
        full[:, :m.shape[1]] = m
        return blb_matmul.pack_columns(full, L)

    def encrypt(self, name: str, arr, layout: str, level: int, scale: float) -> Packed:
        """Block input ``name`` at (level, scale): through ``self.io`` (the conversion)."""
        return self.io.encrypt(self, name, arr, layout, level, scale)

    def decrypt(self, name: str, x: Packed):
        """Block output ``name``: through ``self.io`` (the conversion)."""
        return self.io.decrypt(self, name, x)

    def unpack(self, dec: np.ndarray, x: Packed) -> np.ndarray:
        """The logical value of ``x`` from ``dec`` (x's grid + (slots,): each ciphertext's slots;
        floats, or one party's uint64 shares: only copies are made)."""
        P, R = self.P, self.R
        if x.layout == "row":
            C = x.shape[-1]
            n = int(np.prod(x.shape[:-1], dtype=np.int64))
            m, K = x.cts.shape
            out = dec.reshape(m, K, R, P).transpose(0, 2, 1, 3).reshape(m * R, K * P)[:n, :C].reshape(x.shape)
            r, hd = x.rep
            if r > 1:  # the first copy of each KV head
                out = out.reshape(out.shape[0], -1, r, hd)[:, :, 0, :].reshape(out.shape[0], -1)
            if x.heads:
                out = out.reshape(out.shape[0], -1, hd or self.hh[1]).transpose(1, 0, 2)
            return out
        mh = mh_layout(x.layout, self.slots, self.hh[0]) if self.hh else None
        if mh is not None:
            kind, L = mh
            if kind != "mh_diag":
                raise NotImplementedError(f"decoding a {kind!r} value")
            Y = blb_matmul.unpack_diagonals(dec.reshape(L.n_out, self.slots), L)  # (H, n, n)
            if len(x.shape) == 3:  # Q K^T's scores (H, T, S)
                out = Y[:, :x.shape[1], :x.shape[2]]
                if x.keep is not None and out.dtype != np.uint64:  # shares: the io masks them (`twopc_blb`)
                    out = out.copy()
                    out[:, ~x.keep] = -np.inf
                return out
            T, W = x.shape  # P V's output, (T, H hd)
            return np.ascontiguousarray(Y[:, :T, :W // L.heads].transpose(1, 0, 2)).reshape(T, W)
        if x.layout != "headsum":
            raise NotImplementedError(f"decoding a {x.layout!r} value")
        H, hd = self.hh
        _, T, S = x.shape
        nq, nk, U = x.cts.shape
        t, s, ok = _pair_index(R, nq, nk, x.shifts, T, S)
        d5 = dec.reshape(nq, nk, U, R, P)[..., np.arange(H) * hd]  # (nq, nk, U, R, H)
        out = np.zeros((H, T, S), dec.dtype)
        out[:, t[ok], s[ok]] = d5[ok].T
        if x.keep is not None and out.dtype != np.uint64:
            out[:, ~x.keep] = -np.inf
        return out

    # ---- levels
    def level_of(self, x: Packed) -> int:
        return x.first.level

    @staticmethod
    def each(x: Packed, fn) -> Packed:
        """``fn`` applied to every ciphertext of ``x`` (same layout and shape)."""
        cts = np.empty(x.cts.shape, object)
        for idx in np.ndindex(*x.cts.shape):
            cts[idx] = None if x.cts[idx] is None else fn(x.cts[idx])
        return dataclasses.replace(x, cts=cts)

    def copied(self, ct, inplace_op, *args):
        """A copy of ``ct`` with ``inplace_op(ctx, copy, *args)`` applied."""
        c = self.copy(ct)
        inplace_op(self.ctx, c, *args)
        return c

    def drop_to(self, x: Packed, level: int) -> Packed:
        if self.level_of(x) == level:
            return x
        return self.each(x, lambda c: self.copied(c, self.be.mod_switch_to_inplace, level))

    def align(self, a: Packed, b: Packed, additive: bool) -> tuple[Packed, Packed]:
        lvl = min(self.level_of(a), self.level_of(b))
        a, b = self.drop_to(a, lvl), self.drop_to(b, lvl)
        if additive:
            sa, sb = a.first.scale, b.first.scale
            if abs(sa / sb - 1) > 1e-12:
                raise NotImplementedError(f"addition of ciphertexts at scales 2^{math.log2(sa):.6f} and "
                                          f"2^{math.log2(sb):.6f} (matching them would cost a level)")
        return a, b

    # ---- operators
    def binary(self, op: str, a: Packed, b: Packed, out_shape: tuple) -> Packed:
        if a.layout != b.layout:
            raise NotImplementedError(f"{op} of a {a.layout!r} and a {b.layout!r} value")
        if a.start or b.start:
            raise NotImplementedError(f"{op} of an unscaled row sum inside the block (its broadcast would "
                                      "cost a level block_depth does not count)")
        if a.layout == "row" and a.shape[:-1] != b.shape[:-1]:
            raise NotImplementedError(f"{op} of row values with different rows: {a.shape} and {b.shape}")
        a, b = self.align(a, b, op in ("add", "sub"))
        ga, gb = np.broadcast_arrays(a.cts, b.cts)
        cts = np.empty(ga.shape, object)
        for idx in np.ndindex(*ga.shape):
            x, y = ga[idx], gb[idx]
            if op == "mul":
                self.stats["ct_ct"] += 1
                cts[idx] = self.rescale(self.be.multiply(self.ctx, x, y, self.evk))
            else:
                cts[idx] = self.copied(x, self.be.add_inplace if op == "add" else self.be.sub_inplace, y)
        dirty = (a.dirty and b.dirty) if op == "mul" else (a.dirty or b.dirty)
        big = a if a.cts.size >= b.cts.size else b
        return Packed(cts, a.layout, out_shape, dirty, shifts=big.shifts)

    def _chunk_pts(self, x: Packed, vec: np.ndarray, level: int, scale: float) -> list:
        """One plaintext per column chunk of a row value: ``vec`` (the row's width, or less)
        zero-padded, chunk k's period vector the same in every row."""
        K = x.cts.shape[-1]
        full = np.zeros(K * self.P)
        full[:len(vec)] = vec
        return [self.pt(full[k * self.P:(k + 1) * self.P], level, scale) for k in range(K)]

    def _each_chunk(self, x: Packed, fn) -> Packed:
        cts = np.empty(x.cts.shape, object)
        for idx in np.ndindex(*x.cts.shape):
            cts[idx] = None if x.cts[idx] is None else fn(x.cts[idx], idx[-1])
        return dataclasses.replace(x, cts=cts)

    def plain_mul(self, x: Packed, vec: np.ndarray) -> Packed:
        """x * a public row vector (one level; the scale unchanged)."""
        lvl = self.level_of(x)
        pts = self._chunk_pts(x, vec, lvl, self.q(lvl))
        self.stats["ct_pt"] += x.cts.size
        return self._each_chunk(x, lambda c, k: self.rescale(self.be.multiply_plain(self.ctx, c, pts[k])))

    def poly(self, x: Packed, coeffs) -> Packed:
        """sum_k c_k x^k for public reals c_k (GeLU's clamped form, the softmax's exp), in
        `blb_fusion.poly_depth` levels.  A monic polynomial of degree <= 4 as the product of
        its `blb_fusion.monic_factors` (z + H)^2 + K and z + H: constants added, squares and
        products of ciphertexts only (the result's scale is whatever those leave: the block's
        next additions encrypt their fresh operands at it).  Any other: x^k = x^(2^j)
        x^(k - 2^j) by ct-ct products (2^j the highest power of two below k), every power
        dropped to the deepest one's level, each multiplied by c_k encoded at the scale that
        brings the term to the block's scale exactly after one rescale (so that the terms
        add), then c_0 added.  Padding slots stay zero (the constants are period vectors
        over the row's width)."""
        coeffs = [float(c) for c in coeffs]
        if len(coeffs) < 2:
            raise NotImplementedError("poly of degree < 1 in CKKS")
        width = x.shape[-1]
        factors = blb_fusion.monic_factors(coeffs)
        if factors is not None:
            parts = []
            for h, k in factors:
                f = self.plain_add(x, np.full(width, h)) if h else x
                if k is not None:
                    f = self.binary("mul", f, f, x.shape)
                    f = self.plain_add(f, np.full(width, k)) if k else f
                parts.append(f)
            while len(parts) > 1:  # a balanced product tree
                parts = [self.binary("mul", parts[i], parts[i + 1], x.shape) if i + 1 < len(parts) else parts[i]
                         for i in range(0, len(parts), 2)]
            return parts[0]
        pw = {1: x}
        for k in range(2, len(coeffs)):
            h = 1 << ((k - 1).bit_length() - 1)
            pw[k] = self.binary("mul", pw[h], pw[k - h], x.shape)
        used = [k for k in pw if coeffs[k] != 0.0]
        if not used:
            raise NotImplementedError("poly with no term of degree >= 1 in CKKS")
        lvl = min(self.level_of(pw[k]) for k in used)
        acc = None
        for k in used:
            t = self.drop_to(pw[k], lvl)
            pts = self._chunk_pts(t, np.full(width, coeffs[k]), lvl, self.scale * self.q(lvl) / t.first.scale)
            self.stats["ct_pt"] += t.cts.size
            term = self._each_chunk(t, lambda c, j: self.rescale(self.be.multiply_plain(self.ctx, c, pts[j])))
            acc = term if acc is None else self.binary("add", acc, term, x.shape)
        if coeffs[0]:
            acc = self.plain_add(acc, np.full(width, coeffs[0]))
        return acc

    def plain_add(self, x: Packed, vec: np.ndarray) -> Packed:
        pts = self._chunk_pts(x, vec, self.level_of(x), x.first.scale)
        return self._each_chunk(x, lambda c, k: self.copied(c, self.be.add_plain_inplace, pts[k]))

    def linear(self, x: Packed, w: np.ndarray, bias: np.ndarray | None) -> Packed:
        """x W^T + b by the diagonal method on the stacked rows: per (output chunk, input chunk)
        block of W (at most P x P), its d_i + d_o - 1 diagonals k = -(d_o - 1) .. d_i - 1 (not
        cyclic: entry (i, i + k) where 0 <= i + k < d_i, zero elsewhere, so a rotation that
        reaches into a neighbouring row is multiplied by 0), baby-step giant-step:
        sum_j rot(sum_(chunk, i) rot(x_chunk, i) roll(d_(k0 + j b + i), k0 + j b), k0 + j b),
        the input chunks summed before each giant rotation."""
        if x.layout != "row":
            raise NotImplementedError(f"a projection of a {x.layout!r} value")
        if x.dirty or x.start:
            raise NotImplementedError("a projection of a value whose padding slots are not zero")
        P = self.P
        d_out, d_in = w.shape
        if x.shape[-1] != d_in:
            raise ValueError(f"projection of width {d_in} applied to a value of width {x.shape[-1]}")
        k_in = chunk_widths(d_in, P)
        k_out = chunk_widths(d_out, P)
        if x.cts.shape[-1] != len(k_in):
            raise ValueError(f"a value of {x.cts.shape[-1]} chunks for a projection of {len(k_in)}")
        lvl = self.level_of(x)
        if self.native:
            cts = self._native_linear(x, w, k_in, k_out, lvl)
        else:
            cts = self._linear_by_diagonals(x, w, k_in, k_out, lvl)
        out = Packed(cts, "row", x.shape[:-1] + (d_out,), False)
        if bias is not None:
            out = self.plain_add(out, np.asarray(bias, np.float64))
        return out

    def _native_linear(self, x: Packed, w: np.ndarray, k_in: list, k_out: list, lvl: int) -> np.ndarray:
        """`linear`'s products in one backend call (`blb_linear`: the diagonals made and
        encoded natively, each once for all rows, products accumulated in place, the (output
        chunk, giant step) units on all cores); the baby steps come from `_baby_steps`, so the
        projections of one input still share them.  Bit-identical to `_linear_by_diagonals`."""
        plans = [linear_plan(min(w.shape[1], self.P), do) for do in k_out]
        B = max(p[0] for p in plans)
        m = x.cts.shape[0]
        babies = np.empty((m, len(k_in), B), object)
        for r in range(m):
            for ki in range(len(k_in)):
                babies[r, ki] = self._baby_steps(x.cts[r, ki], B)
        t0 = time.perf_counter()
        cts, counts = self.be.blb_linear(self.ctx, babies, w, period=self.P, plans=plans,
                                         scale_bits=math.log2(self.q(lvl)), keys=self.evk, workers=_ENCODE_WORKERS)
        self.stats["native_linear_s"] += time.perf_counter() - t0
        if any(c is None for c in cts.reshape(-1)):
            raise ValueError("an all-zero projection block")
        self.stats["ct_pt"] += counts["ct_pt"]
        self.stats["rotations"] += counts["rotations"]
        self.stats["rescales"] += cts.size
        return cts

    def _linear_by_diagonals(self, x: Packed, w: np.ndarray, k_in: list, k_out: list, lvl: int) -> np.ndarray:
        """`linear`'s products here, diagonal by diagonal (the reference for `_native_linear`)."""
        P = self.P
        d_in = w.shape[1]
        rows = np.arange(P)
        m = x.cts.shape[0]
        cts = np.empty((m, len(k_out)), object)
        for ko, do in enumerate(k_out):
            b, g, k0 = linear_plan(min(d_in, P), do)
            # per row ciphertext and giant step: sum_(chunk, i) rot(x_chunk, i) pt_(chunk, j, i),
            # accumulated one input chunk at a time, so that only that chunk's diagonals are
            # encoded at once (all of them for a 3072-wide input were ~4 GB at N = 16384)
            inner: list[list] = [[None] * g for _ in range(m)]
            for ki, di in enumerate(k_in):
                t0 = time.perf_counter()
                blk = w[ko * P:ko * P + do, ki * P:ki * P + di]
                diags: dict[tuple[int, int], np.ndarray] = {}
                for j in range(g):
                    for i in range(b):
                        k = k0 + j * b + i
                        if k >= di:
                            continue
                        col = rows + k
                        ok = (rows < do) & (col >= 0) & (col < di)
                        if not ok.any():
                            continue
                        diag = np.zeros(P)
                        diag[ok] = blk[rows[ok], col[ok]]
                        if diag.any():
                            diags[j, i] = np.roll(diag, (k0 + j * b) % P)
                pts = dict(zip(diags, self.pts(list(diags.values()), lvl, self.q(lvl))))
                # the weights' encoding: input-independent (the server can do it ahead of time)
                self.stats["encode_weights_s"] += time.perf_counter() - t0
                steps = {}
                for j, i in pts:
                    steps.setdefault(j, []).append(i)
                for r in range(m):
                    babies = self._baby_steps(x.cts[r, ki], b)

                    def add_chunk(j, r=r, babies=babies):
                        """inner[r][j] += sum_i rot(x_chunk, i) pt_(chunk, j, i) (one thread per j;
                        Lattigo's evaluator may be called from several threads, >= 6.2)."""
                        acc = inner[r][j]
                        for i in steps[j]:
                            t = self.be.multiply_plain(self.ctx, babies[i], pts[j, i])
                            if acc is None:
                                acc = t
                            else:
                                self.be.add_inplace(self.ctx, acc, t)
                        inner[r][j] = acc

                    self.stats["ct_pt"] += len(pts)
                    live = sorted(steps)
                    if len(live) > 1:
                        list(_encode_pool().map(add_chunk, live))
                    else:
                        for j in live:
                            add_chunk(j)
                del pts
            for r in range(m):
                def giant(j, r=r):
                    """inner[r][j] rotated by the giant step k0 + j b."""
                    t = inner[r][j]
                    return t if not (k0 + j * b) % self.slots else self.be.rotate_rows(
                        self.ctx, t, (k0 + j * b) % self.slots, self.evk)

                live = [j for j in range(g) if inner[r][j] is not None]
                self.stats["rotations"] += sum(1 for j in live if (k0 + j * b) % self.slots)
                parts = _encode_pool().map(giant, live) if len(live) > 1 else map(giant, live)
                acc = None
                for t in parts:  # exact modular additions: the order does not matter
                    if acc is None:
                        acc = t
                    else:
                        self.be.add_inplace(self.ctx, acc, t)
                if acc is None:
                    raise ValueError("an all-zero projection block")
                cts[r, ko] = self.rescale(acc)
        return cts

    def _baby_steps(self, ct, b: int) -> list:
        """rot(ct, i) for i < b (hoisted), once per ciphertext and b: shared by the projections
        of one input (Q, K, V; gate, up)."""
        hit = self._babies.get((id(ct), b))
        if hit is not None and hit[0] is ct:
            return hit[1]
        babies = self.be.rotate_hoisted(self.ctx, ct, list(range(b)), self.evk)
        self.stats["rotations"] += b - 1
        self._babies[id(ct), b] = (ct, babies)
        return babies

    def forget_baby_steps(self, x: Packed) -> None:
        """Drop the cached baby steps of ``x``'s ciphertexts (after the last projection that
        reads it: b rotations of each ciphertext, ~2 GB for a 3072-wide input at N = 16384)."""
        for ct in x.cts.reshape(-1):
            for key in [k for k in self._babies if k[0] == id(ct)]:
                del self._babies[key]

    def reduce_sum(self, x: Packed, scale: float) -> Packed:
        """Row sums: a rotate-and-sum over the period (log2 P rotations) leaves row r's sum in
        its first slot r P.  With a scale (a mean's 1/d) that slot is masked (the scale there,
        0 elsewhere: one level) and spread back over the row's C slots by a rotate-and-sum the
        other way (log2 C rotations): the broadcast of Figure 6.  Without a scale the sum
        stays in the first slot (``start``): only a block output (the rsqrt / reciprocal
        core's input) reads it, and the conversion reads that slot."""
        if x.layout != "row":
            raise NotImplementedError(f"reduce_sum of a {x.layout!r} value")
        if x.dirty or x.start:
            raise NotImplementedError("reduce_sum of a value whose padding slots are not zero")
        C = x.shape[-1]
        sums = np.empty((x.cts.shape[0], 1), object)
        for r in range(x.cts.shape[0]):  # the column chunks first (additions), then within the period
            acc = self.copy(x.cts[r, 0])
            for k in range(1, x.cts.shape[1]):
                self.be.add_inplace(self.ctx, acc, x.cts[r, k])
            sums[r, 0] = self.rot_sum(acc, self.P)
        out = Packed(sums, "row", x.shape[:-1] + (1,), True, start=True)
        if scale == 1.0:
            return out
        mask = np.zeros(self.P)
        mask[0] = scale
        lvl = self.level_of(out)
        p = self.pt(mask, lvl, self.q(lvl))
        self.stats["ct_pt"] += out.cts.size
        # spread before the rescale: its rounding (and the rotations' key-switch noise, divided
        # by the prime) lands once per slot, not summed over C slots
        w = min(C, self.P)
        out = self.each(out, lambda c: self.rescale(self.rot_sum(self.be.multiply_plain(self.ctx, c, p), w, -1)))
        out.dirty, out.start = C > self.P and C % self.P != 0, False
        return out

    def qk(self, q: Packed, k: Packed, attrs: dict, pos0: int = 0) -> Packed:
        """Q K^T on the pair grid: per (query ciphertext a, key ciphertext b, shift u),
        Q_a * rot(K_b, u P) (row r of a faces key row (r + u) mod R of b), relinearised and
        summed over each head's hd slots (the score in slot r P + h hd); the public scale
        (1 / sqrt(hd)) applied to the ciphertext's scale (no level).  A causal mask is public:
        a ciphertext none of whose pairs is kept is not computed; masked pairs decode as -inf."""
        H, hd = int(attrs["heads"]), int(attrs["head_dim"])
        if q.shape[-1] != H * hd or k.shape[-1] != H * hd:  # K repeated per query head (grouped-query)
            raise ValueError(f"qk of widths {q.shape[-1]}, {k.shape[-1]} with {H} heads of {hd}")
        if q.layout != "row" or k.layout != "row" or q.cts.shape[-1] != 1 or k.cts.shape[-1] != 1:
            raise NotImplementedError("qk of values not in the row layout (one chunk)")
        q, k = self.align(q, k, False)
        T, S = q.shape[0], k.shape[0]
        keep = score_mask(attrs, T, S, pos0)  # public: the masked scores are not computed (-inf at the output)
        shifts = pair_shifts(self.R, T, S)
        nq, nk = q.cts.shape[0], k.cts.shape[0]
        t, s, ok = _pair_index(self.R, nq, nk, shifts, T, S)
        wanted = ok & keep[np.minimum(t, T - 1), np.minimum(s, S - 1)]
        krot = self.shifted(k.cts[:, 0], shifts)
        cts = np.empty((nq, nk, len(shifts)), object)
        for a in range(nq):
            for b in range(nk):
                for ui, u in enumerate(shifts):
                    if not wanted[a, b, ui].any():
                        continue
                    self.stats["ct_ct"] += 1
                    prod = self.be.multiply(self.ctx, q.cts[a, 0], krot[b][u], self.evk)
                    summed = self.rot_sum(prod, hd)
                    self.rescale(summed)
                    self.be.scale_message_inplace(self.ctx, summed, 1.0 / float(attrs.get("scale", 1.0)))
                    cts[a, b, ui] = summed
        return Packed(cts, "headsum", (H, T, S), keep=None if keep.all() else keep, shifts=shifts)

    # ---- section 5's packing
    def relayout(self, name: str, x: Packed, layout: str) -> Packed:
        """``x`` in another packing: out to the io and back in (in the 2pc mode a conversion
        round trip, CKKS -> shares -> CKKS, with the change of packing a local permutation of
        each party's shares: BLB section 5.2's repack); fresh, at the block's start level and
        scale.  Once per value and layout."""
        key = (name, layout)
        if key not in self._relaid:
            self.stats["relayouts"] += 1
            vals = self.decrypt(name, x)
            self._relaid[key] = self.encrypt(name, vals, layout, self.top, self.scale)
        return self._relaid[key]

    def ck(self) -> CkksEvaluator:
        if self._ck is None:
            self._ck = CkksEvaluator(self.be, self.ctx, self.evk, levels_only=True)
        return self._ck

    def fused(self, a: Packed, b: Packed, L: "blb_matmul.MHLayout", scale: float, out_shape: tuple) -> Packed:
        """Section 5's fused ct-ct MatMul (`blb_matmul.fused_matmul`, BSGS, multi-head): ``a`` in
        mh_cols, ``b`` in mh_cols (K: Q K^T) or mh_rows (V: P V); the result in mh_diag, times
        a public ``scale`` on the ciphertexts' scale (no level)."""
        for x, kinds in ((a, ("mh_cols",)), (b, ("mh_cols", "mh_rows"))):
            got = mh_layout(x.layout, self.slots, self.hh[0])
            if got is None or got[0] not in kinds or got[1] != L:
                raise NotImplementedError(f"a fused product of a {x.layout!r} operand (want {kinds} of {L})")
        ck = self.ck()
        ck.stats.counts.clear()
        out = blb_matmul.fused_matmul(ck, list(a.cts), list(b.cts), L, pool=_encode_pool(), workers=_ENCODE_WORKERS)
        for kind, key in (("rotate", "rotations"), ("mul", "ct_ct"), ("mul_plain", "ct_pt"), ("rescale", "rescales")):
            self.stats[key] += ck.stats.counts.get(kind, 0)
        cts = np.empty(len(out), object)
        for i, ct in enumerate(out):
            if scale != 1.0:
                self.be.scale_message_inplace(self.ctx, ct, 1.0 / scale)
            cts[i] = ct
        return Packed(cts, mh_name("mh_diag", L), out_shape)

    def rope(self, x: Packed, attrs: dict, positions: np.ndarray) -> Packed:
        """RoPE per row t (position positions[t]): x cos + rot(x, a) sin1 + rot(x, -a) sin2 with
        a = hd / 2 (rotate_half) or 1 (interleaved pairs), the signs, masks and each row's
        angles in the plaintexts (a rotation never leaves a head's segment where the plaintext
        is nonzero); one rescale for the three products."""
        from . import ops

        if x.layout != "row" or len(x.shape) != 2 or x.cts.shape[-1] != 1:
            raise NotImplementedError("rope of a value not in the row layout (one chunk)")
        H, hd = int(attrs["heads"]), int(attrs["head_dim"])
        if x.shape[-1] != H * hd or hd % 2:
            raise NotImplementedError(f"rope of width {x.shape[-1]} with {H} heads of {hd}")
        inter = bool(attrs.get("interleave"))
        a = 1 if inter else hd // 2
        inv = ops.rope_inv_freq(hd, float(attrs["theta"]))
        j = np.arange(hd)
        freq_of = inv[j // 2] if inter else inv[j % (hd // 2)]
        first = (j % 2 == 0) if inter else (j < hd // 2)  # reads x[j + a] with -sin; the others x[j - a], +sin
        lvl = self.level_of(x)
        T = x.shape[0]
        cts = np.empty(x.cts.shape, object)
        for ci, c in enumerate(x.cts[:, 0]):
            vecs = [np.zeros((self.R, self.P)) for _ in range(3)]
            for r in range(self.R):
                t = ci * self.R + r
                if t >= T:
                    break
                ang = float(positions[t]) * freq_of
                for vec, v in zip(vecs, (np.cos(ang), np.where(first, -np.sin(ang), 0.0),
                                         np.where(first, 0.0, np.sin(ang)))):
                    vec[r, :H * hd] = np.tile(v, H)
            pts = [self.pt(v.reshape(-1), lvl, self.q(lvl)) for v in vecs]
            acc = self.be.multiply_plain(self.ctx, c, pts[0])
            self.be.add_inplace(self.ctx, acc, self.be.multiply_plain(self.ctx, self.rot(c, a), pts[1]))
            self.be.add_inplace(self.ctx, acc, self.be.multiply_plain(self.ctx, self.rot(c, -a), pts[2]))
            self.stats["ct_pt"] += 3
            cts[ci, 0] = self.rescale(acc)
        return Packed(cts, "row", x.shape, False)

    def av(self, p: Packed, v: Packed, attrs: dict) -> Packed:
        """P V: per query ciphertext a, sum over (b, u) of P_(a, b, u) * rot(V_b, u P): row r,
        head segment h collects sum_s p[h, t, s] V[s, h]; already in the row layout."""
        H, hd = int(attrs["heads"]), int(attrs["head_dim"])
        if v.shape[-1] != H * hd:
            raise ValueError(f"av of a V of width {v.shape[-1]} with {H} heads of {hd}")
        if p.layout != "head" or v.layout != "row" or v.cts.shape[-1] != 1:
            raise NotImplementedError(f"av of a {p.layout!r} and a {v.layout!r} value")
        p, v = self.align(p, v, False)
        nq, nk, U = p.cts.shape
        if nk != v.cts.shape[0] or len(p.shifts) != U:
            raise NotImplementedError(f"av: a probability grid {p.cts.shape} for {v.cts.shape[0]} key ciphertexts")
        vrot = self.shifted(v.cts[:, 0], p.shifts)
        T = p.shape[1]
        cts = np.empty((nq, 1), object)
        for a in range(nq):
            acc = None
            for b in range(nk):
                for ui, u in enumerate(p.shifts):
                    if p.cts[a, b, ui] is None:
                        continue
                    self.stats["ct_ct"] += 1
                    prod = self.be.multiply(self.ctx, p.cts[a, b, ui], vrot[b][u], self.evk)
                    if acc is None:
                        acc = prod
                    else:
                        self.be.add_inplace(self.ctx, acc, prod)
            cts[a, 0] = self.rescale(acc)
        return Packed(cts, "row", (T, v.shape[-1]), False)


class LocalIO:
    """The conversions' stand-in of a single process holding the secret keys: an input is
    encoded and encrypted, an output decrypted and decoded (tests, `benchmarks/blb_block_errors.py`;
    the 2pc mode's `runtime.twopc_blb` converts from / to shares instead)."""

    def __init__(self, keys):
        self.keys = keys

    def encrypt(self, ev: "_Eval", name: str, arr, layout: str, level: int, scale: float) -> Packed:
        vecs, dirty, shifts = ev.slot_vectors(arr, layout)
        grid = vecs.shape[:-1]
        cts = np.empty(grid, object)
        for idx in np.ndindex(*grid):
            cts[idx] = self.keys.encrypt(ev.pt(vecs[idx], level, scale))
        return Packed(cts, layout, tuple(np.asarray(arr).shape), dirty, shifts=shifts)

    def decrypt(self, ev: "_Eval", name: str, x: Packed) -> np.ndarray:
        dec = np.zeros(x.cts.shape + (ev.slots,))
        for idx in np.ndindex(*x.cts.shape):
            if x.cts[idx] is not None:
                dec[idx] = ev.be.decode_slots(ev.ctx, self.keys.decrypt(x.cts[idx]), n=ev.slots)
        return ev.unpack(dec, x)


def _fold_affine(graph: Graph, aff, w: np.ndarray, b: np.ndarray | None, params: dict):
    """W diag(gamma), b + W beta for a projection reading affine ``aff``."""
    g = aff.attrs.get("gamma")
    be = aff.attrs.get("beta")
    w2 = w * np.asarray(params[g], np.float64)[None, :] if g else w
    b2 = np.zeros(w.shape[0]) if b is None else np.asarray(b, np.float64)
    if be:
        b2 = b2 + w @ np.asarray(params[be], np.float64)
    return w2, (b2 if (b is not None or be) else None)


def check_block(graph: Graph, block: dict) -> None:
    """NotImplementedError naming the first op of ``block`` `evaluate_block` cannot run."""
    for name in block["nodes"]:
        n = graph.node(name)
        if n.op not in SUPPORTED:
            raise NotImplementedError(f"CKKS evaluation of a fused block: op {n.op!r} ({n.name}) is not supported "
                                      f"(supported: {', '.join(SUPPORTED)})")
        if n.op == "rope" and n.attrs.get("rotary_dim") not in (None, n.attrs.get("head_dim")):
            raise NotImplementedError(f"CKKS evaluation of a fused block: partial RoPE ({n.name})")


def split_of(graph: Graph, block: dict, node):
    """The ``split`` node of the block that alone reads a projection's output (GPT-2's fused
    Q / K / V projection), so that the projection runs as one product per piece; else None."""
    if node is None or node.op != "linear":
        return None
    readers = graph.consumers().get(node.out, [])
    if len(readers) != 1 or readers[0].op != "split" or readers[0].name not in block["nodes"]:
        return None
    sp = readers[0]
    return None if sp.attrs.get("heads") or sum(sp.attrs["sizes"]) != int(node.attrs["d_out"]) else sp


def kv_inputs_as_rows(graph: Graph, block: dict, inputs: dict) -> dict:
    """The block's inputs with each K / V of `kv_expansion` as rows (S, H hd): (H_kv, S, hd)
    from the cache or (S, H_kv hd), each KV head repeated for its query heads.  Copies only, so
    it applies to arrays and to one party's shares alike (the 2pc client lays its shares out
    as the server does: `runtime.twopc_blb`)."""
    out = dict(inputs)
    for v, (r, hd) in kv_expansion(graph, block).items():
        if v in out and (r > 1 or len(value_shape(out[v])) == 3):
            a = out[v]
            if isinstance(a, (list, tuple)) or not hasattr(a, "transpose"):
                a = np.asarray(a, np.float64)
            a = a.transpose(1, 0, 2) if len(a.shape) == 3 else a.reshape(a.shape[0], -1, hd)
            if r > 1:
                a = a[:, np.repeat(np.arange(a.shape[1]), r), :]
            out[v] = a.reshape(a.shape[0], -1)
    return out


def kv_expansion(graph: Graph, block: dict) -> dict[str, tuple[int, int]]:
    """Grouped-query attention: {value: (H / H_kv, head_dim)} for the K / V values the block
    carries with each KV head repeated for its query heads (the projection's rows repeated:
    no extra operation)."""
    nodes = [graph.node(n) for n in block["nodes"]]
    prod = graph.producers()
    in_block = {n.name for n in nodes}
    expand: dict[str, tuple[int, int]] = {}
    todo = [(n.inputs[1], (int(n.attrs["heads"]) // int(n.attrs["kv_heads"]), int(n.attrs["head_dim"])))
            for n in nodes if n.op in ("qk", "av")]
    while todo:
        v, r = todo.pop()
        if expand.setdefault(v, r) != r:
            raise NotImplementedError(f"{v}: read by attention nodes of different head groupings")
        p = prod.get(v)
        if p is None or p.name not in in_block or p.op == "linear":
            continue
        if p.op == "kv_cache":
            todo.append((p.inputs[list(p.outputs).index(v)], r))
        elif p.op == "rope":
            todo.append((p.inputs[0], r))
        elif r[0] > 1:
            raise NotImplementedError(f"{p.name} ({p.op}): cannot carry grouped-query K / V repeated per query head")
    return expand



def block_tokens(inputs: dict) -> int:
    """T: the rows of the block's first two-dimensional input (a (T, C) activation), else the
    query axis of a (H, T, S) one."""
    shapes = [value_shape(x) for x in inputs.values()]
    two = [sh[0] for sh in shapes if len(sh) == 2]
    if two:
        return int(two[0])
    three = [sh[1] for sh in shapes if len(sh) == 3]
    return int(three[0]) if three else 1


def evaluate_block(graph: Graph, block: dict, inputs: dict[str, np.ndarray], params: dict[str, np.ndarray],
                   ctx, be, keys, evk=None, *, scale_bits: int | None = None, positions=None, pos0: int = 0,
                   stats: dict | None = None, io=None, attention: str = "auto",
                   tokens: int | None = None, period: int | None = None,
                   start_level: int | None = None) -> dict[str, np.ndarray]:
    """The block's outputs {value: array} computed in CKKS (module doc).  ``inputs``: every
    value of ``block["inputs"]`` as a plaintext array; ``params``: the bound weights
    (`compile.bind`); ``ctx`` / ``be`` / ``keys``: a Lattigo context at the block's
    parameters (`blb_params.BlockParams.he_params`), its backend and secret keys; ``evk``:
    relinearisation and rotation keys for `block_steps` (made here if None);
    ``scale_bits``: the block's scale (default: the top prime's size); ``positions`` (RoPE,
    default pos0 + row index) and ``pos0`` (causal masks) as the executor's ctx has them; a
    KV cache is taken as empty (prefill: its values are this block's K and V).  ``stats``, if
    given, receives the counts of products, rotations and rescales, the period and the levels.
    ``io``: how inputs become ciphertexts and outputs come back (`LocalIO(keys)` by default;
    the 2pc mode's conversions: `runtime.twopc_blb`); with an ``io``, ``keys`` may be None
    and the inputs / outputs are whatever the io takes and returns (shares).  ``attention``:
    the packing of Q K^T / P V (`blb_params.ATTENTION_PACKINGS`, resolved at ``tokens``,
    default `block_tokens` of the inputs); it must be the one ``params`` were chosen for
    (`blb_params.run(..., attention=, tokens=)`: section 5's products take more levels).
    ``period``: the slots per row (default `block_period`, the fewest ciphertexts; any power
    of two at least the core widths works, wider values in column chunks).  ``start_level``:
    the level fresh inputs are encrypted at (default the top, ``ctx.max_level``); a block in a
    shared parameter set (`blb_params.share_sets`) needs only its own depth above the output
    primes (`blb_params.BlockParams.start_level`), and every prime less is one less in each
    conversion into the block."""
    check_block(graph, block)
    nodes = [graph.node(n) for n in block["nodes"]]
    missing = [i["value"] for i in block["inputs"] if i["value"] not in inputs]
    if missing:
        raise ValueError(f"block {block['id']}: missing inputs {missing}")
    inputs = kv_inputs_as_rows(graph, block, inputs)
    prod = graph.producers()
    in_block = {n.name for n in nodes}
    expand = kv_expansion(graph, block)
    tokens = block_tokens(inputs) if tokens is None else int(tokens)
    mh = attention_layouts(graph, block, ctx.slots, tokens, attention)
    if period is None:
        period = block_period(graph, block, inputs, ctx.slots, fused=mh)
    elif period & (period - 1) or not core_period(graph, block, mh) <= period <= ctx.slots:
        raise ValueError(f"block {block['id']}: period {period} is not a power of two in "
                         f"[{core_period(graph, block, mh)}, {ctx.slots}]")
    elif not spread_fits(period, widths := spread_widths(graph, block, tokens)):
        raise ValueError(f"block {block['id']}: period {period} is narrower than a mean's width and does not "
                         f"divide it ({widths})")
    if evk is None:
        evk = keys.eval_keys(relin=True, steps=block_steps(graph, block, period, ctx.slots, tokens, attention))
    if scale_bits is None:
        scale_bits = round(math.log2(ctx.q_moduli[ctx.max_level]))
    ev = _Eval(ctx, be, io if io is not None else LocalIO(keys), evk, period, scale_bits, blb_params.block_attention(graph, block))
    lay = assign_layouts(graph, block, mh)
    depth, _, folded = block_depth(nodes, prod, fused=bool(mh))
    top = ctx.max_level if start_level is None else int(start_level)
    if not depth <= top <= ctx.max_level:
        raise ValueError(f"block {block['id']}: start level {top} outside [{depth} (its depth), {ctx.max_level}]")
    ev.top = top

    cts: dict[str, Packed] = {}
    deepest = top  # the lowest level any value of the block reaches
    # the last projection of each value (its baby steps are dropped after it)
    last_projection = {n.inputs[0]: n.name for n in nodes if n.op == "linear"}

    fresh: dict[tuple, Packed] = {}

    def get(v: str, like: Packed | None = None, additive: bool = False) -> Packed:
        if v in cts:
            return cts[v]
        if v not in inputs:
            raise ValueError(f"value {v} is neither a block input nor computed before its use")
        if like is None:
            level, scale = top, ev.scale
        else:
            level, scale = ev.level_of(like), (like.first.scale if additive else ev.scale)
        key = (v, level, scale)
        if key not in fresh:  # one encryption per input, level and scale
            fresh[key] = ev.encrypt(v, inputs[v], lay.get(v, "row"), level, scale)
        return fresh[key]

    def as_layout(v: str, x: Packed, layout: str) -> Packed:
        """``x`` (value ``v``) in ``layout`` (`_Eval.relayout` when it is in another one)."""
        return x if x.layout == layout else ev.relayout(v, x, layout)

    def pair(n):
        a_in, b_in = n.inputs[0], n.inputs[-1]
        additive = n.op in ("add", "sub")
        if a_in in cts or b_in not in cts:
            a = get(a_in)
            b = cts[b_in] if b_in in cts else (a if b_in == a_in else get(b_in, a, additive))
        else:
            b = cts[b_in]
            a = get(a_in, b, additive)
        return a, b

    for n in nodes:
        op = n.op
        if op == "affine" and _only_folded(n, nodes, folded) and n.out not in {o["value"] for o in block["outputs"]}:
            continue
        if op in ("add", "sub", "mul"):
            a, b = pair(n)
            shape = tuple(np.broadcast_shapes(a.shape, b.shape))
            out = ev.binary(op, a, b, shape)
        elif op == "linear":
            name = n.attrs["name"]
            w = np.asarray(params[f"{name}.weight"], np.float64)
            bias = np.asarray(params[f"{name}.bias"], np.float64) if n.attrs.get("bias") else None
            src = n.inputs[0]
            p = prod.get(src)
            if p is not None and p.name in in_block and p.op == "affine":
                w, bias = _fold_affine(graph, p, w, bias, params)
                src = p.inputs[0]
            r, hd = expand.get(n.out, (1, 0))
            if r > 1:  # K / V of grouped-query attention: each KV head's rows once per query head
                w = np.repeat(w.reshape(-1, hd, w.shape[1]), r, axis=0).reshape(-1, w.shape[1])
                bias = None if bias is None else np.repeat(bias.reshape(-1, hd), r, axis=0).reshape(-1)
            x = as_layout(src, get(src), "row")
            sp = split_of(graph, block, n)
            if sp is None:
                out = ev.linear(x, w, bias)
                out.rep = (r, hd)
            else:  # a fused projection (GPT-2's c_attn) read only by a split: one product per piece
                lo = 0
                for v, size in zip(sp.outputs, sp.attrs["sizes"]):
                    cts[v] = ev.linear(x, w[lo:lo + size], None if bias is None else bias[lo:lo + size])
                    lo += size
                out = cts[sp.outputs[0]]
            if last_projection.get(n.inputs[0]) == n.name:
                ev.forget_baby_steps(x)
        elif op == "split":
            if split_of(graph, block, prod[n.inputs[0]]) is not n:
                raise NotImplementedError(f"{n.name}: a split of anything but a projection it alone reads")
            out = cts[n.out]
        elif op == "affine":
            x = get(n.inputs[0])
            g, bt = n.attrs.get("gamma"), n.attrs.get("beta")
            if g:
                x = ev.plain_mul(x, np.asarray(params[g], np.float64))
            if bt:
                x = ev.plain_add(x, np.asarray(params[bt], np.float64))
            out = x
        elif op == "reduce_sum":
            out = ev.reduce_sum(get(n.inputs[0]), float(n.attrs.get("scale", 1.0)))
        elif op == "poly":
            out = ev.poly(get(n.inputs[0]), n.attrs["coeffs"])
        elif op == "qk" and n.name in mh:
            L = mh[n.name]
            cols = mh_name("mh_cols", L)
            q = as_layout(n.inputs[0], get(n.inputs[0]), cols)
            k = as_layout(n.inputs[1], get(n.inputs[1]), cols)
            S = k.shape[-2] if len(k.shape) == 3 else k.shape[0]  # K as rows (S, H hd) or per KV head (H_kv, S, hd)
            out = ev.fused(q, k, L, float(n.attrs.get("scale", 1.0)), (int(n.attrs["heads"]), q.shape[0], S))
            keep = score_mask(n.attrs, q.shape[0], S, pos0)  # every pair computed; the mask at the output
            out.keep = None if keep.all() else keep
        elif op == "av" and n.name in mh:
            L = mh[n.name]
            v = as_layout(n.inputs[1], get(n.inputs[1]), mh_name("mh_rows", L))
            p_ = cts[n.inputs[0]] if n.inputs[0] in cts else get(n.inputs[0])
            out = ev.fused(p_, v, L, 1.0, (p_.shape[1], int(n.attrs["heads"]) * int(n.attrs["head_dim"])))
        elif op == "qk":
            q = get(n.inputs[0])
            k = cts[n.inputs[1]] if n.inputs[1] in cts else get(n.inputs[1], q)
            out = ev.qk(q, k, n.attrs, pos0)
        elif op == "rope":
            x = get(n.inputs[0])
            pos = pos0 + np.arange(x.shape[0]) if positions is None else np.asarray(positions)
            hd = int(n.attrs["head_dim"])
            out = ev.rope(x, {**n.attrs, "heads": x.shape[-1] // hd}, pos)
            out.rep = x.rep
        elif op == "kv_cache":  # prefill into an empty cache: the same ciphertexts, read per head
            for v, src in zip(n.outputs, n.inputs):
                x = get(src)
                cts[v] = Packed(x.cts, x.layout, x.shape, x.dirty, heads=True,
                                rep=x.rep if x.rep[0] > 1 else (1, int(expand.get(v, (1, 0))[1]) or ev.hh[1]))
            continue
        elif op == "av":
            v = get(n.inputs[1])
            p_ = cts[n.inputs[0]] if n.inputs[0] in cts else get(n.inputs[0], v)
            out = ev.av(p_, v, n.attrs)
        elif op == "head":
            x = get(n.inputs[0])
            sel = n.attrs.get("select")
            if sel not in ("first", "last_or_all") or x.layout != "row":
                raise NotImplementedError(f"head {sel!r} in CKKS (only 'first', 'last_or_all')")
            # a decoder's "last_or_all": every row (a whole pass; the executor keeps the last one
            # where it wants only that)
            out = x if sel == "last_or_all" else Packed(x.cts[:1].copy(), "row", (1,) + x.shape[1:], x.dirty)
        else:  # pragma: no cover - SUPPORTED is checked above
            raise NotImplementedError(op)
        cts[n.out] = out
        deepest = min(deepest, ev.level_of(out))

    result = {}
    levels = {}
    for o in block["outputs"]:
        v = o["value"]
        if v not in cts:
            raise ValueError(f"block {block['id']}: output {v} was not computed")
        result[v] = ev.decrypt(v, cts[v])
        levels[v] = ev.level_of(cts[v])
    if stats is not None:
        stats.update(ev.stats, period=period, levels=levels, top_level=top, deepest=deepest,
                     attention="fused" if mh else "rows")
    return result


def predicted_max_error(graph, block, value: str, bparams, gains: dict | None = None,
                        tokens: int = 128, attention: str = "auto") -> tuple[float, float, float]:
    """(the noise model's predicted maximum error of one output ``value``, absolute, value
    units: ``blb_params.SIGMAS`` x its std; its magnitude bound; the target the parameters
    were chosen for, 2^-(f+1) max(1, its floor)): `blb_params.output_errors` for that output,
    what `evaluate_block`'s error is checked against (`tests/test_blb_block.py`,
    `benchmarks/blb_block_errors.py`).  ``bparams``: the block's `blb_params.BlockParams`."""
    model = blb_params.NoiseModel(bparams.ring_degree, bparams.scale_bits)
    fused = blb_params.block_fused(graph, block, attention, tokens)
    sigma, mag, floor = blb_params.output_errors(graph, {**block, "outputs": [{"value": value}]}, model, gains,
                                                 tokens, fused)[value]
    return blb_params.SIGMAS * sigma, mag, blb_params.SIGMAS * bparams.target * max(1.0, floor)

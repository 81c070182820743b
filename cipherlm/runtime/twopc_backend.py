"""The 2pc mode's operators on secret shares: the backend the graph executor walks.

`SharesBackend` has one method per graph op (`cipherlm.compile.ir.OPS`), as the
plain `graph_executor.PlainBackend` has in numpy; `ShareLinear` is the
`LinearBackend` of a projection group (one HE product for the group's stacked
weights, `cipherlm.protocols.linear.linear`); `ShareKVCache` holds the cached
keys and values in shares. Values are `AShare`s over Z_2^64 (16 fraction bits),
except two kinds that cost nothing to move:

* `ServerRows`: rows of a server table at public indices (BERT's and GPT-2's
  position and token-type embeddings): the server adds them to its own share;
* `Scores`: Q K^T shares with the public mask the softmax applies.

What each operator runs (BLB sections 2.3-3, Bumblebee's nonlinear protocols in
`cipherlm.mpc.nonlinear`) is in the module docstring of `cipherlm.runtime.twopc`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cipherlm.mpc import nonlinear as nl
from cipherlm.mpc.context import MPCError
from cipherlm.mpc.protocols.mul import cross_term, square
from cipherlm.mpc.protocols.trunc import trunc_faithful, trunc_local
from cipherlm.mpc.ring import fixed_encode, mask
from cipherlm.mpc.shares import AShare, concatenate

from . import ops
from .graph_executor import _heads, causal_keep

#: fraction bits of the RMSNorm statistics (row mean of squares and its 1/sqrt):
#: more than the ring's 16 so that 1/sqrt of LLaMA's massive-activation rows
#: (mean square ~1e6 in SmolLM2) keeps ~1e-3 relative precision
NORM_FRAC = 20
#: RMSNorm: rsqrt range of the mean square (covers SmolLM2's 0.008 .. 1.1e6)
RMS_LO, RMS_HI = 2.0 ** -12, 2.0 ** 22
#: LayerNorm (BERT, GPT-2): variance range (MiniLM: 0.0034 .. 130)
LN_VAR_LO, LN_VAR_HI = 2.0 ** -10, 2.0 ** 12
#: graph activations and their share protocols (GeLU: one approximation serves the erf
#: and tanh forms, max abs error ~0.005 against either)
ACTIVATIONS = {"silu": nl.silu, "gelu": nl.gelu, "gelu_tanh": nl.gelu}


class TwoPCError(MPCError):
    """The model or the request cannot run in the 2pc mode."""


# ----------------------------------------------------------------------------- share helpers


def add_private(ctx, x: AShare, v, owner: int = 1) -> AShare:
    """x + v where v (a real array broadcastable to x) is known to `owner` only: it adds
    v to its own share (free)."""
    if ctx.party != owner:
        return x
    enc = fixed_encode(np.broadcast_to(np.asarray(v, np.float64), x.shape), x.frac, x.bits)
    return AShare(ctx, (x.data + enc) & mask(x.bits), x.bits, x.frac)


def scale_private(ctx, x: AShare, v, owner: int = 1) -> AShare:
    """x * v elementwise, v real (broadcast over x) known to `owner` only.

    x v = x_owner v + x_other v: the first term is local, the second one Gilboa
    cross term (correlated OT, `mpc.protocols.mul.cross_term`, CrypTFlow2
    section 4.1) with the owner as OT sender; then SecureML local truncation."""
    bits, f = x.bits, x.frac
    flat = x.data.reshape(-1)
    if ctx.party == owner:
        enc = fixed_encode(np.broadcast_to(np.asarray(v, np.float64), x.shape), f, bits).reshape(-1)
        out = flat * enc + cross_term(ctx, enc, bits, sender=owner)
    else:
        out = cross_term(ctx, flat, bits, sender=owner)
    prod = AShare(ctx, (out & mask(bits)).reshape(x.shape), bits, 2 * f)
    return trunc_local(ctx, prod, f)


def check_ids(ids, n: int, vocab: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size != n:
        raise TwoPCError(f"expected {n} token ids, got {ids.size}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise TwoPCError(f"token id out of range 0..{vocab - 1}")
    return ids


def client_one_hot(ctx, ids: np.ndarray | None, n: int, vocab: int) -> AShare:
    """The client's tokens as a shared one-hot (n, vocab): the client's share is the one-hot
    at the ring's scale, the server's is 0 (no message: the client's input stays in its share)."""
    ring = ctx.ring
    data = np.zeros((n, vocab), np.uint64)
    if ctx.party == 0:
        ids = check_ids(ids, n, vocab)
        data[np.arange(n), ids] = np.uint64(1 << ring.frac)
    return AShare(ctx, data, ring.bits, ring.frac)


def rms_factor(d: int) -> tuple[int, float]:
    """d = 2^k c with c in [1, 2): the row mean of squares is taken as sum / 2^k (exact shift)."""
    k = int(math.floor(math.log2(d)))
    return k, d / 2.0 ** k


def rms_statistic(ctx, x: AShare, eps: float) -> AShare:
    """x * rsqrt(sum(x^2)/2^k + c eps), so that RMSNorm(x) = this * sqrt(c) * gamma (d = 2^k c).

    Squares in the ring at 14 fraction bits (no truncation; within 2 units of 2^-28
    with the HE product), row sums exact, one faithful truncation per row (CrypTFlow2 section 5) to the mean at
    ``NORM_FRAC`` bits, rsqrt by bracket + Newton (`nonlinear.rsqrt`) on
    [RMS_LO, RMS_HI], one fixed-point product per element (Bumblebee section 4.3)."""
    d = x.shape[-1]
    k, c = rms_factor(d)
    x14 = trunc_local(ctx, x, x.frac - 14) if x.frac > 14 else x
    # frac 28; the HE product's +-2 units at 2^-28 per element vanish in the truncation below
    s = square(ctx, x14, exact=False).sum(axis=-1, keepdims=True)
    ms = trunc_faithful(ctx, s, 28 - NORM_FRAC + k)
    ms = AShare(ctx, ms.data, ms.bits, NORM_FRAC).add_public_fixed(c * eps)
    r = nl.rsqrt(ctx, ms, RMS_LO, RMS_HI)
    # |x r| <= 2^(k/2) <= sqrt(d): the normalising product runs in its narrow ring
    return nl.mulf(ctx, x, r.broadcast_to(x.shape), bound=nl.normalized_bound(d))


def rope_shares(ctx, x: AShare, positions: np.ndarray, inv_freq: np.ndarray) -> AShare:
    """RoPE (rotate-half convention) on shares, x (H, T, hd): x cos + rot(x) sin with public
    cos/sin; both products accumulate before one local truncation (free)."""
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    f = x.frac
    cos = fixed_encode(np.cos(emb), f, x.bits)
    sin = fixed_encode(np.sin(emb), f, x.bits)
    half = x.shape[-1] // 2
    rot = np.concatenate([np.uint64(0) - x.data[..., half:], x.data[..., :half]], axis=-1)
    prod = AShare(ctx, (x.data * cos + rot * sin) & mask(x.bits), x.bits, 2 * f)
    return trunc_local(ctx, prod, f)


# ----------------------------------------------------------------------------- values


@dataclass
class ServerRows:
    """Rows of a server table at public indices; None at the client (who adds nothing)."""

    rows: np.ndarray | None


@dataclass
class Scores:
    """Q K^T shares (H, T, S) and the public mask (T, S) of positions kept (None: all)."""

    s: AShare
    keep: np.ndarray | None


@dataclass
class PeerInput:
    """The other party's private input of `n` items (the server's view of the client's ids)."""

    n: int


class ShareKVCache:
    """Per-layer shares of K and V (kv_heads, S, head_dim); each party holds its own shares."""

    def __init__(self, n_layers: int):
        self.k: list[AShare | None] = [None] * n_layers
        self.v: list[AShare | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: AShare, v: AShare) -> tuple[AShare, AShare]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = concatenate([self.k[layer], k], axis=1)
            self.v[layer] = concatenate([self.v[layer], v], axis=1)
        return self.k[layer], self.v[layer]


# ----------------------------------------------------------------------------- linear


@dataclass
class Proj:
    """A projection as the 2pc linear protocol takes it: W (d_in, d_out), bias (d_out,) or None."""

    w: np.ndarray
    b: np.ndarray | None

    @property
    def d_out(self) -> int:
        return int(self.w.shape[1])


def stack_projections(weights: list[tuple[np.ndarray, np.ndarray | None]]) -> Proj:
    """Projections sharing an input ((W (d_out, d_in), b or None) each) as one
    (d_in, sum d_out) matrix; a missing bias is zeros when another member has one."""
    any_bias = any(b is not None for _, b in weights)
    ws = [np.asarray(w, np.float64).T for w, _ in weights]
    bs = [np.zeros(w.shape[1]) if b is None else np.asarray(b, np.float64) for w, (_, b) in zip(ws, weights)]
    return Proj(np.ascontiguousarray(np.concatenate(ws, axis=1)), np.concatenate(bs) if any_bias else None)


class ShareLinear:
    """`LinearBackend` on shares: each projection group (`passes.group_linears`) is one call
    of the linear protocol with the group's stacked weights (the server's; None at the
    client), its output split back per projection.

    ``cache_weights``: which products keep their HE-encoded weights between calls
    (`linear`'s cache_key): "decode" = single-row passes only (per-token decode reuses
    them; a multi-row pass packs fewer weights per plaintext, ~2 GB per SmolLM2 layer at
    24 rows, so it encodes afresh), "all", or "none". Both parties decide alike."""

    def __init__(self, ctx, groups: list[tuple], projs: dict[int, Proj] | None, linear_fn, packing: dict,
                 cache_weights: str = "decode"):
        self.ctx = ctx
        self.index = {tuple(names): gi for gi, (names, _, _) in enumerate(groups)}
        self.d_outs = {gi: tuple(d_outs) for gi, (_, _, d_outs) in enumerate(groups)}
        self.projs = projs
        self.fn = linear_fn
        self.packing = packing
        self.cache_weights = cache_weights

    def cache_key(self, key: str, rows: int):
        if self.cache_weights == "all" or (self.cache_weights == "decode" and rows == 1):
            return key
        return None

    def product(self, x: AShare, proj: Proj | None, d_out: int, key: str, planned: bool = True) -> AShare:
        """One linear-protocol call; ``planned`` False: the default (coefficient) packing
        whatever the plan says (the one-hot embedding: its sparse input is the client's own)."""
        rows = int(np.prod(x.shape[:-1], dtype=np.int64))
        w = None if proj is None else proj.w
        b = None if proj is None else proj.b
        return self.fn(self.ctx, x, w, b, out_features=d_out, cache_key=self.cache_key(key, rows),
                       **(self.packing if planned else {}))

    def linear(self, x: AShare, names) -> list[AShare]:
        gi = self.index[tuple(names)]
        d_outs = self.d_outs[gi]
        y = self.product(x, None if self.projs is None else self.projs[gi], sum(d_outs), f"group{gi}:{names[0]}")
        cuts = np.cumsum((0,) + d_outs)
        return [y[:, int(a):int(b)] for a, b in zip(cuts[:-1], cuts[1:])] if len(d_outs) > 1 else [y]


# ----------------------------------------------------------------------------- operators


class SharesBackend:
    """One method per graph op on shares. `params`: the server's non-projection tensors
    (norm gammas and betas, embedding tables), None at the client; the graph gives the
    tables' shapes (both parties know them); `embed_word(ids, n,
    table, vocab, d)`: the word-embedding protocol of the plan (FastQuery or one-hot
    linear); `moe_fn(node, x)`: CryptoMoE for a ``moe`` node."""

    def __init__(self, ctx, graph, params: dict | None, embed_word, moe_fn=None):
        self.ctx = ctx
        self.shapes = {name: t.shape for name, t in graph.tensors.items()}
        self.p = params
        self.embed_word = embed_word
        self.moe_fn = moe_fn

    def _server(self, name: str | None):
        """The server's tensor `name` (None at the client, or for no tensor)."""
        return None if self.p is None or name is None else self.p[name]

    def embed(self, node, ids, ctx):
        kind = node.attrs.get("kind", "word")
        if kind == "word":
            table = self._server(node.weights[0])
            vocab, d = self.shapes[node.weights[0]]
            n = ids.n if isinstance(ids, PeerInput) else int(np.asarray(ids).size)
            return self.embed_word(None if isinstance(ids, PeerInput) else ids, n, table, vocab, d)
        # position / token-type rows: public indices, the server's table
        table = self._server(node.weights[0])
        return ServerRows(None if table is None else np.asarray(table, np.float64)[np.asarray(ids, np.int64)])

    def layer_norm(self, node, x, ctx):
        y = nl.layer_norm(self.ctx, x, None, None, node.attrs["eps"], var_lo=LN_VAR_LO, var_hi=LN_VAR_HI)
        y = scale_private(self.ctx, y, self._server(node.attrs["gamma"]))
        if node.attrs.get("beta"):
            y = add_private(self.ctx, y, self._server(node.attrs["beta"]))
        return y

    def rms_norm(self, node, x, ctx):
        """RMSNorm / sqrt(c) (`rms_statistic`); the server's gamma (already times sqrt(c))
        as a private product unless `passes.fold_norms` moved it into the projections."""
        y = rms_statistic(self.ctx, x, node.attrs["eps"])
        if node.attrs.get("gamma"):
            y = scale_private(self.ctx, y, self._server(node.attrs["gamma"]))
        return y

    def rope(self, node, x, ctx):
        H, hd = node.attrs["heads"], node.attrs["head_dim"]
        T = x.shape[0]
        h = x.reshape(T, H, hd).transpose(1, 0, 2)
        h = rope_shares(self.ctx, h, ctx["positions"], ops.rope_inv_freq(hd, node.attrs["theta"]))
        return h.transpose(1, 0, 2).reshape(T, H * hd)

    def qk(self, node, q, k, ctx):
        """Q K^T (GQA: the query heads that share a KV head go in one product) and the
        public causal / sliding-window mask."""
        H, Hkv, hd = node.attrs["heads"], node.attrs["kv_heads"], node.attrs["head_dim"]
        T = q.shape[0]
        k = _heads(k, Hkv)
        S = k.shape[1]
        qg = q.reshape(T, H, hd).transpose(1, 0, 2).reshape(Hkv, (H // Hkv) * T, hd)
        s = ctx["matmul"](qg, k.transpose(0, 2, 1)).reshape(H, T, S)
        if node.attrs.get("scale", 1.0) != 1.0:  # not folded into the weights (passes.fold_attention_scale)
            s = s.mul_public_fixed(node.attrs["scale"])
        keep = causal_keep(node, ctx["pos0"], T, S)
        return Scores(s, None if keep is None or keep.all() else keep)

    def softmax(self, node, sc: Scores, ctx):
        return nl.softmax(self.ctx, sc.s, None if sc.keep is None else sc.keep[None])

    def av(self, node, p, v, ctx):
        H, Hkv = node.attrs["heads"], node.attrs["kv_heads"]
        _, T, S = p.shape
        v = _heads(v, Hkv)
        out = ctx["matmul"](p.reshape(Hkv, (H // Hkv) * T, S), v)
        return out.reshape(H, T, v.shape[-1]).transpose(1, 0, 2).reshape(T, -1)

    def activation(self, node, x, ctx):
        fn = ACTIVATIONS.get(node.attrs["fn"])
        if fn is None:
            raise TwoPCError(f"activation {node.attrs['fn']!r} has no 2pc protocol here")
        return fn(self.ctx, x)

    def mul(self, node, a, b, ctx):
        return nl.mulf(self.ctx, a, b)

    def add(self, node, a, b, ctx):
        if isinstance(a, ServerRows) and isinstance(b, ServerRows):
            return ServerRows(None if a.rows is None else a.rows + b.rows)
        if isinstance(b, ServerRows):
            a, b = b, a
        if isinstance(a, ServerRows):
            return b if a.rows is None else add_private(self.ctx, b, a.rows)
        return a + b

    def split(self, node, x, ctx):
        if node.attrs.get("heads"):
            raise TwoPCError(f"{node.name}: per-head splits are not supported in the 2pc mode")
        cuts = np.cumsum((0,) + tuple(node.attrs["sizes"]))
        return tuple(x[:, int(a):int(b)] for a, b in zip(cuts[:-1], cuts[1:]))

    def head(self, node, x, ctx):
        if node.attrs["select"] == "first":
            return x[:1]
        return x[-1:] if ctx.get("last_only") else x

    def argmax(self, node, logits, ctx):
        """Argmax of each row, opened to the client only (None at the server)."""
        _, idx = nl.argmax_last(self.ctx, logits)
        out = idx.reveal(to=0)
        return None if out is None else out.reshape(-1).astype(np.int64)

    def moe(self, node, x, ctx):
        return self.moe_fn(node, x)

    def _unsupported(self, node, *args, ctx=None):
        raise TwoPCError(f"operator {node.op!r} ({node.name}) has no 2pc protocol here")

    clip = concat = topk = dispatch = combine = _unsupported

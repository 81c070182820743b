"""BLB in the 2pc mode: fused blocks in CKKS between the MPC cores (BLB sections 4, 6, 7.1;
issue 16 items 2-3 wired together).

`BLBEncoder` is a `TwoPCEncoder` (`BLBDecoder` a `TwoPCDecoder`) whose forward walks the
`passes.blb_fusion` graph of the model instead of the layer-by-layer 2pc graph:

* every *HE block* (``graph.meta["blb_blocks"]``: the linear operators between two
  nonlinear cores, section 4) is evaluated by the server on CKKS ciphertexts by
  `runtime.blb_block.evaluate_block` at the block's own parameters (`passes.blb_params`,
  section 7.1), its inputs brought in from additive shares by Algorithm 2 and its outputs
  taken back to shares by Algorithm 1 (`protocols.ckks_convert`, section 6);
* every other node (the cores: max, exp on the reduced range, reciprocal, rsqrt, the
  activations whole or their gates, as the plan's ``blb_activation`` says; the embedding
  lookup; the local s - max) runs on shares (`BLBSharesBackend`, Bumblebee-style protocols
  of `mpc.nonlinear`).

**Roles.** The client (party 0) holds the CKKS secret keys, one key set per distinct
parameter set of the blocks (`blb_params.share_sets` merges the blocks' own sets while
they stay secure; a set is made when a block first needs it; the public key,
relinearisation key and the rotation keys the block uses go to the server once: the
``setup`` operator class, excluded from the per-token totals as in the paper).  The server
(party 1) chooses the parameters (they depend on its weights' gains, `blb_params.run`),
evaluates the blocks and drives the exchange: before each conversion it sends a short
public header (the value's name, layout, level and exact scale, or its packing metadata on
the way out) and the client, which walks no HE code, answers it.  Nothing in a header
depends on the client's data or on the weights beyond the public parameters.

**Conversions.**

* In (Algorithm 2): each party lays its share out in the block's packing
  (`blb_block._Eval.slot_vectors`: copies and zeros only, so it applies to shares; rows
  stacked R per ciphertext, P V's probabilities on the pair grid), and runs
  `shares_to_ckks_many` at the level and exact scale the block asks for (the block's own
  depth above its output primes, `BlockParams.start_level`, even in a deeper shared set; all ciphertexts
  of the input in one batch: the rounds of one conversion per `ckks_convert.batch_size`
  ciphertexts).  The encoding is
  made at a scale of at most 2^`IN_SCALE_BITS` (the encoded coefficients must stay below
  2^62 in the 64-bit ring) and the server multiplies by the integer 2^j that restores the
  block's scale (exact; the ciphertext's scale bookkeeping follows).
  A server-known input (BERT's position / token-type rows) is encrypted by the server with
  the client's public key: no message.
* Out (Algorithm 1): a block's outputs sit at two primes (60 + s bits, `blb_params`);
  Algorithm 1 masks at one prime, so the server first multiplies by the integer
  k = round(q_1 2^`OUT_SCALE_BITS` / Delta) and rescales (the value is unchanged, its scale
  becomes ~2^`OUT_SCALE_BITS`, and Delta' |y| < q_0 / 8 holds for |y| < 2^20, the
  comparisons' bound), then `ckks_to_shares_many` (per ciphertext a uniform mask mod q_0
  and flooding; the field -> ring switch of all of them in one batch; the local decode).
  Two ciphertexts of one output travel in one conversion (`pairable`: one scale, and the
  bound above leaves the pair's coefficients below q_0 / 4): the second one times X^(N/2)
  fills the imaginary parts of the slots, so a value of m ciphertexts costs ceil(m / 2)
  masked ciphertexts, millionaires and COTs; the header's ``paired`` tells the client.
* A value carried from one block to a later one (V to P V, the residual stream, the
  exp's powers) goes out to shares and back in: the blocks have different parameters, and
  the layouts differ (row -> head for P V's probabilities); the paper carries some of
  them as ciphertexts (not yet here).

* Q K^T and P V in section 5's multi-head packing (the server's ``attention``,
  `blb_params.ATTENTION_PACKINGS`, "auto" by default): Q, K and P V's output change packing
  through a conversion round trip inside the block (`blb_block._Eval.relayout`); the
  client answers the "out" of a block value and the later "in" of the same value in
  another packing (a local permutation of its shares), each checked against the block's
  values and packings.

* Decoders (`BLBDecoder`): whole passes from position 0 (teacher forcing, prefill).  Q K^T's
  causal scores leave their block with the public mask applied to the shares by both
  parties (`MASKED_SCORE`; the mask is in the output header).

**Not yet** (docs/blb.md "Not yet"): the paper's spatial-first packing for the projections
and norms (stacked rows here, at the period with the fewest ciphertexts per block:
`blb_block.block_period`), carrying ciphertexts between blocks of one parameter set, and a
KV cache across passes (generation with BLB).
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from typing import Any

import numpy as np

from ..compile import build_graph
from ..compile.ir import OP_CLASS
from ..compile.passes import blb_fusion, blb_params
from ..compile.passes.blb_decompose import EXP_CLIP
from ..he.backend import get_backend
from ..he.params import HEParams
from ..mpc import nonlinear as nl
from ..mpc.nonlinear.common import const
from ..mpc.protocols.trunc import trunc_faithful, trunc_local
from ..mpc.ring import fixed_encode
from ..mpc.shares import AShare
from ..protocols.ckks_convert import PAIR_SCALE_TOLERANCE, CKKSSide, ckks_to_shares_many, shares_to_ckks_many
from . import blb_block
from .blb_block import Packed, _Eval
from .graph_executor import needed
from .twopc import BLB_MIN_VALUE_BITS, ServerModel, TwoPCDecoder, TwoPCEncoder, TwoPCError
from .twopc_backend import LN_VAR_HI, LN_VAR_LO, RMS_HI, RMS_LO, ServerRows, SharesBackend

#: largest scale Algorithm 2 encodes at (coefficients Delta |y| < 2^62 for |y| < 2^12); a plan
#: with a larger bound on the inputs encodes at `in_scale_bits` of it
IN_SCALE_BITS = 50
#: the scale of a block output when Algorithm 1 masks it at one prime (q_0 ~ 2^60:
#: 2^37 |y| < q_0 / 8 for |y| < 2^20, so two outputs fit one conversion: `pairable`)
OUT_SCALE_BITS = 37
#: the server's per-block HE counts `run_block` keeps (`_Eval.stats`): products, rotations,
#: rescales, relayouts, the seconds spent encoding weight diagonals from Python (input-independent
#: work the server could do ahead of time; 0 where the projections run natively) and the seconds
#: of the native projections (`_Eval._native_linear`: their encoding included)
HE_OP_STATS = ("ct_ct", "ct_pt", "rotations", "rescales", "relayouts", "encode_weights_s", "native_linear_s")
#: a causal mask's scores as they leave a block (public, both parties' shares set locally): far
#: below every kept score (|s| < 2^6 by the parameters' magnitude bound), so the max ignores them
#: and s - max lands on the exp core's clip: weight exp(-EXP_CLIP) ~ 1e-7, below the 2^-16 ulp
MASKED_SCORE = -2.0 ** 12
#: the most rotation keys the client makes for one block of the server's (bounds the client's
#: work; section 5's packing at 128 tokens asks for ~170 per set at N = 16384, ~320 at 32768)
MAX_ROTATION_KEYS = 512
#: rotation keys per message, so that one stays well below the channel's 1 GiB frame limit (a
#: seeded key was ~6 MB at N = 16384 and 7 primes in 64-bit words, ~4x that at N = 32768, and is
#: now bit-packed at its primes' bits; the ~200 keys of section 5's packing at 128 tokens in one
#: message took 1.24 GB)
KEYS_PER_MESSAGE = 16
#: the rotation keys (expanded bytes, `_expanded_key_bytes`) the server keeps between blocks;
#: beyond it the least recently used ones that the current block does not need go
#: (`BLBRunner._evict_keys`)
KEY_CACHE_BYTES = 3 << 30
#: fraction bits of the public scalings inside the cores (1/d of a norm's mean square)
CORE_SCALE_FRAC = 24
_LAYOUTS = ("row", "head", "headsum")


class BLBError(TwoPCError):
    """The model or a message cannot run in the BLB 2pc mode."""


# ----------------------------------------------------------------------------- the cores on shares


class BLBSharesBackend(SharesBackend):
    """`SharesBackend` plus the nonlinear cores `passes.blb_decompose` leaves to MPC."""

    def reduce_max(self, node, x, ctx):
        return nl.max_last(self.ctx, x)

    def sub(self, node, a, b, ctx):
        return a - (b.broadcast_to(a.shape) if b.shape != a.shape else b)

    def exp(self, node, x, ctx):
        """exp(x scale) for x = s - max <= 0: x scale in [-EXP_CLIP scale, 0] after the clip
        (`nl.exp_reduced`); the HE block raises it to the power 1 / scale.  A scale 2^-k is a
        local truncation by k bits (failure probability ~|x| 2^(f+1-64) per element; a product
        by 2^-k encoded at 24 bits would fail ~2^24 times as often: ~2 elements per MiniLM
        inference at 128 tokens)."""
        scale = float(node.attrs.get("scale", 1.0))
        k = -math.log2(scale) if scale > 0 else 0.0
        if scale == 1.0:
            y = x
        elif k == int(k) and k > 0:
            y = trunc_local(self.ctx, AShare(self.ctx, x.data, x.bits, x.frac + int(k)), int(k))
        else:
            y = x.mul_public_fixed(scale, frac=CORE_SCALE_FRAC)
        return nl.exp_reduced(self.ctx, y, -EXP_CLIP * scale)

    def clip_min(self, node, x, ctx):
        """max(x, lo): one comparison, one MUX (`nl.common.clip_min`)."""
        return nl.common.clip_min(self.ctx, x, float(node.attrs["lo"]))

    def reciprocal(self, node, x, ctx):
        return nl.reciprocal(self.ctx, x)

    def rsqrt(self, node, x, ctx):
        """1 / sqrt(x scale + eps) (a norm's sum of squares: scale 1/d)."""
        scale, eps = float(node.attrs.get("scale", 1.0)), float(node.attrs.get("eps", 0.0))
        y = x
        if scale != 1.0:  # per row: a faithful truncation (exact up to 1 ulp, no failure probability)
            p = AShare(self.ctx, x.data * fixed_encode(scale, CORE_SCALE_FRAC, x.bits), x.bits,
                       x.frac + CORE_SCALE_FRAC)
            y = trunc_faithful(self.ctx, p, CORE_SCALE_FRAC)
        if eps:
            y = y + const(self.ctx, y, eps)
        rms = (node.attrs.get("blb_from") or ("",))[0] == "rms_norm"
        lo, hi = (RMS_LO, RMS_HI) if rms else (LN_VAR_LO, LN_VAR_HI)
        return nl.rsqrt(self.ctx, y, lo, hi)

    def act_gate(self, node, x, ctx):
        fn = node.attrs["fn"]
        if fn in ("gelu", "gelu_tanh"):
            return nl.gelu_gate(self.ctx, x)
        if fn == "silu":
            return nl.silu_gate(self.ctx, x)
        raise BLBError(f"{node.name}: no gate protocol for activation {fn!r}")

    def act_clamp(self, node, x, ctx):
        """(lin, ac) of an activation's clamped form (`nl.abs_clamp`): its polynomial runs in
        the next HE block."""
        return nl.abs_clamp(self.ctx, x, float(node.attrs["T"]), float(node.attrs.get("scale", 1.0)))


# ----------------------------------------------------------------------------- key sets


def _set_key(bp: blb_params.BlockParams) -> tuple:
    return (bp.ring_degree, tuple(bp.chain), tuple(bp.special))


class _KeyBatch:
    """One key message's rotation keys on the server: the steps they cover, whether the
    conjugation came with them, their expanded size and the last block that used them
    (`BLBRunner._evict_keys`)."""

    __slots__ = ("steps", "conj", "nbytes", "used")

    def __init__(self, steps, conj: bool, nbytes: int, used: int):
        self.steps, self.conj, self.nbytes, self.used = frozenset(steps), conj, nbytes, used


class _KeySet:
    """One CKKS parameter set: its context, the conversions' side, and (server) the client's
    evaluation keys (``evk``: the relinearisation key and the rotation keys it sent, one
    `_KeyBatch` per message)."""

    def __init__(self, hectx, side: CKKSSide):
        self.hectx, self.side = hectx, side
        self.evk = None
        self.batches: list[_KeyBatch] = []

    @property
    def steps(self) -> set[int]:
        return set().union(*(b.steps for b in self.batches))

    @property
    def conj(self) -> bool:
        """Whether ``evk`` holds the conjugation key (paired inputs)."""
        return any(b.conj for b in self.batches)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.batches)

    def missing(self, steps) -> list[int]:
        return sorted(set(steps) - self.steps)

    def touch(self, steps, stamp: int) -> None:
        """Mark the batches the block ``stamp`` uses (its ``steps``, the conjugation)."""
        need = set(steps)
        for b in self.batches:
            if b.conj or b.steps & need:
                b.used = stamp

    def add(self, batch: _KeyBatch, keys) -> None:
        self.batches.append(batch)
        self.evk = self.evk.merged(keys)

    def drop(self, gone: list[_KeyBatch]) -> None:
        """Forget the batches ``gone`` (`BLBRunner._evict_keys`): ``evk`` keeps the others' keys."""
        self.batches = [b for b in self.batches if all(b is not g for g in gone)]
        self.evk = self.evk.keeping(sorted(self.steps), conjugate=self.conj)


def _expanded_key_bytes(hectx, wire_bytes: int, n_keys: int) -> int:
    """The server's memory for ``n_keys`` of the client's Galois keys once expanded, from their
    blob of ``wire_bytes`` (clattigo's seeded layout: a 12-byte header, per key its element and a
    32-byte seed, then one half's rows bit-packed at their primes' bits; expanded, both halves in
    64-bit words)."""
    mods = list(hectx.q_moduli) + list(hectx.p_moduli)
    bits = sum((m - 1).bit_length() for m in mods)
    return (wire_bytes - 12 - 40 * n_keys) * 2 * 64 * len(mods) // bits


def _backend():
    """The CKKS backend of the blocks (Lattigo, through the HE interface)."""
    try:
        return get_backend("lattigo")
    except Exception as e:  # the shared library is missing or cannot load
        raise BLBError(f"BLB needs the Lattigo backend: {e}") from None


def _context(n: int, chain, special) -> Any:
    params = HEParams(f"blb-N{n}", "ckks", int(n), tuple(int(b) for b in chain) + tuple(int(b) for b in special))
    return _backend().context(params)  # refuses parameters below 128-bit security (check_security)


# ----------------------------------------------------------------------------- conversions


def _as_share(ctx, data: np.ndarray) -> AShare:
    return AShare(ctx, np.ascontiguousarray(data, np.uint64), 64, ctx.ring.frac)


def input_cts(ev: _Eval, share_shape, layout: str) -> int:
    """How many ciphertexts a block input of this shape takes in ``layout`` (public)."""
    return int(np.prod(ev.slot_vectors(np.zeros(share_shape, np.uint64), layout)[0].shape[:-1]))


def in_scale_bits(value_bits: int) -> int:
    """The largest scale Algorithm 2 encodes at for inputs |y| < 2^value_bits (the plan's
    ``blb_value_bits``): Delta |y| < 2^62.  2^50 at the default 2^12; SmolLM2's 2^17, 2^45
    (the encoding's rounding, ~0.3 (N/2) rms(y) 2^f / Delta per slot, grows 32x: 4.6e-6 rms(y)
    at N = 16384, below the shares' 2^-16)."""
    return min(IN_SCALE_BITS, 62 - int(value_bits))


def convert_in(ctx, ks: _KeySet, ev: _Eval, share: AShare, layout: str, level: int, scale: float,
               paired: bool = False, scale_cap: int = IN_SCALE_BITS) -> Packed | None:
    """Algorithm 2 for every ciphertext of one block input (both parties; the server gets the
    `Packed` value, the client None).  ``paired``: two ciphertexts per encryption, split by the
    server with its conjugation key (`shares_to_ckks_many`'s ``paired``; the header says so).
    ``scale_cap``: the largest encoding scale's bits (`in_scale_bits`, the same at both parties)."""
    vecs, dirty, shifts = ev.slot_vectors(np.asarray(share.data, np.uint64), layout)
    grid = vecs.shape[:-1]
    j = max(0, math.ceil(math.log2(scale)) - scale_cap)
    be, hc = ks.side.backend, ks.hectx
    y = _as_share(ctx, vecs.reshape(-1, vecs.shape[-1]))  # every ciphertext of the value in one batch
    got = shares_to_ckks_many(ctx, y, ks.side, n_primes=level + 1, scale=scale / 2.0 ** j, paired=paired,
                              conj_keys=ks.evk if paired and ks.side.is_server(ctx) else None)
    if got is None:
        return None
    cts = np.empty(grid, object)
    for idx, ct in zip(np.ndindex(*grid), got):
        if j:  # back to the block's scale: x 2^j (integer, exact), scale x 2^j
            ct = be.multiply_scalar(hc, ct, float(2 ** j))
            be.scale_message_inplace(hc, ct, float(2 ** j))
        cts[idx] = ct
    return Packed(cts, layout, tuple(share.shape), dirty, shifts=shifts)


def _to_one_prime(be, hc, ct):
    """A ciphertext at level >= 1 -> level 0 at scale just below 2^OUT_SCALE_BITS, the same value."""
    if ct.level == 0:
        return ct
    if ct.level > 1:
        be.mod_switch_to_inplace(hc, ct, 1)
    q1 = float(hc.q_moduli[1])
    # at most 2^OUT_SCALE_BITS and at most q_0 / 2^(OUT_VALUE_BITS + 3) (q_0 is a little below
    # 2^60): `pairable` then holds for every output that passes through here
    target = min(2.0 ** OUT_SCALE_BITS, float(hc.coeff_moduli[0]) / 2.0 ** (blb_params.OUT_VALUE_BITS + 3))
    k = float(max(1, math.floor(q1 * target / be.ciphertext_scale(ct))))
    ct = be.multiply_scalar(hc, ct, k)  # an integer: the message times k, no level
    be.rescale_inplace(hc, ct)          # / q_1: reads k y at scale Delta / q_1
    be.scale_message_inplace(hc, ct, k)  # reads y at scale k Delta / q_1 ~ 2^OUT_SCALE_BITS
    return ct


def pairable(be, hc, cts) -> bool:
    """Whether one-prime ciphertexts may travel two per conversion (`ckks_to_shares_many`'s
    ``paired``): more than one, at one scale (to `ckks_convert.PAIR_SCALE_TOLERANCE`: outputs
    computed along different paths differ in the last float bits), and the pair's coefficients
    below q_0 / 4, i.e. scale 2^OUT_VALUE_BITS < q_0 / 8 (the bound a block output's |y| is
    promised)."""
    if len(cts) < 2:
        return False
    scales = [be.ciphertext_scale(c) for c in cts]
    top = max(scales)
    return (top - min(scales) <= PAIR_SCALE_TOLERANCE * top
            and top * 2.0 ** (blb_params.OUT_VALUE_BITS + 3) <= float(hc.coeff_moduli[0]))


def convert_out(ctx, ks: _KeySet, ev: _Eval, x: Packed, paired: bool = False) -> AShare:
    """Algorithm 1 for every ciphertext of one block output (the server passes its `Packed`
    value, the client the same metadata with no ciphertexts); both get the value's shares.
    ``paired``: two ciphertexts per conversion (the server's header says so: `pairable`).  The
    server's ciphertexts are at one prime already (`ConversionIO.decrypt`: `_to_one_prime`)."""
    server = ks.side.is_server(ctx)
    dec = np.zeros(x.cts.shape + (ev.slots,), np.uint64)
    present = [idx for idx in np.ndindex(*x.cts.shape) if x.present[idx]]  # the rest: not computed, zeros
    cts = [x.cts[idx] for idx in present] if server else None
    got = ckks_to_shares_many(ctx, cts, ks.side, len(present), paired=paired).data  # one batch
    for idx, row in zip(present, got):
        dec[idx] = row
    out = ev.unpack(dec, x)
    if x.keep is not None:  # a causal mask's scores: the public constant, as shares (-inf is none)
        out = np.array(out, np.uint64)
        masked = np.broadcast_to(~x.keep, out.shape)
        out[masked] = int(fixed_encode(MASKED_SCORE, ctx.ring.frac, 64)) if ctx.party == 0 else 0
    return _as_share(ctx, out)


class ConversionIO:
    """The server's `blb_block` io: each input / output is announced to the client by a
    header, then converted (`convert_in` / `convert_out`)."""

    def __init__(self, runner: "BLBRunner", ks: _KeySet, block: dict):
        self.runner, self.ks, self.block = runner, ks, block

    def encrypt(self, ev: _Eval, name: str, arr, layout: str, level: int, scale: float) -> Packed:
        ctx, be, hc = self.runner.ctx, self.ks.side.backend, self.ks.hectx
        if isinstance(arr, ServerRows):  # the server's own rows: encrypted under the client's public key
            vecs, dirty, shifts = ev.slot_vectors(np.asarray(arr.rows, np.float64), layout)
            cts = np.empty(vecs.shape[:-1], object)
            for idx in np.ndindex(*cts.shape):
                cts[idx] = be.encrypt_public(hc, self.ks.side.pk, ev.pt(vecs[idx], level, scale))
            return Packed(cts, layout, tuple(np.shape(arr.rows)), dirty, shifts=shifts)
        with self.runner.meter("conversions", self.block["name"]), self.runner.record(name, "in", level) as rec:
            paired = self.ks.conj and input_cts(ev, arr.shape, layout) > 1
            ctx.send({"op": "in", "value": name, "layout": layout, "level": int(level), "scale": float(scale),
                      "paired": paired})
            got = convert_in(ctx, self.ks, ev, arr, layout, level, scale, paired, self.runner.scale_cap)
            rec["cts"], rec["paired"] = int(got.cts.size), paired
            return got

    def decrypt(self, ev: _Eval, name: str, x: Packed) -> AShare:
        x.present = np.vectorize(lambda c: c is not None, otypes=[bool])(x.cts)
        be, hc = self.ks.side.backend, self.ks.hectx
        with self.runner.meter("conversions", self.block["name"]), self.runner.record(name, "out", 0) as rec:
            present = [idx for idx in np.ndindex(*x.cts.shape) if x.present[idx]]
            for idx in present:
                x.cts[idx] = _to_one_prime(be, hc, x.cts[idx])
            paired = pairable(be, hc, [x.cts[idx] for idx in present])
            self.runner.ctx.send({"op": "out", "value": name, "paired": paired, **_packing_header(x)})
            rec["cts"], rec["paired"] = len(present), paired
            return convert_out(self.runner.ctx, self.ks, ev, x, paired)


def _packing_header(x: Packed) -> dict:
    keep = {} if x.keep is None else {"keep": np.packbits(x.keep.reshape(-1)).tobytes()}
    return {**keep, "layout": x.layout, "shape": [int(s) for s in x.shape], "grid": [int(s) for s in x.cts.shape],
            "rep": [int(r) for r in x.rep], "heads": bool(x.heads), "shifts": [int(u) for u in x.shifts],
            "present": np.packbits(x.present.reshape(-1)).tobytes()}


# ----------------------------------------------------------------------------- the runner


class BLBRunner:
    """Both parties' side of the HE blocks: key sets, and per block the server's evaluation
    (`run_block`) or the client's answers to its headers (`serve_block`)."""

    def __init__(self, ctx, graph, params: dict | None, meter, attention: str = "auto",
                 value_bits: int = BLB_MIN_VALUE_BITS, key_cache_bytes: int = KEY_CACHE_BYTES):
        self.ctx, self.graph, self.params, self.meter = ctx, graph, params, meter
        #: the server's bound on the client's rotation keys it keeps between blocks (`_evict_keys`)
        self.key_cache_bytes = int(key_cache_bytes)
        self._stamp = 0  # the server's block counter (`_KeyBatch.used`)
        self.keys_evicted = 0  # batches of rotation keys dropped so far
        #: Algorithm 2's largest encoding scale for the plan's bound on the inputs (`in_scale_bits`)
        self.scale_cap = in_scale_bits(value_bits)
        if attention not in blb_params.ATTENTION_PACKINGS:
            raise BLBError(f"unknown attention packing {attention!r}; one of {blb_params.ATTENTION_PACKINGS}")
        #: the server's packing of Q K^T / P V (`blb_params.ATTENTION_PACKINGS`); the client follows its headers
        self.attention = attention
        self.be = _backend()
        self.sets: dict[tuple, _KeySet] = {}
        self._bparams: dict[int, list] = {}  # tokens -> blb_params.run(...) (server)
        self.block_stats: list[dict] = []
        #: the server's conversions, one record each: block, value, direction ("in": Algorithm 2,
        #: "out": Algorithm 1), ciphertexts, level, bytes both ways (`record`)
        self.conversions: list[dict] = []
        self._block_id = -1

    @property
    def server(self) -> bool:
        return self.ctx.party == 1

    # -- keys
    def _block_params(self, block: dict, tokens: int) -> blb_params.BlockParams:
        if tokens not in self._bparams:
            self._bparams[tokens] = blb_params.share_sets(blb_params.run(self.graph, params=self.params, tokens=tokens,
                                                                         attention=self.attention))
        return self._bparams[tokens][block["id"]]

    def _ensure_keys(self, bp: blb_params.BlockParams, steps: list[int]) -> _KeySet:
        """Server: make sure the client's keys for ``bp``'s set cover ``steps`` and the
        conjugation (a header, then the keys the client sends), then keep the session's rotation
        keys within `key_cache_bytes` (`_evict_keys`)."""
        key = _set_key(bp)
        ks = self.sets.get(key)
        missing = ks.missing(steps) if ks is not None else sorted(set(steps))
        self._stamp += 1
        if ks is None or missing or not ks.conj:
            ks = self._receive_keys(bp, ks, missing)
        ks.touch(steps, self._stamp)
        self._evict_keys()
        return ks

    def _receive_keys(self, bp: blb_params.BlockParams, ks: _KeySet | None, missing: list[int]) -> _KeySet:
        ctx, be, key = self.ctx, self.be, _set_key(bp)
        # the rotation keys in batches of KEYS_PER_MESSAGE (a message stays below the channel's frame limit)
        batches = [missing[i:i + KEYS_PER_MESSAGE] for i in range(0, len(missing), KEYS_PER_MESSAGE)] or [[]]
        with self.meter("setup"), ctx.step("blb_setup"):
            for i, batch in enumerate(batches):
                conj = i == 0 and (ks is None or not ks.conj)  # the conjugation key with the first batch
                ctx.send({"op": "keys", "n": bp.ring_degree, "chain": list(bp.chain), "special": list(bp.special),
                          "steps": batch, "conjugate": conj, "more": i + 1 < len(batches)})
                msg = ctx.recv()
                if ks is None:
                    hc = _context(*key)
                    side = CKKSSide(be, hc, None, be.load_public_key(hc, msg["pk"]), server=1)
                    ks = self.sets[key] = _KeySet(hc, side)
                    ks.evk = be.relin_keys_from_bytes(hc, msg["relin"])
                if batch or conj:
                    gal = be.galois_keys_from_bytes(ks.hectx, msg["galois"], required_steps=batch,
                                                    max_keys=len(batch) + int(conj), conjugate=conj)
                    nbytes = _expanded_key_bytes(ks.hectx, len(msg["galois"]), len(batch) + int(conj))
                    ks.add(_KeyBatch(batch, conj, nbytes, self._stamp), gal)
        return ks

    def _evict_keys(self) -> None:
        """Server: drop the least recently used rotation keys, across the parameter sets, that
        the current block does not use while the kept ones exceed `key_cache_bytes` (a session
        that sees many sentence lengths asks for new steps at each; without a bound the keys of
        every length seen stay, ~1 GB per new MiniLM length).  Dropped keys are asked for again
        when a later block needs them."""
        held = sorted(((b.used, id(b), b, ks) for ks in self.sets.values() for b in ks.batches),
                      key=lambda t: t[:2])
        total = sum(t[2].nbytes for t in held)
        gone: dict[int, tuple[_KeySet, list]] = {}
        for used, _, b, ks in held:
            if total <= self.key_cache_bytes or used >= self._stamp:
                break
            gone.setdefault(id(ks), (ks, []))[1].append(b)
            total -= b.nbytes
        for ks, batches in gone.values():
            ks.drop(batches)
            self.keys_evicted += len(batches)

    def _answer_keys(self, msg: dict) -> None:
        """Client: a key set (new parameters: context, secret keys, public and relinearisation
        keys) and the rotation keys the server asks for."""
        try:
            n, chain, special = int(msg["n"]), tuple(map(int, msg["chain"])), tuple(map(int, msg["special"]))
            steps = [int(s) for s in msg["steps"]]
            conj = msg.get("conjugate", False)
            if not isinstance(conj, bool):
                raise TypeError("'conjugate' is not a bool")
        except (KeyError, TypeError, ValueError) as e:
            raise BLBError(f"malformed key request from the server: {e}") from None
        key = (n, chain, special)
        ks = self.sets.get(key)
        out: dict[str, bytes] = {}
        with self.meter("setup"), self.ctx.step("blb_setup"):
            if ks is None:
                hc = _context(n, chain, special)  # refuses insecure parameters (check_security)
                keys = self.be.keygen(hc)
                ks = self.sets[key] = _KeySet(hc, CKKSSide(self.be, hc, keys, None, server=1))
                out["pk"] = keys.public_key_bytes()
                out["relin"] = keys.relin_key_bytes()
            if any(not 0 < s < ks.hectx.slots for s in steps) or len(steps) > KEYS_PER_MESSAGE:
                raise BLBError("the server asked for rotation keys out of range")
            if steps or conj:
                out["galois"] = ks.side.keys.galois_keys_bytes(steps, conjugate=conj)
            self.ctx.send(out)
        self._client_set = ks

    # -- one block
    @contextlib.contextmanager
    def record(self, value: str, direction: str, level: int):
        """Count one conversion's bytes (both directions, through the channel) into `conversions`."""
        before = self.ctx.chan.totals()
        rec = {"block": self._block_id, "value": value, "direction": direction, "level": int(level), "cts": 0}
        yield rec
        after = self.ctx.chan.totals()
        rec["bytes"] = int(sum(after[k] - before[k] for k in ("bytes_sent", "bytes_received")))
        self.conversions.append(rec)

    def run_block(self, block: dict, inputs: dict, tokens: int) -> dict:
        """Both parties: the block's outputs as shares {value: AShare} from its inputs {value:
        AShare | ServerRows} (the server's own shares / rows; the client's shares)."""
        t0 = time.perf_counter()
        self._block_id = int(block["id"])
        before = self.ctx.chan.totals()
        if self.server:
            out = self._server_block(block, inputs, tokens)
        else:
            out = self._client_block(block, inputs)
        # the process's peak resident memory so far (both parties' when they share a process,
        # as in `cipherlm bench blb`): the block that raises it is the one to look at
        stats = {"block": block["id"], "seconds": time.perf_counter() - t0,
                 "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.server:
            stats["he"] = {k: v for k, v in self._he_stats.items() if k in HE_OP_STATS}
        after = self.ctx.chan.totals()
        stats.update({k: after[k] - before[k] for k in after})
        self.block_stats.append(stats)
        return out

    def _server_block(self, block: dict, inputs: dict, tokens: int) -> dict:
        bp = self._block_params(block, tokens)
        period = blb_block.block_period(self.graph, block, inputs, bp.ring_degree // 2, fused=blb_block.attention_layouts(
            self.graph, block, bp.ring_degree // 2, tokens, self.attention))
        steps = blb_block.block_steps(self.graph, block, period, bp.ring_degree // 2, tokens, self.attention)
        have = self.sets.get(_set_key(bp))
        keys = have is None or bool(have.missing(steps)) or not have.conj
        with self.meter("conversions", block["name"]):
            self.ctx.send({"op": "block", "id": int(block["id"]), "n": bp.ring_degree, "chain": list(bp.chain),
                           "special": list(bp.special), "period": int(period), "scale_bits": int(bp.scale_bits),
                           "keys": keys})
        ks = self._ensure_keys(bp, steps)
        self._he_stats = {}  # the block's HE operation counts and weight-encoding time (`run_block`)
        out = blb_block.evaluate_block(self.graph, block, inputs, self.params, ks.hectx, self.be, None, ks.evk,
                                       scale_bits=bp.scale_bits, io=ConversionIO(self, ks, block),
                                       attention=self.attention, tokens=tokens, period=period,
                                       start_level=bp.start_level, stats=self._he_stats)
        with self.meter("conversions", block["name"]):
            self.ctx.send({"op": "end"})
        return out

    def _client_block(self, block: dict, inputs: dict) -> dict:
        """The client's answers: the block's header, the key requests (``setup``), then one
        conversion per header until the server's "end"."""
        ctx = self.ctx
        with self.meter("conversions", block["name"]):
            head = ctx.recv()
        if not isinstance(head, dict) or head.get("op") != "block" or head.get("id") != block["id"]:
            raise BLBError(f"expected the server's header of block {block['id']}")
        if head.get("keys"):
            with self.meter("setup"):
                more, requests = True, 0
                while more:  # one request per batch of rotation keys (`KEYS_PER_MESSAGE`)
                    msg = ctx.recv()
                    if not isinstance(msg, dict) or msg.get("op") != "keys":
                        raise BLBError(f"block {block['id']}: expected the server's key request")
                    requests += 1
                    if requests > MAX_ROTATION_KEYS // KEYS_PER_MESSAGE + 1:
                        raise BLBError(f"block {block['id']}: too many key requests")
                    more = bool(msg.get("more"))
                    self._answer_keys(msg)
        # the rest is one "conversions" interval (its seconds include waiting for the server's
        # HE evaluation)
        with self.meter("conversions", block["name"]):
            return self._answer_block(block, inputs, head)

    def _answer_block(self, block: dict, inputs: dict, msg: dict) -> dict:
        ctx = self.ctx
        try:
            key = (int(msg["n"]), tuple(int(b) for b in msg["chain"]), tuple(int(b) for b in msg["special"]))
            P, scale_bits = int(msg["period"]), int(msg["scale_bits"])
        except (KeyError, TypeError, ValueError) as e:
            raise BLBError(f"block {block['id']}: malformed header: {e}") from None
        ks = self.sets.get(key)
        if ks is None:
            raise BLBError(f"block {block['id']}: no key set for the server's parameters")
        if P < 1 or P & (P - 1) or P > ks.hectx.slots:
            raise BLBError(f"block {block['id']}: bad period {P}")
        ev = _Eval(ks.hectx, self.be, None, None, P, scale_bits, blb_params.block_attention(self.graph, block))
        inputs = blb_block.kv_inputs_as_rows(self.graph, block, inputs)  # as the server's `evaluate_block` does
        names = {i["value"] for i in block["inputs"]}
        outs = {o["value"] for o in block["outputs"]}
        inside = {v for n in block["nodes"] for v in self.graph.node(n).outputs}  # values the block computes
        out: dict[str, AShare] = {}
        relaid: dict[str, AShare] = {}  # block values out to shares for a change of packing (`_Eval.relayout`)
        while True:
            msg = ctx.recv()
            op = msg.get("op") if isinstance(msg, dict) else None
            if op == "end":
                return out
            if op == "in":
                v, layout = msg.get("value"), msg.get("layout")
                share = relaid.get(v) if isinstance(v, str) else None
                if share is None and v in names:
                    share = inputs.get(v)
                if not isinstance(share, AShare) or not _input_layout(ev, layout):
                    raise BLBError(f"block {block['id']}: the server asked to convert {v!r} ({layout!r})")
                try:
                    level, scale = int(msg["level"]), float(msg["scale"])
                except (KeyError, TypeError, ValueError) as e:
                    raise BLBError(f"block {block['id']}: malformed header: {e}") from None
                if not 0 <= level <= ks.hectx.max_level or not 1.0 <= scale < 2.0 ** 120:
                    raise BLBError(f"block {block['id']}: level {level} / scale out of range")
                convert_in(ctx, ks, ev, share, layout, level, scale, _header_paired(msg), self.scale_cap)
            elif op == "out" and msg.get("value") in outs | inside:
                got = convert_out(ctx, ks, ev, _client_packed(msg, ev), _header_paired(msg))
                if msg["value"] in outs:
                    out[msg["value"]] = got
                relaid[msg["value"]] = got
            else:
                raise BLBError(f"block {block['id']}: unexpected message from the server")


def _input_layout(ev: _Eval, layout) -> bool:
    """Whether a block input may be asked for in ``layout``: rows, P V's pair grid, or one of
    section 5's packings (well formed for this block's heads and slots)."""
    if layout in ("row", "head"):
        return True
    try:
        mh = blb_block.mh_layout(layout, ev.slots, ev.hh[0]) if ev.hh and isinstance(layout, str) else None
    except ValueError:
        return False
    return mh is not None and mh[0] in ("mh_cols", "mh_rows")


def _header_paired(msg: dict) -> bool:
    """An output header's ``paired`` (`pairable`): a bool, absent = False."""
    paired = msg.get("paired", False)
    if not isinstance(paired, bool):
        raise BLBError("malformed output header: 'paired' is not a bool")
    return paired


def _client_packed(msg: dict, ev: _Eval) -> Packed:
    """The metadata of an output `Packed` from its header (no ciphertexts)."""
    try:
        layout = msg["layout"]
        shape, grid = tuple(int(s) for s in msg["shape"]), tuple(int(s) for s in msg["grid"])
        rep = tuple(int(r) for r in msg["rep"])
        shifts = tuple(int(u) for u in msg.get("shifts", ()))
        size = math.prod(grid)
        mh = blb_block.mh_layout(layout, ev.slots, ev.hh[0]) if ev.hh and isinstance(layout, str) else None
        if mh is not None and (mh[0] != "mh_diag" or grid != (mh[1].n_out,)):
            raise BLBError("malformed output header")
        if (layout not in _LAYOUTS and mh is None) or len(rep) != 2 or not 0 < size <= 1 << 20:
            raise BLBError("malformed output header")
        present = np.unpackbits(np.frombuffer(msg["present"], np.uint8))
        if present.size < size:
            raise BLBError("malformed output header")
        present = present[:size].astype(bool).reshape(grid)
        keep = None
        if msg.get("keep") is not None:  # a causal mask over the (T, S) scores of an (H, T, S) value
            if len(shape) != 3:
                raise BLBError("malformed output header: a mask on a value that is not scores")
            bits = np.unpackbits(np.frombuffer(msg["keep"], np.uint8))
            if bits.size < shape[1] * shape[2]:
                raise BLBError("malformed output header: short mask")
            keep = bits[:shape[1] * shape[2]].astype(bool).reshape(shape[1:])
    except (KeyError, TypeError, ValueError) as e:
        raise BLBError(f"malformed output header: {e}") from None
    x = Packed(np.empty(grid, object), layout, shape, False, heads=bool(msg.get("heads")), rep=rep, shifts=shifts,
               keep=keep)
    x.present = present
    return x


# ----------------------------------------------------------------------------- the executor


def units(graph) -> list[tuple[str, Any]]:
    """The fused graph's nodes in an order where each HE block is one step: ("block", block)
    or ("node", node), every input produced by an earlier step (the stage rule of
    `blb_fusion` keeps the blocks acyclic)."""
    blocks = {b["id"]: b for b in graph.meta["blb_blocks"]}
    unit_of = {n.name: ("block", n.attrs["blb_block"]) if n.attrs.get("blb_block") is not None else ("node", n.name)
               for n in graph.nodes}
    prod = graph.producers()
    deps: dict[tuple, set] = {}
    order: list[tuple] = []
    for n in graph.nodes:
        u = unit_of[n.name]
        if u not in deps:
            deps[u] = set()
            order.append(u)
        for v in n.inputs:
            p = prod.get(v)
            if p is not None and unit_of[p.name] != u:
                deps[u].add(unit_of[p.name])
    done: set = set()
    out = []
    while len(out) < len(order):
        progressed = False
        for u in order:
            if u in done or not deps[u] <= done:
                continue
            done.add(u)
            out.append(("block", blocks[u[1]]) if u[0] == "block" else ("node", graph.node(u[1])))
            progressed = True
            break
        if not progressed:
            raise BLBError("the fused blocks form a cycle")
    return out


class _BLBLayers:
    """The BLB walk shared by the encoder and decoder executors: the fused graph's units (HE
    blocks through `BLBRunner`, MPC cores on shares) from the pass inputs to one output value."""

    def _blb_init(self, ctx, config: dict, server: ServerModel | None, attention: str) -> None:
        # plans from before the activation choice have no "blb_activation": the gate split they ran
        self.blb_graph = blb_fusion.run(build_graph(config), activation=self.plan.get("blb_activation", "gate"),
                                        exp=self.plan.get("blb_exp", "core"),
                                        norms=self.plan.get("blb_norms", "split"))
        bound = None
        if server is not None:
            bound = server.bound
            if bound is None:
                raise BLBError("the server model has no bound weights for BLB (ServerModel(..., keep_bound=True))")
        self.blb_params = bound
        self.blb_backend = BLBSharesBackend(ctx, self.blb_graph, None if server is None else server.params,
                                            self._embed_word)
        self.runner = BLBRunner(ctx, self.blb_graph, bound, self.meter, attention,
                                value_bits=self.plan.get("blb_value_bits", BLB_MIN_VALUE_BITS))
        self._units = units(self.blb_graph)

    def _blb_run(self, vals: dict, ctx: dict, n: int, need_out: str) -> AShare:
        """Walk the units the value ``need_out`` needs; ``vals``: the pass inputs (ids, positions,
        ...); ``n``: the pass's tokens."""
        g = self.blb_graph
        need = needed(g.producers(), [need_out])
        read = {v for name in need for v in g.node(name).inputs}  # values some needed node reads
        done_layers = -1
        for kind, item in self._units:
            if kind == "node":
                if item.name not in need:
                    continue
                ins = [vals[v] for v in item.inputs]
                with self.meter(OP_CLASS[item.op], item.name):
                    r = getattr(self.blb_backend, item.op)(item, *ins, ctx=ctx)
                vals.update(zip(item.outputs, r if len(item.outputs) > 1 else (r,)))
            else:
                if not any(name in need for name in item["nodes"]):
                    continue
                made = {v for name in item["nodes"] for v in g.node(name).outputs}
                outs = [o for o in item["outputs"] if o["value"] in read or o["value"] == need_out]
                if need_out in made and all(o["value"] != need_out for o in outs):
                    outs.append({"value": need_out})  # a value inside the block (a decoder's hidden states)
                blk = {**item, "name": f"blb{item['id']}", "outputs": outs,
                       "nodes": [name for name in item["nodes"] if name in need]}
                res = self.runner.run_block(blk, {i["value"]: vals[i["value"]] for i in item["inputs"]}, n)
                vals.update(res)
                if item["layer"] is not None and item["layer"] > done_layers and self.progress is not None:
                    done_layers = item["layer"]
                    self.progress(done_layers + 1, g.n_layers, f"{n} token(s), BLB block {item['id']}")
        return vals[need_out]


class BLBEncoder(_BLBLayers, TwoPCEncoder):
    """An encoder's 2pc executor with BLB fusion (module doc): the same embedding, sentence
    embedding and classifier as `TwoPCEncoder`; the layers as fused HE blocks and MPC cores."""

    def __init__(self, ctx, config: dict, server: ServerModel | None, plan=None, meter=None, progress=None,
                 attention: str = "auto"):
        super().__init__(ctx, config, server, plan, meter, progress)
        self._blb_init(ctx, config, server, attention)

    def encode_shares(self, ids, n: int) -> AShare:
        n = int(n)
        if not 1 <= n <= self.max_positions:
            raise TwoPCError(f"sentence length must be 1..{self.max_positions}, got {n}")
        ctx = self._pass_ctx(0, n)
        vals: dict[str, Any] = {"ids": self._ids_value(ids, n), "positions": ctx["positions"],
                                "token_types": np.zeros(n, np.int64)}
        return self._blb_run(vals, ctx, n, self.blb_graph.outputs["hidden"])


class BLBDecoder(_BLBLayers, TwoPCDecoder):
    """A decoder's 2pc executor with BLB fusion, for whole passes over a sequence (teacher
    forcing, prefill): the causal scores leave their block with the public mask applied to the
    shares (`MASKED_SCORE`).  No KV cache across passes yet (the blocks' ``kv_cache`` is the
    pass's own K and V), so `generate` is refused; `forward` takes a fresh pass from position 0."""

    def __init__(self, ctx, config: dict, server: ServerModel | None, plan=None, meter=None, progress=None,
                 attention: str = "auto"):
        super().__init__(ctx, config, server, plan, meter, progress)
        self._blb_init(ctx, config, server, attention)

    def forward(self, ids, n: int, cache=None, last_only: bool = False, outputs=("logits",)):
        """Logit shares (n or 1, vocab) of ``n`` tokens from position 0 (``outputs=("next_token",)``:
        the argmax opened to the client; ``("hidden",)``: the final norm's output, no LM head), as
        `TwoPCExecutor.forward` without a cache."""
        if cache is not None and cache.length:
            raise BLBError("BLB fusion runs whole passes from position 0 (no KV cache across passes yet)")
        n = int(n)
        if not 1 <= n <= self.max_positions:
            raise TwoPCError(f"sequence length must be 1..{self.max_positions}, got {n}")
        if tuple(outputs) not in (("logits",), ("next_token",), ("hidden",)):
            raise BLBError(f"outputs {outputs!r}: one of ('logits',), ('next_token',), ('hidden',)")
        ctx = self._pass_ctx(0, n, last_only=last_only)
        vals: dict[str, Any] = {"ids": self._ids_value(ids, n), "positions": ctx["positions"]}
        role = "hidden" if outputs[0] == "hidden" else "logits"
        out = self._blb_run(vals, ctx, n, self.blb_graph.outputs[role])
        if last_only:
            out = out[-1:]
        if outputs[0] == "next_token":
            return self.argmax_to_client(out)
        return out

    def generate(self, *args, **kwargs):
        raise BLBError("generation with BLB fusion needs the KV cache across passes (not yet); use --fusion none")


def server_model_blb(config: dict, weights: dict, classifier: tuple | None = None) -> ServerModel:
    """A `ServerModel` that keeps the bound weights of the unfused graph (BLB's blocks read them)."""
    return ServerModel(config, weights, classifier, keep_bound=True)


__all__ = ["BLBEncoder", "BLBDecoder", "BLBRunner", "BLBSharesBackend", "BLBError", "convert_in", "convert_out", "units",
           "server_model_blb", "IN_SCALE_BITS", "OUT_SCALE_BITS", "in_scale_bits"]

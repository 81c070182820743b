"""Linear layers of the 2pc mode: HE matrix products on secret shares.

Shares x = x_0 + x_1 (mod 2^64, fixed point with f fraction bits).  A product
with the server's private weight W is

    x W = x_0 W  (cross term: the client encrypts x_0, the server multiplies
                  by W under HE, masks and returns; BLB section 2.3, Cheetah
                  section 3.1 "HomConv/HomFC")
        + x_1 W  (the server's local term).

A product of two shared matrices A B (attention: Q K^T, P V) expands into two
local terms A_0 B_0, A_1 B_1 and two cross terms A_0 B_1, A_1 B_0, each
evaluated with the same HE cross-term protocol, once in each direction (each
party encrypts under its own key; the partner holds the other operand in
plaintext).  The plaintext operand of a cross term is then a uniformly random
share (|w| < t/2): its noise (>= 2^62.6 per term) leaves no room for
FLOOD_SIGMA = 77 bits of flooding in the 180 data bits of N = 8192, so these
cross terms run in the N = 16384, 240-data-bit session
(`he_session.TWOPC_BFV_WIDE`, chosen by `cross_session` from the public shapes).
This replaces Bumblebee's ct-ct product with ct-pt products of the shares; it
needs no relinearisation or Galois keys.

Flooding (`he_session`): FLOOD_SIGMA = 40 + 37 bits over the noise bound, sized
so that a whole session (at most 2^37 flooded coefficients, counted) is within
statistical distance 2^-41 of a weight-independent view; products with the
server's weights (|W| < 2^19) keep N = 8192 with ~9 bits to spare.

Packing: Cheetah's coefficient encoding (Huang et al. 2022, section 3.1).  A
block of A (m_w x d_w) and of B (d_w x o_w) with m_w d_w o_w <= N are packed as

    a(X) = sum_{t,j} A[t, j] X^(t D + j),           D = d_w o_w
    b(X) = sum_{j,i} B[j, i] X^(i d_w + d_w - 1 - j)

so that the coefficient t D + i d_w + d_w - 1 of a b (negacyclic) is
(A B)[t, i]; no rotations.  Only those coefficients of c_0 are sent back,
plus the whole c_1 (Cheetah section 4: the receiver needs c_1 s at the
selected positions).  The block shape is chosen per call by a cost model of
bytes and ct-pt products (`plan_blocks`) and reported in `LinearStats`.

Arithmetic: HE in Z_t, t = 2^59.  Inputs are locally truncated from f to
``IN_FRAC`` = 14 fraction bits (SecureML local truncation, free), weights are
encoded with ``W_FRAC`` = 14 fraction bits (public bound |W| < 32), products
carry 28 fraction bits.  The result shares mod 2^59 are lifted to Z_2^64
*locally*: each party reads its share as a centred integer (the SecureML
argument of BLB appendix C.4 applied to a ring extension: the sum is the true
value except with probability about |y| 2^28 / 2^59), then both truncate
locally back to f bits.  A 59-bit t is what makes the free lift safe; with a
small t (Cheetah's 2^37-2^41) a SiRNN extension (`mpc.protocols.extend.sext`,
~700 bytes per element) would be needed after every layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _core
from ..mpc.context import MPCError
from ..mpc.protocols.trunc import trunc_local
from ..mpc.ring import fixed_encode, mask
from ..mpc.shares import AShare

from ..mpc.he_session import (FLOOD_SIGMA, RESULT_PRIMES, HESession, he_session, he_session_wide, noise_bound,
                               u64_bytes_view)
# the pieces linear_simd shares, defined below both (re-exported: protocols.linear.plan_blocks, W_BITS, ...)
from .linear_common import IN_FRAC, W_BITS, W_FRAC, BlockPlan, _to_in_frac, plan_blocks  # noqa: F401


@dataclasses.dataclass
class LinearStats:
    """What the last cross terms did (for reports): plans and counts."""

    calls: int = 0
    in_cts: int = 0
    out_cts: int = 0
    products: int = 0
    plans: list = dataclasses.field(default_factory=list)
    #: per-layer packing choices of `linear(..., packing="auto")` (`linear_simd.PackingChoice` dicts)
    packings: list = dataclasses.field(default_factory=list)

    def add(self, plan: BlockPlan) -> None:
        self.calls += 1
        self.in_cts += plan.in_cts
        self.out_cts += plan.out_cts
        self.products += plan.products
        if len(self.plans) < 64:
            self.plans.append((plan.m, plan.d, plan.o, plan.mw, plan.dw, plan.ow, plan.batch))


def linear_stats(ctx) -> LinearStats:
    s = getattr(ctx, "_linear_stats", None)
    if s is None:
        s = ctx._linear_stats = LinearStats()
    return s


# ----------------------------------------------------------------------------- packing
def _pack_lhs(plan: BlockPlan, A: np.ndarray) -> np.ndarray:
    """A (batch, m, d) mod t -> polynomials (batch, mb, db, N)."""
    bsz = A.shape[0]
    pad = np.zeros((bsz, plan.mb * plan.mw, plan.db * plan.dw), np.uint64)
    pad[:, : plan.m, : plan.d] = A
    blk = pad.reshape(bsz, plan.mb, plan.mw, plan.db, plan.dw).transpose(0, 1, 3, 2, 4)  # b, mb, db, mw, dw
    polys = np.zeros((bsz, plan.mb, plan.db, plan.mw, plan.dw * plan.ow), np.uint64)
    polys[..., : plan.dw] = blk
    out = np.zeros((bsz, plan.mb, plan.db, plan.n), np.uint64)
    out[..., : plan.mw * plan.dw * plan.ow] = polys.reshape(bsz, plan.mb, plan.db, -1)
    return out


def _pack_rhs(plan: BlockPlan, B: np.ndarray) -> np.ndarray:
    """B (batch, d, o) signed ints -> polynomials (batch, db, ob, N) (int64): the layout's
    reference definition (`_encoded_rhs` builds the same blocks natively,
    `_core.bfv_encode_blocks`; tests/test_linear_2pc.py compares the two through SEAL)."""
    bsz = B.shape[0]
    pad = np.zeros((bsz, plan.db * plan.dw, plan.ob * plan.ow), np.int64)
    pad[:, : plan.d, : plan.o] = B
    blk = pad.reshape(bsz, plan.db, plan.dw, plan.ob, plan.ow).transpose(0, 1, 3, 4, 2)  # b, db, ob, ow, dw
    blk = blk[..., ::-1]  # coefficient i*dw + dw-1-j
    out = np.zeros((bsz, plan.db, plan.ob, plan.n), np.int64)
    out[..., : plan.ow * plan.dw] = blk.reshape(bsz, plan.db, plan.ob, -1)
    return out


def _unpack_out(plan: BlockPlan, vals: np.ndarray) -> np.ndarray:
    """(batch, mb, ob, mw*ow) -> (batch, m, o)."""
    bsz = vals.shape[0]
    v = vals.reshape(bsz, plan.mb, plan.ob, plan.mw, plan.ow).transpose(0, 1, 3, 2, 4)
    return v.reshape(bsz, plan.mb * plan.mw, plan.ob * plan.ow)[:, : plan.m, : plan.o]


# ----------------------------------------------------------------------------- the cross term
def cross_matmul(ctx, encryptor: int, A: np.ndarray | None, B: np.ndarray | None, shape: tuple[int, int, int, int], *,
                 b_bits: int, cache_key=None) -> np.ndarray:
    """Additive shares mod t of A @ B: A (batch, m, d) held by ``encryptor``
    (values mod t), B (batch, d, o) held by the other party, integers with
    |B| < 2^(b_bits - 1) (signed, or values mod t when b_bits = log2 t).
    Returns this party's share (batch, m, o), uint64 mod t."""
    batch, m, d, o = (int(v) for v in shape)
    mag = float(1 << (b_bits - 1))
    he = cross_session(ctx, d, b_bits)
    if he.backend.name != "seal" or not he.native:  # the kernels share SEAL's NTT convention and keys
        raise MPCError(f"the coefficient-packed cross term needs SEAL's keys as residues "
                       f"(HESession.native), not backend {he.backend.name!r}")
    n, t = he.n, he.t
    # flooding must fit below q / 2t: noise_bound(d * ow, mag) * 2^(FLOOD_SIGMA + 1) * 2 < 2^(log q - log t - 1)
    max_terms = he.max_flood_terms(mag)
    k = len(he.he.coeff_moduli)
    plan = plan_blocks(m, d, o, n, batch, max_noise_terms=float(max_terms), in_ct_bytes=k * n * 8,
                       encode_weights=cache_key is None, op_scale=(n / 8192) * (k / 3))
    linear_stats(ctx).add(plan)
    bound = noise_bound(d * plan.ow, mag)
    positions = plan.positions()
    if ctx.party == encryptor:
        A = np.asarray(A, np.uint64).reshape(batch, m, d) & np.uint64(t - 1)
        polys = _pack_lhs(plan, A).reshape(-1, n)
        ctx.send(he.encrypt_native(polys))
        reply = ctx.recv()
        c1 = np.asarray(reply["c1"], np.uint64)
        c0 = np.asarray(reply["c0"], np.uint64)
        want1, want0 = (plan.out_cts, RESULT_PRIMES, n), (plan.out_cts, RESULT_PRIMES, positions.size)
        if c1.shape != want1 or c0.shape != want0:
            raise MPCError(f"cross term reply has shapes {c1.shape}/{c0.shape}, expected {want1}/{want0}")
        vals = he.decrypt_native(c1, c0, positions)
        return _unpack_out(plan, vals.reshape(batch, plan.mb, plan.ob, -1))
    # evaluator: the inputs in NTT form as one array, order (batch, mb, db)
    msg = ctx.recv()
    if not isinstance(msg, dict):
        raise MPCError(f"cross term: expected a dict of ciphertexts, got {type(msg).__name__}")
    xs = he.load_native(msg, plan.in_cts)
    rhs = _encoded_rhs(he, plan, B, b_bits, cache_key)
    c1s, c0s, shares = [], [], []
    for sums in _block_products(he, plan, xs, rhs):
        c1, c0, sh = he.finish_native(sums, positions, bound)
        c1s.append(c1)
        c0s.append(c0)
        shares.append(sh)
    ctx.send({"c1": np.concatenate(c1s), "c0": np.concatenate(c0s)})
    return _unpack_out(plan, np.concatenate(shares).reshape(batch, plan.mb, plan.ob, -1))


#: output blocks per native call of `_block_products` (bounds the result buffer: 393 kB each
#: at N = 8192 and 3 primes)
PRODUCT_CHUNK = 64


def _block_products(he: HESession, plan: BlockPlan, xs: np.ndarray, rhs: EncodedRhs):
    """Yield per chunk of output blocks, in the order (batch, mb, ob), the NTT-form products
    sum_di x[b, mi, di] * W[b, di, oi] (chunk, 2, k, N), computed in one native call
    (`_core.ntt_mul_sum`: every core, one reduction per coefficient) instead of a backend call
    per block pair.  An output whose weight blocks are all zero sums to zero (the finishing
    re-randomises it like every other)."""
    n, k = he.n, xs.shape[2]
    moduli = [int(q) for q in he.he.coeff_moduli[:k]]
    outs = [(bi, mi, oi) for bi in range(plan.batch) for mi in range(plan.mb) for oi in range(plan.ob)]
    for start in range(0, len(outs), PRODUCT_CHUNK):
        chunk = outs[start:start + PRODUCT_CHUNK]
        offsets, x_idx, w_idx = [0], [], []
        for bi, mi, oi in chunk:
            for di in range(plan.db):
                w = int(rhs.index[bi, di, oi])
                if w >= 0:
                    x_idx.append((bi * plan.mb + mi) * plan.db + di)
                    w_idx.append(w)
            offsets.append(len(x_idx))
        sums = np.frombuffer(_core.ntt_mul_sum(u64_bytes_view(xs), u64_bytes_view(rhs.weights), offsets, x_idx,
                                               w_idx, moduli, xs.shape[1], n),
                             np.uint64).reshape(len(chunk), xs.shape[1], k, n)
        yield sums


def cross_session(ctx, d: int, b_bits: int) -> HESession:
    """The HE session a cross term with inner dimension ``d`` and plaintext operand
    |B| < 2^(b_bits - 1) runs in (public: both parties decide alike): ``TWOPC_BFV``
    when FLOOD_SIGMA-bit flooding fits its 180 data bits for at least one output block
    column (o_w = 1), else ``TWOPC_BFV_WIDE`` (a share mod t as plaintext operand:
    attention, MoE dispatch/combine; module docstring of `he_session`)."""
    he = he_session(ctx)
    if he.max_flood_terms(float(1 << (b_bits - 1))) >= d:
        return he
    wide = he_session_wide(ctx)
    if wide.max_flood_terms(float(1 << (b_bits - 1))) < d:
        raise MPCError(f"a {d}-term product of {b_bits}-bit operands cannot be flooded with "
                       f"{FLOOD_SIGMA} bits in {wide.params.name}")
    return wide


@dataclasses.dataclass
class EncodedRhs:
    """A cross term's plaintext operand, encoded: ``weights`` (n_w, k, N) uint64 NTT-form
    residues of its non-zero blocks, ``index`` (batch, db, ob) the row of block (b, di, oi)
    in ``weights`` or -1 for an all-zero block."""

    weights: np.ndarray
    index: np.ndarray


def _encoded_rhs(he: HESession, plan: BlockPlan, B, b_bits: int, cache_key) -> EncodedRhs:
    key = None if cache_key is None else (cache_key, plan.dw, plan.ow, plan.d, plan.o, plan.batch)
    if key is not None and key in he.plain_cache:
        return he.plain_cache[key]
    if B is None:
        raise MPCError("the evaluator must hold the plaintext operand")
    B = np.asarray(B)
    if B.shape != (plan.batch, plan.d, plan.o):
        raise MPCError(f"plaintext operand has shape {B.shape}, expected {(plan.batch, plan.d, plan.o)}")
    if b_bits >= he.t_bits:  # a share mod t: centre it
        B = np.asarray(B, np.uint64) & np.uint64(he.t - 1)
        B = np.where(B >= np.uint64(he.t // 2), B.astype(np.int64) - he.t, B.astype(np.int64))
    else:
        B = B.astype(np.int64)
        if np.abs(B).max(initial=0) >= 1 << (b_bits - 1):
            raise MPCError(f"weights exceed the public bound |W| < 2^{b_bits - 1 - W_FRAC}")
    # Cheetah's blocks (`_pack_rhs`'s layout), centred lift and NTT, natively and straight from
    # B: the same residues as `he.encode_plain(_pack_rhs(plan, B)[b, di, oi])` (SEAL) gives
    moduli = [int(q) for q in he.he.coeff_moduli]
    B = np.ascontiguousarray(B, np.int64)
    nonzero, enc = _core.bfv_encode_blocks(B.reshape(-1).view(np.uint8), (plan.batch, plan.d, plan.o),
                                           (plan.dw, plan.ow), moduli, he.n)
    nonzero = np.frombuffer(nonzero, np.uint8).astype(bool).reshape(plan.batch, plan.db, plan.ob)
    index = np.full(nonzero.shape, -1, np.int64)
    index[nonzero] = np.arange(int(nonzero.sum()))
    weights = np.frombuffer(enc, np.uint64).reshape(-1, len(moduli), he.n)
    out = EncodedRhs(weights, index)
    if key is not None:
        he.plain_cache[key] = out
    return out


# ----------------------------------------------------------------------------- share-level API
def _matmul_mod(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a @ b) mod 2^bits for uint64 operands (numpy integer matmul wraps mod 2^64)."""
    return np.matmul(a.astype(np.uint64), b.astype(np.uint64)) & mask(bits)


#: limb width of `matmul_small_mod`: d (2^LIMB - 1) max|W| must stay below 2^53
LIMB_BITS = 20


def matmul_small_mod(a: np.ndarray, w: np.ndarray, bits: int, bound: int | None = None) -> np.ndarray:
    """(a @ w) mod 2^bits for a (m, d) uint64 mod 2^bits and small signed integers w (d, o),
    exactly, through float64 BLAS: a is cut into LIMB_BITS-bit limbs whose products with w
    sum exactly in a double while d (2^LIMB_BITS - 1) max|w| < 2^53; otherwise numpy's
    (BLAS-less, ~30x slower) integer matmul.  ``bound``: a known bound on max|w| (the
    weights' public bound, checked where they are encoded) instead of scanning w."""
    w = np.asarray(w, np.int64)
    big = int(np.abs(w).max(initial=0)) if bound is None else int(bound)
    if a.shape[-1] * ((1 << LIMB_BITS) - 1) * big >= 1 << 53:
        return _matmul_mod(a, w.astype(np.uint64), bits)
    wf = w.astype(np.float64)
    a = np.asarray(a, np.uint64)
    acc = np.zeros(a.shape[:-1] + (w.shape[-1],), np.uint64)
    for shift in range(0, bits, LIMB_BITS):
        limb = ((a >> np.uint64(shift)) & mask(LIMB_BITS)).astype(np.float64)
        acc += np.matmul(limb, wf).astype(np.int64).astype(np.uint64) << np.uint64(shift)
    return acc & mask(bits)


def lift_local(ctx, y: np.ndarray, bits: int, frac: int, out_frac: int) -> AShare:
    """Shares mod 2^bits -> ring shares, locally: each party reads its share as a
    centred integer (correct except with probability about |y| / 2^bits), then
    SecureML local truncation from ``frac`` to ``out_frac`` fraction bits."""
    ring = ctx.ring
    y = np.asarray(y, np.uint64) & mask(bits)
    if bits < ring.bits:
        neg = y >= np.uint64(1 << (bits - 1))
        y = np.where(neg, y | (mask(ring.bits) ^ mask(bits)), y)  # sign-extend the share
    z = AShare(ctx, y & mask(ring.bits), ring.bits, frac)
    return trunc_local(ctx, z, frac - out_frac) if frac > out_frac else z


def linear(ctx, x: AShare, weight: np.ndarray | None, bias: np.ndarray | None = None, *,
           out_features: int, cache_key=None, packing: str = "coeff", network: str | None = None) -> AShare:
    """y = x @ weight (+ bias): x AShare (..., d_in); weight (d_in, d_out) float and
    bias (d_out,) held by party 1 (the server), None at party 0; returns AShare (..., d_out)
    at the ring's fraction bits.  ``cache_key`` (any hashable naming the weight) keeps
    the encoded weight blocks for later calls.

    ``packing``: "coeff" (Cheetah coefficient packing, this module; the default: it was
    measured faster on every shape of docs/linear_2pc.md on LAN and WAN), "simd" (BFV
    batching with BOLT-style BSGS, `linear_simd`), or "auto": the per-layer choice of
    `linear_simd.choose_packing` (cost model of products, rotations and bytes at the
    ``network`` preset of `net.netmodel`), recorded in ``linear_stats(ctx).packings``."""
    if not isinstance(x, AShare):
        raise TypeError("linear expects an AShare input")
    ring = ctx.ring
    d = int(x.shape[-1])
    o = int(out_features)
    lead = x.shape[:-1]
    if packing not in ("coeff", "simd", "auto"):
        raise MPCError(f"unknown packing {packing!r}")
    if packing != "coeff":
        from .linear_simd import choose_packing, linear_simd
        m_rows = int(np.prod(lead, dtype=np.int64)) if lead else 1
        if packing == "auto":
            network = network or "LAN"
            choice = choose_packing(m_rows, d, o, network or "LAN", encode_weights=cache_key is None)
            st = linear_stats(ctx)
            if len(st.packings) < 256:
                st.packings.append(choice.to_dict())
            packing = choice.packing
        if packing == "simd":
            return linear_simd(ctx, x, weight, bias, out_features=o, cache_key=cache_key, network=network)
    he = he_session(ctx)
    k = he.t_bits
    xk = _to_in_frac(ctx, x).data.reshape(1, -1, d) & mask(k)
    m = xk.shape[1]
    Wq = None
    if ctx.party == 1:
        if weight is None:
            raise MPCError("the server must pass the weight")
        weight = np.asarray(weight)
        if weight.shape != (d, o):
            raise MPCError(f"weight has shape {weight.shape}, expected {(d, o)}")
        Wq = np.round(weight.astype(np.float64) * (1 << W_FRAC)).astype(np.int64)[None]
    with ctx.step("linear"):
        y = cross_matmul(ctx, 0, xk if ctx.party == 0 else None, Wq, (1, m, d, o), b_bits=W_BITS,
                         cache_key=cache_key)[0]
    if ctx.party == 1:
        # |Wq| < 2^(W_BITS - 1): checked where the blocks were encoded (`_encoded_rhs`)
        y = y + matmul_small_mod(xk[0], Wq[0], k, bound=1 << (W_BITS - 1))
    out = lift_local(ctx, y, k, IN_FRAC + W_FRAC, ring.frac)
    if ctx.party == 1 and bias is not None:
        bias = np.asarray(bias, np.float64).reshape(-1)
        if bias.shape != (o,):
            raise MPCError(f"bias has shape {bias.shape}, expected {(o,)}")
        out.data = (out.data + fixed_encode(bias, ring.frac, ring.bits)) & mask(ring.bits)
    return out.reshape(*lead, o)


def matmul_shared(ctx, a: AShare, b: AShare) -> AShare:
    """a (..., m, k) @ b (..., k, n) for two shared fixed-point tensors (leading
    dimensions are a batch, e.g. attention heads; they must match exactly)."""
    if not isinstance(a, AShare) or not isinstance(b, AShare):
        raise TypeError("matmul_shared expects two AShare")
    if a.ndim < 2 or b.ndim < 2 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise MPCError(f"cannot multiply shapes {a.shape} @ {b.shape}")
    lead = a.shape[:-2]
    m, kd, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = int(np.prod(lead, dtype=np.int64)) if lead else 1
    he = he_session(ctx)
    k = he.t_bits
    ak = _to_in_frac(ctx, a).data.reshape(batch, m, kd) & mask(k)
    bk = _to_in_frac(ctx, b).data.reshape(batch, kd, n) & mask(k)
    shape = (batch, m, kd, n)
    with ctx.step("matmul-shared"):
        y = _matmul_mod(ak, bk, k)  # own local term a_p b_p
        # cross term a_0 b_1: party 0 encrypts a_0, party 1 holds b_1; then a_1 b_0 the other way
        y = y + cross_matmul(ctx, 0, ak if ctx.party == 0 else None, bk if ctx.party == 1 else None, shape, b_bits=k)
        y = y + cross_matmul(ctx, 1, ak if ctx.party == 1 else None, bk if ctx.party == 0 else None, shape, b_bits=k)
    out = lift_local(ctx, y, k, 2 * IN_FRAC, ctx.ring.frac)
    return out.reshape(*lead, m, n)


__all__ = ["linear", "matmul_shared", "cross_matmul", "lift_local", "matmul_small_mod", "plan_blocks", "BlockPlan", "LinearStats",
           "linear_stats", "IN_FRAC", "W_FRAC", "W_BITS"]

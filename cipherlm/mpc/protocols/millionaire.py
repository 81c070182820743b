"""Millionaires' comparison and equality of private inputs (CrypTFlow2 section 3.1, Algorithm 1).

Party 0 holds x, party 1 holds y, both ``bits``-bit unsigned; the output is a
Boolean sharing of 1{x < y} (and optionally of 1{x == y}).

Algorithm 1: split x and y into q = ceil(bits/m) blocks of m bits (m = 4 on
IKNP/KK13, 3 on silent OT: `block_size`).  For
every block j party 0 samples shares lt0_j, eq0_j and acts as the sender of a
1-out-of-2^m OT whose k-th message is (lt0_j XOR 1{x_j < k}, eq0_j XOR 1{x_j == k})
(2 bits); party 1 chooses k = y_j and gets lt1_j, eq1_j.  The leaves are then
combined pairwise up a tree of depth ceil(log2 q):

    lt = lt_hi XOR (eq_hi AND lt_lo),   eq = eq_hi AND eq_lo,

with the two ANDs sharing eq_hi evaluated with one correlated Beaver triple
(`bool_ops.bit_triples(k=2)`).  The most significant block of a bit width that
m does not divide is padded with zeros on both sides.

Cost per element (IKNP-style OT, bits = l): q 1-of-16 OTs with 2-bit messages
(KK13: ~256 + 16*2 bits each) + (q-1) correlated triples (2 ROTs, 2*128 bits)
+ 3 bits each way per AND node; rounds: the 1-of-N OT, the triples, then one
exchange per tree level (ceil(log2 q) = 4 for l = 64).  Measured in docs/mpc.md.

`equality` (CrypTFlow2 section 3.2, the equality variant of Algorithm 1): the
same leaves with only the eq bits (1-bit messages) and an AND-tree of eq.
"""

from __future__ import annotations

import numpy as np

from cipherlm import _core

from ..ring import mask, uniform_bits
from .bool_ops import and_bits, bit_triples

M = 4  # block size: 1-out-of-2^M OT per block (IKNP/KK13, and equality always)
#: block size of the comparison on silent OT: a 1-of-2^m OT there costs m COTs (m bits)
#: + 2^m 2-bit messages, so m = 3 beats m = 4 once the KK13 row is gone: per 63-bit
#: comparison 21 (3 + 16) + 20 x 8 bits (one AND node) = 559 bits against 16 (4 + 32) +
#: 15 x 8 = 696 (measured 65536 elements, refills included: ~596 against ~791); m = 2 is
#: level (568) with one more tree level
M_SILENT = 3

__all__ = ["millionaire", "equality", "block_size", "M", "M_SILENT"]


def block_size(ctx) -> int:
    """The comparison's block size for this context's OT extension (M_SILENT on Ferret)."""
    return M_SILENT if getattr(ctx.ot, "ferret", False) else M


def _blocks(v: np.ndarray, bits: int, m: int) -> np.ndarray:
    """The m-bit digits (m <= 8) of v's ``bits``-bit values: (n, q) uint8, digit 0 the least
    significant (one pass in the Rust core, `digit_blocks`)."""
    q = -(-bits // m)
    v = np.ascontiguousarray(v, dtype=np.uint64)
    return np.frombuffer(_core.digit_blocks(v.view(np.uint8), bits, m), np.uint8).reshape(v.size, q)


def _leaves(ctx, v: np.ndarray, bits: int, m: int, want_lt: bool):
    """Shares of the per-block (lt, eq) bits, each (n, q) uint8."""
    n = v.size
    q = -(-bits // m)
    N = 1 << m
    blocks = _blocks(v, bits, m)
    with ctx.step("millionaire_leaves"):
        if ctx.party == 0:
            lt0 = uniform_bits(ctx.rng, (n, q)) if want_lt else np.zeros((n, q), np.uint8)
            eq0 = uniform_bits(ctx.rng, (n, q))
            # message k of leaf (j, i): (lt0 xor 1{x_ji < k}) | (eq0 xor 1{x_ji == k}) << 1 (eq only
            # for `equality`), n q N bytes made in one pass (`cmp_leaf_msgs`)
            msgs = np.frombuffer(_core.cmp_leaf_msgs(blocks.reshape(-1), lt0.reshape(-1), eq0.reshape(-1), N, want_lt),
                                 np.uint8).reshape(n * q, N)
            ctx.ot.send_1ofN(msgs, 2 if want_lt else 1)
            return lt0, eq0
        got = np.asarray(ctx.ot.recv_1ofN(blocks.reshape(-1), N, 2 if want_lt else 1), np.uint64).reshape(n, q)
        if want_lt:
            return (got & np.uint64(1)).astype(np.uint8), (got >> np.uint64(1)).astype(np.uint8)
        return np.zeros((n, q), np.uint8), got.astype(np.uint8)


def _tree_sizes(q: int) -> list[int]:
    sizes = []
    while q > 1:
        sizes.append(q // 2)
        q = q - q // 2
    return sizes


def _flat_inputs(v, bits: int):
    """A party's comparison inputs as a flat uint64 vector reduced to ``bits`` bits, and their shape."""
    v = np.asarray(v, dtype=np.uint64)
    shape = v.shape
    v = v.reshape(-1)
    if bits > 0:
        v = v & mask(bits)
    return v, shape


def millionaire(ctx, v, bits: int, *, want_eq: bool = False, m: int | None = None):
    """Boolean shares (uint8 0/1, shape of v) of 1{x < y}, where party 0 passes x
    and party 1 passes y (unsigned, ``bits`` wide).  With want_eq also 1{x == y}.
    ``m``: block size (default `block_size`)."""
    v, shape = _flat_inputs(v, bits)
    if m is None:
        m = block_size(ctx)
    if bits <= 0:
        z = np.zeros(shape, np.uint8)
        e = np.full(shape, 1 if ctx.party == 0 else 0, np.uint8)
        return (z, e) if want_eq else z
    m = min(m, bits)
    lt, eq = _leaves(ctx, v, bits, m, True)
    n = v.size
    sizes = _tree_sizes(lt.shape[1])
    total = sum(sizes) * n
    with ctx.step("millionaire_tree"):
        a, b, c = bit_triples(ctx, total, 2)
        pos = 0
        for npairs in sizes:
            lo_lt, hi_lt = lt[:, 0:2 * npairs:2], lt[:, 1:2 * npairs:2]
            lo_eq, hi_eq = eq[:, 0:2 * npairs:2], eq[:, 1:2 * npairs:2]
            k = n * npairs
            t = (a[pos:pos + k], b[pos:pos + k], c[pos:pos + k])
            pos += k
            z = and_bits(ctx, hi_eq.reshape(-1), np.stack([lo_lt.reshape(-1), lo_eq.reshape(-1)], axis=1), t)
            new_lt = hi_lt ^ z[:, 0].reshape(n, npairs)
            new_eq = z[:, 1].reshape(n, npairs)
            if lt.shape[1] % 2:  # odd count: the top block passes through
                new_lt = np.concatenate([new_lt, lt[:, -1:]], axis=1)
                new_eq = np.concatenate([new_eq, eq[:, -1:]], axis=1)
            lt, eq = new_lt, new_eq
    out_lt = lt[:, 0].reshape(shape)
    return (out_lt, eq[:, 0].reshape(shape)) if want_eq else out_lt


def equality(ctx, v, bits: int, *, m: int = M):
    """Boolean shares of 1{x == y} (party 0 passes x, party 1 passes y)."""
    v, shape = _flat_inputs(v, bits)
    if bits <= 0:
        return np.full(shape, 1 if ctx.party == 0 else 0, np.uint8)
    m = min(m, bits)
    _, eq = _leaves(ctx, v, bits, m, False)
    n = v.size
    sizes = _tree_sizes(eq.shape[1])
    with ctx.step("equality_tree"):
        a, b, c = bit_triples(ctx, sum(sizes) * n, 1)
        pos = 0
        for npairs in sizes:
            k = n * npairs
            t = (a[pos:pos + k], b[pos:pos + k], c[pos:pos + k])
            pos += k
            z = and_bits(ctx, eq[:, 1:2 * npairs:2].reshape(-1), eq[:, 0:2 * npairs:2].reshape(-1, 1), t)
            new_eq = z[:, 0].reshape(n, npairs)
            if eq.shape[1] % 2:
                new_eq = np.concatenate([new_eq, eq[:, -1:]], axis=1)
            eq = new_eq
    return eq[:, 0].reshape(shape)

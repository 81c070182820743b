"""The repack of the attention probabilities P inside the softmax's conversion (BLB section 5.2,
section 6).

Q K^T comes out of the fused ct-ct MatMul (`blb_matmul.fused_qk`, section 5) in multi-head
*diagonal* packing; P V (`blb_matmul.fused_av`) wants P in multi-head *spatial-first* packing.
Between the two sits the softmax, a nonlinear core evaluated in MPC: its input is converted
CKKS -> MPC (`ckks_convert.ckks_to_shares`, Algorithm 1) and its output P MPC -> CKKS
(`ckks_convert.shares_to_ckks`, Algorithm 2).  Section 5.2: "Since the next operator is
nonlinear, we convert to secret-share form and repack it"; "P is already in secret-share form,
so we can directly repack it to the multi-head spatial-first packing".  On additive shares a
change of packing is a public permutation of the slot values (entries of P that the
destination pads are 0, a valid sharing of 0), so each party applies it to its own share
vector: no message, no randomness, no rounding.  (This is also where the conversions'
slot order lives: `ckks_convert` already returns the shares in the backend's slot order.)

Source (Q K^T's output, `blb_matmul.unpack_diagonals`): ciphertext q, slot (g H + h) n + t holds
S_h[t, (t + q c + g) mod n] (diagonal delta = q c + g).  Destination (`blb_matmul.pack_columns`
for P V's layout, reduce dimension k = n): ciphertext j, slot (g' H + h) n + t holds
P_h[t, j c' + g'].  So destination (j, g', h, t) reads source delta = (j c' + g' - t) mod n:
ciphertext delta div c, group delta mod c, the same head and token.
"""

from __future__ import annotations

import numpy as np

from ...mpc.shares import AShare
from .blb_matmul import MHLayout

__all__ = ["repack_index", "repack_plain", "repack_shares"]


def repack_index(src: MHLayout, dst: MHLayout) -> np.ndarray:
    """The permutation, as indices into the concatenated source slot vectors (n / c ciphertexts
    of S slots, Q K^T's diagonal packing ``src``) for every destination slot (J' ciphertexts of
    S' slots, P V's spatial-first packing ``dst``); -1 where the destination holds padding."""
    if src.heads != dst.heads or src.n != dst.n:
        raise ValueError(f"layouts of {src.heads} / {dst.heads} heads and {src.n} / {dst.n} tokens")
    if dst.k < dst.n:
        raise ValueError(f"P V reduces over the n = {dst.n} key positions: its k ({dst.k}) is smaller")
    n, H = dst.n, dst.heads
    j, g, h, t = np.meshgrid(np.arange(dst.n_cts), np.arange(dst.groups), np.arange(H), np.arange(n), indexing="ij")
    col = j * dst.groups + g  # P_h's column (key position)
    delta = (col - t) % n
    sq, sg = delta // src.groups, delta % src.groups
    idx = np.where(col < n, sq * src.slots + (sg * H + h) * n + t, -1)
    out = np.full((dst.n_cts, dst.slots), -1, np.int64)
    out[:, : dst.groups * dst.group_slots] = idx.reshape(dst.n_cts, -1)
    return out.reshape(-1)


def repack_plain(vecs, src: MHLayout, dst: MHLayout) -> np.ndarray:
    """The repack on cleartext slot vectors: (n / c, S) -> (J', S')."""
    v = np.asarray(vecs).reshape(-1)
    idx = repack_index(src, dst)
    return np.where(idx >= 0, v[np.maximum(idx, 0)], 0).reshape(dst.n_cts, dst.slots)


def repack_shares(y: AShare, src: MHLayout, dst: MHLayout) -> AShare:
    """Each party's additive share of P, from Q K^T's diagonal packing (the concatenated slot
    values of the n / c converted ciphertexts, `ckks_convert.ckks_to_shares`) to P V's
    spatial-first packing (J' S' values, ciphertext by ciphertext, for
    `ckks_convert.shares_to_ckks`): the local permutation `repack_index`, zeros where P V pads.
    Communication-free; the same fixed-point scale and ring."""
    data = np.asarray(y.data, np.uint64).reshape(-1)
    if data.size != src.n_out * src.slots:
        raise ValueError(f"expected {src.n_out} x {src.slots} share values, got {data.size}")
    idx = repack_index(src, dst)
    out = np.where(idx >= 0, data[np.maximum(idx, 0)], np.uint64(0))
    return AShare(y.ctx, out, y.bits, y.frac)

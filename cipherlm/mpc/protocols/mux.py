"""Multiplexer: select(b, x) = b * x for a shared bit b and a shared ring value x
(CrypTFlow2 section 4.1 / appendix "Multiplexer", with correlated OT).

Each party P in turn is the COT sender with correlation (1 - 2 b_P) x_P: the
peer, choosing with b_{1-P}, gets r_P + b_{1-P} (1 - 2 b_P) x_P, which with the
sender's b_P x_P - r_P sums to (b_P XOR b_{1-P}) x_P = b x_P.

Cost per element: 2 COTs of l bits (IKNP: 2 (128 + l) bits), 2 OT calls.
"""

from __future__ import annotations

import numpy as np

from ..shares import AShare, BShare

__all__ = ["mux", "mux_bits"]


def mux_bits(ctx, b: np.ndarray, x: np.ndarray, bits: int) -> np.ndarray:
    b = np.asarray(b).astype(np.uint64).reshape(-1)
    x = np.asarray(x, np.uint64).reshape(-1)
    one_minus_2b = np.uint64(1) - (b << np.uint64(1))
    out = np.zeros_like(x)
    with ctx.step("mux"):
        for sender in (0, 1):
            if ctx.party == sender:
                r = np.asarray(ctx.ot.send_cot(one_minus_2b * x, bits), np.uint64)
                out += b * x - r
            else:
                out += np.asarray(ctx.ot.recv_cot(b.astype(bool), bits), np.uint64)
    return out


def mux(ctx, b: BShare, x: AShare) -> AShare:
    """b * x (b: shared bits, x: arithmetic shares of the same shape)."""
    if b.bits != 1:
        raise ValueError("mux selects with shared bits (bits=1)")
    if b.shape != x.shape:
        raise ValueError(f"mux: selector shape {b.shape} differs from value shape {x.shape}")
    return x._like(mux_bits(ctx, b.data, x.data, x.bits).reshape(x.shape))

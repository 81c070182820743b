"""What the two packings of the 2pc linear layer share (`linear`: coefficient
packing, `linear_simd`: SIMD/BSGS packing): the fixed-point widths, the coefficient
packing's block plan and its cost model (`BlockPlan`, `plan_blocks`, which
`linear_simd.choose_packing` compares against), and the input truncation
(`_to_in_frac`).  Below both modules, so that `linear` imports `linear_simd` (its
dispatch to the SIMD packing) and `linear_simd` does not import `linear` back;
`linear` re-exports the names here that it always had (``protocols.linear.plan_blocks``,
``BlockPlan``, ``IN_FRAC``, ``W_BITS``, ``W_FRAC``, ``_to_in_frac``).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from ..he.backend import TwoPCCostModel, get_backend
from ..mpc.context import MPCError
from ..mpc.protocols.trunc import trunc_local
from ..mpc.shares import AShare

__all__ = ["IN_FRAC", "W_FRAC", "W_BITS", "BlockPlan", "plan_blocks"]

IN_FRAC = 14
W_FRAC = 14
W_BITS = 20  # |round(W 2^W_FRAC)| < 2^(W_BITS - 1): public bound (|W| < 32), checked by the weight owner

#: the cost model's per-operation seconds are the HE backend's (`get_backend().cost_model.twopc`,
#: ``coeff_*``: N = 8192, three primes, 2-vCPU reference machine); bytes/s of a 1 Gbps LAN
_LAN_BYTES_PER_S = 1e9 / 8


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Coefficient-packing blocks for a batch of (m x d) @ (d x o) cross terms."""

    m: int
    d: int
    o: int
    mw: int
    dw: int
    ow: int
    n: int
    batch: int = 1

    @property
    def mb(self) -> int:
        return -(-self.m // self.mw)

    @property
    def db(self) -> int:
        return -(-self.d // self.dw)

    @property
    def ob(self) -> int:
        return -(-self.o // self.ow)

    @property
    def in_cts(self) -> int:
        return self.batch * self.mb * self.db

    @property
    def out_cts(self) -> int:
        return self.batch * self.mb * self.ob

    @property
    def products(self) -> int:
        return self.batch * self.mb * self.db * self.ob

    def positions(self) -> np.ndarray:
        """Coefficient index of output (t, i) of a block, shape (mw * ow,)."""
        t = np.arange(self.mw)[:, None]
        i = np.arange(self.ow)[None, :]
        return (t * self.dw * self.ow + i * self.dw + self.dw - 1).reshape(-1)

    def bytes_estimate(self, in_ct_bytes: int, out_prime_bytes: int = 16) -> int:
        return self.in_cts * in_ct_bytes + self.out_cts * (self.n + self.mw * self.ow) * out_prime_bytes

    def seconds_estimate(self, in_ct_bytes: int, encode_weights: bool, op_scale: float = 1.0,
                         cost: TwoPCCostModel | None = None) -> float:
        """``op_scale``: cost of one HE operation relative to N = 8192 at three primes
        (the constants' reference; N = 16384 at four primes: 2 x 4/3).  ``cost``: the
        machine constants (default: the default HE backend's cost model)."""
        c = get_backend().cost_model.twopc if cost is None else cost
        s = op_scale * (self.in_cts * c.coeff_encrypt + self.products * c.coeff_product + self.out_cts * c.coeff_finish)
        s += self.bytes_estimate(in_ct_bytes) / _LAN_BYTES_PER_S
        if encode_weights:
            s += op_scale * self.batch * self.db * self.ob * c.coeff_encode
        return s


def _dw_candidates(d: int, n: int) -> list[int]:
    c = {min(d, n)}
    p = 1
    while p < min(d, n):
        c.add(p)
        p *= 2
    return sorted(c)


@lru_cache(maxsize=4096)
def plan_blocks(m: int, d: int, o: int, n: int, batch: int = 1,
                max_noise_terms: float | None = None, in_ct_bytes: int = 3 * 8192 * 8,
                encode_weights: bool = True, op_scale: float = 1.0) -> BlockPlan:
    """The block shape (m_w, d_w, o_w), m_w d_w o_w <= N, with the lowest modelled
    time (ct-pt products, encryptions, finishing, bytes on a 1 Gbps LAN).
    ``max_noise_terms`` caps d * o_w (the number of plaintext terms summed into
    one output coefficient's noise); ``op_scale`` scales the HE operations' times
    (`BlockPlan.seconds_estimate`)."""
    if min(m, d, o, n) < 1:
        raise MPCError(f"empty matrix product {m}x{d} @ {d}x{o}")
    best = None
    for dw in _dw_candidates(d, n):
        for mw in range(1, min(m, n // dw) + 1):
            ow = min(o, n // (mw * dw))
            if ow < 1:
                continue
            if max_noise_terms is not None and d * ow > max_noise_terms:
                ow = int(max_noise_terms // d)
                if ow < 1:
                    continue
            p = BlockPlan(m, d, o, mw, dw, ow, n, batch)
            key = (p.seconds_estimate(in_ct_bytes, encode_weights, op_scale), p.bytes_estimate(in_ct_bytes))
            if best is None or key < best[0]:
                best = (key, p)
    if best is None:
        raise MPCError(f"no block shape fits {m}x{d} @ {d}x{o} in N={n}")
    return best[1]


def _to_in_frac(ctx, x: AShare) -> AShare:
    """Shares at ``IN_FRAC`` fraction bits (local truncation, or a shift up)."""
    if x.frac > IN_FRAC:
        return trunc_local(ctx, x, x.frac - IN_FRAC)
    if x.frac < IN_FRAC:
        return AShare(ctx, x.data << np.uint64(IN_FRAC - x.frac), x.bits, IN_FRAC)
    return x

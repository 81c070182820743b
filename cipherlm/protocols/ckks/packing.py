"""Token-group packing of a (T, d) activation into CKKS slots (AEGIS section 2.3 /
NEXUS): one ciphertext holds ``cpc`` channels x ``tp`` token positions, channel-major,

    slot(c, t) = (c mod cpc) * tp + t,   ciphertext c // cpc,

so every slot is used once d * tp >= slots (AEGIS's s_tok x c_tok = N/2 with s_tok = tp,
c_tok = cpc).  A pass over T tokens at positions offset..offset+T-1 (offset > 0: decoding
after a prefix whose keys and values a KV cache holds) puts token t at slot position
offset + t, so cached keys and new queries line up by absolute position.  ``tp`` is a
power of two >= 2 (offset + T): the positions outside the pass's own hold zeros, and a slot rotation by r with |r| < T then shifts the tokens of every channel
at once with zeros coming in (position t reads t + r of the same channel, or a zero of a
padding position: the shifted-token products of attention, `attention.py`, need no mask).
A rotation by k * tp moves channels by k, cyclically over the cpc channels of a
ciphertext (the linear layers' diagonals, the channel sums of the norms).

Invariant kept by every operator of this package: padding positions (t >= T) and padding
channels (c >= d) decrypt to 0 (up to CKKS noise).  One exception: P.V (`attention.attend`)
leaves partial sums outside the pass's positions, and the projection that always follows
it masks them (its diagonals carry the token mask).  Public: T, d and the layout; the
values are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class TokenPacking:
    """The layout of T tokens in ciphertexts of ``slots`` slots (see the module docstring)."""

    slots: int
    tokens: int
    #: at least this many positions per channel (a session's keys are made for its largest T)
    tp_min: int = 0
    #: the position of the first token (a decoding step after a cached prefix)
    offset: int = 0

    def __post_init__(self):
        if self.tokens < 1 or self.offset < 0:
            raise ValueError("at least one token, at a position >= 0")
        if self.slots & (self.slots - 1) or self.slots < 2:
            raise ValueError(f"slots must be a power of two, got {self.slots}")
        if self.tp > self.slots:
            raise ValueError(f"{self.tokens} tokens need {self.tp} positions per channel: more than the "
                             f"{self.slots} slots of a ciphertext")

    @property
    def tp(self) -> int:
        """Positions per channel: a power of two >= 2 (offset + T) (and >= tp_min)."""
        return max(next_pow2(2 * (self.offset + self.tokens)), next_pow2(self.tp_min))

    @property
    def end(self) -> int:
        """One past the last position of the pass."""
        return self.offset + self.tokens

    def layout(self) -> tuple[int, int]:
        """(slots, tp): two packings with the same layout hold positions at the same slots."""
        return (self.slots, self.tp)

    @property
    def cpc(self) -> int:
        """Channels per ciphertext."""
        return self.slots // self.tp

    def n_cts(self, d: int) -> int:
        return -(-int(d) // self.cpc)

    def token_mask(self) -> np.ndarray:
        """(tp,) 1.0 at the pass's positions offset..offset+T-1."""
        m = np.zeros(self.tp)
        m[self.offset:self.end] = 1.0
        return m

    def pack(self, x: np.ndarray) -> np.ndarray:
        """(T, d) -> (n_cts, slots) slot vectors."""
        x = np.asarray(x, np.float64)
        if x.ndim != 2 or x.shape[0] != self.tokens:
            raise ValueError(f"expected ({self.tokens}, d) values, got {x.shape}")
        d = x.shape[1]
        n = self.n_cts(d)
        out = np.zeros((n * self.cpc, self.tp))
        out[:d, self.offset:self.end] = x.T
        return out.reshape(n, self.slots)

    def unpack(self, slots: np.ndarray, d: int) -> np.ndarray:
        """(n_cts, slots) -> (T, d)."""
        s = np.asarray(slots, np.float64).reshape(-1, self.cpc, self.tp)
        return s.reshape(-1, self.tp)[:d, self.offset:self.end].T.copy()

    def channel_vector(self, v, d: int, *, tokens: bool = True) -> np.ndarray:
        """(n_cts(d), slots): a per-channel vector v (d,) broadcast over the real positions (all
        tp positions with ``tokens=False``)."""
        v = np.asarray(v, np.float64).reshape(-1)
        if v.size != d:
            raise ValueError(f"expected {d} channel values, got {v.size}")
        n = self.n_cts(d)
        cols = np.zeros(n * self.cpc)
        cols[:d] = v
        row = self.token_mask() if tokens else np.ones(self.tp)
        return (cols[:, None] * row[None, :]).reshape(n, self.slots)

    def grid(self, values: np.ndarray, d: int) -> np.ndarray:
        """(n_cts(d), slots) from a (d, tp) array of per-(channel, position) values."""
        values = np.asarray(values, np.float64)
        if values.shape != (d, self.tp):
            raise ValueError(f"expected ({d}, {self.tp}) values, got {values.shape}")
        n = self.n_cts(d)
        out = np.zeros((n * self.cpc, self.tp))
        out[:d] = values
        return out.reshape(n, self.slots)

"""Arithmetic in Z_{2^l} on numpy ``uint64`` arrays, fixed-point encoding, CSPRNG sampling.

Every ring element is stored in a ``uint64`` whose bits above ``l`` are zero
(``1 <= l <= 64``).  numpy's ``uint64`` arithmetic wraps modulo 2^64, so sums,
differences and products are correct modulo 2^l after masking with
``mask(l) = 2^l - 1`` (2^l divides 2^64).

Fixed point (CrypTFlow2 section 2.1, SecureML): a real ``v`` is encoded with
``f`` fraction bits as ``round(v * 2^f) mod 2^l`` in two's complement; the
signed interpretation of ``u`` is ``u - 2^l`` when ``u >= 2^(l-1)``.

Randomness protecting secrets comes from a CSPRNG: `new_rng` is a numpy
Generator over AES-128 in counter mode (``randomgen.AESCounter``, AES-NI) keyed
with 128 bits from the OS CSPRNG (``secrets``), so a peer that sees some of its
outputs (shares, masks) cannot predict the others; numpy's own bit generators
(PCG64, ...) are not cryptographic.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

U64 = np.uint64
DEFAULT_BITS = 64
DEFAULT_FRAC = 16


def mask(bits: int) -> np.uint64:
    """2^bits - 1 as a uint64 (bits in 1..64)."""
    check_bits(bits)
    return U64((1 << bits) - 1)


def check_bits(bits: int) -> int:
    if not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 64:
        raise ValueError(f"ring bit width must be an integer in 1..64, got {bits!r}")
    return int(bits)


def reduce(x, bits: int) -> np.ndarray:
    """x mod 2^bits as uint64 (x: anything numpy turns into an integer array)."""
    a = np.asarray(x)
    if a.dtype != np.uint64:
        if a.dtype.kind == "f":
            raise TypeError("ring elements must be integers; encode floats with fixed_encode")
        if a.dtype.kind == "O":
            a = np.vectorize(lambda v: int(v) % (1 << 64), otypes=[np.uint64])(a) if a.size else a.astype(np.uint64)
        else:
            a = a.astype(np.int64, copy=False).astype(np.uint64) if a.dtype.kind == "i" else a.astype(np.uint64)
    if bits == 64:
        return a.copy() if a is x else a
    return a & mask(bits)


def to_signed(u, bits: int) -> np.ndarray:
    """Signed (two's complement) interpretation of l-bit ring elements, as int64."""
    u = np.asarray(u, dtype=np.uint64)
    if bits == 64:
        return u.view(np.int64).copy()
    half = np.int64(1 << (bits - 1))
    s = u.astype(np.int64)
    neg = s >= half
    s[neg] -= half  # subtract 2^bits in two steps (2^63 does not fit an int64)
    s[neg] -= half
    return s


def from_signed(s, bits: int) -> np.ndarray:
    """Signed integers -> l-bit ring elements."""
    return reduce(np.asarray(s, dtype=np.int64).astype(np.uint64), bits)


def fixed_encode(v, frac: int, bits: int) -> np.ndarray:
    """round(v * 2^frac) mod 2^bits; |v * 2^frac| must fit in a signed 64-bit integer."""
    v = np.asarray(v, dtype=np.float64)
    scaled = np.rint(v * float(2**frac))
    if np.any(np.abs(scaled) >= 2.0**63):
        raise OverflowError("fixed-point value out of range of int64")
    return from_signed(scaled.astype(np.int64), bits)


def fixed_decode(u, frac: int, bits: int) -> np.ndarray:
    """Signed interpretation / 2^frac as float64."""
    return to_signed(u, bits).astype(np.float64) / float(2**frac)


def new_rng() -> np.random.Generator:
    """A numpy Generator over AES-128-CTR keyed with 128 bits from the OS CSPRNG."""
    from randomgen import AESCounter

    return np.random.Generator(AESCounter(key=secrets.randbits(128)))


def uniform(rng: np.random.Generator, shape, bits: int) -> np.ndarray:
    """Uniform elements of Z_{2^bits} (uint64 array of `shape`)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = rng.bit_generator.random_raw(n).astype(np.uint64, copy=False).reshape(shape)
    return raw if bits == 64 else raw & mask(bits)


def uniform_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform bits as uint8 0/1 (every bit of the generator's 64-bit outputs used)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = rng.bit_generator.random_raw(-(-n // 64)).astype(np.uint64, copy=False)
    return np.unpackbits(raw.view(np.uint8), count=n, bitorder="little").reshape(shape)


@dataclass(frozen=True)
class RingConfig:
    """The ring Z_{2^bits} and the default number of fixed-point fraction bits."""

    bits: int = DEFAULT_BITS
    frac: int = DEFAULT_FRAC

    def __post_init__(self):
        check_bits(self.bits)
        if not 0 <= self.frac < self.bits:
            raise ValueError(f"frac must be in 0..bits-1, got {self.frac} for {self.bits} bits")

    @property
    def mask(self) -> np.uint64:
        return mask(self.bits)

    def reduce(self, x) -> np.ndarray:
        return reduce(x, self.bits)

    def encode(self, v, frac: int | None = None) -> np.ndarray:
        return fixed_encode(v, self.frac if frac is None else frac, self.bits)

    def decode(self, u, frac: int | None = None) -> np.ndarray:
        return fixed_decode(u, self.frac if frac is None else frac, self.bits)

    def to_signed(self, u) -> np.ndarray:
        return to_signed(u, self.bits)

    def from_signed(self, s) -> np.ndarray:
        return from_signed(s, self.bits)


# ------------------------------------------------------------------ Z_q helpers


def check_modulus(q: int) -> int:
    q = int(q)
    if not 2 <= q < (1 << 62):
        raise ValueError(f"prime-field modulus must be in [2, 2^62), got {q}")
    return q


def mulmod_scalar(a: np.ndarray, c: int, q: int) -> np.ndarray:
    """(a * c) mod q for uint64 a < q < 2^62 and a Python int c, by double-and-add
    (no 128-bit products needed)."""
    a = np.asarray(a, dtype=np.uint64)
    c = int(c) % q
    Q = U64(q)
    acc = np.zeros_like(a)
    cur = a.copy()
    while c:
        if c & 1:
            acc = acc + cur
            acc = np.where(acc >= Q, acc - Q, acc)
        c >>= 1
        if c:
            cur = cur + cur
            cur = np.where(cur >= Q, cur - Q, cur)
    return acc


def uniform_mod(rng: np.random.Generator, shape, q: int) -> np.ndarray:
    """Uniform elements of Z_q."""
    return rng.integers(0, q, size=shape, dtype=np.uint64)

"""Secret shares as tensor-like types: arithmetic over Z_{2^l}, Boolean (XOR).

* `AShare`: x = x_0 + x_1 mod 2^l, each party holds its ``x_i`` (uint64 array);
  ``frac`` records the fixed-point scale of the shared value (metadata only).
* `BShare`: x = x_0 XOR x_1 on ``bits``-wide words (``bits=1``: shared bits).

Local operations are free (no communication): numpy indexing, reshape,
transpose, concatenation/stacking, sums; adding/subtracting shares; adding a
public value (party 0 adds it); multiplying by a public integer; multiplying by
a public fixed-point value followed by SecureML local truncation
(`AShare.mul_public_fixed`); XOR and AND with public bits for `BShare`.

Interactive operations live in `cipherlm.mpc.protocols` (`a * b` on two
`AShare` calls `protocols.mul.mul`).  `share_input` and `reveal` move data
between plaintext and shares.

The operators that need a protocol (``a * b`` on two `AShare`, ``a & b`` on two
`BShare`, and the SecureML truncation of `AShare.mul_public_fixed`) find it in a
small kernel registry: `cipherlm.mpc.protocols` sits above this module, so each
of those protocol modules registers its implementation here when it is imported
(`register_kernel`) and the operators look it up (`kernel`); this module never
imports them.  ``cipherlm/mpc/__init__.py`` imports the registering modules, so
the kernels are in place whenever this module is.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .context import Context, MPCError
from .ring import check_bits, fixed_decode, fixed_encode, mask, reduce, to_signed, uniform

__all__ = ["AShare", "BShare", "Context", "share_input", "share_bits_input", "reveal", "concatenate", "stack",
           "register_kernel", "kernel"]

# ----------------------------------------------------------------------------- kernel registry

# name -> implementation; "mul": protocols.mul.mul(ctx, x, y), "and": protocols.bool_ops.and_(ctx, x, y),
# "trunc_local": protocols.trunc.trunc_local(ctx, x, s)
_KERNELS: dict[str, Callable] = {}


def register_kernel(name: str, fn: Callable) -> Callable:
    """Register the implementation of an interactive share operator (called by the
    protocol modules at import); returns ``fn``."""
    _KERNELS[name] = fn
    return fn


def kernel(name: str) -> Callable:
    """The registered implementation of ``name`` (`register_kernel`)."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise MPCError(f"no share kernel {name!r} registered: import cipherlm.mpc "
                       f"(it loads cipherlm.mpc.protocols, which registers them)") from None


class _Share:
    """Common tensor plumbing: shape manipulation maps the local share."""

    __array_priority__ = 1000  # numpy defers binary ops to us

    def __init__(self, ctx: Context, data, bits: int):
        self.ctx = ctx
        self.bits = check_bits(bits)
        self.data = np.asarray(data, dtype=np.uint64)

    def _like(self, data):  # same kind, same metadata
        raise NotImplementedError

    # shape -----------------------------------------------------------------
    @property
    def shape(self):
        return self.data.shape

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return self._like(self.data[idx])

    def __setitem__(self, idx, value):
        self._check_same(value)
        self.data[idx] = value.data

    def reshape(self, *shape):
        return self._like(self.data.reshape(*shape))

    def transpose(self, *axes):
        return self._like(self.data.transpose(*axes))

    @property
    def T(self):
        return self._like(self.data.T)

    def flatten(self):
        return self._like(self.data.reshape(-1))

    def swapaxes(self, a, b):
        return self._like(self.data.swapaxes(a, b))

    def broadcast_to(self, shape):
        return self._like(np.broadcast_to(self.data, shape).copy())

    def copy(self):
        return self._like(self.data.copy())

    def _check_same(self, other):
        if type(other) is not type(self):
            raise TypeError(f"expected {type(self).__name__}, got {type(other).__name__}")
        if other.ctx is not self.ctx:
            raise MPCError("shares belong to different sessions")
        if other.bits != self.bits:
            raise MPCError(f"ring mismatch: {self.bits} vs {other.bits} bits")

    def __repr__(self):
        return f"{type(self).__name__}(party={self.ctx.party}, shape={self.shape}, bits={self.bits})"


class AShare(_Share):
    """Additive shares over Z_{2^bits}."""

    def __init__(self, ctx: Context, data, bits: int | None = None, frac: int | None = None):
        bits = ctx.ring.bits if bits is None else bits
        super().__init__(ctx, data, bits)
        if bits < 64:
            self.data = self.data & mask(bits)
        self.frac = ctx.ring.frac if frac is None else int(frac)

    def _like(self, data, frac=None):
        return AShare(self.ctx, data, self.bits, self.frac if frac is None else frac)

    @property
    def mask(self):
        return mask(self.bits)

    def _public(self, v):
        """A public integer/array as ring elements (party 0 contributes it)."""
        return reduce(np.asarray(v), self.bits)

    def _check_frac(self, other):
        if other.frac != self.frac:
            raise MPCError(f"fixed-point scale mismatch: {self.frac} vs {other.frac} fraction bits")

    # linear, local ---------------------------------------------------------
    def __add__(self, other):
        if isinstance(other, AShare):
            self._check_same(other)
            self._check_frac(other)
            return self._like(self.data + other.data)
        if isinstance(other, _Share):
            return NotImplemented
        p = self._public(other)
        return self._like(self.data + p if self.ctx.party == 0 else self.data + np.zeros_like(p))

    __radd__ = __add__

    def __neg__(self):
        return self._like(np.uint64(0) - self.data)

    def __sub__(self, other):
        if isinstance(other, AShare):
            self._check_same(other)
            self._check_frac(other)
            return self._like(self.data - other.data)
        if isinstance(other, _Share):
            return NotImplemented
        with np.errstate(over="ignore"):  # negation mod 2^64 (numpy warns on 0-d uint64 wrap-around)
            return self + (np.uint64(0) - self._public(other))

    def __rsub__(self, other):
        return (-self) + other

    def __mul__(self, other):
        if isinstance(other, AShare):
            return kernel("mul")(self.ctx, self, other)   # protocols.mul.mul
        if isinstance(other, _Share):
            return NotImplemented
        if isinstance(other, (float, np.floating)) or (isinstance(other, np.ndarray) and other.dtype.kind == "f"):
            raise TypeError("multiply by a public real with mul_public_fixed (it needs a truncation)")
        return self._like(self.data * self._public(other))

    __rmul__ = __mul__

    def __lshift__(self, k: int):
        return self._like(self.data << np.uint64(k))

    def add_public_fixed(self, v):
        """x + v for a public real v, encoded at this share's scale."""
        return self + fixed_encode(v, self.frac, self.bits)

    def mul_public_fixed(self, c, frac: int | None = None):
        """x * c for a public real c (encoded with `frac` bits, default this share's),
        rescaled by SecureML local truncation (`protocols.trunc.trunc_local`):
        local, free, error at most one unit in the last place, and a failure
        probability of about |x*c|*2^(frac+1-bits) (see docs/mpc.md)."""
        f = self.frac if frac is None else int(frac)
        enc = fixed_encode(c, f, self.bits)
        prod = self._like(self.data * enc, frac=self.frac + f)
        return kernel("trunc_local")(self.ctx, prod, f)   # protocols.trunc.trunc_local

    def sum(self, axis=None, keepdims=False):
        return self._like(np.sum(self.data, axis=axis, keepdims=keepdims, dtype=np.uint64))

    def dot_public(self, w):
        """x @ w for a public integer matrix w (local)."""
        return self._like(np.matmul(self.data, self._public(w)))

    # conversion -------------------------------------------------------------
    def reveal(self, to: int | None = None):
        """Open: ring elements (uint64) to party `to` (None: both); the other gets None."""
        return reveal(self, to)

    def reveal_signed(self, to=None):
        v = reveal(self, to)
        return None if v is None else to_signed(v, self.bits)

    def reveal_float(self, to=None):
        v = reveal(self, to)
        return None if v is None else fixed_decode(v, self.frac, self.bits)


class BShare(_Share):
    """XOR shares of ``bits``-wide words (``bits=1``: shared bits, values 0/1)."""

    def __init__(self, ctx: Context, data, bits: int = 1):
        super().__init__(ctx, data, bits)
        if bits < 64:
            self.data = self.data & mask(bits)

    def _like(self, data):
        return BShare(self.ctx, data, self.bits)

    def __xor__(self, other):
        if isinstance(other, BShare):
            self._check_same(other)
            return self._like(self.data ^ other.data)
        if isinstance(other, _Share):
            return NotImplemented
        p = reduce(np.asarray(other), self.bits)
        return self._like(self.data ^ p if self.ctx.party == 0 else self.data ^ np.zeros_like(p))

    __rxor__ = __xor__

    def __and__(self, other):
        if isinstance(other, BShare):
            return kernel("and")(self.ctx, self, other)   # protocols.bool_ops.and_
        if isinstance(other, _Share):
            return NotImplemented
        return self._like(self.data & reduce(np.asarray(other), self.bits))

    __rand__ = __and__

    def __invert__(self):
        return self ^ mask(self.bits)

    def reveal(self, to: int | None = None):
        return reveal(self, to)


def _concat_like(items, data):
    first = items[0]
    for it in items[1:]:
        first._check_same(it)
        if isinstance(first, AShare):
            first._check_frac(it)
    return first._like(data)


def concatenate(items, axis=0):
    return _concat_like(items, np.concatenate([it.data for it in items], axis=axis))


def stack(items, axis=0):
    return _concat_like(items, np.stack([it.data for it in items], axis=axis))


def share_input(ctx: Context, x=None, owner: int = 0, bits: int | None = None, frac: int | None = None) -> AShare:
    """Secret-share `owner`'s ring elements x (the other party passes None).
    The owner keeps x - r and sends a uniform r: one message of l bits per element.
    Float input is fixed-point encoded with `frac` bits (default the ring's)."""
    bits = ctx.ring.bits if bits is None else bits
    with ctx.step("share_input"):
        if ctx.party == owner:
            if x is None:
                raise ValueError("the owner must pass its input")
            xa = np.asarray(x)
            if xa.dtype.kind == "f":
                xa = fixed_encode(xa, ctx.ring.frac if frac is None else frac, bits)
            xa = reduce(xa, bits)
            r = uniform(ctx.rng, xa.shape, bits)
            ctx.send({"r": r})
            return AShare(ctx, xa - r, bits, frac)
        r = ctx.recv()["r"]
        return AShare(ctx, r, bits, frac)


def share_bits_input(ctx: Context, x=None, owner: int = 0, bits: int = 1) -> BShare:
    """XOR-share `owner`'s words (bits wide)."""
    with ctx.step("share_input"):
        if ctx.party == owner:
            xa = reduce(np.asarray(x), bits)
            r = uniform(ctx.rng, xa.shape, bits)
            ctx.send({"r": r})
            return BShare(ctx, xa ^ r, bits)
        return BShare(ctx, ctx.recv()["r"], bits)


def reveal(s: _Share, to: int | None = None):
    """Open a share to party `to` (0 or 1) or to both (None); returns the plaintext
    ring elements (uint64) to the receiver(s), None to a party that only sends."""
    ctx = s.ctx
    combine = (lambda a, b: (a + b) & mask(s.bits)) if isinstance(s, AShare) else (lambda a, b: a ^ b)
    with ctx.step("reveal"):
        if to is None:
            other = ctx.exchange({"s": s.data})["s"]
        elif to == ctx.party:
            other = ctx.recv()["s"]
        else:
            ctx.send({"s": s.data})
            return None
        if other.shape != s.shape:
            raise MPCError(f"peer's share has shape {other.shape}, ours {s.shape}")
        return combine(s.data, other)

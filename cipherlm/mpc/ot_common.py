"""Pieces shared by the OT session (`cipherlm.mpc.ot`), the OT-extension
interface (`cipherlm.mpc.ot_extension`) and the Ferret pools
(`cipherlm.mpc.ferret`): the error type, the check of an incoming OT message,
random choice bits and small array helpers.  ferret.py imports only this
module (its pools get their IKNP base through the public raw-COT methods of
`cipherlm.mpc.ot_extension.IknpExtension`).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["OTError", "expect", "random_choices", "u8", "u64", "words", "word_mask"]


class OTError(ValueError):
    """A malformed, truncated or out-of-step OT message, or mismatched calls."""


def expect(chan, op: str, arrays: dict[str, int | None], **fields) -> dict:
    """Receive one OT message from `chan`; check its op, scalar fields and uint8 array sizes
    (None: any size).  Raises `OTError` on any mismatch."""
    msg = chan.recv()
    if not isinstance(msg, dict):
        raise OTError("OT message is not a dict")
    got = msg.get("op")
    if not isinstance(got, str) or got != op:
        raise OTError(f"expected OT message {op!r}, got {repr(got)[:80]} (calls on the two sides do not match)")
    for key, want in fields.items():
        v = msg.get(key)  # scalars only: an array here would make `!=` raise ValueError
        if isinstance(v, (np.ndarray, list, dict, bytes)) or v != want:
            raise OTError(f"OT message {op!r}: peer has {key}={msg.get(key)!r}, this side {key}={want!r}")
    for key, size in arrays.items():
        a = msg.get(key)
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1:
            raise OTError(f"OT message {op!r}: field {key!r} must be a uint8 vector")
        if size is not None and a.size != size:
            raise OTError(f"OT message {op!r}: field {key!r} has {a.size} bytes, expected {size} (truncated or malformed)")
    return msg


def random_choices(n: int) -> np.ndarray:
    """n uniform choice bits from the OS CSPRNG (bool array)."""
    return np.unpackbits(np.frombuffer(os.urandom((n + 7) // 8), np.uint8), bitorder="little")[:n].astype(bool)


def u8(buf) -> np.ndarray:
    """A bytes-like object as a uint8 vector (no copy)."""
    return np.frombuffer(buf, dtype=np.uint8)


def u64(buf) -> np.ndarray:
    """A bytes-like object as a uint64 vector (no copy)."""
    return np.frombuffer(buf, dtype=np.uint64)


def words(x, name: str) -> np.ndarray:
    """An integer/bool array as a flat contiguous uint64 vector."""
    a = np.asarray(x)
    if not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise ValueError(f"{name} must be an integer array")
    return np.ascontiguousarray(a.reshape(-1).astype(np.uint64, copy=False))


def word_mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)

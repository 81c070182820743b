"""Pieces shared by the OT session (`cipherlm.mpc.ot`) and the Ferret pools
(`cipherlm.mpc.ferret`): the error type, the check of an incoming OT message,
and random choice bits.  Both modules import this one; ferret.py does not import
ot.py (the session hands itself to its pools and they use its public IKNP
methods, `OTSession.iknp_*`).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["OTError", "expect", "random_choices"]


class OTError(ValueError):
    """A malformed, truncated or out-of-step OT message, or mismatched calls."""


def expect(chan, op: str, arrays: dict[str, int | None], **fields) -> dict:
    """Receive one OT message from `chan`; check its op, scalar fields and uint8 array sizes
    (None: any size).  Raises `OTError` on any mismatch."""
    msg = chan.recv()
    if not isinstance(msg, dict):
        raise OTError("OT message is not a dict")
    got = msg.get("op")
    if got != op:
        raise OTError(f"expected OT message {op!r}, got {got!r} (calls on the two sides do not match)")
    for key, want in fields.items():
        if msg.get(key) != want:
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

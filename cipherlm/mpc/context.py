"""The per-party state of a two-party computation: channel, party id, OT session, ring, PRG.

Party 0 is the client ("P0" in CrypTFlow2), party 1 the server ("P1").  Every
protocol in `cipherlm.mpc` takes a `Context` as its first argument and is
written once, parameterised by ``ctx.party``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

from .ring import RingConfig, new_rng

_SEND_INLINE = 1 << 15  # messages up to this size are sent before receiving (no thread)


def _payload_size(v) -> int:
    """Approximate bytes of a message value (arrays, bytes, nested containers)."""
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, (bytes, bytearray, memoryview)):
        return len(v)
    if isinstance(v, dict):
        return sum(_payload_size(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_payload_size(x) for x in v)
    return 8


class MPCError(RuntimeError):
    """A two-party protocol failed (bad input, mismatched peer, ...)."""


class Context:
    """One party's handle on a two-party session.

    ``chan``: a `cipherlm.net.Channel` to the peer; ``party``: 0 or 1;
    ``ring``: the default `RingConfig` (bits, fraction bits);
    ``ot_factory(chan, party)``: builds the OT session on first use (default
    `cipherlm.mpc.ot.OTSession`); ``rng``: a CSPRNG-seeded generator.
    """

    def __init__(self, chan, party: int, ring: RingConfig | None = None, *,
                 ot_factory: Callable | None = None, rng: np.random.Generator | None = None):
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1, got {party!r}")
        self.chan = chan
        self.party = int(party)
        self.ring = ring or RingConfig()
        self.rng = rng or new_rng()
        self._ot_factory = ot_factory
        self._ot = None

    @property
    def peer(self) -> int:
        return 1 - self.party

    @property
    def ot(self):
        """The OT session (created on first use)."""
        if self._ot is None:
            factory = self._ot_factory
            if factory is None:
                from .ot import OTSession as factory  # the real OT (Ferret by default; CIPHERLM_OT)
            self._ot = factory(self.chan, self.party)
        return self._ot

    def step(self, label: str):
        """``with ctx.step("mul"):`` labels the channel traffic (see `Channel.step`)."""
        return self.chan.step(label)

    def send(self, msg: dict) -> None:
        self.chan.send(msg)

    def recv(self) -> dict:
        return self.chan.recv()

    def exchange(self, msg: dict) -> dict:
        """Both parties send `msg` and receive the peer's in the same flight.
        Large messages are sent from a helper thread so that two parties sending
        at once cannot block each other on full socket buffers (counted as sent
        before the receive either way: `Channel.send_background`)."""
        if _payload_size(msg) <= _SEND_INLINE:
            self.chan.send(msg)
            return self.chan.recv()
        join = self.chan.send_background(msg)
        try:
            out = self.chan.recv()
        except BaseException:
            with contextlib.suppress(BaseException):  # the receive's error is the one to report
                join()
            raise
        join()
        return out

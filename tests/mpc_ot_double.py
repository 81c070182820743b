"""INSECURE oblivious-transfer test double.  NEVER use outside tests.

Same API as `cipherlm.mpc.ot.OTSession`, but the sender simply sends *both*
messages in the clear and the receiver picks: the receiver learns everything,
so nothing built on it is private.  It exists so the protocols above the OT
layer can be tested for correctness independently of (and before) the real
IKNP/KK13 implementation; view tests must use the real OT.
"""

from __future__ import annotations

import secrets

import numpy as np


def _mask(bits):
    return np.uint64((1 << bits) - 1)


class InsecureOTSession:
    """INSECURE: the sender reveals both messages (test double only)."""

    INSECURE = True

    def __init__(self, chan, party: int):
        self.chan = chan
        self.party = party
        self.rng = np.random.Generator(np.random.PCG64(secrets.randbits(128)))

    def _rand(self, n, bits):
        return self.rng.bit_generator.random_raw(n).astype(np.uint64) & _mask(bits)

    # chosen-message 1-of-2
    def send_chosen(self, m0, m1, bits=64):
        self.chan.send({"m0": np.asarray(m0, np.uint64), "m1": np.asarray(m1, np.uint64)})

    def recv_chosen(self, choices, bits=64):
        msg = self.chan.recv()
        c = np.asarray(choices).astype(bool)
        if c.shape != msg["m0"].shape:
            raise ValueError("choice count does not match the sender's messages")
        return np.where(c, msg["m1"], msg["m0"])

    # correlated OT: receiver gets r + c*corr
    def send_cot(self, corr, bits):
        corr = np.asarray(corr, np.uint64)
        r = self._rand(corr.size, bits).reshape(corr.shape)
        self.send_chosen(r, (r + corr) & _mask(bits))
        return r

    def recv_cot(self, choices, bits):
        return self.recv_chosen(choices)

    # random OT
    def send_random(self, n, bits):
        m0, m1 = self._rand(n, bits), self._rand(n, bits)
        self.send_chosen(m0, m1)
        return m0, m1

    def recv_random(self, choices, bits):
        msg = self.chan.recv()
        n = msg["m0"].shape[0]
        c = (self._rand(n, 1).astype(bool) if choices is None else np.asarray(choices).astype(bool))
        return c, np.where(c, msg["m1"], msg["m0"])

    # 1-of-N
    def send_1ofN(self, msgs, bits):
        self.chan.send({"m": np.asarray(msgs, np.uint64)})

    def recv_1ofN(self, choices, N, bits):
        m = self.chan.recv()["m"]
        c = np.asarray(choices).astype(np.int64)
        if m.shape != (c.shape[0], N):
            raise ValueError("1-of-N shape mismatch")
        return m[np.arange(c.shape[0]), c]


def ot_factory():
    """The real `cipherlm.mpc.ot.OTSession` when it exists, else this double."""
    try:
        from cipherlm.mpc.ot import OTSession
    except ImportError:
        return InsecureOTSession
    return OTSession


def have_real_ot() -> bool:
    return ot_factory() is not InsecureOTSession

"""Oblivious transfer between the two parties: base OT, IKNP extension, KK13.

One `OTSession` per channel and party serves every OT the 2PC protocols need,
in both directions: either party may be the sender of a call, the other calls
the matching receiver method with the same number of OTs.  Semi-honest
security, no trusted dealer; all secrets come from the OS CSPRNG.

Protocols (papers cited by section; the heavy lifting is in ``cipherlm._core``)
--------------------------------------------------------------------------
* **Base OT**: Chou and Orlandi, "The Simplest Protocol for Oblivious Transfer"
  (LATINCRYPT 2015, fig. 1) over Ristretto255 (``curve25519-dalek``), keys
  hashed with SHA-256.  Run lazily, once per direction and per extension kind
  (128 base OTs for IKNP, 256 for KK13), on the first call that needs them.
* **OT extension**: Ishai, Kilian, Nissim, Petrank, "Extending Oblivious
  Transfers Efficiently" (CRYPTO 2003, section 3), kappa = 128, with the
  optimisations of Asharov, Lindell, Schneider, Zohner, "More Efficient
  Oblivious Transfer and Extensions for Faster Secure Computation" (CCS 2013):
  the receiver sends only u^i = G(k0^i) xor G(k1^i) xor r (sec. 4.1), G is
  AES-128-CTR, the random oracle is a fixed-key AES correlation-robust hash
  (sec. 4; we use the tweakable CCR hash of Guo-Katz-Wang-Yu, S&P 2020),
  the matrix is transposed with SSE2 (sec. 4.3), and correlated OT sends one
  ``bits``-bit word per OT instead of two messages (C-OT, sec. 5.4).
* **1-out-of-N OT**: Kolesnikov and Kumaresan, "Improved OT Extension for
  Transferring Short Secrets" (CRYPTO 2013, sec. 4) with the 256-bit
  Walsh-Hadamard code (distance 128), N <= 256.  This is what CrypTFlow2's
  millionaire protocol (Rathee et al., CCS 2020, sec. 4.1, "Protocol
  Pi_MILL") uses: each party splits its l-bit input into m-bit digits and the
  sender offers all 2^m comparison results of a digit in one 1-out-of-2^m OT
  (m = 4: 1-out-of-16 OTs with 2-bit messages, the ``lt``/``eq`` bits masked
  by the sender's shares).

Cost on the wire (bits per OT, payload only; ``l`` = ``bits``)
-------------------------------------------------------------
=====================  ====================  ==========================
call                   receiver -> sender    sender -> receiver
=====================  ====================  ==========================
random OT              128                   0
boolean COT (raw)      128                   0
arithmetic COT         128                   l
chosen OT              128                   2 l
chosen OT, L bytes     128                   2 * 8 L
1-out-of-N (KK13)      256                   N l
=====================  ====================  ==========================

plus one-time base OTs per direction: 32 + 128 * 32 bytes (IKNP) and
32 + 256 * 32 bytes (KK13), and per batch of up to ``batch`` OTs one message
header (~150 bytes) and padding of the OT count to a multiple of 16.  Two
flights per call (one for random / boolean COT).  The log N alternative to
KK13 (N-1-of-... from log2 N 1-out-of-2 OTs, Naor-Pinkas style) costs
128 log2 N + N l bits: for N = 16, l = 2 that is 544 bits against KK13's 288.

Swapping in silent OT
---------------------
Callers only see the methods below.  Each of them is derived from *correlated
OT with a global Delta* (``send_bool_cot``/``recv_bool_cot``: the sender gets
q_j, the receiver t_j = q_j xor c_j Delta) by hashing, plus the sender's
correction words.  A Ferret/VOLE backend (Yang et al. CCS 2020) produces the
same random COTs with sublinear communication; replacing `_Extension` (the
``extend`` step) by one that serves pre-generated COTs and sends the
choice-bit corrections c_j xor b_j (1 bit per OT, Beaver derandomisation)
instead of the IKNP matrix keeps every public method and its outputs unchanged.
See docs/ot.md.

This is implemented: ``OTSession(..., ferret=True)`` (or the environment
variable ``CIPHERLM_OT=ferret``) serves every 1-out-of-2 OT kind from a
Ferret pool (`cipherlm.mpc.ferret`, Yang et al. CCS 2020, semi-honest,
bootstrapped once from IKNP): the receiver sends e = c xor u (1 bit per OT),
the sender sets v <- v xor e*Delta, and the hashing / corrections below are
unchanged.  1-out-of-N for N = 2^m then comes from m of those correlated
OTs (Naor-Pinkas 1999 on random OTs: message x is masked with
SHA-256(tweak, q_1 xor x_1 Delta, ..., q_m xor x_m Delta), of which the
receiver knows exactly the one for its choice): m + N l bits per OT instead
of KK13's 256 + N l (other N stay on KK13).  Default: IKNP; ``CIPHERLM_OT=ferret`` or
``ferret=True`` selects Ferret.  Why IKNP stays the default: on the 2-vCPU
development machine Ferret cuts bytes 4-9x but costs 3-4x the compute
(refills and the 1-of-N hashing), which outweighs the saved transfer even in
the modelled WAN setting (docs/ot.md, measured).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterator

import numpy as np

from cipherlm import _core

from .ferret import FerretReceiver, FerretSender
from .ot_common import OTError, expect, random_choices

__all__ = ["OTSession", "OTError", "bytes_per_ot", "KAPPA"]

KAPPA = 128  # IKNP extension width (computational security parameter)
KK13_K = 256  # KK13 code length (Walsh-Hadamard, 256 codewords, distance 128)
DEFAULT_BATCH = 1 << 16  # OTs per extension message (1 MiB IKNP matrix; L2-friendly)


def bytes_per_ot(kind: str, bits: int = 64, N: int = 2, length: int = 0, ferret: bool = False) -> float:
    """Payload bytes per OT on the wire, both directions, excluding base OTs,
    headers and padding.  `kind`: random | bool_cot | cot | chosen |
    chosen_bytes (`length` bytes) | 1ofN.  With ``ferret`` the 128-bit IKNP
    row becomes the 1-bit derandomisation (the Ferret refills, amortised
    ~0.45 bit per OT with the main parameter set, are not included), and
    1-out-of-N for N = 2^m takes m such OTs instead of KK13's 256-bit row."""
    if ferret and kind == "1ofN" and N & (N - 1) == 0:
        return ((N.bit_length() - 1) + N * bits) / 8
    if ferret and kind != "1ofN":
        return bytes_per_ot(kind, bits, N, length) - (KAPPA - 1) / 8
    if kind in ("random", "bool_cot"):
        return KAPPA / 8
    if kind == "cot":
        return (KAPPA + bits) / 8
    if kind == "chosen":
        return (KAPPA + 2 * bits) / 8
    if kind == "chosen_bytes":
        return KAPPA / 8 + 2 * length
    if kind == "1ofN":
        return (KK13_K + N * bits) / 8
    raise ValueError(f"unknown OT kind {kind!r}")


def _u8(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _u64(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint64)


def _bits_arg(bits: int) -> int:
    bits = int(bits)
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in 1..64, got {bits}")
    return bits


def _mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)


def _choices01(choices) -> tuple[np.ndarray, tuple]:
    c = np.asarray(choices)
    shape = c.shape
    if c.dtype != np.bool_:
        if not np.issubdtype(c.dtype, np.integer):
            raise ValueError("choices must be a bool or integer array")
        if c.size and (c.min() < 0 or c.max() > 1):
            raise ValueError("choice bits must be 0 or 1")
    return np.ascontiguousarray(c.reshape(-1), dtype=np.uint8), shape


def _words(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise ValueError(f"{name} must be an integer array")
    return np.ascontiguousarray(a.reshape(-1).astype(np.uint64, copy=False))


class _Extension:
    """One direction of one OT-extension kind (k = 128 IKNP or 256 KK13) and
    the running OT index used as hash tweak."""

    __slots__ = ("ext", "count", "delta")

    def __init__(self, ext, delta: bytes | None):
        self.ext = ext
        self.count = 0
        self.delta = delta


class OTSession:
    """Oblivious transfers over `chan` for `party` (0 or 1), both directions.

    Calls must be matched: when one party calls ``send_X`` the other calls
    ``recv_X`` with the same number of OTs (and the same ``bits`` / ``N``),
    in the same order relative to other calls on the channel.  Mismatches are
    detected from the message headers and raise `OTError`; a stalled peer
    raises the channel's `ChannelTimeout` after its timeout.

    ``step``: channel accounting label for the OT traffic (None: the caller's
    label applies).  Base OTs are always labelled ``"ot.base"``.
    ``batch``: OTs per extension message (bounds memory and frame size).
    """

    def __init__(self, chan, party: int, *, batch: int = DEFAULT_BATCH, step: str | None = None,
                 ferret: bool | None = None):
        if party not in (0, 1):
            raise ValueError("party must be 0 or 1")
        if batch < 16:
            raise ValueError("batch must be >= 16")
        self.chan = chan
        self.party = party
        self.batch = int(batch)
        self.step = step
        self._as_sender: dict[int, _Extension] = {}
        self._as_receiver: dict[int, _Extension] = {}
        if ferret is None:
            env = os.environ.get("CIPHERLM_OT", "iknp").strip().lower()
            if env not in ("iknp", "ferret"):
                raise ValueError(f"CIPHERLM_OT must be 'iknp' or 'ferret', got {env!r}")
            ferret = env == "ferret"
        self.ferret = bool(ferret)
        self._ferret_send = None  # cipherlm.mpc.ferret.FerretSender (this party holds Delta)
        self._ferret_recv = None  # cipherlm.mpc.ferret.FerretReceiver

    # ------------------------------------------------------------ plumbing

    def _label(self, label: str | None):
        import contextlib

        return self.chan.step(label) if label is not None else contextlib.nullcontext()

    def _expect(self, op: str, arrays: dict[str, int | None], **fields) -> dict:
        """Receive one message; check its op, scalar fields and uint8 array sizes."""
        return expect(self.chan, op, arrays, **fields)

    def _sender_ext(self, k: int) -> _Extension:
        """This party as extension sender = base-OT receiver with choices Delta."""
        st = self._as_sender.get(k)
        if st is None:
            with self.chan.step("ot.base"):
                msg = self._expect("base_A", {"A": 32}, k=k)
                delta = secrets.token_bytes(k // 8)
                bits = np.unpackbits(_u8(delta), bitorder="little")
                try:
                    B, keys = _core.baseot_receiver(msg["A"], bits)
                except ValueError as e:
                    raise OTError(f"base OT: {e}") from e
                self.chan.send({"op": "base_B", "k": k, "B": _u8(B)})
            st = self._as_sender[k] = _Extension(_core.OtExtSender(delta, keys), delta)
        return st

    def _receiver_ext(self, k: int) -> _Extension:
        """This party as extension receiver = base-OT sender."""
        st = self._as_receiver.get(k)
        if st is None:
            with self.chan.step("ot.base"):
                a, A = _core.baseot_sender_init()
                self.chan.send({"op": "base_A", "k": k, "A": _u8(A)})
                msg = self._expect("base_B", {"B": 32 * k}, k=k)
                try:
                    k0, k1 = _core.baseot_sender_keys(a, A, msg["B"])
                except ValueError as e:
                    raise OTError(f"base OT: {e}") from e
                del a
            st = self._as_receiver[k] = _Extension(_core.OtExtReceiver(k0, k1), None)
        return st

    def setup(self, kk13: bool = False) -> None:
        """Run the base OTs of both directions now (otherwise they run on first
        use).  Both parties call it."""
        for k in (KAPPA, KK13_K) if kk13 else (KAPPA,):
            for sender in (0, 1):
                if self.party == sender:
                    self._sender_ext(k)
                else:
                    self._receiver_ext(k)

    def _recv_extend(self, k: int, op: str, choices: np.ndarray, **fields) -> list:
        """Receiver: correlated OTs for `choices` (uint8) in batches, from IKNP
        or (k = 128 with ``ferret``) the Ferret pool.  Returns [(t, tweak, lo, hi)]."""
        if k == KAPPA and self.ferret:
            return self._ferret_recv_extend(op, choices, **fields)
        return self._iknp_recv_extend(k, op, choices, **fields)

    def _send_extend(self, k: int, op: str, n: int, **fields) -> Iterator:
        """Sender: the matching rows q (t = q xor c*Delta), yielded per batch as (q, tweak, lo, hi)."""
        if k == KAPPA and self.ferret:
            return self._ferret_send_extend(op, n, **fields)
        return self._iknp_send_extend(k, op, n, **fields)

    def _ferret_recv_extend(self, op: str, choices: np.ndarray, **fields) -> list:
        """Beaver derandomisation of Ferret random COTs (u, w): send e = c xor u."""
        if self._ferret_recv is None:
            self._ferret_recv = FerretReceiver(self)
        pool = self._ferret_recv
        n = choices.size
        out = []
        for lo in range(0, n, self.batch) if n else ():
            hi = min(n, lo + self.batch)
            u, w = pool.take(hi - lo)
            tw = pool.tweak() - (hi - lo)
            e = np.packbits(choices[lo:hi] ^ u, bitorder="little")
            self.chan.send({"op": op, "k": KAPPA, "n": hi - lo, "at": tw, **fields, "e": e})
            out.append((w.view(np.uint8).reshape(-1), tw, lo, hi))
        return out

    def _ferret_send_extend(self, op: str, n: int, **fields) -> Iterator:
        if self._ferret_send is None:
            self._ferret_send = FerretSender(self)
        pool = self._ferret_send
        lo = 0
        while lo < n:
            m = min(n - lo, self.batch)
            v = pool.take(m)  # may refill (messages to the peer) before we read its corrections
            tw = pool.tweak() - m
            msg = self._expect(op, {"e": (m + 7) // 8}, k=KAPPA, n=m, at=tw, **fields)
            e = np.unpackbits(msg["e"], count=m, bitorder="little").astype(np.uint64)
            v ^= pool.delta64 * e[:, None]
            yield v.view(np.uint8).reshape(-1), tw, lo, lo + m
            lo += m

    def _iknp_recv_extend(self, k: int, op: str, choices: np.ndarray, **fields) -> list[tuple[bytearray, int, int, int]]:
        """Receiver: extend for `choices` (uint8), send the matrices in batches.
        Returns [(t, tweak, lo, hi)] per batch."""
        st = self._receiver_ext(k)
        n = choices.size
        out = []
        for lo in range(0, n, self.batch) if n else ():
            hi = min(n, lo + self.batch)
            u, t = st.ext.extend(choices[lo:hi])
            self.chan.send({"op": op, "k": k, "n": hi - lo, "at": st.count, **fields, "u": _u8(u)})
            out.append((t, st.count, lo, hi))
            st.count += hi - lo
        return out

    def _iknp_send_extend(self, k: int, op: str, n: int, **fields) -> Iterator[tuple[bytearray, int, int, int]]:
        """Sender: receive the receiver's batches; yield (q, tweak, lo, hi)."""
        st = self._sender_ext(k)
        lo = 0
        while lo < n:
            m = min(n - lo, self.batch)
            msg = self._expect(op, {"u": k * ((m + 15) // 16 * 16) // 8}, k=k, n=m, at=st.count, **fields)
            try:
                q = st.ext.extend(msg["u"], m)
            except ValueError as e:
                raise OTError(str(e)) from e
            yield q, st.count, lo, lo + m
            st.count += m
            lo += m

    # ------------------------------------------------------------ raw IKNP COT (the Ferret pools' base)
    # The interface `cipherlm.mpc.ferret` uses: IKNP correlated OT with this session's
    # Delta, whatever the session's `ferret` setting, without hashing and without the
    # session's step label (the pools label their own traffic "ot.ferret").

    def iknp_sender_delta(self) -> bytes:
        """This party's IKNP Delta (16 bytes) as extension sender; runs the base OTs on first use
        (the peer calls `iknp_receiver_setup` at the same point)."""
        return bytes(self._sender_ext(KAPPA).delta)

    def iknp_receiver_setup(self) -> None:
        """This party as IKNP extension receiver: runs the base OTs on first use."""
        self._receiver_ext(KAPPA)

    def iknp_send_cot(self, n: int, op: str) -> np.ndarray:
        """Raw IKNP correlated OT, sender: q (n, 2) uint64; the peer (`iknp_recv_cot`) gets
        q xor c*Delta.  Not hashed: for protocols that hash or mask them (Ferret's base)."""
        rows = [_u64(q).reshape(-1, 2) for q, _tw, _lo, _hi in self._iknp_send_extend(KAPPA, op, int(n))]
        return np.concatenate(rows) if rows else np.empty((0, 2), np.uint64)

    def iknp_recv_cot(self, choices: np.ndarray, op: str) -> np.ndarray:
        """Raw IKNP correlated OT, receiver: t (n, 2) uint64 = q xor c*Delta for the uint8 0/1 `choices`."""
        c = np.ascontiguousarray(choices, dtype=np.uint8).reshape(-1)
        rows = [_u64(t).reshape(-1, 2) for t, _tw, _lo, _hi in self._iknp_recv_extend(KAPPA, op, c)]
        return np.concatenate(rows) if rows else np.empty((0, 2), np.uint64)

    def _send_replies(self, op: str, replies: list[np.ndarray]) -> None:
        for y in replies:
            self.chan.send({"op": op, "y": y})

    def _recv_reply(self, op: str, size: int) -> np.ndarray:
        return self._expect(op, {"y": size})["y"]

    # ------------------------------------------------------------ random OT

    def send_random(self, n: int, bits: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """Random OT, sender: (m0, m1), uint64 arrays of n uniform `bits`-bit values.
        Wire: 128 bits per OT from the receiver, nothing back."""
        bits = _bits_arg(bits)
        n = int(n)
        m0 = np.empty(n, np.uint64)
        m1 = np.empty(n, np.uint64)
        with self._label(self.step):
            for q, tw, lo, hi in self._send_extend(KAPPA, "rot", n, bits=bits):
                a, b = _core.rot_sender(q, self._as_sender[KAPPA].delta, tw, bits)
                m0[lo:hi] = _u64(a)
                m1[lo:hi] = _u64(b)
        return m0, m1

    def recv_random(self, choices=None, bits: int = 64, *, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Random OT, receiver: (choices, m_c).  `choices`: bool/0-1 array, or
        None (then `n` uniformly random choice bits are drawn), or an int n."""
        bits = _bits_arg(bits)
        if choices is None or isinstance(choices, (int, np.integer)):
            n = int(choices if choices is not None else n if n is not None else -1)
            if n < 0:
                raise ValueError("give choices or n")
            c = np.unpackbits(_u8(secrets.token_bytes((n + 7) // 8)), bitorder="little")[:n]
            shape = (n,)
        else:
            c, shape = _choices01(choices)
        out = np.empty(c.size, np.uint64)
        with self._label(self.step):
            for t, tw, lo, hi in self._recv_extend(KAPPA, "rot", c, bits=bits):
                out[lo:hi] = _u64(_core.rot_receiver(t, tw, bits))
        return c.astype(bool).reshape(shape), out.reshape(shape)

    # ------------------------------------------------------------ boolean COT

    def send_bool_cot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw IKNP correlated OT with global Delta, sender: (q (n, 2) uint64,
        Delta (2,) uint64); the receiver gets q xor c*Delta.  128 bits per OT.
        These are *not* hashed: use them only in protocols that hash or mask
        them (e.g. to build other OT kinds)."""
        n = int(n)
        q_all = np.empty((n, 2), np.uint64)
        with self._label(self.step):
            for q, _tw, lo, hi in self._send_extend(KAPPA, "bcot", n):
                q_all[lo:hi] = _u64(q).reshape(-1, 2)
            st = self._sender_ext(KAPPA)
        return q_all, _u64(st.delta).copy()

    def recv_bool_cot(self, choices) -> np.ndarray:
        """Raw correlated OT, receiver: t (n, 2) uint64 = q xor c*Delta."""
        c, _shape = _choices01(choices)
        t_all = np.empty((c.size, 2), np.uint64)
        with self._label(self.step):
            for t, _tw, lo, hi in self._recv_extend(KAPPA, "bcot", c):
                t_all[lo:hi] = _u64(t).reshape(-1, 2)
        return t_all

    # ------------------------------------------------------------ arithmetic COT

    def send_cot(self, corr, bits: int = 64) -> np.ndarray:
        """Arithmetic correlated OT over Z_2^bits, sender (ALSZ13 sec. 5.4):
        returns r (uniform, shape of `corr`); the receiver with choice c gets
        r + c*corr mod 2^bits.  Wire: 128 + bits bits per OT."""
        bits = _bits_arg(bits)
        corr_a = np.asarray(corr)
        c = _words(corr_a, "corr") & _mask(bits)
        r = np.empty(c.size, np.uint64)
        replies = []
        with self._label(self.step):
            st = None
            for q, tw, lo, hi in self._send_extend(KAPPA, "cot", c.size, bits=bits):
                st = st or self._as_sender[KAPPA]
                rr, d = _core.acot_sender(q, st.delta, tw, c[lo:hi].view(np.uint8), bits)
                r[lo:hi] = _u64(rr)
                replies.append(_u8(d))
            self._send_replies("cot_y", replies)
        return r.reshape(corr_a.shape)

    def recv_cot(self, choices, bits: int = 64) -> np.ndarray:
        """Arithmetic correlated OT, receiver: r + choices*corr mod 2^bits (uint64, shape of choices)."""
        bits = _bits_arg(bits)
        c, shape = _choices01(choices)
        out = np.empty(c.size, np.uint64)
        with self._label(self.step):
            batches = self._recv_extend(KAPPA, "cot", c, bits=bits)
            for t, tw, lo, hi in batches:
                y = self._recv_reply("cot_y", (hi - lo) * bits // 8 + (1 if (hi - lo) * bits % 8 else 0))
                try:
                    out[lo:hi] = _u64(_core.acot_receiver(t, c[lo:hi], tw, y, bits))
                except ValueError as e:
                    raise OTError(str(e)) from e
        return out.reshape(shape)

    # ------------------------------------------------------------ chosen-message OT

    def send_chosen(self, m0, m1, bits: int = 64) -> None:
        """Chosen-message 1-out-of-2 OT of `bits`-bit words, sender.
        Wire: 128 + 2*bits bits per OT."""
        bits = _bits_arg(bits)
        a = _words(m0, "m0") & _mask(bits)
        b = _words(m1, "m1") & _mask(bits)
        if a.size != b.size:
            raise ValueError("m0 and m1 must have the same size")
        replies = []
        with self._label(self.step):
            for q, tw, lo, hi in self._send_extend(KAPPA, "chosen", a.size, bits=bits):
                y = _core.chosen_sender(q, self._as_sender[KAPPA].delta, tw, a[lo:hi].view(np.uint8), b[lo:hi].view(np.uint8), bits)
                replies.append(_u8(y))
            self._send_replies("chosen_y", replies)

    def recv_chosen(self, choices, bits: int = 64) -> np.ndarray:
        """Chosen-message OT, receiver: m_c (uint64, shape of choices)."""
        bits = _bits_arg(bits)
        c, shape = _choices01(choices)
        out = np.empty(c.size, np.uint64)
        with self._label(self.step):
            for t, tw, lo, hi in self._recv_extend(KAPPA, "chosen", c, bits=bits):
                y = self._recv_reply("chosen_y", (2 * (hi - lo) * bits + 7) // 8)
                out[lo:hi] = _u64(_core.chosen_receiver(t, c[lo:hi], tw, y, bits))
        return out.reshape(shape)

    def send_chosen_bytes(self, m0, m1) -> None:
        """Chosen OT of byte strings, sender: m0, m1 are (n, L) uint8.
        Wire: 128 bits + 2 L bytes per OT (keys stretched by AES-CTR beyond 16 bytes)."""
        a = np.ascontiguousarray(m0, dtype=np.uint8)
        b = np.ascontiguousarray(m1, dtype=np.uint8)
        if a.shape != b.shape or a.ndim != 2:
            raise ValueError("m0 and m1 must be (n, L) uint8 arrays of the same shape")
        n, L = a.shape
        replies = []
        with self._label(self.step):
            for q, tw, lo, hi in self._send_extend(KAPPA, "chosen_bytes", n, length=L):
                y = _core.chosen_bytes_sender(q, self._as_sender[KAPPA].delta, tw, a[lo:hi].reshape(-1), b[lo:hi].reshape(-1), L)
                replies.append(_u8(y))
            self._send_replies("chosen_bytes_y", replies)

    def recv_chosen_bytes(self, choices, length: int) -> np.ndarray:
        """Chosen OT of byte strings, receiver: (n, length) uint8."""
        c, _shape = _choices01(choices)
        L = int(length)
        out = np.empty((c.size, L), np.uint8)
        with self._label(self.step):
            for t, tw, lo, hi in self._recv_extend(KAPPA, "chosen_bytes", c, length=L):
                y = self._recv_reply("chosen_bytes_y", 2 * (hi - lo) * L)
                out[lo:hi] = _u8(_core.chosen_bytes_receiver(t, c[lo:hi], tw, y, L)).reshape(-1, L)
        return out

    # ------------------------------------------------------------ 1-out-of-N (KK13)

    def _np_1ofN(self, N: int) -> bool:
        """With Ferret, 1-out-of-N for N = 2^m comes from m correlated OTs (Naor-Pinkas
        1999 on random OTs: m + N l bits per OT on the wire instead of KK13's 256 + N l);
        the batches hold whole instances (`_whole_instances`)."""
        return self.ferret and N & (N - 1) == 0

    @contextlib.contextmanager
    def _whole_instances(self, m_bits: int):
        """Batches of correlated OTs that hold whole 1-out-of-N instances (m_bits OTs each)."""
        saved = self.batch
        self.batch = max(m_bits, saved - saved % m_bits)
        try:
            yield
        finally:
            self.batch = saved

    def send_1ofN(self, msgs, bits: int = 64) -> None:
        """1-out-of-N OT (KK13), sender: msgs is (n, N) of `bits`-bit words, 2 <= N <= 256.
        Wire: 256 + N*bits bits per OT."""
        bits = _bits_arg(bits)
        m = np.asarray(msgs)
        if m.ndim != 2 or not 2 <= m.shape[1] <= 256:
            raise ValueError("msgs must be (n, N) with 2 <= N <= 256")
        n, N = m.shape
        if not (np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_):
            raise ValueError("msgs must be an integer array")
        replies = []
        if self._np_1ofN(N):
            m_bits = N.bit_length() - 1
            with self._label(self.step), self._whole_instances(m_bits):
                for q, tw, lo, hi in self._send_extend(KAPPA, "1ofN", n * m_bits, bits=bits, N=N):
                    w = _words(m[lo // m_bits:hi // m_bits], "msgs") & _mask(bits)
                    y = _core.np1ofn_sender(q, self._ferret_send.delta, tw, N, w.view(np.uint8), bits)
                    replies.append(_u8(y))
                self._send_replies("1ofN_y", replies)
            return
        with self._label(self.step):
            for q, tw, lo, hi in self._send_extend(KK13_K, "1ofN", n, bits=bits, N=N):
                # widened to uint64 one batch at a time: callers may pass compact (uint8) tables
                w = _words(m[lo:hi], "msgs") & _mask(bits)
                y = _core.kk13_sender(q, self._as_sender[KK13_K].delta, tw, N, w.view(np.uint8), bits)
                replies.append(_u8(y))
            self._send_replies("1ofN_y", replies)

    def recv_1ofN(self, choices, N: int, bits: int = 64) -> np.ndarray:
        """1-out-of-N OT, receiver: choices in [0, N) -> msgs[j, choices[j]] (uint64, shape of choices)."""
        bits = _bits_arg(bits)
        N = int(N)
        if not 2 <= N <= 256:
            raise ValueError("N must be in 2..256")
        ch = np.asarray(choices)
        shape = ch.shape
        if not np.issubdtype(ch.dtype, np.integer) or (ch.size and (ch.min() < 0 or ch.max() >= N)):
            raise ValueError(f"choices must be integers in [0, {N})")
        c = np.ascontiguousarray(ch.reshape(-1), dtype=np.uint8)
        out = np.empty(c.size, np.uint64)
        if self._np_1ofN(N):
            m_bits = N.bit_length() - 1
            # bit i of choice j is the choice of correlated OT j m + i
            cbits = ((c[:, None] >> np.arange(m_bits, dtype=np.uint8)) & 1).astype(np.uint8).reshape(-1)
            with self._label(self.step), self._whole_instances(m_bits):
                for t, tw, lo, hi in self._recv_extend(KAPPA, "1ofN", cbits, bits=bits, N=N):
                    j0, j1 = lo // m_bits, hi // m_bits
                    y = self._recv_reply("1ofN_y", ((j1 - j0) * N * bits + 7) // 8)
                    out[j0:j1] = _u64(_core.np1ofn_receiver(t, c[j0:j1], tw, N, y, bits))
            return out.reshape(shape)
        with self._label(self.step):
            for t, tw, lo, hi in self._recv_extend(KK13_K, "1ofN", c, bits=bits, N=N):
                y = self._recv_reply("1ofN_y", ((hi - lo) * N * bits + 7) // 8)
                out[lo:hi] = _u64(_core.kk13_receiver(t, c[lo:hi], tw, N, y, bits))
        return out.reshape(shape)

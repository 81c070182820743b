"""OT-extension interface: the correlated OTs behind `cipherlm.mpc.ot.OTSession`.

`OTSession` (ot.py) turns *correlated OT with a global Delta* into every OT
flavour the 2PC protocols use (random, boolean / arithmetic correlated,
chosen-message, 1-out-of-N) by hashing and correction words.  Where those
correlated OTs come from is this module's business, behind one interface in
the style of SPU's ``FerretOtInterface`` (spu/mpc/cheetah/ot): the session asks
an `OTExtension` for

* **chosen-input COT** (``send_cot`` / ``recv_cot``): the receiver has choice
  bits c_j, the sender gets rows q_j and the receiver t_j = q_j xor c_j Delta,
  per batch, together with the hash tweak of the batch's first OT;
* **random COT** (``send_rcot`` / ``recv_rcot``): the receiver's bits u_j are
  random (sender v_j; receiver u_j, w_j = v_j xor u_j Delta), the primitive a
  silent OT produces natively (what emp-ot counts as "rcot");
* **1-out-of-N OT** of ``bits``-bit messages (``send_1ofN`` / ``recv_1ofN``),
  because the best construction depends on the extension (KK13 next to IKNP,
  Naor-Pinkas from log2 N COTs next to Ferret);
* the sender's ``Delta`` (``sender_delta``) and the base OTs (``setup``).

Both directions live in one object: the party that calls ``send_*`` is the
Delta holder of that call's direction.  Calls must be matched on the two sides
(same order, same sizes), as for `OTSession`.

Implementations, selected by ``CIPHERLM_OT`` (``iknp``, the default, or
``ferret``) or explicitly (`make_extension`):

* `IknpExtension`: IKNP03 with the ALSZ13 optimisations (and KK13 for
  1-out-of-N), base OTs by Chou-Orlandi, 128 bits per COT from the receiver.
  Its messages are exactly those `OTSession` sent before this module existed
  (same ops, fields, sizes and batching).
* `FerretExtension`: Ferret silent COT (`cipherlm.mpc.ferret`, Yang et al.
  CCS 2020), bootstrapped once from the `IknpExtension` it wraps (only through
  the latter's public raw-COT methods), 1 bit per chosen-input COT (Beaver
  derandomisation e = c xor u) and ~0.3-0.5 bit per random COT for the
  refills; 1-out-of-N for N = 2^m from m COTs (other N: KK13 of the IKNP part).

The CCR hashing and the correction words stay in ot.py (`cipherlm._core`'s
``rot_* / acot_* / chosen_*``), identical for both implementations.
"""

from __future__ import annotations

import os
import secrets
from abc import ABC, abstractmethod
from typing import Iterator

import numpy as np

from cipherlm import _core

from .ferret import FerretReceiver, FerretSender
from .ot_common import OTError, expect, random_choices, u8, u64, words, word_mask

__all__ = [
    "KAPPA", "KK13_K", "DEFAULT_BATCH", "OTExtension", "IknpExtension", "FerretExtension",
    "extension_kind", "make_extension", "KINDS",
]

KAPPA = 128  # IKNP extension width (computational security parameter)
KK13_K = 256  # KK13 code length (Walsh-Hadamard, 256 codewords, distance 128)
DEFAULT_BATCH = 1 << 16  # OTs per extension message (1 MiB IKNP matrix; L2-friendly)
KINDS = ("iknp", "ferret")

# (rows, tweak of the first OT of the batch, lo, hi): one batch of correlated OTs;
# rows are 16 bytes per OT (q for the sender, t = q xor c Delta for the receiver).
Batch = tuple[object, int, int, int]


def extension_kind(ferret: bool | None = None) -> str:
    """'ferret' or 'iknp': from ``ferret`` when given, else from ``CIPHERLM_OT``
    (default ``ferret``, docs/ot.md "Which default"; ``CIPHERLM_OT=iknp`` keeps
    IKNP).  Raises ValueError on any other value of the variable."""
    if ferret is not None:
        return "ferret" if ferret else "iknp"
    env = os.environ.get("CIPHERLM_OT", "ferret").strip().lower()
    if env not in KINDS:
        raise ValueError(f"CIPHERLM_OT must be 'iknp' or 'ferret', got {env!r}")
    return env


def make_extension(chan, party: int, *, batch: int = DEFAULT_BATCH, kind: str | None = None) -> "OTExtension":
    """The OT extension over `chan` for `party`: ``kind`` 'iknp' or 'ferret'
    (None: `extension_kind()`, i.e. ``CIPHERLM_OT``)."""
    kind = kind or extension_kind()
    iknp = IknpExtension(chan, party, batch=batch)
    if kind == "iknp":
        return iknp
    if kind == "ferret":
        return FerretExtension(iknp)
    raise ValueError(f"unknown OT extension {kind!r}")


class OTExtension(ABC):
    """Correlated OT with a global Delta per direction (see the module docstring).

    ``chan``: the channel to the peer; ``party``: 0 or 1; ``batch``: OTs per
    extension message.  Traffic is labelled by the caller's channel step, except
    base OTs ("ot.base") and Ferret refills ("ot.ferret")."""

    name: str = "?"
    chan = None
    party: int = 0
    batch: int = DEFAULT_BATCH

    @abstractmethod
    def setup(self, kk13: bool = False) -> None:
        """Base OTs of both directions now (otherwise on first use); both parties call it."""

    def prime(self) -> None:
        """Set-up for a large workload (both directions; both parties call it at the
        same point): a silent extension switches to its main parameters and fills the
        base they need now instead of growing into them.  Nothing to do on IKNP."""

    @abstractmethod
    def sender_delta(self) -> bytes:
        """This party's Delta (16 bytes) as COT sender (runs the base OTs on first use)."""

    @abstractmethod
    def send_cot(self, op: str, n: int, **fields) -> Iterator[Batch]:
        """Chosen-input COT, sender: yields (q, tweak, lo, hi) per batch, reading the
        receiver's message of each batch (header ``op`` and ``fields``)."""

    @abstractmethod
    def recv_cot(self, op: str, choices: np.ndarray, **fields) -> list[Batch]:
        """Chosen-input COT, receiver, for uint8 0/1 `choices`: sends every batch's
        message, returns [(t, tweak, lo, hi)] with t = q xor c Delta."""

    @abstractmethod
    def send_rcot(self, n: int) -> np.ndarray:
        """Random COT, sender: v (n, 2) uint64; the peer's `recv_rcot` gets (u, v xor u Delta)."""

    @abstractmethod
    def recv_rcot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Random COT, receiver: (u (n,) uint8 0/1 uniform, w (n, 2) uint64)."""

    @abstractmethod
    def send_1ofN(self, msgs: np.ndarray, bits: int, op: str = "1ofN") -> list[np.ndarray]:
        """1-out-of-N OT, sender: msgs (n, N) integer array; reads the receiver's
        messages and returns the replies (uint8 vectors) for the caller to send
        (op ``op + '_y'``), in order."""

    @abstractmethod
    def recv_1ofN(self, c: np.ndarray, N: int, bits: int, op: str = "1ofN") -> np.ndarray:
        """1-out-of-N OT, receiver: c (n,) uint8 < N -> msgs[j, c_j] (n,) uint64; sends its
        batches first, then reads the sender's replies (op ``op + '_y'``)."""

    def wire_bits(self, kind: str, bits: int = 64, N: int = 2) -> float:
        """Payload bits per OT on the wire (both directions, no headers, refills or
        base OTs) of `kind` ('rcot', 'cot' = chosen-input COT, '1ofN')."""
        raise NotImplementedError

    def _reply(self, op: str, size: int) -> np.ndarray:
        return expect(self.chan, op, {"y": size})["y"]


class _Direction:
    """One direction of one IKNP/KK13 extension width: the native extension
    object, the running OT index (the CCR hash tweak), and Delta (sender side)."""

    __slots__ = ("ext", "count", "delta")

    def __init__(self, ext, delta: bytes | None):
        self.ext = ext
        self.count = 0
        self.delta = delta


class IknpExtension(OTExtension):
    """IKNP03/ALSZ13 (k = 128) and KK13 (k = 256) over Chou-Orlandi base OTs
    (src/iknp.rs, src/baseot.rs).  Wire per COT: 128 bits receiver -> sender
    (256 for KK13); base OTs once per direction and width."""

    name = "iknp"

    def __init__(self, chan, party: int, *, batch: int = DEFAULT_BATCH):
        if party not in (0, 1):
            raise ValueError("party must be 0 or 1")
        if batch < 16:
            raise ValueError("batch must be >= 16")
        self.chan = chan
        self.party = party
        self.batch = int(batch)
        self.as_sender: dict[int, _Direction] = {}
        self.as_receiver: dict[int, _Direction] = {}
        # LSB of the k = 128 Delta forced to 1 (set by `FerretExtension`, whose pools
        # carry the receiver's choice bit in the LSB of w; 127 random bits remain)
        self.delta_lsb = False

    # ---------------------------------------------------------------- base OTs

    def sender_state(self, k: int) -> _Direction:
        """This party as extension sender = base-OT receiver with choices Delta."""
        st = self.as_sender.get(k)
        if st is None:
            with self.chan.step("ot.base"):
                msg = expect(self.chan, "base_A", {"A": 32}, k=k)
                delta = secrets.token_bytes(k // 8)
                if k == KAPPA and self.delta_lsb:
                    delta = bytes([delta[0] | 1]) + delta[1:]  # Ferret: LSB(Delta) = 1
                bits = np.unpackbits(u8(delta), bitorder="little")
                try:
                    B, keys = _core.baseot_receiver(msg["A"], bits)
                except ValueError as e:
                    raise OTError(f"base OT: {e}") from e
                self.chan.send({"op": "base_B", "k": k, "B": u8(B)})
            st = self.as_sender[k] = _Direction(_core.OtExtSender(delta, keys), delta)
        return st

    def receiver_state(self, k: int) -> _Direction:
        """This party as extension receiver = base-OT sender."""
        st = self.as_receiver.get(k)
        if st is None:
            with self.chan.step("ot.base"):
                a, A = _core.baseot_sender_init()
                self.chan.send({"op": "base_A", "k": k, "A": u8(A)})
                msg = expect(self.chan, "base_B", {"B": 32 * k}, k=k)
                try:
                    k0, k1 = _core.baseot_sender_keys(a, A, msg["B"])
                except ValueError as e:
                    raise OTError(f"base OT: {e}") from e
                del a
            st = self.as_receiver[k] = _Direction(_core.OtExtReceiver(k0, k1), None)
        return st

    def setup(self, kk13: bool = False) -> None:
        for k in (KAPPA, KK13_K) if kk13 else (KAPPA,):
            for sender in (0, 1):
                if self.party == sender:
                    self.sender_state(k)
                else:
                    self.receiver_state(k)

    def sender_delta(self) -> bytes:
        return bytes(self.sender_state(KAPPA).delta)

    def receiver_setup(self) -> None:
        """This party as COT receiver: run the base OTs on first use."""
        self.receiver_state(KAPPA)

    # ---------------------------------------------------------------- extension

    def extend_recv(self, k: int, op: str, choices: np.ndarray, batch: int | None = None, **fields) -> list[Batch]:
        """Receiver: extend for `choices` (uint8; < 256 for k = 256), send the
        matrices in batches.  Returns [(t, tweak, lo, hi)] per batch."""
        batch = batch or self.batch
        st = self.receiver_state(k)
        n = choices.size
        out = []
        for lo in range(0, n, batch) if n else ():
            hi = min(n, lo + batch)
            u, t = st.ext.extend(choices[lo:hi])
            self.chan.send({"op": op, "k": k, "n": hi - lo, "at": st.count, **fields, "u": u8(u)})
            out.append((t, st.count, lo, hi))
            st.count += hi - lo
        return out

    def extend_send(self, k: int, op: str, n: int, batch: int | None = None, **fields) -> Iterator[Batch]:
        """Sender: receive the receiver's batches; yield (q, tweak, lo, hi)."""
        batch = batch or self.batch
        st = self.sender_state(k)
        lo = 0
        while lo < n:
            m = min(n - lo, batch)
            msg = expect(self.chan, op, {"u": k * ((m + 15) // 16 * 16) // 8}, k=k, n=m, at=st.count, **fields)
            try:
                q = st.ext.extend(msg["u"], m)
            except ValueError as e:
                raise OTError(str(e)) from e
            yield q, st.count, lo, lo + m
            st.count += m
            lo += m

    def send_cot(self, op: str, n: int, **fields) -> Iterator[Batch]:
        return self.extend_send(KAPPA, op, n, **fields)

    def recv_cot(self, op: str, choices: np.ndarray, **fields) -> list[Batch]:
        return self.extend_recv(KAPPA, op, choices, **fields)

    # raw (unhashed) COT as arrays: the Ferret pools' bootstrap and random COT

    def send_raw_cot(self, n: int, op: str) -> np.ndarray:
        """Raw IKNP correlated OT, sender: q (n, 2) uint64; the peer (`recv_raw_cot`) gets
        q xor c*Delta.  Not hashed: for protocols that hash or mask them."""
        rows = [u64(q).reshape(-1, 2) for q, _tw, _lo, _hi in self.extend_send(KAPPA, op, int(n))]
        return np.concatenate(rows) if rows else np.empty((0, 2), np.uint64)

    def recv_raw_cot(self, choices: np.ndarray, op: str) -> np.ndarray:
        """Raw IKNP correlated OT, receiver: t (n, 2) uint64 = q xor c*Delta for uint8 0/1 `choices`."""
        c = np.ascontiguousarray(choices, dtype=np.uint8).reshape(-1)
        rows = [u64(t).reshape(-1, 2) for t, _tw, _lo, _hi in self.extend_recv(KAPPA, op, c)]
        return np.concatenate(rows) if rows else np.empty((0, 2), np.uint64)

    def send_rcot(self, n: int) -> np.ndarray:
        return self.send_raw_cot(n, "rcot")

    def recv_rcot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        u = random_choices(int(n)).astype(np.uint8)
        return u, self.recv_raw_cot(u, "rcot")

    # ---------------------------------------------------------------- 1-out-of-N (KK13)

    def send_1ofN(self, msgs: np.ndarray, bits: int, op: str = "1ofN") -> list[np.ndarray]:
        n, N = msgs.shape
        replies = []
        for q, tw, lo, hi in self.extend_send(KK13_K, op, n, bits=bits, N=N):
            # widened to uint64 one batch at a time: callers may pass compact (uint8) tables
            w = words(msgs[lo:hi], "msgs") & word_mask(bits)
            y = _core.kk13_sender(q, self.as_sender[KK13_K].delta, tw, N, w.view(np.uint8), bits)
            replies.append(u8(y))
        return replies

    def recv_1ofN(self, c: np.ndarray, N: int, bits: int, op: str = "1ofN") -> np.ndarray:
        out = np.empty(c.size, np.uint64)
        for t, tw, lo, hi in self.extend_recv(KK13_K, op, c, bits=bits, N=N):
            y = self._reply(op + "_y", ((hi - lo) * N * bits + 7) // 8)
            out[lo:hi] = u64(_core.kk13_receiver(t, c[lo:hi], tw, N, y, bits))
        return out

    def wire_bits(self, kind: str, bits: int = 64, N: int = 2) -> float:
        if kind in ("rcot", "cot"):
            return KAPPA
        if kind == "1ofN":
            return KK13_K + N * bits
        raise ValueError(f"unknown kind {kind!r}")


class FerretExtension(OTExtension):
    """Ferret silent COT (`cipherlm.mpc.ferret`) with the Delta of the wrapped
    `IknpExtension`, which bootstraps the pools (raw IKNP COT) and serves KK13
    1-out-of-N for N not a power of two.  Wire: 1 bit per chosen-input COT
    (e = c xor u), m + N*bits per 1-out-of-2^m OT, plus the refills ("ot.ferret")."""

    name = "ferret"

    def __init__(self, iknp: IknpExtension):
        if KAPPA in iknp.as_sender and not iknp.as_sender[KAPPA].delta[0] & 1:
            raise ValueError("Ferret needs LSB(Delta) = 1: wrap the IKNP extension before its base OTs")
        iknp.delta_lsb = True
        self.iknp = iknp
        self.chan = iknp.chan
        self.party = iknp.party
        self.sender_pool: FerretSender | None = None  # this party holds Delta
        self.receiver_pool: FerretReceiver | None = None

    @property
    def batch(self) -> int:  # type: ignore[override]
        return self.iknp.batch

    @batch.setter
    def batch(self, value: int) -> None:
        self.iknp.batch = int(value)

    def _send_pool(self) -> FerretSender:
        if self.sender_pool is None:
            self.sender_pool = FerretSender(self.iknp)
        return self.sender_pool

    def _recv_pool(self) -> FerretReceiver:
        if self.receiver_pool is None:
            self.receiver_pool = FerretReceiver(self.iknp)
        return self.receiver_pool

    def setup(self, kk13: bool = False) -> None:
        self.iknp.setup(kk13)

    def sender_delta(self) -> bytes:
        return self._send_pool().delta

    def prime(self) -> None:
        """Both pools to the main set with a full reserve (`FerretSender.prime`); party 0's
        sender pool pairs with party 1's receiver pool, so the parties go in mirrored order."""
        pools = (self._send_pool, self._recv_pool) if self.party == 0 else (self._recv_pool, self._send_pool)
        for pool in pools:
            pool().prime()

    def recv_cot(self, op: str, choices: np.ndarray, batch: int | None = None, **fields) -> list[Batch]:
        """Beaver derandomisation of Ferret random COTs (u, w): send e = c xor u."""
        batch = batch or self.batch
        pool = self._recv_pool()
        n = choices.size
        out = []
        for lo in range(0, n, batch) if n else ():
            hi = min(n, lo + batch)
            u, w = pool.take(hi - lo)
            tw = pool.tweak() - (hi - lo)
            e = np.packbits(choices[lo:hi] ^ u, bitorder="little")
            self.chan.send({"op": op, "k": KAPPA, "n": hi - lo, "at": tw, **fields, "e": e})
            out.append((w.view(np.uint8).reshape(-1), tw, lo, hi))
        return out

    def send_cot(self, op: str, n: int, batch: int | None = None, **fields) -> Iterator[Batch]:
        batch = batch or self.batch
        pool = self._send_pool()
        lo = 0
        while lo < n:
            m = min(n - lo, batch)
            v = pool.take(m)  # may refill (messages to the peer) before we read its corrections
            tw = pool.tweak() - m
            msg = expect(self.chan, op, {"e": (m + 7) // 8}, k=KAPPA, n=m, at=tw, **fields)
            e = np.unpackbits(msg["e"], count=m, bitorder="little").astype(np.uint64)
            v ^= pool.delta64 & np.negative(e)[:, None]  # Delta where e = 1 (all-ones mask)
            yield v.view(np.uint8).reshape(-1), tw, lo, lo + m
            lo += m

    def send_rcot(self, n: int) -> np.ndarray:
        return self._send_pool().take(int(n))

    def recv_rcot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._recv_pool().take(int(n))

    # ---------------------------------------------------------------- 1-out-of-N

    @staticmethod
    def _np(N: int) -> bool:
        """1-out-of-N for N = 2^m from m correlated OTs (Naor-Pinkas 1999 on random OTs)."""
        return N & (N - 1) == 0

    def _whole(self, m_bits: int) -> int:
        """A batch size holding whole 1-out-of-N instances (m_bits COTs each)."""
        return max(m_bits, self.batch - self.batch % m_bits)

    def send_1ofN(self, msgs: np.ndarray, bits: int, op: str = "1ofN") -> list[np.ndarray]:
        n, N = msgs.shape
        if not self._np(N):
            return self.iknp.send_1ofN(msgs, bits, op)
        m_bits = N.bit_length() - 1
        replies = []
        small = bits <= 8 and msgs.dtype == np.uint8  # one byte a message: no uint64 copy (the kernel masks)
        for q, tw, lo, hi in self.send_cot(op, n * m_bits, batch=self._whole(m_bits), bits=bits, N=N):
            rows = msgs[lo // m_bits:hi // m_bits]
            w = np.ascontiguousarray(rows).reshape(-1) if small else (words(rows, "msgs") & word_mask(bits)).view(np.uint8)
            y = _core.np1ofn_sender(q, self.sender_pool.delta, tw, N, w, bits, 1 if small else 8)
            replies.append(u8(y))
        return replies

    def recv_1ofN(self, c: np.ndarray, N: int, bits: int, op: str = "1ofN") -> np.ndarray:
        if not self._np(N):
            return self.iknp.recv_1ofN(c, N, bits, op)
        m_bits = N.bit_length() - 1
        out = np.empty(c.size, np.uint64)
        # bit i of choice j is the choice of correlated OT j m + i
        cbits = np.unpackbits(np.asarray(c, np.uint8)[:, None], axis=1, count=m_bits, bitorder="little").reshape(-1)
        for t, tw, lo, hi in self.recv_cot(op, cbits, batch=self._whole(m_bits), bits=bits, N=N):
            j0, j1 = lo // m_bits, hi // m_bits
            y = self._reply(op + "_y", ((j1 - j0) * N * bits + 7) // 8)
            out[j0:j1] = u64(_core.np1ofn_receiver(t, c[j0:j1], tw, N, y, bits))
        return out

    def wire_bits(self, kind: str, bits: int = 64, N: int = 2) -> float:
        if kind == "rcot":
            return 0.0
        if kind == "cot":
            return 1.0
        if kind == "1ofN":
            return (N.bit_length() - 1) + N * bits if self._np(N) else self.iknp.wire_bits(kind, bits, N)
        raise ValueError(f"unknown kind {kind!r}")


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
  ``bits``-bit word per OT instead of two messages (C-OT, sec. 5.4); the
  same C-OT modulo each of several primes (``send_cot_mod``, one correction
  of ceil(|q_i| / 8) bytes per prime: BLB's conversion to CKKS shares).
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
COT mod primes q_i     128                   8 sum_i ceil(|q_i| / 8)
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

Where the correlated OTs come from
----------------------------------
Callers only see the methods below.  Each of them is derived from *correlated
OT with a global Delta* (the sender gets q_j, the receiver t_j = q_j xor c_j
Delta) by hashing, plus the sender's correction words.  Those correlated OTs
come from an OT extension behind the interface of
`cipherlm.mpc.ot_extension` (`OTExtension`, in the style of SPU's
``FerretOtInterface``): `FerretExtension` (the default) or `IknpExtension`
(IKNP / KK13; ``CIPHERLM_OT=iknp`` or ``ferret=False``).  Ferret: silent COT, Yang et al. CCS 2020, semi-honest,
bootstrapped once from IKNP: the receiver sends e = c xor u, 1 bit per OT,
the sender sets v <- v xor e*Delta, and the hashing / corrections below are
unchanged; 1-out-of-N for N = 2^m comes from m of those correlated OTs,
Naor-Pinkas 1999 on random OTs, m + N l bits per OT instead of KK13's
256 + N l; other N stay on KK13).  The session object is ``OTSession.ext``.
Why Ferret is the default: it sends 4-9x fewer bytes, and since its iteration
was pipelined and sped up its compute is close to IKNP's (docs/ot.md,
"Which default", measured); the cost table above is IKNP's, Ferret's is in
`bytes_per_ot` and docs/ot.md.
"""

from __future__ import annotations

import contextlib
import secrets

import numpy as np

from cipherlm import _core

from .ot_common import OTError, expect
from .ot_common import u8 as _u8, u64 as _u64, word_mask as _mask, words as _words
from .ot_extension import (DEFAULT_BATCH, KAPPA, KK13_K, FerretExtension, IknpExtension, OTExtension,
                           extension_kind)

__all__ = ["OTSession", "OTError", "bytes_per_ot", "cot_mod_row_bytes", "KAPPA"]


def bytes_per_ot(kind: str, bits: int = 64, N: int = 2, length: int = 0, ferret: bool | None = None) -> float:
    """Payload bytes per OT on the wire, both directions, excluding base OTs,
    headers and padding.  `kind`: random | bool_cot | cot | chosen |
    chosen_bytes (`length` bytes) | cot_mod (`length` = the reply bytes per OT,
    sum_i ceil(bitlen(q_i) / 8)) | 1ofN.  ``ferret``: True / False for that
    extension; None (default) for the one a default `OTSession` uses
    (``CIPHERLM_OT``, default Ferret).  With Ferret the 128-bit IKNP
    row becomes the 1-bit derandomisation (the Ferret refills, amortised
    ~0.45 bit per OT with the main parameter set, are not included), and
    1-out-of-N for N = 2^m takes m such OTs instead of KK13's 256-bit row."""
    if ferret is None:
        ferret = extension_kind() == "ferret"
    if ferret and kind == "1ofN" and N & (N - 1) == 0:
        return ((N.bit_length() - 1) + N * bits) / 8
    if ferret and kind != "1ofN":
        return bytes_per_ot(kind, bits, N, length, ferret=False) - (KAPPA - 1) / 8
    if kind in ("random", "bool_cot"):
        return KAPPA / 8
    if kind == "cot":
        return (KAPPA + bits) / 8
    if kind == "chosen":
        return (KAPPA + 2 * bits) / 8
    if kind == "chosen_bytes":
        return KAPPA / 8 + 2 * length
    if kind == "cot_mod":
        return KAPPA / 8 + length
    if kind == "1ofN":
        return (KK13_K + N * bits) / 8
    raise ValueError(f"unknown OT kind {kind!r}")


def _bits_arg(bits: int) -> int:
    bits = int(bits)
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in 1..64, got {bits}")
    return bits


def _primes_arg(primes) -> list[int]:
    """The moduli of `send_cot_mod` / `recv_cot_mod`: 1 to 16 ints in [2, 2^62)."""
    ps = [int(q) for q in np.asarray(primes, dtype=object).reshape(-1)]
    if not 1 <= len(ps) <= 16:
        raise ValueError(f"need 1 to 16 primes, got {len(ps)}")
    for q in ps:
        if not 2 <= q < (1 << 62):
            raise ValueError(f"prime {q} is not in [2, 2^62)")
    return ps


def cot_mod_row_bytes(primes) -> int:
    """Bytes of the sender's correction per OT of `send_cot_mod`: sum_i ceil(bitlen(q_i) / 8)."""
    return sum((q.bit_length() + 7) // 8 for q in _primes_arg(primes))


def _choices01(choices) -> tuple[np.ndarray, tuple]:
    c = np.asarray(choices)
    shape = c.shape
    if c.dtype != np.bool_:
        if not np.issubdtype(c.dtype, np.integer):
            raise ValueError("choices must be a bool or integer array")
        if c.size and (c.min() < 0 or c.max() > 1):
            raise ValueError("choice bits must be 0 or 1")
    return np.ascontiguousarray(c.reshape(-1), dtype=np.uint8), shape


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
    ``ferret``: True / False selects the OT extension (None: ``CIPHERLM_OT``,
    default Ferret, ``CIPHERLM_OT=iknp`` for IKNP); the extension object is
    ``self.ext`` (`cipherlm.mpc.ot_extension`).
    """

    def __init__(self, chan, party: int, *, batch: int = DEFAULT_BATCH, step: str | None = None,
                 ferret: bool | None = None):
        self._iknp = IknpExtension(chan, party, batch=int(batch))  # checks party and batch
        self.chan = chan
        self.party = party
        self.step = step
        kind = extension_kind(ferret)
        self.ext: OTExtension = FerretExtension(self._iknp) if kind == "ferret" else self._iknp
        self.ferret = kind == "ferret"

    @property
    def batch(self) -> int:
        return self._iknp.batch

    @batch.setter
    def batch(self, value: int) -> None:
        self._iknp.batch = int(value)

    # ------------------------------------------------------------ plumbing

    def _label(self, label: str | None):
        return self.chan.step(label) if label is not None else contextlib.nullcontext()

    def _expect(self, op: str, arrays: dict[str, int | None], **fields) -> dict:
        """Receive one message; check its op, scalar fields and uint8 array sizes."""
        return expect(self.chan, op, arrays, **fields)

    def setup(self, kk13: bool = False) -> None:
        """Run the base OTs of both directions now (otherwise they run on first
        use).  Both parties call it."""
        self.ext.setup(kk13)

    def prime(self) -> None:
        """Set-up for a large workload (`OTExtension.prime`): on Ferret, both directions'
        pools switch to the main parameter set and fill its base now.  Both parties call it."""
        self.ext.prime()

    # internals kept for tests and tools that act as a broken peer (the IKNP part's state)

    @property
    def _as_sender(self) -> dict:
        return self._iknp.as_sender

    @property
    def _as_receiver(self) -> dict:
        return self._iknp.as_receiver

    def _sender_ext(self, k: int):
        return self._iknp.sender_state(k)

    def _receiver_ext(self, k: int):
        return self._iknp.receiver_state(k)

    @property
    def _ferret_send(self):
        """The Ferret pool where this party holds Delta (None: not started / IKNP)."""
        return getattr(self.ext, "sender_pool", None)

    @property
    def _ferret_recv(self):
        return getattr(self.ext, "receiver_pool", None)

    def _delta(self) -> bytes:
        return self.ext.sender_delta()

    # ------------------------------------------------------------ raw IKNP COT
    # Kept for callers of the previous interface; the Ferret pools now use
    # `IknpExtension` (``self.ext`` / `ot_extension`) directly.

    def iknp_sender_delta(self) -> bytes:
        """This party's IKNP Delta (16 bytes) as extension sender; runs the base OTs on first use."""
        return self._iknp.sender_delta()

    def iknp_receiver_setup(self) -> None:
        """This party as IKNP extension receiver: runs the base OTs on first use."""
        self._iknp.receiver_setup()

    def iknp_send_cot(self, n: int, op: str) -> np.ndarray:
        """Raw IKNP correlated OT, sender: q (n, 2) uint64 (see `IknpExtension.send_raw_cot`)."""
        return self._iknp.send_raw_cot(n, op)

    def iknp_recv_cot(self, choices: np.ndarray, op: str) -> np.ndarray:
        """Raw IKNP correlated OT, receiver: t (n, 2) uint64 = q xor c*Delta."""
        return self._iknp.recv_raw_cot(choices, op)

    def _send_replies(self, op: str, replies: list[np.ndarray]) -> None:
        for y in replies:
            self.chan.send({"op": op, "y": y})

    def _recv_reply(self, op: str, size: int) -> np.ndarray:
        return self._expect(op, {"y": size})["y"]

    # ------------------------------------------------------------ random COT (unhashed)

    def send_rcot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Random correlated OT, sender: (v (n, 2) uint64, Delta (2,) uint64); the
        receiver (`recv_rcot`) gets random bits u and w = v xor u*Delta.  Not hashed.
        Wire: IKNP 128 bits per OT; Ferret nothing but the amortised refills."""
        with self._label(self.step):
            v = self.ext.send_rcot(int(n))
        return v, _u64(self._delta()).copy()

    def recv_rcot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Random correlated OT, receiver: (u (n,) bool uniform, w (n, 2) uint64)."""
        with self._label(self.step):
            u, w = self.ext.recv_rcot(int(n))
        return u.astype(bool), w

    # ------------------------------------------------------------ random OT

    def send_random(self, n: int, bits: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """Random OT, sender: (m0, m1), uint64 arrays of n uniform `bits`-bit values.
        Wire: 128 bits per OT from the receiver, nothing back."""
        bits = _bits_arg(bits)
        n = int(n)
        m0 = np.empty(n, np.uint64)
        m1 = np.empty(n, np.uint64)
        with self._label(self.step):
            for q, tw, lo, hi in self.ext.send_cot("rot", n, bits=bits):
                a, b = _core.rot_sender(q, self._delta(), tw, bits)
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
            for t, tw, lo, hi in self.ext.recv_cot("rot", c, bits=bits):
                out[lo:hi] = _u64(_core.rot_receiver(t, tw, bits))
        return c.astype(bool).reshape(shape), out.reshape(shape)

    # ------------------------------------------------------------ boolean COT

    def send_bool_cot(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw correlated OT with global Delta, sender: (q (n, 2) uint64,
        Delta (2,) uint64); the receiver gets q xor c*Delta.  128 bits per OT
        (IKNP; Ferret: 1).  These are *not* hashed: use them only in protocols
        that hash or mask them (e.g. to build other OT kinds)."""
        n = int(n)
        q_all = np.empty((n, 2), np.uint64)
        with self._label(self.step):
            for q, _tw, lo, hi in self.ext.send_cot("bcot", n):
                q_all[lo:hi] = _u64(q).reshape(-1, 2)
            delta = self._delta()
        return q_all, _u64(delta).copy()

    def recv_bool_cot(self, choices) -> np.ndarray:
        """Raw correlated OT, receiver: t (n, 2) uint64 = q xor c*Delta."""
        c, _shape = _choices01(choices)
        t_all = np.empty((c.size, 2), np.uint64)
        with self._label(self.step):
            for t, _tw, lo, hi in self.ext.recv_cot("bcot", c):
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
            for q, tw, lo, hi in self.ext.send_cot("cot", c.size, bits=bits):
                rr, d = _core.acot_sender(q, self._delta(), tw, c[lo:hi].view(np.uint8), bits)
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
            batches = self.ext.recv_cot("cot", c, bits=bits)
            for t, tw, lo, hi in batches:
                y = self._recv_reply("cot_y", (hi - lo) * bits // 8 + (1 if (hi - lo) * bits % 8 else 0))
                try:
                    out[lo:hi] = _u64(_core.acot_receiver(t, c[lo:hi], tw, y, bits))
                except ValueError as e:
                    raise OTError(str(e)) from e
        return out.reshape(shape)

    # ------------------------------------------------------------ arithmetic COT mod primes

    def send_cot_mod(self, corr, primes) -> np.ndarray:
        """Arithmetic correlated OT modulo each of k primes (ALSZ13 sec. 5.4 per
        prime), sender: corr (n, k) integers with corr[:, i] < primes[i]; returns r
        (n, k) uint64, r[:, i] uniform mod primes[i]; the receiver with choice c_j
        gets r[j] + c_j corr[j] mod primes.  Wire: 128 bits (Ferret: 1) plus
        sum_i ceil(bitlen(q_i) / 8) bytes per OT (`cot_mod_row_bytes`)."""
        ps = _primes_arg(primes)
        k = len(ps)
        a = np.asarray(corr)
        if a.ndim != 2 or a.shape[1] != k:
            raise ValueError(f"corr must be (n, {k}) for {k} primes, got shape {a.shape}")
        if not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
            raise ValueError("corr must be an integer array")
        if a.size and np.issubdtype(a.dtype, np.signedinteger) and a.min() < 0:
            raise ValueError("corr must be non-negative")
        c = np.ascontiguousarray(a, dtype=np.uint64)
        if c.size and (c >= np.array(ps, np.uint64)).any():
            raise ValueError("corr[:, i] must be below primes[i]")
        n, w = c.shape[0], cot_mod_row_bytes(ps)
        r = np.empty((n, k), np.uint64)
        replies = []
        with self._label(self.step):
            for q, tw, lo, hi in self.ext.send_cot("cot_mod", n, nprimes=k, ybytes=w):
                rr, y = _core.acot_mod_sender(q, self._delta(), tw, c[lo:hi].reshape(-1).view(np.uint8), ps)
                r[lo:hi] = _u64(rr).reshape(-1, k)
                replies.append(_u8(y))
            self._send_replies("cot_mod_y", replies)
        return r

    def recv_cot_mod(self, choices, primes) -> np.ndarray:
        """Arithmetic COT modulo each prime, receiver: (n, k) uint64, row j =
        r[j] + choices[j] corr[j] mod primes (see `send_cot_mod`)."""
        ps = _primes_arg(primes)
        k = len(ps)
        c, _shape = _choices01(choices)
        w = cot_mod_row_bytes(ps)
        out = np.empty((c.size, k), np.uint64)
        with self._label(self.step):
            batches = self.ext.recv_cot("cot_mod", c, nprimes=k, ybytes=w)
            for t, tw, lo, hi in batches:
                y = self._recv_reply("cot_mod_y", (hi - lo) * w)
                try:
                    out[lo:hi] = _u64(_core.acot_mod_receiver(t, c[lo:hi], tw, y, ps)).reshape(-1, k)
                except ValueError as e:
                    raise OTError(str(e)) from e
        return out

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
            for q, tw, lo, hi in self.ext.send_cot("chosen", a.size, bits=bits):
                y = _core.chosen_sender(q, self._delta(), tw, a[lo:hi].view(np.uint8), b[lo:hi].view(np.uint8), bits)
                replies.append(_u8(y))
            self._send_replies("chosen_y", replies)

    def recv_chosen(self, choices, bits: int = 64) -> np.ndarray:
        """Chosen-message OT, receiver: m_c (uint64, shape of choices)."""
        bits = _bits_arg(bits)
        c, shape = _choices01(choices)
        out = np.empty(c.size, np.uint64)
        with self._label(self.step):
            for t, tw, lo, hi in self.ext.recv_cot("chosen", c, bits=bits):
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
            for q, tw, lo, hi in self.ext.send_cot("chosen_bytes", n, length=L):
                y = _core.chosen_bytes_sender(q, self._delta(), tw, a[lo:hi].reshape(-1), b[lo:hi].reshape(-1), L)
                replies.append(_u8(y))
            self._send_replies("chosen_bytes_y", replies)

    def recv_chosen_bytes(self, choices, length: int) -> np.ndarray:
        """Chosen OT of byte strings, receiver: (n, length) uint8."""
        c, _shape = _choices01(choices)
        L = int(length)
        out = np.empty((c.size, L), np.uint8)
        with self._label(self.step):
            for t, tw, lo, hi in self.ext.recv_cot("chosen_bytes", c, length=L):
                y = self._recv_reply("chosen_bytes_y", 2 * (hi - lo) * L)
                out[lo:hi] = _u8(_core.chosen_bytes_receiver(t, c[lo:hi], tw, y, L)).reshape(-1, L)
        return out

    # ------------------------------------------------------------ 1-out-of-N

    def send_1ofN(self, msgs, bits: int = 64) -> None:
        """1-out-of-N OT, sender: msgs is (n, N) of `bits`-bit words, 2 <= N <= 256.
        Wire (IKNP, KK13): 256 + N*bits bits per OT; Ferret, N = 2^m: m + N*bits."""
        bits = _bits_arg(bits)
        m = np.asarray(msgs)
        if m.ndim != 2 or not 2 <= m.shape[1] <= 256:
            raise ValueError("msgs must be (n, N) with 2 <= N <= 256")
        if not (np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_):
            raise ValueError("msgs must be an integer array")
        with self._label(self.step):
            replies = self.ext.send_1ofN(m, bits, "1ofN")
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
        with self._label(self.step):
            out = self.ext.recv_1ofN(c, N, bits, "1ofN")
        return out.reshape(shape)

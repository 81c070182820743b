"""Ferret silent correlated OT: a pool of random COTs behind `OTSession`.

Yang, Weng, Lan, Zhang, Wang, "Ferret: Fast Extension for coRRElated oT with
small communication", CCS 2020 (ePrint 2020/924), semi-honest protocol
(sec. 4, primal LPN with regular noise; sec. 5 bootstrapping).

One direction of an `OTSession` (a Delta holder, the *sender*, and a choice-bit
holder, the *receiver*) keeps a pool of random COTs
(sender v_i; receiver u_i, w_i = v_i xor u_i * Delta) with the Delta of the
session's IKNP extension in that direction.  The pool is refilled by Ferret
iterations computed in the Rust core (`_core.ferret_sender` /
`_core.ferret_receiver`, see src/ferret.rs): each iteration consumes
k + t*h base COTs and produces n = t * 2^h new ones, of which the first
k + t*h are kept as the base of the next iteration (Ferret sec. 5, "bootstrapping")
and the rest are served.  The very first base comes from IKNP (raw correlated
OT, `IknpExtension.send_raw_cot` / `recv_raw_cot`).  One iteration costs
two messages from the sender: first the 16-byte public LPN seed, then
t (h * 256 + 128) bits (masked GGM level sums and the leaf-sum correction).
The halves are pipelined: the receiver encodes its LPN part (which needs
only the seed) while the sender builds its trees, and the sender encodes
its LPN part after sending the trees' message, while the receiver rebuilds
the punctured trees; with the two parties on two cores an iteration takes
about the longer of the two encodings plus the tree halves, instead of the
sum of both parties' work.

Ahead of time (main phase, on by default: `FerretSender.ahead`,
`FerretReceiver.ahead`): each main iteration's "ferret" message also carries the
public seed of the next main iteration (field ``next``, 16 bytes), and as soon
as an iteration is absorbed both parties start their part of the next one in a
background thread (the core releases the GIL): the sender its whole iteration,
the receiver its LPN half.  The refill that falls due later only sends the
message and rebuilds the receiver's trees, so the ~0.3 s LPN encodings overlap
the protocol that consumes the COTs (on two cores: the time a party spends
waiting for its peer) instead of stopping it.  The background iteration writes
into the arrays that the previous served block frees (`_Fifo.spare`), so the
memory stays at two iterations' outputs per side.

The receiver's choice bit travels in the LSB of w (as in the authors' emp-ot):
LSB(Delta) = 1 (`IknpExtension.delta_lsb`, 127 random bits of Delta remain),
the sender's rows v all have LSB 0 (the IKNP bootstrap is normalised on
both sides: v's LSB cleared, w's LSB set to the choice bit; the GGM leaves
are cleared in the core), so u = LSB(w) for the base and, by linearity, for
every output: the receiver's LPN encoding gathers w only, not the choice
bits as well.  The served sender rows therefore have LSB 0 (the raw
`send_rcot` / `send_bool_cot` outputs; the hashed OT kinds are unaffected).

The pools are driven by `cipherlm.mpc.ot_extension.FerretExtension` (the
Ferret implementation of the OT-extension interface), which hands them its
`IknpExtension`; they use only that object's channel (``base.chan``) and its
public raw-COT methods (``sender_delta``, ``receiver_setup``,
``send_raw_cot``, ``recv_raw_cot``), and this module imports neither ot.py
nor ot_extension.py (shared pieces: `cipherlm.mpc.ot_common`).

Derandomisation (Beaver 1995) is done by `FerretExtension.send_cot` /
``recv_cot``: the receiver sends e = c xor u (1 bit per OT), the sender
replaces v by v xor e * Delta; everything after that (CCR hashing, chosen /
arithmetic corrections in `OTSession`) is the IKNP code path unchanged.

Parameters: only the Ferret paper's LPN parameter sets for primal LPN with
regular noise (see `FERRET_MAIN`, `FERRET_SETUP`).  The first iterations of a
session use the small set; the session switches to the main set once it has
served more than `MAIN_AFTER` COTs in that direction (or a single request
needs more than one small iteration gives), because a main iteration costs
~0.3-0.5 s of compute per party (2-vCPU EPYC, docs/benchmarks.md "OT extension
throughput") and ~350 MB of memory per party and direction (its output, and the
previous output kept for reuse or filled ahead), which only pays off for large workloads.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import numpy as np

from cipherlm import _core

from .ot_common import OTError, expect, random_choices

__all__ = ["LPNParams", "FERRET_MAIN", "FERRET_SETUP", "FerretSender", "FerretReceiver", "GGM_TWEAK", "SERVE_TWEAK"]


@dataclass(frozen=True)
class LPNParams:
    """One Ferret iteration: n = t * 2^h outputs from k + t*h base COTs."""

    n: int
    k: int
    t: int
    h: int

    def __post_init__(self):
        if self.n != self.t << self.h:
            raise ValueError(f"n = {self.n} is not t * 2^h = {self.t} * 2^{self.h}")

    @property
    def base(self) -> int:
        return self.k + self.t * self.h

    @property
    def usable(self) -> int:
        return self.n - self.base

    @property
    def msg_len(self) -> int:
        return self.t * (32 * self.h + 16)


# Ferret (CCS 2020 / ePrint 2020/924), LPN parameters for primal LPN with
# regular noise and a local linear code of row weight d = 10, 128-bit security
# (the paper's parameter table; the same sets as the authors' reference
# implementation emp-ot at the paper's release, emp-ot/ferret/constants.h,
# commit 66567cf, Sept. 2020: N_REG/K_REG/T_REG/BIN_SZ_REG and
# N_PRE_REG/K_PRE_REG/T_PRE_REG/BIN_SZ_PRE_REG):
#
#   set     n            k          t       leaves/tree   base = k + t*h
#   main    10,805,248   589,760    1,319   2^13          606,907
#   setup      649,728    36,288    1,269   2^9            47,709
#
# (emp-ot later moved to other sets, e.g. n = 10,608,640, k = 589,824,
# t = 1,295, and in 2022 to n = 10,485,760, k = 452,000, t = 1,280; we keep the
# published ones.)
FERRET_MAIN = LPNParams(10_805_248, 589_760, 1_319, 13)
FERRET_SETUP = LPNParams(649_728, 36_288, 1_269, 9)

# After this many COTs served in one direction, refills use FERRET_MAIN.
MAIN_AFTER = 2 * FERRET_SETUP.usable

# Tweak domains of the CCR hash (IKNP uses 0, 1, 2, ... per OT): GGM level
# masks and OTs served from the Ferret pool never share a tweak with IKNP or
# with each other.
GGM_TWEAK = 1 << 62
SERVE_TWEAK = 1 << 63


class _FerretSide:
    """State shared by both roles: reserve (base of the next iteration), pool
    of served COTs, counters.  Both parties make the same sequence of `take`
    calls, so their refills happen at the same points."""

    def __init__(self, base, main_after: int = MAIN_AFTER):
        # the IKNP base: an `ot_extension.IknpExtension` (chan, sender_delta,
        # receiver_setup, send_raw_cot, recv_raw_cot)
        self.base = base
        self.main_after = int(main_after)
        self.served = 0  # COTs handed out (tweak counter of the served OTs)
        self.iterations = 0
        self.ggm_tweak = GGM_TWEAK
        self.main = False

    # subclass API: _reserve_len(), _bootstrap(m), _iterate(P) -> None, _avail()

    def tweak(self) -> int:
        """CCR-hash tweak of the next served COT."""
        return SERVE_TWEAK + self.served

    def _refill(self, m: int) -> None:
        """One refill step (both parties make the same ones); its traffic is
        labelled "ot.ferret" in the channel accounting (like "ot.base")."""
        with self.base.chan.step("ot.ferret"):
            self._refill_step(m)

    def _refill_step(self, m: int) -> None:
        if not self.main and (self.served + m > self.main_after or m - self._avail() > FERRET_SETUP.usable):
            self.main = True
        P = FERRET_MAIN if self.main else FERRET_SETUP
        if self._reserve_len() < FERRET_SETUP.base:
            self._bootstrap(FERRET_SETUP.base - self._reserve_len())
        if self._reserve_len() < P.base:
            # main set without enough base: one small iteration feeds the reserve only
            self._iterate(FERRET_SETUP, serve=False)
            return
        self._iterate(P, serve=True)

    def prime(self) -> None:
        """Set-up for a large workload: switch to the main set now, fill the reserve
        with a main iteration's base (the IKNP bootstrap and one small iteration that
        feeds the reserve only, as emp-ot's Ferret set-up does with its
        pre-iteration), then run one main iteration into an empty pool.  The first
        main iteration of a side costs up to 3x a later one (measured 0.24-0.64 s
        against 0.21 s: its output arrays, the core's scratch); that now falls in
        the set-up, and later requests see the steady state.  Both parties call it at
        the same point; traffic is labelled "ot.ferret"."""
        self.main = True
        while self._reserve_len() < FERRET_MAIN.base:
            self._refill(FERRET_MAIN.usable)
        if self._avail() == 0:
            self._refill(FERRET_MAIN.usable)

    def _take(self, m: int, empty: list[np.ndarray]) -> list[np.ndarray]:
        """m COTs off the pool (subclass `pool`, a `_Fifo`): what is there first, then
        refills (so that the served-out block's arrays are free for the refill).
        `served` counts as they are popped, so the refill decisions see
        served + m and m - available exactly as when the whole request waited."""
        parts = []
        left = m
        while left:
            if self.pool.avail == 0:
                self._refill(left)
                continue
            k = min(left, self.pool.avail)
            parts.append(self.pool.pop(k))
            self.served += k
            left -= k
        if not parts:
            return empty
        if len(parts) == 1:
            return parts[0]
        return [np.concatenate(col) for col in zip(*parts)]

    def _next_iteration(self, P: LPNParams) -> tuple[int, int]:
        it, tw = self.iterations, self.ggm_tweak
        self.iterations += 1
        self.ggm_tweak += P.t * P.h
        return it, tw


def _rows(n: int) -> np.ndarray:
    """An uninitialised (n, 2) uint64 array, 16-byte aligned (the native core
    writes the COTs of an iteration straight into it)."""
    a = np.empty((n + 1) * 2, np.uint64)
    off = (-a.ctypes.data % 16) // 8
    return a[off:off + 2 * n].reshape(n, 2)


class _Fifo:
    """The served COTs: a queue of row blocks (views of whole iterations' outputs;
    an iteration is appended without copying it into one big pool).  The output
    arrays of a block that has been served completely are kept (``spare``) and
    reused by the next iteration of the same size: a fresh 170 MB array costs
    more in the kernel's page zeroing than the copy of the COTs out of it."""

    def __init__(self):
        self.blocks: list[list] = []  # [arrays..., owners, pos]
        self.avail = 0
        self.spare: dict[tuple, np.ndarray] = {}

    def push(self, *arrays: np.ndarray, owners: tuple = ()) -> None:
        if arrays[0].shape[0]:
            self.blocks.append([*arrays, owners, 0])
            self.avail += arrays[0].shape[0]

    def array(self, shape: tuple, make) -> np.ndarray:
        """A spare array of this shape, or make() a new one."""
        a = self.spare.pop(shape, None)
        return a if a is not None else make()

    def pop(self, m: int) -> list[np.ndarray]:
        """The next m rows of every array of the blocks, as fresh arrays."""
        assert m <= self.avail
        parts: list[list[np.ndarray]] = []
        done = []
        left = m
        while left:
            blk = self.blocks[0]
            pos = blk[-1]
            size = blk[0].shape[0]
            take = min(left, size - pos)
            parts.append([a[pos:pos + take] for a in blk[:-2]])
            left -= take
            if pos + take == size:
                done.append(self.blocks.pop(0)[-2])
            else:
                blk[-1] = pos + take
        self.avail -= m
        if len(parts) == 1:
            out = [p.copy() for p in parts[0]]
        else:
            out = [np.concatenate(col) for col in zip(*parts)]
        for owners in done:  # served completely (and copied out): reusable
            for a in owners:
                self.spare[a.shape] = a
        return out


class _Background:
    """fn(*args) in a daemon thread (the native core releases the GIL, so it runs beside
    the session's thread); `join` returns its result or re-raises its exception in the
    caller's thread."""

    def __init__(self, name: str, fn, *args):
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name=name)
        self.thread.start()

    def _run(self, fn, args) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the session's thread
            self.error = e

    def join(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


class _Ahead:
    """The sender's next main iteration, computed in a background thread while the
    COTs of the current one are served (and while the receiver computes its side
    of the current one): on two cores the sender's iteration no longer adds to the
    receiver's on the critical path.  It uses the LPN seed already announced to the
    receiver (`FerretSender._next_seed`).  Nothing else is sent early: the message
    goes out when the refill is due, exactly as without it; the iteration counter
    and tweaks are committed then."""

    def __init__(self, side: "FerretSender", P: LPNParams, seed: bytes):
        self.P, self.reserve, self.seed = P, side.reserve, seed
        self.it, self.tw = side.iterations, side.ggm_tweak  # what _next_iteration will return
        base, self.v = side._iteration_buffers(P)
        args = (side.delta, base, P.n, P.k, P.t, P.h, seed, self.tw)
        self.job = _Background("ferret-ahead", lambda: _core.ferret_sender(*args, out=self.v.view(np.uint8).reshape(-1))[0])


class _ReceiverAhead:
    """The receiver's LPN half of its next main iteration (`_core.ferret_receiver_lpn`,
    which needs only the public seed and this side's base), computed in a background
    thread from the seed the sender announced with the current iteration's message
    (``next``); the tree half waits for the sender's message at the refill, as without
    it.  Used only if the refill that comes is that iteration (same parameters, base,
    counter and seed); otherwise discarded and the LPN half computed then."""

    def __init__(self, side: "FerretReceiver", P: LPNParams, seed: bytes):
        self.P, self.seed, self.it = P, seed, side.iterations
        self.reserve_w = side.reserve_w
        self.bu, self.bw, self.u, self.w = side._iteration_buffers(P)
        self.job = _Background("ferret-ahead-lpn", _core.ferret_receiver_lpn, self.bu, self.bw, P.n, P.k, P.t, P.h,
                               seed, self.u, self.w.view(np.uint8).reshape(-1), True)

    def matches(self, side: "FerretReceiver", P: LPNParams, it: int, seed) -> bool:
        return (self.P is P and self.it == it and self.reserve_w is side.reserve_w
                and bytes(np.asarray(seed, np.uint8)) == self.seed)


def _next_seed(msg: dict) -> bytes | None:
    """The LPN seed the sender announces for its next main iteration (field ``next`` of
    its "ferret" message, 16 bytes), or None."""
    nxt = msg.get("next")
    if nxt is None:
        return None
    if not isinstance(nxt, np.ndarray) or nxt.dtype != np.uint8 or nxt.shape != (16,):
        raise OTError("OT message 'ferret': field 'next' must be a 16-byte uint8 vector")
    return nxt.tobytes()


class FerretSender(_FerretSide):
    """The Delta holder of one direction (the IKNP extension sender).

    In the main phase each "ferret" message also announces the public LPN seed of the
    next main iteration (``next``), so that the receiver can encode its LPN half of
    that iteration in the background (`_ReceiverAhead`).  Announcing the public matrix
    early changes nothing for security: it is public and independent of every secret
    (the authors' emp-ot even fixes one matrix per session); the seed stays fresh per
    iteration from the OS CSPRNG.

    ``ahead`` (default True): in the main phase, compute the next iteration in a
    background thread (`_Ahead`); same messages, same outputs."""

    ahead = True

    def __init__(self, base, main_after: int = MAIN_AFTER):
        super().__init__(base, main_after)
        base.delta_lsb = True  # takes effect if its base OTs have not run yet
        self.delta = base.sender_delta()  # IKNP sender: same Delta
        if not self.delta[0] & 1:
            raise ValueError("Ferret needs LSB(Delta) = 1 (IknpExtension.delta_lsb before its base OTs)")
        self.delta64 = np.frombuffer(self.delta, np.uint64).copy()
        self.reserve = np.empty((0, 2), np.uint64)
        self.pool = _Fifo()
        self._ahead: _Ahead | None = None
        self._next_seed: bytes | None = None  # announced for the next main iteration

    def _avail(self) -> int:
        return self.pool.avail

    def _reserve_len(self) -> int:
        return self.reserve.shape[0]

    def _bootstrap(self, m: int) -> None:
        q = self.base.send_raw_cot(m, "ferret_boot")
        q[:, 0] &= ~np.uint64(1)  # LSB(v) = 0: the receiver's choice bit is LSB(w) (module doc)
        self.reserve = np.concatenate([self.reserve, q])

    def _iterate(self, P: LPNParams, serve: bool) -> None:
        """One iteration in two halves around the message: the public LPN seed goes
        out first (the receiver starts its LPN encoding at once), then the GGM
        trees and their message (the receiver's tree half), then this party's own
        LPN encoding, which overlaps the receiver's work."""
        ahead, self._ahead = self._ahead, None
        announced, self._next_seed = self._next_seed, None
        main = P is FERRET_MAIN and serve
        if ahead is not None:
            ahead.job.join()
            if not (ahead.P is P and ahead.reserve is self.reserve and main
                    and (ahead.it, ahead.tw) == (self.iterations, self.ggm_tweak)):
                ahead = None  # not the iteration due now (cannot happen in the main phase): redo
        chan = self.base.chan
        # the next main iteration's public seed, announced with this one's message
        extra = {"next": np.frombuffer(secrets.token_bytes(16), np.uint8)} if main else {}
        if ahead is not None:
            it, _ = self._next_iteration(P)
            chan.send({"op": "ferret_seed", "it": it, "n": P.n, "seed": np.frombuffer(ahead.seed, np.uint8)})
            chan.send({"op": "ferret", "it": it, "n": P.n, "msg": np.frombuffer(ahead.job.result, np.uint8), **extra})
            v = ahead.v
        else:
            it, tw = self._next_iteration(P)
            # public LPN matrix seed, fresh per iteration (the one announced, if any)
            seed = announced if (announced is not None and main) else secrets.token_bytes(16)
            chan.send({"op": "ferret_seed", "it": it, "n": P.n, "seed": np.frombuffer(seed, np.uint8)})
            base, v = self._iteration_buffers(P)
            vb = v.view(np.uint8).reshape(-1)
            msg = _core.ferret_sender_trees(self.delta, base, P.n, P.k, P.t, P.h, tw, vb)
            chan.send({"op": "ferret", "it": it, "n": P.n, "msg": np.frombuffer(msg, np.uint8), **extra})
            _core.ferret_sender_lpn(base, P.n, P.k, P.t, P.h, seed, vb)
        self._absorb(P, v, serve)
        if main:
            self._next_seed = extra["next"].tobytes()
            if self.ahead and self.reserve.shape[0] >= P.base:
                self._ahead = _Ahead(self, P, self._next_seed)

    def _iteration_buffers(self, P: LPNParams) -> tuple[np.ndarray, np.ndarray]:
        """An iteration's inputs and output: the base COTs' bytes (the first P.base rows of
        the reserve) and the (n, 2) array v is written into (a spare one when the pool has it)."""
        base = np.ascontiguousarray(self.reserve[:P.base]).view(np.uint8).reshape(-1)
        return base, self.pool.array((P.n, 2), lambda: _rows(P.n))

    def _absorb(self, P: LPNParams, out: np.ndarray, serve: bool) -> None:
        rest = self.reserve[P.base:]
        if not serve:
            self.reserve = np.concatenate([rest, out])
            return
        need = max(0, P.base - rest.shape[0])
        self.reserve = np.concatenate([rest, out[:need]])
        self.pool.push(out[need:], owners=(out,))

    def take(self, m: int) -> np.ndarray:
        """m random COTs v (m, 2) uint64 (a fresh array); refills as needed
        (which sends Ferret messages to the peer)."""
        (v,) = self._take(m, [np.empty((0, 2), np.uint64)])
        return v


class FerretReceiver(_FerretSide):
    """The choice-bit holder of one direction (the IKNP extension receiver).

    ``ahead`` (default True): when the sender announces the next main iteration's seed,
    encode this side's LPN half of it in a background thread (`_ReceiverAhead`); same
    messages, same outputs."""

    ahead = True

    def __init__(self, base, main_after: int = MAIN_AFTER):
        super().__init__(base, main_after)
        base.receiver_setup()
        self.reserve_u = np.empty(0, np.uint8)
        self.reserve_w = np.empty((0, 2), np.uint64)
        self.pool = _Fifo()
        self._ahead: _ReceiverAhead | None = None

    def _avail(self) -> int:
        return self.pool.avail

    def _reserve_len(self) -> int:
        return self.reserve_u.shape[0]

    def _bootstrap(self, m: int) -> None:
        c = random_choices(m).astype(np.uint8)
        w = self.base.recv_raw_cot(c, "ferret_boot")
        w[:, 0] = (w[:, 0] & ~np.uint64(1)) | c  # the peer cleared LSB(v); LSB(Delta) = 1
        self.reserve_u = np.concatenate([self.reserve_u, c])
        self.reserve_w = np.concatenate([self.reserve_w, w])

    def _iterate(self, P: LPNParams, serve: bool) -> None:
        """The LPN half as soon as the public seed is in (while the sender builds
        its trees), then the trees from the sender's message."""
        it, tw = self._next_iteration(P)
        chan = self.base.chan
        seed = expect(chan, "ferret_seed", {"seed": 16}, it=it, n=P.n)["seed"]
        ahead, self._ahead = self._ahead, None
        try:
            if ahead is not None:
                ahead.job.join()
                if not ahead.matches(self, P, it, seed):
                    ahead = None  # not the iteration due now: encode it here
            bu, bw, u, w = (ahead.bu, ahead.bw, ahead.u, ahead.w) if ahead is not None else self._iteration_buffers(P)
            wb = w.view(np.uint8).reshape(-1)
            if ahead is None:
                _core.ferret_receiver_lpn(bu, bw, P.n, P.k, P.t, P.h, seed, u, wb, lsb=True)
            fmsg = expect(chan, "ferret", {"msg": P.msg_len}, it=it, n=P.n)
            nxt = _next_seed(fmsg)
            _core.ferret_receiver_trees(bu, bw, P.n, P.k, P.t, P.h, tw, fmsg["msg"], u, wb, lsb=True)
        except OTError:
            raise
        except ValueError as e:
            raise OTError(f"Ferret: {e}") from e
        rest_u, rest_w = self.reserve_u[P.base:], self.reserve_w[P.base:]
        if not serve:
            self.reserve_u = np.concatenate([rest_u, u])
            self.reserve_w = np.concatenate([rest_w, w])
            return
        need = max(0, P.base - rest_u.shape[0])
        self.reserve_u = np.concatenate([rest_u, u[:need]])
        self.reserve_w = np.concatenate([rest_w, w[:need]])
        self.pool.push(u[need:], w[need:], owners=(u, w))
        if self.ahead and nxt is not None and P is FERRET_MAIN and self.reserve_u.shape[0] >= P.base:
            self._ahead = _ReceiverAhead(self, P, nxt)

    def _iteration_buffers(self, P: LPNParams) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """An iteration's inputs and outputs: the base choice bits and rows' bytes (the first
        P.base of the reserve) and the arrays u (n,) and w (n, 2) are written into (spare ones
        when the pool has them)."""
        bu = np.ascontiguousarray(self.reserve_u[:P.base])
        bw = np.ascontiguousarray(self.reserve_w[:P.base]).view(np.uint8).reshape(-1)
        u = self.pool.array((P.n,), lambda: np.empty(P.n, np.uint8))
        return bu, bw, u, self.pool.array((P.n, 2), lambda: _rows(P.n))

    def take(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """m random COTs: (u (m,) uint8 0/1, w (m, 2) uint64), fresh arrays."""
        u, w = self._take(m, [np.empty(0, np.uint8), np.empty((0, 2), np.uint64)])
        return u, w

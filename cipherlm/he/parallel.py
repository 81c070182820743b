"""Parallel server-side ``apply`` of the offload ct x pt MatMul over worker processes.

The offload server (``fhe_offload_llama_003``, sections 4-5) spends its time in
:func:`cipherlm.he.matmul.apply` (BSGS, ``blb_004``).  SEAL (tenseal.sealapi)
never releases the GIL, so the work is spread over W worker *processes*
(``spawn`` context: no SEAL object crosses a fork).

Split of the work.  A plan's work is a list of *units* (o, i): giant step i of
output block o (up to g multiply_plain + adds on the baby steps, then one
giant-step rotation when i > 0).  The units, in (o, i) order, are cut into W
contiguous parts of about equal modelled cost (:func:`split_units`); worker w
holds the NTT plaintexts of its part only (it encodes them itself at start-up,
in parallel with the others, so memory stays about that of one process).  So
for plans with many output blocks whole blocks go to workers, and for a single
block the giant-step range is split.  Each worker deserialises the input,
computes the baby steps rot(x, j) it needs itself (measured: a rotation costs
1.4 ms, shipping a 2-prime ciphertext save + load ~1 ms plus a round trip, so
recomputing is about as fast and much simpler), sums its units per block,
rescales, sums the input chunks of its partial (the server-side chunk sum of
:func:`~cipherlm.he.matmul.evaluate_blocks`: linear, so partials summed apart
still add up; the parent holds no Galois keys) and returns one-prime ciphertexts.  A block cut between two workers
comes back as two rescaled partials that the parent adds (the extra rescale
rounding is ~2^-45 relative, far below the error bound).  The result bytes are
exactly the format of :func:`~cipherlm.he.matmul.apply`.

Because every worker repeats the g-1 baby steps, plans for a pool should be
made with ``plan_matmul(..., workers=W)`` (fewer baby steps, more giant steps).

Sessions: a session's Galois keys (bytes) are loaded once per worker under a
session id (:meth:`ApplyPool.open_session`) and dropped by
:meth:`ApplyPool.close_session` (or when the :class:`PoolSession` handle is
garbage collected).  The pool is thread-safe: one request in flight per
worker pipe (a lock per worker, taken in worker order, released as soon as
that worker answered, so concurrent requests pipeline).

Robustness: a worker that dies or does not answer within the timeout makes
the call raise :class:`HEError` (never a hang) and marks the pool broken (later
calls raise at once); an exception inside a worker is returned as HEError and
the pool stays usable.  Workers poll their pipe and exit when the parent is
gone.  ``close()`` (or ``with ApplyPool(...)``) shuts them down.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Sequence

import numpy as np

from . import serialize
from .context import HEContext
from .errors import HEError
from .matmul import (
    CostModel,
    HEOpCounter,
    MatmulPlan,
    _count,
    encode_matrix,
    offload_costs,
    evaluate_blocks,
    load_galois_keys,
    pack_cts,
)
from .params import HEParams

_OPS = ("rotations", "multiply_plain", "add", "rescale", "encode")


def default_workers() -> int:
    """min(2, cpu count): the target machine has 2 cores."""
    return max(1, min(2, os.cpu_count() or 1))


# --------------------------------------------------------------------------- split


def split_units(plan: MatmulPlan, workers: int, cm: CostModel | None = None) -> list[list[tuple[int, int]]]:
    """Cut the (block, giant step) units into <= ``workers`` contiguous parts of
    about equal modelled cost; parts are non-empty (fewer than ``workers`` when
    there are fewer units).  ``cm``: default the HE backend's offload constants
    (`he.matmul.offload_costs`)."""
    cm = offload_costs(cm)
    p = plan
    units, costs = [], []
    for o in range(p.n_blocks):
        for i in range(p.b):
            if i * p.g >= p.m:
                break
            units.append((o, i))
            costs.append(min(p.g, p.m - i * p.g) * (cm.multiply_plain + cm.add) + (cm.rotate if i else 0.0))
    k = max(1, min(workers, len(units)))
    cum = np.cumsum(costs)
    total = float(cum[-1])
    parts, start = [], 0
    for w in range(1, k):
        cut = int(np.searchsorted(cum, total * w / k, side="left")) + 1
        cut = min(max(cut, start + 1), len(units) - (k - w))  # non-empty parts
        parts.append(units[start:cut])
        start = cut
    parts.append(units[start:])
    return parts


# --------------------------------------------------------------------------- worker side


@dataclasses.dataclass
class _Share:
    enc: object  # EncodedMatrix with only this worker's plaintexts
    blocks: list[tuple[int, list[int]]]  # (o, [i, ...]) in order
    g_needed: int  # baby steps j < g_needed are used


def _make_share(ctx: HEContext, plan: MatmulPlan, W, b, units) -> _Share:
    mine = set()
    for o, i in units:
        for k in range(i * plan.g, min((i + 1) * plan.g, plan.m)):
            mine.add((o, k))
    enc = encode_matrix(ctx, W, b, plan=plan, keep=lambda o, k: (o, k) in mine)
    blocks: list[tuple[int, list[int]]] = []
    for o, i in units:
        if blocks and blocks[-1][0] == o:
            blocks[-1][1].append(i)
        else:
            blocks.append((o, [i]))
    g_needed = max(min(plan.g, plan.m - i * plan.g) for _, i in units)
    return _Share(enc, blocks, g_needed)


def _apply_share(ctx: HEContext, share: _Share, ct_bytes: bytes, gk) -> tuple[list[tuple[int, bytes]], dict]:
    """This worker's part of matmul.apply: per touched block, the rescaled partial sum."""
    t0 = time.perf_counter()
    out, n = evaluate_blocks(share.enc, ct_bytes, gk, share.blocks, share.g_needed)
    n = dict.fromkeys(_OPS, 0) | n
    n["seconds"] = time.perf_counter() - t0
    return out, n


def _worker_main(conn, params_blob: bytes, parent_pid: int) -> None:  # pragma: no cover - runs in a child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes us
    ctx = HEContext(serialize.params_from_bytes(params_blob))
    shares: dict[int, _Share] = {}
    sessions: dict[str, object] = {}
    while True:
        try:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    return  # parent died
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        op = msg[0]
        try:
            if op == "close":
                conn.send(("ok", None))
                return
            if op == "add":
                _, gid, plan_d, W, b, units = msg
                share = _make_share(ctx, MatmulPlan.from_dict(plan_d), W, b, units)
                shares[gid] = share
                res = (share.enc.n_plaintexts, share.enc.nbytes)
            elif op == "open":
                _, sid, blob = msg
                plans = [s.enc.plan for s in shares.values()]
                sessions[sid] = load_galois_keys(ctx, blob, plans)
                res = None
            elif op == "drop":
                for sid in msg[1]:
                    sessions.pop(sid, None)
                res = None
            elif op == "apply":
                _, gid, sid, ct = msg
                if sid not in sessions:
                    raise HEError("unknown or closed session")
                res = _apply_share(ctx, shares[gid], ct, sessions[sid])
            elif op == "crash":  # tests only: die without answering
                os._exit(3)
            else:
                raise HEError(f"unknown pool request {op!r}")
            conn.send(("ok", res))
        except Exception as e:  # report, stay alive
            try:
                conn.send(("err", f"{type(e).__name__}: {e}" if not isinstance(e, HEError) else str(e)))
            except (OSError, ValueError):
                return


# --------------------------------------------------------------------------- parent side


class PoolSession:
    """Handle of one session's keys in the pool; dropping it releases the keys."""

    def __init__(self, pool: ApplyPool, sid: str):
        self.pool = pool
        self.sid = sid
        self._fin = weakref.finalize(self, pool._defer_drop, sid)

    def close(self) -> None:
        if self._fin.alive:
            self._fin.detach()
            self.pool.close_session(self.sid)


@dataclasses.dataclass
class _Group:
    plan: MatmulPlan
    workers: list[int]  # workers holding a share (index into pool)
    n_plaintexts: int = 0
    nbytes: int = 0


class ApplyPool:
    """W worker processes, each holding a share of every encoded matrix.

    Usage (server)::

        with ApplyPool(params, workers=2) as pool:
            pool.add_matrix(gid, [Wq, Wk, Wv], [bq, bk, bv], plan)   # at start-up
            sess = pool.open_session(galois_keys_bytes)                # per session
            out = pool.apply(gid, ct_bytes, sess, counter)             # = matmul.apply bytes
            sess.close()                                               # session ends
    """

    def __init__(
        self,
        params: HEParams,
        workers: int | None = None,
        *,
        timeout: float = 300.0,
        cost_model: CostModel | None = None,
        serial: bool = False,
    ):
        """``serial``: measurement only -- ask the workers one after another, so that
        each share is timed without contention (``last_worker_seconds``) on a
        machine that lacks W free cores; the projected parallel latency is then
        wall - sum(worker seconds) + max(worker seconds)."""
        self.n_workers = default_workers() if workers is None else int(workers)
        if self.n_workers < 1:
            raise HEError("workers must be >= 1")
        self.params = params
        self.ctx = HEContext(params)
        self.timeout = timeout
        self.cost_model = offload_costs(cost_model)  # the HE backend's offload constants by default
        self.serial = serial
        self.groups: dict[int, _Group] = {}
        #: cumulative op counts of each worker
        self.worker_counters = [HEOpCounter() for _ in range(self.n_workers)]
        #: seconds each worker spent in its share of the last apply
        self.last_worker_seconds = [0.0] * self.n_workers
        self._broken: str | None = None
        self._closed = False
        self._locks = [threading.Lock() for _ in range(self.n_workers)]
        self._state_lock = threading.Lock()
        self._pending_drops: deque[str] = deque()
        mpc = mp.get_context("spawn")
        blob = serialize.params_to_bytes(params)
        self._conns, self._procs = [], []
        try:
            for w in range(self.n_workers):
                parent_end, child_end = mpc.Pipe(duplex=True)
                proc = mpc.Process(
                    target=_worker_main, args=(child_end, blob, os.getpid()), name=f"cipherlm-he-{w}", daemon=True
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
        except Exception:
            self._terminate()
            raise

    # ------------------------------------------------------------ plumbing
    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _check(self) -> None:
        if self._closed:
            raise HEError("HE worker pool is closed")
        if self._broken:
            raise HEError(f"HE worker pool is broken: {self._broken}")

    def _fail(self, why: str) -> HEError:
        with self._state_lock:
            if not self._broken:
                self._broken = why
        self._terminate()
        return HEError(f"HE worker pool is broken: {why}")

    def _recv(self, w: int, timeout: float | None):
        conn, proc = self._conns[w], self._procs[w]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if conn.poll(0.2):
                    return conn.recv()
            except (EOFError, OSError):
                proc.join(1.0)
                raise self._fail(f"worker {w} (pid {proc.pid}) died, exit code {proc.exitcode}") from None
            if not proc.is_alive():
                raise self._fail(f"worker {w} (pid {proc.pid}) died, exit code {proc.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail(f"worker {w} (pid {proc.pid}) did not answer within {timeout:.0f} s")

    def _call(self, msgs: dict[int, tuple], timeout: float | None) -> dict[int, object]:
        """Send msgs[w] to each worker w (locks in worker order), collect the answers."""
        if self.serial and len(msgs) > 1:
            out: dict[int, object] = {}
            for w in sorted(msgs):
                out.update(self._call({w: msgs[w]}, timeout))
            return out
        self._check()
        order = sorted(msgs)
        drops = self._take_drops()
        got: dict[int, tuple] = {}
        held: list[int] = []
        try:
            for w in order:
                self._locks[w].acquire()
                held.append(w)
                self._check()
                try:
                    if drops:
                        self._conns[w].send(("drop", drops))
                        self._expect_ok(w, timeout)
                    self._conns[w].send(msgs[w])
                except (OSError, ValueError) as e:
                    proc = self._procs[w]
                    proc.join(1.0)
                    why = f"died, exit code {proc.exitcode}" if not proc.is_alive() else f"pipe error: {e}"
                    raise self._fail(f"worker {w} (pid {proc.pid}) {why}") from None
            for w in order:
                got[w] = self._recv(w, timeout)
                self._locks[w].release()
                held.remove(w)
        finally:
            for w in held:
                self._locks[w].release()
        if drops and len(order) < self.n_workers:  # workers not addressed here still need them
            with self._state_lock:
                self._pending_drops.extend(drops)
        errs = [f"worker {w}: {r[1]}" for w, r in got.items() if r[0] != "ok"]
        if errs:
            raise HEError("; ".join(errs))
        return {w: r[1] for w, r in got.items()}

    def _expect_ok(self, w: int, timeout: float | None) -> None:
        r = self._recv(w, timeout)
        if r[0] != "ok":
            raise HEError(f"worker {w}: {r[1]}")

    def _take_drops(self) -> list[str]:
        with self._state_lock:
            out = list(self._pending_drops)
            self._pending_drops.clear()
        return out

    def _defer_drop(self, sid: str) -> None:
        # called from a finalizer (any thread, inside GC): never take a worker lock here
        self._pending_drops.append(sid)

    # ------------------------------------------------------------ API
    def add_matrix(
        self,
        gid: int,
        Ws: Sequence[np.ndarray],
        bs: Sequence[np.ndarray | None] | None,
        plan: MatmulPlan,
        *,
        timeout: float | None = None,
    ) -> None:
        """Encode group ``gid`` (members sharing one input, stacked as in encode_group):
        each worker encodes its share, all at once."""
        W = np.concatenate([np.asarray(w, dtype=np.float32) for w in Ws], axis=0)
        b = None
        if bs is not None and any(x is not None for x in bs):
            b = np.concatenate([np.zeros(w.shape[0]) if x is None else np.asarray(x).reshape(-1) for w, x in zip(Ws, bs)])
        if plan.slots != self.ctx.slots or (plan.d_out, plan.d_in, plan.has_bias) != (W.shape[0], W.shape[1], b is not None):
            raise HEError("plan does not match the matrix")
        parts = split_units(plan, self.n_workers, self.cost_model)
        msgs = {w: ("add", gid, plan.to_dict(), W, b, part) for w, part in enumerate(parts)}
        res = self._call(msgs, timeout)
        self.groups[gid] = _Group(
            plan, sorted(msgs), sum(r[0] for r in res.values()), sum(r[1] for r in res.values())
        )
        for w in res:
            self.worker_counters[w].encode += res[w][0]

    @property
    def plaintext_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups.values())

    @property
    def n_plaintexts(self) -> int:
        return sum(g.n_plaintexts for g in self.groups.values())

    def open_session(self, galois_keys: bytes, session_id: str | None = None) -> PoolSession:
        """Load a session's Galois keys in every worker (checked against all plans)."""
        if not isinstance(galois_keys, (bytes, bytearray)):
            raise HEError("galois_keys must be bytes")
        sid = session_id or uuid.uuid4().hex
        try:
            self._call({w: ("open", sid, bytes(galois_keys)) for w in range(self.n_workers)}, self.timeout)
        except HEError:
            if not self._broken:
                self._defer_drop(sid)
            raise
        return PoolSession(self, sid)

    def close_session(self, session) -> None:
        """Drop a session's keys from every worker (idempotent)."""
        sid = session.sid if isinstance(session, PoolSession) else session
        if isinstance(session, PoolSession) and session._fin.alive:
            session._fin.detach()
        if self._closed or self._broken:
            return
        self._call({w: ("drop", [sid]) for w in range(self.n_workers)}, self.timeout)

    def apply(
        self,
        gid: int,
        ct_bytes: bytes,
        session: PoolSession | str,
        counter: HEOpCounter | None = None,
        *,
        timeout: float | None = -1.0,
    ) -> bytes:
        """Same result format as :func:`cipherlm.he.matmul.apply`; op counts of all
        workers (and the parent's combining adds) go to ``counter``."""
        t0 = time.perf_counter()
        if not isinstance(ct_bytes, (bytes, bytearray)):
            raise HEError("a ciphertext must be bytes")
        g = self.groups.get(gid)
        if g is None:
            raise HEError(f"unknown matrix group {gid}")
        sid = session.sid if isinstance(session, PoolSession) else session
        res = self._call({w: ("apply", gid, sid, bytes(ct_bytes)) for w in g.workers}, self.timeout if timeout == -1.0 else timeout)
        pieces: list[list[bytes]] = [[] for _ in range(g.plan.n_blocks)]
        total = dict.fromkeys(_OPS, 0)
        for w in sorted(res):
            out, n = res[w]
            n = dict(n)
            secs = n.pop("seconds", 0.0)
            self.worker_counters[w].server_seconds += secs
            self.last_worker_seconds[w] = secs
            for o, blob in out:
                pieces[o].append(blob)
            wc = self.worker_counters[w]
            for k, v in n.items():
                total[k] += v
                setattr(wc, k, getattr(wc, k) + v)
        blobs = []
        ev = self.ctx.evaluator
        for ps in pieces:
            ps = [p for p in ps if p]
            if len(ps) <= 1:
                blobs.append(ps[0] if ps else b"")
                continue
            acc = serialize.ciphertext_from_bytes(self.ctx, ps[0], n_primes=1)
            for p in ps[1:]:
                ev.add_inplace(acc, serialize.ciphertext_from_bytes(self.ctx, p, n_primes=1))
                total["add"] += 1
            blobs.append(serialize.ciphertext_to_bytes(acc))
        data = pack_cts(blobs)
        total.pop("encode")
        _count(counter, **total, server_seconds=time.perf_counter() - t0)
        return data

    def crash_worker_for_test(self, w: int) -> None:
        """Tests: make worker w exit without answering."""
        with self._locks[w]:
            self._conns[w].send(("crash",))

    # ------------------------------------------------------------ shutdown
    def _terminate(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass

    def close(self, timeout: float = 5.0) -> None:
        """Ask the workers to exit, then terminate any that do not."""
        if self._closed:
            return
        self._closed = True
        if not self._broken:
            for w, (c, p) in enumerate(zip(self._conns, self._procs)):
                if self._locks[w].acquire(timeout=timeout):
                    try:
                        c.send(("close",))
                    except (OSError, ValueError):
                        pass
                    finally:
                        self._locks[w].release()
            deadline = time.monotonic() + timeout
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._terminate()

    def __enter__(self) -> ApplyPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; close() is the API
        try:
            if not self._closed:
                self._terminate()
        except Exception:
            pass


__all__ = ["ApplyPool", "PoolSession", "default_workers", "split_units"]

"""Run a two-party computation: in one process (two threads over `inprocess_pair`)
or as two OS processes over TCP on 127.0.0.1 (multiprocessing, spawn).

A party function has the signature ``fn(ctx: Context, *args) -> result``; pass
one function for both parties (it branches on ``ctx.party``) or one per party.
Both runners return ``(result0, result1)`` (with ``stats=True`` also each
party's channel counters ``(totals0, totals1)``, see `Channel.totals`).

Failure handling: an exception in one party closes that party's channel, so
the peer fails fast with `ChannelClosed` instead of waiting; the caller gets a
`PartyFailed` naming the party whose error came first (the root cause) with
its traceback.  A run that does not finish within ``timeout`` seconds is torn
down (channels closed / processes terminated) and raises `MPCTimeout`.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import traceback
from typing import Any, Callable

from .context import Context, MPCError
from .ring import RingConfig


class PartyFailed(MPCError):
    """A party raised; ``party`` and ``remote_traceback`` tell which and where."""

    def __init__(self, party: int, summary: str, tb: str):
        super().__init__(f"party {party} failed: {summary}\n--- party {party} traceback ---\n{tb}")
        self.party = party
        self.summary = summary
        self.remote_traceback = tb


class MPCTimeout(MPCError, TimeoutError):
    """The two-party run did not finish in time."""


def _is_secondary(summary: str) -> bool:
    # A ChannelClosed in one party is usually the echo of the other party's failure.
    return summary.startswith("ChannelClosed")


def _pick_failure(failures: list[tuple[int, str, str]]) -> PartyFailed:
    primary = [f for f in failures if not _is_secondary(f[1])] or failures
    return PartyFailed(*primary[0])


def run_inprocess(fn0: Callable, fn1: Callable | None = None, args0: tuple = (), args1: tuple = (), *,
                  ring: RingConfig | None = None, ot_factory: Callable | None = None,
                  timeout: float = 120.0, chan_timeout: float | None = None, stats: bool = False):
    """Run the two parties as two threads of this process."""
    from ..net import inprocess_pair

    fns = (fn0, fn1 or fn0)
    args = (tuple(args0), tuple(args1))
    chans = inprocess_pair(timeout=chan_timeout if chan_timeout is not None else timeout)
    results: list[Any] = [None, None]
    failures: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def body(p):
        try:
            ctx = Context(chans[p], p, ring, ot_factory=ot_factory)
            results[p] = fns[p](ctx, *args[p])
        except BaseException as e:  # reported to the caller
            with lock:
                failures.append((p, f"{type(e).__name__}: {e}", traceback.format_exc()))
            chans[p].close()

    threads = [threading.Thread(target=body, args=(p,), daemon=True, name=f"mpc-party{p}") for p in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        with lock:
            earlier = list(failures)  # failures after the forced close are its echo
        for c in chans:
            c.close()
        for t in threads:
            t.join(5)
        if earlier:
            raise _pick_failure(earlier)
        raise MPCTimeout(f"two-party run did not finish within {timeout} s")
    totals = (chans[0].totals(), chans[1].totals())
    for c in chans:
        c.close()
    if failures:
        raise _pick_failure(failures)
    return (results[0], results[1], totals) if stats else (results[0], results[1])


def _proc_main(party, fn, args, ring, ot_factory, timeout, port_q, result_q, port):
    from ..net import TCPChannel, listen

    chan = None
    try:
        if party == 0:
            srv = listen("127.0.0.1", 0)
            port_q.put(srv.getsockname()[1])
            try:
                chan = TCPChannel.accept(srv, timeout=timeout, accept_timeout=timeout)
            finally:
                srv.close()
        else:
            chan = TCPChannel.connect("127.0.0.1", port, timeout=timeout, connect_timeout=min(timeout, 30.0))
        ctx = Context(chan, party, ring, ot_factory=ot_factory)
        out = fn(ctx, *args)
        result_q.put(("ok", party, out, chan.totals()))
    except BaseException as e:  # reported to the parent
        result_q.put(("err", party, f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        if chan is not None:
            chan.close()


def run_processes(fn0: Callable, fn1: Callable | None = None, args0: tuple = (), args1: tuple = (), *,
                  ring: RingConfig | None = None, ot_factory: Callable | None = None,
                  timeout: float = 120.0, stats: bool = False):
    """Run the two parties as two spawned OS processes talking TCP over 127.0.0.1.
    Functions, arguments, results and `ot_factory` must be picklable (module-level)."""
    mctx = mp.get_context("spawn")
    port_q, result_q = mctx.Queue(), mctx.Queue()
    fns = (fn0, fn1 or fn0)
    procs = []
    deadline = time.monotonic() + timeout
    try:
        p0 = mctx.Process(target=_proc_main, args=(0, fns[0], tuple(args0), ring, ot_factory, timeout, port_q, result_q, None),
                          daemon=True, name="mpc-party0")
        p0.start()
        procs.append(p0)
        port = None
        while port is None:  # a party 0 that dies while starting must not leave us waiting
            try:
                port = port_q.get(timeout=0.5)
            except queue.Empty:
                if p0.exitcode is not None:
                    raise PartyFailed(0, f"process exited with code {p0.exitcode} before listening",
                                      "(no traceback: the process died while starting)") from None
                if time.monotonic() >= deadline:
                    raise MPCTimeout("party 0 did not start listening in time") from None
        p1 = mctx.Process(target=_proc_main, args=(1, fns[1], tuple(args1), ring, ot_factory, timeout, port_q, result_q, port),
                          daemon=True, name="mpc-party1")
        p1.start()
        procs.append(p1)
        results: dict[int, Any] = {}
        totals: dict[int, Any] = {}
        failures: list[tuple[int, str, str]] = []
        dead_since: dict[int, float] = {}
        first_failure: float | None = None
        while len(results) + len(failures) < 2:
            remaining = deadline - time.monotonic()
            if failures and first_failure is None:
                first_failure = time.monotonic()
            try:
                kind, party, a, b = result_q.get(timeout=max(0.05, min(remaining, 0.5)))
            except queue.Empty:
                now = time.monotonic()
                reported = set(results) | {f[0] for f in failures}
                # a process that died without reporting (killed, crashed interpreter)
                for q, p in enumerate(procs):
                    if p.exitcode is not None and q not in reported:
                        dead_since.setdefault(q, now)
                        if now - dead_since[q] > 1.0:
                            failures.insert(0, (q, f"process exited with code {p.exitcode} without a result",
                                                "(no traceback: the process died)"))
                if failures and first_failure is None:
                    first_failure = now
                reported = set(results) | {f[0] for f in failures}
                pending = any(q in dead_since and q not in reported for q in range(len(procs)))
                if failures and not pending:
                    if (now >= deadline or now - first_failure > 3.0 or all(p.exitcode is not None for p in procs)
                            or len(reported) == 2):
                        break
                    continue
                if failures and (now >= deadline or now - first_failure > 3.0):
                    break  # give the peer a moment to report, then stop it
                if now >= deadline:
                    raise MPCTimeout(f"two-party run did not finish within {timeout} s") from None
                continue
            if kind == "ok":
                results[party], totals[party] = a, b
            else:
                failures.append((party, a, b))
        if failures:
            raise _pick_failure(failures)
        return (results[0], results[1], (totals[0], totals[1])) if stats else (results[0], results[1])
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)

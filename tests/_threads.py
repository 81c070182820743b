"""Run callables on threads of their own (test helpers): two parties' callables, each with
its own object, or n workers; a hung thread fails the test, the first exception is raised
again in the test's thread."""

from __future__ import annotations

import threading


def run_threads(fs, join_timeout: float = 120.0) -> list:
    """Run each callable of ``fs`` on a thread of its own, at once; their results in order.
    A hung thread fails the test; the first exception is raised again here."""
    res, errs = [None] * len(fs), [None] * len(fs)

    def work(i, f):
        try:
            res[i] = f()
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errs[i] = exc

    threads = [threading.Thread(target=work, args=(i, f), daemon=True) for i, f in enumerate(fs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), "hung"
    for exc in errs:
        if exc is not None:
            raise exc
    return res


def run_pair(objs, f0, f1, join_timeout: float = 120.0) -> list:
    """f0(objs[0]) and f1(objs[1]) on two threads (two parties)."""
    return run_threads([lambda: f0(objs[0]), lambda: f1(objs[1])], join_timeout)

"""Run two parties' callables on two threads (test helper): each gets its own object,
a hung party fails the test, the first exception is raised again."""

from __future__ import annotations

import threading


def run_pair(objs, f0, f1, join_timeout: float = 120.0) -> list:
    res, errs = [None, None], [None, None]

    def work(i, f):
        try:
            res[i] = f(objs[i])
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errs[i] = exc

    threads = [threading.Thread(target=work, args=(i, f), daemon=True) for i, f in enumerate((f0, f1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), "hung"
    for exc in errs:
        if exc is not None:
            raise exc
    return res

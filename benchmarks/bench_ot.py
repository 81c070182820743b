#!/usr/bin/env python3
"""OT throughput on this machine, both parties in one process (two threads
over `inprocess_pair`, a socketpair), base OTs done beforehand and timed apart.

    .venv/bin/python benchmarks/bench_ot.py [--json reports/bench_ot.json]
        [--random 10000000] [--cot 1000000] [--one-of-n 1000000] [--chosen 1000000]

Per kind: seconds (wall clock, both parties done), OTs per second, bytes per
OT on the wire (both directions, frame headers included) against the formula
of `cipherlm.mpc.ot.bytes_per_ot`.  The native core releases the GIL, so the
two parties' Rust work runs on two cores; the two parties share this machine's
cores, so a real two-machine run has each party's compute to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from cipherlm.mpc.ot import OTSession, bytes_per_ot
from cipherlm.net.channel import inprocess_pair


def both(s0, s1, f0, f1):
    res = [None, None]
    errs = []

    def w(i, s, f):
        try:
            res[i] = f(s)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = [threading.Thread(target=w, args=(0, s0, f0)), threading.Thread(target=w, args=(1, s1, f1))]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise errs[0]
    return res, dt


def measure(name, n, s0, s1, a, b, f0, f1, formula, check):
    a.reset_stats()
    b.reset_stats()
    res, dt = both(s0, s1, f0, f1)
    tot = a.totals()
    wire = tot["bytes_sent"] + tot["bytes_received"]
    check(*res)
    row = {
        "kind": name,
        "n": n,
        "seconds": round(dt, 4),
        "ots_per_second": round(n / dt),
        "bytes_per_ot": round(wire / n, 4),
        "bytes_per_ot_formula": formula,
        "bytes_total": wire,
        "flights": tot["rounds"] + tot["flights_received"],
    }
    print(
        f"{name:28s} n={n:>9,d}  {dt:8.3f} s  {n / dt / 1e6:8.3f} M OT/s  "
        f"{wire / n:8.3f} B/OT (formula {formula:g})  flights {row['flights']}"
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="reports/bench_ot.json")
    ap.add_argument("--random", type=int, default=10_000_000)
    ap.add_argument("--cot", type=int, default=1_000_000)
    ap.add_argument("--one-of-n", type=int, default=1_000_000)
    ap.add_argument("--chosen", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1 << 16)
    args = ap.parse_args(argv)

    a, b = inprocess_pair(timeout=600)
    s0, s1 = OTSession(a, 0, batch=args.batch), OTSession(b, 1, batch=args.batch)
    rows = []

    _, dt = both(s0, s1, lambda s: s.setup(kk13=True), lambda s: s.setup(kk13=True))
    tot = a.totals()
    print(f"base OTs (2 directions x (128 + 256) Chou-Orlandi): {dt:.3f} s, {tot['bytes_sent'] + tot['bytes_received']:,} bytes")
    rows.append({"kind": "base_ot_setup", "seconds": round(dt, 4), "bytes_total": tot["bytes_sent"] + tot["bytes_received"]})

    rng = np.random.default_rng()
    if args.random:
        n = args.random

        def chk(r0, r1):
            (m0, m1), (c, mc) = r0, r1
            assert (mc[:1000] == np.where(c[:1000], m1[:1000], m0[:1000])).all()

        rows.append(
            measure(
                "random OT (64-bit)", n, s0, s1, a, b,
                lambda s: s.send_random(n, 64), lambda s: s.recv_random(None, 64, n=n),
                bytes_per_ot("random"), chk,
            )
        )
    if args.cot:
        n = args.cot
        corr = rng.integers(0, 2**64, n, dtype=np.uint64)
        c = rng.integers(0, 2, n).astype(bool)

        def chk(r, out):
            assert (out == r + c.astype(np.uint64) * corr).all()

        rows.append(
            measure(
                "arithmetic COT (64-bit)", n, s0, s1, a, b,
                lambda s: s.send_cot(corr, 64), lambda s: s.recv_cot(c, 64),
                bytes_per_ot("cot", 64), chk,
            )
        )
    if args.chosen:
        n = args.chosen
        m0 = rng.integers(0, 2**64, n, dtype=np.uint64)
        m1 = rng.integers(0, 2**64, n, dtype=np.uint64)
        c = rng.integers(0, 2, n).astype(bool)

        def chk(_, out):
            assert (out == np.where(c, m1, m0)).all()

        rows.append(
            measure(
                "chosen OT (64-bit)", n, s0, s1, a, b,
                lambda s: s.send_chosen(m0, m1, 64), lambda s: s.recv_chosen(c, 64),
                bytes_per_ot("chosen", 64), chk,
            )
        )
    if args.one_of_n:
        n = args.one_of_n
        N, bits = 16, 2
        msgs = rng.integers(0, 4, (n, N), dtype=np.uint64)
        ch = rng.integers(0, N, n)

        def chk(_, out):
            assert (out == msgs[np.arange(n), ch]).all()

        rows.append(
            measure(
                "1-of-16 OT KK13 (2-bit)", n, s0, s1, a, b,
                lambda s: s.send_1ofN(msgs, bits), lambda s: s.recv_1ofN(ch, N, bits),
                bytes_per_ot("1ofN", bits, N=N), chk,
            )
        )
    a.close()
    b.close()
    report = {
        "benchmark": "ot",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "setting": "in-process, two threads over a socketpair; base OTs excluded from the per-kind rows",
        "results": rows,
    }
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2))
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

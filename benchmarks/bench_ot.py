#!/usr/bin/env python3
"""OT throughput on this machine, both parties in one process (two threads
over `inprocess_pair`, a socketpair), base OTs done beforehand and timed apart.

    .venv/bin/python benchmarks/bench_ot.py [--json reports/bench_ot.json]
        [--rcot 20000000] [--rcot-kinds iknp,ferret]
        [--random 10000000] [--cot 1000000] [--one-of-n 1000000] [--chosen 1000000]
        [--compare OLD_ROOT [--repeat 3]] [--core-ab OLD_SO [--repeat 3]]

Random COT (``--rcot``, the issue 14 figure): ``OTSession.send_rcot`` /
``recv_rcot`` from each OT extension (`cipherlm.mpc.ot_extension`: IKNP,
Ferret), after a warm-up that runs the base OTs and (Ferret) puts the pool on
the main parameter set.  Reported: COTs per second of wall clock (each party
on its own core: "per core"), COTs per CPU-second of one party (the process's
CPU time over both parties, halved: the Ferret pools compute their next iteration in
background threads, which the session threads' own CPU times miss), and bits per COT counted through the channel (both
directions, frame headers and the Ferret refills included, base OTs not).
``--compare OLD_ROOT`` runs the random-COT rows A/B in one run: alternately
with the package under OLD_ROOT (a directory holding an older ``cipherlm/``
with its own ``_core.abi3.so``) and with this checkout, ``--repeat`` times
each, in fresh subprocesses, and prints the best and median of each.
``--core-ab OLD_SO`` times the native kernels alone, old build (a
``_core.abi3.so`` file) against this checkout's, alternately in one process
(thread CPU time): one Ferret iteration at the main parameters (sender,
receiver) and the 1-out-of-16 pads from correlated OTs (``np1ofn_*``,
2-bit messages, 1M instances).

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
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from cipherlm.mpc.ot import OTSession, bytes_per_ot
from cipherlm.net.channel import inprocess_pair


def both(s0, s1, f0, f1, cpu: list | None = None):
    """f0(s0) and f1(s1) in two threads; (results, wall seconds).  ``cpu``: receives
    each party's thread CPU seconds."""
    res = [None, None]
    errs = []
    cpu_t = [0.0, 0.0]

    def w(i, s, f):
        c0 = time.thread_time()
        try:
            res[i] = f(s)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
        cpu_t[i] = time.thread_time() - c0

    th = [threading.Thread(target=w, args=(0, s0, f0)), threading.Thread(target=w, args=(1, s1, f1))]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise errs[0]
    if cpu is not None:
        cpu[:] = cpu_t
    return res, dt


def machine_info() -> dict:
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def bench_rcot(kind: str, n: int, batch: int, chunk: int = 1 << 20) -> dict:
    """Random COTs from the `kind` extension: n of them in requests of `chunk`,
    after a warm-up (base OTs; Ferret: the pool on its main parameter set)."""
    from cipherlm.mpc.ferret import FERRET_SETUP

    a, b = inprocess_pair(timeout=600)
    s0 = OTSession(a, 0, batch=batch, ferret=kind == "ferret")
    s1 = OTSession(b, 1, batch=batch, ferret=kind == "ferret")
    warm = 2 * FERRET_SETUP.usable + 1 if kind == "ferret" else 1000
    both(s0, s1, lambda s: s.send_rcot(warm), lambda s: s.recv_rcot(warm))
    a.reset_stats()
    b.reset_stats()
    d = np.frombuffer(s0.ext.sender_delta(), np.uint64)

    def snd(s):
        last = None
        for lo in range(0, n, chunk):
            last, _ = s.send_rcot(min(chunk, n - lo))
        return last

    def rcv(s):
        last = None
        for lo in range(0, n, chunk):
            last = s.recv_rcot(min(chunk, n - lo))
        return last

    cpu = [0.0, 0.0]
    p0 = time.process_time()
    (v, (u, w)), dt = both(s0, s1, snd, rcv, cpu)
    pcpu = time.process_time() - p0  # both parties, with the Ferret pools' background threads
    np.testing.assert_array_equal(w, v ^ (u.astype(np.uint64)[:, None] * d))  # the last chunk
    tot = a.totals()
    wire = tot["bytes_sent"] + tot["bytes_received"]
    a.close()
    b.close()
    row = {
        "kind": f"random COT ({kind})",
        "extension": kind,
        "n": n,
        "seconds": round(dt, 4),
        "cots_per_second_per_core": round(n / dt),
        "cpu_seconds_sender_receiver": [round(x, 4) for x in cpu],
        "cots_per_cpu_second": round(n / max(cpu)),
        "process_cpu_seconds": round(pcpu, 4),
        "cots_per_party_cpu_second": round(2 * n / pcpu),
        "bits_per_cot": round(8 * wire / n, 4),
        "bytes_total": wire,
    }
    print(
        f"random COT {kind:7s} n={n:>11,d}  {dt:7.3f} s  {n / dt / 1e6:7.2f} M COT/s per core (wall)  "
        f"{2 * n / pcpu / 1e6:7.2f} M/CPU-s per party (process {pcpu:.2f} s: session threads s/r {cpu[0]:.2f}/{cpu[1]:.2f}"
        f" + background)  {8 * wire / n:8.4f} bits/COT"
    )
    return row


def _load_core(path: str):
    """A build of the native core from a file, as its own module object."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("_core", path)
    spec = importlib.util.spec_from_file_location("_core", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def core_ab(old_so: str, repeat: int) -> list[dict]:
    """Native kernels, old build vs this checkout's, alternating, thread CPU seconds (best of `repeat`)."""
    from cipherlm import _core as new
    from cipherlm.mpc.ferret import FERRET_MAIN as P

    builds = {"before": _load_core(str(Path(old_so).resolve())), "after": new}
    rng = np.random.default_rng(5)
    delta = rng.bytes(16)
    d64 = np.frombuffer(delta, np.uint64)
    v = rng.integers(0, 2**64, (P.base, 2), dtype=np.uint64)
    u = rng.integers(0, 2, P.base).astype(np.uint8)
    w = v ^ (u.astype(np.uint64)[:, None] * d64)
    seed = rng.bytes(16)
    n1, N, m = 1 << 20, 16, 4
    q = rng.integers(0, 2**64, (n1 * m, 2), dtype=np.uint64)
    ch = rng.integers(0, N, n1).astype(np.uint8)
    cb = ((ch[:, None] >> np.arange(m, dtype=np.uint8)) & 1).reshape(-1).astype(np.uint64)
    t = q ^ (cb[:, None] * d64)
    msgs = rng.integers(0, 4, (n1, N), dtype=np.uint64)
    best: dict = {}
    outs = (np.empty(P.n * 16 + 16, np.uint8), np.empty(P.n, np.uint8), np.empty(P.n * 16 + 16, np.uint8))
    al = [o[(-o.ctypes.data) % 16:][:P.n * 16] if o.size > P.n else o for o in outs]

    def kw(core, *names):
        """Every build that can writes into reused arrays (as the Ferret pools do); one
        that cannot allocates its outputs (and pays for their page faults)."""
        has_out = "out" in (getattr(core.ferret_sender, "__text_signature__", None) or "")
        return dict(zip(names, [al[0]] if len(names) == 1 else al[1:])) if has_out else {}

    def timed(key, f):
        c0 = time.thread_time()
        r = f()
        dt = time.thread_time() - c0
        best[key] = min(best.get(key, dt), dt)
        return r

    for _ in range(repeat):
        for label, core in builds.items():
            msg, vo = timed((label, "ferret_sender"), lambda: core.ferret_sender(
                delta, v.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 1 << 62, **kw(core, "out")))
            uo, wo = timed((label, "ferret_receiver"), lambda: core.ferret_receiver(
                u, w.view(np.uint8).reshape(-1), P.n, P.k, P.t, P.h, seed, 1 << 62, msg, **kw(core, "out_u", "out_w")))
            vv = np.frombuffer(vo, np.uint64).reshape(-1, 2)
            ww = np.frombuffer(wo, np.uint64).reshape(-1, 2)
            uu = np.frombuffer(uo, np.uint8)
            assert (ww[:1000] == vv[:1000] ^ (uu[:1000].astype(np.uint64)[:, None] * d64)).all()
            del vo, wo, vv, ww
            y = timed((label, "np1ofn_sender (1-of-16, 1M)"), lambda: core.np1ofn_sender(
                q.view(np.uint8).reshape(-1), delta, 7, N, msgs.view(np.uint8).reshape(-1), 2))
            got = timed((label, "np1ofn_receiver (1-of-16, 1M)"), lambda: core.np1ofn_receiver(
                t.view(np.uint8).reshape(-1), ch, 7, N, y, 2))
            assert (np.frombuffer(got, np.uint64) == msgs[np.arange(n1), ch]).all()
    rows = []
    print(f"\nnative kernels, thread CPU seconds, best of {repeat} (before = {old_so})")
    for kernel in dict.fromkeys(k for _, k in best):
        b, a = best[("before", kernel)], best[("after", kernel)]
        rows.append({"kernel": kernel, "before_s": round(b, 4), "after_s": round(a, 4), "speedup": round(b / a, 2)})
        print(f"  {kernel:32s} before {b:7.3f} s   after {a:7.3f} s   x{b / a:5.2f}")
    return rows


def compare(old_root: str, argv: list[str], repeat: int) -> list[dict]:
    """A/B in one run: the random-COT rows alternately under OLD_ROOT's package and this checkout."""
    here = str(Path(__file__).resolve().parents[1])
    roots = {"before": str(Path(old_root).resolve()), "after": here}
    runs: dict[str, list] = {"before": [], "after": []}
    for r in range(repeat):
        for label, root in roots.items():
            env = {**os.environ, "PYTHONPATH": root}
            out = subprocess.run([sys.executable, __file__, *argv, "--json", "-", "--random", "0", "--cot", "0",
                                  "--chosen", "0", "--one-of-n", "0"], env=env, cwd=root,
                                 capture_output=True, text=True, check=True)
            rep = json.loads(out.stdout.split("JSON:", 1)[1])
            assert rep["core"].startswith(root), (rep["core"], root)
            runs[label].append(rep)
            print(f"[{label} #{r + 1}] " + "; ".join(
                f"{x['extension']}: {x['cots_per_second_per_core'] / 1e6:.2f} M/s, {x['bits_per_cot']:.3f} bits"
                for x in rep["results"] if "extension" in x), flush=True)
    summary = []
    for label, reps in runs.items():
        for kind in sorted({x["extension"] for rep in reps for x in rep["results"] if "extension" in x}):
            rows = [x for rep in reps for x in rep["results"] if x.get("extension") == kind]
            rates = [x["cots_per_second_per_core"] for x in rows]
            # per party-CPU-second over the whole process where the run has it (background
            # threads included); older trees report the session threads' CPU only
            cpu_rates = [x.get("cots_per_party_cpu_second", x["cots_per_cpu_second"]) for x in rows]
            summary.append({
                "version": label, "extension": kind, "runs": len(rows),
                "best_cots_per_second_per_core": max(rates),
                "median_cots_per_second_per_core": round(statistics.median(rates)),
                "best_cots_per_cpu_second": max(cpu_rates),
                "bits_per_cot": [x["bits_per_cot"] for x in rows],
            })
    print(f"\nA/B ({repeat} alternating runs each; before = {roots['before']})")
    for row in summary:
        print(f"  {row['version']:6s} {row['extension']:7s} best {row['best_cots_per_second_per_core'] / 1e6:7.2f} M COT/s "
              f"per core, median {row['median_cots_per_second_per_core'] / 1e6:7.2f}, best "
              f"{row['best_cots_per_cpu_second'] / 1e6:7.2f} M/CPU-s, bits/COT {row['bits_per_cot']}")
    return summary


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
    ap.add_argument("--rcot", type=int, default=20_000_000, help="random COTs per extension (0: skip)")
    ap.add_argument("--rcot-kinds", default="iknp,ferret")
    ap.add_argument("--compare", metavar="OLD_ROOT", help="A/B the random-COT rows against the package under OLD_ROOT")
    ap.add_argument("--core-ab", metavar="OLD_SO", help="A/B the native kernels against an older _core.abi3.so")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    info = machine_info()
    print(f"machine: {info['nproc']} CPUs ({info['cpu']}), load average {info['load_average']}, {info['date']}")
    print(f"command: {info['command']}")

    if args.core_ab:
        rows = core_ab(args.core_ab, args.repeat)
        report = {"benchmark": "ot_core_ab", "machine": info,
                  "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "kernels": rows}
        if args.json and args.json != "-":
            p = Path(args.json)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(report, indent=2))
            print(f"wrote {p}")
        return 0

    if args.compare:
        sub = ["--rcot", str(args.rcot), "--rcot-kinds", args.rcot_kinds, "--batch", str(args.batch)]
        summary = compare(args.compare, sub, args.repeat)
        report = {"benchmark": "ot_ab", "machine": info, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                  "before": str(Path(args.compare).resolve()), "summary": summary}
        if args.json and args.json != "-":
            p = Path(args.json)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(report, indent=2))
            print(f"wrote {p}")
        return 0

    rows = []
    for kind in [k for k in args.rcot_kinds.split(",") if k] if args.rcot else ():
        rows.append(bench_rcot(kind, args.rcot, args.batch))
    if not (args.random or args.cot or args.chosen or args.one_of_n):
        return _write(args, info, rows)

    a, b = inprocess_pair(timeout=600)
    s0, s1 = OTSession(a, 0, batch=args.batch, ferret=False), OTSession(b, 1, batch=args.batch, ferret=False)
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
                bytes_per_ot("random", ferret=False), chk,
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
                bytes_per_ot("cot", 64, ferret=False), chk,
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
                bytes_per_ot("chosen", 64, ferret=False), chk,
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
                bytes_per_ot("1ofN", bits, N=N, ferret=False), chk,
            )
        )
    a.close()
    b.close()
    return _write(args, info, rows)


def _write(args, info: dict, rows: list) -> int:
    from cipherlm import _core

    report = {
        "benchmark": "ot",
        "machine": {**info, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "core": str(Path(_core.__file__).resolve()),
        "setting": "in-process, two threads over a socketpair; base OTs excluded from the per-kind rows",
        "results": rows,
    }
    if args.json == "-":
        print("JSON:" + json.dumps(report))
    elif args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2))
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

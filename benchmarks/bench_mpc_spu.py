"""cipherlm's 2PC engine side by side with SecretFlow-SPU 0.9.5 (CHEETAH, FM64).

    bash benchmarks/setup_peers.sh spu                 # once: SPU in .peers/spu
    .venv/bin/python benchmarks/bench_mpc_spu.py [--elements 65536] [--rows 128]
        [--only "softmax,gelu"] [--report FILE.json] [--spu-python PATH]

Same operations, sizes and input data on both sides: the operations of
`cipherlm.mpc.bench` marked ``spu=True`` (primitives on --elements elements;
softmax 128x128, GeLU 128x3072, LayerNorm 128x768, RMSNorm 128x576, SiLU
128x1536, top-8 of 64 for 128 rows), inputs from `cipherlm.mpc.bench.inputs`.
Both run as two OS processes on loopback: cipherlm via
`cipherlm.mpc.runner.run_processes` (TCP), SPU via benchmarks/spu_peer.py
(`libspu.link.create_brpc` + `spu.Runtime`) in its own venv.  The two runs
are sequential, never concurrent.

Bytes: both directions (cipherlm: channel counters; SPU: the "Link details"
lines of its profile log).  cipherlm's "MB ours" are as they fell, with the Ferret pool
refills that happened to land inside the operation; "amort." replaces those by the
operation's COTs times the steady-state refill traffic per COT
(`cipherlm.mpc.bench.REFILL_BYTES_PER_COT`), as `cipherlm bench mpc` reports them.  Seconds: wall time of the protocol call / of
`Runtime.run`, after the one-time OT set-up on both sides.  Errors: max abs
difference from the same numpy reference (`cipherlm.mpc.bench`).  Ratios are
cipherlm / SPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cipherlm.mpc import bench  # noqa: E402


def _fname(name: str) -> str:
    return name.replace(" ", "_").replace("/", "_")


def spu_outputs_to_ours(name: str, outs: list[np.ndarray]) -> np.ndarray:
    """SPU's outputs in the layout `cipherlm.mpc.bench` opens ours in."""
    if name == "top8_of_64":
        # SPU returns the right top-k set, but not in descending order: sort it (free, public
        # after opening) before comparing values and indices with numpy's order
        v, i = outs[0].astype(np.float64), outs[1].astype(np.float64)
        order = np.argsort(-v, -1, kind="stable")
        return np.concatenate([np.take_along_axis(v, order, -1), np.take_along_axis(i, order, -1)], -1)
    return outs[0].astype(np.float64)


def run_spu(names, n, rows, spu_python, work):
    in_dir, out_dir = os.path.join(work, "in"), os.path.join(work, "out")
    os.makedirs(in_dir, exist_ok=True)
    for nm in names:
        np.savez(os.path.join(in_dir, _fname(nm) + ".npz"), **bench.inputs(nm, n, rows))
    t = time.perf_counter()
    p = subprocess.run([spu_python, os.path.join(ROOT, "benchmarks", "spu_peer.py"), in_dir, out_dir, *names],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"SPU peer failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows_out = {r["name"]: r for r in json.load(open(os.path.join(out_dir, "results.json")))}
    for nm in names:
        o = bench.op(nm)
        d = np.load(os.path.join(out_dir, _fname(nm) + ".out.npz"))
        got = spu_outputs_to_ours(nm, [d[f"out{i}"] for i in range(len(d.files))])
        want = np.asarray(o.ref(bench.inputs(nm, n, rows)), np.float64)
        rows_out[nm]["max_error"] = float(np.abs(got - want).max())
    return rows_out, wall


def fmt_table(table) -> str:
    head = (f"{'operation':16s} {'size':>9s} | {'MB ours':>9s} {'amort.':>8s} {'MB SPU':>8s} {'ratio':>6s} | {'s ours':>7s}"
            f" {'s SPU':>7s} {'ratio':>6s} | {'err ours':>8s} {'err SPU':>8s}")
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(f"{r['name']:16s} {'x'.join(map(str, r['size'])):>9s} | {r['bytes_ours'] / 1e6:9.2f}"
                     f" {r['bytes_ours_amortised'] / 1e6:8.2f} {r['bytes_spu'] / 1e6:8.2f} {r['bytes_ratio']:6.2f}"
                     f" | {r['seconds_ours']:7.2f}"
                     f" {r['seconds_spu']:7.2f} {r['seconds_ratio']:6.2f} | {r['max_error_ours']:8.1e}"
                     f" {r['max_error_spu']:8.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 16)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--only", help="comma-separated operation names (default: every spu=True operation)")
    ap.add_argument("--spu-python", default=os.path.join(ROOT, ".peers", "spu", "bin", "python"))
    ap.add_argument("--report")
    ap.add_argument("--keep", help="keep SPU inputs/outputs/logs in this directory")
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else [o.name for o in bench.ops() if o.spu]
    for nm in names:
        if not bench.op(nm).spu:
            ap.error(f"{nm!r} has no SPU counterpart")
    if not os.path.exists(a.spu_python):
        print(f"no SPU venv at {a.spu_python}: run  bash benchmarks/setup_peers.sh spu", file=sys.stderr)
        return 2
    work = a.keep or tempfile.mkdtemp(prefix="spu-bench-")
    print(f"SPU: two processes over brpc loopback ({len(names)} operations) ...", file=sys.stderr, flush=True)
    spu_rows, spu_wall = run_spu(names, a.elements, a.rows, a.spu_python, work)
    print("cipherlm: two processes over TCP loopback ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    ours = {r["name"]: r for r in bench.measure(names, a.elements, a.rows, processes=True)}
    our_wall = time.perf_counter() - t
    table = []
    for nm in names:
        o, s = ours[nm], spu_rows[nm]
        table.append({"name": nm, "size": o["size"], "bytes_ours": o["bytes"], "bytes_spu": s["bytes"],
                      "bytes_ours_amortised": o.get("bytes_amortised", o["bytes"]),
                      "ferret_refill_bytes_ours": o.get("ferret_refill_bytes", 0),
                      "bytes_ratio": o["bytes"] / max(1, s["bytes"]), "seconds_ours": o["seconds"],
                      "seconds_spu": s["seconds"], "seconds_ratio": o["seconds"] / max(1e-9, s["seconds"]),
                      "rounds_ours": o["rounds"], "send_actions_spu": s["send_actions"],
                      "max_error_ours": o["max_error"], "max_error_spu": s["max_error"], "bound_ours": o["bound"]})
    print(fmt_table(table))
    print(f"(whole runs: SPU {spu_wall:.0f} s incl. compilation and set-up, cipherlm {our_wall:.0f} s incl. set-up)")
    if a.report:
        with open(a.report, "w") as f:
            json.dump({"command": sys.argv, "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                                        "processor": platform.processor()},
                       "elements": a.elements, "rows": a.rows, "operations": table,
                       "spu_raw": spu_rows, "wall_seconds": {"spu": spu_wall, "cipherlm": our_wall}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

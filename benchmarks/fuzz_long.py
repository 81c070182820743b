"""Long fuzzing runs of the network decoders (the targets of tests/fuzz_targets.py).

    .venv/bin/python benchmarks/fuzz_long.py --minutes 1                 # every target, 1 min each
    .venv/bin/python benchmarks/fuzz_long.py --minutes 30 --target seal_bfv_ciphertext --target channel_stream
    .venv/bin/python benchmarks/fuzz_long.py --list

Each target runs in its own child process (a crash in native code kills the child, not
the run, and the input that crashed it is kept) for ``--minutes``, in random (not
derandomized) batches of Hypothesis examples without shrinking; any input that raises an
error its decoder does not document, hangs (20 s) or crashes the child is a finding.
Prints one line per target (examples, examples/s, findings) and, with ``--json``,
writes them to a file.  Findings are printed in full; a crashing input is written to
``--crash-dir`` (default build/fuzz-crashes/).  The CI run of the same targets, with a
bounded number of examples, is tests/test_fuzz_decoders.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_targets as F  # noqa: E402


def run_target(name: str, seconds: float, crash_dir: Path) -> dict:
    crash_dir.mkdir(parents=True, exist_ok=True)
    record = crash_dir / f"{name}.last"
    t0 = time.monotonic()
    out = F.run_in_child(name, seconds=seconds, timeout=seconds + 120 + F.HANG_SECONDS, record=record)
    wall = time.monotonic() - t0
    res = out["result"]
    if res is None:  # the child died (a crash in native code) or hung past its budget
        crash = crash_dir / f"{name}.crash-{int(time.time())}"
        if record.exists():
            record.rename(crash)
        return {"target": name, "examples": None, "seconds": wall, "rate": None,
                "findings": [f"child ended with returncode {out['returncode']} (input kept in {crash}); "
                             f"stderr: {out['stderr'][-800:]}"]}
    record.unlink(missing_ok=True)
    res["rate"] = res["examples"] / res["seconds"] if res["seconds"] else None
    res["wall_seconds"] = wall
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="budget per target (default 1)")
    ap.add_argument("--target", action="append", choices=sorted(F.TARGETS),
                    help="a target to run (repeat for several; default: all)")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--crash-dir", type=Path, default=ROOT / "build" / "fuzz-crashes")
    a = ap.parse_args(argv)
    if a.list:
        for name, t in sorted(F.TARGETS.items()):
            print(f"{name:28s} {'native' if t.native else 'python':6s} {t.error_names:40s} {t.module}")
        return 0
    names = a.target or sorted(F.TARGETS)
    load = os.getloadavg()
    print(f"fuzz_long: {len(names)} targets x {a.minutes:g} min; {os.cpu_count()} CPUs, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start", flush=True)
    results = []
    for name in names:
        why = F.TARGETS[name].needs()
        if why:
            print(f"{name:28s} not run: {why}", flush=True)
            results.append({"target": name, "examples": None, "not_run": why, "findings": []})
            continue
        r = run_target(name, a.minutes * 60, a.crash_dir)
        results.append(r)
        rate = f"{r['rate']:9.1f}/s" if r.get("rate") else "        -"
        print(f"{name:28s} {r['examples'] if r['examples'] is not None else '-':>9} examples {rate}  "
              f"findings {len(r['findings'])}", flush=True)
        for f in r["findings"]:
            print(f"    {f}", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"minutes": a.minutes, "results": results}, indent=1))
    return 1 if any(r["findings"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

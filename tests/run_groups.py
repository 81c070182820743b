"""Run the test suite as a few pytest processes instead of one (the command `make test` runs).

Why: one pytest process that runs all ~90 modules keeps much of what each module allocated
(HE keys, Go and glibc heaps that are freed but not handed back, caches), so its resident
memory climbed to ~16 GB and the machine's to 20 GB of 24; on CI's machine that was killed
for memory near the end of the run.  A fresh process per group of modules starts from a clean
heap each time, so the peak is the largest group's, not the sum.  The cost is one interpreter
start (imports of torch/transformers, the session fixtures) per group: about 10 s each.

Usage: ``python tests/run_groups.py [pytest options]``.  With an explicit path or node id among
the arguments it runs one plain pytest process on them (a selection is the caller's choice);
otherwise it runs every ``tests/test_*.py`` in ``GROUPS`` groups (the modules in ``ALONE``
each in its own), passing the options to each, prints each group's result, time and peak
memory, and exits non-zero if any group failed (after running them all).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
GROUPS = 5
# Modules that hold the most memory at once: each gets a process to itself.
ALONE = ("test_twopc_blb.py",)
# pytest's exit code when a group's modules hold no selected test (e.g. `-m slow`).
NO_TESTS_COLLECTED = 5


def plan(files: list[Path], groups: int = GROUPS, alone: tuple[str, ...] = ALONE) -> list[list[Path]]:
    """Split the modules (in name order) into `groups` runs of consecutive modules with about
    equal counts, plus one run per module named in `alone`."""
    shared = [f for f in files if f.name not in alone]
    size = -(-len(shared) // groups) if shared else 1
    runs = [shared[i:i + size] for i in range(0, len(shared), size)]
    return runs + [[f] for f in files if f.name in alone]


def _selects_paths(args: list[str]) -> bool:
    return any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in args)


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q"]
    if _selects_paths(argv):
        return subprocess.call(pytest + argv)
    runs = plan(sorted(TESTS.glob("test_*.py")))
    results = []
    for i, run in enumerate(runs, 1):
        names = [f.name for f in run]
        print(f"[run_groups] group {i}/{len(runs)}: {names[0]} .. {names[-1]} ({len(names)} modules)", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(pytest + argv + [str(f) for f in run])
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        elapsed = time.monotonic() - start
        results.append((i, names, code, elapsed, usage.ru_maxrss / 2**20))
    print("[run_groups] group  exit  seconds  peak RSS (GB)  modules")
    failed = False
    for i, names, code, elapsed, peak in results:
        ok = code in (0, NO_TESTS_COLLECTED)
        failed |= not ok
        print(f"[run_groups] {i:5d}  {code:4d}  {elapsed:7.0f}  {peak:13.1f}  {names[0]} .. {names[-1]}"
              + ("" if ok else "  FAILED"))
    if all(code == NO_TESTS_COLLECTED for _, _, code, _, _ in results):
        return NO_TESTS_COLLECTED
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

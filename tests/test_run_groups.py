"""The suite runner's plan: every module runs exactly once, the heavy ones alone."""

from __future__ import annotations

from pathlib import Path

from run_groups import ALONE, plan


def test_plan_runs_every_module_once_and_isolates_the_heavy_ones():
    files = [Path(f"test_{i:02d}.py") for i in range(23)] + [Path(ALONE[0])]
    runs = plan(sorted(files), groups=5)
    flat = [f for run in runs for f in run]
    assert sorted(flat) == sorted(files)
    assert [Path(ALONE[0])] in runs
    shared = [run for run in runs if run != [Path(ALONE[0])]]
    assert len(shared) == 5 and max(map(len, shared)) - min(map(len, shared)) <= 4
    # consecutive modules stay together (a module's neighbours share its fixtures' imports)
    assert [f for run in shared for f in run] == sorted(f for f in files if f.name not in ALONE)


def test_plan_with_fewer_modules_than_groups():
    files = [Path("test_a.py"), Path("test_b.py")]
    assert plan(files, groups=5, alone=()) == [[Path("test_a.py")], [Path("test_b.py")]]

"""The Go tests of the Lattigo backend's native code (`native/lattigo`, `go test`): the AVX-512
NTTs and every operation re-expressed over them (`fastops.go`) bit for bit against Lattigo's
own, and the offload kernels against math/big.  Run here so that CI runs them; they need the
Go toolchain `make` builds the library with (skipped, with the reason, where there is none)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _go() -> str | None:
    for cand in (shutil.which("go"), "/usr/local/go/bin/go"):
        if cand and os.path.exists(cand):
            return cand
    return None


@pytest.mark.skipif(_go() is None, reason="no Go toolchain (the Lattigo backend is not built either)")
def test_native_lattigo_go_tests_pass():
    proc = subprocess.run([_go(), "test", "-count=1", "."], cwd=ROOT / "native" / "lattigo",
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ok" in proc.stdout

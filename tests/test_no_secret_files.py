"""No secret-bearing file is created on disk or tmpfs during a session.

SEAL objects (secret keys, shares, masks, weight blocks, ciphertexts) pass
through anonymous memfd files (he/serialize.py): they have no name in any file
system and vanish with the process.  A child process runs a whole offload
session and a whole 2pc session (server and client in one process) with

* a Python audit hook that records every file opened for writing, every
  ``tempfile`` file or directory and every ``os.mkdir``/``rename`` (builtins.open,
  os.open, io.open and tempfile all raise audit events), and
* every ``save``/``load`` of every SEAL class wrapped to record the path SEAL
  opens (the only file I/O SEAL does is on paths we hand it),

then reports them.  The one place allowed to receive files is the client's
bundle cache (public tensors, checked by its sha256).  A second child is
killed with SIGKILL in the middle of a session: nothing is left behind in its
temp dir, and nothing of ours in /dev/shm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

TESTS = os.path.dirname(__file__)

_PRELUDE = """
import json, os, stat, sys, threading, tempfile
import numpy as np
import tenseal.sealapi as seal

CACHE = os.environ["CIPHERLM_CACHE"]
writes, seal_paths = [], []

def audit(event, args):
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int) or path is None:
            return
        path = os.fsdecode(path)
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and not path.startswith(CACHE) and path != os.devnull:
            writes.append(path)
    elif event in ("tempfile.mkstemp", "tempfile.mkdtemp", "os.mkdir", "os.rename", "os.replace"):
        path = os.fsdecode(args[0])
        if not path.startswith(CACHE):
            writes.append(f"{event}: {path}")

def wrap(cls):
    for name in ("save", "load"):
        orig = getattr(cls, name, None)
        if orig is None:
            continue
        def hooked(self, *a, _orig=orig):
            seal_paths.append(next(x for x in a if isinstance(x, str)))
            return _orig(self, *a)
        setattr(cls, name, hooked)

for name in dir(seal):
    if hasattr(getattr(seal, name), "save"):
        wrap(getattr(seal, name))
from cipherlm.he import HEContext, OFFLOAD_CKKS
from cipherlm.he.keys import ClientKeys
_k = ClientKeys(HEContext(OFFLOAD_CKKS))
_pt = seal.Plaintext()
_k.ctx.encoder.encode([0.0], 2.0 ** 40, _pt)
wrap(type(_k._encryptor.encrypt_symmetric(_pt)))
wrap(type(_k._keygen.create_galois_keys([3])))
"""

_SESSIONS = """
from cipherlm.models import LoadedModel
from cipherlm.runtime.offload_client import OffloadClient
from cipherlm.runtime.offload_server import ModelHost, OffloadServer
from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost, TwoPCServer
from test_twopc import llama_model

def offload_session():
    srv = OffloadServer(ModelHost(os.environ["TINY_LLAMA"]), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    with OffloadClient(*srv.address) as client:
        ex = client.executor()
        ex.forward(np.asarray([1, 2, 3]), ex.new_cache())
    srv.shutdown()

config, w = llama_model(seed=2)  # torch builds the weights before the hook is on
sys.addaudithook(audit)

def twopc_session():
    host = TwoPCHost("tiny-llama", lm=LoadedModel("tiny-llama", config, w))
    srv = TwoPCServer(host, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    with TwoPCClient(*srv.address) as client:
        client.generate([3, 4, 5], 1, eos_ids=[])
    srv.shutdown()
"""


def _env(tmp_path, tiny_llama_dir) -> dict:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
            "CIPHERLM_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp), "TINY_LLAMA": tiny_llama_dir}


def _shm_entries() -> set:
    return {n for n in os.listdir("/dev/shm") if "cipherlm" in n} if os.path.isdir("/dev/shm") else set()


def test_sessions_write_no_file_outside_the_bundle_cache(tmp_path, tiny_llama_dir):
    code = _PRELUDE + _SESSIONS + textwrap.dedent("""
        offload_session()
        twopc_session()
        print(json.dumps({"writes": writes, "seal_paths": seal_paths}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=_env(tmp_path, tiny_llama_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["writes"] == [], seen["writes"]
    # the hooks saw SEAL's traffic (keys, ciphertexts, plaintexts) and it all went to memfds
    assert len(seen["seal_paths"]) > 100
    assert all(p.startswith("/proc/self/fd/") for p in seen["seal_paths"]), \
        sorted({p for p in seen["seal_paths"] if not p.startswith("/proc/self/fd/")})[:5]
    assert os.listdir(tmp_path / "tmp") == []


def test_a_session_killed_midway_leaves_no_file_behind(tmp_path, tiny_llama_dir):
    """SIGKILL in the middle of a 2pc session, after its keys have passed through SEAL and at
    the client's third cross-term decryption (the cross terms themselves run in the Rust core,
    which writes no file): no file of ours in the temp dir or /dev/shm afterwards."""
    before = _shm_entries()
    code = _PRELUDE + _SESSIONS + textwrap.dedent("""
        import signal
        from cipherlm.mpc import he_session as hs
        decrypt, calls = hs.HESession.decrypt_native, []
        def decrypt_then_kill(self, *args, **kwargs):
            out = decrypt(self, *args, **kwargs)
            calls.append(1)
            if len(calls) == 3 and seal_paths:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        hs.HESession.decrypt_native = decrypt_then_kill
        twopc_session()
        print("session finished before the kill", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=_env(tmp_path, tiny_llama_dir), cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert os.listdir(tmp_path / "tmp") == []
    assert _shm_entries() - before == set()
    leftovers = [p for p in tmp_path.iterdir() if p.name not in ("tmp", "cache")]
    assert leftovers == [], leftovers

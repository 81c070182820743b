"""Launch helpers shared by the commands (`cipherlm.commands`) and the benchmarks
(`cipherlm.bench`): the command line's defaults, `UserError`, and starting /
stopping a ``cipherlm serve`` process.

Standard library only: `cipherlm.cli` imports the defaults from here when it
builds the parser, before anything heavy is loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

MODES = ("plain", "offload", "2pc")
DEFAULT_DECODER = "smollm2-135m"
DEFAULT_ENCODER = "minilm-l6"
DEFAULT_PROMPT = "What is the capital of France?"


class UserError(Exception):
    """An error the user can fix (bad model name, unreachable server, ...): printed without a traceback."""


def start_server_process(model: str, timeout: float = 900.0, mode: str = "offload", extra_args=()):
    """Start ``cipherlm serve`` as a separate process on a free loopback port (``extra_args``:
    more ``serve`` flags); returns (proc, (host, port))."""
    cmd = [sys.executable, "-m", "cipherlm", "serve", "--mode", mode, "--model", model, "--host", "127.0.0.1",
           "--port", "0", *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found: dict = {}

    def read_stdout():
        for line in proc.stdout:
            if line.startswith("LISTENING ") and "addr" not in found:
                h, _, p = line.split()[1].rpartition(":")
                found["addr"] = (h, int(p))

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    deadline = time.time() + timeout
    while "addr" not in found:
        if proc.poll() is not None:
            raise UserError(f"the server process exited with code {proc.returncode} before listening")
        if time.time() > deadline:
            proc.kill()
            raise UserError("the server did not start listening in time")
        time.sleep(0.1)
    return proc, found["addr"]


def stop_process(proc) -> None:
    """Terminate a child process, killing it if it does not exit within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


__all__ = ["MODES", "DEFAULT_DECODER", "DEFAULT_ENCODER", "DEFAULT_PROMPT", "UserError",
           "start_server_process", "stop_process"]

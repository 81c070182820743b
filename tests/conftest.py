"""Fixtures shared by several test modules."""

from __future__ import annotations

import gc
import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def _release_heaps():
    """After each module: collect Python's garbage (whose handles free Go objects), then hand
    the Go heap they leave and glibc's free pages back to the OS, so that one long test process
    does not keep every module's HE keys and buffers (the suite once peaked at 20 GB of this
    24 GB machine; `make test` also runs it as several processes, tests/run_groups.py)."""
    yield
    gc.collect()
    lat = sys.modules.get("cipherlm.he.lattigo_backend")
    if lat is not None:
        lat.release_memory()
    _malloc_trim()


def _malloc_trim() -> None:
    """Hand glibc's free heap pages back to the OS (numpy buffers below the mmap threshold are
    freed into malloc's arenas, which otherwise keep them)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, d = 64, vocab 96) saved as a Hugging Face directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_offload_host(tmp_path_factory, tiny_llama_dir):
    """An offload `ModelHost` of the tiny Llama (its own bundle cache), closed after the module."""
    from cipherlm.runtime.offload_server import ModelHost

    mp = pytest.MonkeyPatch()
    mp.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    host = ModelHost(tiny_llama_dir)
    yield host
    host.engine.close()
    mp.undo()


@pytest.fixture
def serve_offload(tiny_offload_host):
    """start(session_timeout=20.0, processes=1, **ServerLimits fields) -> an `OffloadServer` of
    the tiny Llama serving in a thread; every server started is shut down (and its thread
    joined) after the test."""
    import threading

    from cipherlm.runtime.offload_server import OffloadServer
    from cipherlm.runtime.session_server import ServerLimits

    servers = []

    def start(session_timeout: float = 20.0, processes: int = 1, **limits):
        srv = OffloadServer(tiny_offload_host, "127.0.0.1", 0, session_timeout=session_timeout,
                            limits=ServerLimits(**limits), processes=processes)
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        thread.start()
        servers.append((srv, thread))
        return srv

    yield start
    for srv, thread in servers:
        srv.shutdown()
        thread.join(timeout=10)
        assert not thread.is_alive(), "serve_forever did not return after shutdown"


def wait_for(cond, what: str, limit: float = 20.0) -> None:
    """Poll ``cond()`` until true; fail naming ``what`` after ``limit`` seconds (a bound, not a timing target)."""
    import time

    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


# ----------------------------------------------------------------------------- no secrets in logs
#
# Issue 19: "No plaintext prompt, output, share or key appears in either side's logs under any
# test (asserted)."  Every test runs with a handler on the root logger that keeps each record
# emitted in this process (the servers, clients and the proxy that tests run in threads); at
# the end of the test, no formatted record (message and traceback) may hold
# * a string registered with the `log_secrets` fixture (tests add their prompts and answers;
#   the default demo prompt is always registered), or
# * what a value dump looks like: a numpy array repr, a bytes literal, eight or more numbers
#   in a row (a share, logits, token ids), a base64/hex run of 64+ characters (a key or a
#   ciphertext).
# Servers started as child processes log to their own stderr; the tests that run them check
# that output themselves (test_proxy, test_twopc_session).

import logging as _logging  # noqa: E402
import re as _re  # noqa: E402

_DUMP_PATTERNS = {
    "numpy array": _re.compile(r"\barray\(\["),
    "bytes literal": _re.compile(r"""\bb(['"])[^'"]{16,}"""),
    "number run": _re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?:\s*,\s*|\s+)(?:-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
                              r"(?:\s*,\s*|\s+)){6,}-?\d"),
    "base64/hex run": _re.compile(r"[A-Za-z0-9+/]{64,}={0,2}"),
}


def log_leaks(lines, secrets) -> list[str]:
    """What in (logger name, formatted record) pairs looks like a leak (see above)."""
    found = []
    for name, line in lines:
        for s in secrets:
            if s and s in line:
                found.append(f"{name}: a registered secret ({s[:12]!r}...) in {line[:200]!r}")
        for what, pat in _DUMP_PATTERNS.items():
            if pat.search(line):
                found.append(f"{name}: {what} in {line[:200]!r}")
    return found


class _RecordKeeper(_logging.Handler):
    def __init__(self):
        super().__init__(level=0)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        try:
            self.lines.append((record.name, self.format(record)))
        except Exception:  # a record that cannot be formatted is the logging module's problem
            self.lines.append((record.name, str(record.msg)))


@pytest.fixture
def log_secrets() -> set:
    """Strings (prompts, answers) the current test's log records must not contain."""
    return _SECRETS.setdefault("current", set())


_SECRETS: dict = {}


@pytest.fixture(autouse=True)
def _no_secrets_in_logs(request):
    from cipherlm.launch import DEFAULT_PROMPT

    keeper = _RecordKeeper()
    keeper.setFormatter(_logging.Formatter("%(message)s"))
    root = _logging.getLogger()
    root.addHandler(keeper)
    _SECRETS["current"] = {DEFAULT_PROMPT}
    try:
        yield
    finally:
        root.removeHandler(keeper)
    found = log_leaks(keeper.lines, _SECRETS.pop("current", set()))
    if found:
        pytest.fail("log records hold what they must not:\n" + "\n".join(found[:10]), pytrace=False)


@pytest.fixture(scope="module")
def ckks_toy_keys():
    """(backend, context, secret keys, bootstrapping keys) at Lattigo's INSECURE N = 2^10 test
    preset, per module (callers skip when the library is not built)."""
    from cipherlm.he.lattigo_backend import TEST_INSECURE_PRESET, LattigoBackend, LattigoContext

    be = LattigoBackend()
    ctx = LattigoContext.from_preset(TEST_INSECURE_PRESET, allow_insecure_for_tests=True)
    sk = be.keygen(ctx)
    bk = sk.bootstrapping_keys()
    yield be, ctx, sk, bk
    bk.close()

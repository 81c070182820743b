"""Fault injection while other sessions run (docs/reliability.md, "Fuzzing and fault injection").

A real offload server (the tiny random Llama of conftest.py, sessions in threads of this
process so that its counters and log can be read) gets one faulty peer at a time: a client
process killed with SIGKILL in the middle of a request, a peer that stops sending in the
middle of a frame, a peer whose bytes are trickled through a slow user-space relay, a
truncated frame, garbage after the hello; and a server process restarted between two
requests of a client.  A 2pc server gets a client process killed mid-protocol.

In every case one or two well-behaved sessions run at the same time ("bystanders") and
must finish with the answers they give alone (greedy tokens: the CKKS noise never flips
one on this model, and the 2pc run is deterministic); afterwards the server serves a fresh
session, its counters show exactly the faulty session as failed, and its log names the
fault without any payload (no prompt, no answer, no bytes, no arrays).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cipherlm.net import framing  # noqa: E402
from cipherlm.net.channel import TCPChannel  # noqa: E402
from cipherlm.runtime.offload_client import OffloadClient  # noqa: E402
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION  # noqa: E402
from cipherlm.runtime.offload_server import OffloadServer  # noqa: E402
from conftest import wait_for  # noqa: E402

PROMPTS = [[5, 17, 42], [9, 3, 60, 11]]
NEW_TOKENS = 3
HELLO = {"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload", "model": None}
IDLE = 2.5  # the servers' idle timeout in these tests (s)


@pytest.fixture(scope="module")
def host(tiny_offload_host):
    """The tiny Llama's offload host (conftest.py; it also points CIPHERLM_CACHE at a fresh
    directory for the module)."""
    return tiny_offload_host


@pytest.fixture
def serve(serve_offload):
    return functools.partial(serve_offload, session_timeout=IDLE)


def answer(addr, prompt, timeout: float = 30) -> list[int]:
    """One well-behaved offload session: greedy tokens for `prompt`."""
    with OffloadClient(*addr, timeout=timeout) as client:
        client.backend.show_progress = False
        return [int(t) for t in client.executor().generate(list(prompt), max_new_tokens=NEW_TOKENS)]


@pytest.fixture(scope="module")
def solo(host):
    """Each prompt's answer from a server with no other session."""
    srv = OffloadServer(host, "127.0.0.1", 0, session_timeout=IDLE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        return [answer(srv.address, p) for p in PROMPTS]
    finally:
        srv.shutdown()


class Bystanders:
    """Well-behaved sessions in threads, one per prompt, back to back until `finish`
    (each completes at least one session)."""

    def __init__(self, addr, prompts=PROMPTS, run=answer):
        self.results = [[] for _ in prompts]
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(addr, i, p, run), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _loop(self, addr, i, prompt, run):
        while True:
            try:
                self.results[i].append(run(addr, prompt))
            except Exception as exc:  # noqa: BLE001 - reported by finish()
                self.errors.append(f"session {i}: {type(exc).__name__}: {exc}")
                return
            if self.stop.is_set():
                return

    def finish(self, solo_answers, limit: float = 120.0) -> int:
        self.stop.set()
        for t in self.threads:
            t.join(limit)
        assert not any(t.is_alive() for t in self.threads), "a bystander session hangs"
        assert not self.errors, self.errors
        for i, got in enumerate(self.results):
            assert got, f"bystander {i} finished no session"
            assert all(g == solo_answers[i] for g in got), (i, got, solo_answers[i])
        return sum(len(r) for r in self.results)


def _wait_for(cond, what: str, limit: float = 30.0) -> None:
    wait_for(cond, what, limit)


def _assert_no_plaintext(records, solo_answers) -> None:
    """The server's log names sessions and fault kinds only: no prompt, no answer, no
    bytes or arrays (`session_server` logs the first line of an error message at most)."""
    text = "\n".join(r.getMessage() + (r.exc_text or "") for r in records)
    for ids in list(PROMPTS) + list(solo_answers):
        assert ", ".join(map(str, ids)) not in text, ids
    assert "array(" not in text
    assert not re.search(r"b['\"](\\x[0-9a-f]{2}|\\.|[^'\"\\]){9,}", text), text[-2000:]  # no bytes beyond a header's 8


def _hello(addr) -> TCPChannel:
    chan = TCPChannel.connect(*addr, timeout=20)
    chan.send(HELLO)
    assert chan.recv()["type"] == "welcome"
    return chan


def _after(srv, failed_before: int, solo_answers) -> None:
    """Exactly one more failed session, none left open, and a fresh session answers right."""
    _wait_for(lambda: srv.active_sessions == 0, "every session has ended")
    assert srv.sessions_failed == failed_before + 1, (srv.sessions_failed, failed_before)
    assert answer(srv.address, PROMPTS[0]) == solo_answers[0]


# --------------------------------------------------------------------------- a peer killed mid-request


KILLED_CLIENT = """
    import sys, time
    import numpy as np
    from cipherlm.runtime.offload_client import OffloadClient
    c = OffloadClient(sys.argv[1], int(sys.argv[2]), timeout=30)
    g = max(range(len(c.groups)), key=lambda i: c.groups[i].d_out)
    ct = c.engine.encrypt(g, np.ones(c.groups[g].d_in))
    c.chan.send({"type": "linear", "group": g, "cts": [ct] * 512})
    print("SENT", flush=True)
    time.sleep(120)
"""


def test_peer_killed_mid_request(serve, solo, host, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="cipherlm")
    srv = serve()
    applied = [0]
    apply = host.engine.apply

    def counted(*a, **kw):
        applied[0] += 1
        return apply(*a, **kw)

    monkeypatch.setattr(host.engine, "apply", counted)
    others = Bystanders(srv.address)
    failed = srv.sessions_failed
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_CLIENT), *map(str, srv.address)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SENT"
        _wait_for(lambda: applied[0] > 0, "the server works on the request")
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of the 512-ciphertext request
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    t0 = time.monotonic()
    _wait_for(lambda: srv.sessions_failed > failed, "the killed session ends")
    took = time.monotonic() - t0
    assert took < IDLE + 5
    n = others.finish(solo)
    assert n >= 2
    print(f"FAULT killed-mid-request: ended {took:.2f} s after the SIGKILL; {n} bystander sessions, all as solo")
    msgs = [r.getMessage() for r in caplog.records]
    assert any("ended: ChannelClosed" in m for m in msgs), msgs[-10:]
    _after(srv, failed, solo)
    _assert_no_plaintext(caplog.records, solo)


# --------------------------------------------------------------------------- raw faults on the wire


def _stall_mid_frame(chan: TCPChannel) -> None:
    """Announce a 10 000-byte request, send 100 bytes of it, then nothing (the socket stays open)."""
    chan.sock.setblocking(True)
    chan.sock.sendall(framing.encode_header(framing.KIND_MESSAGE, 10_000) + b"\0" * 100)


def _truncate_frame(chan: TCPChannel) -> None:
    """Announce 1000 bytes, send 500, close."""
    chan.sock.setblocking(True)
    chan.sock.sendall(framing.encode_header(framing.KIND_MESSAGE, 1000) + b"\1" * 500)
    chan.sock.shutdown(socket.SHUT_WR)


def _garbage(chan: TCPChannel) -> None:
    """64 bytes that are no frame header (after a valid hello)."""
    chan.sock.setblocking(True)
    chan.sock.sendall(bytes(range(7, 71)))


@pytest.mark.parametrize("inject, error, ends_within", [
    (_stall_mid_frame, "ChannelTimeout", (IDLE - 0.5, IDLE + 6)),
    (_truncate_frame, "ChannelClosed", (0, 5)),
    (_garbage, "FrameError", (0, 5)),
], ids=["stalled-mid-frame", "truncated-frame", "garbage-after-hello"])
def test_wire_fault_ends_that_session_only(serve, solo, caplog, inject, error, ends_within):
    caplog.set_level(logging.DEBUG, logger="cipherlm")
    srv = serve()
    others = Bystanders(srv.address)
    failed = srv.sessions_failed
    chan = _hello(srv.address)
    t0 = time.monotonic()
    inject(chan)
    _wait_for(lambda: srv.sessions_failed > failed, "the faulty session ends", limit=IDLE + 20)
    took = time.monotonic() - t0
    assert ends_within[0] <= took <= ends_within[1], took
    # the faulty peer sees its connection end (an error report may precede the EOF), never a hang
    chan.sock.settimeout(10)
    got = b""
    try:
        while chunk := chan.sock.recv(1 << 16):
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    chan.close()
    assert b"welcome" not in got
    n = others.finish(solo)
    assert n >= 2
    print(f"FAULT {inject.__name__}: ended {took:.2f} s after the fault as {error}; peer got {len(got)} bytes "
          f"then EOF; {n} bystander sessions, all as solo")
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"ended: {error}" in m for m in msgs), msgs[-10:]
    _after(srv, failed, solo)
    _assert_no_plaintext(caplog.records, solo)


# --------------------------------------------------------------------------- a slow peer


class Relay:
    """A TCP relay on loopback that forwards each direction in `chunk`-byte pieces at
    about `rate` bytes/s with `delay` seconds more per piece (user-space shaping: no
    tc netem here).  `seconds` / `bytes` record what the relayed sessions took."""

    def __init__(self, target, rate: float, chunk: int = 16 << 10, delay: float = 0.002):
        self.target, self.rate, self.chunk, self.delay = tuple(target), rate, chunk, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self.bytes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(self.chunk):
                time.sleep(self.delay + len(data) / self.rate)
                dst.sendall(data)
                self.bytes += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def test_slow_peer_is_served_and_others_are_not_slowed(serve, solo, caplog):
    caplog.set_level(logging.DEBUG, logger="cipherlm")
    srv = serve()
    relay = Relay(srv.address, rate=8e6)  # ~8 MB/s and 2 ms per 16 KiB piece, each way
    try:
        others = Bystanders(srv.address, PROMPTS[1:])
        failed, served = srv.sessions_failed, srv.sessions_served
        t0 = time.monotonic()
        assert answer(relay.address, PROMPTS[0]) == solo[0]
        slow = time.monotonic() - t0
        t0 = time.monotonic()
        assert answer(srv.address, PROMPTS[0]) == solo[0]
        fast = time.monotonic() - t0
        n = others.finish(solo[1:])
        assert n >= 1
    finally:
        relay.close()
    print(f"FAULT slow-peer: {relay.bytes / 1e6:.1f} MB relayed; session {slow:.2f} s through the relay, "
          f"{fast:.2f} s direct; {n} bystander sessions, all as solo")
    assert relay.bytes > 1 << 20
    assert slow > fast, (slow, fast)  # the relay did slow it down
    _wait_for(lambda: srv.active_sessions == 0, "every session has ended")
    assert srv.sessions_failed == failed and srv.sessions_served > served
    _assert_no_plaintext(caplog.records, solo)


# --------------------------------------------------------------------------- a server restarted


def test_server_restarted_between_two_requests(tiny_llama_dir, solo, host):
    from cipherlm.commands import start_server_process, stop_process

    args = ("--timeout", str(IDLE), "--session-processes", "1")
    proc, addr = start_server_process(tiny_llama_dir, timeout=120, extra_args=args)
    client = None
    try:
        client = OffloadClient(*addr, timeout=30)
        client.backend.show_progress = False
        ex = client.executor()
        assert [int(t) for t in ex.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)] == solo[0]  # request 1
        stop_process(proc)  # the server goes away between two requests
        proc, addr2 = start_server_process(tiny_llama_dir, timeout=120, extra_args=args + ("--port", str(addr[1])))
        assert addr2 == addr
        t0 = time.monotonic()
        with pytest.raises((ConnectionError, OSError)) as err:  # request 2 on the old session
            ex.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        took = time.monotonic() - t0
        assert took < 10, "the client hung instead of failing"
        print(f"FAULT restart: request 2 failed after {took:.2f} s with {type(err.value).__name__}: {err.value}")
        assert "disconnected" in str(err.value) or "closed" in str(err.value), err.value
        client.chan.close()
        # a new session on the restarted server works, with a bystander beside it
        others = Bystanders(addr, PROMPTS[1:])
        assert answer(addr, PROMPTS[0]) == solo[0]
        assert others.finish(solo[1:]) >= 1
    finally:
        if client is not None:
            client.chan.close()
        stop_process(proc)


# --------------------------------------------------------------------------- 2pc: a client killed mid-protocol


KILLED_2PC_CLIENT = """
    import sys, time
    from cipherlm.runtime.twopc_session import TwoPCClient
    c = TwoPCClient(sys.argv[1], int(sys.argv[2]), timeout=60)
    print("CONNECTED", flush=True)
    c.generate([5, 17, 42], 8, eos_ids=[], on_token=lambda t: print("TOKEN", flush=True))
    time.sleep(120)
"""


@pytest.mark.slow  # ~40 s here: three 2pc sessions of the tiny Llama at once on 2 cores
def test_2pc_client_killed_mid_protocol(tiny_llama_dir, caplog):
    from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost, TwoPCServer

    caplog.set_level(logging.DEBUG, logger="cipherlm")
    host = TwoPCHost(tiny_llama_dir)
    srv = TwoPCServer(host, "127.0.0.1", 0, session_timeout=30.0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def run(addr, prompt):
        with TwoPCClient(*addr, timeout=60) as c:
            return [int(t) for t in c.generate(prompt, 1, eos_ids=[])]

    try:
        solo2 = [run(srv.address, PROMPTS[1])]
        failed = srv.sessions_failed
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_2PC_CLIENT), *map(str, srv.address)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "CONNECTED"
            others = Bystanders(srv.address, PROMPTS[1:], run=run)
            assert proc.stdout.readline().strip() == "TOKEN"  # the prefill is done: kill it in the first decode pass
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        t0 = time.monotonic()
        _wait_for(lambda: srv.sessions_failed > failed, "the killed 2pc session ends")
        took = time.monotonic() - t0
        n = others.finish(solo2)
        assert n >= 1
        print(f"FAULT 2pc-killed: ended {took:.2f} s after the SIGKILL; {n} bystander sessions, all as solo")
        _wait_for(lambda: srv.active_sessions == 0, "every session has ended")
        assert srv.sessions_failed == failed + 1
        assert run(srv.address, PROMPTS[1]) == solo2[0]  # a fresh session afterwards
        msgs = [r.getMessage() for r in caplog.records]
        assert any("ended: ChannelClosed" in m for m in msgs), msgs[-10:]
        _assert_no_plaintext(caplog.records, solo2)
    finally:
        srv.shutdown()

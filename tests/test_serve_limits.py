"""Server resource limits (`ServerLimits`, docs/reliability.md "Server limits"): the frame cap
before hello, session caps (total and per address) with a "server busy" error, the session
lifetime, the offload work limits, work stopping when the client leaves, one bundle per
session, the strict hello, and the CLI keeping each mode's own default idle timeout.

Servers run in threads on 127.0.0.1 with a tiny random Llama (as in test_offload.py).
Assertions compare counts and messages; waits are bounded loops, not timing targets."""

from __future__ import annotations

import logging
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from conftest import wait_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cipherlm.net import framing, message  # noqa: E402
from cipherlm.net.channel import ChannelClosed, TCPChannel, inprocess_pair  # noqa: E402
from cipherlm.runtime.offload_client import OffloadClient  # noqa: E402
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION, RemoteError  # noqa: E402
from cipherlm.runtime.session_server import ServerLimits  # noqa: E402

HELLO = {"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload", "model": None}


@pytest.fixture(scope="module")
def host(tiny_offload_host):
    return tiny_offload_host


@pytest.fixture
def serve(serve_offload):
    """serve(session_timeout=..., **limit fields) -> a running OffloadServer (shut down after the test)."""
    return serve_offload



def _hello(addr, source: str | None = None, **fields) -> TCPChannel:
    if source is None:
        chan = TCPChannel.connect(*addr, timeout=20)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.bind((source, 0))
        sock.connect(tuple(addr))
        chan = TCPChannel(sock, timeout=20)
    chan.send({**HELLO, **fields})
    return chan


def _session(addr, source: str | None = None) -> TCPChannel:
    chan = _hello(addr, source)
    reply = chan.recv()
    assert reply["type"] == "welcome", reply
    return chan


def _assert_serves(srv) -> None:
    with OffloadClient(*srv.address) as client:
        ex = client.executor()
        out = ex.forward(np.asarray([1, 2]), ex.new_cache())
        assert np.all(np.isfinite(out))


def _count_applies(monkeypatch, host) -> list:
    """Count the ciphertexts the server evaluates and the CPU seconds its session thread
    spends on them: [count, cpu seconds] (a wrapper around the engine's apply)."""
    done = [0, 0.0]
    apply = host.engine.apply

    def counted(*a, **kw):
        t0 = time.thread_time()
        out = apply(*a, **kw)
        done[0] += 1
        done[1] += time.thread_time() - t0
        return out

    monkeypatch.setattr(host.engine, "apply", counted)
    return done


# ------------------------------------------------------------------ frames before hello


def test_oversized_frame_before_hello_refused_without_allocating(serve):
    srv = serve()
    assert srv.limits.pre_hello_max_frame == 64 << 10
    # a well-formed hello padded to 4 MiB: accepted if the server had no pre-hello cap
    payload = message.encode({**HELLO, "pad": b"x" * (4 << 20)})
    frame = framing.encode_header(framing.KIND_MESSAGE, len(payload)) + payload
    before = srv.sessions_failed
    received = b""
    tracemalloc.start()
    try:
        with socket.create_connection(srv.address, timeout=10) as s:
            try:
                s.sendall(frame)
                while True:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    received += chunk
            except OSError:  # reset: the server closed with our payload unread
                pass
        wait_for(lambda: srv.sessions_failed > before, "the session ends")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert b"welcome" not in received
    assert srv.sessions_failed == before + 1
    assert peak < 1 << 20, peak  # the server never buffered the 4 MiB payload
    # after the hello the normal cap applies: a 1 MiB request is fine
    chan = _session(srv.address)
    chan.send({"type": "stats", "pad": b"y" * (1 << 20)})
    assert chan.recv()["type"] == "stats"
    chan.send({"type": "bye"})
    chan.close()
    _assert_serves(srv)


# ------------------------------------------------------------------ session caps


def test_too_many_sessions_get_busy_error(serve):
    srv = serve(max_sessions=2, max_sessions_per_address=10)
    a, b = _session(srv.address), _session(srv.address)
    with pytest.raises(RemoteError, match="server busy"):
        OffloadClient(*srv.address)
    silent = TCPChannel.connect(*srv.address, timeout=10)  # says nothing: still told, not left hanging
    reply = silent.recv()
    silent.close()
    assert reply["type"] == "error" and reply["message"].startswith("server busy:"), reply
    assert srv.sessions_refused == 2 and srv.active_sessions == 2
    a.send({"type": "bye"})
    a.close()
    wait_for(lambda: srv.active_sessions < 2, "a slot frees")
    _assert_serves(srv)
    b.close()


def test_too_many_sessions_from_one_address(serve):
    srv = serve(max_sessions=10, max_sessions_per_address=1)
    a = _session(srv.address, "127.0.0.1")
    second = _hello(srv.address, "127.0.0.1")
    reply = second.recv()
    second.close()
    assert reply["type"] == "error" and reply["message"].startswith("server busy:"), reply
    assert "your address" in reply["message"]
    try:
        other = _session(srv.address, "127.0.0.2")  # another address still gets in
    except OSError:
        other = None  # no second loopback address here
    if other is not None:
        other.close()
    a.send({"type": "bye"})
    a.close()
    wait_for(lambda: srv.active_sessions == 0, "the sessions end")
    _assert_serves(srv)


# ------------------------------------------------------------------ lifetime


def test_session_lifetime_ends_a_chatty_session(serve):
    srv = serve(session_timeout=30.0, session_lifetime=1.0)
    chan = _session(srv.address)
    answered, reply = 0, None
    for _ in range(200):  # one stats every 0.05 s, far under the 30 s idle timeout
        try:
            chan.send({"type": "stats"})
            reply = chan.recv()
        except ChannelClosed:
            break
        if reply["type"] != "stats":
            break
        answered += 1
        time.sleep(0.05)
    chan.close()
    assert reply is not None and reply["type"] == "error", reply
    assert "lifetime" in reply["message"]
    assert 0 < answered < 200


def test_session_lifetime_is_a_deadline_on_receives(serve):
    srv = serve(session_timeout=30.0, session_lifetime=1.0)
    chan = _session(srv.address)
    reply = chan.recv(timeout=20)  # silent client: the lifetime ends it, not the 30 s idle timeout
    chan.close()
    assert reply["type"] == "error" and "lifetime" in reply["message"], reply


# ------------------------------------------------------------------ offload work limits


def _ct(client, gid: int = 0) -> bytes:
    group = client.groups[gid]
    return client.engine.encrypt(group.index, np.ones(group.d_in))


def test_too_many_ciphertexts_in_one_request(serve, host, monkeypatch):
    srv = serve(max_cts_per_request=4)
    done = _count_applies(monkeypatch, host)
    client = OffloadClient(*srv.address)
    try:
        client.chan.send({"type": "linear", "group": 0, "cts": [_ct(client)] * 5})
        reply = client.chan.recv()
    finally:
        client.chan.close()
    assert reply["type"] == "error" and "at most 4" in reply["message"], reply
    assert done[0] == 0  # refused before any work
    _assert_serves(srv)  # requests of 2 ciphertexts
    assert done[0] > 0


def test_session_work_budget(serve, host, monkeypatch):
    srv = serve(max_work_per_session=6)
    done = _count_applies(monkeypatch, host)
    for _ in range(2):  # each session has its own budget
        client = OffloadClient(*srv.address)
        try:
            ct = _ct(client)
            client.chan.send({"type": "linear", "group": 0, "cts": [ct] * 4})
            assert client.chan.recv()["type"] == "result"
            client.chan.send({"type": "linear", "group": 0, "cts": [ct] * 4})
            reply = client.chan.recv()
        finally:
            client.chan.close()
        assert reply["type"] == "error" and "work budget of 6" in reply["message"], reply
    assert done[0] == 8


def test_work_stops_when_the_client_disconnects(serve, host, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="cipherlm.serve")
    srv = serve()
    n = 128
    client = OffloadClient(*srv.address)
    gid = max(range(len(client.groups)), key=lambda g: client.groups[g].d_out)  # the slowest group
    ct = _ct(client, gid)
    done = _count_applies(monkeypatch, host)
    # the CPU time one ciphertext of this group costs the server, measured first
    client.chan.send({"type": "linear", "group": gid, "cts": [ct] * 4})
    assert client.chan.recv()["type"] == "result"
    cpu_per_ct = done[1] / done[0]
    done[:] = [0, 0.0]
    before = srv.sessions_failed
    client.chan.send({"type": "linear", "group": gid, "cts": [ct] * n})
    client.chan.close()  # gone before the answer
    wait_for(lambda: srv.sessions_failed > before, "the session ends")
    assert any("disconnected during its request" in r.getMessage() for r in caplog.records)
    assert done[0] < n // 4, done[0]  # without the check the server evaluates all n
    # server CPU spent on the abandoned request: a fraction of what all n would cost
    assert done[1] < n * cpu_per_ct / 4, (done[1], cpu_per_ct)
    _assert_serves(srv)


def test_bundle_only_once_per_session(serve):
    srv = serve()
    chan = _session(srv.address)
    chan.send({"type": "get_bundle"})
    assert chan.recv()["type"] == "bundle"
    chan.send({"type": "get_bundle"})
    reply = chan.recv()
    chan.close()
    assert reply["type"] == "error" and "once per session" in reply["message"], reply
    # and never before the hello
    chan = TCPChannel.connect(*srv.address, timeout=20)
    chan.send({"type": "get_bundle"})
    reply = chan.recv()
    chan.close()
    assert reply["type"] == "error" and "hello" in reply["message"], reply


# ------------------------------------------------------------------ strict hello


@pytest.mark.parametrize("fields, match", [
    ({"protocol": True}, "protocol version True"),
    ({"protocol": 1.0}, "protocol version 1.0"),
    ({"protocol": "1"}, "protocol version '1'"),
    ({"mode": None}, "not None"),
    ({"mode": 1}, "not 1"),
    ({"model": 5}, "model must be a name"),
])
def test_strict_hello(serve, fields, match):
    srv = serve()
    chan = _hello(srv.address, **fields)
    reply = chan.recv()
    chan.close()
    assert reply["type"] == "error" and match in reply["message"], reply


def test_hello_without_mode_refused(serve):
    srv = serve()
    chan = TCPChannel.connect(*srv.address, timeout=20)
    chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "model": None})
    reply = chan.recv()
    chan.close()
    assert reply["type"] == "error" and "without a mode" in reply["message"], reply
    _assert_serves(srv)


class _FakeTwoPCHost:
    name = "fake"
    startup_seconds = 0.0
    plan = {"embedding": "onehot-linear"}
    config = {}

    def welcome(self):
        return {"type": "welcome", "protocol": 1, "mode": "2pc", "model": self.name}


def test_strict_hello_2pc_server():
    from cipherlm.runtime.twopc_session import TwoPCServer

    srv = TwoPCServer(_FakeTwoPCHost(), "127.0.0.1", 0, session_timeout=20)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for fields in ({"protocol": True}, {"protocol": 1.0}, {"mode": None}):
            chan = TCPChannel.connect(*srv.address, timeout=20)
            chan.send({"type": "hello", "protocol": 1, "mode": "2pc", "model": None, **fields})
            reply = chan.recv()
            chan.close()
            assert reply["type"] == "error", (fields, reply)
        chan = TCPChannel.connect(*srv.address, timeout=20)
        chan.send({"type": "hello", "protocol": 1, "model": None})
        reply = chan.recv()
        chan.close()
        assert reply["type"] == "error" and "without a mode" in reply["message"], reply
        chan = TCPChannel.connect(*srv.address, timeout=20)
        chan.send({"type": "hello", "protocol": 1, "mode": "2pc", "model": None})
        assert chan.recv()["type"] == "welcome"
        chan.close()
    finally:
        srv.shutdown()


# ------------------------------------------------------------------ CLI defaults


def _serve_cli(monkeypatch, argv):
    """Run `cipherlm serve` with the model load and the accept loop stubbed; return the server."""
    from cipherlm import cli
    from cipherlm.runtime import offload_server, twopc_session

    made = []
    monkeypatch.setattr(twopc_session, "TwoPCHost", lambda *a, **kw: _FakeTwoPCHost())

    class FakeModelHost:
        name, startup_seconds = "fake", 0.0

        def __init__(self, *a, **kw):
            self.engine = type("E", (), {"close": lambda self: None})()

    monkeypatch.setattr(offload_server, "ModelHost", FakeModelHost)

    def record(self):
        made.append(self)

    monkeypatch.setattr(twopc_session.TwoPCServer, "serve_forever", record)
    monkeypatch.setattr(offload_server.OffloadServer, "serve_forever", record)
    rc = cli.main(["serve", "--port", "0", "--model", "fake", *argv])
    return rc, (made[0] if made else None)


def test_2pc_server_keeps_its_default_timeout(monkeypatch):
    from cipherlm import cli
    from cipherlm.runtime import offload_server, twopc_session

    assert cli.build_parser().parse_args(["serve", "--mode", "2pc"]).timeout is None
    rc, srv = _serve_cli(monkeypatch, ["--mode", "2pc"])
    assert rc == 0 and srv.session_timeout == twopc_session.DEFAULT_TIMEOUT == 600.0
    assert srv.limits == twopc_session.DEFAULT_LIMITS
    rc, srv = _serve_cli(monkeypatch, ["--mode", "offload"])
    assert rc == 0 and srv.session_timeout == offload_server.DEFAULT_TIMEOUT == 300.0
    assert srv.limits == offload_server.DEFAULT_LIMITS
    # flags the user gives win, the others keep the mode's defaults
    rc, srv = _serve_cli(monkeypatch, ["--mode", "2pc", "--timeout", "42", "--max-sessions", "3",
                                       "--session-lifetime", "99", "--pre-hello-max-frame", "4096"])
    assert rc == 0 and srv.session_timeout == 42.0
    assert (srv.limits.max_sessions, srv.limits.session_lifetime, srv.limits.pre_hello_max_frame) == (3, 99.0, 4096)
    assert srv.limits.max_sessions_per_address == twopc_session.DEFAULT_LIMITS.max_sessions_per_address
    rc, srv = _serve_cli(monkeypatch, ["--mode", "offload", "--max-cts-per-request", "7",
                                       "--max-work-per-session", "70", "--max-sessions-per-address", "2"])
    assert rc == 0 and srv.session_timeout == 300.0
    assert (srv.limits.max_cts_per_request, srv.limits.max_work_per_session,
            srv.limits.max_sessions_per_address) == (7, 70, 2)
    rc, srv = _serve_cli(monkeypatch, ["--mode", "offload", "--max-sessions", "0"])
    assert rc == 2 and srv is None


# ------------------------------------------------------------------ the channel's liveness probe


def _tcp_pair():
    from cipherlm.net.channel import listen

    srv = listen("127.0.0.1", 0)
    a = TCPChannel.connect(*srv.getsockname()[:2], timeout=5)
    b = TCPChannel.accept(srv, timeout=5, accept_timeout=5)
    srv.close()
    return a, b


def test_peer_gone():
    for pair in (_tcp_pair, lambda: inprocess_pair(timeout=5)):
        a, b = pair()
        assert not a.peer_gone()
        b.send({"type": "x"})
        wait_for(lambda: a.sock.recv(1, socket.MSG_PEEK), "the data arrives")
        assert not a.peer_gone()  # data waiting: still there
        b.close()
        wait_for(a.peer_gone, "the close is seen")  # EOF behind the unread data
        assert a.recv()["type"] == "x"  # nothing was consumed
        a.close()
        a, b = pair()
        b.close()
        wait_for(a.peer_gone, "the close is seen")
        a.close()
        assert a.peer_gone()


def test_lifetime_checked_between_messages():
    """Requests already queued are not served once the lifetime is over (no wait involved)."""
    from cipherlm.runtime.session_server import LimitExceeded, MessageSession

    served = []

    class Session(MessageSession):
        mode = "offload"
        handlers = {"stats": lambda self, msg: served.append(msg)}

    client, server_end = inprocess_pair(timeout=5)
    s = Session()
    s.chan, s.host = server_end, _FakeTwoPCHost()
    s.limits = ServerLimits(session_lifetime=1.0)
    s.expires_at = time.monotonic() - 1.0  # over (chan.deadline left unset: no receive deadline)
    client.send(HELLO)
    client.send({"type": "stats"})
    with pytest.raises(LimitExceeded, match="lifetime"):
        s.run()
    assert client.recv()["type"] == "welcome" and served == []
    client.close()
    server_end.close()

"""Channel: round trips (in-process and TCP), framing errors, disconnects,
timeouts, and exact byte/round accounting."""

import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest

from cipherlm.net import (
    HEADER_SIZE, ChannelClosed, ChannelTimeout, FrameError, SocketChannel, TCPChannel,
    inprocess_pair, listen,
)
from cipherlm.net.framing import KIND_BYTES, KIND_MESSAGE, MAGIC, encode_header
from test_net_message import assert_same, sample_message


def raw_pair(**kw):
    """(channel, raw socket peer) over a socketpair."""
    a, b = socket.socketpair()
    b.settimeout(5)
    return SocketChannel(a, **kw), b


def tcp_pair(**kw):
    srv = listen("127.0.0.1", 0)
    port = srv.getsockname()[1]
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("s", TCPChannel.accept(srv, accept_timeout=5, **kw)))
    t.start()
    c = TCPChannel.connect("127.0.0.1", port, connect_timeout=5, **kw)
    t.join(5)
    srv.close()
    return c, box["s"]


@pytest.fixture(params=["inprocess", "tcp"])
def pair(request):
    a, b = inprocess_pair(timeout=10) if request.param == "inprocess" else tcp_pair(timeout=10)
    yield a, b
    a.close()
    b.close()


def test_round_trip_every_type(pair):
    a, b = pair
    m = sample_message()
    a.send(m)
    assert_same(m, b.recv())
    b.send(m)
    assert_same(m, a.recv())
    a.send_bytes(b"raw \x00 blob")
    assert b.recv_bytes() == b"raw \x00 blob"
    a.send_bytes(b"")
    assert b.recv_bytes() == b""


def test_large_arrays_full_duplex(pair):
    """Both ends send several MB at once (would deadlock without concurrent
    send/recv); arrays arrive intact."""
    a, b = pair
    x = np.random.default_rng(0).standard_normal((1000, 700))
    got = {}

    def side(ch, key):
        t = threading.Thread(target=lambda: ch.send({"x": x}))
        t.start()
        got[key] = ch.recv()["x"]
        t.join()

    ts = [threading.Thread(target=side, args=(a, "a")), threading.Thread(target=side, args=(b, "b"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    np.testing.assert_array_equal(got["a"], x)
    np.testing.assert_array_equal(got["b"], x)


def test_tcp_nodelay_and_context_manager():
    c, s = tcp_pair()
    with c, s:
        assert c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert c.peer[1] == s.sock.getsockname()[1]
    assert c.closed and s.closed
    with pytest.raises(ChannelClosed):
        c.send({"a": 1})
    with pytest.raises(ChannelClosed):
        c.recv()


def test_connect_refused_times_out():
    srv = listen("127.0.0.1", 0)
    port = srv.getsockname()[1]
    srv.close()
    t = time.monotonic()
    with pytest.raises(ChannelTimeout):
        TCPChannel.connect("127.0.0.1", port, timeout=0.3)
    assert time.monotonic() - t < 3


def test_accept_times_out():
    srv = listen("127.0.0.1", 0)
    with pytest.raises(ChannelTimeout):
        TCPChannel.accept(srv, accept_timeout=0.2)
    srv.close()


# ------------------------------------------------------------------ bad frames


@pytest.mark.parametrize("header", [
    b"XXXX" + encode_header(KIND_MESSAGE, 0)[4:],                  # bad magic
    MAGIC + struct.pack(">BBHQ", 9, 0, 0, 0),                        # bad version
    MAGIC + struct.pack(">BBHQ", 1, 7, 0, 0),                        # unknown kind
    MAGIC + struct.pack(">BBHQ", 1, 0, 1, 0),                        # reserved bits
    encode_header(KIND_BYTES, 3) + b"abc",                           # wrong kind for recv()
    encode_header(KIND_MESSAGE, 3) + b"abc",                         # undecodable payload
])
def test_bad_frames_raise_frame_error(header):
    ch, peer = raw_pair(timeout=2)
    peer.sendall(header)
    with pytest.raises(FrameError):
        ch.recv()
    assert ch.closed  # stream no longer in sync


def test_oversized_frame_refused_before_allocating():
    ch, peer = raw_pair(timeout=2, max_frame=1 << 20)
    tracemalloc.start()
    try:
        peer.sendall(encode_header(KIND_MESSAGE, (1 << 20) + 1))
        with pytest.raises(FrameError, match="maximum frame size"):
            ch.recv()
        ch2, peer2 = raw_pair(timeout=2)  # default max 1 GiB
        peer2.sendall(encode_header(KIND_BYTES, (1 << 64) - 1))
        with pytest.raises(FrameError):
            ch2.recv_bytes()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    # The sender refuses too.
    a, b = inprocess_pair(max_frame=1000)
    with pytest.raises(FrameError):
        a.send_bytes(b"x" * 1001)


def test_declared_but_unsent_payload_does_not_allocate():
    """A header announcing 512 MiB followed by a few bytes and a disconnect:
    ChannelClosed, and the receive buffer never grows past what arrived (+1 MiB)."""
    ch, peer = raw_pair(timeout=2)
    tracemalloc.start()
    try:
        peer.sendall(encode_header(KIND_BYTES, 512 << 20) + b"x" * 1000)
        peer.close()
        with pytest.raises(ChannelClosed, match="mid-frame"):
            ch.recv_bytes()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# ------------------------------------------------------------------ disconnects and stalls


@pytest.mark.parametrize("sent", [b"", b"CLM", None])
def test_peer_disconnects(sent):
    ch, peer = raw_pair(timeout=2)
    if sent is None:  # mid-payload
        sent = encode_header(KIND_BYTES, 100) + b"y" * 40
    peer.sendall(sent)
    peer.close()
    with pytest.raises(ChannelClosed):
        ch.recv_bytes()


def test_send_to_closed_peer_raises_closed():
    a, b = inprocess_pair(timeout=2)
    b.close()
    with pytest.raises(ChannelClosed):
        for _ in range(100):
            a.send_bytes(b"z" * 100000)


@pytest.mark.parametrize("partial", [b"", b"CL", None])
def test_peer_stalls_times_out(partial):
    ch, peer = raw_pair(timeout=30)
    if partial is None:
        partial = encode_header(KIND_BYTES, 100) + b"y" * 10
    peer.sendall(partial)
    t = time.monotonic()
    with pytest.raises(ChannelTimeout):
        ch.recv_bytes(timeout=0.3)  # per-call timeout overrides the channel's
    assert 0.25 < time.monotonic() - t < 2.0
    if not partial:  # nothing of the frame was consumed: still usable
        peer.sendall(encode_header(KIND_BYTES, 2) + b"ok")
        assert ch.recv_bytes() == b"ok"
    else:
        assert ch.closed


def test_channel_default_timeout():
    a, b = inprocess_pair(timeout=0.2)
    t = time.monotonic()
    with pytest.raises(ChannelTimeout):
        b.recv()
    assert time.monotonic() - t < 2.0


def test_send_times_out_when_peer_never_reads():
    a, b = inprocess_pair(timeout=0.3)
    t = time.monotonic()
    with pytest.raises(ChannelTimeout):
        a.send_bytes(bytes(32 << 20))
    assert time.monotonic() - t < 3.0


# ------------------------------------------------------------------ accounting


def _drain(sock, out):
    n = 0
    while True:
        d = sock.recv(1 << 20)
        if not d:
            break
        n += len(d)
    out.append(n)


@pytest.mark.parametrize("transport", ["socketpair", "tcp"])
def test_bytes_counted_equal_bytes_on_the_wire(transport):
    if transport == "socketpair":
        ch, peer = raw_pair(timeout=5)
    else:
        srv = listen("127.0.0.1", 0)
        ch = TCPChannel.connect("127.0.0.1", srv.getsockname()[1], timeout=5)
        peer, _ = srv.accept()
        srv.close()
    counted = []
    t = threading.Thread(target=_drain, args=(peer, counted))
    t.start()
    msgs = [{"a": np.arange(n, dtype=np.float32), "s": "x" * n} for n in (0, 1, 7, 1000, 300000)]
    total = sum(ch.send(m) for m in msgs) + ch.send_bytes(b"abc")
    st = ch.totals()
    ch.close()
    t.join(10)
    assert counted == [total] == [st["bytes_sent"]]
    assert st["messages_sent"] == 6 and st["rounds"] == 1

    # Receive direction: frames written by hand, counted on the raw side.
    ch, peer = raw_pair(timeout=5)
    from cipherlm.net import message
    wire = b""
    for m in msgs[:4]:
        p = message.encode(m)
        wire += encode_header(KIND_MESSAGE, len(p)) + p
    peer.sendall(wire)
    for _ in msgs[:4]:
        ch.recv()
    assert ch.totals()["bytes_received"] == len(wire)
    assert ch.totals()["messages_received"] == 4


def test_header_overhead_is_counted():
    a, b = inprocess_pair()
    n = a.send_bytes(b"12345")
    b.recv_bytes()
    assert n == HEADER_SIZE + 5 == a.bytes_sent == b.bytes_received


def test_ping_pong_rounds_and_steps():
    a, b = inprocess_pair(timeout=5)
    n = 5
    for i in range(n):
        with a.step("linear"):
            a.send({"i": i})
            a.send({"again": i})  # same flight
        with b.step("outer"), b.step("linear"):  # innermost label wins
            b.recv(); b.recv()
            b.send({"r": i})
        with a.step("linear"):
            a.recv()
    sa, sb = a.stats(), b.stats()
    assert set(sa) == {"linear"} and set(sb) == {"linear"}
    assert sa["linear"]["rounds"] == n and sb["linear"]["rounds"] == n
    assert sa["linear"]["flights_received"] == n and sb["linear"]["flights_received"] == n
    assert sa["linear"]["messages_sent"] == 2 * n == sb["linear"]["messages_received"]
    assert sa["linear"]["bytes_sent"] == sb["linear"]["bytes_received"]
    assert sa["linear"]["bytes_received"] == sb["linear"]["bytes_sent"]
    # default label, totals, reset
    a.send({"x": 1}); b.recv()
    assert a.stats()["other"]["rounds"] == 1 and a.rounds == n + 1
    assert a.totals()["bytes_sent"] == sum(v["bytes_sent"] for v in a.stats().values())
    a.reset_stats()
    assert a.stats() == {} and a.totals()["bytes_sent"] == 0


def test_send_background_is_counted_before_the_receive():
    """A background send (Context.exchange of large messages) is accounted as a send
    followed by the receive, whatever the threads' timing: the peer's message is already
    waiting, yet the next send still opens a new round in its own step."""
    a, b = inprocess_pair(timeout=20)
    big = {"x": np.zeros(1 << 16)}

    def peer():
        b.send(big)
        b.recv()
        b.recv()

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    time.sleep(0.2)  # b's frame is (partly) buffered before a starts
    with a.step("exchange"):
        join = a.send_background(big)
        got = a.recv()
        assert join() > big["x"].nbytes
    with a.step("next"):
        a.send({"k": 1})
    t.join(10)
    stats = a.stats()
    assert np.array_equal(got["x"], big["x"])
    assert stats["exchange"]["rounds"] == 1 and stats["exchange"]["flights_received"] == 1
    assert stats["next"]["rounds"] == 1
    a.close()
    b.close()

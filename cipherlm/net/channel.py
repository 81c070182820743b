"""The one network channel every mode uses: framing, timeouts and accounting.

See DESIGN.md "Network model": every byte and round between the client and the
server goes through a `Channel`, which counts them per protocol step so that
reports can combine measured compute time with modelled network time
(`cipherlm.net.netmodel`).

Accounting
----------
* Bytes are counted exactly as they appear on the wire: the 16-byte frame header
  plus the payload (see `framing`).
* Traffic is labelled with the innermost active ``with channel.step(label):``
  block (default label ``"other"``).  The label stack belongs to the channel (it
  is shared by the threads using that channel).
* **Round** (a.k.a. flight): one batch of messages travelling in one direction.
  This party starts a new round whenever it sends after having received (or
  sends for the first time); consecutive sends without an intervening receive
  belong to the same round.  The round is attributed to the step active at its
  first send.  Symmetrically, ``flights_received`` counts the peer's rounds as
  seen by this party (a receive after having sent, or the first receive).
  A protocol's total number of one-way flights is therefore
  ``rounds + flights_received`` on either side; a ping-pong of n request/response
  pairs is n rounds on each side, 2n flights in all.  `NetworkModel` charges one
  one-way latency per flight.

Timeouts
--------
Every receive has a deadline (the channel's `timeout`, default 120 s, or the
``timeout=`` argument): the whole frame must arrive within it, else
`ChannelTimeout`.  Sends have the same deadline for the peer to accept the
bytes.  If a timeout or a `FrameError` leaves a frame half-read or half-written,
the stream is no longer in sync and the channel is closed; a timeout while
waiting for the first byte of a frame leaves the channel usable.

An absolute ``channel.deadline`` (a `time.monotonic()` value, default None)
caps every wait on top of the per-frame timeout: a server sets it to the end
of a session's lifetime, so that a peer trickling frames just under the idle
timeout cannot hold the session open past it.

Peer liveness
-------------
`SocketChannel.peer_gone()` tells, without blocking and without consuming
data, whether the peer has closed or reset the connection (EOF or an error
pending, even behind unread data where the OS reports it: POLLRDHUP on
Linux).  A server checks it between units of long work so that it stops
computing for a client that has left.  A peer that half-closes (shuts down
its sending side and waits for the answer) counts as gone; no client of this
package does that.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Callable, Iterator

from . import message as _message
from .framing import (
    DEFAULT_MAX_FRAME,
    DEFAULT_TIMEOUT,
    HEADER_SIZE,
    KIND_BYTES,
    KIND_MESSAGE,
    ChannelClosed,
    ChannelTimeout,
    FrameError,
    decode_header,
    encode_header,
)

DEFAULT_STEP = "other"
STAT_KEYS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "rounds", "flights_received")
_INITIAL_BUF = 1 << 20  # receive buffers start at 1 MiB and grow as data arrives
_COALESCE = 1 << 16  # payloads up to this size are sent in one write with their header
DEFAULT_CONNECT_TIMEOUT = 10.0  # default window for retrying refused connections
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut its sending side (seen behind unread data)


def _new_counter() -> dict[str, int]:
    return {k: 0 for k in STAT_KEYS}


class Channel:
    """Base class: a bidirectional, framed, accounted message channel.

    Subclasses implement `_write(data, deadline)`, `_read_into(view, deadline)`
    and `_close_transport()`.
    """

    def __init__(self, *, timeout: float | None = DEFAULT_TIMEOUT, max_frame: int = DEFAULT_MAX_FRAME, name: str = ""):
        self.timeout = timeout
        self.max_frame = int(max_frame)
        self.name = name
        self._closed = False
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._steps: list[str] = []
        self._stats: dict[str, dict[str, int]] = {}
        self._last_dir: str | None = None  # "send" | "recv"
        # absolute time.monotonic() after which no send or receive waits (None: no cap)
        self.deadline: float | None = None

    # ------------------------------------------------------------ public API

    def send(self, msg: dict) -> int:
        """Send one message (see `cipherlm.net.message`); return the bytes on the wire."""
        return self._send_frame(KIND_MESSAGE, _message.encode_parts(msg))

    def recv(self, timeout: float | None = None) -> dict:
        """Receive one message; raise ChannelTimeout / ChannelClosed / FrameError."""
        payload = self._recv_frame(KIND_MESSAGE, timeout)
        try:
            return _message.decode(payload)
        except FrameError:
            self.close()
            raise

    def send_bytes(self, data: bytes | bytearray | memoryview) -> int:
        """Send one raw blob; return the bytes on the wire."""
        return self._send_frame(KIND_BYTES, [memoryview(data).cast("B")])

    def recv_bytes(self, timeout: float | None = None) -> bytes:
        """Receive one raw blob sent with `send_bytes`."""
        return bytes(self._recv_frame(KIND_BYTES, timeout))

    def close(self) -> None:
        """Close the channel (idempotent); the peer sees ChannelClosed."""
        if not self._closed:
            self._closed = True
            self._close_transport()

    @property
    def closed(self) -> bool:
        return self._closed

    def peer_gone(self) -> bool:
        """Whether the peer is known to have left (transports that can tell override this)."""
        return self._closed

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ accounting

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Label the traffic inside the block (innermost label wins)."""
        self._steps.append(str(label))
        try:
            yield
        finally:
            self._steps.pop()

    @property
    def current_step(self) -> str:
        return self._steps[-1] if self._steps else DEFAULT_STEP

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-step counters: {label: {bytes_sent, bytes_received, messages_sent,
        messages_received, rounds, flights_received}} (a copy)."""
        with self._stats_lock:
            return {k: dict(v) for k, v in self._stats.items()}

    def totals(self) -> dict[str, int]:
        """The counters summed over all steps."""
        out = _new_counter()
        for c in self.stats().values():
            for k in STAT_KEYS:
                out[k] += c[k]
        return out

    @property
    def bytes_sent(self) -> int:
        return self.totals()["bytes_sent"]

    @property
    def bytes_received(self) -> int:
        return self.totals()["bytes_received"]

    @property
    def rounds(self) -> int:
        return self.totals()["rounds"]

    def reset_stats(self) -> None:
        """Forget all counters (the round state restarts too)."""
        with self._stats_lock:
            self._stats = {}
            self._last_dir = None

    def _count(self, label: str, direction: str, nbytes: int) -> None:
        with self._stats_lock:
            c = self._stats.setdefault(label, _new_counter())
            if direction == "send":
                if self._last_dir != "send":
                    c["rounds"] += 1
                c["bytes_sent"] += nbytes
                c["messages_sent"] += 1
            else:
                if self._last_dir != "recv":
                    c["flights_received"] += 1
                c["bytes_received"] += nbytes
                c["messages_received"] += 1
            self._last_dir = direction

    # ------------------------------------------------------------ framing

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        d = None if t is None else time.monotonic() + t
        cap = self.deadline
        if cap is not None:
            d = cap if d is None else min(d, cap)
        return d

    def send_background(self, msg: dict) -> Callable[[], int]:
        """Send one message from a helper thread; return ``join()``, which waits for the
        write and re-raises its error (or returns the bytes on the wire).

        For two parties that send large messages to each other at once (their writes
        would block on full socket buffers if neither read).  The frame is counted
        *now*, before this party receives anything, so the accounting (bytes, rounds,
        flights and their steps) reads exactly as a plain ``send`` followed by a
        ``recv`` and never depends on thread timing.  The send lock is held until the
        write is done: frames never interleave and keep their order.
        """
        chunks, total, label = self._frame(KIND_MESSAGE, _message.encode_parts(msg))
        self._send_lock.acquire()
        try:
            if self._closed:
                raise ChannelClosed("channel is closed")
            deadline = self._deadline(None)
            self._count(label, "send", total)
        except BaseException:
            self._send_lock.release()
            raise
        err: list[BaseException] = []

        def write():
            try:
                self._write_chunks(chunks, deadline)
            except BaseException as e:  # re-raised by join()
                err.append(e)
            finally:
                self._send_lock.release()

        t = threading.Thread(target=write, daemon=True, name="channel-send")
        t.start()

        def join() -> int:
            t.join()
            if err:
                raise err[0]
            return total

        return join

    def _frame(self, kind: int, parts: list) -> tuple[list, int, str]:
        """(chunks to write, bytes on the wire, step label) of one frame."""
        label = self.current_step
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.max_frame:
            raise FrameError(f"frame of {size} bytes exceeds the maximum frame size {self.max_frame}")
        header = encode_header(kind, size)
        # Small frames go out in one write (one TCP segment with TCP_NODELAY).
        if size <= _COALESCE:
            chunks = [header + b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)]
        else:
            chunks = [header, *parts]
        return chunks, HEADER_SIZE + size, label

    def _write_chunks(self, chunks: list, deadline: float | None) -> None:
        """Write a frame's chunks (the send lock held); a partly written frame would
        desynchronise the stream, so a failure closes the channel."""
        try:
            for ch in chunks:
                self._write(memoryview(ch).cast("B"), deadline)
        except (ChannelTimeout, ChannelClosed):
            self.close()
            raise

    def _send_frame(self, kind: int, parts: list) -> int:
        chunks, total, label = self._frame(kind, parts)
        with self._send_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            self._write_chunks(chunks, self._deadline(None))
        self._count(label, "send", total)
        return total

    def _recv_frame(self, kind: int, timeout: float | None) -> bytearray:
        label = self.current_step
        with self._recv_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            deadline = self._deadline(timeout)
            header = bytearray(HEADER_SIZE)
            got = self._read_exact(memoryview(header), deadline, started=False)
            try:
                fkind, length = decode_header(header, self.max_frame)
                if fkind != kind:
                    want = "message" if kind == KIND_MESSAGE else "raw bytes"
                    raise FrameError(f"expected a {want} frame, got frame kind {fkind}")
            except FrameError:
                self.close()
                raise
            payload = self._read_payload(length, deadline)
            got += length
        self._count(label, "recv", got)
        return payload

    def _read_exact(self, view: memoryview, deadline: float | None, started: bool) -> int:
        pos, n = 0, len(view)
        try:
            while pos < n:
                k = self._read_into(view[pos:], deadline)
                if k == 0:
                    if pos or started:
                        raise ChannelClosed(f"peer disconnected mid-frame ({pos} of {n} bytes read)")
                    raise ChannelClosed("peer disconnected")
                pos += k
        except ChannelTimeout:
            if pos or started:
                self.close()
            raise
        except ChannelClosed:
            self.close()
            raise
        return n

    def _read_payload(self, length: int, deadline: float | None) -> bytearray:
        buf = bytearray(min(length, _INITIAL_BUF))
        pos = 0
        while pos < length:
            if pos == len(buf):
                buf += bytes(min(length, 2 * len(buf)) - len(buf))
            view = memoryview(buf)[pos:]
            try:
                pos += self._read_exact(view, deadline, started=True)
            finally:
                view.release()
        return buf

    # ------------------------------------------------------------ transport hooks

    def _write(self, data: memoryview, deadline: float | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def _read_into(self, view: memoryview, deadline: float | None) -> int:  # pragma: no cover
        """Read at least one byte into `view` (0 = EOF); raise ChannelTimeout at the deadline."""
        raise NotImplementedError

    def _close_transport(self) -> None:  # pragma: no cover
        raise NotImplementedError


class SocketChannel(Channel):
    """A `Channel` over a connected stream socket (TCP or a socketpair).

    The socket is switched to non-blocking mode; waits use poll() with the
    remaining time to the deadline, so a send and a recv may run concurrently
    in two threads.
    """

    def __init__(self, sock: socket.socket, **kw):
        super().__init__(**kw)
        self.sock = sock
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fd = sock.fileno()
        self._has_poll = hasattr(select, "poll")
        if self._has_poll:
            self._rpoll = select.poll()
            self._rpoll.register(self._fd, select.POLLIN | select.POLLPRI)
            self._wpoll = select.poll()
            self._wpoll.register(self._fd, select.POLLOUT)

    def peer_gone(self) -> bool:
        """True when the peer has closed or reset the connection (or this channel is
        closed); never blocks and consumes nothing, so it may be called between units
        of work while a request is being served."""
        if self._closed:
            return True
        if self._has_poll:
            p = select.poll()
            p.register(self._fd, select.POLLIN | _POLLRDHUP)
            try:
                ready = p.poll(0)
            except OSError:
                return True
            events = ready[0][1] if ready else 0
            if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL | _POLLRDHUP):
                return True
            if not events & select.POLLIN:
                return False
        try:  # readable: data (the peer is still there, as far as this end can tell) or EOF
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _wait(self, write: bool, deadline: float | None) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise ChannelTimeout("timed out waiting for the peer")
        if self._has_poll:
            p = self._wpoll if write else self._rpoll
            ms = None if remaining is None else max(1, int(remaining * 1000 + 0.999))
            ready = p.poll(ms)
        else:  # pragma: no cover (non-POSIX)
            r, w, _ = select.select([] if write else [self.sock], [self.sock] if write else [], [], remaining)
            ready = r or w
        if not ready:
            if deadline is not None and time.monotonic() >= deadline:
                raise ChannelTimeout("timed out waiting for the peer")

    def _write(self, data: memoryview, deadline: float | None) -> None:
        pos, n = 0, len(data)
        while pos < n:
            try:
                pos += self.sock.send(data[pos:])
            except (BlockingIOError, InterruptedError):
                self._wait(True, deadline)
            except OSError as e:
                if self._closed:
                    raise ChannelClosed("channel is closed") from e
                raise ChannelClosed(f"peer disconnected: {e}") from e

    def _read_into(self, view: memoryview, deadline: float | None) -> int:
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                self._wait(False, deadline)
            except OSError as e:
                if self._closed:
                    raise ChannelClosed("channel is closed") from e
                raise ChannelClosed(f"peer disconnected: {e}") from e

    def _close_transport(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TCPChannel(SocketChannel):
    """A `Channel` over TCP (TCP_NODELAY).  Build one with `connect`, `accept`,
    or ``TCPChannel(accepted_socket)``."""

    @classmethod
    def connect(
        cls, host: str, port: int, timeout: float | None = DEFAULT_TIMEOUT, *, connect_timeout: float | None = None, **kw
    ) -> "TCPChannel":
        """Connect to (host, port).  `timeout` is the channel's send/recv timeout.
        Refused connections are retried (the server may still be starting) for
        `connect_timeout` seconds (default: min(timeout, 10 s)), then ChannelTimeout."""
        if connect_timeout is None:
            connect_timeout = min(timeout, DEFAULT_CONNECT_TIMEOUT) if timeout is not None else DEFAULT_CONNECT_TIMEOUT
        limit = connect_timeout
        deadline = time.monotonic() + limit
        last: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout(f"could not connect to {host}:{port} within {limit} s: {last}") from last
            try:
                sock = socket.create_connection((host, port), timeout=remaining)
            except (ConnectionRefusedError, ConnectionResetError, socket.timeout) as e:
                last = e
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            return cls(sock, timeout=timeout, **kw)

    @classmethod
    def accept(
        cls, server: socket.socket, timeout: float | None = DEFAULT_TIMEOUT, *, accept_timeout: float | None = None, **kw
    ) -> "TCPChannel":
        """Accept one connection on a listening socket (see `listen`).  `timeout`
        is the channel's send/recv timeout; ChannelTimeout if no client connects
        within `accept_timeout` seconds (None: wait indefinitely)."""
        server.settimeout(accept_timeout)
        try:
            sock, _addr = server.accept()
        except socket.timeout as e:
            raise ChannelTimeout(f"no connection within {accept_timeout} s") from e
        return cls(sock, timeout=timeout, **kw)

    @property
    def peer(self) -> tuple:
        return self.sock.getpeername()


def listen(host: str = "127.0.0.1", port: int = 0, backlog: int = 8) -> socket.socket:
    """A listening TCP socket (SO_REUSEADDR); port 0 picks a free port,
    read it back with ``sock.getsockname()[1]``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def inprocess_pair(**kw) -> tuple[SocketChannel, SocketChannel]:
    """Two connected channels in this process (over socket.socketpair, so the
    framing and the byte counts are exactly those of TCP).  Keyword arguments
    (timeout, max_frame) apply to both ends."""
    a, b = socket.socketpair()
    return SocketChannel(a, name="client", **kw), SocketChannel(b, name="server", **kw)

"""The session layer every mode's server and client share.

One TCP connection is one session in its own thread.  A session opens with
``{type: hello, protocol, mode, model}`` answered by ``{type: welcome, ...}``,
then the client sends requests ``{type: <kind>, ...}`` that the mode's
session class dispatches to its handlers until ``{type: bye}``.

Faults: an error in one session (malformed or unexpected message, wrong
shapes, a peer that disconnects or stalls past the session timeout) ends that
session only; the client gets ``{type: error, message}`` when the channel still
works, and the server goes on serving others.  Log lines name sessions and
the kind of fault, never payloads, keys or values (the first line of an
exception message at most, and the modes' messages name shapes, not data).

Limits (`ServerLimits`, one frozen set per server; docs/reliability.md
"Server limits" has the table): at most ``max_sessions`` sessions at once and
``max_sessions_per_address`` from one source address (a client beyond them
gets ``{type: error, message: "server busy: ..."}`` and its connection is
closed); frames of at most ``pre_hello_max_frame`` bytes until the hello has
been checked, which must come within ``hello_timeout``, then ``max_frame``;
an absolute ``session_lifetime`` (checked between requests and a deadline on
every send and receive, on top of the per-frame idle timeout); and the
modes' own work limits (offload: ``max_cts_per_request``,
``max_work_per_session``).  Exceeding a limit is a `LimitExceeded`, which
ends the session like any other fault.
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict

from cipherlm.net import message as _message
from cipherlm.net.channel import ChannelClosed, ChannelTimeout, FrameError, TCPChannel, listen
from cipherlm.net.framing import DEFAULT_MAX_FRAME, KIND_MESSAGE, encode_header
from cipherlm.runtime.offload_protocol import MAX_TOKENS_PER_REQUEST, ProtocolError, expect
from cipherlm.runtime.session_workers import SessionWorkerPool, check_session_processes

__all__ = ["SessionServer", "MessageSession", "SessionClient", "ServerLimits", "LimitExceeded", "short_error",
           "try_send_error"]

_LINGER_SECONDS = 2.0  # how long a refused connection is drained before it is closed
_MAX_LINGERING = 64  # refused connections being drained at once (the oldest is closed first)


class LimitExceeded(ProtocolError):
    """A session went past one of its server's limits (`ServerLimits`)."""


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Resource limits of one server; every field has a safe default.

    ``max_sessions``: sessions open at once (each is a thread); a connection
    beyond it is answered ``{type: error, message: "server busy: ..."}`` and
    closed.  ``max_sessions_per_address``: the same, per client IP address.
    ``session_lifetime``: seconds a session may last in all (None: no limit),
    besides the server's idle timeout per frame.  ``hello_timeout``: seconds
    a new connection has to send its hello.  ``pre_hello_max_frame`` /
    ``max_frame``: the largest frame accepted before / after the hello.
    Offload only: ``max_cts_per_request`` (ciphertexts in one ``linear``
    request) and ``max_work_per_session`` (ciphertexts evaluated in one
    session, all requests together).
    """

    max_sessions: int = 16
    max_sessions_per_address: int = 4
    session_lifetime: float | None = 8 * 3600.0
    hello_timeout: float = 30.0
    pre_hello_max_frame: int = 64 << 10
    max_frame: int = DEFAULT_MAX_FRAME
    max_cts_per_request: int = 512
    max_work_per_session: int = 1 << 20

    def __post_init__(self):
        for name in ("max_sessions", "max_sessions_per_address", "max_cts_per_request", "max_work_per_session"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_cts_per_request > MAX_TOKENS_PER_REQUEST:
            raise ValueError(f"max_cts_per_request may be at most the protocol's {MAX_TOKENS_PER_REQUEST}")
        for name in ("session_lifetime", "hello_timeout"):
            v = getattr(self, name)
            if (v is not None or name == "hello_timeout") and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not isinstance(self.pre_hello_max_frame, int) or self.pre_hello_max_frame < 1024:
            raise ValueError(f"pre_hello_max_frame must be at least 1024 bytes, got {self.pre_hello_max_frame!r}")
        if not isinstance(self.max_frame, int) or self.max_frame < self.pre_hello_max_frame:
            raise ValueError(f"max_frame must be at least pre_hello_max_frame, got {self.max_frame!r}")

    def merged(self, **overrides) -> "ServerLimits":
        """These limits with some fields replaced; None values keep the field as it is."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _error_frame(text: str) -> bytes:
    payload = _message.encode({"type": "error", "message": text})
    return encode_header(KIND_MESSAGE, len(payload)) + payload


def short_error(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut to ``limit`` characters."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:limit]


def try_send_error(chan, message: str) -> None:
    """Tell the peer why its session ends, if the channel still works."""
    try:
        chan.send({"type": "error", "message": message})
    except Exception:
        pass


class MessageSession:
    """The server side of one session: the hello check and the request loop.

    Subclasses set ``mode`` and ``handlers`` (request type -> method) and
    have ``host`` (with ``name`` and ``welcome()``) and ``chan``.  The server
    sets ``limits`` and ``expires_at`` (the session's end, a
    ``time.monotonic()`` value, or None) before `run`.
    """

    mode: str = ""
    protocol_version: int = 1
    handshake_step: str = "setup"
    handlers: dict = {}
    limits: ServerLimits = ServerLimits()
    expires_at: float | None = None

    def check_hello(self) -> None:
        """The first message must be a hello for this protocol version, this mode and
        (if it names one) this model; anything else ends the session."""
        hello = self.chan.recv(timeout=self.limits.hello_timeout)
        if isinstance(hello, dict) and isinstance(hello.get("type"), str) and hello["type"] == "error":
            # a client's error report is not the server's (expect() would raise RemoteError)
            raise ProtocolError("expected a 'hello' message, got an error report")
        hello = expect(hello, "hello")
        proto = hello.get("protocol")
        if type(proto) is not int or proto != self.protocol_version:  # not True, not 1.0
            raise ProtocolError(f"protocol version {proto!r} not supported "
                                f"(this server speaks {self.protocol_version})")
        if "mode" not in hello:
            raise ProtocolError(f"hello without a mode (this server runs the {self.mode} mode)")
        mode = hello["mode"]
        if not isinstance(mode, str) or mode != self.mode:
            raise ProtocolError(f"this server runs the {self.mode} mode, not {mode!r}")
        wanted = hello.get("model")
        if wanted is not None and not isinstance(wanted, str):
            raise ProtocolError(f"model must be a name or None, not a {type(wanted).__name__}")
        if wanted not in (None, self.host.name):
            raise ProtocolError(f"unknown model {wanted!r}: this server serves {self.host.name!r}")

    def welcome(self) -> dict:
        """The answer to an accepted hello."""
        return self.host.welcome()

    def check_lifetime(self) -> None:
        """Raise LimitExceeded once the session has lived its ``session_lifetime``."""
        if self.expires_at is not None and time.monotonic() >= self.expires_at:
            raise LimitExceeded(f"session lifetime of {self.limits.session_lifetime:g} s reached")

    def check_alive(self, progress: str = "") -> None:
        """Between units of long work: stop if the lifetime is over or the client has gone."""
        self.check_lifetime()
        if self.chan.peer_gone():
            raise ChannelClosed("the client disconnected during its request" + (f" ({progress})" if progress else ""))

    def run(self) -> None:
        self.check_hello()
        self.chan.max_frame = self.limits.max_frame  # the small pre-hello cap is lifted
        with self.chan.step(self.handshake_step):
            self.chan.send(self.welcome())
        while True:
            self.check_lifetime()
            msg = self.chan.recv()
            if not isinstance(msg, dict):
                raise ProtocolError("expected a message dict")
            kind = msg.get("type")
            if not isinstance(kind, str):
                raise ProtocolError(f"a request's type must be a string, not a {type(kind).__name__}")
            if kind == "bye":
                return
            handler = self.handlers.get(kind)
            if handler is None:
                raise ProtocolError(f"unexpected message type {kind!r}")
            handler(self, msg)

    def close(self) -> None:
        """Release what the session holds (nothing by default)."""


class SessionServer:
    """Accepts sessions on a TCP port, one thread per session, for one model host;
    with ``processes`` W > 1 the sessions run in W forked worker processes
    (`session_workers.SessionWorkerPool`) and this process only admits and hands out
    connections.

    Subclasses implement ``new_session(chan)``, set ``default_timeout`` and
    ``log_name``, may set ``default_limits``
    (used when the constructor gets no ``limits``) and may extend
    ``expected_errors`` (faults logged as warnings with their message; any
    other exception is logged by type only).
    """

    expected_errors: tuple = (ChannelClosed, ChannelTimeout, FrameError, ProtocolError)
    thread_name = "session"
    default_limits = ServerLimits()
    default_timeout = 300.0
    log_name = "cipherlm.serve"

    def __init__(self, host, address: str = "127.0.0.1", port: int = 0, session_timeout: float | None = None,
                 limits: ServerLimits | None = None, processes: int = 1):
        """`session_timeout`: the idle timeout per frame (None: the mode's ``default_timeout``);
        `limits`: None for the mode's ``default_limits``; `processes`: 1 runs sessions in
        threads of this process, W > 1 in W forked worker processes (`session_workers`;
        the host must be ``fork_safe``)."""
        self.processes = check_session_processes(host, processes)
        self.host = host
        self.session_timeout = self.default_timeout if session_timeout is None else session_timeout
        self.limits = limits if limits is not None else self.default_limits
        self.log = logging.getLogger(self.log_name)
        self.sock = listen(address, port)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._active = 0
        self._per_address: dict[str, int] = {}
        self._lingering: OrderedDict = OrderedDict()  # refused socket -> time to close it
        self._selector = None
        self._pool = None  # SessionWorkerPool when processes > 1
        self.sessions_served = 0
        self.sessions_failed = 0
        self.sessions_refused = 0

    def new_session(self, chan) -> MessageSession:
        raise NotImplementedError

    @property
    def active_sessions(self) -> int:
        """Sessions open now (accepted and not yet ended)."""
        with self._lock:
            return self._active

    def serve_forever(self) -> None:
        sel = self._selector = selectors.DefaultSelector()
        self.sock.setblocking(False)
        try:
            sel.register(self.sock, selectors.EVENT_READ)
            if self.processes > 1:
                self._start_pool()
            while not self._stop.is_set():
                try:
                    events = sel.select(timeout=0.5)
                except (OSError, ValueError):
                    break
                for key, _ in events:
                    if key.fileobj is self.sock:
                        if not self._accept_one():
                            return
                    elif key.data == "worker":
                        self._worker_report(key.fileobj)
                    else:
                        self._drain(key.fileobj)
                now = time.monotonic()
                while self._lingering and next(iter(self._lingering.values())) <= now:
                    self._drop_lingering(next(iter(self._lingering)))
        finally:
            for conn in list(self._lingering):
                self._drop_lingering(conn)
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            sel.close()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------ admission

    def _accept_one(self) -> bool:
        """Accept one pending connection; False when the listening socket is gone."""
        try:
            conn, peer = self.sock.accept()
        except (BlockingIOError, InterruptedError, socket.timeout):
            return True
        except OSError:
            return not self._stop.is_set() and self.sock.fileno() >= 0
        busy = self._admit(peer[0])
        if busy is not None:
            self._refuse(conn, peer, busy)
            return True
        if self._pool is not None:
            if not self._pool.dispatch(conn, peer):
                self._release(peer[0])
                self._refuse(conn, peer, "no session worker available")
            return True
        try:
            threading.Thread(target=self._session, args=(conn, peer), daemon=True, name=self.thread_name).start()
        except RuntimeError:  # no thread to be had: refuse, do not crash the accept loop
            self._release(peer[0])
            self._refuse(conn, peer, "no thread available for a new session")
        return True

    # ------------------------------------------------------------ worker processes

    def _start_pool(self) -> None:
        pool = SessionWorkerPool(self.processes, self._run_session,
                                 inherited=lambda: [self.sock, self._selector, *self._lingering],
                                 thread_name=self.thread_name, log=self.log)
        pool.start()
        for control in pool.control_sockets():
            self._selector.register(control, selectors.EVENT_READ, "worker")
        self._pool = pool
        self.log.info("sessions run in %d worker processes", self.processes)

    def _worker_report(self, control) -> None:
        """A worker's control socket is readable: sessions ended (or the worker did)."""
        before = set(self._pool.control_sockets())
        for ip, ok in self._pool.handle(control):
            self._ended(ip, ok)
        after = set(self._pool.control_sockets())
        for gone in before - after:
            try:
                self._selector.unregister(gone)
            except (KeyError, ValueError, OSError):
                pass
        for new in after - before:
            self._selector.register(new, selectors.EVENT_READ, "worker")

    def _admit(self, ip: str) -> str | None:
        """Take a session slot for ``ip``, or say why none is free."""
        lim = self.limits
        with self._lock:
            if self._active >= lim.max_sessions:
                return f"all {lim.max_sessions} session slots are taken; try again later"
            if self._per_address.get(ip, 0) >= lim.max_sessions_per_address:
                return (f"{lim.max_sessions_per_address} sessions from your address are open (the limit per "
                        "address); close one or try again later")
            self._active += 1
            self._per_address[ip] = self._per_address.get(ip, 0) + 1
        return None

    def _release(self, ip: str) -> None:
        with self._lock:
            self._active -= 1
            left = self._per_address.get(ip, 1) - 1
            if left:
                self._per_address[ip] = left
            else:
                self._per_address.pop(ip, None)

    def _refuse(self, conn: socket.socket, peer, reason: str) -> None:
        """Tell a client the server is busy and close its connection, without a thread:
        the error frame goes out, the sending side is shut, and what the client sends
        meanwhile is drained for a moment so that closing does not reset the
        connection before the client has read the error."""
        with self._lock:
            self.sessions_refused += 1
        self.log.warning("session %s:%s refused: server busy", peer[0], peer[1])
        try:
            conn.setblocking(False)
            conn.send(_error_frame(f"server busy: {reason}"))  # a few hundred bytes: fits a fresh socket's buffer
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if self._selector is None:
            conn.close()
            return
        if len(self._lingering) >= _MAX_LINGERING:
            self._drop_lingering(next(iter(self._lingering)))
        self._lingering[conn] = time.monotonic() + _LINGER_SECONDS
        try:
            self._selector.register(conn, selectors.EVENT_READ)
        except (OSError, ValueError, KeyError):
            self._drop_lingering(conn)

    def _drain(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_lingering(conn)

    def _drop_lingering(self, conn: socket.socket) -> None:
        self._lingering.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError, OSError, AttributeError):
            pass
        conn.close()

    # ------------------------------------------------------------ one session

    def _session(self, conn: socket.socket, peer) -> None:
        """One session in a thread of this process: run it, then count it and free its slot."""
        ok = False
        try:
            ok = self._run_session(conn, peer)
        finally:
            self._ended(peer[0], ok)

    def _ended(self, ip: str, ok: bool) -> None:
        """A session from ``ip`` has ended (in a thread or a worker): count it, free its slot."""
        with self._lock:
            self.sessions_served += 1
            self.sessions_failed += 0 if ok else 1
        self._release(ip)

    def _run_session(self, conn: socket.socket, peer) -> bool:
        """Run one session on an accepted connection to its end; True when it ended with a bye.
        Never raises: a fault is logged (by kind, no payload) and reported to the client."""
        lim = self.limits
        sid = f"{peer[0]}:{peer[1]}"
        chan = None
        ok = False
        session = None
        expires_at = None if lim.session_lifetime is None else time.monotonic() + lim.session_lifetime
        try:
            chan = TCPChannel(conn, timeout=self.session_timeout, max_frame=lim.pre_hello_max_frame)
            chan.deadline = expires_at
            self.log.info("session %s opened", sid)
            session = self.new_session(chan)
            session.limits = lim
            session.expires_at = expires_at
            session.run()
            ok = True
            self.log.info("session %s closed", sid)
        except self.expected_errors as exc:
            if (isinstance(exc, ChannelTimeout) and expires_at is not None and time.monotonic() >= expires_at):
                exc = LimitExceeded(f"session lifetime of {lim.session_lifetime:g} s reached")
            self.log.warning("session %s ended: %s: %s", sid, type(exc).__name__, short_error(exc))
            if chan is not None:
                chan.deadline = None  # the error report may still go out (within the idle timeout)
                try_send_error(chan, f"{type(exc).__name__}: {short_error(exc)}")
        except Exception as exc:  # one broken session must not stop the server
            self.log.warning("session %s failed: %s", sid, type(exc).__name__)
            self.log.debug("session %s traceback", sid, exc_info=True)
            if chan is not None:
                chan.deadline = None
                try_send_error(chan, f"internal error: {type(exc).__name__}")
        finally:
            try:
                if session is not None:
                    session.close()
            except Exception as exc:
                self.log.warning("session %s: releasing its state failed: %s", sid, type(exc).__name__)
            finally:
                if chan is not None:
                    chan.close()
                else:
                    conn.close()
        return ok


class SessionClient:
    """Client-side helpers shared by the modes' clients (``self.chan`` is the session's channel)."""

    def server_stats(self) -> dict:
        self.chan.send({"type": "stats"})
        return expect(self.chan.recv(), "stats")

    def close(self) -> None:
        try:
            self.chan.send({"type": "bye"})
        except Exception:
            pass
        self.chan.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

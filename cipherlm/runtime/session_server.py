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
"""

from __future__ import annotations

import logging
import socket
import threading

from cipherlm.net.channel import ChannelClosed, ChannelTimeout, FrameError, TCPChannel, listen
from cipherlm.runtime.offload_protocol import ProtocolError, expect

__all__ = ["SessionServer", "MessageSession", "SessionClient", "short_error", "try_send_error"]


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
    have ``host`` (with ``name`` and ``welcome()``) and ``chan``.
    """

    mode: str = ""
    protocol_version: int = 1
    handshake_step: str = "setup"
    handlers: dict = {}

    def check_hello(self) -> None:
        hello = expect(self.chan.recv(), "hello")
        if hello.get("protocol") != self.protocol_version:
            raise ProtocolError(f"protocol version {hello.get('protocol')!r} not supported "
                                f"(this server speaks {self.protocol_version})")
        mode = hello.get("mode", self.mode)
        if mode != self.mode:
            raise ProtocolError(f"this server runs the {self.mode} mode, not {mode!r}")
        wanted = hello.get("model")
        if wanted not in (None, self.host.name):
            raise ProtocolError(f"unknown model {wanted!r}: this server serves {self.host.name!r}")

    def run(self) -> None:
        self.check_hello()
        with self.chan.step(self.handshake_step):
            self.chan.send(self.host.welcome())
        while True:
            msg = self.chan.recv()
            if not isinstance(msg, dict):
                raise ProtocolError("expected a message dict")
            kind = msg.get("type")
            if kind == "bye":
                return
            handler = self.handlers.get(kind)
            if handler is None:
                raise ProtocolError(f"unexpected message type {kind!r}")
            handler(self, msg)

    def close(self) -> None:
        """Release what the session holds (nothing by default)."""


class SessionServer:
    """Accepts sessions on a TCP port, one thread per session, for one model host.

    Subclasses implement ``new_session(chan)`` and may extend
    ``expected_errors`` (faults logged as warnings with their message; any
    other exception is logged by type only).
    """

    expected_errors: tuple = (ChannelClosed, ChannelTimeout, FrameError, ProtocolError)
    thread_name = "session"

    def __init__(self, host, address: str = "127.0.0.1", port: int = 0, session_timeout: float = 300.0,
                 log: logging.Logger | None = None):
        self.host = host
        self.session_timeout = session_timeout
        self.log = log or logging.getLogger("cipherlm.serve")
        self.sock = listen(address, port)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.sessions_served = 0
        self.sessions_failed = 0

    def new_session(self, chan) -> MessageSession:
        raise NotImplementedError

    def serve_forever(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._session, args=(conn, peer), daemon=True, name=self.thread_name).start()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass

    def _session(self, conn: socket.socket, peer) -> None:
        chan = TCPChannel(conn, timeout=self.session_timeout)
        sid = f"{peer[0]}:{peer[1]}"
        self.log.info("session %s opened", sid)
        ok = False
        session = None
        try:
            session = self.new_session(chan)
            session.run()
            ok = True
            self.log.info("session %s closed", sid)
        except self.expected_errors as exc:
            self.log.warning("session %s ended: %s: %s", sid, type(exc).__name__, short_error(exc))
            try_send_error(chan, f"{type(exc).__name__}: {short_error(exc)}")
        except Exception as exc:  # one broken session must not stop the server
            self.log.warning("session %s failed: %s", sid, type(exc).__name__)
            self.log.debug("session %s traceback", sid, exc_info=True)
            try_send_error(chan, f"internal error: {type(exc).__name__}")
        finally:
            if session is not None:
                session.close()
            with self._lock:
                self.sessions_served += 1
                self.sessions_failed += 0 if ok else 1
            chan.close()


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

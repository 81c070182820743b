"""Worker processes that run a session server's sessions, so N sessions use N cores.

SEAL (the offload projections, the 2pc linear layers) holds the GIL for the
whole of every call, so sessions in threads of one process share one core's
HE throughput.  A `SessionWorkerPool` forks W worker processes once, after the
server's model host is built: they share its encoded weights copy-on-write
(nothing is loaded twice) and each runs its sessions in threads of its own.

The parent keeps what must be global: it accepts connections, applies the
admission limits (`ServerLimits.max_sessions`, per address), and hands each
admitted connection's socket to the least-loaded worker over an AF_UNIX
SOCK_SEQPACKET pair (`socket.send_fds`: the descriptor itself moves, no byte
of the session passes through the parent).  The worker answers
``{"done": token, "ok": bool}`` when the session ends, which frees the slot.

Isolation: a session's keys and state live in the worker that runs it and die
with the session (`MessageSession.close`), as in the thread model; workers
share nothing writable with each other or with the parent.

Faults: a worker that dies (killed, crashed) loses only the sessions it ran:
the parent sees the end of its control socket, counts those sessions as
failed, frees their slots, and forks a replacement.  A worker exits when its
control socket closes (the server shut down: running sessions get a few
seconds to end), and at once when the server process dies (Linux
``PR_SET_PDEATHSIG``), so a killed server ends its sessions as a server of
threads does.

Not fork-safe hosts: a host whose libraries run threads of their own (the Go
runtime of the Lattigo backend, the spawn-context HE pool of ``--workers``)
must not be forked; such hosts say so with ``fork_safe = False`` and the
server refuses worker processes for them (Lattigo releases the GIL in every
call, so its sessions already use every core in threads).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time

__all__ = ["SessionWorkerPool", "SessionProcessesError", "default_session_processes", "session_processes_for"]

_CONTROL_MAX = 4096  # bytes of one control message (a peer address, a token)
_EXIT_GRACE = 3.0  # seconds shut-down waits for workers before killing them


def default_session_processes() -> int:
    """Worker processes by default: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class SessionProcessesError(ValueError):
    """Worker processes asked for that cannot be had (a bad count, a host that is not fork-safe)."""


def check_session_processes(host, processes) -> int:
    """``processes`` when a server for ``host`` can run that many (else SessionProcessesError)."""
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise SessionProcessesError(f"session processes must be a positive integer, got {processes!r}")
    if processes > 1 and not getattr(host, "fork_safe", True):
        raise SessionProcessesError("this model host cannot run sessions in worker processes: "
                                    + getattr(host, "fork_unsafe_reason", "its libraries are not fork-safe"))
    return processes


def session_processes_for(host, asked: int | None) -> int:
    """The worker processes a server runs for ``host``: ``asked`` when given (1: threads),
    else one per core when the host is fork-safe, else 1."""
    if asked is not None:
        return check_session_processes(host, asked)
    return default_session_processes() if getattr(host, "fork_safe", True) else 1


class _Worker:
    def __init__(self, pid: int, control: socket.socket):
        self.pid = pid
        self.control = control
        self.tokens: dict[int, str] = {}  # sessions it runs now: token -> client IP


class SessionWorkerPool:
    """W forked worker processes running ``run_session(conn, peer) -> ok`` each in a thread.

    Parent side only: `start`, `dispatch`, `handle` (on a readable control socket),
    `control_sockets`, `close`.  ``inherited()`` gives what a new child must close (the
    listening socket, refused connections being drained, the parent's selector);
    ``thread_name`` names the session threads.
    """

    def __init__(self, processes: int, run_session, inherited=lambda: (), thread_name: str = "session",
                 log: logging.Logger | None = None):
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"session worker processes must be a positive integer, got {processes!r}")
        self.processes = processes
        self.run_session = run_session
        self.inherited = inherited
        self.thread_name = thread_name
        self.log = log or logging.getLogger("cipherlm.serve")
        self.workers: dict[socket.socket, _Worker] = {}
        self.respawned = 0
        self._next_token = 0

    # ------------------------------------------------------------ parent side

    def start(self) -> None:
        for _ in range(self.processes):
            self._spawn()

    def control_sockets(self) -> list[socket.socket]:
        return list(self.workers)

    def dispatch(self, conn: socket.socket, peer) -> bool:
        """Give an admitted connection to the least-loaded live worker; False when none took it.
        When True, the parent's copy of the socket is closed."""
        self._next_token += 1
        token = self._next_token
        for worker in sorted(self.workers.values(), key=lambda w: len(w.tokens)):
            msg = json.dumps({"peer": [str(peer[0]), int(peer[1])], "token": token}).encode()
            try:
                socket.send_fds(worker.control, [msg], [conn.fileno()])
            except OSError:
                continue  # a dying worker: its end is handled when its control socket reads EOF
            worker.tokens[token] = str(peer[0])
            conn.close()
            return True
        return False

    def handle(self, control: socket.socket) -> list[tuple[str, bool]]:
        """Read what a worker reported: (client IP, ok) for each session that ended.  A
        worker that has gone reports its sessions as failed and is replaced."""
        worker = self.workers.get(control)
        if worker is None:
            return []
        try:
            data = control.recv(_CONTROL_MAX)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if data:
            try:
                done = json.loads(data)
                token, ok = int(done["done"]), bool(done["ok"])
            except (ValueError, KeyError, TypeError):
                return []
            ip = worker.tokens.pop(token, None)
            return [] if ip is None else [(ip, ok)]
        lost = [(ip, False) for ip in worker.tokens.values()]
        self._bury(worker)
        self.log.warning("session worker %d ended with %d session%s open; starting another", worker.pid,
                         len(lost), "" if len(lost) == 1 else "s")
        try:
            self._spawn()
            self.respawned += 1
        except OSError as exc:
            self.log.warning("could not start a session worker: %s", type(exc).__name__)
        return lost

    def close(self) -> None:
        """Close the control sockets (workers exit when their sessions have ended) and
        wait for them a moment; workers still running after that are killed."""
        workers = list(self.workers.values())
        self.workers.clear()
        for w in workers:
            try:
                w.control.close()
            except OSError:
                pass
        deadline = time.monotonic() + _EXIT_GRACE
        for w in workers:
            while time.monotonic() < deadline and not _reaped(w.pid):
                time.sleep(0.02)
            if not _reaped(w.pid):
                try:
                    os.kill(w.pid, signal.SIGKILL)
                    os.waitpid(w.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass

    def _bury(self, worker: _Worker) -> None:
        self.workers.pop(worker.control, None)
        try:
            worker.control.close()
        except OSError:
            pass
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(worker.pid, 0)
        except ChildProcessError:
            pass

    def _spawn(self) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the caller's code
            code = 0
            try:
                parent_end.close()
                for s in list(self.inherited()) + [w.control for w in self.workers.values()]:
                    try:
                        s.close()
                    except OSError:
                        pass
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
                _die_with_parent(parent_pid)
                self._serve(child_end)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        child_end.close()
        parent_end.setblocking(False)
        self.workers[parent_end] = _Worker(pid, parent_end)

    # ------------------------------------------------------------ worker side

    def _serve(self, control: socket.socket) -> None:
        """A worker's loop: take connections from the parent, run each in a thread,
        report its end; return when the parent closes the control socket."""
        send_lock = threading.Lock()
        threads: list[threading.Thread] = []

        def run(conn: socket.socket, peer, token: int) -> None:
            ok = False
            try:
                ok = bool(self.run_session(conn, peer))
            finally:
                with send_lock:
                    try:
                        control.send(json.dumps({"done": token, "ok": ok}).encode())
                    except OSError:
                        pass

        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(control, _CONTROL_MAX, 1)
            except InterruptedError:
                continue
            except OSError:
                break
            if not msg:
                for fd in fds:
                    os.close(fd)
                break
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                continue
            conn = socket.socket(fileno=fds[0])
            try:
                order = json.loads(msg)
                peer, token = (order["peer"][0], int(order["peer"][1])), int(order["token"])
            except (ValueError, KeyError, TypeError, IndexError):
                conn.close()
                continue
            t = threading.Thread(target=run, args=(conn, peer, token), daemon=True, name=self.thread_name)
            t.start()
            threads = [x for x in threads if x.is_alive()] + [t]
        for t in threads:  # the server is shutting down: let running sessions end (they have timeouts)
            t.join()


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this worker when the server process dies (``PR_SET_PDEATHSIG``), so
    that a killed server takes its sessions with it, as a server of threads does.  Elsewhere
    a worker outlives its parent until its sessions end (it takes no new ones)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the server died before the request took effect
        os._exit(1)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid

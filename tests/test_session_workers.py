"""Sessions in worker processes (`session_workers.SessionWorkerPool`, `SessionServer(processes=W)`).

A server forks W workers after its host is built; concurrent sessions run in them (so N
sessions use N cores: timing is measured in benchmarks/bench_concurrency.py, not here).
Checked here: answers identical to the thread server's solo answers, sessions spread over
worker processes other than the server's, admission limits global across workers (busy
past them, slots freed when sessions end), a killed worker losing only its own sessions and
being replaced, fork-unsafe hosts refused with a clear error, workers reaped at shut-down.

Servers run in threads of the test process with a tiny random Llama (as in test_offload.py).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import wait_for

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cipherlm.net.channel import ChannelClosed  # noqa: E402
from cipherlm.runtime.offload_client import OffloadClient  # noqa: E402
from cipherlm.runtime.offload_protocol import RemoteError  # noqa: E402
from cipherlm.runtime.offload_server import OffloadServer  # noqa: E402
from cipherlm.runtime.session_workers import SessionProcessesError, session_processes_for  # noqa: E402

PROMPTS = [[1, 2, 3], [5, 7], [11, 4, 9, 2], [3]]
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def host(tiny_offload_host):
    return tiny_offload_host


@pytest.fixture
def serve(serve_offload):
    return functools.partial(serve_offload, processes=2, session_timeout=30.0)



def _answer(addr, prompt) -> list[int]:
    with OffloadClient(*addr, timeout=60) as client:
        return list(client.executor().generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=[]))


def _children() -> set[int]:
    """PIDs of this process's live children (from /proc)."""
    me = str(os.getpid())
    kids = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            kids.add(int(pid))
    return kids


def test_concurrent_sessions_in_workers_equal_solo_answers(serve, host, tmp_path, monkeypatch):
    solo_srv = serve(processes=1)
    solo = [_answer(solo_srv.address, p) for p in PROMPTS]

    # record which process evaluates each ciphertext (the forked workers inherit the wrapper)
    log = tmp_path / "pids"
    apply = host.engine.apply

    def traced(*a, **kw):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return apply(*a, **kw)

    monkeypatch.setattr(host.engine, "apply", traced)
    srv = serve(processes=2)
    wait_for(lambda: srv._pool is not None, "the worker pool started")
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        answers = list(ex.map(lambda p: _answer(srv.address, p), PROMPTS))
    assert answers == solo
    pids = {int(x) for x in log.read_text().split()}
    assert os.getpid() not in pids, "a session ran in the server's own process"
    assert len(pids) == 2, f"sessions ran in {len(pids)} processes, not the 2 workers"
    wait_for(lambda: srv.sessions_served == len(PROMPTS), "every session counted")
    assert srv.sessions_failed == 0 and srv.active_sessions == 0


def test_limits_are_global_across_workers_and_slots_come_back(serve):
    srv = serve(processes=2, max_sessions=2)
    first, second = OffloadClient(*srv.address), OffloadClient(*srv.address)
    try:
        wait_for(lambda: srv.active_sessions == 2, "two sessions admitted")
        with pytest.raises((RemoteError, ChannelClosed), match="busy"):
            OffloadClient(*srv.address)
        assert srv.sessions_refused == 1
    finally:
        first.close()
        second.close()
    wait_for(lambda: srv.active_sessions == 0, "the workers reported both sessions' end")
    assert _answer(srv.address, PROMPTS[0])  # a slot is free again
    assert srv.sessions_failed == 0


def test_killed_worker_loses_only_its_sessions_and_is_replaced(serve):
    srv = serve(processes=2)
    wait_for(lambda: srv._pool is not None, "the worker pool started")
    victim = OffloadClient(*srv.address, timeout=20)
    wait_for(lambda: srv.active_sessions == 1, "the session admitted")
    (worker,) = [w for w in srv._pool.workers.values() if w.tokens]
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises((ChannelClosed, RemoteError, ConnectionError, OSError)):
        victim.executor().generate([1, 2], max_new_tokens=2, eos_token_ids=[])
    victim.chan.close()
    wait_for(lambda: srv.active_sessions == 0 and srv.sessions_failed == 1, "the lost session freed and counted")
    wait_for(lambda: len(srv._pool.workers) == 2 and srv._pool.respawned == 1, "a replacement worker")
    assert worker.pid not in {w.pid for w in srv._pool.workers.values()}
    with ThreadPoolExecutor(2) as ex:  # both workers serve again
        assert all(ex.map(lambda p: _answer(srv.address, p), PROMPTS[:2]))


def test_workers_exit_at_shutdown(host):
    before = _children()
    srv = OffloadServer(host, "127.0.0.1", 0, processes=2)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    wait_for(lambda: srv._pool is not None, "the worker pool started")
    pids = {w.pid for w in srv._pool.workers.values()}
    assert len(pids) == 2 and pids <= _children()
    assert _answer(srv.address, PROMPTS[1])
    srv.shutdown()
    t.join(timeout=15)
    assert not t.is_alive()
    wait_for(lambda: not (_children() - before) & pids, "the workers gone and reaped")


def test_fork_unsafe_host_refused(host, monkeypatch):
    monkeypatch.setattr(host, "fork_safe", False)
    monkeypatch.setattr(host, "fork_unsafe_reason", "test reason")
    with pytest.raises(SessionProcessesError, match="test reason"):
        OffloadServer(host, "127.0.0.1", 0, processes=2)
    assert session_processes_for(host, None) == 1  # the default falls back to threads
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SessionProcessesError):
            session_processes_for(host, bad)


def test_lattigo_and_he_pool_hosts_are_not_fork_safe():
    class Fake:
        pass

    seal = Fake()
    seal.fork_safe = True
    assert session_processes_for(seal, None) >= 1
    assert session_processes_for(seal, 3) == 3

"""A bounded load test of the proxy (issue 19, item 4): 8 concurrent OpenAI clients x 8 tokens
on loopback, through `cipherlm proxy` to an offload server whose sessions run in 2 worker
processes (tiny random Llama, character tokenizer: the fixtures of test_proxy.py).

Checked: every answer equals the answer of the same request run alone (a session that
leaked keys or cache into another would change it), streamed and non-streamed alike; every
session ends (the server's and the proxy's counts of open sessions return to 0, none failed);
memory returns to its level after a first round: the proxy's Python heap (tracemalloc) and the
server workers' resident sets (/proc).  Throughput and latency are reported by
benchmarks/bench_proxy_load.py, not asserted here.
"""

from __future__ import annotations

import gc
import threading
import tracemalloc

import pytest
from conftest import wait_for

from test_proxy import RunningProxy, chat_dir, monkeypatch_module  # noqa: F401 (fixtures)

from cipherlm.bench.load import run_load, solo_answers
from cipherlm.runtime.offload_server import ModelHost, OffloadServer
from cipherlm.runtime.proxy import ChatTemplate, ProxyApp
from cipherlm.runtime.session_server import ServerLimits

CLIENTS = 8
TOKENS = 8
ASKS = [[{"role": "user", "content": c}] for c in
        ("alpha?", "bravo", "charlie!", "delta 4", "echo, echo", "foxtrot.", "golf:", "hotel 8")]
HEAP_SLACK = 4 << 20  # bytes of the proxy's heap that may stay after a round (caches, pools)
RSS_SLACK = 0.10  # fraction a worker's resident set may grow between two identical rounds


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")



@pytest.fixture(scope="module")
def loaded(chat_dir):  # noqa: F811
    # one proxy is one address: it may open all of its clients' sessions (the default allows 4)
    server = OffloadServer(ModelHost(str(chat_dir)), "127.0.0.1", 0, session_timeout=60.0, processes=2,
                           limits=ServerLimits(max_sessions_per_address=CLIENTS))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    wait_for(lambda: server._pool is not None, "the session workers started")
    proxy = RunningProxy(ProxyApp([server.address], "offload",
                                  chat_template=ChatTemplate.from_file(chat_dir / "tokenizer_config.json")))
    yield server, proxy
    proxy.stop()
    server.shutdown()
    thread.join(timeout=10)


def test_eight_concurrent_clients_equal_solo_answers_and_memory_returns(loaded):
    server, proxy = loaded
    client = proxy.client()
    model = "tiny-chat"
    solo = solo_answers(client, model, ASKS, TOKENS)
    assert len(set(solo)) > 1, "the prompts should not all give the same answer"
    workers = [w.pid for w in server._pool.workers.values()]

    def round_() -> None:
        result = run_load(client, model, ASKS, TOKENS, concurrency=CLIENTS)
        assert result.answers == solo
        assert all(r.completion_tokens <= TOKENS for r in result.results)
        assert all(r.first_token_s is not None for r in result.results if r.stream)
        wait_for(lambda: server.active_sessions == 0, "every server session ended")
        wait_for(lambda: proxy.proxy.active_jobs == 0, "every proxy job ended")

    round_()  # the first round brings caches and pools to their working size
    gc.collect()
    tracemalloc.start()
    try:
        heap_before = tracemalloc.get_traced_memory()[0]
        rss_before = {pid: _rss(pid) for pid in workers}
        served_before = server.sessions_served
        round_()
        gc.collect()
        heap_after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    rss_after = {pid: _rss(pid) for pid in workers}
    assert heap_after - heap_before < HEAP_SLACK, f"the proxy kept {heap_after - heap_before} bytes"
    for pid in workers:
        assert rss_after[pid] <= rss_before[pid] * (1 + RSS_SLACK), (pid, rss_before[pid], rss_after[pid])
    assert server.sessions_failed == 0
    assert server.sessions_served - served_before == len(ASKS)  # one session per request, all ended

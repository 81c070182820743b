"""A bounded load run against an OpenAI-compatible endpoint (`cipherlm proxy`).

Issue 19, item 4: "a load test with a bounded count and time (e.g. 8 concurrent proxy
clients x 8 tokens on loopback)".  `run_load` sends a list of chat requests with at most
``concurrency`` in flight (every other one streamed, so both paths are loaded), each with
greedy decoding and a fixed ``max_tokens``, and measures per request: wall seconds, time to
the first streamed token, completion tokens.  `LoadResult` gives throughput (completion
tokens / wall seconds of the whole run) and latency percentiles.  The caller compares the
answers with solo runs (`solo_answers`): a session that leaked into another shows up as
a different answer.  Used by tests/test_proxy_load.py (tiny models, bounded) and
benchmarks/bench_proxy_load.py (the figures in docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["LoadResult", "RequestResult", "chat_once", "run_load", "solo_answers"]


@dataclasses.dataclass
class RequestResult:
    text: str
    seconds: float
    first_token_s: float | None  # streamed requests only
    completion_tokens: int
    stream: bool


@dataclasses.dataclass
class LoadResult:
    results: list[RequestResult]  # in the order of the asks
    wall_s: float
    concurrency: int

    @property
    def answers(self) -> list[str]:
        return [r.text for r in self.results]

    def summary(self) -> dict:
        lat = np.array([r.seconds for r in self.results])
        ttft = np.array([r.first_token_s for r in self.results if r.first_token_s is not None])
        tokens = sum(r.completion_tokens for r in self.results)
        pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None  # noqa: E731
        return {"requests": len(self.results), "concurrency": self.concurrency, "wall_s": self.wall_s,
                "completion_tokens": tokens, "tokens_per_s": tokens / self.wall_s if self.wall_s else None,
                "latency_s": {"p50": pct(lat, 50), "p95": pct(lat, 95), "max": float(lat.max())},
                "first_token_s": {"p50": pct(ttft, 50), "p95": pct(ttft, 95)}}


def chat_once(client, model: str, messages: list[dict], max_tokens: int, stream: bool) -> RequestResult:
    """One greedy chat completion through an `openai.OpenAI` client, timed."""
    t0 = time.perf_counter()
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        return RequestResult(r.choices[0].message.content or "", time.perf_counter() - t0, None,
                             r.usage.completion_tokens, False)
    parts, first, tokens = [], None, 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return RequestResult("".join(parts), time.perf_counter() - t0, first, tokens, True)


def run_load(client, model: str, asks: list[list[dict]], max_tokens: int, concurrency: int) -> LoadResult:
    """All ``asks`` with at most ``concurrency`` in flight; odd-numbered ones streamed."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda ia: chat_once(client, model, ia[1], max_tokens, stream=ia[0] % 2 == 1),
                                enumerate(asks)))
    return LoadResult(results, time.perf_counter() - t0, concurrency)


def solo_answers(client, model: str, asks: list[list[dict]], max_tokens: int) -> list[str]:
    """Each ask run alone (one at a time; odd-numbered ones streamed as in `run_load`): the
    reference answers."""
    return run_load(client, model, asks, max_tokens, concurrency=1).answers

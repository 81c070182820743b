"""Concurrent offload sessions on one server: aggregate tokens per second, N sessions vs one.

Issue 19, item 3: sessions run in worker processes (`cipherlm serve --session-processes`,
default one per core), so N sessions use N cores although SEAL holds the GIL.  This
benchmark starts one `cipherlm serve --mode offload` process, then in one run:

1. one client alone (the solo phase), then
2. ``--sessions`` clients at once (the concurrent phase),

each client a process of its own (a user's machine), all with the same prompt ids and
greedy decoding, so every answer must equal the solo answer.  It repeats the pair
``--rounds`` times (solo and concurrent alternate, so background load falls on both);
``--compare-threads`` runs the same against a server whose sessions are threads
(``--session-processes 1``), the A/B of this feature in one run.  The machine's own
ceiling (n busy processes vs one, `cpu_ceiling`) is measured before and after.

Reported per phase: new tokens / wall seconds from the first client's first request to the
last client's last token (``tok_s``), the same for decode tokens only (after each
client's first token), per-token latency p50/p95 and time to first token; the ratio
concurrent / solo; machine (nproc, load average before and after).  Session set-up (hello,
bundle, keys) is excluded: direct clients do it, then wait at a barrier until every client
of the phase is set up, then start their clocks together (through the proxy, set-up is
part of each request and is included).

    .venv/bin/python benchmarks/bench_concurrency.py --model smollm2-135m --sessions 4 \\
        --prompt-tokens 2 --new-tokens 4 --report benchmarks/results/concurrency.json
    .venv/bin/python benchmarks/bench_concurrency.py --via proxy ...   # the same through `cipherlm proxy`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def client_main(addr: str, prompt: list[int], new_tokens: int) -> None:
    """One client process: a session, greedy generation, timings as one JSON line on stdout.
    ``addr`` HOST:PORT is a `cipherlm serve`; an http:// URL is a `cipherlm proxy` (then the
    clock includes the proxy's session set-up, which a direct client does before ``t0``)."""
    stamps: list[float] = []
    if addr.startswith("http"):
        import openai

        client = openai.OpenAI(base_url=addr, api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        t0 = time.time()
        parts = []
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                               stream=True):
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.time())
                parts.append(chunk.choices[0].text)
        print(json.dumps({"ids": "".join(parts), "t0": t0, "stamps": stamps}), flush=True)
        return
    from cipherlm.runtime.offload_client import OffloadClient

    host, _, port = addr.rpartition(":")
    with OffloadClient(host, int(port), timeout=600) as client:
        ex = client.executor()
        print("READY", flush=True)  # set-up done: wait until every client of the phase is
        sys.stdin.readline()  # ready, so no handshake overlaps the measured generation
        t0 = time.time()
        ids = ex.generate(prompt, max_new_tokens=new_tokens, eos_token_ids=[],
                          on_token=lambda _t: stamps.append(time.time()))
    print(json.dumps({"ids": [int(i) for i in ids], "t0": t0, "stamps": stamps}), flush=True)


def start_proxy(server: str) -> tuple[subprocess.Popen, str]:
    """`cipherlm proxy` in front of ``server`` on a free port; returns (process, base URL)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cipherlm", "proxy", "--server", server, "--mode", "offload",
                             "--port", str(port)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return proc, url + "/v1"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the proxy did not come up")


def run_phase(addr: str, n: int, prompt: list[int], new_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--client", addr, "--prompt-ids", ",".join(map(str, prompt)),
           "--new-tokens", str(new_tokens)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    if not addr.startswith("http"):  # direct clients wait at a barrier after their set-up
        for p in procs:
            if p.stdout.readline().strip() != "READY":
                raise SystemExit("a client failed during its set-up")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    runs = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"a client failed with exit code {p.returncode}")
        runs.append(json.loads(out.strip().splitlines()[-1]))
    start = min(r["t0"] for r in runs)
    end = max(r["stamps"][-1] for r in runs)
    first = [r["stamps"][0] - r["t0"] for r in runs]
    gaps = np.concatenate([np.diff(r["stamps"]) for r in runs])
    decode_start = min(r["stamps"][0] for r in runs)
    decode_tokens = sum(len(r["stamps"]) - 1 for r in runs)
    return {
        "sessions": n,
        "answers": [r["ids"] for r in runs],
        "tokens": sum(len(r["stamps"]) for r in runs),
        "wall_s": end - start,
        "tok_s": sum(len(r["stamps"]) for r in runs) / (end - start),
        "decode_tok_s": decode_tokens / (end - decode_start) if decode_tokens else None,
        "first_token_s": {"p50": float(np.percentile(first, 50)), "max": float(max(first))},
        "per_token_s": {"p50": float(np.percentile(gaps, 50)), "p95": float(np.percentile(gaps, 95))}
        if len(gaps) else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--session-processes", type=int, default=None, help="the server's (default: one per core)")
    ap.add_argument("--prompt-tokens", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--via", choices=("direct", "proxy"), default="direct",
                    help="clients talk to the server (direct) or to one `cipherlm proxy` (OpenAI streaming "
                         "completions; the proxy holds every session's keys)")
    ap.add_argument("--compare-threads", action="store_true",
                    help="also run the same phases against a server with --session-processes 1 (sessions in "
                         "threads), in the same run")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more `cipherlm serve` argument (repeat; e.g. --server-arg=--he-backend "
                         "--server-arg=lattigo)")
    ap.add_argument("--report", metavar="FILE")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client_main(args.client, [int(x) for x in args.prompt_ids.split(",")], args.new_tokens)
        return

    from cipherlm.launch import start_server_process, stop_process

    prompt = [int(i) for i in np.random.default_rng(0).integers(10, 1000, size=args.prompt_tokens)]
    load_before = os.getloadavg()
    ceiling_before = cpu_ceiling(min(args.sessions, os.cpu_count() or 1))
    print(f"machine: {ceiling_before:.2f}x one process's CPU throughput with all cores busy", file=sys.stderr)
    configs = [("processes", args.session_processes)] + ([("threads", 1)] if args.compare_threads else [])
    results = {}
    for name, processes in configs:
        extra = ["--max-sessions-per-address", str(max(4, args.sessions)), *args.server_arg]  # proxy: one address
        if processes is not None:
            extra += ["--session-processes", str(processes)]
        t0 = time.time()
        proc, (host, port) = start_server_process(args.model, timeout=1800, extra_args=extra)
        print(f"[{name}] server ready in {time.time() - t0:.0f} s", file=sys.stderr)
        addr = f"{host}:{port}"
        proxy = None
        rounds = results[name] = []
        try:
            if args.via == "proxy":
                proxy, addr = start_proxy(addr)
            for r in range(args.rounds):
                solo = run_phase(addr, 1, prompt, args.new_tokens)
                many = run_phase(addr, args.sessions, prompt, args.new_tokens)
                print(f"[{name}] round {r}: solo {solo['tok_s']:.3f} tok/s, {args.sessions} sessions "
                      f"{many['tok_s']:.3f} tok/s (x{many['tok_s'] / solo['tok_s']:.2f})", file=sys.stderr)
                rounds.append({"solo": solo, "concurrent": many,
                               "ratio": many["tok_s"] / solo["tok_s"],
                               "decode_ratio": (many["decode_tok_s"] / solo["decode_tok_s"])
                               if many["decode_tok_s"] and solo["decode_tok_s"] else None,
                               "identical": all(a == solo["answers"][0] for a in many["answers"])})
        finally:
            if proxy is not None:
                stop_process(proxy)
            stop_process(proc)
    ceiling_after = cpu_ceiling(min(args.sessions, os.cpu_count() or 1))
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"nproc": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
                    "cpu_ceiling_before": ceiling_before, "cpu_ceiling_after": ceiling_after},
        "model": args.model, "via": args.via, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "sessions": args.sessions, "session_processes": args.session_processes or "default (one per core)",
        "server_args": args.server_arg,
        "configs": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "configs"} | {
        name: {"ratios": [r["ratio"] for r in rounds], "identical": [r["identical"] for r in rounds]}
        for name, rounds in results.items()}, indent=1))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)


SPIN = "import time\nt = time.perf_counter()\nx = 0\nfor i in range(12_000_000): x += i\nprint(time.perf_counter() - t)"


def cpu_ceiling(n: int) -> float:
    """The machine's parallel CPU throughput: n busy processes against one (a pure-Python
    loop; n x solo time / the slowest of n at once).  It bounds any N-session speed-up, and
    falls when other work shares the machine (it is measured before and after the run)."""
    def run(k: int) -> list[float]:
        ps = [subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True) for _ in range(k)]
        return [float(p.communicate()[0]) for p in ps]

    solo = min(run(1)[0], run(1)[0])
    return n * solo / max(run(n))


if __name__ == "__main__":
    main()

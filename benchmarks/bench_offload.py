#!/usr/bin/env python3
"""Offload mode, side by side with Concrete ML 1.9.0 HybridFHEModel, in one run.

    .venv/bin/python benchmarks/bench_offload.py [--json reports/bench_offload.json]
        [--skip-generation] [--skip-peer] [--skip-7b] [--calls 2]

Measures, on this machine:

1. SmolLM2-135M, server and client as two processes on loopback, an 8-token
   prompt and 16 greedy tokens: first-token and later-token latency, bytes per
   token up and down, server peak memory (cipherlm.bench.offload).
2. The seven projections of one SmolLM2 decoder layer (q 576x576, k/v 576x192,
   o 576x576, gate/up 576x1536, down 1536x576), one token each: cipherlm
   (q,k,v and gate,up stacked as it serves them; each shape alone as well) and
   Concrete ML's HybridFHEModel on the same shapes (its own venv,
   benchmarks/setup_peers.sh; both of its back ends: the default it picks, and
   the TFHE circuit that its remote client/server mode can serve), with the
   ratio per token (30 layers; LM head excluded on both sides, Concrete ML
   does not run it).
3. One LLaMA-2-7B-shaped decoder layer (random weights, d=4096, FFN 11008,
   32 heads): bytes per token up/down through cipherlm, times 32 layers,
   against the ~57 GB per token of the source report.

``--generation-ab OLD_TREE [--rounds R] [--new-tokens N] [--he-backend lattigo]``: only
part 1, in child processes (each starts its own server), alternating this tree and OLD_TREE
(a `git worktree` of an older commit with its libraries built; PYTHONPATH and a working
directory outside both trees select which cipherlm the client and the server load) R times;
prints each run's first / later-token seconds, the server's HE seconds and the children's CPU
seconds (client + server, from getrusage), with the load average at each start (issue 15 A/B):

    .venv/bin/python benchmarks/bench_offload.py --generation-ab /tmp/old --rounds 2 --new-tokens 6

``--workers-ab W``: the same, this tree only, alternating the server's ``--workers 1`` and
``--workers W`` (on Lattigo: goroutines per request).

``--prefill-ab [--rounds R] [--prompt-tokens 14] [--prefill-tokens 2] [--new-tokens N]``: only
part 1, this tree, alternating the packed prefill (``$CIPHERLM_OFFLOAD_PREFILL_PACK`` = the
given T) and rows one by one (= 1) R times; first-token (prefill) seconds and bytes up / down
(issue 15 item 2 A/B):

    .venv/bin/python benchmarks/bench_offload.py --prefill-ab --rounds 2 --new-tokens 2

Targets (from the issue; compared, not asserted): >= 10x less time and bytes
per token than Concrete ML on the same shapes; <= 100 MB traffic and <= 10 s
per generated token after the first for SmolLM2; 7B: 32 x bytes/token <= 1% of
57 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PEER_PY = ROOT / ".peers" / "concrete" / "bin" / "python"
SOURCE_REPORT_BYTES_PER_TOKEN = 57e9  # fhe_offload_llama_003: ~57 GB per token for LLaMA-2-7B
SMOLLM2_LAYERS = 30


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_peer(shapes: list[str], calls: int, backend: str | None) -> list[dict] | None:
    if not PEER_PY.exists():
        log(f"Concrete ML peer venv missing ({PEER_PY}); set it up with: bash benchmarks/setup_peers.sh")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [str(PEER_PY), str(ROOT / "benchmarks" / "concrete_ml_peer.py"), *shapes, "--calls", str(calls), "--json", str(out)]
        if backend:
            cmd += ["--backend", backend]
        log("running: " + " ".join(cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log(proc.stdout[-3000:])
        if proc.returncode != 0 or not out.exists():
            log(f"Concrete ML peer failed (exit {proc.returncode})")
            return None
        data = json.loads(out.read_text())
    return data["results"] if isinstance(data, dict) and "results" in data else data


def per_layer(rows: list[dict], layer_shapes: list[str]) -> dict:
    by = {r["shape"]: r for r in rows}
    return {
        "seconds": sum(by[s]["seconds_per_call"] for s in layer_shapes),
        "bytes_up": sum(by[s]["bytes_up_per_call"] for s in layer_shapes),
        "bytes_down": sum(by[s]["bytes_down_per_call"] for s in layer_shapes),
    }


def _child_run(child: str, env: dict) -> dict | None:
    """Run ``python -c child`` (it prints one ``RESULT <json>`` line) with ``env``: its result,
    start time, load average, wall and CPU seconds; None (stderr logged) when it fails."""
    import resource

    load = Path("/proc/loadavg").read_text().split()[:3]
    start = time.strftime("%H:%M:%S")
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", child], env=env, cwd="/", capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        log(proc.stderr[-3000:])
        return None
    g = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"result": g, "start_utc": start, "load": load, "wall_s": wall, "cpu_s": cpu}


def generation_ab(variants: dict[str, tuple[str, tuple]], rounds: int, new_tokens: int, he_backend: str,
                  out: Path | None) -> int:
    """Variants alternated (the order reversed every other round), each run a child process starting
    its own server; ``variants``: label -> (tree on PYTHONPATH, extra ``cipherlm serve`` flags).
    The ratios printed are of the second variant over the first (see the docstring)."""
    import os

    labels = list(variants)
    runs = []
    for rnd in range(rounds):
        for label in (labels if rnd % 2 == 0 else labels[::-1]):
            tree, server_args = variants[label]
            child = ("import json, sys; from cipherlm.bench.offload import bench_generation; "
                     f"g = bench_generation('smollm2-135m', 8, {int(new_tokens)}, "
                     "progress=lambda s: print(s, file=sys.stderr)"
                     # (an older tree's bench_generation may not take server_args)
                     f"{f', server_args={tuple(server_args)!r}' if server_args else ''}); "
                     "print('RESULT ' + json.dumps(g, default=float))")
            env = dict(os.environ, PYTHONPATH=tree, CIPHERLM_OFFLOAD_HE_BACKEND=he_backend)
            env.pop("CIPHERLM_LATTIGO_LIB", None)
            m = _child_run(child, env)
            if m is None:
                return 1
            g, start, load, wall, cpu = m["result"], m["start_utc"], m["load"], m["wall_s"], m["cpu_s"]
            he = sum(g.get("server_seconds_by_class", {}).values()) if isinstance(g.get("server_seconds_by_class"), dict) else None
            row = {"round": rnd + 1, "tree": label, "server_args": list(server_args), "start_utc": start, "load": load,
                   "wall_s": wall, "cpu_s": cpu, "server_he_s": he, **g}
            runs.append(row)
            log(f"round {rnd + 1} {label} start {start} load {' '.join(load)}: first {g['first_token_seconds']:.1f} s, "
                f"later mean {g['later_token_seconds_mean']:.2f} s max {g['later_token_seconds_max']:.2f} s, "
                f"server HE {he} s, CPU {cpu:.0f} s, wall {wall:.0f} s")
    print("| round | variant | start (UTC) | load | server start s | first token s | later tokens mean / max s | "
          "later token MB up / down | server HE s (session) | CPU s (client + server) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        he = "-" if r["server_he_s"] is None else f"{r['server_he_s']:.1f}"
        print(f"| {r['round']} | {r['tree']} | {r['start_utc']} | {' '.join(r['load'])} | {r['server_start_seconds']:.1f} | "
              f"{r['first_token_seconds']:.1f} | {r['later_token_seconds_mean']:.2f} / {r['later_token_seconds_max']:.2f} | "
              f"{r['later_token_bytes_up_mean'] / 1e6:.2f} / {r['later_token_bytes_down_mean'] / 1e6:.2f} | "
              f"{he} | {r['cpu_s']:.0f} |")
    a_label, b_label = labels[:2]
    for rnd in range(1, rounds + 1):
        a = {r["tree"]: r for r in runs if r["round"] == rnd}
        print(f"round {rnd}: later tokens {b_label} / {a_label} = "
              f"{a[b_label]['later_token_seconds_mean'] / a[a_label]['later_token_seconds_mean']:.2f}, "
              f"CPU {b_label} / {a_label} = {a[b_label]['cpu_s'] / a[a_label]['cpu_s']:.2f}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1, default=float))
    return 0


def prefill_ab(rounds: int, prompt_tokens: int, new_tokens: int, he_backend: str, tokens: str,
               out: Path | None) -> int:
    """This tree's packed prefill against rows one by one ("per-row", the path before issue 15
    item 2), alternated (the order rotated each round), each run a child process starting its
    own server: first-token (prefill) seconds, bytes, server start and peak memory.  ``tokens``:
    comma-separated variants, T ($CIPHERLM_OFFLOAD_PREFILL_PACK = T, "packed T=..") or Tw (the
    same with the diagonals stored whole, $CIPHERLM_OFFLOAD_PACK_COMPRESS=0, "whole T=..")."""
    import os

    child = ("import json, sys; from cipherlm.bench.offload import bench_generation; "
             f"g = bench_generation('smollm2-135m', {int(prompt_tokens)}, {int(new_tokens)}, "
             "progress=lambda s: print(s, file=sys.stderr)); print('RESULT ' + json.dumps(g, default=float))")
    variants = {"per-row": {"CIPHERLM_OFFLOAD_PREFILL_PACK": "1"}}
    for v in str(tokens).split(","):
        v = v.strip()
        whole = v.endswith("w")
        t = int(v[:-1] if whole else v)
        variants[f"{'whole' if whole else 'packed'} T={t}"] = {
            "CIPHERLM_OFFLOAD_PREFILL_PACK": str(t), "CIPHERLM_OFFLOAD_PACK_COMPRESS": "0" if whole else "1"}
    names = list(variants)
    runs = []
    for rnd in range(rounds):
        k = rnd % len(names)
        for label in names[k:] + names[:k]:
            env = dict(os.environ, PYTHONPATH=str(ROOT), CIPHERLM_OFFLOAD_HE_BACKEND=he_backend, **variants[label])
            m = _child_run(child, env)
            if m is None:
                return 1
            g, start, load, wall, cpu = m["result"], m["start_utc"], m["load"], m["wall_s"], m["cpu_s"]
            row = {"round": rnd + 1, "variant": label, "start_utc": start, "load": load, "wall_s": wall, "cpu_s": cpu, **g}
            runs.append(row)
            log(f"round {rnd + 1} {label} start {start} load {' '.join(load)}: first token {g['first_token_seconds']:.1f} s, "
                f"up {g['first_token_bytes_up']} B down {g['first_token_bytes_down']} B, CPU {cpu:.0f} s")
    print("| round | variant | start (UTC) | load (1, 5, 15 min) | server start s | first token s | first token up B | "
          "first token down B | later token s | setup up B | server peak GiB | CPU s (client + server) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        later = "-" if r["later_token_seconds_mean"] is None else f"{r['later_token_seconds_mean']:.2f}"
        peak = "-" if not r.get("server_peak_memory_bytes") else f"{r['server_peak_memory_bytes'] / 2**30:.2f}"
        print(f"| {r['round']} | {r['variant']} | {r['start_utc']} | {' '.join(r['load'])} | {r['server_start_seconds']:.1f} | "
              f"{r['first_token_seconds']:.1f} | {r['first_token_bytes_up']:,} | {r['first_token_bytes_down']:,} | {later} | "
              f"{r['setup_bytes_up']:,} | {peak} | {r['cpu_s']:.0f} |")
    for rnd in range(1, rounds + 1):
        a = {r["variant"]: r for r in runs if r["round"] == rnd}
        base = a["per-row"]
        for label in names[1:]:
            print(f"round {rnd}: first token {label} / per-row = "
                  f"{a[label]['first_token_seconds'] / base['first_token_seconds']:.2f}, bytes up "
                  f"{a[label]['first_token_bytes_up'] / base['first_token_bytes_up']:.2f}, down "
                  f"{a[label]['first_token_bytes_down'] / base['first_token_bytes_down']:.2f}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1, default=float))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-ab", action="store_true",
                    help="only the SmolLM2 prefill: packed rows (--prefill-tokens) against rows one by one, alternated")
    ap.add_argument("--prompt-tokens", type=int, default=14)
    ap.add_argument("--prefill-tokens", default="2",
                    help="--prefill-ab's packed variants, comma-separated: T (diagonals of period S/T stored at "
                         "1/T) or Tw (stored whole), e.g. 2,2w,4")
    ap.add_argument("--generation-ab", metavar="OLD_TREE", help="only the SmolLM2 generation, A/B against OLD_TREE")
    ap.add_argument("--workers-ab", type=int, metavar="W",
                    help="only the SmolLM2 generation, this tree, the server's --workers 1 against W")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--he-backend", default="lattigo")
    ap.add_argument("--json", type=Path, default=ROOT / "reports" / "bench_offload.json")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-7b", action="store_true")
    args = ap.parse_args()
    if args.prefill_ab:
        return prefill_ab(args.rounds, args.prompt_tokens, args.new_tokens, args.he_backend, args.prefill_tokens,
                          args.json if "--json" in sys.argv else None)
    if args.generation_ab or args.workers_ab:
        variants = ({"old": (str(Path(args.generation_ab).resolve()), ()), "new": (str(ROOT), ())} if args.generation_ab
                    else {"workers=1": (str(ROOT), ("--workers", "1")),
                          f"workers={args.workers_ab}": (str(ROOT), ("--workers", str(args.workers_ab)))})
        return generation_ab(variants, args.rounds, args.new_tokens, args.he_backend,
                             args.json if "--json" in sys.argv else None)

    from cipherlm.bench import offload
    from cipherlm.report import machine_info

    result: dict = {"machine": machine_info(), "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not args.skip_generation:
        log("== SmolLM2 generation over loopback")
        result["generation"] = offload.bench_generation(progress=log)
        offload.print_generation(result["generation"])

    log("== one SmolLM2 layer's projections, one token (cipherlm)")
    layer = [f"{a}x{b}" for a, b in offload.smollm2_layer_shapes()]
    unique = sorted(set(offload.smollm2_layer_shapes()))
    ours = offload.bench_linear_shapes(unique, calls=args.calls, progress=log)
    stacked = offload.bench_linear_shapes([(576, 960), (576, 3072)], calls=args.calls, progress=log)
    result["cipherlm_shapes"] = ours + stacked
    ours_layer = per_layer(ours, layer)
    by = {r["shape"]: r for r in ours + stacked}
    served = ["576x960", "576x576", "576x3072", "1536x576"]  # q,k,v stacked; o; gate,up stacked; down
    ours_served = {
        "seconds": sum(by[s]["seconds_per_call"] for s in served),
        "bytes_up": sum(by[s]["bytes_up_per_call"] for s in served),
        "bytes_down": sum(by[s]["bytes_down_per_call"] for s in served),
    }
    result["cipherlm_layer_separate"] = ours_layer
    result["cipherlm_layer_as_served"] = ours_served

    peers = {}
    if not args.skip_peer:
        peer_shapes = sorted({s for s in layer})
        for label, backend in (("concrete-ml (its default back ends)", None), ("concrete-ml (TFHE circuit, remote-capable)", "tfhe")):
            log(f"== {label}")
            rows = run_peer(peer_shapes, args.calls, backend)
            if rows:
                peers[label] = {"rows": rows, "layer": per_layer(rows, layer)}
    result["peers"] = peers

    if not args.skip_7b:
        log("== one LLaMA-2-7B-shaped decoder layer (random weights), one token")
        result["llama7b_layer"] = offload.bench_llama7b_layer(progress=log)

    # ------------------------------------------------------------------ table
    mb = 1e6
    print()
    print(f"Per token, {SMOLLM2_LAYERS} SmolLM2 layers' projections (LM head excluded), one token, this machine "
          f"({result['machine'].get('cpu_model', '?')}, {result['machine'].get('cores', '?')} cores)")
    print(f"{'system':<48} {'seconds':>10} {'MB up':>10} {'MB down':>10} {'time ratio':>11} {'bytes ratio':>12}")
    rows = [("cipherlm offload (as served: stacked groups)", ours_served), ("cipherlm offload (each projection alone)", ours_layer)]
    for name, row in rows:
        print(f"{name:<48} {row['seconds'] * SMOLLM2_LAYERS:>10.2f} {row['bytes_up'] * SMOLLM2_LAYERS / mb:>10.2f} "
              f"{row['bytes_down'] * SMOLLM2_LAYERS / mb:>10.2f} {'1.0':>11} {'1.0':>12}")
    for name, p in peers.items():
        L = p["layer"]
        t_ratio = L["seconds"] / ours_served["seconds"]
        b_ratio = (L["bytes_up"] + L["bytes_down"]) / (ours_served["bytes_up"] + ours_served["bytes_down"])
        p["ratio_time"], p["ratio_bytes"] = t_ratio, b_ratio
        print(f"{name:<48} {L['seconds'] * SMOLLM2_LAYERS:>10.2f} {L['bytes_up'] * SMOLLM2_LAYERS / mb:>10.2f} "
              f"{L['bytes_down'] * SMOLLM2_LAYERS / mb:>10.2f} {t_ratio:>10.1f}x {b_ratio:>11.1f}x")
    if "llama7b_layer" in result:
        r = result["llama7b_layer"]
        total = (r["bytes_up"] + r["bytes_down"]) * 32
        r["bytes_per_token_32_layers"] = total
        r["fraction_of_source_report"] = total / SOURCE_REPORT_BYTES_PER_TOKEN
        print(f"\nLLaMA-2-7B-shaped layer: {r['bytes_up'] / mb:.2f} MB up + {r['bytes_down'] / mb:.2f} MB down per token, "
              f"{r['server_seconds']:.1f} s server; x32 layers = {total / 1e9:.3f} GB per token = "
              f"{100 * r['fraction_of_source_report']:.2f}% of the source report's 57 GB")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=float))
    log(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

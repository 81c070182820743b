"""Offload-mode benchmark: SmolLM2 generation over loopback, per-shape linear layers.

Measures (nothing here is a timed test; targets are compared in the printout):

* generation with a server process and a client process on loopback: an
  ``prompt_tokens``-token prompt, ``new_tokens`` greedy tokens: first-token and
  later-token latency, bytes up/down per token, set-up bytes (client bundle +
  Galois keys, once per session), server peak memory (VmHWM); the server runs
  ``cipherlm serve``'s default HE backend (auto: Lattigo where its library is
  built, else SEAL; ``$CIPHERLM_OFFLOAD_HE_BACKEND=seal|lattigo`` picks one) and the
  result names it (``he_backend``);
* one-token linear layers of given shapes through the offload engine in one
  process (client encrypt + server apply + client decrypt, SEAL), for the side by
  side with Concrete ML on the same shapes.

Run through ``cipherlm bench offload`` or ``benchmarks/bench_offload.py``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

BENCH_TEXT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
    "movable metal type with an oil-based ink and a screw press."
)


def _peak_memory_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def bench_generation(model: str = "smollm2-135m", prompt_tokens: int = 8, new_tokens: int = 16, progress=print,
                     server_args=()) -> dict:
    """Server and client as two processes on loopback; per-token latency and bytes
    (``server_args``: more ``cipherlm serve`` flags, e.g. ``("--workers", "2")``)."""
    from cipherlm.launch import start_server_process, stop_process
    from cipherlm.runtime.offload_client import OffloadClient

    t0 = time.perf_counter()
    proc, (host, port) = start_server_process(model, extra_args=tuple(server_args))
    server_start = time.perf_counter() - t0
    try:
        with OffloadClient(host, port, model=model) as client:
            ids = client.tokenizer.encode(BENCH_TEXT).ids[:prompt_tokens]
            executor = client.executor()
            setup = client.chan.totals()
            marks = [(time.perf_counter(), client.chan.bytes_sent, client.chan.bytes_received)]

            def on_token(_tid):
                marks.append((time.perf_counter(), client.chan.bytes_sent, client.chan.bytes_received))
                progress(f"  token {len(marks) - 1}/{new_tokens}: {marks[-1][0] - marks[-2][0]:.2f} s")

            new_ids = executor.generate(ids, max_new_tokens=new_tokens, eos_token_ids=[], on_token=on_token)
            server_stats = client.server_stats()
            he_backend = client.engine.he_backend  # the server's (`cipherlm serve`'s default: auto)
            setup_seconds = client.setup_seconds
            client_seconds = dict(client.seconds)
        peak = _peak_memory_bytes(proc.pid)
    finally:
        stop_process(proc)
    times = np.diff([m[0] for m in marks])
    up = np.diff([m[1] for m in marks])
    down = np.diff([m[2] for m in marks])
    return {
        "model": model,
        "he_backend": he_backend,
        "prompt_tokens": len(ids),
        "new_tokens": len(new_ids),
        "server_start_seconds": server_start,
        "session_setup_seconds": setup_seconds,
        "setup_bytes_up": setup["bytes_sent"],
        "setup_bytes_down": setup["bytes_received"],
        "first_token_seconds": float(times[0]),
        "later_token_seconds_mean": float(times[1:].mean()) if len(times) > 1 else None,
        "later_token_seconds_max": float(times[1:].max()) if len(times) > 1 else None,
        "first_token_bytes_up": int(up[0]),
        "first_token_bytes_down": int(down[0]),
        "later_token_bytes_up_mean": float(up[1:].mean()) if len(up) > 1 else None,
        "later_token_bytes_down_mean": float(down[1:].mean()) if len(down) > 1 else None,
        "server_peak_memory_bytes": peak,
        "server_seconds_by_class": server_stats.get("seconds", {}),
        "server_he_ops": server_stats.get("he_ops", {}),
        "client_seconds": client_seconds,
    }


def bench_linear_shapes(shapes, calls: int = 3, seed: int = 0, progress=print) -> list[dict]:
    """One-token y = W x + b through the offload engine (in process), per (d_in, d_out)."""
    from cipherlm.runtime.linear_groups import LinearGroup
    from cipherlm.runtime.offload_engine import ClientEngine, ServerEngine

    rng = np.random.default_rng(seed)
    out = []
    for d_in, d_out in shapes:
        W = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
        b = (0.1 * rng.standard_normal(d_out)).astype(np.float32)
        group = LinearGroup(0, ("layer",), d_in, (d_out,))
        t = time.perf_counter()
        server = ServerEngine([group], {"layer": (W, b)})
        encode_s = time.perf_counter() - t
        client = ClientEngine(server.public_setup(), [group])
        keys_blob = client.galois_keys_blob()
        keys = server.load_client_keys(keys_blob, client.ring_switch_key, client.input_switch_key)
        secs, ups, downs, errs = [], [], [], []
        for _ in range(calls):
            x = rng.standard_normal(d_in)
            t = time.perf_counter()
            ct = client.encrypt(0, x)
            res = server.apply(0, ct, keys)
            y = client.decrypt(0, res)
            secs.append(time.perf_counter() - t)
            ups.append(len(ct))
            downs.append(len(res))
            ref = W.astype(np.float64) @ x + b
            errs.append(float(np.max(np.abs(y - ref))))
        plan = server.plans[0]
        row = {
            "shape": f"{d_in}x{d_out}",
            "seconds_per_call": float(np.median(secs)),
            "bytes_up_per_call": int(np.median(ups)),
            "bytes_down_per_call": int(np.median(downs)),
            "key_bytes": len(keys_blob),
            "encode_seconds": encode_s,
            "max_abs_err": max(errs),
            "plan": {k: getattr(plan, k) for k in ("c", "m", "n_blocks", "g", "b")},
            "op_counts": plan.op_counts(),
        }
        progress(f"  cipherlm {row['shape']}: {row['seconds_per_call'] * 1e3:.1f} ms/call, "
                 f"{row['bytes_up_per_call'] / 1e3:.0f} kB up, {row['bytes_down_per_call'] / 1e3:.0f} kB down, "
                 f"max err {row['max_abs_err']:.1e}")
        out.append(row)
    return out


def smollm2_layer_shapes() -> list[tuple[int, int]]:
    """The seven projections of one SmolLM2 decoder layer as (d_in, d_out)."""
    return [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]


def print_generation(g: dict) -> None:
    mb = 1e6
    print(f"SmolLM2 offload generation ({g['prompt_tokens']}-token prompt, {g['new_tokens']} new tokens, "
          f"HE backend {g.get('he_backend', 'seal')})")
    print(f"  server start (load + encode)     {g['server_start_seconds']:.1f} s")
    print(f"  session set-up                   {g['session_setup_seconds']:.1f} s, "
          f"{g['setup_bytes_up'] / mb:.1f} MB up (Galois keys), {g['setup_bytes_down'] / mb:.1f} MB down (bundle, if not cached)")
    print(f"  first token (prefill)            {g['first_token_seconds']:.2f} s, "
          f"{g['first_token_bytes_up'] / mb:.1f} MB up, {g['first_token_bytes_down'] / mb:.1f} MB down")
    if g["later_token_seconds_mean"] is not None:
        print(f"  later tokens (mean / max)        {g['later_token_seconds_mean']:.2f} / {g['later_token_seconds_max']:.2f} s, "
              f"{g['later_token_bytes_up_mean'] / mb:.2f} MB up, {g['later_token_bytes_down_mean'] / mb:.2f} MB down per token")
    if g["server_peak_memory_bytes"]:
        print(f"  server peak memory               {g['server_peak_memory_bytes'] / 2**30:.2f} GiB")


def run(args) -> dict:
    """``cipherlm bench offload``: generation + per-shape linear layers (ours only)."""
    result = {"generation": bench_generation(args.model, args.prompt_tokens or 8, args.max_new_tokens or 16,
                                             progress=lambda s: print(s, file=sys.stderr))}
    print_generation(result["generation"])
    result["linear_shapes"] = bench_linear_shapes(sorted(set(smollm2_layer_shapes())),
                                                  progress=lambda s: print(s, file=sys.stderr))
    return result


def bench_llama7b_layer(d: int = 4096, ffn: int = 11008, seed: int = 0, progress=print) -> dict:
    """Bytes and server time of one token through one LLaMA-2-7B-shaped decoder layer's projections.

    Random weights (std 0.02, as Llama's initialiser); q,k,v and gate,up stacked
    as the server serves them; the down projection's 11008-wide input is three
    column parts (see offload_engine.input_parts).
    """
    from cipherlm.runtime.linear_groups import LinearGroup
    from cipherlm.runtime.offload_engine import ClientEngine, ServerEngine

    rng = np.random.default_rng(seed)

    def w(rows, cols):
        return (0.02 * rng.standard_normal((rows, cols), dtype=np.float32)).astype(np.float32)

    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (ffn, d), "up": (ffn, d), "down": (d, ffn)}
    linears = {n: (w(*s), None) for n, s in shapes.items()}
    groups = [
        LinearGroup(0, ("q", "k", "v"), d, (d, d, d)),
        LinearGroup(1, ("o",), d, (d,)),
        LinearGroup(2, ("gate", "up"), d, (ffn, ffn)),
        LinearGroup(3, ("down",), ffn, (d,)),
    ]
    t = time.perf_counter()
    last = [0.0]

    def enc_progress(done, total):
        if time.perf_counter() - last[0] > 10 or done == total:
            last[0] = time.perf_counter()
            progress(f"  encoding 7B layer: {done}/{total} plaintexts")

    server = ServerEngine(groups, linears, progress=enc_progress)
    encode_s = time.perf_counter() - t
    client = ClientEngine(server.public_setup(), groups)
    keys_blob = client.galois_keys_blob()
    keys = server.load_client_keys(keys_blob, client.ring_switch_key, client.input_switch_key)
    up = down = 0
    server_s = client_s = 0.0
    max_rel = 0.0
    x = rng.standard_normal(d)
    for g in groups:
        xin = x if g.d_in == d else rng.standard_normal(g.d_in)
        t = time.perf_counter()
        ct = client.encrypt(g.index, xin)
        t1 = time.perf_counter()
        res = server.apply(g.index, ct, keys)
        t2 = time.perf_counter()
        y = client.decrypt(g.index, res)
        t3 = time.perf_counter()
        client_s += (t1 - t) + (t3 - t2)
        server_s += t2 - t1
        up, down = up + len(ct), down + len(res)
        ref = np.concatenate([linears[n][0].astype(np.float64) @ xin for n in g.names])
        max_rel = max(max_rel, float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))))
        progress(f"  7B {'+'.join(g.names)}: {(t2 - t1):.2f} s server, {len(ct) / 1e6:.2f} MB up, {len(res) / 1e6:.2f} MB down")
    return {
        "shape": {"d": d, "ffn": ffn},
        "bytes_up": up,
        "bytes_down": down,
        "server_seconds": server_s,
        "client_seconds": client_s,
        "encode_seconds": encode_s,
        "plaintext_bytes": server.plaintext_bytes,
        "galois_key_bytes": len(keys_blob),
        "max_rel_err": max_rel,
        "plans": [p.to_dict() for p in server.plans],
    }

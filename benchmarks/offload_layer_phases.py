#!/usr/bin/env python3
"""Where a later offload token's server time goes: one SmolLM2-shaped decoder layer's four
projection groups (q,k,v 576 -> 960; o 576 -> 576; gate,up 576 -> 3072; down 1536 -> 576;
random weights) through `ServerEngine.apply` exactly as the server runs them by default on
Lattigo (real inputs in the half ring, half-ring results; docs/offload.md), in this process.

    .venv/bin/python benchmarks/offload_layer_phases.py [--workers 1,2] [--reps 10]
        [--sweep-g] [--json FILE]

Per goroutine count W: milliseconds per request of each group (min over ``--reps``), and the
split of a layer's time over the phases of `cipherlm.he.matmul.apply` (the input's unfolding
and key switch ``real_to_complex``, the BSGS product ``bsgs_apply``, the results' ring switch,
(de)serialisation); a token is 30 such layers.  ``--sweep-g`` also times every baby-step count
g (giant steps b = ceil(m / g)) of each group's plan at the first W, against the planner's
choice (`plan_matmul`'s cost model), with the max abs error of each against numpy.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from cipherlm.he import lattigo_backend
from cipherlm.he.matmul import apply, encode_group
from cipherlm.runtime import offload_engine
from cipherlm.runtime.linear_groups import LinearGroup

SHAPES = (("qkv", 576, (576, 192, 192)), ("o", 576, (576,)), ("gate_up", 576, (1536, 1536)),
          ("down", 1536, (576,)))
PHASES = ("ciphertext_from_bytes", "real_to_complex", "bsgs_apply", "ring_switch", "ciphertext_to_bytes")
SWEEP_G = (4, 6, 8, 9, 12, 16, 18, 24, 32, 36, 48)


def layer(seed: int = 0):
    rng = np.random.default_rng(seed)
    groups, lin = [], {}
    for i, (name, d_in, d_outs) in enumerate(SHAPES):
        names = tuple(f"{name}.{k}" for k in range(len(d_outs)))
        groups.append(LinearGroup(i, names, d_in, d_outs))
        for n, d in zip(names, d_outs):
            lin[n] = (rng.standard_normal((d, d_in)) * 0.05, None)
    return groups, lin


class PhaseTimer:
    """Wraps the Lattigo backend's methods of `PHASES` to add up their seconds."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        for name in PHASES:
            f = getattr(lattigo_backend.LattigoBackend, name)

            def timed(*a, _f=f, _name=name, **kw):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    self.seconds[_name] += time.perf_counter() - t0

            setattr(lattigo_backend.LattigoBackend, name, timed)


def sweep_plans(plans):
    """Per group: its plan with each g of SWEEP_G up to m (b = ceil(m / g))."""
    return [[dataclasses.replace(p, g=g, b=math.ceil(p.m / g)) for g in SWEEP_G if g <= p.m] for p in plans]


def run(workers: list[int], reps: int, sweep: bool) -> dict:
    groups, lin = layer()
    timer = PhaseTimer()
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(g.d_in) for g in groups]
    result: dict = {"per_workers": {}, "sweep": {}}
    for w in workers:
        eng = offload_engine.ServerEngine(groups, lin, he_backend="lattigo", prefill_tokens=1, workers=w)
        if any(len(ids) != 1 for ids in eng.parts):
            sys.exit("every group is expected to be one part")
        plans = [eng.plans[ids[0]] for ids in eng.parts]
        swept = sweep_plans(plans) if sweep and w == workers[0] else []
        client = offload_engine.ClientEngine(eng.public_setup(), groups)
        client.plans = client.plans + [q for qs in swept for q in qs]  # keys for every swept step
        msg = client.keys_message()
        keys = eng.load_client_keys(msg["galois_keys"], msg["ring_switch_key"], msg.get("input_switch_key"))
        cts = [client.encrypt(i, x) for i, x in enumerate(xs)]
        for i in range(len(groups)):  # warm-up
            eng.apply(i, cts[i], keys)
        timer.seconds.clear()
        best = [math.inf] * len(groups)
        for _ in range(reps):
            for i in range(len(groups)):
                t0 = time.perf_counter()
                eng.apply(i, cts[i], keys)
                best[i] = min(best[i], time.perf_counter() - t0)
        result["per_workers"][w] = {
            "ms_per_request_min": {SHAPES[i][0]: round(1e3 * b, 2) for i, b in enumerate(best)},
            "ms_per_layer_min": round(1e3 * sum(best), 2),
            "phase_ms_per_layer_mean": {k: round(1e3 * v / reps, 2) for k, v in timer.seconds.items()},
            "plans": {SHAPES[i][0]: {k: getattr(p, k) for k in ("c", "m", "g", "b", "n_blocks")} | {
                "chunk_steps": list(p.chunk_steps)} for i, p in enumerate(plans)},
        }
        for i, qs in enumerate(swept):
            Ws = [lin[n][0] for n in groups[i].names]
            want = np.concatenate([W @ xs[i] for W in Ws])
            rows = []
            for q in qs:
                enc = encode_group(eng.ctx, Ws, [None] * len(Ws), plan=q)
                enc.workers = w
                t = math.inf
                for _ in range(reps):
                    t0 = time.perf_counter()
                    out = apply(enc, cts[i], keys.galois_keys, ring_switch_key=keys.ring_switch,
                                input_switch_key=keys.input_switch)
                    t = min(t, time.perf_counter() - t0)
                err = float(np.abs(client.decrypt(i, out) - want).max())
                rows.append({"g": q.g, "b": q.b, "ms_min": round(1e3 * t, 2), "max_abs_err": err,
                             "model_ms": round(1e3 * q.cost(), 2), "chosen": q.g == plans[i].g})
                del enc
            result["sweep"][SHAPES[i][0]] = rows
        keys.release()
        eng.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated goroutine counts per request")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep-g", action="store_true", help="also time every baby-step count g of each plan")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load = os.getloadavg()
    res = run(workers, args.reps, args.sweep_g)
    print(f"# {started}, nproc {os.cpu_count()}, load at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"one SmolLM2-shaped layer, min of {args.reps} per request")
    print("| W | " + " | ".join(f"{n} ms" for n, _, _ in SHAPES) + " | layer ms | token s (x30) | phases ms per layer |")
    print("|---|" + "---:|" * (len(SHAPES) + 2) + "---|")
    for w, r in res["per_workers"].items():
        ph = ", ".join(f"{k} {v}" for k, v in r["phase_ms_per_layer_mean"].items())
        cells = " | ".join(str(r["ms_per_request_min"][n]) for n, _, _ in SHAPES)
        print(f"| {w} | {cells} | {r['ms_per_layer_min']} | {30 * r['ms_per_layer_min'] / 1e3:.2f} | {ph} |")
    for name, rows in res["sweep"].items():
        print(f"# {name}: " + ", ".join(f"g={r['g']}/b={r['b']}{'*' if r['chosen'] else ''} {r['ms_min']} ms"
                                         for r in rows) + f"; max abs err {max(r['max_abs_err'] for r in rows):.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "started": started,
                                               "load": load, **res}, indent=1))


if __name__ == "__main__":
    main()

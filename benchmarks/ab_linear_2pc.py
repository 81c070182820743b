"""A/B helper: the 2pc linear layers (`cipherlm.protocols.linear.linear`, coefficient packing) at
SmolLM2-135M's shapes, both parties in one process, weights cached as in the 2pc runtime.

For each shape (tokens x d_in -> d_out) it runs one warm-up call (encodes and caches the
weights), then ``reps`` timed calls, and prints one JSON line per shape: wall and CPU seconds per
call (both parties; CPU time is steadier on a shared machine), the bytes both sent, and the max
abs error against numpy.  Run it against two trees in turns (old and new):

    PYTHONPATH=OLD .venv/bin/python benchmarks/ab_linear_2pc.py [reps] [shape,...]
    PYTHONPATH=NEW .venv/bin/python benchmarks/ab_linear_2pc.py [reps] [shape,...]

Shapes are named ``TxDxO`` (e.g. ``1x576x960``); the default set is SmolLM2's decode layers
(QKV, O, gate+up, down, LM head) and a 14-token prefill's gate+up and down.
Random weights with the models' scale (std 0.02) and inputs in [-2, 2): timing data, not secrets.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import share_input
from cipherlm.protocols.linear import linear
from cipherlm.mpc.he_session import he_session

DEFAULT_SHAPES = "1x576x960,1x576x576,1x576x3072,1x1536x576,1x576x49152,14x576x3072,14x1536x576"


def _party(ctx, shape, reps, x, w):
    he_session(ctx)
    T, d, o = shape
    xs = share_input(ctx, x if ctx.party == 0 else None, owner=0)
    weight = w if ctx.party == 1 else None
    linear(ctx, xs, weight, out_features=o, cache_key="w")  # warm-up: encodes and caches the weights
    b0 = sum(v["bytes_sent"] for v in ctx.chan.stats().values())
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        y = linear(ctx, xs, weight, out_features=o, cache_key="w")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    sent = sum(v["bytes_sent"] for v in ctx.chan.stats().values()) - b0
    return y.reveal_float(to=0), sent / reps, wall / reps, cpu / reps


def main(argv):
    reps = int(argv[0]) if argv else 3
    shapes = argv[1] if len(argv) > 1 else DEFAULT_SHAPES
    rng = np.random.default_rng(0)
    for name in shapes.split(","):
        shape = tuple(int(v) for v in name.split("x"))
        T, d, o = shape
        x = rng.uniform(-2, 2, (T, d))
        w = rng.normal(0, 0.02, (d, o))
        (y, b0, wall, cpu), (_, b1, _, _) = run_inprocess(_party, args0=(shape, reps, x, w), args1=(shape, reps, x, w),
                                                        timeout=3600)
        print(json.dumps({"shape": name, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                          "bytes": int(b0 + b1), "err": float(np.abs(y - x @ w).max())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

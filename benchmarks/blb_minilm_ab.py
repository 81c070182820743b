"""MiniLM (all 6 layers, real weights) in the 2pc mode, BLB fusion or the layer-by-layer
baseline, both parties in this process, on random token ids: bytes per operator class,
wall seconds, max abs error of the hidden states against the plaintext executor.

    .venv/bin/python benchmarks/blb_minilm_ab.py TOKENS blb|base

writes benchmarks/results/blb_minilm_{blb|base}_{TOKENS}.json.  `cipherlm bench blb` is the
ablation command (both rows in one run); this script is the whole-model run of one row.
"""
import json
import os
import sys
import time

import numpy as np

from cipherlm.models.loader import load_model
from cipherlm.mpc.runner import run_inprocess
from cipherlm.runtime import twopc, twopc_blb
from cipherlm.runtime.graph_executor import GraphExecutor
from cipherlm.compile import bind, build_graph

TOK = int(sys.argv[1]) if len(sys.argv) > 1 else 8
which = sys.argv[2] if len(sys.argv) > 2 else "blb"
m = load_model("minilm-l6")
config, w = m.config, m.weights
ids = np.random.default_rng(1).integers(1000, 5000, TOK)
g = build_graph(config)
ref = GraphExecutor(g, bind(g, w), dtype=np.float64).run(
    {"ids": ids, "positions": np.arange(TOK), "token_types": np.zeros(TOK, np.int64)},
    {"pos0": 0, "T": TOK, "positions": np.arange(TOK)})["hidden"]
sm = twopc_blb.server_model_blb(config, w) if which == "blb" else twopc.server_weights(config, w)
plan = twopc.public_plan(config, sm)

def party(ctx):
    meter = twopc.OpMeter(ctx.chan)
    cls = twopc_blb.BLBEncoder if which == "blb" else twopc.TwoPCEncoder
    e = cls(ctx, config, sm if ctx.party == 1 else None, plan, meter=meter,
            progress=(lambda i, n, s: print("layer", i, n, s, time.strftime("%H:%M:%S"), flush=True)) if ctx.party == 0 else None)
    t0 = time.time()
    h = e.encode_shares(ids if ctx.party == 0 else None, TOK)
    dt = time.time() - t0
    out = h.reveal_float(to=0)
    tot = ctx.chan.totals()
    return out, meter.summary(), getattr(getattr(e, "runner", None), "block_stats", None), dt, tot

r0, r1 = run_inprocess(party, timeout=7200)
load = os.getloadavg()
out, summ, bst, dt, tot = r0
err = np.abs(out - ref)
print(which, "tokens", TOK, "time", round(dt, 1), "max err", err.max(), "ref max", np.abs(ref).max())
setup = summ.get("setup", {}).get("bytes", 0)
total = sum(v["bytes"] for v in summ.values())
for k, v in summ.items():
    if v["bytes"] or v["seconds"] > 0.5:
        print(f"  {k:12s} {v['bytes']/1e6:10.1f} MB {v['seconds']:8.1f} s")
print("total MB", total / 1e6, "excl setup", (total - setup) / 1e6, "rounds", tot["rounds"])
json.dump({"machine": {"cpus": os.cpu_count(), "loadavg_end": load}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "which": which, "tokens": TOK, "seconds": dt, "max_err": float(err.max()), "summary": summ,
           "blocks": bst, "totals": tot}, open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"blb_minilm_{which}_{TOK}.json"), "w"), default=str)

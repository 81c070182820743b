"""A/B helper: CPU seconds (both parties in one process) of one MiniLM layer on shares, 32 tokens,
and the bytes each party sent. Run it against two trees in turns (old and new):

    (cd OLD && PYTHONPATH=OLD /path/to/.venv/bin/python /path/to/benchmarks/ab_twopc_cpu.py)
    (cd NEW && PYTHONPATH=NEW .venv/bin/python benchmarks/ab_twopc_cpu.py)

CPU time, not wall time: on a shared machine the wall clock moves with the load.
Used for the issue 13 A/B in docs/benchmarks.md."""
import json, time
import numpy as np
from cipherlm.bench.twopc import prepare
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import share_input
from cipherlm.runtime import twopc
from cipherlm.runtime.twopc_executors import make_twopc_executor
spec = prepare("minilm", tokens=32, layers=1)
cfg = spec["config"]
sw = twopc.server_weights(cfg, spec["weights"])
plan = twopc.public_plan(cfg, sw)
def party(ctx):
    ex = make_twopc_executor(ctx, cfg, sw if ctx.party == 1 else None, plan)
    from cipherlm.mpc.he_session import he_session
    he_session(ctx); ctx.ot.setup(kk13=True)
    x = share_input(ctx, spec["x"] if ctx.party == 0 else None, owner=0)
    b0 = sum(v["bytes_sent"] for v in ctx.chan.stats().values())
    if hasattr(ex, "run_layers") and not hasattr(ex, "_layer"):
        y = ex.run_layers(x, [0])
    else:
        y = ex._layer(0, x)
    b1 = sum(v["bytes_sent"] for v in ctx.chan.stats().values())
    return y.reveal_float(to=0), b1 - b0
c0 = time.process_time(); w0 = time.perf_counter()
(r0, b0), (_, b1) = run_inprocess(party, timeout=1800)
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0, "bytes": [b0, b1],
                  "err": float(np.abs(r0 - spec["ref"]).max())}))

"""Seconds per private embedding lookup (32000 x 4096 table, flood 40 bits, one token), several
lookups after one set-up, both parties as threads of one process.  For A/B runs of the HE
library: run it once per `CIPHERLM_LATTIGO_LIB`, alternating; ``WEIGHT_CACHE_BYTES``: the
server's budget for the prepared weights (`embedding.setup`'s ``weight_cache_bytes``; 0: none).  ``PERF_CTL``: a perf control FIFO
(`perf record --control=fifo:...  -D -1`), enabled around the timed lookups only.

    python benchmarks/ab_embedding_lookup.py +blockot 3
"""
import os, sys, time, numpy as np
from cipherlm.mpc.runner import run_inprocess
from cipherlm.protocols import embedding as E
V, D = 32000, 4096
method = sys.argv[1]; reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
table = (0.02 * np.random.default_rng(0).standard_normal((V, D), dtype=np.float32))
ctl = os.environ.get("PERF_CTL")
def party(ctx):
    wcb = os.environ.get("WEIGHT_CACHE_BYTES")
    st = E.setup(ctx, table if ctx.party else None, vocab_size=V, dim=D, method=method, flood_bits=40,
                 weight_cache_bytes=None if wcb is None else int(wcb))
    ctx.ot.prime() if os.environ.get("PRIME") else None
    E.lookup(ctx, st, np.array([V - 1]) if ctx.party == 0 else None, n_ids=1)  # warm: OT pools
    ts = []
    for r in range(reps):
        ctx.send({"x": np.zeros(1)}) if ctx.party == 0 else ctx.recv()
        if ctx.party == 0 and ctl and r == 0:
            open(ctl, "w").write("enable\n")
        t0 = time.perf_counter()
        E.lookup(ctx, st, np.array([12345 + r]) if ctx.party == 0 else None, n_ids=1)
        ts.append(time.perf_counter() - t0)
    if ctx.party == 0 and ctl:
        open(ctl, "w").write("disable\n")
    return ts
r = run_inprocess(party, timeout=1800)
print(method, "lookup s per rep (client):", [round(x, 2) for x in r[0]], "server:", [round(x, 2) for x in r[1]])

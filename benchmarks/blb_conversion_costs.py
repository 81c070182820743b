"""Bytes, rounds and wall time of one BLB conversion (Algorithm 2, MPC -> CKKS, then
Algorithm 1, CKKS -> MPC; `protocols.ckks_convert`) per ring degree and prime count, counted
through the channel (both directions), the smallest of 3 warm repetitions (the first one
pays the OT set-up), slot values uniform in [-8, 8]; docs/blb.md "CKKS <-> MPC conversions".
Algorithm 2 with each ring -> field step (`ckks_convert.RING_TO_FIELD`: local, wrap) in the
same run.

    .venv/bin/python benchmarks/blb_conversion_costs.py [seal|lattigo]
"""
import sys
import time

import numpy as np
from cipherlm.he.backend import get_backend
from cipherlm.he.params import HEParams
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import AShare
from cipherlm.protocols import ckks_convert as cc

be = get_backend(sys.argv[1] if len(sys.argv) > 1 else "seal")
ROWS = [(4096, (60, 49), 1), (8192, (60, 40, 60), 2), (16384, (60, 50, 50, 60), 3),
        (16384, (60, 48, 48, 48, 48, 48, 60), 6)]
F = 16
for n, chain, k in ROWS:
    params = HEParams(f"t{n}-{len(chain)}", "ckks", n, chain)
    hc_c = be.context(params); keys = be.keygen(hc_c); hc_s = be.context(params)
    rng = np.random.default_rng(1)
    Z = np.rint(rng.uniform(-8, 8, n // 2) * 2**F).astype(np.int64)
    s0 = rng.integers(0, 2**64, n // 2, dtype=np.uint64); s1 = Z.astype(np.uint64) - s0

    for r2f in cc.RING_TO_FIELD:
        def party(ctx):
            side = cc.setup(ctx, be, hc_s if ctx.party == 1 else hc_c, keys if ctx.party == 0 else None)
            mine = s1 if ctx.party == 1 else s0
            res = []
            for rep in range(4):
                base = ctx.chan.totals(); t0 = time.perf_counter()
                ct = cc.shares_to_ckks(ctx, AShare(ctx, mine, 64, F), side, n_primes=k, scale_bits=50 if n < 16384 or k < 6 else 48, value_bits=4, ring_to_field=r2f)
                mid = ctx.chan.totals(); t1 = time.perf_counter()
                y = cc.ckks_to_shares(ctx, ct, side).data
                end = ctx.chan.totals(); t2 = time.perf_counter()
                res.append((mid["bytes_sent"] - base["bytes_sent"], end["bytes_sent"] - mid["bytes_sent"], t1 - t0, t2 - t1,
                            mid["rounds"] - base["rounds"], end["rounds"] - mid["rounds"]))
            return y, res
        (y0, r0), (y1, r1) = run_inprocess(party, timeout=600)
        err = np.abs((y0 + y1).view(np.int64) / 2**F - Z / 2**F).max()
        a2 = min(r0[i][0] + r1[i][0] for i in range(1, 4)); a1 = min(r0[i][1] + r1[i][1] for i in range(1, 4))
        w1 = min(r0[i][3] for i in range(1, 4)); w2 = min(r0[i][2] for i in range(1, 4))
        print(f"N={n} k={k} {r2f:5}: Alg1 {a1/1e3:.0f} KB, Alg2 {a2/1e3:.0f} KB, wall 1/2 {w1:.2f}/{w2:.2f} s, rounds(client) 1/2 {min(r0[i][5] for i in range(1,4))}/{min(r0[i][4] for i in range(1,4))}, max err 1+2 {err:.1e}")

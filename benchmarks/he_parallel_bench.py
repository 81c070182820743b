"""Server seconds per token of the offload MatMul, in-process vs ApplyPool (cipherlm.he.parallel).

SmolLM2-135M shapes, random weights (std 0.04), x ~ N(0, 1).  Per worker count W,
each group is planned with ``plan_matmul(..., workers=W)``, encoded (W = 1: in
process, as ServerEngine does today; W > 1: by the pool), and applied ``--reps``
times; per token = 30 x (qkv + o + gate_up + down) + lm_head (medians).

    .venv/bin/python benchmarks/he_parallel_bench.py [--workers 1 2] [--reps 5] [--skip-head]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cipherlm.he import ClientKeys, HEContext, HEOpCounter, OFFLOAD_CKKS, apply, decrypt_output
from cipherlm.he import encode_matrix, encrypt_input, load_galois_keys, plan_matmul
from cipherlm.he.parallel import ApplyPool, split_units

SHAPES = [
    ("q,k,v", [576, 192, 192], 576, 30),
    ("o", [576], 576, 30),
    ("gate,up", [1536, 1536], 576, 30),
    ("down", [576], 1536, 30),
    ("lm_head", [49152], 576, 1),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-head", action="store_true")
    ap.add_argument("--serial", action="store_true", help="also time each worker's share alone (projection)")
    args = ap.parse_args()
    ctx = HEContext(OFFLOAD_CKKS)
    keys = ClientKeys(ctx)
    rng = np.random.default_rng(0)
    shapes = [s for s in SHAPES if not (args.skip_head and s[0] == "lm_head")]
    mats = {name: np.concatenate([(rng.standard_normal((o, d_in)) * 0.04).astype(np.float32) for o in outs])
            for name, outs, d_in, _ in shapes}
    xs = {name: [rng.standard_normal(d_in) for _ in range(args.reps)] for name, _, d_in, _ in shapes}
    summary = {}
    for W in args.workers:
        plans = [plan_matmul(sum(outs), d_in, ctx.slots, splits=outs, workers=W) for _, outs, d_in, _ in shapes]
        steps = sorted({s for p in plans for s in p.rotation_steps})
        gk_bytes = keys.galois_keys_bytes(steps)
        pool = ApplyPool(OFFLOAD_CKKS, W) if W > 1 else None
        spool = ApplyPool(OFFLOAD_CKKS, W, serial=True) if W > 1 and args.serial else None
        try:
            t0 = time.perf_counter()
            encs = []
            for gid, ((name, _, _, _), p) in enumerate(zip(shapes, plans)):
                if pool is None:
                    encs.append(encode_matrix(ctx, mats[name], None, plan=p))
                else:
                    pool.add_matrix(gid, [mats[name]], None, p)
                    if spool:
                        spool.add_matrix(gid, [mats[name]], None, p)
            t_enc = time.perf_counter() - t0
            sess = pool.open_session(gk_bytes) if pool else load_galois_keys(ctx, gk_bytes, plans)
            ssess = spool.open_session(gk_bytes) if spool else None
            per_token = proj_token = 0.0
            print(f"\nW={W}: encode of the {len(shapes)} shapes {t_enc:.1f} s")
            for gid, ((name, _, _, count), p) in enumerate(zip(shapes, plans)):
                ts, errs, c = [], [], HEOpCounter()
                for x in xs[name]:
                    ct = encrypt_input(keys, x, p)
                    c = HEOpCounter()
                    t1 = time.perf_counter()
                    out = pool.apply(gid, ct, sess, c) if pool else apply(encs[gid], ct, sess, c)
                    ts.append(time.perf_counter() - t1)
                    y = decrypt_output(keys, out, p)
                    ref = mats[name].astype(np.float64) @ x
                    errs.append(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
                med = float(np.median(ts))
                per_token += count * med
                proj = ""
                if spool:
                    pj = []
                    for x in xs[name]:
                        ct = encrypt_input(keys, x, p)
                        t1 = time.perf_counter()
                        spool.apply(gid, ct, ssess)
                        wall = time.perf_counter() - t1
                        ws = spool.last_worker_seconds
                        pj.append(wall - sum(ws) + max(ws))
                    proj_token += count * float(np.median(pj))
                    proj = f", projected with {W} free cores {np.median(pj)*1e3:7.1f} ms"
                parts = [len(u) for u in split_units(p, W)]
                print(
                    f"  {name:8s} c/m/blocks/g/b {p.c}/{p.m}/{p.n_blocks}/{p.g}/{p.b} units/worker {parts} "
                    f"rot {c.rotations} mul {c.multiply_plain} rescale {c.rescale}: {med*1e3:7.1f} ms "
                    f"(x{count}), max rel err {max(errs):.1e}{proj}"
                )
            summary[W] = per_token
            print(f"  server seconds per token (30 layers + head): {per_token:.2f} s")
            if spool:
                print(f"  projected with {W} free cores (shares timed one at a time): {proj_token:.2f} s")
        finally:
            if pool:
                pool.close()
            if spool:
                spool.close()
    if 1 in summary:
        for W, s in summary.items():
            print(f"W={W}: {s:.2f} s/token, speedup {summary[1]/s:.2f}x")


if __name__ == "__main__":
    main()

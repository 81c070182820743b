"""Micro-benchmark of the offload ct x pt MatMul (cipherlm.he.matmul) on SmolLM2-135M shapes.

Random weights (std 0.04) and activations (std 1); one token per request.
Prints per shape: plan, encode time, cached plaintexts and their memory,
server apply time, client encrypt/decrypt time, op counts, bytes up/down,
the Galois-key bytes for the plan, and the precision vs numpy float64.

    .venv/bin/python benchmarks/he_matmul_micro.py [--reps 3] [--skip-head] [--calibrate]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cipherlm.he import ClientKeys, HEContext, HEOpCounter, OFFLOAD_CKKS, apply, decrypt_output
from cipherlm.he import encode_matrix, encrypt_input, load_galois_keys
from cipherlm.he.matmul import CostModel, measure_costs, plan_matmul

SHAPES = [
    ("q,k,v", [576, 192, 192], 576),
    ("o", [576], 576),
    ("gate,up", [1536, 1536], 576),
    ("down", [576], 1536),
    ("lm_head", [49152], 576),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-head", action="store_true")
    ap.add_argument("--calibrate", action="store_true", help="plan with measured op costs")
    ap.add_argument("--mbps", type=float, default=100.0, help="link speed the planner assumes")
    args = ap.parse_args()
    ctx = HEContext(OFFLOAD_CKKS)
    keys = ClientKeys(ctx)
    cm = measure_costs(ctx, keys)
    cm = CostModel(cm.rotate, cm.multiply_plain, cm.add, cm.rescale, byte=8.0 / (args.mbps * 1e6))
    print(
        f"params {OFFLOAD_CKKS.name}: N={ctx.n} q={OFFLOAD_CKKS.coeff_modulus_bits} slots={ctx.slots}\n"
        f"measured op costs: rotate {cm.rotate*1e3:.2f} ms, multiply_plain {cm.multiply_plain*1e3:.3f} ms, "
        f"add {cm.add*1e3:.3f} ms, rescale {cm.rescale*1e3:.3f} ms"
    )
    rng = np.random.default_rng(0)
    total_mem = 0
    for name, outs, d_in in SHAPES:
        if args.skip_head and name == "lm_head":
            continue
        Ws = [(rng.standard_normal((o, d_in)) * 0.04).astype(np.float32) for o in outs]
        kw = {"plan": plan_matmul(sum(outs), d_in, ctx.slots, splits=outs, cost_model=cm if args.calibrate else CostModel(byte=cm.byte))}
        t0 = time.perf_counter()
        enc = encode_matrix(ctx, np.concatenate(Ws, axis=0), None, **kw)
        t_enc = time.perf_counter() - t0
        p = enc.plan
        gk_bytes = keys.galois_keys_bytes(p.rotation_steps or [1])
        gk = load_galois_keys(ctx, gk_bytes, [p])
        W = np.concatenate(Ws, axis=0).astype(np.float64)
        t_apply, t_encr, t_decr, errs = [], [], [], []
        counter = HEOpCounter()
        for r in range(args.reps):
            x = rng.standard_normal(d_in)
            c = HEOpCounter()
            t0 = time.perf_counter()
            ct = encrypt_input(keys, x, p, c)
            t1 = time.perf_counter()
            out = apply(enc, ct, gk, c)
            t2 = time.perf_counter()
            y = decrypt_output(keys, out, p, c)
            t3 = time.perf_counter()
            ref = W @ x
            errs.append(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
            t_encr.append(t1 - t0)
            t_apply.append(t2 - t1)
            t_decr.append(t3 - t2)
            counter = c
        total_mem += enc.nbytes
        print(
            f"\n{name:8s} ({sum(outs)} x {d_in}) plan c={p.c} m={p.m} rows={p.rows} blocks={p.n_blocks} "
            f"g={p.g} b={p.b}\n"
            f"  encode {t_enc:.2f} s, {enc.n_plaintexts} plaintexts, {enc.nbytes/2**20:.1f} MiB\n"
            f"  server apply {np.median(t_apply)*1e3:.1f} ms | client encrypt {np.median(t_encr)*1e3:.1f} ms, "
            f"decrypt {np.median(t_decr)*1e3:.1f} ms\n"
            f"  ops/token: rot {counter.rotations}, mul_plain {counter.multiply_plain}, add {counter.add}, "
            f"rescale {counter.rescale}\n"
            f"  bytes/token: up {counter.bytes_in}, down {counter.bytes_out}; "
            f"Galois keys ({len(p.rotation_steps)} steps) {len(gk_bytes)} B\n"
            f"  max rel err vs float64: {max(errs):.2e}"
        )
    print(f"\nencoded plaintext memory, all shapes above: {total_mem/2**20:.0f} MiB")


if __name__ == "__main__":
    main()

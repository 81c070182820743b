#!/usr/bin/env python3
"""BLB fused blocks evaluated in CKKS against the plaintext executor (issue 16 item 2).

    .venv/bin/python benchmarks/blb_block_errors.py [--model minilm-l6] [--tokens 8]
        [--blocks 0,1,2,3,4,5,31] [--param-tokens 128]

For an installed model (`cipherlm.models`), with random token ids: the plaintext executor
on the `blb_fusion` graph gives every value; each listed HE block is evaluated by
`runtime.blb_block.evaluate_block` at its `passes.blb_params` set (for the real
weights and ``--param-tokens`` symbolic lengths, 128 as `cipherlm inspect --fusion blb`),
and the max error of each output is printed next to the noise model's prediction at its
magnitude bound and next to the target the parameters were chosen for (2^-17; a sum of squares relative to d 2^-8), as a
markdown table (docs/blb.md, "CKKS evaluation of a fused block").  Times: the evaluation
only (no key generation), on whatever this machine is; in parentheses the part spent
encoding the projections' diagonals (input-independent: a server does it ahead of time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--blocks", default="", help="block ids (default: the prologue, layer 0 and the epilogue)")
    ap.add_argument("--param-tokens", type=int, default=128)
    args = ap.parse_args()

    from cipherlm.compile import bind, build_graph
    from cipherlm.compile.passes import blb_fusion, blb_params as bp
    from cipherlm.he import lattigo_backend as lg
    from cipherlm.models import load_model
    from cipherlm.runtime.blb_block import evaluate_block, predicted_max_error
    from cipherlm.runtime.graph_executor import GraphExecutor

    lm = load_model(args.model)
    g0 = build_graph(lm.config)
    p = bind(g0, lm.weights)
    g = blb_fusion.run(g0)
    T = args.tokens
    ids = np.random.default_rng(0).integers(0, int(lm.config.get("vocab_size", 1000)), T)
    ex = GraphExecutor(g, p, dtype=np.float64)
    ctx = {"pos0": 0, "positions": np.arange(T), "T": T}
    inputs = {"ids": ids, "positions": np.arange(T)}
    if g.kind == "encoder":
        inputs["token_types"] = np.zeros(T, np.int64)
    vals = ex.run_nodes(ex.graph.nodes, inputs, ctx, ex.new_cache())
    params = {x.block: x for x in bp.run(g, params=p, tokens=args.param_tokens)}
    gains = bp.gains_of(g, p)
    blocks = {b["id"]: b for b in g.meta["blb_blocks"]}
    which = ([int(x) for x in args.blocks.split(",")] if args.blocks
             else [b for b, x in blocks.items() if x["layer"] in (None, 0)])  # prologue, layer 0, epilogue
    print(f"{args.model}, T = {T}, parameters for T = {args.param_tokens}")
    print("| block | output | N | scale | max abs value (bound) | max err | 16 sigma model | ratio | "
          "target | ratio | time (s) (of which projections natively, or encoding W in Python) |")
    print("|---" * 11 + "|")
    for bid in which:
        b, pp = blocks[bid], params[bid]
        hctx = lg.LattigoContext(pp.he_params)
        be = lg.LattigoBackend()
        keys = be.keygen(hctx)
        t0 = time.perf_counter()
        stats: dict = {}
        out = evaluate_block(g, b, {i["value"]: vals[i["value"]] for i in b["inputs"]}, p, hctx, be, keys,
                             scale_bits=pp.scale_bits, stats=stats)
        secs = time.perf_counter() - t0
        enc = stats["encode_weights_s"] + stats["native_linear_s"]
        for v, y in out.items():
            ref = np.asarray(vals[v], np.float64)
            fin = np.isfinite(ref)
            err = float(np.abs(y[fin] - ref[fin]).max())
            mag = float(np.abs(ref[fin]).max())
            bound, mag_bound, target = predicted_max_error(g, b, v, pp, gains, args.param_tokens)
            print(f"| {bid} | {v} | {pp.ring_degree} | 2^{pp.scale_bits} | {mag:.3g} ({mag_bound:.3g}) | {err:.2e} | "
                  f"{bound:.2e} | {err / bound:.2g} | {target:.2e} | {err / target:.2g} | {secs:.1f} ({enc:.1f}) |",
                  flush=True)


if __name__ == "__main__":
    main()

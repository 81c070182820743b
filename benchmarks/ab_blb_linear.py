"""A/B of one BLB projection (`runtime.blb_block._Eval.linear`): the backend's one native
call (`blb_linear`, native/lattigo/blb_linear.go) against the diagonal-by-diagonal Python
path, on the same input ciphertexts, alternating, with the outputs checked byte for byte.

Shapes (the periods `block_period` picks; N = 16384, a BLB block's depth-3 chain):

* ``minilm-ffn-up-8``: MiniLM's FFN up (384 -> 1536) at 8 tokens, P = 1024;
* ``minilm-qkv-128``: one of MiniLM's 384 -> 384 projections at 128 tokens, P = 64;
* ``bert-ffn-up-128``: BERT-base's FFN up (768 -> 3072) at 128 tokens, P = 64 (long).

    python benchmarks/ab_blb_linear.py [--shapes minilm-ffn-up-8,minilm-qkv-128] [--rounds 2]
"""

import argparse
import json
import os
import time

import numpy as np

from cipherlm.compile.passes.blb_params import BlockParams
from cipherlm.he import lattigo_backend as lattigo
from cipherlm.runtime import blb_block

SHAPES = {"minilm-ffn-up-8": (384, 1536, 8, 1024), "minilm-qkv-128": (384, 384, 128, 64),
          "bert-ffn-up-128": (768, 3072, 128, 64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="minilm-ffn-up-8,minilm-qkv-128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    pp = BlockParams(block=0, depth=3, ring_degree=16384, scale_bits=40, output_primes=(60,),
                     chain=(60, 40, 40, 40), special=(60,), predicted_std=0.0, target=0.0)
    ctx = lattigo.LattigoContext(pp.he_params)
    be = lattigo.LattigoBackend()
    keys = be.keygen(ctx)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.shapes.split(","):
        d_in, d_out, tokens, P = SHAPES[name]
        w = rng.normal(0, 0.05, (d_out, d_in))
        arr = rng.normal(0, 1, (tokens, d_in))
        steps = sorted({s for do in blb_block.chunk_widths(d_out, P)
                        for s in blb_block.linear_steps(min(d_in, P), do, ctx.slots)})
        evk = keys.eval_keys(relin=False, steps=steps)
        io = blb_block.LocalIO(keys)
        x = blb_block._Eval(ctx, be, io, evk, P, pp.scale_bits, None).encrypt("x", arr, "row", ctx.max_level,
                                                                                2.0 ** pp.scale_bits)
        secs: dict[str, list] = {"native": [], "python": []}
        first: dict[str, list] = {}
        for rnd in range(args.rounds):
            for mode in (("native", "python") if rnd % 2 == 0 else ("python", "native")):
                ev = blb_block._Eval(ctx, be, io, evk, P, pp.scale_bits, None)
                ev.native = mode == "native"
                t0 = time.perf_counter()
                y = ev.linear(x, w, None)
                secs[mode].append(time.perf_counter() - t0)
                first.setdefault(mode, [be.ciphertext_to_bytes(c) for c in y.cts.reshape(-1)])
                print(f"{name} round {rnd} {mode}: {secs[mode][-1]:.2f} s ({ev.stats['ct_pt']} products)", flush=True)
        same = first["native"] == first["python"]
        rows.append({"shape": name, "d_in": d_in, "d_out": d_out, "tokens": tokens, "period": P, "seconds": secs,
                     "python_over_native": min(secs["python"]) / min(secs["native"]), "identical_bytes": same})
        print(f"{name}: python / native = {rows[-1]['python_over_native']:.2f} (min of {args.rounds}), "
              f"identical ciphertexts: {same}", flush=True)
    res = {"rows": rows, "N": 16384, "load_average": list(os.getloadavg()), "cpus": os.cpu_count()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

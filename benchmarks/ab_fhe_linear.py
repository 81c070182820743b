"""A/B of the fhe mode's projection (cipherlm/protocols/ckks/linear.py): the one-call native
path (`LattigoBackend.token_group_linear`, native/lattigo/tg_linear.go) against the
per-diagonal Python reference path (`EncodedLinear.native = False`), alternating in one
process on the same ciphertexts, at the production preset N16QP1546H192H32.

Default shape: MiniLM's FFN up-projection (384 -> 1536) on 32 tokens (tp = 64, 512
channels per ciphertext), input at level 5.  Prints the seconds of each run, the max error
against numpy, and the ratio reference / native per round (docs/fhe.md quotes it).

    .venv/bin/python benchmarks/ab_fhe_linear.py [--rounds 2] [--d-in 384] [--d-out 1536] [--tokens 32] [--level 5]

``--out-levels 3,0``: instead, the native path with the input as it is against the same input
dropped for each output level cap (`EncodedLinear`'s ``out_level``: fewer primes to encode the
diagonals at), alternating; e.g. SmolLM2's o projection as layers 1-29 meet it, input just
refreshed (docs/fhe.md "Projections at the levels their readers use"):

    .venv/bin/python benchmarks/ab_fhe_linear.py --d-in 576 --d-out 576 --tokens 7 --level 9 --out-levels 3,0
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cipherlm.he import get_backend
from cipherlm.protocols.ckks import linear as L
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor
from cipherlm.protocols.ckks.packing import TokenPacking


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d-in", type=int, default=384)
    ap.add_argument("--d-out", type=int, default=1536)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--level", type=int, default=5)
    ap.add_argument("--preset", default="N16QP1546H192H32")
    ap.add_argument("--out-levels", default=None, help="comma-separated output level caps to A/B against none")
    a = ap.parse_args()
    be = get_backend("lattigo")
    ctx = be.bootstrappable_context(a.preset)
    sk = be.keygen(ctx)
    P = TokenPacking(ctx.slots, a.tokens, tp_min=2 * a.tokens)
    steps = sorted(L.rotation_steps(P))
    t0 = time.perf_counter()
    ek = sk.eval_keys(relin=True, steps=steps)
    print(f"{len(steps)} rotation keys in {time.perf_counter() - t0:.1f} s", flush=True)
    ev = CkksEvaluator(be, ctx, ek, refresher=lambda cts, bound, factor=1.0: cts)  # never called here
    rng = np.random.default_rng(0)
    X = rng.normal(size=(a.tokens, a.d_in))
    W = rng.normal(size=(a.d_out, a.d_in)) / 20
    cts = [sk.encrypt(be.encode_slots(ctx, r)) for r in P.pack(X)]
    for c in cts:
        be.mod_switch_to_inplace(ctx, c, a.level)
    x = CkksTensor(cts, a.d_in, P, 4.0)
    # (label, native, out_level cap)
    if a.out_levels:
        variants = [("as is", True, None)] + [(f"cap {c}", True, int(c)) for c in a.out_levels.split(",")]
    else:
        variants = [("native", True, None), ("reference", False, None)]
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    for rnd in range(a.rounds):
        for label, native, cap in (variants if rnd % 2 == 0 else variants[::-1]):
            lin = L.EncodedLinear(W, None, P, cache=False)
            lin.native = native
            t0 = time.perf_counter()
            y = lin(ev, x, bound=8.0, out_level=cap)
            dt = time.perf_counter() - t0
            got = np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in y.cts]).reshape(-1, P.tp)
            err = np.abs(P.unpack(got.reshape(-1, ctx.slots), a.d_out) - X @ W.T).max()
            print(f"round {rnd} {label}: {dt:.1f} s, output level {y.level}, max error {err:.2e}", flush=True)
            times[label].append(dt)
    base = variants[0][0]
    for label, *_ in variants[1:]:
        print(f"{label} / {base} per round:", [round(t / b, 2) for t, b in zip(times[label], times[base])])

if __name__ == "__main__":
    main()

"""A/B of the fhe mode's Q.K^T and P.V (cipherlm/protocols/ckks/attention.py) against the
same module at an earlier commit (default 882a657: one product, one relinearisation and one
head window per shift), alternating in one process on the same ciphertexts, at the
production preset N16QP1546H192H32.

Default shape: one MiniLM attention (12 heads of 32, d = 384) on 32 tokens (tp = 64, 512
channels per ciphertext: one ciphertext), Q/K/V at level 5.  The softmax between them runs
once (this checkout's code, a refresh by the key holder standing in for the client's) and
both P.V variants read its output.  Prints the seconds of each step and variant, the max
error against numpy and the ratio new / old per round (docs/fhe.md quotes it).

    .venv/bin/python benchmarks/ab_fhe_attention.py [--rounds 2] [--tokens 32] [--d 384] [--base 882a657]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cipherlm.fhe.approx import approximation
from cipherlm.he import get_backend
from cipherlm.protocols.ckks import attention as new
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor
from cipherlm.protocols.ckks.packing import TokenPacking
from cipherlm.runtime import ops

ROOT = Path(__file__).resolve().parents[1]


def load_base(commit: str):
    """attention.py as of ``commit``, imported as a module of the same package."""
    src = subprocess.run(["git", "show", f"{commit}:cipherlm/protocols/ckks/attention.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "attention_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("cipherlm.protocols.ckks.attention_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--level", type=int, default=5)
    ap.add_argument("--base", default="882a657")
    ap.add_argument("--preset", default="N16QP1546H192H32",
                    help="or test-insecure-N1024 for a smoke run (--tokens 5 --d 32 --head-dim 8)")
    a = ap.parse_args()
    old = load_base(a.base)
    be = get_backend("lattigo")
    ctx = be.bootstrappable_context(a.preset, allow_insecure_for_tests=a.preset.startswith("test-insecure"))
    sk = be.keygen(ctx)
    T, d, hd = a.tokens, a.d, a.head_dim
    P = TokenPacking(ctx.slots, T, tp_min=2 * T)
    steps = set(new.rotation_steps(P, hd)) | set(old.rotation_steps(P, hd))
    t0 = time.perf_counter()
    ek = sk.eval_keys(relin=True, steps=sorted(steps))
    print(f"{len(steps)} rotation keys in {time.perf_counter() - t0:.1f} s", flush=True)

    def refresher(cts, bound, factor=1.0):  # the client's refresh, by the key holder
        return [sk.encrypt(be.encode_slots(ctx, be.decode_slots(ctx, sk.decrypt(c)) * factor)) for c in cts]

    ev = CkksEvaluator(be, ctx, ek, refresher=refresher)
    rng = np.random.default_rng(0)
    Q, K, V = (rng.normal(size=(T, d)) for _ in range(3))
    scale = 1 / np.sqrt(hd)
    H = d // hd
    qh, kh, vh = (m.reshape(T, H, hd).transpose(1, 0, 2) for m in (Q, K, V))
    S = qh @ kh.transpose(0, 2, 1) * scale
    bound = float(np.abs(S).max()) * 1.2
    want = (ops.softmax(S, axis=-1) @ vh).transpose(1, 0, 2).reshape(T, d)

    def enc(X):
        cts = [sk.encrypt(be.encode_slots(ctx, r)) for r in P.pack(X)]
        for c in cts:
            be.mod_switch_to_inplace(ctx, c, a.level)
        return CkksTensor(cts, d, P, 4.0)

    q, k, v = enc(Q), enc(K), enc(V)
    e_iv, i_iv = new.softmax_intervals(bound, False, hd, T, 2 * T - 1)
    exp_a, inv_a = approximation("exp", *e_iv, 1e-6), approximation("inv", *i_iv, 1e-4)
    p = None
    variants = [("new", new), ("old", old)]
    times: dict[str, dict[str, list[float]]] = {"qk": {"new": [], "old": []}, "av": {"new": [], "old": []}}
    for rnd in range(a.rounds):
        for label, mod in (variants if rnd % 2 == 0 else variants[::-1]):
            t0 = time.perf_counter()
            s = mod.scores(ev, q, k, hd, scale, bound)
            times["qk"][label].append(time.perf_counter() - t0)
            if p is None:
                p = new.softmax(ev, s, exp_a, inv_a)
            t0 = time.perf_counter()
            out = mod.attend(ev, p, v, bound=4.0)
            times["av"][label].append(time.perf_counter() - t0)
            got = P.unpack(np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in out.cts]), d)
            print(f"round {rnd} {label}: Q.K^T {times['qk'][label][-1]:.1f} s, P.V {times['av'][label][-1]:.1f} s, "
                  f"max error {np.abs(got - want).max():.2e}", flush=True)
    for step in ("qk", "av"):
        print(f"{step} new / old per round:", [round(n / o, 2) for n, o in zip(times[step]["new"], times[step]["old"])])


if __name__ == "__main__":
    main()

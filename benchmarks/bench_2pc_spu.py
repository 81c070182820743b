#!/usr/bin/env python3
"""cipherlm 2pc vs SecretFlow-SPU 0.9.5 (CHEETAH, FM64) on the same Transformer layers, in one run.

    bash benchmarks/setup_peers.sh spu                       # once: the SPU venv in .peers/spu
    .venv/bin/python benchmarks/bench_2pc_spu.py [--workloads minilm,smollm-block,bert-base]
        [--tokens T] [--layers L] [--linear-packing coeff,simd] [--packing-network LAN|WAN]
        [--fusion none,blb] [--report reports/bench_2pc_spu.json]

Issue 4's benchmark: MiniLM at 128 tokens (its 6 encoder layers: one inference
without the embedding lookup) and one SmolLM2 decoder block at 64 tokens, plus
a BERT-base-shaped layer (random weights; x12 extrapolated) next to the
published figures.  Both systems start from the same secret-shared hidden
states and run the same layers (cipherlm.bench.twopc / benchmarks/spu_models.py),
each as two OS processes over loopback TCP; bytes are both directions (SPU:
the sum of both parties' "total send bytes" from its profile log), seconds the
client's wall time, errors max |output - plaintext executor| on the same input.
LAN/WAN: compute + bytes / bandwidth + flights x latency (CryptoMoE presets;
SPU's flights = its send actions).

``--fusion blb`` (issue 16's benchmark; minilm and bert-base) adds cipherlm's BLB+fused
row (`cipherlm.bench.blb`, the same weights and token ids, two processes over loopback):
BLB's executor starts from the token ids, so that row is reported without its embedding
lookup's bytes, flights and seconds (`run_blb`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SPU_PY = ROOT / ".peers" / "spu" / "bin" / "python"


def spu_inputs(prep: dict) -> tuple[str, dict]:
    """(SPU function name, its npz inputs) for a prepared cipherlm.bench.twopc workload."""
    from cipherlm.runtime import ops

    W, cfg, x = prep["weights"], prep["config"], prep["x"]
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    if prep["workload"] in ("minilm", "bert-base"):
        names = {"wq": "attention.self.query", "wk": "attention.self.key", "wv": "attention.self.value",
                 "wo": "attention.output.dense", "wi": "intermediate.dense", "wo2": "output.dense"}
        lns = {"1": "attention.output.LayerNorm", "2": "output.LayerNorm"}
        d = {"x": f32(x), "heads": f32(cfg["num_attention_heads"]), "eps": f32(cfg.get("layer_norm_eps", 1e-12))}
        L = prep["layers"]
        for k, n in names.items():
            d[k] = f32([W[f"encoder.layer.{i}.{n}.weight"].T for i in range(L)])
            d["b" + k[1:]] = f32([W[f"encoder.layer.{i}.{n}.bias"] for i in range(L)])
        for j, n in lns.items():
            d["g" + j] = f32([W[f"encoder.layer.{i}.{n}.weight"] for i in range(L)])
            d["b" + j] = f32([W[f"encoder.layer.{i}.{n}.bias"] for i in range(L)])
        return "bert_layers", d
    p = "model.layers.0"
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // H
    T = x.shape[0]
    inv = ops.rope_inv_freq(hd, cfg.get("rope_theta", 10000.0))
    ang = np.arange(T)[:, None] * inv[None]
    ang = np.concatenate([ang, ang], axis=-1)[None]  # (1, T, hd), rotate-half layout
    mask = np.where(np.tril(np.ones((T, T), bool)), 0.0, -100.0)[None]
    d = {"x": f32(x), "cos": f32(np.cos(ang)), "sin": f32(np.sin(ang)), "mask": f32(mask), "heads": f32(H),
         "kv_heads": f32(Hkv), "eps": f32(cfg.get("rms_norm_eps", 1e-6)),
         "wq": f32(W[f"{p}.self_attn.q_proj.weight"].T), "wk": f32(W[f"{p}.self_attn.k_proj.weight"].T),
         "wv": f32(W[f"{p}.self_attn.v_proj.weight"].T), "wo": f32(W[f"{p}.self_attn.o_proj.weight"].T),
         "g1": f32(W[f"{p}.input_layernorm.weight"]), "g2": f32(W[f"{p}.post_attention_layernorm.weight"]),
         "wg": f32(W[f"{p}.mlp.gate_proj.weight"].T), "wu": f32(W[f"{p}.mlp.up_proj.weight"].T),
         "wd": f32(W[f"{p}.mlp.down_proj.weight"].T)}
    return "llama_block", d


#: the workloads with a BLB row (`cipherlm.bench.blb` has no SmolLM2 block: see docs/blb.md)
BLB_WORKLOADS = ("minilm", "bert-base")


def run_blb(prep: dict) -> dict:
    """cipherlm with BLB fusion (issue 16): `cipherlm.bench.blb`'s BLB+fused row on the same
    weights and token ids, the two parties as two OS processes over loopback TCP like the
    other rows.  BLB's executor runs the whole encoder from the token ids, so the row is
    reported without its embedding lookup (the meter's ``embedding`` class: bytes, flights and
    seconds), since SPU and the BFV+MPC rows start from the embedding's output; the fused
    prologue (the embedding sum and the embedding LayerNorm) stays in, a little more work than
    theirs.  Errors: against `bench.blb`'s plaintext reference (the same function and input)."""
    from cipherlm.bench import blb as BB
    from cipherlm.bench import twopc as B

    w = prep["workload"]
    if w not in BLB_WORKLOADS:
        raise ValueError(f"no BLB row for {w!r} (one of {', '.join(BLB_WORKLOADS)})")
    bprep = BB.prepare(w, prep["layers"], prep["tokens"], ids=prep["ids"])
    full = BB.run_row(bprep, "BLB+fused", processes=True)
    emb = full["by_class"].get("embedding", {"bytes": 0, "flights": 0, "seconds": 0.0})
    by_class = {k: v for k, v in full["by_class"].items() if k != "embedding"}
    total = full["bytes"] - int(emb["bytes"])
    flights = full["flights"] - int(emb["flights"])
    seconds = full["compute_seconds"] - float(emb["seconds"])
    row = {"workload": w, "tokens": prep["tokens"], "layers": prep["layers"], "fusion": "blb",
           "bytes": total, "flights": flights, "seconds": seconds, "setup": full["setup"],
           "max_abs_error": full["max_abs_error"], "by_class": by_class,
           "embedding_excluded": {k: emb[k] for k in ("bytes", "flights", "seconds")}, "blb_row": full}
    row.update(B.modelled_seconds(seconds, total, flights))
    return row


def run_spu(prep: dict) -> dict:
    from cipherlm.net.netmodel import PRESETS

    name, data = spu_inputs(prep)
    with tempfile.TemporaryDirectory(prefix="cipherlm-spu-") as tmp:
        ind, outd = Path(tmp) / "in", Path(tmp) / "out"
        ind.mkdir()
        np.savez(ind / f"{name}.npz", **data)
        r = subprocess.run([str(SPU_PY), str(ROOT / "benchmarks" / "spu_peer.py"), str(ind), str(outd), name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"SPU peer failed: {r.stderr[-3000:]}")
        rows = json.loads((outd / "results.json").read_text())
        row = [x for x in rows if x["name"] == name][0]
        out = np.load(outd / f"{name}.out.npz")["out0"]
    res = {"bytes": row["bytes"], "flights": row["send_actions"], "seconds": row["seconds"],
           "max_abs_error": float(np.abs(out - prep["ref"]).max())}
    for net in ("LAN", "WAN"):
        res[f"{net}_seconds"] = res["seconds"] + PRESETS[net].seconds(res["bytes"], res["flights"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="minilm,smollm-block,bert-base")
    ap.add_argument("--tokens", type=int, default=None, help="default 128 (smollm-block 64)")
    ap.add_argument("--layers", type=int, default=None, help="default: minilm 6, bert-base 1")
    ap.add_argument("--report", type=Path, default=ROOT / "reports" / "bench_2pc_spu.json")
    ap.add_argument("--linear-packing", default="coeff",
                    help="cipherlm's linear-layer packings to run, comma-separated (coeff, simd, auto): "
                         "each is one cipherlm row next to the same SPU run")
    ap.add_argument("--packing-network", default="LAN", choices=("LAN", "WAN"),
                    help="network the packing cost model and the SIMD plans assume")
    ap.add_argument("--fusion", default="none",
                    help="cipherlm rows, comma-separated: none (today's pipeline, one row per --linear-packing) "
                         "and/or blb (BLB+fused, issue 16; minilm and bert-base only)")
    args = ap.parse_args()
    packings = [p.strip() for p in args.linear_packing.split(",") if p.strip()]
    fusions = [f.strip() for f in args.fusion.split(",") if f.strip()]
    if not fusions or set(fusions) - {"none", "blb"}:
        print(f"--fusion: none and/or blb, got {args.fusion!r}", file=sys.stderr)
        return 2
    if "blb" in fusions and set(w.strip() for w in args.workloads.split(",")) - set(BLB_WORKLOADS):
        print(f"--fusion blb: workloads {', '.join(BLB_WORKLOADS)} only", file=sys.stderr)
        return 2
    if not SPU_PY.exists():
        print(f"no SPU venv at {SPU_PY}: run `bash benchmarks/setup_peers.sh spu` first", file=sys.stderr)
        return 2
    from cipherlm.bench import twopc as B

    results = []
    for w in args.workloads.split(","):
        prep = B.prepare(w.strip(), args.tokens, args.layers)
        print(f"{w}: {prep['tokens']} tokens, {prep['layers']} layer(s): cipherlm ...", file=sys.stderr, flush=True)
        by_packing = {}
        for pk in packings if "none" in fusions else ():
            if len(packings) > 1:
                print(f"{w}: cipherlm, linear packing {pk} ...", file=sys.stderr, flush=True)
            by_packing[pk] = B.run_workload(w.strip(), prepared=prep, linear_packing=pk,
                                            network=args.packing_network)
        if "blb" in fusions:
            print(f"{w}: cipherlm, BLB+fused ...", file=sys.stderr, flush=True)
            by_packing["blb"] = run_blb(prep)
        print(f"{w}: SecretFlow-SPU ...", file=sys.stderr, flush=True)
        spu = run_spu(prep)
        results.append({"workload": w, "tokens": prep["tokens"], "layers": prep["layers"],
                        "cipherlm": next(iter(by_packing.values())), "cipherlm_by_packing": by_packing, "spu": spu})
        for pk, ours in by_packing.items():
            print(B.format_rows([ours]))
            what = "BLB+fused, without the embedding" if pk == "blb" else f"{pk} packing"
            print(f"{'':4}ratio cipherlm ({what}) / SPU: bytes {ours['bytes'] / spu['bytes']:.2f}x, "
                  f"time {ours['seconds'] / spu['seconds']:.2f}x, LAN {ours['LAN_seconds'] / spu['LAN_seconds']:.2f}x, "
                  f"WAN {ours['WAN_seconds'] / spu['WAN_seconds']:.2f}x", flush=True)
        print(f"{'':4}SPU: {spu['bytes'] / 1e9:.3f} GB, {spu['flights']} send actions, {spu['seconds']:.1f} s, "
              f"LAN {spu['LAN_seconds']:.1f} s, WAN {spu['WAN_seconds']:.1f} s, max err {spu['max_abs_error']:.2e}",
              flush=True)
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps({"machine": {"cpu_count": os.cpu_count()}, "command": sys.argv,
                                           "results": results}, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

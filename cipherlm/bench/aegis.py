"""`cipherlm bench aegis`: one fhe pass spread over W workers (AEGIS, docs/aegis.md), for
each W and placement: bytes between workers per layer half (attention, FFN), measured
through the executor and next to Table 2's formula at the same levels, the compile pass's
prediction, wall time per half, scaling efficiency T1 / (W T_W), per worker the peak
RSS, CPU seconds in operators and bootstraps, and the error against plaintext.

Workloads (random weights, `transformers` configs):

* ``bert-base``: BERT-base shapes (hidden 768, 12 heads of 64, FFN 3072), ``--layers``
  layers (default 1);
* ``bert-tiny``: hidden 64, 4 heads of 16, FFN 256 (quick runs).

At the INSECURE N = 2^10 test preset (512 slots) whole heads of 64 channels fit a
ciphertext only up to 4 tokens; the production preset N16QP1546H192H32 needs the
bootstrapping keys (~8 GB) on every worker.  Placements: ``aegis``, ``megatron`` (the
row-parallel tensor-parallel baseline) and ``hydra`` (column-wise tensor parallelism, the
stream gathered at each layer boundary; `runtime.aegis_executor`); the limb-parallel baseline (HE-Booster)
needs RNS limbs split across workers, which Lattigo's ciphertexts do not offer: its traffic is
given by the paper's formula only (docs/aegis.md).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

WORKLOADS = {
    "bert-base": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
    "bert-tiny": {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256},
}


def _model(workload: str, layers: int, tokens: int):
    import torch
    import transformers

    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model

    if workload not in WORKLOADS:
        raise SystemExit(f"unknown aegis workload {workload!r} (one of {sorted(WORKLOADS)})")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=layers, max_position_embeddings=max(512, tokens),
                                  **WORKLOADS[workload])
    with tempfile.TemporaryDirectory() as d:
        transformers.BertModel(cfg).eval().save_pretrained(d)
        lm = load_model(d)
    rng = np.random.default_rng(0)
    model = calibrated_model(lm, [rng.integers(1000, 20000, size=tokens) for _ in range(4)])
    return lm, model


def _by_part(collectives: list, key: str) -> dict:
    out: dict[str, int] = {}
    for c in collectives:
        k = c["key"]
        out[k] = out.get(k, 0) + c[key]
    return out


def _predicted(model, W: int, tokens: int, slots: int, n: int) -> dict:
    """The compile pass's bytes per layer half (its level plan, not the executor's levels)."""
    from cipherlm.compile.passes import aegis_placement
    from cipherlm.runtime.aegis_executor import part_key

    plan = aegis_placement.run(model.graph, W, tokens, slots=slots, n=n)
    out: dict[str, int] = {}
    for c in plan.collectives():
        k = part_key(c.node.split(",")[0])
        out[k] = out.get(k, 0) + c.bytes
    return out


def bench(workload: str = "bert-tiny", layers: int = 1, tokens: int = 4, workers=(1, 2),
          placements=("aegis", "megatron"), preset: str = "test-insecure-N1024", insecure: bool = True,
          runtime: str = "ray", ray_address: str | None = None, progress=print, warmup: bool = True,
          threads: int | None = 1, dispatch=("async",)) -> dict:
    """See the module docstring; each W and placement gets fresh workers, a warm-up pass
    (``warmup``) and the measured pass.  ``threads``: OS threads per Ray worker (GOMAXPROCS;
    default 1, so W workers on W cores compare with one worker on one core; None: all).
    ``dispatch``: the executor's dispatch modes to run for each W > 1 ("async": queued calls,
    one wait per layer half; "sync": a barrier after every operator), in that order, on the
    same workers: an A/B of the overlap (AEGIS 4.4.1) in one run."""
    from cipherlm.he import get_backend
    from cipherlm.runtime.aegis_executor import DISPATCH, AegisExecutor, InlineRuntime, RayRuntime
    from cipherlm.runtime.fhe_executor import client_embedding, client_tensors
    from cipherlm.runtime.plain import plain_executor

    if not dispatch or any(d not in DISPATCH for d in dispatch):
        raise SystemExit(f"--dispatch: one or more of {DISPATCH}, got {','.join(dispatch)!r}")
    lm, model = _model(workload, layers, tokens)
    be = get_backend("lattigo")
    ctx = be.bootstrappable_context(preset, allow_insecure_for_tests=insecure)
    P = model.packing(ctx.slots, tokens, tokens)
    t0 = time.perf_counter()
    sk = be.keygen(ctx)
    bk = sk.bootstrapping_keys()
    steps = model.rotation_steps(P)
    ek = sk.eval_keys(relin=True, steps=steps)
    blobs = {"relin": ek.relin_key_bytes(), "galois": sk.galois_keys_bytes(steps), "bootstrap": bk.to_bytes()}
    progress(f"keys in {time.perf_counter() - t0:.1f} s ({sum(map(len, blobs.values())) / 1e6:.1f} MB)")
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, 20000, size=tokens)
    x = client_embedding(model.graph, client_tensors(model), ids)
    up = [be.ciphertext_to_bytes(sk.encrypt(be.encode_slots(ctx, r))) for r in P.pack(x)]
    want = plain_executor(lm, dtype=np.float64).forward(ids)
    runs = []
    for W in workers:
        for placement in (("aegis",) if W == 1 else placements):
            rt = InlineRuntime() if runtime == "inline" else RayRuntime(ray_address, num_cpus=max(workers),
                                                                        threads=threads)
            ex = AegisExecutor(model, W, placement=placement, runtime=rt, cache_plaintexts=insecure)
            ex.open_session(preset, insecure, blobs, ctx.slots, ctx.n)
            progress(f"W={W} {placement}: running ..." + (" (a warm-up pass first)" if warmup else ""))
            if warmup:  # the projections' encodings and the actors' first calls: not timed
                ex.run(up, P)
            for mode in (dispatch[:1] if W == 1 else dispatch):
                ex.dispatch = mode
                res = ex.run(up, P)
                h = res["outputs"]["hidden"]
                s = np.stack([be.decode_slots(ctx, sk.decrypt(be.ciphertext_from_bytes(ctx, b))) for b in h])
                err = float(np.abs(P.unpack(s, want.shape[1]) - want).max())
                run = {"W": W, "placement": placement, "dispatch": mode, "seconds": res["seconds"],
                       "part_seconds": res["part_seconds"], "bytes": res["bytes"],
                       "bytes_by_part": _by_part(res["collectives"], "bytes"),
                       "formula_bytes_by_part": _by_part(res["collectives"], "formula_bytes"),
                       "predicted_bytes_by_part": _predicted(model, W, tokens, ctx.slots, ctx.n)
                       if placement == "aegis" and W > 1 else {},
                       "collectives": res["collectives"], "workers": res["workers"], "max_abs_error": err}
                progress(f"W={W} {placement} ({mode} dispatch): {res['seconds']:.1f} s, "
                         f"{res['bytes'] / 1e6:.2f} MB between workers, max error {err:.2e}")
                runs.append(run)
            ex.shutdown()
    bk.close()
    add_efficiency(runs)
    return {"workload": workload, "layers": layers, "tokens": tokens, "preset": preset, "n": ctx.n,
            "slots": ctx.slots, "runtime": runtime, "warmup": warmup, "threads_per_worker": threads, "runs": runs,
            "load_average": list(os.getloadavg())}


def add_efficiency(runs: list[dict]) -> None:
    """Each run's scaling efficiency T1 / (W T_W), per layer half and in total, against the
    one-worker run among ``runs`` (none without one)."""
    one = next((r for r in runs if r["W"] == 1), None)
    if one is None:
        return
    for r in runs:
        r["efficiency"] = {k: one["part_seconds"][k] / (r["W"] * v) for k, v in r["part_seconds"].items()
                           if k in one["part_seconds"] and v > 0}
        r["efficiency_total"] = one["seconds"] / (r["W"] * r["seconds"])


def merge(results: list[dict]) -> dict:
    """One result from runs of `bench` with the same workload, tokens and preset made in
    separate processes (one W each, as `benchmarks/device/aegis_scaling.sh` runs them), with
    the efficiencies against the one-worker run."""
    keys = ("workload", "layers", "tokens", "preset", "n")
    for r in results[1:]:
        if any(r[k] != results[0][k] for k in keys):
            raise ValueError(f"results of different runs: {[{k: x[k] for k in keys} for x in results]}")
    runs = [dict(run) for r in results for run in r["runs"]]
    add_efficiency(runs)
    return {**results[0], "runs": runs, "load_average": [r.get("load_average") for r in results]}


def minilm_polarity(sentences: int = 10, tokens: int = 8, W: int = 2, preset: str = "test-insecure-N1024",
                    insecure: bool = True, runtime: str = "ray", ray_address: str | None = None,
                    progress=print) -> dict:
    """MiniLM-L6 polarity classification of `sentences` test sentences (cut or repeated to
    `tokens` tokens) on W workers: the distributed prediction against plaintext's."""
    from cipherlm.he import get_backend
    from cipherlm.runtime.aegis_executor import AegisExecutor, InlineRuntime, RayRuntime
    from cipherlm.runtime.fhe_executor import client_embedding, client_tensors

    from .fhe import minilm_polarity_model

    ex, test, fit, model = minilm_polarity_model(tokens)
    be = get_backend("lattigo")
    ctx = be.bootstrappable_context(preset, allow_insecure_for_tests=insecure)
    P = model.packing(ctx.slots, tokens, tokens)
    sk = be.keygen(ctx)
    bk = sk.bootstrapping_keys()
    steps = model.rotation_steps(P)
    blobs = {"relin": sk.relin_key_bytes(), "galois": sk.galois_keys_bytes(steps), "bootstrap": bk.to_bytes()}
    rt = InlineRuntime() if runtime == "inline" else RayRuntime(ray_address, num_cpus=W)
    dist = AegisExecutor(model, W, runtime=rt, cache_plaintexts=insecure)
    dist.open_session(preset, insecure, blobs, ctx.slots, ctx.n)
    rows = []
    for i, (text, label) in enumerate(test[:sentences]):
        ids = fit(text)
        plain = ex.classify(np.asarray(ids))
        x = client_embedding(model.graph, client_tensors(model), ids)
        up = [be.ciphertext_to_bytes(sk.encrypt(be.encode_slots(ctx, r))) for r in P.pack(x)]
        res = dist.run(up, P, classify=True)
        got = np.stack([be.decode_slots(ctx, sk.decrypt(be.ciphertext_from_bytes(ctx, b)))
                        for b in res["outputs"]["logits"]]).reshape(-1, P.tp)[: len(plain), 0]
        rows.append({"sentence": i, "seconds": round(res["seconds"], 2), "bytes_between_workers": res["bytes"],
                     "fhe_prediction": int(np.argmax(got)), "plain_prediction": int(np.argmax(plain)),
                     "label": int(label), "max_logit_error": float(np.abs(got - plain).max())})
        progress(f"minilm W={W} sentence {i}: {res['seconds']:.1f} s, prediction {rows[-1]['fhe_prediction']} "
                 f"(plain {rows[-1]['plain_prediction']}), logit error {rows[-1]['max_logit_error']:.2e}")
    dist.shutdown()
    bk.close()
    return {"workload": "minilm-polarity", "W": W, "tokens": tokens, "preset": preset, "rows": rows,
            "identical_predictions": sum(r["fhe_prediction"] == r["plain_prediction"] for r in rows)}


def table(result: dict) -> str:
    """The per-layer-half table of `bench` (MB = 10^6 bytes)."""
    lines = [f"aegis bench: {result['workload']}, {result['layers']} layer(s), {result['tokens']} tokens, "
             f"{result['preset']} (N = {result['n']}), runtime {result['runtime']}, "
             f"{result.get('threads_per_worker') or 'all'} thread(s) per worker, load {result.get('load_average')}",
             f"{'W':>2} {'placement':15} {'part':13} {'measured MB':>11} {'Table 2 MB':>10} {'plan MB':>8} "
             f"{'seconds':>8} {'T1/(W TW)':>9}"]
    for r in result["runs"]:
        keys = sorted(set(r["part_seconds"]) | set(r["bytes_by_part"]))
        for k in keys:
            eff = r.get("efficiency", {}).get(k)
            pred = r["predicted_bytes_by_part"].get(k)
            lines.append(f"{r['W']:>2} {_label(r):15} {k:13} {r['bytes_by_part'].get(k, 0) / 1e6:>11.3f} "
                         f"{r['formula_bytes_by_part'].get(k, 0) / 1e6:>10.3f} "
                         f"{'-' if pred is None else f'{pred / 1e6:.3f}':>8} "
                         f"{r['part_seconds'].get(k, 0):>8.1f} {'-' if eff is None else f'{eff:.2f}':>9}")
        rss = ", ".join(f"{w['peak_rss_bytes'] / 1e9:.2f}" for w in r["workers"])
        lines.append(f"   total {r['seconds']:.1f} s, {r['bytes'] / 1e6:.3f} MB, error {r['max_abs_error']:.2e}, "
                     f"peak RSS per worker (GB): {rss}, bootstraps per worker: "
                     f"{[w['bootstraps'] for w in r['workers']]}")
    return "\n".join(lines)


def _label(run: dict) -> str:
    """A run's placement, with its dispatch mode when it is not the default."""
    mode = run.get("dispatch", "async")
    return run["placement"] if mode == "async" else f"{run['placement']}/{mode}"


def plot(result: dict, path: str) -> None:
    """Bytes between workers per layer half and placement, and scaling efficiency (as AEGIS's
    Figures 11-12)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["W"] > 1]
    parts = sorted({k for r in runs for k in r["bytes_by_part"]})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        a.bar(np.arange(len(parts)) + i * width, [r["bytes_by_part"].get(k, 0) / 1e6 for k in parts], width,
              label=f"{_label(r)} W={r['W']}")
    a.set_xticks(np.arange(len(parts)) + 0.4 - width / 2, parts, rotation=30)
    a.set_ylabel("MB between workers (measured)")
    a.legend()
    for placement, mode in sorted({(r["placement"], r.get("dispatch", "async")) for r in runs}):
        # this placement's runs in this dispatch mode, from the one-worker reference on
        rs = sorted((r for r in result["runs"] if r["placement"] == placement and "efficiency_total" in r
                     and (r["W"] == 1 or r.get("dispatch", "async") == mode)), key=lambda r: r["W"])
        b.plot([r["W"] for r in rs], [r["efficiency_total"] for r in rs], marker="o",
               label=_label({"placement": placement, "dispatch": mode}))
    b.set_xlabel("workers")
    b.set_ylabel("T1 / (W T_W)")
    b.set_ylim(0, 1.1)
    b.legend()
    fig.suptitle(f"{result['workload']}, {result['tokens']} tokens, {result['preset']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args) -> dict:
    """`cipherlm bench aegis` (see the module docstring)."""
    insecure = bool(getattr(args, "insecure_test_preset", False))
    preset = "test-insecure-N1024" if insecure else args.fhe_preset
    if preset.startswith("test-insecure") and not insecure:
        raise SystemExit(f"--fhe-preset {preset} is INSECURE: add --insecure-test-preset (tests only)")
    workers = [int(w) for w in str(args.workers or "1,2").split(",") if w.strip()]
    res = bench(args.workloads or "bert-tiny", int(getattr(args, "layers", 1) or 1), int(args.tokens or 4),
                workers, tuple(p.strip() for p in (getattr(args, "placements", None) or "aegis,megatron").split(",")),
                preset, insecure, getattr(args, "runtime", "ray") or "ray", getattr(args, "ray_address", None),
                progress=lambda m: print(f"bench aegis: {m}", file=sys.stderr, flush=True),
                dispatch=tuple(d.strip() for d in (getattr(args, "dispatch", None) or "async").split(",")))
    print(table(res))
    if getattr(args, "plot", None):
        plot(res, args.plot)
    return res

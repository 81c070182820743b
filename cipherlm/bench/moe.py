"""``cipherlm bench moe``: one private MoE layer, CryptoMoE Table 2 style.

Rows (CryptoMoE section 5.2): insecure (routing revealed), dense (all experts),
CipherPrune-style dispatch at t = 1.0 (the paper's CryptoMoE^T_{t=1.0}),
CryptoMoE t = 1.0 and t = 2.0.  Per row: bytes (both directions, frame headers
included), one-way flights, compute seconds (both parties on this machine, in
one process as two threads unless ``--processes``), and per token: MB, modelled
LAN and WAN seconds (compute + bytes / bandwidth + flights x latency, CryptoMoE's
settings: 3 Gbps / 0.2 ms and 400 Mbps / 40 ms, `cipherlm.net.netmodel`), plus
the per-phase split (gate, dispatch, experts, combine) and the dispatch+combine
share of the LAN time.

Shapes (``--shape``; random weights, std 1/sqrt(fan_in), router x ``--router-scale``):

* ``reduced`` (default): d = 256, n = 16 experts, top-2, expert FFN 128, m = 32
  tokens: OLMoE's ratios k/n = 1/8 and m/t, every expert run, every number
  measured (about 5-10 minutes here).
* ``olmoe``: d = 2048, n = 64, top-8, FFN 1024, m = 64 (issue 5 / the paper).
* ``qwen``: d = 2048, n = 60, top-4, FFN 1408, m = 64 (Qwen1.5-MoE without its
  shared expert).

For the full shapes the expert FFNs (and CipherPrune's per-expert swap network)
would take hours and tens of GB of traffic on this 2-core machine, so they are
run for ``--expert-sample`` experts (default 2) and their bytes and seconds are
scaled by n / s (flights too for the insecure baseline, whose experts run one
after another; the batched variants' flights do not grow with n).  Gate
routing, Pi_dispatch and Pi_combine always run at the full shape.  Rows say
``extrapolated`` when this was done.
"""

from __future__ import annotations

import sys
import time

import numpy as np

SHAPES = {
    "reduced": dict(d=256, n=16, k=2, f=128, m=32, sample=None),
    "olmoe": dict(d=2048, n=64, k=8, f=1024, m=64, sample=2),
    "qwen": dict(d=2048, n=60, k=4, f=1408, m=64, sample=2),
}
ROWS = (("insecure", None), ("dense", None), ("cipherprune", 1.0), ("cryptomoe", 1.0), ("cryptomoe", 2.0))
PHASES = ("gate", "dispatch", "experts", "combine")
#: CryptoMoE Table 2 (MB/token; LAN, WAN s/token) for the same model shapes, for reference
PAPER_TABLE2 = {
    "olmoe": {"insecure": (29.7, 0.95, 5.46), "dense": (232.0, 3.38, 17.21), "cipherprune t=1.0": (93.0, 1.09, 11.03),
              "cryptomoe t=1.0": (42.2, 0.83, 8.55), "cryptomoe t=2.0": (75.0, 1.02, 9.92)},
    "qwen": {"insecure": (19.5, 0.94, 4.86), "dense": (291.4, 4.28, 18.74), "cipherprune t=1.0": (288.3, 2.72, 18.52),
             "cryptomoe t=1.0": (25.8, 0.56, 6.93), "cryptomoe t=2.0": (47.7, 0.73, 7.69)},
}


def row_name(variant: str, c) -> str:
    return variant if c is None else f"{variant} t={c:.1f}"


def _party(ctx, shp: dict, variant: str, c, sample, seed: int, router_scale: float, batched: bool = True,
           packing: str = "coeff") -> dict:
    """One row, one party (module level so it also runs as two OS processes)."""
    from cipherlm.moe.layer import MoEShape, MoEWeights, moe_layer
    from cipherlm.mpc.protocols.mux import mux
    from cipherlm.mpc.shares import BShare, share_input
    from cipherlm.protocols.linear import he_session, linear

    shape = MoEShape(d=shp["d"], n=shp["n"], k=shp["k"], f=shp["f"])
    m = shp["m"]
    w = X = None
    if ctx.party == 1:   # public benchmark data from a fixed seed (not secrets)
        w = MoEWeights.random(shape, np.random.default_rng(seed), experts=sample)
        w.router *= router_scale
    else:
        X = np.random.default_rng(seed + 1).standard_normal((m, shape.d))
    x = share_input(ctx, X, owner=0)
    # warm-up outside the measured window: HE keys, base OTs, one tiny linear and MUX
    he_session(ctx)
    linear(ctx, x[:1, :4], None if w is None else np.ones((4, 1)), out_features=1)
    mux(ctx, BShare(ctx, np.zeros(4, np.uint64), 1), x[0, :4])
    simd = None
    if packing == "simd":  # SIMD keys and Galois keys (once per session) outside the measured window
        simd = _simd_warmup(ctx, shape, m, 2.0 if c is None else c, sample, batched)
    ctx.chan.reset_stats()
    t0 = time.perf_counter()
    r = moe_layer(ctx, x, w, shape, variant=variant, c=2.0 if c is None else c, expert_sample=sample,
                  batch_experts=batched, expert_packing=packing)
    secs = time.perf_counter() - t0
    out = {"phases": r.phases, "totals": ctx.chan.totals(), "seconds": secs, "t": r.t}
    if simd is not None:
        from cipherlm.protocols.linear_simd import simd_stats
        st = simd_stats(ctx)
        out["simd"] = dict(simd, rotations=st.rotations - simd["rotations0"], products=st.products - simd["products0"],
                           done_rotations=st.done_rotations, done_products=st.done_products)
    return out


def _simd_warmup(ctx, shape, m: int, c: float, sample, batched: bool) -> dict:
    """Send the Galois keys the expert plans need (per session, not per layer) and
    record the planned rotations of both packings (per-expert vs batched)."""
    from cipherlm.moe.routing import capacity
    from cipherlm.protocols.linear_simd import batch_rotation_counts, ensure_galois_keys, plan_simd, simd_session, simd_stats

    he = simd_session(ctx)
    t = capacity(m, shape.k, shape.n, c)
    n_run = shape.n if sample is None else sample
    steps = set()
    for d, o in ((shape.d, 2 * shape.f), (shape.f, shape.d)):
        steps.update(plan_simd(n_run * t if batched else t, d, o).steps)
    ensure_galois_keys(ctx, he, steps)
    st = simd_stats(ctx)
    counts = {}
    for d, o in ((shape.d, 2 * shape.f), (shape.f, shape.d)):
        for k, v in batch_rotation_counts(n_run, t, d, o).items():
            agg = counts.setdefault(k, {})
            for kk, vv in v.items():
                agg[kk] = agg.get(kk, 0) + vv
    return {"planned": counts, "galois_keys": st.galois_keys, "galois_bytes": st.galois_bytes,
            "rotations0": st.rotations, "products0": st.products, "experts_run": n_run, "t": t}


def _scale_phases(phases: dict, variant: str, factor: float) -> dict:
    """Extrapolate the sampled per-expert phases by n / s (module docstring)."""
    scaled = {}
    per_expert = {"cryptomoe": ("experts",), "dense": ("experts", "combine"), "insecure": ("experts",),
                  "cipherprune": ("dispatch", "experts", "combine")}[variant]
    for name, p in phases.items():
        q = dict(p)
        if name in per_expert:
            for key in ("bytes_sent", "bytes_received", "seconds", "messages_sent", "messages_received"):
                q[key] = p[key] * factor
            if variant == "insecure":
                q["rounds"] = p["rounds"] * factor
                q["flights_received"] = p["flights_received"] * factor
        scaled[name] = q
    return scaled


def run_row(shp: dict, variant: str, c, *, seed: int = 0, router_scale: float = 4.0, processes: bool = False,
            timeout: float = 3600.0, batched: bool = True, packing: str = "coeff") -> dict:
    from cipherlm.mpc.runner import run_inprocess, run_processes
    from cipherlm.net.netmodel import default_presets

    sample = shp.get("sample")
    runner = run_processes if processes else run_inprocess
    args = (shp, variant, c, sample, seed, router_scale, batched, packing)
    r0, r1 = runner(_party, args0=args, args1=args, timeout=timeout)
    factor = 1.0 if sample is None else shp["n"] / sample
    ph0 = _scale_phases(r0["phases"], variant, factor)
    ph1 = _scale_phases(r1["phases"], variant, factor)
    phases = {}
    for name in ph0:
        a, b = ph0[name], ph1[name]
        phases[name] = {"bytes": a["bytes_sent"] + a["bytes_received"],
                        "flights": a["rounds"] + a["flights_received"],
                        "seconds": max(a["seconds"], b["seconds"])}
    total_bytes = sum(p["bytes"] for p in phases.values())
    flights = sum(p["flights"] for p in phases.values())
    seconds = sum(p["seconds"] for p in phases.values())
    m = shp["m"]
    nets = {k: seconds + net.seconds(total_bytes, flights) for k, net in default_presets().items()}
    for p in phases.values():
        p["network_seconds"] = {k: p["seconds"] + net.seconds(p["bytes"], p["flights"])
                                for k, net in default_presets().items()}
    dc = {k: sum(phases[n]["network_seconds"][k] for n in ("dispatch", "combine") if n in phases) for k in nets}
    suffix = ("" if batched else " per-expert") if packing == "coeff" else (" SIMD batch" if batched else " SIMD per-expert")
    simd = None
    if packing == "simd":
        s1 = r1.get("simd", {})
        simd = {"planned": s1.get("planned"), "rotations": s1.get("rotations"), "products": s1.get("products"),
                "server_rotations": s1.get("done_rotations"), "galois_keys": s1.get("galois_keys"),
                "galois_bytes": s1.get("galois_bytes"), "experts_run": s1.get("experts_run")}
    return {
        "name": row_name(variant, c) + suffix, "variant": variant, "c": c, "t": r0["t"], "m": m,
        "packing": packing, "batched": batched, "simd": simd,
        "extrapolated": sample is not None, "expert_sample": sample,
        "bytes": total_bytes, "flights": flights, "seconds": seconds, "network_seconds": nets,
        "mb_per_token": total_bytes / m / 1e6, "seconds_per_token": seconds / m,
        "network_seconds_per_token": {k: v / m for k, v in nets.items()},
        "dispatch_combine_share": {k: dc[k] / nets[k] for k in nets},
        "phases": phases,
        "measured_seconds_wall": max(r0["seconds"], r1["seconds"]),
    }


def format_rows(rows: list[dict]) -> str:
    head = (f"{'method':18s} {'t':>4s} {'MB/token':>9s} {'flights':>8s} {'compute s/tok':>13s} {'LAN s/tok':>9s} "
            f"{'WAN s/tok':>9s} {'disp+comb LAN':>13s}  phases MB (gate/dispatch/experts/combine)")
    lines = [head]
    for r in rows:
        ph = "/".join(f"{r['phases'].get(p, {'bytes': 0})['bytes'] / 1e6:.1f}" for p in PHASES)
        lines.append(f"{r['name']:18s} {r['t']:4d} {r['mb_per_token']:9.2f} {r['flights']:8.0f} "
                     f"{r['seconds_per_token']:13.3f} {r['network_seconds_per_token']['LAN']:9.3f} "
                     f"{r['network_seconds_per_token']['WAN']:9.3f} {100 * r['dispatch_combine_share']['LAN']:12.1f}%"
                     f"  {ph}{'  (extrapolated)' if r['extrapolated'] else ''}")
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict:
    """The issue's targets: CryptoMoE t=2.0 vs dense (>= 3x fewer bytes, >= 2x less time),
    vs CipherPrune (>= 2x fewer bytes), dispatch+combine <= 25 % of the layer time."""
    by = {r["name"]: r for r in rows}
    cm, dn, cp = by.get("cryptomoe t=2.0"), by.get("dense"), by.get("cipherprune t=1.0")
    out = {}
    if cm and dn:
        out["bytes_vs_dense"] = dn["bytes"] / cm["bytes"]
        out["lan_time_vs_dense"] = dn["network_seconds"]["LAN"] / cm["network_seconds"]["LAN"]
        out["compute_time_vs_dense"] = dn["seconds"] / cm["seconds"]
    if cm and cp:
        out["bytes_vs_cipherprune"] = cp["bytes"] / cm["bytes"]
    if cm:
        out["dispatch_combine_share_lan"] = cm["dispatch_combine_share"]["LAN"]
    return out


def run(args) -> dict:
    """Entry point of ``cipherlm bench moe``."""
    name = getattr(args, "shape", None) or "reduced"
    if name not in SHAPES:
        raise SystemExit(f"unknown MoE shape {name!r}; known: {', '.join(SHAPES)}")
    shp = dict(SHAPES[name])
    if getattr(args, "tokens_moe", None):
        shp["m"] = int(args.tokens_moe)
    sample = getattr(args, "expert_sample", None)
    if sample is not None:
        shp["sample"] = None if sample <= 0 or sample >= shp["n"] else int(sample)
    wanted = getattr(args, "variants", None)
    rows_spec = [rc for rc in ROWS if not wanted or row_name(*rc) in wanted.split(",") or rc[0] in wanted.split(",")]
    if not rows_spec:
        raise SystemExit(f"no rows selected; known: {', '.join(row_name(*rc) for rc in ROWS)}")
    rows = []
    for variant, c in rows_spec:
        print(f"bench moe: {row_name(variant, c)} on {name} (d={shp['d']}, n={shp['n']}, k={shp['k']}, "
              f"f={shp['f']}, m={shp['m']}{', experts sampled: ' + str(shp['sample']) if shp['sample'] else ''}) ...",
              file=sys.stderr, flush=True)
        rows.append(run_row(shp, variant, c, seed=getattr(args, "seed", 0) or 0,
                            processes=getattr(args, "processes", False)))
        print(format_rows(rows[-1:]).splitlines()[1], file=sys.stderr, flush=True)
    print(f"MoE layer, shape {name}: d={shp['d']}, n={shp['n']}, top-{shp['k']}, expert FFN {shp['f']}, "
          f"m={shp['m']} tokens")
    print(format_rows(rows))
    tg = targets(rows)
    if tg:
        print("targets (CryptoMoE t=2.0): " + ", ".join(
            f"{k} {v:.2f}" + ("x" if not k.endswith("share_lan") else "") for k, v in tg.items()))
    if name in PAPER_TABLE2:
        print("paper Table 2 (MB/token, LAN s/token, WAN s/token): " +
              "; ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in PAPER_TABLE2[name].items()))
    out = {"shape": name, "config": shp, "rows": rows, "targets": tg, "paper_table2": PAPER_TABLE2.get(name)}
    if getattr(args, "ablation", False):
        # CryptoMoE Table 4's "+batch MatMul": the expert products in SIMD slots with BSGS, one
        # plan per expert (before) vs all experts' tokens in shared ciphertexts (section 4.4)
        for c in (1.0, 2.0):
            for batched in (False, True):
                print(f"bench moe: cryptomoe t={c:.1f} SIMD {'batch' if batched else 'per-expert'} (ablation) ...",
                      file=sys.stderr, flush=True)
                rows.append(run_row(shp, "cryptomoe", c, seed=getattr(args, "seed", 0) or 0, batched=batched,
                                    packing="simd", processes=getattr(args, "processes", False)))
                print(format_rows(rows[-1:]).splitlines()[1], file=sys.stderr, flush=True)
        print(format_rows([r for r in rows if r.get("packing") == "simd"]))
        out["ablation"] = ablation(rows)
        print(format_ablation(out["ablation"]))
    return {"moe": out}


def ablation(bench_rows: list[dict] | None = None, prompts: int = 16, tokens: int = 64,
             cs=(1.0, 2.0)) -> list[dict]:
    """Routing ablation like CryptoMoE Table 4 on the sparse-upcycled SmolLM2-MoE
    (`cipherlm.models.upcycle`, `cipherlm.runtime.upcycled`; plaintext): over ``prompts`` Wikipedia prompts of
    ``tokens`` tokens (teacher forcing, every position), the fraction of next-token
    predictions equal to the unbalanced MoE's, and the dropped share of
    token-expert pairs; the per-layer LAN / WAN seconds per token of the matching
    secure row of ``bench_rows`` where one was measured."""
    from cipherlm.moe.routing import BalancedRouting
    from cipherlm.models.upcycle import wiki_prompts
    from cipherlm.runtime.graph_executor import DecoderExecutor
    from cipherlm.runtime.plain import PlainLinear, split_params
    from cipherlm.runtime.upcycled import upcycled_smollm2

    lm = upcycled_smollm2()
    client, server = split_params(lm.config, lm.weights)
    backend = PlainLinear(server)
    seqs = [lm.tokenizer.encode(t).ids[:tokens] for t in wiki_prompts(prompts)]
    by = {r["name"]: r for r in bench_rows or []}

    def lat(name):
        r = by.get(name)
        return None if r is None else {k: v for k, v in r["network_seconds_per_token"].items()}

    def rot(name):
        r = by.get(name)
        return None if r is None or not r.get("simd") else r["simd"]["rotations"]

    def evaluate(routing):
        ex = DecoderExecutor(lm.config, client, backend, moe_routing=routing)
        preds, drop, pairs = [], 0, 0
        t0 = time.perf_counter()
        for ids in seqs:
            preds.append(np.argmax(ex.forward(ids), axis=-1))
            for dsp in ex.last_moe_dispatch.values():
                drop += dsp.dropped
                pairs += dsp.routed
        return preds, (drop / pairs if pairs else 0.0), time.perf_counter() - t0

    ref, _, _ = evaluate(None)
    n_pred = sum(len(p) for p in ref)
    agree = lambda preds: sum(int((a == b).sum()) for a, b in zip(preds, ref)) / n_pred
    up = lm.config["cipherlm_upcycle"]
    rows = [{"name": "dense (all experts, masked scores)", "c": None, "selection": None, "agreement": 1.0,
             "dropped_fraction": 0.0, "latency_per_token": lat("dense"),
             "note": "computes the unbalanced MoE's function exactly"}]
    for c in cs:
        for sel, label in (("random", "balanced (naive random)"), ("confidence", "+confidence-aware")):
            preds, dropped, secs = evaluate(BalancedRouting(c=c, selection=sel))
            rows.append({"name": f"{label} t={c:.1f}", "c": c, "selection": sel, "agreement": agree(preds),
                         "dropped_fraction": dropped, "plain_seconds": secs,
                         # naive and confidence-aware selection run the same protocol (only the
                         # priority scores differ); both with one SIMD/BSGS plan per expert here
                         "latency_per_token": lat(f"cryptomoe t={c:.1f} SIMD per-expert"),
                         "rotations": rot(f"cryptomoe t={c:.1f} SIMD per-expert")})
        rows.append({"name": f"+batch MatMul t={c:.1f}", "c": c, "selection": "confidence",
                     "agreement": rows[-1]["agreement"], "dropped_fraction": rows[-1]["dropped_fraction"],
                     "latency_per_token": lat(f"cryptomoe t={c:.1f} SIMD batch"),
                     "rotations": rot(f"cryptomoe t={c:.1f} SIMD batch"),
                     "note": "same function as +confidence-aware (packing only)"})
        rows.append({"name": f"(coefficient packing, batched) t={c:.1f}", "c": c, "selection": "confidence",
                     "agreement": rows[-1]["agreement"], "dropped_fraction": rows[-1]["dropped_fraction"],
                     "latency_per_token": lat(f"cryptomoe t={c:.1f}"), "rotations": 0 if by.get(f"cryptomoe t={c:.1f}") else None,
                     "note": "Cheetah coefficient packing: no rotations"})
    for r in rows:
        r.update(prompts=len(seqs), predictions=n_pred, model=lm.name, moe_layers=up["moe_layers"],
                 n_experts=up["n_experts"], top_k=up["top_k"])
    return rows


def format_ablation(rows: list[dict]) -> str:
    r0 = rows[0]
    lines = [f"routing ablation: {r0['model']} (n={r0['n_experts']}, top-{r0['top_k']}, MoE layers "
             f"{r0['moe_layers']}), {r0['prompts']} Wikipedia prompts, {r0['predictions']} next-token predictions "
             "vs the unbalanced MoE",
             f"{'configuration':38s} {'agreement':>9s} {'dropped':>8s} {'LAN s/tok':>9s} {'WAN s/tok':>9s} "
             f"{'rotations':>9s}"]
    for r in rows:
        lt = r.get("latency_per_token")
        ls = f"{lt['LAN']:9.3f} {lt['WAN']:9.3f}" if lt else f"{'-':>9s} {'-':>9s}"
        rt = r.get("rotations")
        lines.append(f"{r['name']:38s} {r['agreement']:9.3f} {100 * r['dropped_fraction']:7.1f}% {ls} "
                     f"{'-' if rt is None else rt:>9}")
    return "\n".join(lines)


__all__ = ["SHAPES", "ROWS", "run", "run_row", "format_rows", "targets"]

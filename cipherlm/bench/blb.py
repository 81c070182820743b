"""`cipherlm bench blb`: the BLB ablation (issue 16 item 6, BLB paper Table 11 / Figure 11).

For each workload the same random token ids go through the rows, both parties in this
process (`mpc.runner.run_inprocess`, two threads over an in-process channel), each row's
executor picked by its plan's ``fusion`` (`runtime.twopc.public_plan`, `make_twopc_executor`):

* ``BFV+MPC``: today's 2pc pipeline (`runtime.twopc.TwoPCEncoder` / `TwoPCDecoder`,
  Bumblebee-style: every linear operator an HE product followed by the HE -> MPC conversion
  and a truncation; Table 11's baseline);
* ``BLB``: `runtime.twopc_blb.BLBEncoder` / `BLBDecoder` (FineGrainFusion + the CKKS <-> MPC
  conversions of section 6: the fused blocks evaluated by the server in CKKS, the nonlinear
  cores on shares), Q K^T / P V on the rows' pair grid;
* ``BLB+fused``: the same with Q K^T / P V in section 5's multi-head packing and fused ct-ct
  MatMul (Table 11's third row; `ATTENTION`).

Per row (the client's channel, exact counters, `net.channel`):

* ``bytes``: both directions during the encoder pass, **set-up excluded** as in the paper
  (section 7.1: base OTs, BFV keys, CKKS public / relinearisation / rotation keys: the
  ``setup`` operator class) and reported separately under ``setup``;
* ``rounds`` (the client's own sends after a receive) and ``flights`` (rounds +
  the server's, i.e. one-way flights: what `NetworkModel` charges a latency for);
* ``seconds``: measured wall time of the pass (both parties on this machine, the
  in-process channel's transfers are negligible), ``compute_seconds`` = that minus the
  set-up made inside the pass (BLB's CKKS keys, made when a block first needs them);
* ``network``: modelled end-to-end seconds under the paper's settings (section 7.1, "Test
  Environment": LAN 1 Gbps / 0.3 ms RTT, WAN1 400 Mbps / 4 ms, WAN2 100 Mbps / 4 ms, WAN3
  100 Mbps / 80 ms; `net.netmodel` presets ``blb-*``):
  ``compute_seconds + NetworkModel.seconds(bytes, flights)``;
* ``breakdown``: bytes by category like Figure 11 (`CATEGORIES`): ``conversions`` (BFV+MPC:
  the sign extension / truncation after each HE product; BLB: the Algorithm 2 / Algorithm 1
  conversions around each fused block, i.e. its ciphertext transfers too), ``nonlinear``
  (the softmax / norm / activation cores on shares), ``linear_he`` (BFV+MPC's HE ciphertext
  transfers of the linear layers and attention products; BLB has none outside the blocks),
  ``embedding`` and ``other``; ``by_class`` is the meter's finer table;
* ``max_abs_error``: the hidden states (decoders: the final norm's output at every position of
  one teacher-forcing pass; the LM head is not run) against the plaintext executor (`runtime.graph_executor.GraphExecutor`,
  float64) on the same ids.

Workloads (`WORKLOADS`): ``minilm`` (all-MiniLM-L6-v2, real weights; default 1 of its 6
layers, 8 tokens), ``bert-base`` (BERT-base shape, random weights initialised like Hugging
Face's, `bench.twopc.random_bert_weights`; default 1 layer, 8 tokens), ``tiny`` (a tiny random
BERT, d = 48, for tests; 1 layer, 4 tokens), ``gpt2`` (GPT2-base shape, random weights at
GPT-2's initialisation scale but token embeddings at a trained GPT-2's (`GPT2_EMBED_STD`),
`bench.twopc.random_gpt2_weights`; a whole pass to the final
norm's output, the LM head left out as for the encoders; default 1 layer, 8 tokens) and ``tiny-gpt2`` (d =
48, for tests).  The defaults fit a 2-vCPU machine; the issue's sizes (BERT-base 128
tokens, MiniLM 6 layers 128 tokens, GPT2-base 64 tokens) are ``--tokens`` / ``--layers``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from cipherlm.runtime.twopc_executors import make_twopc_executor

#: `cipherlm bench blb` without --workloads
DEFAULT_WORKLOADS = "minilm,gpt2"
#: workload -> (default layers, default tokens)
WORKLOADS = {"tiny": (1, 4), "tiny-gpt2": (1, 4), "minilm": (1, 8), "bert-base": (1, 8), "gpt2": (1, 8)}
#: Table 11's ablation rows: the layer-by-layer baseline; + FineGrainFusion and the CKKS
#: conversions (Q K^T / P V on the rows' pair grid); + section 5's fused MatMul (their
#: multi-head packing, `compile.passes.blb_params.ATTENTION_PACKINGS`)
VARIANTS = ("BFV+MPC", "BLB", "BLB+fused")
#: the server's attention packing of each BLB row
ATTENTION = {"BLB": "rows", "BLB+fused": "fused"}
#: BLB section 7.1 ("Test Environment", Linux tc): row label -> `net.netmodel.PRESETS` name
#: (1 Gbps / 0.3 ms RTT; 400 Mbps / 4 ms; 100 Mbps / 4 ms; 100 Mbps / 80 ms, as RTTs)
NETWORKS = {"LAN": "blb-LAN", "WAN1": "blb-WAN1", "WAN2": "blb-WAN2", "WAN3": "blb-WAN3"}
#: Figure 11-like categories -> the meter's operator classes (`compile.ir.OP_CLASSES`)
CATEGORIES = {
    "conversions": ("conversions",),
    "nonlinear": ("softmax", "norm", "activation"),
    "linear_he": ("linear", "attention_matmul"),
    "embedding": ("embedding",),
}

#: GPT2-base's shape (the issue's decoder workload; random weights at GPT-2's initialisation
#: scale, `random_gpt2_weights`)
GPT2_BASE_CONFIG = {
    "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "n_ctx": 1024,
    "vocab_size": 50257, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
}
#: the plan's fusion of each row (`runtime.twopc.public_plan(..., fusion=)`)
FUSION = {"BFV+MPC": "none", "BLB": "blb", "BLB+fused": "blb"}

TINY_CONFIG = {
    "model_type": "bert", "hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 1,
    "intermediate_size": 96, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "vocab_size": 120,
    "max_position_embeddings": 64, "type_vocab_size": 2, "position_embedding_type": "absolute",
}
#: the random GPT-2's token-embedding std: about a trained GPT-2's (HF's initialisation, 0.02,
#: leaves the first LayerNorm's input variance at ~8e-4, below the 2pc norm's range of
#: [2^-10, 2^12] (`runtime.twopc_backend.LN_VAR_LO`): the BFV+MPC row's error was 4.4 there)
GPT2_EMBED_STD = 0.1
#: a tiny GPT-2 (d = 48, for tests)
TINY_GPT2_CONFIG = dict(GPT2_BASE_CONFIG, n_embd=48, n_head=4, n_layer=1, n_positions=64, n_ctx=64, vocab_size=96)
#: the tiny BERT's weight scale (0.1 like tests/test_twopc_blb.py's initializer_range, so that
#: attention is not uniform; BERT's own 0.02 for bert-base)
TINY_STD = 0.1


def _log(msg: str) -> None:
    print(f"bench blb: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- workloads


def prepare(workload: str, layers: int | None = None, tokens: int | None = None, seed: int = 0,
            ids: np.ndarray | None = None) -> dict:
    """Config, weights, token ids and the plaintext reference of one workload (``ids``: these
    token ids instead of the seeded random ones, e.g. another benchmark's input)."""
    from ..compile import bind, build_graph
    from ..models import normalize_weights
    from ..runtime import twopc
    from ..runtime.graph_executor import GraphExecutor
    from .twopc import BERT_BASE_CONFIG, random_bert_weights, random_gpt2_weights

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    L = int(layers or WORKLOADS[workload][0])
    T = int(tokens or WORKLOADS[workload][1])
    if L < 1 or T < 1:
        raise ValueError("layers and tokens must be positive")
    base = {"workload": workload, "layers": L, "tokens": T}
    if workload in ("gpt2", "tiny-gpt2"):
        cfg = GPT2_BASE_CONFIG if workload == "gpt2" else TINY_GPT2_CONFIG
        config = dict(cfg, n_layer=L)
        std = 0.02 if workload == "gpt2" else TINY_STD
        weights = normalize_weights(config, random_gpt2_weights(config, L, seed=seed, std=std,
                                                                embed_std=max(std, GPT2_EMBED_STD)))
        lo = 0
    elif workload == "minilm":
        from ..models import load_model

        lm = load_model("minilm-l6")
        full = dict(lm.config)
        if L > full["num_hidden_layers"]:
            raise ValueError(f"minilm has {full['num_hidden_layers']} layers, asked for {L}")
        config = dict(full, num_hidden_layers=L)
        weights = normalize_weights(config, lm.weights)
        lo = 1000
    else:
        cfg = dict(BERT_BASE_CONFIG if workload == "bert-base" else TINY_CONFIG)
        config = dict(cfg, num_hidden_layers=L)
        weights = random_bert_weights(config, L, seed=seed)
        if workload == "tiny":  # 0.02 -> TINY_STD for every matrix and bias (not the LayerNorms' gammas)
            k = TINY_STD / 0.02
            weights = {n: (a if "LayerNorm" in n else (a * k).astype(np.float32)) for n, a in weights.items()}
        lo = 1000 if workload == "bert-base" else 0
    kind, _, max_pos = twopc.model_kind(config)
    if T > max_pos:
        raise ValueError(f"{workload}: at most {max_pos} tokens")
    if ids is None:
        ids = np.random.default_rng(seed + 1).integers(lo, config["vocab_size"], T).astype(np.int64)
    else:
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size != T or ids.min() < 0 or ids.max() >= config["vocab_size"]:
            raise ValueError(f"{workload}: need {T} token ids in [0, {config['vocab_size']})")
    g = build_graph(config)
    ex = GraphExecutor(g, bind(g, weights), dtype=np.float64)
    pass_ctx = {"pos0": 0, "T": T, "positions": np.arange(T)}
    if kind == "encoder":
        ref = ex.run({"ids": ids, "positions": np.arange(T), "token_types": np.zeros(T, np.int64)}, pass_ctx)["hidden"]
    else:  # a decoder's whole pass (teacher forcing, prefill): the final norm's output at every position
        ref = ex.run({"ids": ids, "positions": np.arange(T)}, pass_ctx, ex.new_cache(), outputs=("hidden",))["hidden"]
    return {**base, "config": config, "weights": weights, "ids": ids, "ref": np.asarray(ref, np.float64)}


# ----------------------------------------------------------------------------- one row


def _delta(after: dict, before: dict) -> dict:
    return {k: int(v) - int(before.get(k, 0)) for k, v in after.items()}


def _party(ctx, config: dict, server, plan: dict, ids: np.ndarray, attention: str = "auto") -> dict:
    """One party of one row: the encoder pass between the channel counters (set-up warmed
    up first, outside the pass: base OTs and the BFV keys, both rows alike).  The plan's
    ``fusion`` picks the executor (`TwoPCEncoder` or `twopc_blb.BLBEncoder`)."""
    from ..mpc.he_session import he_session
    from ..runtime import twopc

    meter = twopc.OpMeter(ctx.chan)
    enc = make_twopc_executor(ctx, config, server if ctx.party == 1 else None, plan, meter=meter,
                              attention=attention)
    want = {"none": ("TwoPCEncoder", "TwoPCDecoder"), "blb": ("BLBEncoder", "BLBDecoder")}[plan["fusion"]]
    if type(enc).__name__ not in want:
        raise RuntimeError(f"fusion {plan['fusion']!r} gave {type(enc).__name__}")
    with meter("setup"):
        he_session(ctx)
        ctx.ot.setup(kk13=True)
        ctx.ot.prime()  # Ferret's main set and base now, as emp-ot's Ferret set-up in SPU's warm-up
    n = int(ids.size)
    summary0, stats0, chan0 = meter.summary(), meter.stats(), ctx.chan.totals()
    t0 = time.perf_counter()
    mine = ids if ctx.party == 0 else None
    # decoders: the final norm's output of every position (a teacher-forcing pass up to the LM head)
    h = enc.encode_shares(mine, n) if enc.graph.kind == "encoder" else enc.forward(mine, n, outputs=("hidden",))
    seconds = time.perf_counter() - t0
    summary1, stats1, chan1 = meter.summary(), meter.stats(), ctx.chan.totals()
    out = h.reveal_float(to=0)
    by_class = {}
    for k, v in summary1.items():
        b = summary0.get(k, {})
        d = {f: (v[f] - b.get(f, 0)) for f in ("bytes", "bytes_sent", "flights", "seconds", "calls")}
        if d["bytes"] or d["calls"]:
            by_class[k] = d
    setup_pass = _delta(stats1.get("setup", {}), stats0.get("setup", {}))
    return {"output": out, "seconds": seconds, "channel": _delta(chan1, chan0), "setup_pass": setup_pass,
            "by_class": by_class, "setup_total": summary1.get("setup"),
            "block_stats": list(getattr(getattr(enc, "runner", None), "block_stats", []) or []),
            "conversions": list(getattr(getattr(enc, "runner", None), "conversions", []) or [])}


def _bytes(c: dict) -> int:
    return int(c.get("bytes_sent", 0)) + int(c.get("bytes_received", 0))


def _flights(c: dict) -> int:
    return int(c.get("rounds", 0)) + int(c.get("flights_received", 0))


def breakdown(by_class: dict) -> dict:
    """Bytes by Figure 11-like category (`CATEGORIES`, the rest ``other``) from a row's
    per-class table (set-up excluded)."""
    out = {k: 0 for k in CATEGORIES}
    out["other"] = 0
    where = {c: cat for cat, classes in CATEGORIES.items() for c in classes}
    for cls, v in by_class.items():
        if cls == "setup":
            continue
        out[where.get(cls, "other")] += int(v["bytes"])
    return out


def network_seconds(compute_seconds: float, total_bytes: int, flights: int) -> dict:
    """{LAN, WAN1, WAN2, WAN3: compute + `NetworkModel.seconds(bytes, flights)`} (BLB section 7.1)."""
    from ..net.netmodel import PRESETS

    return {k: float(compute_seconds) + PRESETS[p].seconds(total_bytes, flights) for k, p in NETWORKS.items()}


def run_row(prep: dict, variant: str, *, embedding: str = "onehot-linear", timeout: float = 7200.0,
            activation: str | None = None, processes: bool = False, exp: str | None = None) -> dict:
    """One ablation row (JSON-able) of a prepared workload (``activation``: BLB rows' split of
    GeLU / SiLU, `runtime.twopc.BLB_ACTIVATIONS`; ``exp``: the softmax's exp split,
    `runtime.twopc.BLB_EXPS`; None = the plan's defaults).  ``processes``:
    the parties as two OS processes over loopback TCP (`mpc.runner.run_processes`, as a peer
    system runs) instead of two threads of this process."""
    from ..mpc.runner import run_inprocess, run_processes
    from ..runtime import twopc

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    config, w = prep["config"], prep["weights"]
    server = twopc.server_weights(config, w, keep_bound=FUSION[variant] == "blb")
    plan = twopc.public_plan(config, server, embedding=embedding, fusion=FUSION[variant],
                             blb_activation=activation or twopc.DEFAULT_BLB_ACTIVATION,
                             blb_exp=exp or twopc.DEFAULT_BLB_EXP)
    args = (config, server, plan, prep["ids"], ATTENTION.get(variant, "auto"))
    r0, r1 = (run_processes if processes else run_inprocess)(_party, args0=args, args1=args, timeout=timeout)
    ch, sp = r0["channel"], r0["setup_pass"]
    excl = {k: ch[k] - sp.get(k, 0) for k in ch}
    total, flights = _bytes(excl), _flights(excl)
    by_class = {k: v for k, v in r0["by_class"].items() if k != "setup"}
    setup_pass_row = r0["by_class"].get("setup", {"bytes": 0, "flights": 0, "seconds": 0.0})
    compute = r0["seconds"] - float(setup_pass_row.get("seconds", 0.0))
    st = r0["setup_total"] or {"bytes": 0, "flights": 0, "seconds": 0.0}
    row = {
        "workload": prep["workload"], "variant": variant, "status": "ok",
        "layers": prep["layers"], "tokens": prep["tokens"], "embedding": plan["embedding"], "fusion": plan["fusion"],
        "activation": plan.get("blb_activation"), "exp": plan.get("blb_exp"), "norms": plan.get("blb_norms"),
        "value_bits": plan.get("blb_value_bits"),
        "bytes": total, "bytes_client_to_server": int(excl["bytes_sent"]),
        "bytes_server_to_client": int(excl["bytes_received"]),
        "rounds": int(excl["rounds"]), "flights": flights,
        "channel": {"pass": ch, "setup_in_pass": sp},
        "unmetered_bytes": total - sum(int(v["bytes"]) for v in by_class.values()),
        "seconds": r0["seconds"], "compute_seconds": compute,
        "network": network_seconds(compute, total, flights),
        "setup": {"bytes": int(st["bytes"]), "flights": int(st["flights"]), "seconds": float(st["seconds"]),
                  "in_pass_bytes": _bytes(sp), "in_pass_seconds": float(setup_pass_row.get("seconds", 0.0))},
        "breakdown": breakdown(by_class),
        "by_class": by_class,
        "max_abs_error": float(np.abs(np.asarray(r0["output"], np.float64) - prep["ref"]).max()),
    }
    if FUSION[variant] == "blb":  # the server's view of each HE block: its time (HE evaluation + conversions) and traffic
        blocks = [{"block": int(b["block"]), "seconds": float(b["seconds"]), "bytes": _bytes(b), "flights": _flights(b),
                   "peak_rss_bytes": int(b["peak_rss_bytes"]), "he": dict(b.get("he", {}))} for b in r1["block_stats"]]
        row["he_blocks"] = {"count": len(blocks), "seconds": sum(b["seconds"] for b in blocks), "blocks": blocks}
        row["conversions"] = r1["conversions"]  # the server's records: block, value, direction, cts, level, bytes
    return row


# ----------------------------------------------------------------------------- the bench


def _machine() -> dict:
    from ..report import machine_info

    m = machine_info()
    try:
        m["load_average"] = list(os.getloadavg())
    except OSError:
        m["load_average"] = None
    return m


def _parse_workloads(workloads) -> list[str]:
    if workloads is None:
        workloads = DEFAULT_WORKLOADS
    if isinstance(workloads, str):
        workloads = [w.strip() for w in workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r}; one of {', '.join(WORKLOADS)}")
    return list(workloads)


def run_blb_bench(workloads=None, layers: int | None = None, tokens: int | None = None, report: str | None = None,
                  *, variants=VARIANTS, embedding: str = "onehot-linear", seed: int = 0, command=None,
                  timeout: float = 7200.0, echo: bool = True, activation: str | None = None,
                  exp: str | None = None) -> dict:
    """The ablation of every workload (``layers`` / ``tokens``: None = the workload's default,
    `WORKLOADS`), printed as it goes; the report (JSON-able dict) is written to ``report``
    when given.  ``embedding``: the plan's embedding method, the same for both rows;
    ``activation`` / ``exp``: the BLB rows' activation and exp splits (None: the plan's defaults)."""
    names = _parse_workloads(workloads)
    variants = tuple(variants)
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    machine_start = _machine()
    rows: list[dict] = []
    for w in names:
        _log(f"{w}: preparing (layers {layers or 'default'}, tokens {tokens or 'default'}) ...")
        prep = prepare(w, layers, tokens, seed=seed)
        for v in variants:
            _log(f"{w} / {v}: {prep['layers']} layer(s), {prep['tokens']} tokens, both parties in process ...")
            tr = time.perf_counter()
            row = run_row(prep, v, embedding=embedding, timeout=timeout, activation=activation, exp=exp)
            _log(f"{w} / {v}: done in {time.perf_counter() - tr:.1f} s")
            rows.append(row)
            if echo:
                print(format_rows([row]), flush=True)
    out = {
        "schema": "cipherlm.bench.blb/1",
        "command": list(command) if command is not None else list(sys.argv),
        "date": started.isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - t0,
        "machine": {**machine_start, "load_average_end": _machine()["load_average"]},
        "settings": {"workloads": names, "layers": layers, "tokens": tokens, "embedding": embedding, "seed": seed,
                     "blb_activation": activation, "blb_exp": exp,
                     "variants": list(variants), "parties": "in process (two threads, in-process channel)"},
        "networks": {k: _preset_dict(p) for k, p in NETWORKS.items()},
        "categories": {k: list(v) for k, v in CATEGORIES.items()},
        "rows": rows,
        "ratios": ratios(rows),
        "ratios_fused": ratios(rows, "BLB+fused"),
    }
    if echo:
        print(format_table(rows), flush=True)
    if report:
        Path(report).write_text(json.dumps(out, indent=2, default=_jsonable))
        _log(f"report written to {report}")
    return out


def _preset_dict(name: str) -> dict:
    from ..net.netmodel import PRESETS

    return PRESETS[name].to_dict()


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def ratios(rows: list[dict], variant: str = "BLB") -> dict:
    """Per workload with both rows run: BFV+MPC / ``variant`` for bytes, flights and each network's seconds."""
    out = {}
    by = {(r["workload"], r["variant"]): r for r in rows}
    for (w, v), base in by.items():
        blb = by.get((w, variant))
        if v != "BFV+MPC" or blb is None:
            continue
        q = lambda a, b: (a / b) if b else None  # noqa: E731
        out[w] = {"bytes": q(base["bytes"], blb["bytes"]), "flights": q(base["flights"], blb["flights"]),
                  **{k: q(base["network"][k], blb["network"][k]) for k in NETWORKS}}
    return out


# ----------------------------------------------------------------------------- printing


def format_rows(rows: list[dict]) -> str:
    """Each row's headline and its Figure 11-like breakdown."""
    out = []
    for r in rows:
        out.append(f"{r['workload']:10} {r['variant']:9} {r['layers']} layer(s) x {r['tokens']} tokens: "
                   f"{r['bytes'] / 1e6:.2f} MB, {r['flights']} flights ({r['rounds']} client rounds), "
                   f"{r['seconds']:.1f} s wall ({r['compute_seconds']:.1f} s without set-up), "
                   f"max err {r['max_abs_error']:.2e}; set-up {r['setup']['bytes'] / 1e6:.2f} MB")
        out.append("    breakdown: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in r["breakdown"].items()))
        if "he_blocks" in r:
            peak = max((b.get("peak_rss_bytes", 0) for b in r["he_blocks"]["blocks"]), default=0)
            out.append(f"    HE blocks: {r['he_blocks']['count']}, {r['he_blocks']['seconds']:.1f} s (server, "
                       f"evaluation + conversions); process peak RSS after them {peak / 2**30:.1f} GiB")
    return "\n".join(out)


def format_table(rows: list[dict]) -> str:
    """The Table 11-like summary: bytes, flights, compute and the modelled LAN / WAN seconds."""
    head = (f"{'workload':10} {'row':9} {'L':>2} {'T':>4} {'MB':>9} {'flights':>7} {'compute s':>9} "
            + " ".join(f"{k + ' s':>8}" for k in NETWORKS) + f" {'setup MB':>9} {'max err':>8}")
    out = [head]
    for r in rows:
        out.append(f"{r['workload']:10} {r['variant']:9} {r['layers']:2d} {r['tokens']:4d} {r['bytes'] / 1e6:9.2f} "
                   f"{r['flights']:7d} {r['compute_seconds']:9.1f} "
                   + " ".join(f"{r['network'][k]:8.1f}" for k in NETWORKS)
                   + f" {r['setup']['bytes'] / 1e6:9.2f} {r['max_abs_error']:8.1e}")
    cats = list(CATEGORIES) + ["other"]
    out.append("")
    out.append(f"{'bytes (MB)':20} " + " ".join(f"{c:>11}" for c in cats))
    for r in rows:
        out.append(f"{r['workload'] + ' ' + r['variant']:20} "
                   + " ".join(f"{r['breakdown'][c] / 1e6:11.2f}" for c in cats))
    return "\n".join(out)


def run(args) -> dict:
    """`cipherlm bench blb` (the CLI's arguments)."""
    variants = getattr(args, "variants", None)
    variants = VARIANTS if not variants else tuple(v.strip() for v in variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown bench blb rows {unknown}; one of {', '.join(VARIANTS)}")
    return run_blb_bench(args.workloads, args.layers, args.tokens, getattr(args, "report", None),
                         variants=variants, embedding=getattr(args, "embedding", None) or "onehot-linear",
                         seed=getattr(args, "seed", 0) or 0, command=sys.argv,
                         activation=getattr(args, "blb_activation", None), exp=getattr(args, "blb_exp", None))


__all__ = ["run_blb_bench", "run_row", "prepare", "breakdown", "network_seconds", "format_rows", "format_table",
           "WORKLOADS", "VARIANTS", "NETWORKS", "CATEGORIES", "DEFAULT_WORKLOADS"]

"""`cipherlm bench 2pc`: Transformer layers in the 2pc mode, per operator class (issue 4 benchmark).

Workloads (both start from secret-shared hidden states, so that the optional
SecretFlow-SPU run in `benchmarks/bench_2pc_spu.py` does exactly the same work):

* ``minilm``: all-MiniLM-L6-v2's encoder layers (real weights) on ``tokens``
  tokens of real text (default 128 tokens, all 6 layers = one inference
  without the embedding lookup, which `cipherlm bench embedding` measures);
* ``smollm-block``: one SmolLM2-135M decoder block (layer 0, real weights,
  causal attention with RoPE) on ``tokens`` tokens (default 64);
* ``bert-base``: a BERT-base-shaped encoder (d = 768, 12 heads, FFN 3072,
  random weights) on 128 tokens; ``layers`` of its 12 are run (default 1) and
  the totals extrapolated x 12 / layers, next to the published figures (BLB
  Table 11: 5.8 GB for its BFV+MPC Bumblebee-style baseline, 3.0 GB for BLB;
  BOLT reported at roughly 25-60 GB).

The two parties run as two OS processes over TCP on loopback
(`mpc.runner.run_processes`).  Reported per workload: bytes (both
directions), flights, the client's wall time, modelled LAN/WAN time
(`net.netmodel` presets, compute time plus bytes / bandwidth plus flights x
latency), the breakdown by operator class (the runtime's `OpMeter`), and the
max abs error of the output against the plaintext executor on the same input.
"""

from __future__ import annotations

import time

import numpy as np

from cipherlm.runtime.twopc_executors import make_twopc_executor

#: `cipherlm bench 2pc` without --workloads
DEFAULT_WORKLOADS = "minilm,smollm-block,bert-base"

PUBLISHED_BERT_BASE = {
    "BLB (BLB paper, Table 11)": 3.0e9,
    "BFV+MPC baseline, Bumblebee-style (BLB paper, Table 11)": 5.8e9,
    "BOLT (as reported in BLB, low end)": 25e9,
}

BERT_BASE_CONFIG = {
    "model_type": "bert", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "vocab_size": 30522,
    "max_position_embeddings": 512, "type_vocab_size": 2, "position_embedding_type": "absolute",
}


def random_bert_weights(cfg: dict, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-named BERT weights with BERT's initialisation scale (std 0.02), for
    the first ``layers`` layers and the pooler (public benchmark data, not secrets)."""
    rng = np.random.default_rng(seed)
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    w = {
        "embeddings.word_embeddings.weight": rng.normal(0, 0.02, (cfg["vocab_size"], d)).astype(np.float32),
        "embeddings.position_embeddings.weight": rng.normal(0, 0.02, (cfg["max_position_embeddings"], d)).astype(np.float32),
        "embeddings.token_type_embeddings.weight": rng.normal(0, 0.02, (cfg["type_vocab_size"], d)).astype(np.float32),
        "embeddings.LayerNorm.weight": np.ones(d, np.float32), "embeddings.LayerNorm.bias": np.zeros(d, np.float32),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for name, (o, n) in {"attention.self.query": (d, d), "attention.self.key": (d, d),
                             "attention.self.value": (d, d), "attention.output.dense": (d, d),
                             "intermediate.dense": (f, d), "output.dense": (d, f)}.items():
            w[f"{p}.{name}.weight"] = rng.normal(0, 0.02, (o, n)).astype(np.float32)
            w[f"{p}.{name}.bias"] = rng.normal(0, 0.02, o).astype(np.float32)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[f"{p}.{ln}.weight"] = (1 + rng.normal(0, 0.02, d)).astype(np.float32)
            w[f"{p}.{ln}.bias"] = rng.normal(0, 0.02, d).astype(np.float32)
    w["pooler.dense.weight"] = rng.normal(0, 0.02, (d, d)).astype(np.float32)  # the graph binds it
    w["pooler.dense.bias"] = np.zeros(d, np.float32)
    return w


def random_gpt2_weights(cfg: dict, layers: int, seed: int = 0, std: float = 0.02,
                        embed_std: float | None = None) -> dict[str, np.ndarray]:
    """Hugging Face-named GPT-2 weights (Conv1D layout: (in, out)) drawn like GPT-2's
    initialisation (normal, std 0.02; norms 1 + small noise), for the first ``layers`` blocks;
    the head is tied to the token embedding (`models.normalize_weights`).  ``embed_std``: the
    token embedding's std (default ``std``; a trained GPT-2's is ~0.1).  Public benchmark data,
    not secrets."""
    rng = np.random.default_rng(seed)
    d = cfg["n_embd"]
    f = cfg.get("n_inner") or 4 * d

    def normal(*shape):
        return rng.normal(0, std, shape).astype(np.float32)

    wte = rng.normal(0, std if embed_std is None else embed_std, (cfg["vocab_size"], d)).astype(np.float32)
    w = {"transformer.wte.weight": wte, "transformer.wpe.weight": normal(cfg["n_positions"], d),
         "transformer.ln_f.weight": (1 + normal(d)).astype(np.float32), "transformer.ln_f.bias": normal(d)}
    for i in range(layers):
        p = f"transformer.h.{i}"
        for name, (n_in, n_out) in {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, f),
                                    "mlp.c_proj": (f, d)}.items():
            w[f"{p}.{name}.weight"] = normal(n_in, n_out)
            w[f"{p}.{name}.bias"] = normal(n_out)
        for ln in ("ln_1", "ln_2"):
            w[f"{p}.{ln}.weight"] = (1 + normal(d)).astype(np.float32)
            w[f"{p}.{ln}.bias"] = normal(d)
    return w


def _text_ids(tokenizer, n: int) -> np.ndarray:
    from ..models.data import load_polarity

    text = " ".join(s for s, _ in load_polarity()[:60])
    ids = tokenizer.encode(text).ids
    if len(ids) < n:
        raise ValueError(f"not enough text for {n} tokens")
    return np.asarray(ids[:n], np.int64)


def prepare(workload: str, tokens: int | None = None, layers: int | None = None) -> dict:
    """Plaintext set-up of one workload: config, weights, input hidden states, reference output."""
    from ..models import load_model
    from ..runtime.plain import make_executor, plain_executor, split_params, PlainLinear

    if workload == "minilm":
        lm = load_model("minilm-l6")
        cfg, weights = dict(lm.config), lm.weights
        T = tokens or 128
        L = layers or cfg["num_hidden_layers"]
        ex = plain_executor(lm, dtype=np.float64)
        ids = _text_ids(lm.tokenizer, T)
        x0 = _encoder_input(ex, ids)
        return {"workload": workload, "config": cfg, "weights": weights, "x": x0, "ref": _encoder_layers(ex, x0, L),
                "layers": L, "tokens": T, "extrapolate": 1.0, "ids": ids}
    if workload == "bert-base":
        cfg = dict(BERT_BASE_CONFIG)
        T = tokens or 128
        L = layers or 1
        weights = random_bert_weights(cfg, L)
        cfg_run = dict(cfg, num_hidden_layers=L)
        client, server = split_params(cfg_run, weights)
        ex = make_executor(cfg_run, client, PlainLinear(server, dtype=np.float64))
        ids = np.random.default_rng(1).integers(1000, 30000, T)
        x0 = _encoder_input(ex, ids)
        return {"workload": workload, "config": cfg_run, "weights": weights, "x": x0,
                "ref": _encoder_layers(ex, x0, L), "layers": L, "tokens": T,
                "extrapolate": cfg["num_hidden_layers"] / L, "ids": ids}
    if workload == "smollm-block":
        lm = load_model("smollm2-135m")
        cfg, weights = dict(lm.config), lm.weights
        T = tokens or 64
        ex = plain_executor(lm, dtype=np.float64)
        ids = _text_ids(lm.tokenizer, T)
        x0 = np.asarray(weights["model.embed_tokens.weight"][ids], np.float64)
        ref = ex.run_layers(x0, [0])
        return {"workload": workload, "config": cfg, "weights": weights, "x": x0, "ref": ref, "layers": 1,
                "tokens": T, "extrapolate": 1.0}
    raise ValueError(f"unknown workload {workload!r} (minilm, smollm-block, bert-base)")


def _encoder_layers(ex, x: np.ndarray, layers: int) -> np.ndarray:
    """The plaintext executor's first ``layers`` encoder layers on hidden states x (T, d)."""
    return ex.run_layers(x, range(layers))


def _encoder_input(ex, ids: np.ndarray) -> np.ndarray:
    """Embedding output after the embedding LayerNorm, (T, d), as the plaintext executor computes it."""
    src, _ = ex.layer_io(0)
    T = ids.size
    nodes = [n for n in ex.graph.nodes if n.name in ex.needed([src])]
    vals = ex.run_nodes(nodes, {"ids": np.asarray(ids, np.int64), "positions": np.arange(T),
                                "token_types": np.zeros(T, np.int64)}, {"T": T})
    return vals[src]


def _party(ctx, spec: dict):
    """One party of the benchmark (run by `run_processes`): returns its meter summary,
    channel totals, wall time and (client) the opened output."""
    from ..mpc.shares import share_input
    from ..runtime import twopc

    cfg = spec["config"]
    server = twopc.server_weights(cfg, spec["weights"]) if ctx.party == 1 else None
    plan = spec["plan"]
    meter = twopc.OpMeter(ctx.chan)
    ex = make_twopc_executor(ctx, cfg, server, plan, meter=meter)
    x = share_input(ctx, spec["x"] if ctx.party == 0 else None, owner=0)
    # one-time set-up (base OTs, BFV keys) outside the timed region, as both peers' warm-ups
    from ..mpc.he_session import he_session

    with meter("setup"):
        he_session(ctx)
        ctx.ot.setup(kk13=True)
        ctx.ot.prime()  # Ferret's main set and base now, as emp-ot's Ferret set-up in SPU's warm-up
    t0 = time.perf_counter()
    y = ex.run_layers(x, range(1 if spec["workload"] == "smollm-block" else spec["layers"]))
    seconds = time.perf_counter() - t0
    out = y.reveal_float(to=0)
    return {"summary": meter.summary(), "totals": ctx.chan.totals(), "seconds": seconds,
            "output": out, "linear_packing": twopc.linear_packing_report(ctx, plan)}


def run_workload(workload: str, tokens: int | None = None, layers: int | None = None, *, timeout: float = 7200.0,
                 prepared: dict | None = None, linear_packing: str = "coeff", network: str = "LAN") -> dict:
    """Run one workload as two processes; one result row (JSON-able).  ``linear_packing``
    / ``network``: the plan's linear-layer packing (`twopc.LINEAR_PACKINGS`)."""
    from ..mpc.runner import run_processes
    from ..runtime import twopc

    prep = prepared or prepare(workload, tokens, layers)
    server = twopc.server_weights(prep["config"], prep["weights"])
    plan = twopc.public_plan(prep["config"], server, linear_packing=linear_packing, network=network)
    spec = {k: prep[k] for k in ("workload", "weights", "x", "layers")}
    spec.update(config=prep["config"], plan=plan)
    r0, r1 = run_processes(_party, args0=(spec,), args1=(spec,), timeout=timeout)
    setup = r0["summary"].get("setup", {"bytes": 0, "flights": 0, "seconds": 0.0})
    total_bytes = sum(v["bytes"] for k, v in r0["summary"].items() if k != "setup")
    flights = sum(v["flights"] for k, v in r0["summary"].items() if k != "setup")
    row = {
        "workload": workload, "tokens": prep["tokens"], "layers": prep["layers"],
        "bytes": total_bytes, "flights": flights, "seconds": r0["seconds"], "setup": setup,
        "max_abs_error": float(np.abs(r0["output"] - prep["ref"]).max()),
        "by_class": {k: v for k, v in r0["summary"].items() if k != "setup"},
        "linear_packing": r0["linear_packing"],
    }
    row.update(modelled_seconds(row["seconds"], total_bytes, flights))
    if prep["extrapolate"] != 1.0:
        row["extrapolated"] = {"factor": prep["extrapolate"], "bytes": total_bytes * prep["extrapolate"],
                               "seconds": r0["seconds"] * prep["extrapolate"]}
        row["published_bytes"] = PUBLISHED_BERT_BASE
    return row


#: the network presets a row's modelled times are given for (`net.netmodel.PRESETS`)
ROW_NETWORKS = ("LAN", "WAN", "blb-LAN", "blb-WAN1", "blb-WAN3")


def modelled_seconds(seconds: float, total_bytes: int, flights: int) -> dict[str, float]:
    """{"<preset>_seconds": compute + the preset's transfer time} for every `ROW_NETWORKS` preset."""
    from ..net.netmodel import PRESETS

    return {f"{name}_seconds": seconds + PRESETS[name].seconds(total_bytes, flights) for name in ROW_NETWORKS}


def format_rows(rows: list[dict]) -> str:
    out = [f"{'workload':14} {'tokens':>6} {'layers':>6} {'GB':>8} {'flights':>8} {'compute s':>10} "
           f"{'LAN s':>8} {'WAN s':>8} {'max err':>9}"]
    for r in rows:
        lan, wan = r["LAN_seconds"], r["WAN_seconds"]
        out.append(f"{r['workload']:14} {r['tokens']:6d} {r['layers']:6d} {r['bytes'] / 1e9:8.3f} {r['flights']:8d} "
                   f"{r['seconds']:10.1f} {lan:8.1f} {wan:8.1f} {r['max_abs_error']:9.2e}")
        for k, v in sorted(r["by_class"].items(), key=lambda kv: -kv[1]["bytes"]):
            out.append(f"    {k:18} {v['bytes'] / 1e6:10.1f} MB {v['flights']:7d} flights {v['seconds']:8.1f} s")
        lp = r.get("linear_packing") or {}
        if lp.get("packing", "coeff") != "coeff":
            out.append(f"    linear packing {lp['packing']} ({lp.get('network')})"
                       + (f": calls {lp['calls']}" if "calls" in lp else ""))
        if "extrapolated" in r:
            e = r["extrapolated"]
            out.append(f"    x{e['factor']:.0f} layers: {e['bytes'] / 1e9:.2f} GB, {e['seconds']:.0f} s; published: "
                       + "; ".join(f"{k} {v / 1e9:.1f} GB" for k, v in r["published_bytes"].items()))
    return "\n".join(out)


def run(args) -> list[dict]:
    """`cipherlm bench 2pc`: every workload in ``--workloads``, printed as it finishes."""
    import sys

    rows = []
    for w in [w.strip() for w in (args.workloads or DEFAULT_WORKLOADS).split(",") if w.strip()]:
        print(f"bench 2pc: {w} (tokens {args.tokens or 'default'}, layers {args.layers or 'default'}) "
              "as two processes ...", file=sys.stderr, flush=True)
        row = run_workload(w, args.tokens, args.layers, linear_packing=getattr(args, "linear_packing", "coeff"),
                           network=getattr(args, "packing_network", "LAN"))
        rows.append(row)
        print(format_rows([row]), flush=True)
    return rows

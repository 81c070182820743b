"""What each CLI command does (argument parsing lives in cipherlm.cli)."""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

# UserError and the server-process helpers live in cipherlm.launch (the benchmarks use them
# too); they stay importable from here (cipherlm.commands.UserError, .start_server_process).
from cipherlm.launch import DEFAULT_PROMPT, UserError, start_server_process, stop_process  # noqa: F401
from cipherlm.runtime.meter import Meter


def dispatch(args) -> int:
    handler = {
        "models": cmd_models,
        "generate": cmd_generate,
        "classify": cmd_classify,
        "inspect": cmd_inspect,
        "serve": cmd_serve,
        "proxy": cmd_proxy,
        "demo": cmd_demo,
        "bench": cmd_bench,
    }[args.command]
    try:
        return handler(args)
    except (ValueError, OSError) as exc:
        from cipherlm.models import UnknownModelError
        from cipherlm.net.channel import ChannelClosed, ChannelTimeout
        from cipherlm.runtime.offload_protocol import RemoteError

        if isinstance(exc, (UnknownModelError, ConnectionError, ChannelClosed, ChannelTimeout, RemoteError)):
            raise UserError(str(exc)) from exc
        raise


# ----------------------------------------------------------------------------- helpers


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def chat_prompt(tokenizer, prompt: str, raw: bool) -> str:
    """Wrap a user prompt in the ChatML template when the tokenizer has its tokens (SmolLM2-Instruct)."""
    if raw or tokenizer is None or tokenizer.token_to_id("<|im_start|>") is None:
        return prompt
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def eos_ids(config: dict, tokenizer) -> set[int]:
    ids = set()
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos)
    if tokenizer is not None:
        for tok in ("<|im_end|>", "<|endoftext|>", "</s>"):
            tid = tokenizer.token_to_id(tok)
            if tid is not None:
                ids.add(tid)
    return ids


class TokenStreamer:
    """Print tokens as they are produced (decoding the whole suffix keeps multi-byte characters intact)."""

    def __init__(self, tokenizer, stream=None):
        self.tokenizer = tokenizer
        self.stream = stream or sys.stdout
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            self.stream.write(text[len(self.printed):])
            self.stream.flush()
            self.printed = text

    def finish(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def run_plain_generation(model_name: str, prompt: str, args, report) -> dict:
    """Generate with the plaintext executor, streaming tokens; the figures for the report."""
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(model_name)
    executor = plain_executor(lm, profiler=report.profiler)
    prompt_ids = lm.tokenizer.encode(chat_prompt(lm.tokenizer, prompt, getattr(args, "raw", False))).ids
    streamer = TokenStreamer(lm.tokenizer)
    new_ids, _ = executor.generate(prompt_ids, **_gen_kwargs(args, lm.config, lm.tokenizer), on_token=streamer)
    streamer.finish()
    return {"prompt_tokens": len(prompt_ids), "new_tokens": len(new_ids)}


def _write_outputs(report, args) -> None:
    if getattr(args, "report", None):
        report.write_json(args.report)
        _err(f"report written to {args.report}")
    if getattr(args, "plot", None):
        report.plot_png(args.plot)
        _err(f"plot written to {args.plot}")


# ----------------------------------------------------------------------------- commands


def cmd_models(args) -> int:
    from cipherlm.models import list_models

    rows = list_models()
    print(f"{'name':<16} {'family':<10} {'params':>10}  {'available':<9}  path")
    for m in rows:
        params = f"{m['params'] / 1e6:.1f}M" if m.get("params") else "?"
        print(f"{m['name']:<16} {m['family']:<10} {params:>10}  {'yes' if m['available'] else 'no':<9}  {m.get('path') or ''}")
    return 0


def model_config(name_or_path: str) -> tuple[str, dict]:
    """(name, HF config) of a registered model or an HF directory / .gguf file, without its weights."""
    import json

    from cipherlm.models.loader import converted_gguf_dir
    from cipherlm.models.registry import resolve

    name, path = resolve(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        path = converted_gguf_dir(path)
    return name, json.loads((path / "config.json").read_text())


def inspect_text(config: dict, name: str = "", all_nodes: bool = False, groups: bool = False) -> str:
    """The model graph as text: a header, the nodes (op, output shape, parameters), the
    parameters per op and, with `groups`, the projection groups."""
    from cipherlm.compile import build_graph, passes

    g = passes.group_linears.run(build_graph(config))
    nodes = g.nodes if all_nodes else [n for n in g.nodes if n.layer in (None, 0)]
    lines = [f"{name}: " + g.summary(nodes) if name else g.summary(nodes)]
    if not all_nodes and g.n_layers > 1:
        lines.append(f"  (layers 1..{g.n_layers - 1} not shown: --all)")
    per_op: dict[str, list[int]] = {}
    for n in g.nodes:
        c = per_op.setdefault(n.op, [0, 0])
        c[0] += 1
        c[1] += g.param_count(n)
    lines.append("parameters per op:")
    for op, (count, params) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {op:<11} {count:>6} nodes {params:>14,}")
    if groups:
        lines.append(f"projection groups ({len(g.meta['linear_groups'])}):")
        for k, (names, d_in, d_outs) in enumerate(g.meta["linear_groups"]):
            if all_nodes or k < 12:
                lines.append(f"  {k:>4} d_in {d_in:<6} d_out {'+'.join(map(str, d_outs)):<16} {', '.join(names)}")
        if not all_nodes and len(g.meta["linear_groups"]) > 12:
            lines.append("  ... (--all)")
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def prediction_table(pred: dict, title: str) -> list[str]:
    """`runtime.predict.predict`'s result as text rows (op class, bytes, rounds, HE ops)."""
    lines = [f"{title}:", f"  {'op class':<17} {'bytes':>11} {'rounds':>7}  he ops"]
    tot_b = tot_r = 0
    for cls, e in sorted(pred.items(), key=lambda kv: -kv[1]["bytes"]):
        ops = ", ".join(f"{k} {v:,}" for k, v in e["he_ops"].items() if k in
                        ("rotations", "multiply_plain", "rescale", "encrypt", "decrypt"))
        lines.append(f"  {cls:<17} {_fmt_bytes(e['bytes']):>11} {e['rounds']:>7}  {ops}")
        tot_b += e["bytes"]
        tot_r += e["rounds"]
    lines.append(f"  {'total':<17} {_fmt_bytes(tot_b):>11} {tot_r:>7}")
    return lines


def inspect_plan(config: dict, mode: str, tokens: int, linear_packing: str = "coeff",
                 he_backend: str | None = "auto") -> tuple[str, dict]:
    """The mode's plan and predicted costs as text, and the same as a JSON-able dict
    (offload: on HE backend ``he_backend``, "auto" as ``cipherlm serve`` resolves it here)."""
    from cipherlm.compile import build_graph, passes
    from cipherlm.runtime import predict as P

    g = passes.group_linears.run(build_graph(config))
    decoder = "logits" in g.outputs
    doc: dict = {"mode": mode, "tokens": tokens}
    lines = []
    if mode == "plain":
        return "plain: nothing leaves this machine (no plan, no traffic)", doc
    if mode == "offload":
        from cipherlm.he.matmul import resolve_offload_backend

        asked = he_backend or "auto"
        backend, why = (asked, "asked for") if asked in ("seal", "lattigo") else resolve_offload_backend(asked)
        groups = P.plan_offload(config, g, backend)
        steps = P.galois_steps(groups)
        lines.append(f"offload plan: {len(groups)} projection groups, CKKS N = 8192 (4096 complex slots), "
                     f"HE backend {backend} ({why})")
        lines.append(f"  {'grp':>4} {'class':<10} {'d_in':>5} {'d_outs':<16} {'chunks':>6} {'blocks':>6} "
                     f"{'baby':>4} {'giant':>5} {'rot':>4} {'mul':>5}  names")
        shown = {}
        for k, gr in enumerate(groups):
            key = (gr["op_class"], gr["d_in"], gr["d_outs"])
            first = key not in shown
            shown.setdefault(key, 0)
            shown[key] += 1
            if not first:
                continue
            for p in gr["plans"]:
                oc = p.op_counts()
                lines.append(f"  {k:>4} {gr['op_class']:<10} {p.d_in:>5} {'+'.join(map(str, gr['d_outs'])):<16} "
                             f"{p.c:>6} {p.n_blocks:>6} {p.g:>4} {p.b:>5} {oc['rotations']:>4} "
                             f"{oc['multiply_plain']:>5}  {', '.join(gr['names'])}")
        same = sum(v - 1 for v in shown.values())
        if same:
            lines.append(f"  ({same} more groups with the same shapes as one above)")
        lines.append(f"  Galois key steps ({len(steps)}): {', '.join(map(str, steps))}")
        doc["groups"] = [{"names": list(gr["names"]), "d_in": gr["d_in"], "d_outs": list(gr["d_outs"]),
                          "op_class": gr["op_class"], "plans": [p.to_dict() for p in gr["plans"]]} for gr in groups]
        doc["galois_steps"] = steps
        doc["he_backend"] = backend
        kw: dict = {"he_backend": backend}
    else:
        kw = {"linear_packing": linear_packing}
        plan = P.plan_twopc(config, tokens, graph=g, linear_packing=linear_packing)
        lines.append(f"2pc public plan: embedding {plan['embedding']}, linear packing {plan['linear']['packing']} "
                     f"(network {plan['linear']['network']})"
                     + (f", MoE {plan['moe']['variant']} capacity {plan['moe']['capacity']}" if "moe" in plan else "")
                     + ("" if decoder else ", classifier width: the server's"))
        if decoder:
            lines.append("  folded norms: decided by the server from its weights (RMSNorm gammas folded into the "
                         "projections when they fit the weight bound)")
        lines.append(f"  linear layers at {tokens} token rows (packing choice per layer shape, "
                     f"linear_packing_report rows):")
        lines.append(f"  {'class':<10} {'m':>5} {'d':>5} {'o':>6} {'choice':>6} {'used':>6} {'coeff MB':>9} "
                     f"{'simd MB':>8} {'coeff s':>8} {'simd s':>8} {'calls':>5}")
        rows: dict = {}
        for c in plan["linear"]["choices"]:
            key = (c["op_class"], c["m"], c["d"], c["o"])
            if key in rows:
                rows[key][1] += 1
            else:
                rows[key] = [c, 1]
        for c, n in rows.values():
            lines.append(f"  {c['op_class']:<10} {c['m']:>5} {c['d']:>5} {c['o']:>6} {c['packing']:>6} {c['used']:>6} "
                         f"{c['coeff_bytes'] / 1e6:>9.2f} {c['simd_bytes'] / 1e6:>8.2f} {c['coeff_seconds']:>8.3f} "
                         f"{min(c['simd_seconds'], 1e9):>8.3f} {n:>5}")
        doc["plan"] = plan
    pred = P.predict(config, mode, tokens, phase="prefill", graph=g, **kw)
    title = f"predicted {'prefill' if decoder else 'pass'} of {tokens} tokens"
    lines += prediction_table(pred, title)
    doc["prefill" if decoder else "pass"] = pred
    if decoder:
        dec = P.predict(config, mode, tokens, phase="decode", graph=g, **kw)
        lines += prediction_table(dec, f"predicted per decode token (after {tokens} tokens)")
        doc["decode"] = dec
    if mode == "2pc":
        lines.append("  (2pc: embedding, setup and control not predicted; nonlinear classes from the per-element "
                     "costs of docs/mpc.md, attention products rough)")
    else:
        lines.append("  (offload on SEAL: input ciphertexts are compressed, their size varies by ~2%; counts are exact)"
                     if kw.get("he_backend") == "seal" else
                     "  (offload on Lattigo: ciphertext sizes and counts are exact; message framing approximate)")
    return "\n".join(lines), doc


def inspect_blb(config: dict, all_layers: bool = False, tokens: int | None = None, norms: str = "split") -> str:
    """BLB's fused blocks (passes blb_decompose + blb_fusion, ``norms`` as `blb_decompose.NORM_SPLITS`)
    as a table: per block its layer, HE depth, rotate-and-sum reductions, products, the MPC cores
    around it and its ops; then each block's CKKS parameters (`passes.blb_params`, default weight
    gains, ``tokens`` keys)."""
    from cipherlm.compile import build_graph
    from cipherlm.compile.passes import blb_fusion, blb_params
    from cipherlm.runtime.twopc import DEFAULT_BLB_ACTIVATION, DEFAULT_BLB_EXP

    g = blb_fusion.run(build_graph(config), activation=DEFAULT_BLB_ACTIVATION, norms=norms, exp=DEFAULT_BLB_EXP)
    T = int(tokens or blb_params.TOKENS)
    params = blb_params.run(g, tokens=T, strict=False)
    att = next((hh for b in g.meta["blb_blocks"] if (hh := blb_params.block_attention(g, b))), None)
    packing = ""
    if att is not None:
        chosen = "rows" if not any(blb_params.block_fused(g, b, "auto", T) for b in g.meta["blb_blocks"]) else "fused"
        cts = {p: blb_params.attention_cts(p, T, *att) for p in ("rows", "fused")}
        packing = (f"\nattention packing at {T} tokens: {chosen} (ciphertexts the attention core converts per "
                   f"layer: rows {cts['rows']}, section 5's fused {cts['fused']}; docs/blb.md)")
    return (blb_fusion.format_blocks(g, all_layers=all_layers) + packing + "\n"
            + blb_params.format_params(g, params, all_layers=all_layers)
            + f"\n  (projection gains sqrt(d_in) x {blb_params.WEIGHT_RMS}, |gamma| <= {blb_params.GAMMA_MAX:g}, "
            f"values <= 2^{blb_params.VALUE_BITS}: the defaults of passes.blb_params; docs/blb.md)")


def inspect_fhe(config: dict, levels: int = 9) -> tuple[str, dict]:
    """fhe mode: the approximations (default ranges) and the level pass's per-block depth and
    bootstraps (`passes.fhe_levels`), as text and as a JSON-able dict."""
    from cipherlm.compile import build_graph
    from cipherlm.compile.passes import fhe_levels
    from cipherlm.fhe import approx

    if levels < 1:
        raise UserError("--fhe-levels must be at least 1")
    try:
        g = fhe_levels.run(build_graph(config), levels=levels)
    except ValueError as e:
        raise UserError(str(e)) from e
    s = g.meta["fhe_levels"]
    used = {k: approx.approximation(k, v["lo"], v["hi"], approx.DEFAULT_RANGES[k][2])
            for k, v in s["approximations"].items()}
    lines = [("fhe approximations (default ranges, not calibrated: cipherlm.fhe.calibrate; errors measured "
              "against numpy):"), approx.table(used), fhe_levels.format_summary(s),
             "  (the level pass's plan; the fhe executor places its own bootstraps greedily at run time and "
             "calibrates the ranges on the served model: cipherlm serve --mode fhe, docs/fhe.md)"]
    return "\n".join(lines), {"mode": "fhe", "fhe_levels": s}


def inspect_aegis(config: dict, workers: int, tokens: int, levels: int = 9) -> tuple[str, dict]:
    """fhe mode on W workers: the AEGIS placement plan (`passes.aegis_placement`: groups,
    collectives, predicted bytes by AEGIS's Table 2, the tensor-parallel figure), as text and dict."""
    from cipherlm.compile import build_graph
    from cipherlm.compile.passes import aegis_placement, fhe_levels

    if workers < 1:
        raise UserError("--workers must be at least 1")
    try:
        plan = aegis_placement.run(fhe_levels.run(build_graph(config), levels=levels), workers, tokens)
    except (ValueError, NotImplementedError) as e:
        raise UserError(str(e)) from e
    return aegis_placement.format_plan(plan), plan.to_dict()


def cmd_inspect(args) -> int:
    name, config = model_config(args.model)
    print(inspect_text(config, name, all_nodes=args.all, groups=args.groups))
    mode = getattr(args, "mode", "plain") or "plain"
    tokens = int(getattr(args, "tokens", 16) or 16)
    if tokens < 1:
        raise UserError("--tokens must be at least 1")
    workers = getattr(args, "workers", None)
    if workers is not None and mode != "fhe":
        raise UserError("--workers needs --mode fhe (the AEGIS placement of the fhe mode)")
    if mode == "fhe":
        text, doc = inspect_fhe(config, int(getattr(args, "fhe_levels", 9)))
        if workers is not None:
            aegis_text, doc["aegis"] = inspect_aegis(config, int(workers), tokens, int(getattr(args, "fhe_levels", 9)))
            text += "\n" + aegis_text
    else:
        text, doc = inspect_plan(config, mode, tokens, getattr(args, "linear_packing", "coeff"),
                                 he_backend=getattr(args, "he_backend", None) or "auto")
    print(text)
    if getattr(args, "fusion", "none") == "blb":
        print(inspect_blb(config, all_layers=args.all, tokens=tokens, norms=getattr(args, "blb_norms", "split")))
    if getattr(args, "json", None):
        import json

        doc["model"] = name
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


def cmd_generate(args) -> int:
    from cipherlm.report import RunReport

    t0 = time.perf_counter()
    report = RunReport(mode=args.mode, model=args.model, command=sys.argv)
    if args.mode == "plain":
        report.extra.update(run_plain_generation(args.model, args.prompt, args, report))
        report.finish(wall_seconds=time.perf_counter() - t0)
        print(report.summary_text(), file=sys.stderr)
        _write_outputs(report, args)
        return 0
    if args.server is None:
        raise UserError(f"--mode {args.mode} needs --server HOST:PORT (start one with `cipherlm serve --mode {args.mode}`)")
    run = {"2pc": run_twopc_generation, "fhe": run_fhe_generation}.get(args.mode, run_offload_generation)
    result = run(args.server, args.model, args.prompt, args, report=report, compare=args.compare)
    report.extra.update(result["extra"])
    report.finish(wall_seconds=time.perf_counter() - t0)
    print(report.summary_text(), file=sys.stderr)
    _write_outputs(report, args)
    return 0


def _gen_kwargs(args, config, tokenizer) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=getattr(args, "temperature", 0.0),
        top_k=getattr(args, "top_k", 0),
        top_p=getattr(args, "top_p", 1.0),
        seed=getattr(args, "seed", None),
        eos_token_ids=eos_ids(config, tokenizer),
        return_logits=True,
    )


def _add_offload_stats(report, client, timer) -> None:
    """Traffic, server/client seconds and HE op counts of an offload session, into the report."""
    server_stats = client.server_stats()
    report.extra["he_backend"] = client.engine.he_backend  # the server's, named in its welcome
    report.add_channel_stats(client.chan.stats(), party="client")
    for op_class, seconds in server_stats.get("seconds", {}).items():
        report.add_seconds(op_class, seconds)
    report.merge_he_ops(server_stats.get("he_ops", {}))
    for op_class, seconds in client.seconds.items():
        report.add_seconds(op_class, seconds)
    report.merge_he_ops(client.engine.he_ops())
    # client compute per operator class; "linear" is the client's wait for the
    # server (encrypt + network + server HE + decrypt), which the classes above already split
    for op_class, seconds in timer.seconds.items():
        if op_class != "linear":
            report.add_seconds(op_class, seconds)
    report.extra["client_linear_wait_seconds"] = timer.seconds.get("linear", 0.0)
    report.extra["server_seconds"] = dict(server_stats.get("seconds", {}))
    report.extra["client_seconds"] = dict(client.seconds)
    report.extra["server_compute_seconds"] = sum(server_stats.get("seconds", {}).values())
    report.extra["client_compute_seconds"] = sum(client.seconds.values()) + sum(
        v for k, v in timer.seconds.items() if k != "linear")


def generation_passes(n_prompt: int, n_new: int) -> list[tuple[int, str]]:
    """The passes of a generation: the prompt's prefill (first token), then one decode pass
    per further token (after n_prompt + i cached positions)."""
    return [(n_prompt, "prefill")] + [(n_prompt + i, "decode") for i in range(max(0, n_new - 1))]


def add_run_prediction(report, config: dict, mode: str, passes, **kw) -> None:
    """`runtime.predict.predict` for each (tokens, phase) pass of the run, summed into the
    report (`RunReport.add_prediction`); a model the graph cannot price is only noted."""
    from cipherlm.compile import build_graph, passes as gpasses
    from cipherlm.runtime import predict as P

    try:
        g = gpasses.group_linears.run(build_graph(config))
        memo: dict = {}
        for tokens, phase in passes:
            # offload decode passes cost the same at every position
            key = (1 if mode == "offload" and phase == "decode" else int(tokens), phase)
            if key not in memo:
                memo[key] = P.predict(config, mode, int(tokens), phase=phase, graph=g, **kw)
            report.add_prediction(memo[key])
    except Exception as exc:  # a prediction must never fail the run it describes
        _err(f"no cost prediction for this model: {exc}")


def run_offload_generation(server, model, prompt, args, report, compare: bool, stream=True) -> dict:
    """Generate through an offload server; optionally compare with the local plaintext executor."""
    from cipherlm.runtime.offload_client import OffloadClient

    host, port = server
    _err(f"connecting to {host}:{port} ...")
    with OffloadClient(host, port, model=model, progress=_err) as client:
        tokenizer, config = client.tokenizer, client.config
        prompt_ids = tokenizer.encode(chat_prompt(tokenizer, prompt, getattr(args, "raw", False))).ids
        _err(f"session ready in {client.setup_seconds:.1f} s; {len(prompt_ids)} prompt tokens, generating ...")
        timer = Meter()
        executor = client.executor(profiler=timer)
        streamer = TokenStreamer(tokenizer) if stream else (lambda t: None)
        token_times: list[float] = []
        t_gen = time.perf_counter()

        def on_token(tid):
            token_times.append(time.perf_counter() - t_gen)
            streamer(tid)

        new_ids, logits = executor.generate(prompt_ids, **_gen_kwargs(args, config, tokenizer), on_token=on_token)
        if stream:
            streamer.finish()
        _add_offload_stats(report, client, timer)
        add_run_prediction(report, config, "offload", generation_passes(len(prompt_ids), len(new_ids)),
                           he_backend=client.engine.he_backend, prefill_tokens=client.engine.prefill_tokens)
        extra = {
            "prompt_tokens": len(prompt_ids),
            "new_tokens": len(new_ids),
            "setup_seconds": client.setup_seconds,
            "bundle_from_cache": client.bundle_from_cache,
            "first_token_seconds": token_times[0] if token_times else None,
            "later_token_seconds_mean": float(np.mean(np.diff(token_times))) if len(token_times) > 1 else None,
            "text": tokenizer.decode(new_ids, skip_special_tokens=True),
        }
    if compare:
        extra.update(compare_with_plain(client.model, prompt_ids, new_ids, logits, args))
        report.agreement = extra["agreement"]
    return {"new_ids": new_ids, "logits": logits, "extra": extra}


def run_twopc_generation(server, model, prompt, args, report, compare: bool, stream=True) -> dict:
    """Greedy generation with a 2pc server (prompt and weights private); optionally compare
    with the plaintext executor (token agreement; the client has no logits in this mode)."""
    from cipherlm.net.channel import ChannelClosed, ChannelTimeout
    from cipherlm.runtime.offload_protocol import ProtocolError, RemoteError
    from cipherlm.runtime.twopc_session import LayerProgress, TwoPCClient, add_client_stats

    host, port = server
    _err(f"connecting to {host}:{port} (2pc) ...")
    try:
        with TwoPCClient(host, port, model=model, progress=LayerProgress()) as client:
            tokenizer, config = client.tokenizer, client.config
            prompt_ids = tokenizer.encode(chat_prompt(tokenizer, prompt, getattr(args, "raw", False))).ids
            _err(f"{len(prompt_ids)} prompt tokens, generating under 2PC (embedding {client.plan['embedding']}) ...")
            streamer = TokenStreamer(tokenizer) if stream else (lambda t: None)
            token_times: list[float] = []
            t_gen = time.perf_counter()

            def on_token(tid):
                token_times.append(time.perf_counter() - t_gen)
                streamer(tid)

            new_ids = client.generate(prompt_ids, args.max_new_tokens, eos_ids(config, tokenizer), on_token)
            if stream:
                streamer.finish()
            add_client_stats(report, client)
            add_run_prediction(report, config, "2pc", generation_passes(len(prompt_ids), len(new_ids)),
                               **_twopc_predict_kw(client.plan))
            name = client.model
    except (RemoteError, ProtocolError, ChannelClosed, ChannelTimeout) as exc:
        raise UserError(f"2pc session failed: {exc}") from exc
    extra = {
        "prompt_tokens": len(prompt_ids), "new_tokens": len(new_ids), "new_ids": new_ids,
        "first_token_seconds": token_times[0] if token_times else None,
        "later_token_seconds_mean": float(np.mean(np.diff(token_times))) if len(token_times) > 1 else None,
        "text": tokenizer.decode(new_ids, skip_special_tokens=True),
    }
    if compare:
        from cipherlm.models import load_model
        from cipherlm.runtime.plain import plain_executor

        _err("running the plaintext executor for comparison ...")
        lm = load_model(name)
        ref_ids, _ = plain_executor(lm).generate(prompt_ids, **_gen_kwargs(args, lm.config, lm.tokenizer))
        n = max(len(ref_ids), len(new_ids))
        extra["agreement"] = sum(a == b for a, b in zip(ref_ids, new_ids)) / n if n else 1.0
        extra["identical_prefix"] = next((i for i, (a, b) in enumerate(zip(ref_ids, new_ids)) if a != b),
                                         min(len(ref_ids), len(new_ids)))
        extra["plain_text"] = lm.tokenizer.decode(ref_ids, skip_special_tokens=True)
        report.agreement = extra["agreement"]
    return {"new_ids": new_ids, "extra": extra}


def compare_with_plain(model_name, prompt_ids, new_ids, logits, args) -> dict:
    """Agreement of private greedy tokens with the plaintext executor's, and first-token logit MSE."""
    _err("running the plaintext executor for comparison ...")
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(model_name)
    executor = plain_executor(lm)
    ref_ids, ref_logits = executor.generate(prompt_ids, **_gen_kwargs(args, lm.config, lm.tokenizer))
    n = max(len(ref_ids), len(new_ids))
    same = sum(1 for a, b in zip(ref_ids, new_ids) if a == b)
    prefix = next((i for i, (a, b) in enumerate(zip(ref_ids, new_ids)) if a != b), min(len(ref_ids), len(new_ids)))
    mse = float(np.mean((np.asarray(logits[0], np.float64) - np.asarray(ref_logits[0], np.float64)) ** 2))
    return {
        "agreement": same / n if n else 1.0,
        "identical_prefix": prefix,
        "plain_text": lm.tokenizer.decode(ref_ids, skip_special_tokens=True),
        "first_token_logits_mse": mse,
        "first_token_logits_max_abs_err": float(np.max(np.abs(np.asarray(logits[0]) - np.asarray(ref_logits[0])))),
    }


def _sentences(args) -> list[str]:
    if args.sentences:
        return list(args.sentences)
    from cipherlm.models.data import load_polarity

    pairs = load_polarity()
    limit = args.limit
    if not limit and getattr(args, "mode", "") == "fhe":
        limit = FHE_DEFAULT_SENTENCES
        _err(f"fhe mode: classifying the first {limit} polarity sentences (one encrypted pass each; --limit N "
             "for more)")
    return [t for t, _ in pairs][:limit] if limit else [t for t, _ in pairs]


def classify_texts(executor, tokenizer, texts, progress_label: str | None = None) -> np.ndarray:
    """Class logits (N, n_classes), one sentence per forward pass (no padding work)."""
    from cipherlm.progress import Progress

    out = []
    with Progress(progress_label or "classifying") as bar:
        for i, text in enumerate(texts):
            ids, mask = executor.batch_encode(tokenizer, [text])
            out.append(np.asarray(executor.classify(ids, mask)).reshape(-1))
            bar.update(i + 1, len(texts))
    return np.stack(out)


def _twopc_predict_kw(plan: dict) -> dict:
    """The 2pc session plan's linear packing and network preset, for `predict`."""
    lin = (plan or {}).get("linear") or {}
    return {k: lin[s] for k, s in (("linear_packing", "packing"), ("network", "network")) if s in lin}


def classify_twopc(server, model, texts, report):
    """Class logits (N, C) of each sentence from a 2pc server (one forward per sentence)."""
    from cipherlm.net.channel import ChannelClosed, ChannelTimeout
    from cipherlm.progress import Progress
    from cipherlm.runtime.offload_protocol import ProtocolError, RemoteError
    from cipherlm.runtime.twopc_session import TwoPCClient, add_client_stats

    try:
        with TwoPCClient(*server, model=model) as client:
            if not client.labels:
                raise UserError(f"the server's model {client.model!r} has no classifier head")
            out, passes = [], []
            with Progress("classifying under 2PC") as bar:
                for i, text in enumerate(texts):
                    ids = client.tokenizer.encode(text).ids
                    out.append(client.classify(ids))
                    passes.append((len(ids), "prefill"))
                    bar.update(i + 1, len(texts))
            add_client_stats(report, client)
            add_run_prediction(report, client.config, "2pc", passes, **_twopc_predict_kw(client.plan))
            return np.stack(out), list(client.labels)
    except (RemoteError, ProtocolError, ChannelClosed, ChannelTimeout) as exc:
        raise UserError(f"2pc session failed: {exc}") from exc


def cmd_classify(args) -> int:
    from cipherlm.report import RunReport
    from cipherlm.runtime.plain import polarity_classifier

    t0 = time.perf_counter()
    report = RunReport(mode=args.mode, model=args.model, command=sys.argv)
    texts = _sentences(args)
    if args.mode == "plain":
        from cipherlm.models import load_model

        executor, tokenizer, probe = polarity_classifier(load_model(args.model), profiler=report.profiler)
        logits = classify_texts(executor, tokenizer, texts)
        labels = list(probe.labels)
    elif args.mode == "2pc":
        if args.server is None:
            raise UserError("--mode 2pc needs --server HOST:PORT (start one with `cipherlm serve --mode 2pc --model minilm-l6`)")
        logits, labels = classify_twopc(args.server, args.model, texts, report)
    elif args.mode == "fhe":
        if args.server is None:
            raise UserError("--mode fhe needs --server HOST:PORT (start one with `cipherlm serve --mode fhe "
                            "--model minilm-l6`)")
        logits, labels = classify_fhe(args.server, args.model, texts, report, args)
    else:
        if args.server is None:
            raise UserError("--mode offload needs --server HOST:PORT (start one with `cipherlm serve --mode offload --model minilm-l6`)")
        from cipherlm.runtime.offload_client import OffloadClient

        with OffloadClient(*args.server, model=args.model, progress=_err) as client:
            if client.labels is None:
                raise UserError(f"the server's model {client.model!r} has no classifier head")
            timer = Meter()
            executor = client.executor(profiler=timer)
            logits = classify_texts(executor, client.tokenizer, texts, "classifying under HE")
            labels = client.labels
            _add_offload_stats(report, client, timer)
            # classify_texts: one encoder pass per sentence (batch_encode, at most 256 tokens)
            add_run_prediction(report, client.config, "offload",
                               [(len(executor.batch_encode(client.tokenizer, [t])[0][0]), "prefill") for t in texts],
                               he_backend=client.engine.he_backend, prefill_tokens=client.engine.prefill_tokens)
    preds = np.argmax(logits, axis=-1)
    for text, p in zip(texts, preds):
        print(f"{labels[p]:<9} {text}")
    report.extra.update(n_sentences=len(texts), predictions=[labels[p] for p in preds])
    if args.compare or (args.mode == "plain" and not args.sentences):
        from cipherlm.models import load_model
        from cipherlm.models.data import load_polarity

        if args.mode != "plain":
            _err("running the plaintext executor for comparison ...")
            executor, tokenizer, _ = polarity_classifier(load_model(args.model))
            ref = classify_texts(executor, tokenizer, texts, "plaintext reference")
            report.agreement = float(np.mean(np.argmax(ref, axis=-1) == preds))
            report.extra["max_abs_logit_error"] = float(np.max(np.abs(ref - logits)))
            print(f"agreement with plaintext: {report.agreement:.4f} ({int(round(report.agreement * len(texts)))}/{len(texts)})")
        if not args.sentences:
            gold = [y for _, y in load_polarity()][: len(texts)]
            report.extra["accuracy_vs_labels"] = float(np.mean(np.asarray(gold) == preds))
            print(f"accuracy against the polarity labels: {report.extra['accuracy_vs_labels']:.3f}")
    report.finish(wall_seconds=time.perf_counter() - t0)
    print(report.summary_text(), file=sys.stderr)
    _write_outputs(report, args)
    return 0


SERVE_LIMIT_FLAGS = ("max_sessions", "max_sessions_per_address", "session_lifetime", "hello_timeout",
                     "pre_hello_max_frame", "max_frame", "max_cts_per_request", "max_work_per_session")


def serve_limits(args, defaults):
    """The mode's default `ServerLimits` with the limit flags the user gave (None: not given)."""
    try:
        return defaults.merged(**{k: getattr(args, k, None) for k in SERVE_LIMIT_FLAGS})
    except ValueError as exc:
        raise UserError(f"bad server limit: {exc}") from exc


def _session_processes(args) -> int | None:
    n = getattr(args, "session_processes", None)
    if n is not None and n < 1:
        raise UserError("--session-processes must be a positive integer")
    return n


@contextlib.contextmanager
def _serve_errors():
    """A server's set-up refusals as user errors (e.g. worker processes for a host that cannot fork)."""
    from cipherlm.runtime.session_workers import SessionProcessesError
    from cipherlm.runtime.twopc_backend import TwoPCError

    try:
        yield
    except SessionProcessesError as exc:
        raise UserError(f"--session-processes: {exc}") from None
    except TwoPCError as exc:  # e.g. --fusion blb for a decoder
        raise UserError(str(exc)) from None


def cmd_serve(args) -> int:
    timeout = getattr(args, "timeout", None)  # None: the mode's own default idle timeout
    if timeout is not None and timeout <= 0:
        raise UserError("--timeout must be a positive number of seconds")
    if getattr(args, "workers", None) is not None and args.workers < 1:
        raise UserError("--workers must be at least 1")
    if args.mode == "2pc":
        from cipherlm.runtime import twopc_session

        limits = serve_limits(args, twopc_session.DEFAULT_LIMITS)
        with _serve_errors():
            twopc_session.run_server(args.model, args.host, args.port, timeout,
                                     embedding=getattr(args, "embedding", "auto"),
                                     moe_capacity=getattr(args, "moe_capacity", 2.0),
                                     linear_packing=getattr(args, "linear_packing", "coeff"),
                                     network=getattr(args, "packing_network", "LAN"), limits=limits,
                                     session_processes=_session_processes(args),
                                     fusion=getattr(args, "fusion", "auto"))
        return 0
    if args.mode == "fhe":
        return serve_fhe(args, timeout)
    from cipherlm.runtime import offload_server

    from cipherlm.he.matmul import OffloadBackendUnavailable

    limits = serve_limits(args, offload_server.DEFAULT_LIMITS)
    with _serve_errors():
        try:
            offload_server.run_server(args.model, args.host, args.port, timeout, workers=args.workers,
                                      limits=limits, he_backend=getattr(args, "he_backend", None),
                                      session_processes=_session_processes(args))
        except OffloadBackendUnavailable as exc:  # --he-backend lattigo without the library
            raise UserError(str(exc)) from None
    return 0


def cmd_proxy(args) -> int:
    import os

    from cipherlm.runtime import proxy

    api_key = args.api_key or os.environ.get("CIPHERLM_PROXY_API_KEY") or None
    template = None
    if args.chat_template:
        try:
            template = proxy.ChatTemplate.from_file(args.chat_template)
        except (OSError, ValueError) as exc:
            raise UserError(f"--chat-template: {exc}") from exc
    if not 0 <= args.port < 65536:
        raise UserError("--port must be in 0..65535")
    proxy.serve(list(args.server), args.mode, host=args.host, port=args.port, api_key=api_key,
                chat_template=template, compare_plaintext=args.compare_plaintext)
    return 0


def cmd_demo(args) -> int:
    from cipherlm.report import RunReport

    from cipherlm.launch import DEFAULT_DECODER, DEFAULT_ENCODER

    t0 = time.perf_counter()
    if getattr(args, "model", None) is None:
        args.model = DEFAULT_ENCODER if args.mode == "fhe" else DEFAULT_DECODER
    report = RunReport(mode=args.mode, model=args.model, command=sys.argv)
    args.temperature, args.top_k, args.top_p, args.seed, args.raw = 0.0, 0, 1.0, None, False
    if args.max_new_tokens is None:
        args.max_new_tokens = {"2pc": 2, "fhe": 1}.get(args.mode, 8)
    if args.mode == "fhe":
        return demo_fhe(args, report, t0)
    if args.mode == "2pc":
        return demo_twopc(args, report, t0)
    if args.mode == "plain":
        print(f"prompt: {args.prompt}")
        report.extra.update(run_plain_generation(args.model, args.prompt, args, report))
        report.finish(wall_seconds=time.perf_counter() - t0)
        print(report.summary_text())
        _write_outputs(report, args)
        return 0
    _err(f"starting the {args.mode} server for {args.model} (a separate process) ...")
    proc, addr = start_server_process(args.model)
    try:
        print(f"prompt: {args.prompt}")
        result = run_offload_generation(addr, args.model, args.prompt, args, report=report, compare=True)
    finally:
        stop_process(proc)
    report.extra.update(result["extra"])
    report.finish(wall_seconds=time.perf_counter() - t0)
    ex = result["extra"]
    server_s, client_s = report.extra["server_compute_seconds"], report.extra["client_compute_seconds"]
    print(f"offload (private, HE backend {report.extra.get('he_backend', '?')}): {ex['text']!r}")
    print(f"plaintext executor:   {ex['plain_text']!r}")
    print(f"bytes up {report.parties['client']['bytes_sent'] / 1e6:.1f} MB, down {report.parties['client']['bytes_received'] / 1e6:.1f} MB "
          f"(set-up included: client bundle once per model, Galois keys once per session)")
    print(f"server HE time {server_s:.1f} s, client time {client_s:.1f} s; "
          f"first token {ex['first_token_seconds']:.1f} s, later tokens {ex['later_token_seconds_mean'] or 0:.1f} s each")
    print("modelled end to end: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.network().items()))
    print(f"agreement with plaintext: {ex['agreement']:.3f} (identical prefix {ex['identical_prefix']} tokens), "
          f"first-token logits MSE {ex['first_token_logits_mse']:.3e}")
    print(report.summary_text())
    _write_outputs(report, args)
    return 0


def demo_twopc(args, report, t0) -> int:
    """`cipherlm demo --mode 2pc`: a 2pc server process on loopback and a short greedy generation."""
    if args.prompt == DEFAULT_PROMPT:  # keep the demo short: a 5-token raw prompt (no chat template)
        args.prompt, args.raw = "The capital of France is", True
    _err(f"starting the 2pc server for {args.model} (a separate process) ...")
    proc, addr = start_server_process(args.model, mode="2pc")
    try:
        print(f"prompt: {args.prompt}")
        result = run_twopc_generation(addr, args.model, args.prompt, args, report=report, compare=True)
    finally:
        stop_process(proc)
    ex = result["extra"]
    report.extra.update(ex)
    report.finish(wall_seconds=time.perf_counter() - t0)
    print(f"2pc (private):        {ex['text']!r}")
    print(f"plaintext executor:   {ex['plain_text']!r}")
    print(f"agreement with plaintext: {ex['agreement']:.3f} (identical prefix {ex['identical_prefix']} tokens)")
    print(report.summary_text())
    _write_outputs(report, args)
    return 0


# ----------------------------------------------------------------------------- fhe mode

#: polarity sentences `cipherlm classify --mode fhe` takes without sentences or --limit (a pass each)
FHE_DEFAULT_SENTENCES = 2


@contextlib.contextmanager
def _fhe_session(server, model, args):
    """An `FheClient` session with a `cipherlm serve --mode fhe`; its faults as user errors."""
    from cipherlm.he import HEError
    from cipherlm.net.channel import ChannelClosed, ChannelTimeout
    from cipherlm.runtime.fhe_client import FheClient
    from cipherlm.runtime.fhe_protocol import ProtocolError, RemoteError

    host, port = server
    _err(f"connecting to {host}:{port} (fhe) ...")
    try:
        with FheClient(host, port, model=model, insecure_ok=bool(getattr(args, "insecure_ok", False)),
                       progress=_err, refresh=getattr(args, "refresh", "bootstrap")) as client:
            _err(f"session ready in {client.setup_seconds:.1f} s: {client.model} ({client.kind}), preset "
                 f"{client.preset}{' (INSECURE test preset)' if client.insecure else ''}, up to "
                 f"{client.max_tokens} tokens per pass, refresh by {client.refresh}")
            yield client
    except (RemoteError, ProtocolError, ChannelClosed, ChannelTimeout, HEError) as exc:
        raise UserError(f"fhe session failed: {exc}") from exc


def peak_rss_mb() -> float:
    from cipherlm.runtime.fhe_server import peak_rss_mb as peak

    return peak()


def _add_fhe_stats(report, client) -> None:
    """Traffic, server seconds per operation kind (the evaluator's), bootstraps and HE op counts,
    client seconds and peak memory of an fhe session, into the report."""
    server_stats = client.server_stats()
    report.extra["he_backend"] = client.engine.he_backend  # the server's, named in its welcome
    report.add_channel_stats(client.chan.stats(), party="client")
    for kind, seconds in client.server_seconds.items():
        report.add_seconds(kind, seconds)
    report.add_he_ops(dict(client.server_counts), op_class="fhe")
    for kind, seconds in client.seconds.items():
        report.add_seconds(f"client_{kind}", seconds)
    keys_s = (server_stats.get("seconds") or {}).get("keys", 0.0)
    report.add_seconds("keys_load", keys_s)
    report.extra.update({
        "preset": client.preset, "insecure_preset": client.insecure, "max_tokens": client.max_tokens,
        "setup_seconds": client.setup_seconds, "bundle_from_cache": client.bundle_from_cache,
        "refresh": client.refresh,
        "bootstraps": int(client.server_counts.get("bootstrap", 0)),
        "client_refreshes": client.client_refreshes,
        "client_refreshed_ciphertexts": int(client.server_counts.get("client_refresh", 0)),
        "server_seconds": dict(client.server_seconds), "server_keys_load_seconds": keys_s,
        "server_compute_seconds": sum(client.server_seconds.values()),
        "client_seconds": dict(client.seconds), "client_compute_seconds": sum(client.seconds.values()),
        "passes": [{k: v for k, v in p.items()} for p in client.infer_stats],
        "peak_rss_mb": {"client": peak_rss_mb(), "server": server_stats.get("peak_rss_mb")},
    })


def _fhe_generate_with(client, prompt, args, report, stream=True) -> dict:
    tok = client.tokenizer
    if client.kind != "decoder":
        raise UserError(f"the server's model {client.model!r} is an encoder: use `cipherlm classify --mode fhe`")
    if tok is None:
        raise UserError(f"the server's model {client.model!r} has no tokenizer")
    prompt_ids = tok.encode(chat_prompt(tok, prompt, getattr(args, "raw", False))).ids
    if len(prompt_ids) > client.max_tokens:
        raise UserError(f"the prompt is {len(prompt_ids)} tokens: this fhe server takes at most {client.max_tokens} "
                        "per pass (serve --max-tokens)")
    _err(f"{len(prompt_ids)} prompt tokens; generating: one encrypted pass over the prompt, then one per new "
         "token (the keys and values stay encrypted in the server's KV cache) ...")
    streamer = TokenStreamer(tok) if stream else (lambda t: None)
    token_times: list[float] = []
    t_gen = time.perf_counter()

    def on_token(tid):
        token_times.append(time.perf_counter() - t_gen)
        streamer(tid)

    new_ids, logits = client.generate(prompt_ids, args.max_new_tokens, eos_ids(client.config, tok), on_token)
    if stream:
        streamer.finish()
    _add_fhe_stats(report, client)
    extra = {
        "prompt_tokens": len(prompt_ids), "new_tokens": len(new_ids), "new_ids": new_ids,
        "first_token_seconds": token_times[0] if token_times else None,
        "later_token_seconds_mean": float(np.mean(np.diff(token_times))) if len(token_times) > 1 else None,
        "text": tok.decode(new_ids, skip_special_tokens=True),
    }
    return {"prompt_ids": prompt_ids, "new_ids": new_ids, "logits": logits, "extra": extra}


def run_fhe_generation(server, model, prompt, args, report, compare: bool, stream=True) -> dict:
    """Greedy generation with an fhe server (whole blocks on ciphertexts); optionally compared
    with the local plaintext executor."""
    with _fhe_session(server, model, args) as client:
        result = _fhe_generate_with(client, prompt, args, report, stream)
        name = client.model
    if compare:
        result["extra"].update(compare_with_plain(name, result["prompt_ids"], result["new_ids"], result["logits"],
                                                  args))
        report.agreement = result["extra"]["agreement"]
    return result


def _fhe_classify_with(client, texts) -> np.ndarray:
    from cipherlm.progress import Progress

    if "classify" not in client.tasks or not client.labels:
        raise UserError(f"the server's model {client.model!r} has no classifier head")
    if client.tokenizer is None:
        raise UserError(f"the server's model {client.model!r} has no tokenizer")
    out, cut = [], 0
    with Progress("classifying under FHE (one encrypted pass per sentence)") as bar:
        for i, text in enumerate(texts):
            ids = client.tokenizer.encode(text).ids
            if len(ids) > client.max_tokens:
                ids, cut = ids[: client.max_tokens], cut + 1
            out.append(client.classify(ids))
            bar.update(i + 1, len(texts))
    if cut:
        _err(f"{cut} sentence(s) cut to the server's {client.max_tokens} tokens (serve --max-tokens)")
    return np.stack(out)


def classify_fhe(server, model, texts, report, args):
    """Class logits (N, C) of each sentence from an fhe server (one encrypted pass each)."""
    with _fhe_session(server, model, args) as client:
        logits = _fhe_classify_with(client, texts)
        _add_fhe_stats(report, client)
        return logits, list(client.labels)


def _fhe_serve_options(args) -> tuple[str, bool, int]:
    from cipherlm.runtime.fhe_protocol import DEFAULT_MAX_TOKENS, TEST_PRESET

    preset = getattr(args, "fhe_preset", None) or "N16QP1546H192H32"
    insecure = bool(getattr(args, "insecure_test_preset", False))
    if preset == TEST_PRESET and not insecure:
        raise UserError(f"--fhe-preset {TEST_PRESET} is INSECURE (no security at all): it needs "
                        "--insecure-test-preset, for tests only")
    max_tokens = getattr(args, "max_tokens", None)
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise UserError("--max-tokens must be a positive integer")
    return preset, insecure, max_tokens


def serve_fhe(args, timeout) -> int:
    """`cipherlm serve --mode fhe`: sessions in threads, keys per session, bootstrapping."""
    from cipherlm.he import HEError
    from cipherlm.runtime import fhe_server

    if getattr(args, "session_processes", None) not in (None, 1):
        raise UserError("--session-processes: the fhe mode runs sessions in threads (Lattigo's Go runtime "
                        "must not be forked; it uses every core)")
    workers = getattr(args, "workers", None)
    workers = 1 if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise UserError("--workers must be a positive integer")
    if getattr(args, "ray_address", None) and workers == 1:
        raise UserError("--ray-address needs --workers > 1 (one worker runs in the server process)")
    preset, insecure, max_tokens = _fhe_serve_options(args)
    limits = serve_limits(args, fhe_server.DEFAULT_LIMITS)
    try:
        fhe_server.run_server(args.model, args.host, args.port, timeout, limits=limits, preset=preset,
                              insecure_test_preset=insecure, max_tokens=max_tokens, workers=workers,
                              ray_address=getattr(args, "ray_address", None))
    except HEError as exc:
        raise UserError(f"fhe: {exc}") from exc
    return 0


def demo_fhe(args, report, t0) -> int:
    """`cipherlm demo --mode fhe`: an fhe server process on loopback; a decoder generates
    --max-new-tokens greedy tokens (default 1), an encoder classifies the prompt; compared
    with the plaintext executor."""
    preset, insecure, max_tokens = _fhe_serve_options(args)
    args.insecure_ok = insecure
    extra_args = ["--fhe-preset", preset, "--max-tokens", str(max_tokens)] + (
        ["--insecure-test-preset"] if insecure else [])
    _err(f"starting the fhe server for {args.model} (a separate process; preset {preset}) ...")
    proc, addr = start_server_process(args.model, mode="fhe", extra_args=extra_args)
    try:
        print(f"prompt: {args.prompt}")
        with _fhe_session(addr, None, args) as client:
            if client.kind == "decoder":
                result = _fhe_generate_with(client, args.prompt, args, report)
                kind = "decoder"
            else:
                if client.tokenizer is None:
                    raise UserError(f"the server's model {client.model!r} has no tokenizer: nothing to classify")
                logits = _fhe_classify_with(client, [args.prompt])[0]
                _add_fhe_stats(report, client)
                labels, kind = list(client.labels), "encoder"
    finally:
        stop_process(proc)
    if kind == "decoder":
        ex = result["extra"]
        try:
            ex.update(compare_with_plain(args.model, result["prompt_ids"], result["new_ids"], result["logits"], args))
            report.agreement = ex["agreement"]
        except Exception as exc:  # a model the plaintext side cannot load (a path served elsewhere)
            _err(f"no plaintext comparison: {type(exc).__name__}")
        report.extra.update(ex)
        print(f"fhe (private):        {ex['text']!r}")
        if "plain_text" in ex:
            print(f"plaintext executor:   {ex['plain_text']!r}")
    else:
        report.extra.update(prediction=labels[int(np.argmax(logits))], logits=[float(v) for v in logits])
        print(f"fhe (private):        {labels[int(np.argmax(logits))]} (logits {', '.join(f'{v:.4f}' for v in logits)})")
        try:
            from cipherlm.models import load_model
            from cipherlm.runtime.plain import polarity_classifier

            executor, tokenizer, _ = polarity_classifier(load_model(args.model))
            ids = tokenizer.encode(args.prompt).ids[:max_tokens]
            ref = np.asarray(executor.classify(np.asarray([ids]))).reshape(-1)
            report.agreement = float(np.argmax(ref) == np.argmax(logits))
            report.extra["max_abs_logit_error"] = float(np.max(np.abs(ref - logits)))
            print(f"plaintext executor:   {labels[int(np.argmax(ref))]} (max |logit error| "
                  f"{report.extra['max_abs_logit_error']:.2e})")
        except Exception as exc:
            _err(f"no plaintext comparison: {type(exc).__name__}")
    report.finish(wall_seconds=time.perf_counter() - t0)
    c = report.parties["client"]
    x = report.extra
    print(f"bytes up {c['bytes_sent'] / 1e6:.1f} MB, down {c['bytes_received'] / 1e6:.1f} MB (keys once per session "
          f"included), {report.rounds} rounds; refresh by {x['refresh']}: "
          f"{x['bootstraps'] if x['refresh'] == 'bootstrap' else x['client_refreshes']} "
          f"{'bootstraps' if x['refresh'] == 'bootstrap' else 'client refreshes'}, server HE time "
          f"{x['server_compute_seconds']:.1f} s, client time {x['client_compute_seconds']:.1f} s; peak memory "
          f"client {x['peak_rss_mb']['client']:.0f} MB, server {x['peak_rss_mb']['server'] or 0:.0f} MB")
    print(report.summary_text())
    _write_outputs(report, args)
    return 0


def cmd_bench(args) -> int:
    from cipherlm.report import RunReport

    if args.what == "blb":  # its own report (rows of the three pipelines, the machine's load; --report FILE)
        from cipherlm.bench import blb

        try:
            blb.run(args)
        except ValueError as e:  # an unknown workload or row
            raise UserError(str(e)) from None
        return 0
    t0 = time.perf_counter()
    mode = {"offload": "offload", "fhe": "fhe", "aegis": "fhe"}.get(args.what, "2pc")
    if args.what == "aegis":
        model = f"{args.workloads or 'bert-tiny'} (random weights)"
    elif args.what == "fhe":  # its workloads name their models (`bench.fhe`), not --model
        model = args.workloads or "minilm"
    else:
        model = args.model
    report = RunReport(mode=mode, model=model, command=sys.argv)
    if args.what == "mpc":
        report.extra["operations"] = bench_mpc(args)
    elif args.what == "embedding":
        from cipherlm.bench import embedding

        report.extra.update(embedding.run(args))
    elif args.what == "moe":
        from cipherlm.bench import moe

        report.extra.update(moe.run(args))
    elif args.what == "2pc":
        from cipherlm.bench import twopc

        report.extra["workloads"] = twopc.run(args)
    elif args.what == "fhe":
        from cipherlm.bench import fhe

        report.extra["workloads"] = fhe.run(args)
    elif args.what == "aegis":
        from cipherlm.bench import aegis

        report.extra["aegis"] = aegis.run(args)
        args.plot = None  # aegis.run drew its own figure there
    else:
        from cipherlm.bench import offload

        report.extra.update(offload.run(args))
    report.finish(wall_seconds=time.perf_counter() - t0)
    _write_outputs(report, args)
    return 0


def bench_mpc(args) -> list[dict]:
    """2PC primitives (--elements each) and the nonlinear library on the issue's shapes:
    bytes, rounds, compute time, modelled LAN/WAN time and max error vs numpy."""
    from cipherlm.mpc import bench

    names = args.only.split(",") if args.only else None
    where = "two processes over TCP" if args.processes else "two parties in process"
    _err(f"bench mpc: primitives on {args.elements} elements, nonlinear shapes with {args.rows} rows ({where}) ...")
    rows = bench.add_network(bench.measure(names, args.elements, args.rows, processes=args.processes))
    print(bench.format_rows(rows))
    over = [r["name"] for r in rows if r["max_error"] > r["bound"]]
    if over:
        print("max error above the documented bound: " + ", ".join(over))
    return rows

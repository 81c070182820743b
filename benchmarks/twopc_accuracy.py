"""Accuracy of the 2pc mode against the plaintext executor on the real models (issue 4 acceptance).

* MiniLM polarity (the 200 Rotten Tomatoes sentences, linear probe): 2PC class predictions
  vs the plaintext executor's; ``--every N`` runs every N-th sentence.
* SmolLM2 teacher forcing: for each prompt (first ``--prompt-tokens`` tokens of a fixed
  text), the plaintext greedy continuation of ``--new-tokens`` tokens, then ONE 2PC
  forward pass over prompt + continuation; the argmax at each position that predicts a
  continuation token is compared with it (the report's ``agreement``), plus logit error
  statistics.  For the statistics the logits are opened to the client (a diagnostic: the
  served mode opens only the argmax).  ``--free-running`` also runs 2PC greedy generation
  (prefill + KV-cached decode, argmax on shares) and reports the identical-prefix length.

Both parties run in this process (two threads, `run_inprocess`), sharing its cores.

    python benchmarks/twopc_accuracy.py polarity --every 20 --out reports/twopc_polarity.json
    python benchmarks/twopc_accuracy.py smollm --prompts 5 --out reports/twopc_smollm.json
    python benchmarks/twopc_accuracy.py smollm --fusion blb --resume --out reports/twopc_smollm_blb.json
    python benchmarks/twopc_accuracy.py polarity --fusion blb --by-length --resume --out reports/blb_all.json
    # all 200 sentences as 4 parallel shards, then one report
    for i in 0 1 2 3; do python benchmarks/twopc_accuracy.py polarity --shard $i/4 --out s$i.json & done; wait
    python benchmarks/twopc_accuracy.py merge-polarity s0.json s1.json s2.json s3.json --out all.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from cipherlm.mpc.runner import run_inprocess
from cipherlm.runtime import twopc
from cipherlm.runtime.twopc_executors import make_twopc_executor

PROMPTS = [
    "The capital of France is Paris, a city known for",
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis is the process by which green plants convert",
    "The first step in writing a good essay is to choose",
    "Water boils at one hundred degrees Celsius when the pressure",
]


def _write(path, obj) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(obj, indent=2) + "\n")


def _plan_header(plan: dict) -> dict:
    """The plan's choices a report records: the embedding, the fusion and, with BLB, its splits
    (activation, exp, norms) and value bound."""
    keys = ("embedding", "fusion", "blb_activation", "blb_exp", "blb_norms", "blb_value_bits")
    return {k: plan[k] for k in keys if k in plan}


def polarity(args) -> dict:
    from cipherlm.models import load_model
    from cipherlm.models.data import load_polarity
    from cipherlm.runtime.plain import polarity_classifier

    lm = load_model("minilm-l6")
    ex, tok, probe = polarity_classifier(lm)
    pairs = load_polarity()
    sel = list(range(0, len(pairs), args.every))
    if args.max_tokens:  # the short sentences only (a slow configuration: --fusion blb)
        sel = [i for i in sel if len(tok.encode(pairs[i][0]).ids) <= args.max_tokens]
    sel = sel[: args.limit or None]
    if args.shard:
        i, n = _parse_shard(args.shard)
        sel = sel[i::n]
    rows: list[dict] = []
    earlier_classes: dict = {}
    if args.resume and args.out and Path(args.out).exists():  # keep the finished sentences, run the rest
        old = json.loads(Path(args.out).read_text())
        rows = [r for r in old["rows"] if r["index"] in set(sel)]
        earlier_classes = old.get("op_classes", {})
        done = {r["index"] for r in rows}
        sel = [i for i in sel if i not in done]
        print(f"resuming {args.out}: {len(done)} done, {len(sel)} to run", flush=True)
    sw = twopc.server_weights(lm.config, lm.weights, classifier=probe.as_linear()["classifier"],
                              keep_bound=args.fusion == "blb")
    plan = twopc.public_plan(lm.config, sw, embedding=args.embedding, fusion=args.fusion)
    if args.by_length:
        # the same sentences, shortest first: each length's rotation keys are made and sent once
        # (the BLB server keeps a bounded LRU of rotation keys, ~1 GB per MiniLM length, so in
        # dataset order nearly every sentence asks for a new set)
        sel = sorted(sel, key=lambda i: (len(tok.encode(pairs[i][0]).ids), i))
    ids_list = [tok.encode(pairs[i][0]).ids for i in sel]
    ref = [np.asarray(ex.classify(*ex.batch_encode(tok, [pairs[i][0]]))).reshape(-1) for i in sel]
    out = {"task": "polarity", "model": lm.name, "every": args.every, "shard": args.shard, **_plan_header(plan),
           "command": " ".join(sys.argv), "rows": rows, "earlier_op_classes": earlier_classes}

    def party(ctx):
        meter = twopc.OpMeter(ctx.chan)
        enc = make_twopc_executor(ctx, lm.config, sw if ctx.party == 1 else None, plan, meter=meter)
        for j, ids in enumerate(ids_list):
            t0 = time.perf_counter()
            logits = enc.classify(np.asarray(ids) if ctx.party == 0 else None, len(ids))
            if ctx.party == 0:
                r = ref[j]
                rows.append({"index": sel[j], "tokens": len(ids), "logits": logits.tolist(), "plain": r.tolist(),
                             "same": bool(np.argmax(logits) == np.argmax(r)),
                             "max_abs_err": float(np.max(np.abs(logits - r))), "seconds": time.perf_counter() - t0,
                             "bytes_so_far": sum(v["bytes"] for v in meter.summary().values())})
                _summarise_polarity(out, meter)
                _write(args.out, out)
                print(f"[{j + 1}/{len(ids_list)}] sentence {sel[j]}: {len(ids)} tokens, same={rows[-1]['same']}, "
                      f"err {rows[-1]['max_abs_err']:.4f}, {rows[-1]['seconds']:.1f} s", flush=True)
        return meter.summary()

    run_inprocess(party, timeout=args.timeout)
    return out


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard takes I/N (e.g. 3/16), got {text!r}") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard {text}: need 0 <= I < N")
    return i, n


def merge_polarity(paths: list[str]) -> dict:
    """One polarity report from shard reports (``--shard I/N`` runs, possibly on several
    machines): rows de-duplicated by sentence index, per-class bytes/seconds summed."""
    rows: dict[int, dict] = {}
    classes: dict[str, dict] = {}
    commands = []
    for path in paths:
        part = json.loads(Path(path).read_text())
        if part.get("task") != "polarity":
            raise SystemExit(f"{path}: not a polarity report")
        commands.append(part.get("command"))
        for r in part["rows"]:
            rows.setdefault(r["index"], r)
        _add_classes(classes, part.get("op_classes", {}))
    out = {"task": "polarity", "model": "minilm-l6", "merged_from": list(paths), "commands": commands,
           "rows": [rows[i] for i in sorted(rows)]}
    _summarise_polarity(out, None)
    out["op_classes"] = classes
    # both directions, every class, each shard run's session set-up included
    out["bytes_per_sentence"] = sum(v.get("bytes", 0) for v in classes.values()) / max(1, out["n"])
    return out


def _add_classes(acc: dict, more: dict) -> dict:
    """Per-operator-class totals (bytes, seconds, ...) of `more` added into `acc`."""
    for name, v in more.items():
        a = acc.setdefault(name, {})
        for k, x in v.items():
            a[k] = a.get(k, 0) + x
    return acc


def _summarise_polarity(out, meter) -> None:
    rows = out["rows"]
    out["n"] = len(rows)
    out["identical"] = sum(r["same"] for r in rows)
    out["max_abs_logit_err"] = max(r["max_abs_err"] for r in rows)
    # how close the plaintext decisions are: the 2PC error matters only where it reaches this
    out["min_plain_margin"] = min(float(np.ptp(np.sort(r["plain"])[-2:])) for r in rows)
    out["mean_seconds_per_sentence"] = float(np.mean([r["seconds"] for r in rows]))
    out["mean_tokens"] = float(np.mean([r["tokens"] for r in rows]))
    if meter is not None:  # this run's classes plus those of the run it resumed (--resume)
        out["op_classes"] = _add_classes(_add_classes({}, out.get("earlier_op_classes", {})), meter.summary())


def smollm(args) -> dict:
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model("smollm2-135m")
    ex = plain_executor(lm)
    sw = twopc.server_weights(lm.config, lm.weights, keep_bound=args.fusion == "blb")
    plan = twopc.public_plan(lm.config, sw, embedding=args.embedding, fusion=args.fusion)
    P, K = args.prompt_tokens, args.new_tokens
    rows: list[dict] = []
    if args.resume and args.out and Path(args.out).exists():  # keep the finished prompts, run the rest
        rows = [r for r in json.loads(Path(args.out).read_text())["rows"] if "agree" in r]
    done = {tuple(r["prompt"]) for r in rows}
    cases = []
    for text in PROMPTS[: args.prompts]:
        prompt = lm.tokenizer.encode(text).ids[:P]
        if tuple(prompt) in done:
            continue
        cont = ex.generate(prompt, max_new_tokens=K, eos_token_ids=[])
        seq = prompt + list(cont)
        ref_logits = ex.forward(seq)  # (P+K, V)
        cases.append((prompt, list(cont), seq, ref_logits))
    if args.resume:
        print(f"resuming {args.out}: {len(rows)} prompts done, {len(cases)} to run", flush=True)
    out = {"task": "smollm-teacher-forced", "model": lm.name, "prompt_tokens": P, "new_tokens": K,
           "fold_norms": plan["fold_norms"], **_plan_header(plan), "command": " ".join(sys.argv), "rows": rows}

    def party(ctx):
        meter = twopc.OpMeter(ctx.chan)
        dec = make_twopc_executor(ctx, lm.config, sw if ctx.party == 1 else None, plan, meter=meter,
                                  progress=(lambda d, t, n="": print(f"  layer {d}/{t} {n}", flush=True))
                                  if ctx.party == 0 and args.verbose else None)
        for j, (prompt, cont, seq, ref_logits) in enumerate(cases):
            t0 = time.perf_counter()
            row = {"prompt": prompt, "plain_continuation": cont} if ctx.party == 0 else None
            if not args.teacher_forcing:
                pass
            elif ctx.party == 0:
                lg = dec.logits_to_client(dec.forward(np.asarray(seq), len(seq)))
                pos = np.arange(P - 1, P + K - 1)  # positions whose next token is a continuation token
                pred = np.argmax(lg[pos], axis=-1)
                err = np.abs(lg[pos] - ref_logits[pos])
                row.update({"twopc_argmax": pred.tolist(),
                            "agree": int(np.sum(pred == np.asarray(cont))), "positions": int(K),
                            "max_abs_logit_err": float(err.max()), "mean_abs_logit_err": float(err.mean()),
                            "logit_mse": float(np.mean(err ** 2)), "plain_logit_absmax": float(np.abs(ref_logits[pos]).max()),
                            "teacher_forced_seconds": time.perf_counter() - t0})
                print(f"[{j + 1}/{len(cases)}] teacher forced: {row['agree']}/{K} agree, max err "
                      f"{row['max_abs_logit_err']:.3f}, {row['teacher_forced_seconds']:.0f} s", flush=True)
            else:
                dec.logits_to_client(dec.forward(None, len(seq)))
            if args.free_running:
                t1 = time.perf_counter()
                gen = dec.generate(np.asarray(prompt) if ctx.party == 0 else None, P, K)
                if ctx.party == 0:
                    same = _first_disagreement(gen, cont)
                    row.update(free_running=gen, identical_prefix=int(same),
                               free_running_seconds=time.perf_counter() - t1)
                    print(f"    free running: identical prefix {same}/{K}, {row['free_running_seconds']:.0f} s",
                          flush=True)
            if ctx.party == 0:
                rows.append(row)
                _summarise_smollm(out, meter)
                _write(args.out, out)
        return None

    run_inprocess(party, timeout=args.timeout)
    return out


def _first_disagreement(pred, ref) -> int:
    return next((i for i, (a, b) in enumerate(zip(pred, ref)) if a != b), min(len(pred), len(ref)))


def _summarise_smollm(out, meter=None) -> None:
    """Agreement and logit errors of the teacher-forced rows; identical-prefix lengths.

    ``prefix_until_first_disagreement`` (teacher-forced rows): up to and including
    the first position where the 2PC argmax differs from the plaintext continuation,
    the teacher-forced 2PC inputs are exactly the ones free-running 2PC generation
    feeds itself, so this index is the free-running identical-prefix length of a run
    with the same fixed-point errors (free running draws fresh shares, so the two
    agree in distribution, not token by token).  ``identical_prefix``: measured by
    real free-running generation (``--free-running``)."""
    rows = [r for r in out["rows"] if "agree" in r]
    if rows:
        out["agreement"] = sum(r["agree"] for r in rows) / sum(r["positions"] for r in rows)
        out["max_abs_logit_err"] = max(r["max_abs_logit_err"] for r in rows)
        out["mean_abs_logit_err"] = float(np.mean([r["mean_abs_logit_err"] for r in rows]))
        pre = [_first_disagreement(r["twopc_argmax"], r["plain_continuation"]) for r in rows]
        out["prefix_until_first_disagreement"] = pre
        out["mean_prefix_until_first_disagreement"] = float(np.mean(pre))
    rows = out["rows"]
    if any("identical_prefix" in r for r in rows):
        out["identical_prefix"] = [r.get("identical_prefix") for r in rows]
    if meter is not None:
        out["op_classes"] = meter.summary()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", choices=("polarity", "smollm", "merge-polarity", "summarise-smollm"))
    ap.add_argument("reports", nargs="*", help="merge-polarity: the shard reports to combine; "
                    "summarise-smollm: one smollm report whose summary is recomputed from its rows")
    ap.add_argument("--every", type=int, default=1, help="polarity: every N-th sentence")
    ap.add_argument("--limit", type=int, default=0, help="polarity: at most this many sentences")
    ap.add_argument("--max-tokens", type=int, default=0, help="polarity: only sentences of at most this many tokens")
    ap.add_argument("--shard", help="polarity: I/N runs every N-th selected sentence from the I-th "
                    "(shards can run in parallel and be combined with merge-polarity)")
    ap.add_argument("--by-length", action="store_true", help="polarity: run the selected sentences shortest "
                    "first (same sentences and rows; the session's key requests then repeat far less)")
    ap.add_argument("--resume", action="store_true", help="polarity / smollm: keep the rows already in --out "
                    "and run only the missing sentences (op_classes then cover this run only)")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--free-running", action="store_true", help="smollm: also 2PC greedy generation")
    ap.add_argument("--no-teacher-forcing", dest="teacher_forcing", action="store_false",
                    help="smollm: skip the teacher-forced pass (with --free-running: generation only)")
    ap.add_argument("--embedding", default="auto", choices=twopc.EMBEDDING_METHODS)
    ap.add_argument("--fusion", default="none", choices=twopc.FUSIONS,
                    help="blb runs BLB's fused blocks (runtime.twopc_blb; smollm: teacher forcing only)")
    ap.add_argument("--timeout", type=float, default=36000.0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", help="JSON results (rewritten after every item)")
    args = ap.parse_args(argv)
    if args.task == "merge-polarity":
        out = merge_polarity(args.reports)
        _write(args.out, out)
    elif args.task == "summarise-smollm":
        if len(args.reports) != 1:
            raise SystemExit("summarise-smollm takes one report")
        out = json.loads(Path(args.reports[0]).read_text())
        _summarise_smollm(out)
        _write(args.out or args.reports[0], out)
    else:
        out = polarity(args) if args.task == "polarity" else smollm(args)
    summary = {k: v for k, v in out.items() if k not in ("rows", "op_classes")}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

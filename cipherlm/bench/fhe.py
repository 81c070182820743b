"""``cipherlm bench fhe``: the fhe mode on one machine, client and server in one process
(no network: the bytes are the serialised sizes of what would travel).

Workloads:

* ``minilm``: MiniLM-L6 polarity classification (the polarity probe as the classifier
  head, `runtime.fhe_executor.FheModel.classify`) of polarity test sentences cut or
  repeated to exactly ``--tokens`` tokens; per sentence the fhe prediction against the
  plain executor's, and the logit error;
* ``bert-base``: one BERT-base layer (hidden 768, 12 heads, FFN 3072; random weights,
  seed 0) at ``--tokens`` tokens, its hidden states against the plain layer;
* ``smollm-block``: SmolLM2-135M's first decoder block (+ the final RMSNorm) on
  ``--tokens`` tokens of real text, against the plain executor's values there;
* ``smollm-generate``: SmolLM2-135M greedy generation of ``--max-new-tokens`` tokens after
  the first ``--prompt-tokens`` tokens of a fixed text, all 30 layers, checkpointed after
  every layer in ``--checkpoint DIR`` and resumed from it (`cipherlm.bench.fhe_generate`;
  ``--max-layers`` stops a call early), against the plain executor's greedy tokens.

``--refresh client`` runs the client-aided refresh instead of bootstrapping (no
bootstrapping keys; the refresh round trips' bytes are reported); at the production
preset the projections are encoded on every use, not cached (GBs at 2^15 slots).

Per run: seconds per inference (and per op kind: linear, qk, av, norm, poly, bootstrap),
bootstraps, key generation seconds, bytes up (evaluation + bootstrapping keys once; the
input ciphertexts per inference) and down (the result ciphertexts), and the process's
peak resident memory.  The published single-device figures it is compared with: NEXUS on
a 64-thread CPU 457 min for 12-layer BERT-base (about 38 min a layer; BLB Table 9), 37.3 s
on GPU; THOR 590.6 s on one A100.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time

import numpy as np

PUBLISHED = {"nexus_cpu_bert_base_layer_s": 457 * 60 / 12, "nexus_gpu_bert_base_s": 37.3,
             "thor_a100_bert_base_s": 590.6}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fit(ids: list[int], n: int, cls_id: int | None = None, sep_id: int | None = None) -> list[int]:
    """Exactly n ids: the sentence's inner tokens cut or repeated, between [CLS] and [SEP]."""
    inner = [t for t in ids if t not in (cls_id, sep_id)] or [0]
    k = n - (cls_id is not None) - (sep_id is not None)
    body = (inner * (k // len(inner) + 1))[:k]
    return ([cls_id] if cls_id is not None else []) + body + ([sep_id] if sep_id is not None else [])


class _Keys:
    """The client's keys for one packing layout, and the server's evaluator built from them."""

    def __init__(self, model, preset: str, max_tokens: int, insecure: bool, refresh: str = "bootstrap"):
        from cipherlm.he import get_backend
        from cipherlm.protocols.ckks.evaluator import CkksEvaluator
        from cipherlm.protocols.ckks.refresh import ClientRefresher, reencrypt_blobs

        self.be = get_backend("lattigo")
        self.ctx = self.be.bootstrappable_context(preset, allow_insecure_for_tests=insecure)
        t0 = time.perf_counter()
        self.sk = self.be.keygen(self.ctx)
        self.bk = self.sk.bootstrapping_keys() if refresh == "bootstrap" else None
        #: bytes of the client-aided refreshes (down: masked ciphertexts, up: fresh ones)
        self.refresh_bytes = {"down": 0, "up": 0}
        steps = list(model.rotation_steps(model.packing(self.ctx.slots, max_tokens)))
        self.ek = self.sk.eval_keys(relin=True, steps=steps)
        self.keygen_seconds = time.perf_counter() - t0
        # the upload's size without making the Galois keys a second time (GBs at N = 2^16): the
        # seeded blob of one and of two keys gives the header and the per-key bytes
        one, two = len(self.sk.galois_keys_bytes(steps[:1])), len(self.sk.galois_keys_bytes(steps[:2]))
        self.key_bytes = {"bootstrapping": self.bk.size_bytes if self.bk is not None else 0,
                          "relin_galois": len(self.sk.relin_key_bytes()) + one + (two - one) * (len(steps) - 1),
                          "rotation_steps": len(steps)}

        def exchange(blobs):  # the round trip to the client, in process
            self.refresh_bytes["down"] += sum(map(len, blobs))
            back = reencrypt_blobs(self.be, self.ctx, self.sk, blobs)
            self.refresh_bytes["up"] += sum(map(len, back))
            return back

        if self.bk is not None:
            self.ev = CkksEvaluator(self.be, self.ctx, self.ek, self.bk)
        else:
            self.ev = CkksEvaluator(self.be, self.ctx, self.ek, refresher=ClientRefresher(self.be, self.ctx, exchange))

    def encrypt(self, model, packing, x):
        from cipherlm.protocols.ckks.evaluator import CkksTensor

        blobs = [self.sk.encrypt_seeded(self.be.encode_slots(self.ctx, r)) for r in packing.pack(x)]
        cts = [self.be.ciphertext_from_bytes(self.ctx, b) for b in blobs]
        return CkksTensor(cts, x.shape[1], packing, model.bound(model.input_value)), sum(map(len, blobs))

    def slots(self, t) -> tuple[np.ndarray, int]:
        blobs = [self.be.ciphertext_to_bytes(c) for c in t.cts]
        s = np.stack([self.be.decode_slots(self.ctx, self.sk.decrypt(c)) for c in t.cts])
        return s.reshape(-1, t.packing.tp), sum(map(len, blobs))

    def close(self):
        if self.bk is not None:
            self.bk.close()


def _layer_progress(progress, what: str, ev, t0: float):
    """An `on_layer` callback printing one line per finished layer."""
    def on_layer(layer, n_layers):
        c = ev.stats.counts
        progress(f"{what}: layer {layer + 1}/{n_layers} done at {time.perf_counter() - t0:.0f} s "
                 f"({c.get('bootstrap', 0)} bootstraps, {ev.stats.as_dict()['refreshes']} refreshes)")
    return on_layer


def _stats(ev) -> dict:
    d = ev.stats.as_dict()
    ev.stats.counts.clear()
    ev.stats.seconds.clear()
    ev.stats.refreshes.clear()
    return d


def minilm_polarity_model(tokens: int):
    """(plain executor, test sentences, text -> exactly `tokens` ids, calibrated `FheModel` with
    the polarity probe as its classifier) for MiniLM-L6 at `tokens` tokens."""
    from cipherlm.models import load_model
    from cipherlm.models.data import polarity_split
    from cipherlm.runtime.fhe_executor import calibrated_model
    from cipherlm.runtime.plain import polarity_classifier

    lm = load_model("minilm-l6")
    ex, tok, probe = polarity_classifier(lm)
    W, b = probe.as_linear()["classifier"]
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    _train, test = polarity_split()

    def fit(text: str) -> list[int]:
        return _fit(tok.encode(text).ids, tokens, cls_id, sep_id)

    model = calibrated_model(lm, [fit(t) for t, _ in test[-8:]],
                             classifier=(np.asarray(W, np.float64), np.asarray(b, np.float64)))
    return ex, test, fit, model


def _resumed_rows(rows_file, run: dict) -> list[dict]:
    """The rows already in ``rows_file`` (None or missing: none); a file of another run
    (tokens, preset or refresh) is refused, not mixed in."""
    import json
    from pathlib import Path

    if rows_file is None or not Path(rows_file).exists():
        return []
    doc = json.loads(Path(rows_file).read_text())
    if {k: doc.get(k) for k in run} != run:
        raise SystemExit(f"{rows_file} holds the rows of another run ({ {k: doc.get(k) for k in run} }, "
                         f"this one {run}): pick another file")
    return list(doc.get("rows", []))


def bench_minilm(tokens: int, n: int, preset: str, insecure: bool, progress=print, refresh: str = "bootstrap",
                 rows_file=None) -> dict:
    """MiniLM polarity over the first ``n`` test sentences.  ``rows_file``: after each sentence
    the rows so far are written there (JSON), and the sentences already in it are skipped (a
    long run can stop and go on; the other fields are then those of the last part)."""
    import json
    from pathlib import Path

    from cipherlm.runtime.fhe_executor import client_embedding, client_tensors

    run = {"workload": "minilm", "tokens": tokens, "preset": preset, "refresh": refresh}
    rows = _resumed_rows(rows_file, run)
    done = {r["sentence"] for r in rows}
    if done:
        progress(f"minilm: {len(done)} sentences already in {rows_file}, {len(set(range(n)) - done)} to run")
    t0 = time.perf_counter()
    ex, test, fit, model = minilm_polarity_model(tokens)
    model.cache_plaintexts = preset.startswith("test-insecure")  # at 2^15 slots: GBs, and one pass uses each once
    setup = time.perf_counter() - t0
    keys = _Keys(model, preset, tokens, insecure, refresh)
    progress(f"minilm: keys in {keys.keygen_seconds:.1f} s ({keys.key_bytes['bootstrapping'] / 1e9:.2f} GB "
             f"bootstrapping keys), calibration {setup:.1f} s")
    for i, (text, label) in enumerate(test[:n]):
        if i in done:
            continue
        ids = fit(text)
        plain = ex.classify(np.asarray(ids))
        P = model.packing(keys.ctx.slots, len(ids), tokens)
        x, up = keys.encrypt(model, P, client_embedding(model.graph, client_tensors(model), ids))
        t1 = time.perf_counter()
        out = model.classify(keys.ev, x, on_layer=_layer_progress(progress, "minilm", keys.ev, t1))
        sec = time.perf_counter() - t1
        s, down = keys.slots(out)
        got = s[: out.d, 0]
        st = _stats(keys.ev)
        rows.append({"sentence": i, "tokens": len(ids), "seconds": round(sec, 2),
                     "fhe_prediction": int(np.argmax(got)), "plain_prediction": int(np.argmax(plain)),
                     "label": int(label), "max_logit_error": float(np.abs(got - plain).max()),
                     "bytes_up": up, "bytes_down": down, "bootstraps": st["counts"].get("bootstrap", 0),
                     "client_refreshes": st["refreshes"] if refresh == "client" else 0,
                     "counts": st["counts"], "seconds_by_kind": st["seconds"]})
        progress(f"minilm sentence {i}: {sec:.1f} s, {rows[-1]['bootstraps']} bootstraps, prediction "
                 f"{rows[-1]['fhe_prediction']} (plain {rows[-1]['plain_prediction']}), logit error "
                 f"{rows[-1]['max_logit_error']:.2e}")
        if rows_file is not None:
            rows.sort(key=lambda r: r["sentence"])
            tmp = Path(f"{rows_file}.tmp")
            tmp.write_text(json.dumps({**run, "rows": rows}, indent=1, default=float))
            tmp.replace(rows_file)
    keys.close()
    return {**run, "refresh_bytes": dict(keys.refresh_bytes), "keygen_seconds": keys.keygen_seconds,
            "key_bytes": keys.key_bytes, "calibration_seconds": setup, "rows": rows,
            "identical_predictions": sum(r["fhe_prediction"] == r["plain_prediction"] for r in rows),
            "max_logit_error": max((r["max_logit_error"] for r in rows), default=None),
            "peak_rss_bytes": _peak_rss_bytes()}


def bench_bert_base_layer(tokens: int, preset: str, insecure: bool, progress=print, refresh: str = "bootstrap") -> dict:
    import torch
    import transformers

    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model, client_embedding, client_tensors
    from cipherlm.runtime.plain import plain_executor

    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=1, max_position_embeddings=max(512, tokens))
    with tempfile.TemporaryDirectory() as d:
        transformers.BertModel(cfg).eval().save_pretrained(d)
        lm = load_model(d)
    rng = np.random.default_rng(0)
    calib = [rng.integers(1000, 20000, size=tokens) for _ in range(4)]
    model = calibrated_model(lm, calib)
    model.cache_plaintexts = preset.startswith("test-insecure")
    keys = _Keys(model, preset, tokens, insecure, refresh)
    progress(f"bert-base layer: keys in {keys.keygen_seconds:.1f} s")
    ids = rng.integers(1000, 20000, size=tokens)
    P = model.packing(keys.ctx.slots, tokens, tokens)
    x, up = keys.encrypt(model, P, client_embedding(model.graph, client_tensors(model), ids))
    t1 = time.perf_counter()
    out = model.run(keys.ev, x, on_layer=_layer_progress(progress, "bert-base layer", keys.ev, t1))["hidden"]
    sec = time.perf_counter() - t1
    s, down = keys.slots(out)
    got = P.unpack(s.reshape(-1, keys.ctx.slots), out.d)
    want = plain_executor(lm, dtype=np.float64).forward(ids)
    st = _stats(keys.ev)
    keys.close()
    return {"workload": "bert-base-layer", "tokens": tokens, "preset": preset, "refresh": refresh,
            "refresh_bytes": dict(keys.refresh_bytes), "seconds": sec,
            "max_abs_error": float(np.abs(got - want).max()), "bytes_up": up, "bytes_down": down,
            "keygen_seconds": keys.keygen_seconds, "key_bytes": keys.key_bytes,
            "bootstraps": st["counts"].get("bootstrap", 0), "counts": st["counts"],
            "seconds_by_kind": st["seconds"], "peak_rss_bytes": _peak_rss_bytes(), "published": PUBLISHED}


def bench_smollm_block(tokens: int, preset: str, insecure: bool, progress=print, refresh: str = "bootstrap") -> dict:
    """SmolLM2-135M's first decoder block (RMSNorm, attention with RoPE and GQA, SwiGLU FFN)
    and the final RMSNorm on ``tokens`` tokens of a real prompt, against the plain executor's
    values at the same point (the LM head left out)."""
    from cipherlm.models import load_model
    from cipherlm.models.data import polarity_split
    from cipherlm.models.loader import LoadedModel
    from cipherlm.runtime.fhe_executor import calibrated_model, client_embedding, client_tensors
    from cipherlm.runtime.plain import plain_executor
    from cipherlm.fhe.calibrate import _plain_pass

    lm = load_model("smollm2-135m")
    cfg = dict(lm.config, num_hidden_layers=1)
    weights = {k: v for k, v in lm.weights.items() if ".layers." not in k or ".layers.0." in k}
    lm1 = LoadedModel(name="smollm2-135m-block0", config=cfg, weights=weights, tokenizer=lm.tokenizer)
    _train, test = polarity_split()
    texts = [t for t, _ in test[:12]]
    idss = [(lm.tokenizer.encode(" ".join(texts[i:i + 3])).ids * 4)[:tokens] for i in range(0, 12, 3)]
    model = calibrated_model(lm1, idss[1:])
    model.cache_plaintexts = preset.startswith("test-insecure")
    head = next(n for n in model.graph.nodes if n.out == model.graph.outputs["logits"])
    model.graph.outputs["block"] = head.inputs[0]
    ex = plain_executor(lm1, dtype=np.float64)
    plain_head = next(n for n in ex.graph.nodes if n.out == ex.graph.outputs["logits"])
    keys = _Keys(model, preset, tokens, insecure, refresh)
    progress(f"smollm block: keys in {keys.keygen_seconds:.1f} s")
    ids = idss[0]
    P = model.packing(keys.ctx.slots, tokens, tokens)
    x, up = keys.encrypt(model, P, client_embedding(model.graph, client_tensors(model), ids))
    t1 = time.perf_counter()
    out = model.run(keys.ev, x, ("block",), on_layer=_layer_progress(progress, "smollm block", keys.ev, t1))["block"]
    sec = time.perf_counter() - t1
    s, down = keys.slots(out)
    got = P.unpack(s.reshape(-1, keys.ctx.slots), out.d)
    want = _plain_pass(ex, ids)[0][plain_head.inputs[0]]
    st = _stats(keys.ev)
    keys.close()
    err = np.abs(got - want)
    return {"workload": "smollm-block", "tokens": tokens, "preset": preset, "refresh": refresh,
            "refresh_bytes": dict(keys.refresh_bytes), "seconds": sec, "max_abs_error": float(err.max()),
            "mean_abs_error": float(err.mean()), "max_abs_value": float(np.abs(want).max()),
            "bytes_up": up, "bytes_down": down, "keygen_seconds": keys.keygen_seconds, "key_bytes": keys.key_bytes,
            "bootstraps": st["counts"].get("bootstrap", 0), "client_refreshes": st["refreshes"] if refresh == "client"
            else 0, "counts": st["counts"], "seconds_by_kind": st["seconds"], "peak_rss_bytes": _peak_rss_bytes()}


#: the text whose first tokens are ``smollm-generate``'s prompt
GENERATE_TEXT = "The capital of France is Paris, a city known for its museums and"


def bench_smollm_generate(prompt_tokens: int, new_tokens: int, preset: str, insecure: bool, progress=print,
                          refresh: str = "client", checkpoint=None, max_layers: int | None = None) -> dict:
    """SmolLM2-135M greedy generation in the fhe mode, resumable (`fhe_generate.generate`); the
    ranges are calibrated on polarity test sentences, not on the prompt."""
    from cipherlm.models import load_model
    from cipherlm.models.data import polarity_split

    from .fhe_generate import generate

    lm = load_model("smollm2-135m")
    ids = lm.tokenizer.encode(GENERATE_TEXT).ids[:prompt_tokens]
    if len(ids) < prompt_tokens:
        raise SystemExit(f"the generation text has only {len(ids)} tokens")
    n = prompt_tokens + new_tokens - 1
    _train, test = polarity_split()
    texts = [t for t, _ in test[:12]]
    cal = [(lm.tokenizer.encode(" ".join(texts[i:i + 3])).ids * 4)[:n] for i in range(0, 12, 3)]
    if checkpoint is None:
        checkpoint = tempfile.mkdtemp(prefix="cipherlm-fhe-generate-")
        progress(f"smollm generate: checkpoints in {checkpoint} (pass --checkpoint to resume a stopped run)")
    return generate(lm, ids, new_tokens, checkpoint, calibration=cal, preset=preset, insecure=insecure,
                    refresh=refresh, max_layers=max_layers, progress=progress)


def run_workloads(workloads: str, tokens: list[int], sentences: int, preset: str, insecure: bool,
                  progress=print, refresh: str = "bootstrap", rows_file=None, generate: dict | None = None) -> list[dict]:
    """Each workload at each token count, one result dict each (``rows_file``: MiniLM's rows,
    resumable, `bench_minilm`; one token count only).  ``generate``: ``smollm-generate``'s
    prompt_tokens, new_tokens, checkpoint and max_layers (it ignores ``tokens``)."""
    if rows_file is not None and len(tokens) > 1:
        raise SystemExit("--rows-file takes one token count")
    out = []
    for w in (w.strip() for w in workloads.split(",") if w.strip()):
        if w == "smollm-generate":
            out.append(bench_smollm_generate(progress=progress, preset=preset, insecure=insecure, refresh=refresh,
                                             **(generate or {"prompt_tokens": 7, "new_tokens": 2})))
            continue
        for t in tokens:
            if w == "minilm":
                out.append(bench_minilm(t, sentences, preset, insecure, progress=progress, refresh=refresh,
                                        rows_file=rows_file))
            elif w == "bert-base":
                out.append(bench_bert_base_layer(t, preset, insecure, progress=progress, refresh=refresh))
            elif w == "smollm-block":
                out.append(bench_smollm_block(t, preset, insecure, progress=progress, refresh=refresh))
            else:
                raise SystemExit(f"unknown fhe workload {w!r} (minilm, bert-base, smollm-block, smollm-generate)")
    return out


def run(args) -> list[dict]:
    """`cipherlm bench fhe` (see the module docstring; results go into the run report)."""
    if args.fhe_preset.startswith("test-insecure") and not args.insecure_test_preset:
        raise SystemExit(f"--fhe-preset {args.fhe_preset} is INSECURE: add --insecure-test-preset (tests only)")
    preset = "test-insecure-N1024" if args.insecure_test_preset else args.fhe_preset
    return run_workloads(args.workloads or "minilm", [args.tokens or 32], args.sentences, preset,
                         preset.startswith("test-insecure"),
                         progress=lambda m: print(f"bench fhe: {m}", file=sys.stderr, flush=True),
                         refresh=getattr(args, "refresh", "bootstrap"), rows_file=getattr(args, "rows_file", None),
                         generate={"prompt_tokens": args.prompt_tokens or 7, "new_tokens": args.max_new_tokens or 2,
                                   "checkpoint": getattr(args, "checkpoint", None),
                                   "max_layers": getattr(args, "max_layers", None)})


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="cipherlm bench fhe", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="minilm")
    p.add_argument("--tokens", default="32", help="comma-separated token counts")
    p.add_argument("--sentences", type=int, default=1, help="minilm: sentences per token count")
    p.add_argument("--preset", default="N16QP1546H192H32")
    p.add_argument("--insecure-test-preset", action="store_true",
                   help="run at the INSECURE N=2^10 test preset (checks the circuits quickly; no security)")
    p.add_argument("--refresh", choices=("bootstrap", "client"), default="bootstrap")
    p.add_argument("--rows-file", default=None, help="minilm: per-sentence rows, written as they finish; resumed")
    p.add_argument("--prompt-tokens", type=int, default=7, help="smollm-generate: prompt tokens (default 7)")
    p.add_argument("--max-new-tokens", type=int, default=2, help="smollm-generate: new tokens (default 2)")
    p.add_argument("--checkpoint", default=None, help="smollm-generate: the run's directory (resumed when it exists)")
    p.add_argument("--max-layers", type=int, default=None, help="smollm-generate: stop after this many layers")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    preset = "test-insecure-N1024" if a.insecure_test_preset else a.preset
    out = run_workloads(a.workloads, [int(v) for v in a.tokens.split(",")], a.sentences, preset,
                        a.insecure_test_preset, progress=lambda m: print(m, file=sys.stderr, flush=True),
                        refresh=a.refresh, rows_file=a.rows_file,
                        generate={"prompt_tokens": a.prompt_tokens, "new_tokens": a.max_new_tokens,
                                  "checkpoint": a.checkpoint, "max_layers": a.max_layers})
    text = json.dumps(out, indent=1, default=float)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

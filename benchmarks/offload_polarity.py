#!/usr/bin/env python3
"""MiniLM polarity classification in offload mode against the plaintext executor.

    .venv/bin/python benchmarks/offload_polarity.py [--every K] [--json FILE]

Runs the plaintext executor on all 200 polarity sentences (the linear probe
head trained on plaintext embeddings of the training split), then a server and
a client (two processes on loopback) on every K-th sentence (K=1: all 200;
about 0.9 s of server time per token on this 2-core machine, so all 200 take
over an hour here). Reports the agreement of predictions, the largest logit
error, and the smallest plaintext decision margin over all 200 sentences: with
the error far below that margin, the sentences not run under HE cannot flip
either (an argument, not a measurement; K=1 measures all of them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=10, help="run every K-th sentence under HE (1 = all 200)")
    ap.add_argument("--json", type=Path, default=ROOT / "reports" / "offload_polarity.json")
    args = ap.parse_args()

    from cipherlm.commands import classify_texts, start_server_process, stop_process
    from cipherlm.models import load_model
    from cipherlm.models.data import load_polarity
    from cipherlm.runtime.offload_client import OffloadClient
    from cipherlm.runtime.plain import polarity_classifier

    pairs = load_polarity()
    texts = [t for t, _ in pairs]
    ex, tok, probe = polarity_classifier(load_model("minilm-l6"))
    t0 = time.perf_counter()
    plain = classify_texts(ex, tok, texts, "plaintext, all 200")
    plain_s = time.perf_counter() - t0
    margins = np.abs(plain[:, 1] - plain[:, 0])
    idx = list(range(0, len(texts), args.every))
    proc, addr = start_server_process("minilm-l6")
    try:
        t0 = time.perf_counter()
        with OffloadClient(*addr, model="minilm-l6") as client:
            got = classify_texts(client.executor(), client.tokenizer, [texts[i] for i in idx], "offload (CKKS)")
            totals = client.chan.totals()
            stats = client.server_stats()
        offload_s = time.perf_counter() - t0
    finally:
        stop_process(proc)
    ref = plain[idx]
    same = np.argmax(got, -1) == np.argmax(ref, -1)
    err = float(np.max(np.abs(got - ref)))
    n_tokens = sum(len(tok.encode(texts[i]).ids) for i in idx)
    result = {
        "sentences_total": len(texts),
        "sentences_under_he": len(idx),
        "every": args.every,
        "identical_predictions": int(same.sum()),
        "agreement": float(same.mean()),
        "max_abs_logit_error": err,
        "min_plaintext_margin_all_200": float(margins.min()),
        "min_plaintext_margin_subset": float(margins[idx].min()),
        "plaintext_accuracy_vs_labels": float(np.mean(np.argmax(plain, -1) == np.array([y for _, y in pairs]))),
        "tokens_under_he": n_tokens,
        "offload_seconds": offload_s,
        "offload_seconds_per_token": offload_s / n_tokens,
        "server_seconds": sum(stats.get("seconds", {}).values()),
        "bytes_up": totals["bytes_sent"],
        "bytes_down": totals["bytes_received"],
        "plaintext_seconds_all_200": plain_s,
        "command": " ".join(sys.argv),
    }
    print(json.dumps(result, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

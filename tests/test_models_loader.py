"""Loader: HF directories (sharded, bf16, legacy MoE layouts), GGUF helpers, registry."""

import json

import numpy as np
import pytest

from _hf_oracle import build_hf, torch_setup
from cipherlm.models import UnknownModelError, list_models, load_model, normalize_weights, resolve
from cipherlm.models.gguf_convert import unpermute_rope
from cipherlm.models.safetensors_io import read_safetensors

torch = torch_setup()
import transformers as T  # noqa: E402


def test_sharded_hf_dir_round_trip(tmp_path):
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    model, w = build_hf(cfg, T.LlamaForCausalLM)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    lm = load_model(str(tmp_path))
    assert lm.config["model_type"] == "llama" and lm.tokenizer is None
    assert set(lm.weights) == set(w)
    for k in w:
        np.testing.assert_array_equal(lm.weights[k], w[k])


def test_bf16_safetensors(tmp_path):
    from safetensors.torch import save_file

    t = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"a": t, "pos": torch.arange(4)}, str(tmp_path / "x.safetensors"))
    got = read_safetensors(tmp_path / "x.safetensors")
    assert set(got) == {"a"} and got["a"].dtype == np.float32
    np.testing.assert_array_equal(got["a"], t.float().numpy())


def test_legacy_mixtral_experts_are_fused():
    cfg = T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=3)
    _, w = build_hf(cfg, T.MixtralForCausalLM)
    gu, down = w["model.layers.0.mlp.experts.gate_up_proj"], w["model.layers.0.mlp.experts.down_proj"]
    legacy = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in w.items() if ".experts." not in k}
    for e in range(3):
        p = f"model.layers.0.block_sparse_moe.experts.{e}"
        legacy[f"{p}.w1.weight"], legacy[f"{p}.w3.weight"] = gu[e, :16], gu[e, 16:]
        legacy[f"{p}.w2.weight"] = down[e]
    got = normalize_weights(cfg.to_dict(), legacy)
    assert set(got) == set(w)
    np.testing.assert_array_equal(got["model.layers.0.mlp.experts.gate_up_proj"], gu)
    np.testing.assert_array_equal(got["model.layers.0.mlp.experts.down_proj"], down)


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    np.testing.assert_array_equal(unpermute_rope(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_registry_and_errors(tmp_path):
    rows = list_models()
    names = [r["name"] for r in rows]
    assert names[:2] == ["smollm2-135m", "minilm-l6"]
    for r in rows:
        assert {"name", "family", "params", "available", "path"} <= set(r)
        assert isinstance(r["params"], int)
    with pytest.raises(UnknownModelError, match="smollm2-135m") as e:
        load_model("no-such-model")
    assert isinstance(e.value, ValueError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError):
        resolve(tmp_path / "empty")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve(tmp_path / "m") == ("m", tmp_path / "m")

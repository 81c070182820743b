"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, d = 64, vocab 96) saved as a Hugging Face directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)

"""Convert a llama.cpp GGUF file (Llama architecture) into a float32 Hugging Face directory.

The quantised tensors are dequantised with `gguf.quants.dequantize`, renamed to the
Hugging Face Llama names, and the q/k projections are un-permuted: llama.cpp's
converter reorders the rows of q_proj/k_proj within each head from the
"rotate_half" layout (first half, second half) to interleaved pairs; we undo it so
the weights match transformers' LlamaForCausalLM. The tokenizer is rebuilt from the
GGUF's `tokenizer.ggml.*` metadata as a byte-level BPE `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _progress(msg: str) -> None:
    print(f"[cipherlm] {msg}", file=sys.stderr, flush=True)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face parameter name of a GGUF tensor name (None if unknown)."""
    if gguf_name in _TOP_MAP:
        return _TOP_MAP[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_MAP:
            return f"model.layers.{idx}.{_LAYER_MAP[rest]}"
    return None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on q/k projection rows."""
    d_out = w.shape[0]
    return (
        w.reshape(n_head, d_out // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_config(reader) -> dict:
    """HF LlamaConfig dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = "llama."
    n_head = int(_field(reader, p + "attention.head_count"))
    d = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(_field(reader, p + "rope.dimension_count", d // n_head))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": d,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": float(np.float32(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    # round the float32 epsilon back to its decimal value (9.9999997e-06 -> 1e-05)
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    return cfg


def gguf_tokenizer(reader):
    """Byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = _field(reader, "tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "qwen2", "llama-bpe", "deepseek-llm"):
        # these pre-tokenizers split digits one by one before the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if int(ty) in (3, 4)  # CONTROL, USER_DEFINED
    ]
    tok.add_special_tokens(special)
    return tok


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantise `gguf_path` to float32 and write config.json, model.safetensors and
    tokenizer.json (+ tokenizer_config.json with the chat template) into `out_dir`.
    Written to a temporary directory first, then renamed, so a partial conversion
    never looks complete."""
    import gguf
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    t0 = time.time()
    _progress(f"converting {Path(gguf_path).name} to float32 (once) -> {out_dir}")
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = gguf_config(reader)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    weights: dict[str, np.ndarray] = {}
    n = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = hf_name(t.name)
        if name is None:
            _progress(f"  skipping unknown tensor {t.name}")
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        arr = arr.reshape(shape)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            arr = unpermute_rope(arr, n_head)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            arr = unpermute_rope(arr, n_kv)
        weights[name] = np.ascontiguousarray(arr, dtype=np.float32)
        if (i + 1) % 25 == 0 or i + 1 == n:
            _progress(f"  dequantised {i + 1}/{n} tensors")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _progress("  writing model.safetensors")
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    tok = gguf_tokenizer(reader)
    tok.save(str(tmp / "tokenizer.json"))
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def _tok(key):
        idx = _field(reader, key)
        return tokens[idx] if idx is not None else None

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _tok("tokenizer.ggml.bos_token_id"),
        "eos_token": _tok("tokenizer.ggml.eos_token_id"),
        "unk_token": _tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": _tok("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": cfg["max_position_embeddings"],
    }
    with open(tmp / "tokenizer_config.json", "w") as f:
        json.dump(tcfg, f, indent=2)
    with open(tmp / "gguf_source.json", "w") as f:
        st = os.stat(gguf_path)
        json.dump({"path": str(gguf_path), "size": st.st_size, "mtime": st.st_mtime}, f)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    _progress(f"  done in {time.time() - t0:.1f} s")
    return out_dir

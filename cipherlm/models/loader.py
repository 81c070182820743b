"""Load models into numpy: Hugging Face directories (sharded safetensors too) and GGUF.

Weights come back as float32 arrays under the exact parameter names of the installed
transformers' `state_dict()` for the model's *ForCausalLM / BertModel class:
- BERT: no `bert.` prefix (BertModel);
- GPT-2: `transformer.` prefix, `lm_head.weight` tied to `transformer.wte.weight`;
- MoE (Qwen2-MoE, OLMoE, Mixtral): per layer `mlp.gate.weight` (router) and fused
  experts `mlp.experts.gate_up_proj` (E, 2*I, d) and `mlp.experts.down_proj`
  (E, d, I); per-expert checkpoints (`experts.{e}.gate_proj` or Mixtral's
  `block_sparse_moe.experts.{e}.w1/w2/w3`) are fused on load;
- tied embeddings: `lm_head.weight` is the same array as the embedding.
A GGUF file is converted once to a float32 HF directory in the cache.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .cache import cache_dir
from .registry import resolve
from .safetensors_io import read_safetensors

MOE_TYPES = ("qwen2_moe", "olmoe", "mixtral")


@dataclass
class LoadedModel:
    name: str
    config: dict
    weights: dict[str, np.ndarray] = field(repr=False)
    tokenizer: object | None = field(default=None, repr=False)  # tokenizers.Tokenizer
    path: Path | None = None

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def n_params(self) -> int:
        seen, total = set(), 0
        for w in self.weights.values():
            if id(w) not in seen:
                seen.add(id(w))
                total += w.size
        return total


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache directory of the float32 conversion of a GGUF file (converting on first use)."""
    from .gguf_convert import convert_gguf

    gguf_path = Path(gguf_path).resolve()
    out = cache_dir() / "models" / (gguf_path.stem + "-f32")
    src = out / "gguf_source.json"
    if src.exists() and (out / "model.safetensors").exists():
        try:
            meta = json.loads(src.read_text())
            if meta.get("size") == gguf_path.stat().st_size:
                return out
        except (OSError, ValueError):
            pass
    return convert_gguf(gguf_path, out)


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        return [d / f for f in sorted(set(wm.values()))]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    return files


def normalize_weights(config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename/fuse checkpoint tensors to the installed transformers' state_dict names."""
    mt = config.get("model_type", "")
    w = dict(weights)
    if mt == "bert":
        w = {(k[5:] if k.startswith("bert.") else k): v for k, v in w.items()}
        w = {k: v for k, v in w.items() if not k.startswith(("cls.", "classifier."))}
    elif mt == "gpt2":
        w = {
            (k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
            for k, v in w.items()
        }
        w = {k: v for k, v in w.items() if not re.search(r"\.attn\.(masked_)?bias$", k)}
        if "lm_head.weight" not in w or config.get("tie_word_embeddings", True):
            w["lm_head.weight"] = w["transformer.wte.weight"]
    elif mt in MOE_TYPES or "model.embed_tokens.weight" in w:
        if mt in MOE_TYPES:
            w = _fuse_experts(w)
        tie = config.get("tie_word_embeddings", False)
        if "lm_head.weight" not in w or tie:
            w["lm_head.weight"] = w["model.embed_tokens.weight"]
    return w


_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_ROLE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _fuse_experts(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    per: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for k, v in w.items():
        m = _EXPERT_RE.match(k)
        if m:
            layer, e, role = m.group(1), int(m.group(2)), m.group(3)
            per.setdefault(layer, {}).setdefault(e, {})[_ROLE.get(role, role)] = v
            continue
        out[k.replace(".block_sparse_moe.", ".mlp.")] = v
    for layer, experts in per.items():
        n = max(experts) + 1
        out[f"{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([experts[e]["gate_proj"], experts[e]["up_proj"]], axis=0) for e in range(n)]
        )
        out[f"{layer}.mlp.experts.down_proj"] = np.stack([experts[e]["down_proj"] for e in range(n)])
    return out


def load_hf_dir(path: str | os.PathLike, name: str | None = None) -> LoadedModel:
    """Load config.json, *.safetensors (sharded or not) and tokenizer.json of an HF directory."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights: dict[str, np.ndarray] = {}
    for f in _safetensors_files(path):
        weights.update(read_safetensors(f))
    weights = normalize_weights(config, weights)
    tokenizer = None
    tj = path / "tokenizer.json"
    if tj.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tj))
        if config.get("model_type") == "bert":
            # sentence encoders ship with fixed-length padding; callers pad per batch
            tokenizer.no_padding()
    return LoadedModel(name or path.name, config, weights, tokenizer, path)


def load_model(name_or_path: str | os.PathLike) -> LoadedModel:
    """Load a registered model (`smollm2-135m`, `minilm-l6`) or an HF dir / .gguf path."""
    name, path = resolve(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        path = converted_gguf_dir(path)
    return load_hf_dir(path, name)

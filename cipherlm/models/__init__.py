"""Model loading (HF safetensors directories, GGUF), the model registry, data sets and probes;
`upcycle`: the sparse-upcycled MoE fixture's construction (not imported here)."""

from .cache import cache_dir
from .loader import LoadedModel, converted_gguf_dir, load_hf_dir, load_model, normalize_weights
from .registry import DEFAULT_MODEL, MODELS, UnknownModelError, list_models, resolve

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "LoadedModel",
    "UnknownModelError",
    "cache_dir",
    "converted_gguf_dir",
    "list_models",
    "load_hf_dir",
    "load_model",
    "normalize_weights",
    "resolve",
]

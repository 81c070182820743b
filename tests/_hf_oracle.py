"""Helpers: build small random-weight Hugging Face models and compare with ours."""

from __future__ import annotations

import numpy as np


def torch_setup():
    import torch

    torch.set_num_threads(1)
    return torch


def build_hf(cfg, cls, seed: int = 0):
    torch = torch_setup()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    weights = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    return model, weights


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))

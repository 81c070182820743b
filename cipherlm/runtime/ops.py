"""Plaintext nonlinear operators (numpy, float64): the reference every private
protocol for a nonlinear function is checked against."""

from __future__ import annotations

import numpy as np

_SQRT2 = np.sqrt(2.0)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    mu = np.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    y = xc / np.sqrt(var + eps) * w
    return y + b if b is not None else y


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def erf(x: np.ndarray) -> np.ndarray:
    """erf to ~1e-15 relative: Taylor series near 0, continued-fraction erfc beyond."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    ax = np.abs(x)
    small = ax < 2.5
    xs = x[small]
    # Maclaurin series: erf(x) = 2/sqrt(pi) * sum (-1)^n x^(2n+1) / (n! (2n+1))
    term = xs.copy()
    acc = xs.copy()
    x2 = xs * xs
    for n in range(1, 60):
        term = term * (-x2) / n
        acc = acc + term / (2 * n + 1)
    out[small] = acc * (2.0 / np.sqrt(np.pi))
    xl = ax[~small]
    # erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + 2/(x + ...)))))
    frac = xl.copy()
    for k in range(60, 0, -1):
        frac = xl + (k / 2.0) / frac
    erfc = np.exp(-xl * xl) / np.sqrt(np.pi) / frac
    out[~small] = np.sign(x[~small]) * (1.0 - erfc)
    return out


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, as torch's default and BERT's "gelu"."""
    return 0.5 * x * (1.0 + erf(x / _SQRT2))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """tanh-approximated GELU (GPT-2's "gelu_new", "gelu_pytorch_tanh")."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu": gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "relu": relu,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


def rope_inv_freq(head_dim: int, theta: float, rotary_dim: int | None = None) -> np.ndarray:
    rd = rotary_dim or head_dim
    return 1.0 / (theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotary embedding in the rotate_half convention. x: (H, T, hd)."""
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (T, hd/2)
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin

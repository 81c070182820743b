"""A linear probe on sentence embeddings: the classifier head of the encoder demo.

Binary logistic regression with L2 regularisation, fitted by Newton's method
(deterministic: zero start, fixed iterations), exported as a 2-class linear layer
named "classifier" (logits [-z/2, z/2] with z = w.x + b, so softmax gives
P(pos) = sigmoid(z)). The embedding function is passed in (the models layer does
not import the runtime); `get_polarity_probe` caches the fitted probe in the user
cache dir.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .cache import cache_dir
from .data import LABELS, polarity_split

PROBE_VERSION = 1


@dataclass
class LinearProbe:
    weight: np.ndarray  # (n_classes, d) float32
    bias: np.ndarray  # (n_classes,) float32
    labels: tuple[str, ...] = LABELS
    meta: dict = field(default_factory=dict)

    def logits(self, x: np.ndarray) -> np.ndarray:
        return np.atleast_2d(x) @ self.weight.T.astype(np.float64) + self.bias

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(x), axis=-1)

    def accuracy(self, x: np.ndarray, y: Sequence[int]) -> float:
        return float(np.mean(self.predict(x) == np.asarray(y)))

    def as_linear(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{"classifier": (W, b)}, ready to add to server_linears."""
        return {"classifier": (self.weight, self.bias)}

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"classifier.weight": self.weight, "classifier.bias": self.bias}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, weight=self.weight, bias=self.bias,
                 labels=np.array(self.labels), meta=np.array(json.dumps(self.meta)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "LinearProbe":
        with np.load(path, allow_pickle=False) as z:
            return cls(z["weight"], z["bias"], tuple(str(s) for s in z["labels"]), json.loads(str(z["meta"])))


def train_probe(x: np.ndarray, y: Sequence[int], l2: float = 1e-2, iters: int = 30) -> LinearProbe:
    """Fit binary logistic regression (labels 0/1) by Newton's method."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, d = x.shape
    xa = np.concatenate([x, np.ones((n, 1))], axis=1)
    reg = np.full(d + 1, l2 * n)
    reg[-1] = 0.0  # no penalty on the bias
    theta = np.zeros(d + 1)
    for _ in range(iters):
        z = xa @ theta
        p = 0.5 * (1 + np.tanh(0.5 * z))
        grad = xa.T @ (p - y) + reg * theta
        hess = (xa * (p * (1 - p))[:, None]).T @ xa + np.diag(reg) + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    w, b = theta[:d], theta[d]
    weight = np.stack([-w / 2, w / 2]).astype(np.float32)
    bias = np.array([-b / 2, b / 2], dtype=np.float32)
    return LinearProbe(weight, bias)


def polarity_probe_path(model_name: str = "minilm-l6") -> Path:
    return cache_dir() / "probes" / f"{model_name}-polarity-v{PROBE_VERSION}.npz"


def get_polarity_probe(embed_fn: Callable[[list[str]], np.ndarray], model_name: str = "minilm-l6",
                       retrain: bool = False) -> LinearProbe:
    """The sentiment probe for `model_name`: loaded from the cache, or fitted on the
    embeddings `embed_fn(texts)` of the polarity training split and saved."""
    path = polarity_probe_path(model_name)
    if path.exists() and not retrain:
        return LinearProbe.load(path)
    train, test = polarity_split()
    xtr = embed_fn([t for t, _ in train])
    probe = train_probe(xtr, [y for _, y in train])
    xte = embed_fn([t for t, _ in test])
    probe.meta = {
        "model": model_name,
        "data": "pang_lee_polarity (gensim 4.4.0)",
        "n_train": len(train),
        "n_test": len(test),
        "train_accuracy": probe.accuracy(xtr, [y for _, y in train]),
        "test_accuracy": probe.accuracy(xte, [y for _, y in test]),
    }
    probe.save(path)
    return probe

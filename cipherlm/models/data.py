"""Evaluation data read from files shipped in PyPI wheels (never imported).

`load_polarity()`: the 200 Rotten Tomatoes sentences (100 positive, 100 negative,
Pang & Lee) in the gensim 4.4.0 wheel, `gensim/test/test_data/pang_lee_polarity.cor`
(latin-1, one `__label__pos|__label__neg sentence` per line).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .registry import package_dir

POLARITY_RELPATH = "test/test_data/pang_lee_polarity.cor"
LABELS = ("neg", "pos")  # label index 0 = negative, 1 = positive


def polarity_path() -> Path:
    d = package_dir("gensim")
    p = d / POLARITY_RELPATH if d is not None else None
    if p is None or not p.exists():
        raise FileNotFoundError(
            "pang_lee_polarity.cor not found: install the data wheel with "
            "`.venv/bin/uv pip install --python .venv/bin/python --no-deps gensim==4.4.0`"
        )
    return p


def load_polarity() -> list[tuple[str, int]]:
    """200 (sentence, label) pairs in file order; label 1 = positive, 0 = negative."""
    out = []
    with open(polarity_path(), encoding="latin-1") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            tag, _, text = line.partition(" ")
            if tag not in ("__label__pos", "__label__neg"):
                raise ValueError(f"unexpected label {tag!r} in polarity data")
            out.append((text.strip(), 1 if tag == "__label__pos" else 0))
    return out


def polarity_split(test_fraction: float = 0.3):
    """Deterministic stratified split (train, test) of `load_polarity()`.

    Within each class the sentences are ordered by the SHA-256 of their text and the
    first `test_fraction` go to the test set, so the split never depends on a RNG or
    library version. Both lists keep file order."""
    data = load_polarity()
    test_idx = set()
    for label in (0, 1):
        idx = [i for i, (_, y) in enumerate(data) if y == label]
        idx.sort(key=lambda i: hashlib.sha256(data[i][0].encode("utf-8")).hexdigest())
        test_idx.update(idx[: round(len(idx) * test_fraction)])
    train = [d for i, d in enumerate(data) if i not in test_idx]
    test = [d for i, d in enumerate(data) if i in test_idx]
    return train, test

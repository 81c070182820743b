"""Polarity data, deterministic split and the logistic-regression probe."""

import numpy as np

from cipherlm.models.data import load_polarity, polarity_split
from cipherlm.models.probe import LinearProbe, train_probe


def test_polarity_data_and_split():
    data = load_polarity()
    assert len(data) == 200 and sum(y for _, y in data) == 100
    assert data[0] == ("simplistic , silly and tedious .", 0)
    train, test = polarity_split()
    assert (len(train), len(test)) == (140, 60)
    assert sum(y for _, y in test) == 30
    assert not set(train) & set(test)
    assert polarity_split() == (train, test)


def test_probe_fits_separable_data_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 10))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(int)
    p = train_probe(x, y, l2=1e-3)
    assert p.accuracy(x, y) > 0.95
    assert p.weight.shape == (2, 10) and p.bias.shape == (2,)
    z = p.logits(x)
    assert np.allclose(z[:, 0], -z[:, 1], atol=1e-5)
    p2 = train_probe(x, y, l2=1e-3)
    assert np.array_equal(p.weight, p2.weight)
    p.meta = {"a": 1}
    p.save(tmp_path / "p.npz")
    q = LinearProbe.load(tmp_path / "p.npz")
    assert np.array_equal(q.weight, p.weight) and q.meta == {"a": 1} and q.labels == ("neg", "pos")
    assert set(q.as_linear()) == {"classifier"}

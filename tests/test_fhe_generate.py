"""Resumable greedy generation in the fhe mode (cipherlm/bench/fhe_generate.py) on a tiny
random Llama at the INSECURE N = 2^10 test preset: a run stopped after one layer and resumed
in a second call gives the plain executor's greedy tokens; another run's directory is refused;
the client's secret is stored for the client only."""

from __future__ import annotations

import json
import stat

import numpy as np
import pytest

from cipherlm.he.errors import HEError
from cipherlm.he.lattigo_backend import available

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")


def test_ternary_secret_has_the_presets_hamming_weight():
    from cipherlm.bench.fhe_generate import ternary_secret

    s = ternary_secret(1024, 192)
    assert s.shape == (1024,) and int(np.count_nonzero(s)) == 192 and set(np.unique(s)) <= {-1, 0, 1}
    assert (s == 1).sum() > 40 and (s == -1).sum() > 40  # both signs (P(fail) < 1e-20)
    assert not np.array_equal(s, ternary_secret(1024, 192))  # fresh randomness each time
    u = ternary_secret(3000, None)
    assert all(800 < (u == v).sum() < 1200 for v in (-1, 0, 1))


def test_generation_resumes_after_a_layer(tmp_path, tiny_llama_dir):
    from cipherlm.bench.fhe_generate import generate
    from cipherlm.models import load_model

    lm = load_model(tiny_llama_dir)
    rng = np.random.default_rng(5)
    cal = [list(rng.integers(0, 96, size=8)) for _ in range(4)]
    ids = [int(t) for t in rng.integers(0, 96, size=4)]
    kw = dict(calibration=cal, preset="test-insecure-N1024", insecure=True, refresh="client", progress=lambda m: None)
    ck = tmp_path / "run"
    first = generate(lm, ids, 2, ck, max_layers=1, **kw)
    assert not first["complete"] and first["tokens"] == [] and len(first["layers"]) == 1
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["layers_done"] == {"0": 1}
    assert stat.S_IMODE((ck / "secret.npy").stat().st_mode) == 0o600
    assert (ck / "p0_h0.ct").exists() and (ck / "p0_k0.ct").exists()
    out = generate(lm, ids, 2, ck, **kw)  # a fresh call: the keys are made again from the stored secret
    assert out["complete"] and [r["layer"] for r in out["layers"]] == [0, 1, 0, 1]
    assert out["tokens"] == out["plain_tokens"] and out["identical"]
    assert all(p["max_abs_logit_error"] < 5e-3 for p in out["passes"])
    assert not (ck / "p0_h0.ct").exists() and not (ck / "p0_k1.ct").exists()  # superseded files removed
    assert generate(lm, ids, 2, ck, **kw)["tokens"] == out["tokens"]  # nothing left to run
    with pytest.raises(HEError, match="another run"):
        generate(lm, ids[:3], 2, ck, **kw)

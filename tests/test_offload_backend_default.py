"""The offload HE backend by default: ``auto`` (issue 15).

`cipherlm serve --mode offload` (and `cipherlm demo` / `cipherlm bench offload`, which start
one) picks Lattigo where its library is built and loads, else SEAL with one log line saying
why; ``--he-backend seal|lattigo`` (or ``$CIPHERLM_OFFLOAD_HE_BACKEND``) forces one, and
Lattigo without its library is a clear error naming ``make lattigo``.  ``cipherlm inspect
--mode offload`` predicts for the same backend (`predict.offload_backend`).  The model load
and the accept loop are stubbed: nothing here encodes weights or runs HE.
"""

from __future__ import annotations

import json
import logging

import pytest

from cipherlm.he import HEError
from cipherlm.he.matmul import OffloadBackendUnavailable, resolve_offload_backend
from cipherlm.runtime import predict as P

LLAMA = dict(model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0,
             tie_word_embeddings=False)

NOT_BUILT = "the Lattigo backend library /x/libclattigo.so is not built; build it with `make lattigo`"


def _lattigo_built() -> bool:
    from cipherlm.he import lattigo_backend

    return lattigo_backend.available()


@pytest.fixture
def no_lattigo(monkeypatch):
    """This machine as one without the Lattigo library (no Go)."""
    from cipherlm.he import lattigo_backend

    monkeypatch.setattr(lattigo_backend, "unavailable_reason", lambda: NOT_BUILT)
    monkeypatch.setattr(lattigo_backend, "available", lambda: False)


def test_resolve_auto_is_lattigo_where_built():
    backend, why = resolve_offload_backend("auto")
    assert backend == ("lattigo" if _lattigo_built() else "seal"), why
    assert resolve_offload_backend(None)[0] == backend
    assert resolve_offload_backend("seal") == ("seal", "asked for")
    if _lattigo_built():
        assert resolve_offload_backend("lattigo") == ("lattigo", "asked for")
    with pytest.raises(HEError, match="unknown offload HE backend"):
        resolve_offload_backend("tfhe")


def test_resolve_without_the_library(no_lattigo, monkeypatch):
    backend, why = resolve_offload_backend("auto")
    assert backend == "seal" and "not built" in why and "make lattigo" in why
    with pytest.raises(OffloadBackendUnavailable, match="make lattigo"):
        resolve_offload_backend("lattigo")
    assert resolve_offload_backend("seal")[0] == "seal"
    # a reason that does not name the build (an old library, a failed load) gets the hint added
    from cipherlm.he import lattigo_backend

    monkeypatch.setattr(lattigo_backend, "unavailable_reason", lambda: "libclattigo.so: ABI version 6 != 7; rebuild it")
    assert "make lattigo" in resolve_offload_backend("auto")[1]


def _serve_cli(monkeypatch, argv):
    """`cipherlm serve --mode offload ...` with the model load and the accept loop stubbed:
    (exit code, the backend the model host was built with or None)."""
    from cipherlm import cli
    from cipherlm.runtime import offload_server

    made = {}

    class FakeModelHost:
        name, startup_seconds = "fake", 0.0

        def __init__(self, *a, he_backend="seal", workers=None, **kw):
            made["he_backend"], made["workers"] = he_backend, workers
            self.fork_safe = he_backend == "seal"
            self.engine = type("E", (), {"close": lambda self: None})()

    monkeypatch.setattr(offload_server, "ModelHost", FakeModelHost)
    monkeypatch.setattr(offload_server.OffloadServer, "serve_forever", lambda self: None)
    rc = cli.main(["serve", "--mode", "offload", "--port", "0", "--model", "fake", "--session-processes", "1", *argv])
    _serve_cli.workers = made.get("workers")
    return rc, made.get("he_backend")


def test_serve_defaults_to_auto(monkeypatch, caplog):
    monkeypatch.delenv("CIPHERLM_OFFLOAD_HE_BACKEND", raising=False)
    assert __import__("cipherlm.cli").cli.build_parser().parse_args(["serve"]).he_backend is None
    with caplog.at_level(logging.INFO, logger="cipherlm.serve"):
        rc, backend = _serve_cli(monkeypatch, [])
    assert rc == 0 and backend == ("lattigo" if _lattigo_built() else "seal")
    assert any(f"HE backend {backend}" in r.getMessage() for r in caplog.records)
    # asked for by name, or through the environment (how a bench / demo server is put on one)
    assert _serve_cli(monkeypatch, ["--he-backend", "seal"]) == (0, "seal")
    monkeypatch.setenv("CIPHERLM_OFFLOAD_HE_BACKEND", "seal")
    assert _serve_cli(monkeypatch, []) == (0, "seal")
    if _lattigo_built():
        assert _serve_cli(monkeypatch, ["--he-backend", "lattigo"]) == (0, "lattigo")
        assert _serve_cli(monkeypatch, ["--he-backend", "auto"]) == (0, "lattigo")


def test_serve_workers_default_per_backend(monkeypatch, capsys):
    """Without ``--workers``: one goroutine per core on Lattigo (the client is idle while the
    server computes), 1 on SEAL (its workers are processes holding the encoded weights); an
    explicit W is passed through; W < 1 is a user error before anything is loaded."""
    import os

    from cipherlm.runtime.offload_server import default_workers

    monkeypatch.delenv("CIPHERLM_OFFLOAD_HE_BACKEND", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert default_workers("lattigo") == cores and default_workers("seal") == 1
    assert _serve_cli(monkeypatch, ["--he-backend", "seal"]) == (0, "seal") and _serve_cli.workers == 1
    assert _serve_cli(monkeypatch, ["--he-backend", "seal", "--workers", "3"]) == (0, "seal")
    assert _serve_cli.workers == 3
    if _lattigo_built():
        assert _serve_cli(monkeypatch, ["--he-backend", "lattigo"]) == (0, "lattigo") and _serve_cli.workers == cores
    capsys.readouterr()
    assert _serve_cli(monkeypatch, ["--workers", "0"]) == (2, None)
    err = capsys.readouterr().err
    assert "--workers must be at least 1" in err and "Traceback" not in err, err


def test_serve_without_the_library_falls_back_with_one_log_line(no_lattigo, monkeypatch, caplog, capsys):
    monkeypatch.delenv("CIPHERLM_OFFLOAD_HE_BACKEND", raising=False)
    with caplog.at_level(logging.INFO, logger="cipherlm.serve"):
        rc, backend = _serve_cli(monkeypatch, [])
    assert rc == 0 and backend == "seal"
    why = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(why) == 1 and "SEAL" in why[0].getMessage() and "make lattigo" in why[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cipherlm.serve"):
        assert _serve_cli(monkeypatch, ["--he-backend", "seal"]) == (0, "seal")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # asked for: nothing to explain
    # lattigo forced without the library: a clear error before any model is loaded
    rc, backend = _serve_cli(monkeypatch, ["--he-backend", "lattigo"])
    err = capsys.readouterr().err
    assert rc == 2 and backend is None and "make lattigo" in err and "Traceback" not in err, err


def test_serve_lattigo_refuses_session_processes(monkeypatch, capsys):
    if not _lattigo_built():
        pytest.skip("the Lattigo library is not built")
    from cipherlm import cli
    from cipherlm.runtime import offload_server

    monkeypatch.delenv("CIPHERLM_OFFLOAD_HE_BACKEND", raising=False)
    monkeypatch.setattr(offload_server, "ModelHost", lambda *a, **kw: pytest.fail("the model was loaded"))
    rc = cli.main(["serve", "--mode", "offload", "--port", "0", "--model", "fake", "--session-processes", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--he-backend seal" in err, err


def test_predict_and_inspect_follow_the_backend(no_lattigo, tmp_path, capsys):
    """Without the library, auto predicts SEAL; named, each backend its own bytes."""
    from cipherlm import cli

    seal = P.predict(LLAMA, "offload", 4, phase="decode", he_backend="seal")
    lattigo = P.predict(LLAMA, "offload", 4, phase="decode", he_backend="lattigo")  # nothing runs: no library needed
    assert P.predict(LLAMA, "offload", 4, phase="decode") == seal
    # each backend's input ciphertext size: Lattigo's seeded inputs bit-packed at the primes'
    # lengths (102,452 B), SEAL's zstd-compressed (~116 kB); the results are the same size class
    assert P.CT_BYTES["lattigo"][1] < P.CT_BYTES["seal"][1]
    assert P.total(lattigo)["bytes"] < P.total(seal)["bytes"]
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    for flag, want in (([], "seal"), (["--he-backend", "lattigo"], "lattigo"), (["--he-backend", "seal"], "seal")):
        out = tmp_path / f"pred-{want}-{len(flag)}.json"
        assert cli.main(["inspect", str(tmp_path), "--mode", "offload", "--tokens", "4", "--json", str(out), *flag]) == 0
        text = capsys.readouterr().out
        doc = json.loads(out.read_text())
        assert doc["he_backend"] == want and f"HE backend {want}" in text
        assert doc["decode"] == {"seal": seal, "lattigo": lattigo}[want]

"""The distributed fhe executor (cipherlm/runtime/aegis_executor.py, AEGIS 4.1-4.4) against
the single-worker fhe executor and the plain executor, on small random BERT and Llama
configs at the INSECURE N = 2^10 test preset: W = 2 and 3, the AEGIS placement and the
Megatron-style tensor-parallel baseline, workers in this process and as Ray actors.
Bytes between workers are counted through the executor and checked against Table 2's
ciphertext size at each ciphertext's level."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cipherlm.he.errors import HEError
from cipherlm.he.lattigo_backend import TEST_INSECURE_PRESET, available

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def keys(ckks_toy_keys):
    return ckks_toy_keys


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-bert-aegis")
    transformers.BertModel(cfg).eval().save_pretrained(path)
    lm = load_model(str(path))
    rng = np.random.default_rng(2)
    W, b = rng.normal(size=(2, 32)), rng.normal(size=2) * 0.1
    return lm, calibrated_model(lm, [rng.integers(0, 100, size=10) for _ in range(4)], classifier=(W, b)), (W, b)


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model

    lm = load_model(tiny_llama_dir)
    rng = np.random.default_rng(3)
    return lm, calibrated_model(lm, [rng.integers(0, 96, size=12) for _ in range(4)])


def _blobs(keys, model):
    be, ctx, sk, bk = keys
    steps = model.rotation_steps(model.packing(ctx.slots, MAX_TOKENS))
    ek = sk.eval_keys(relin=True, steps=steps)
    return {"relin": ek.relin_key_bytes(), "galois": sk.galois_keys_bytes(steps), "bootstrap": bk.to_bytes()}


def _upload(keys, model, ids):
    from cipherlm.runtime.fhe_executor import client_embedding, client_tensors

    be, ctx, sk, _ = keys
    P = model.packing(ctx.slots, len(ids), MAX_TOKENS)
    x = client_embedding(model.graph, client_tensors(model), ids)
    return P, [be.ciphertext_to_bytes(sk.encrypt(be.encode_slots(ctx, r))) for r in P.pack(x)]


def _open(keys, model, W, placement="aegis", runtime=None, **kw):
    from cipherlm.runtime.aegis_executor import AegisExecutor

    be, ctx, sk, bk = keys
    ex = AegisExecutor(model, W, placement=placement, runtime=runtime, **kw)
    ex.open_session(TEST_INSECURE_PRESET, True, _blobs(keys, model), ctx.slots, ctx.n)
    return ex


def _slots(keys, blobs, tp):
    be, ctx, sk, _ = keys
    return np.stack([be.decode_slots(ctx, sk.decrypt(be.ciphertext_from_bytes(ctx, b))) for b in blobs]).reshape(-1, tp)


def _check_bytes(res):
    """Every collective's measured bytes against Table 2's size of the same ciphertexts."""
    for c in res["collectives"]:
        assert c["cts"] > 0 and c["bytes"] > 0
        # Lattigo's serialisation adds a small header per ciphertext to 2 (l+1) N 8 bytes
        assert c["formula_bytes"] <= c["bytes"] <= c["formula_bytes"] * 1.01 + 256 * c["cts"], c
    assert res["bytes"] == sum(c["bytes"] for c in res["collectives"])


@pytest.mark.parametrize("W,placement,classify", [(2, "aegis", True), (3, "aegis", False), (2, "megatron", False),
                                                   (2, "hydra", True), (3, "hydra", False)])
def test_bert_distributed_equals_plaintext(keys, tiny_bert, W, placement, classify):
    from cipherlm.runtime.plain import plain_executor

    lm, model, (Wc, bc) = tiny_bert
    ids = list(np.random.default_rng(5).integers(0, 100, size=7))
    P, up = _upload(keys, model, ids)
    ex = _open(keys, model, W, placement)
    if classify:
        res = ex.run(up, P, classify=True)
        got = _slots(keys, res["outputs"]["logits"], P.tp)
        want = plain_executor(lm, dtype=np.float64).sentence_embedding(ids) @ Wc.T + bc
        assert np.abs(got[:2, 0] - want).max() < 1e-2
        got[:2, 0] = 0
        assert np.abs(got).max() < 1e-4  # the logits and nothing else
        _check_bytes(res)
    else:
        hidden = ex.run(up, P)
        h = P.unpack(_slots(keys, hidden["outputs"]["hidden"], P.tp).reshape(-1, P.slots), 32)
        assert np.abs(h - plain_executor(lm, dtype=np.float64).forward(ids)).max() < 2e-2
        _check_bytes(hidden)
        kinds = {c["kind"] for c in hidden["collectives"]}
        if placement == "aegis":
            assert "AllGather" in kinds and "AllReduce" in kinds  # projections' inputs, norms' sums
        elif placement == "hydra":
            # column-parallel projections (inputs gathered) and the stream gathered at each norm:
            # nothing is reduced, and no norm sums travel
            forms = {c["form"] for c in hidden["collectives"]}
            assert "AllReduce" not in kinds and "ReduceScatter" not in kinds
            assert {"gather", "boundary"} <= forms and "norm-sum" not in forms
        else:
            assert kinds == {"AllReduce"} and {c["form"] for c in hidden["collectives"]} == {"allreduce"}
        assert all(w["bootstraps"] > 0 for w in hidden["workers"] if w["busy_s"] > 0)
    ex.shutdown()


@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_llama_distributed_logits(keys, tiny_llama, W):
    from cipherlm.runtime.plain import plain_executor

    lm, model = tiny_llama
    ids = list(np.random.default_rng(4).integers(0, 96, size=5))
    P, up = _upload(keys, model, ids)
    want = plain_executor(lm, dtype=np.float64).forward(ids)[-1]
    ex = _open(keys, model, W)
    res = ex.run(up, P, outputs=("logits",), last_only=True)
    s = _slots(keys, res["outputs"]["logits"], P.tp)
    got = s[:want.size, len(ids) - 1]
    assert np.abs(got - want).max() < 5e-3 and int(np.argmax(got)) == int(np.argmax(want))
    _check_bytes(res)
    ex.shutdown()


def test_single_worker_moves_nothing(keys, tiny_bert):
    lm, model, _c = tiny_bert
    P, up = _upload(keys, model, [1, 2, 3])
    ex = _open(keys, model, 1)
    res = ex.run(up, P)
    assert res["collectives"] == [] and res["bytes"] == 0
    ex.shutdown()


def test_unknown_placement_and_no_session(tiny_llama):
    from cipherlm.runtime.aegis_executor import AegisExecutor

    lm, model = tiny_llama
    with pytest.raises(HEError, match="unknown placement"):
        AegisExecutor(model, 2, placement="hydra-ish")
    ex = AegisExecutor(model, 2)
    with pytest.raises(HEError, match="no session"):
        ex.run([b""], None)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _llama_want(lm, ids):
    from cipherlm.runtime.plain import plain_executor

    return plain_executor(lm, dtype=np.float64).forward(ids)[-1]


def test_ray_actors_and_a_killed_worker(keys, tiny_llama, ray_local):
    """W = 2 on Ray actors (ciphertexts through the object store): logits equal plaintext
    and every collective's bytes match Table 2.  Then a worker killed during a pass: a clear
    error within the timeout, and after `recover` the next request is answered correctly."""
    from cipherlm.runtime.aegis_executor import RayRuntime

    lm, model = tiny_llama
    ids = [5, 17, 3, 9]
    P, up = _upload(keys, model, ids)
    want = _llama_want(lm, ids)
    ex = _open(keys, model, 2, runtime=RayRuntime(), timeout=120)
    res = ex.run(up, P, outputs=("logits",), last_only=True)
    got = _slots(keys, res["outputs"]["logits"], P.tp)[:96, len(ids) - 1]
    assert np.abs(got - want).max() < 5e-3
    _check_bytes(res)
    assert {w["rank"] for w in res["workers"]} == {0, 1} and len(set(ex.pids)) == 2
    # async dispatch (the default: calls queued, one wait per layer half) against a barrier
    # after every operator: the same collectives, bytes and result
    assert ex.dispatch == "async"
    ex.dispatch = "sync"
    res_sync = ex.run(up, P, outputs=("logits",), last_only=True)
    ex.dispatch = "async"
    strip = [{k: c[k] for k in ("kind", "form", "node", "cts", "bytes", "levels", "sends")} for c in res["collectives"]]
    assert strip == [{k: c[k] for k in strip[0]} for c in res_sync["collectives"]]
    got_sync = _slots(keys, res_sync["outputs"]["logits"], P.tp)[:96, len(ids) - 1]
    assert np.abs(got_sync - got).max() < 1e-6
    killer = threading.Timer(1.0, lambda: ex.runtime.kill(1))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(HEError, match="died|failed"):
        ex.run(up, P, outputs=("logits",), last_only=True)
    assert time.monotonic() - t0 < 120
    ex.recover()
    again = _slots(keys, ex.run(up, P, outputs=("logits",), last_only=True)["outputs"]["logits"], P.tp)
    assert np.abs(again[:96, len(ids) - 1] - want).max() < 5e-3
    ex.shutdown()


def test_served_on_two_workers(tiny_llama_dir, tmp_path, monkeypatch):
    """`cipherlm serve --mode fhe --workers 2` (workers in the server process here; the Ray
    actors are tested above): greedy generation with the KV cache on the workers equals
    plaintext, the welcome names the workers, and the client-aided refresh is refused."""
    from cipherlm.models import load_model
    from cipherlm.runtime.aegis_executor import InlineRuntime
    from cipherlm.runtime.fhe_client import FheClient, FheKeys
    from cipherlm.runtime.fhe_protocol import TEST_PRESET, ProtocolError, RemoteError
    from cipherlm.runtime.fhe_server import FheHost, FheServer
    from cipherlm.runtime.plain import plain_executor

    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path))
    host = FheHost(tiny_llama_dir, preset=TEST_PRESET, max_tokens=8, insecure_test_preset=True, workers=2,
                   runtime=InlineRuntime())
    assert host.welcome()["workers"] == 2 and host.welcome()["refresh"] == ["bootstrap"]
    srv = FheServer(host, "127.0.0.1", 0, session_timeout=60.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        # keys are checked by the workers only (the server does not parse them itself): Galois
        # keys without one of the model's steps are refused, and the server goes on serving
        keys = FheKeys(TEST_PRESET, host.rotation_steps, insecure_ok=True)
        full_galois = keys.blobs["galois"]
        keys.blobs["galois"] = keys.sk.galois_keys_bytes(keys.steps[:-1])
        with pytest.raises(RemoteError, match="lack some of the .* required rotation steps"):
            with FheClient(*srv.address, insecure_ok=True, keys=keys, timeout=60.0) as c:
                c.next_logits([1, 2])
        keys.blobs["galois"] = full_galois
        ids = [3, 17, 42, 5, 9]
        with FheClient(*srv.address, insecure_ok=True, keys=keys, timeout=60.0) as c:
            new, logits = c.generate(ids, 2)
            stats = c.infer_stats
        want_new, want_logits = plain_executor(load_model(tiny_llama_dir), dtype=np.float64).generate(
            ids, max_new_tokens=2, return_logits=True, eos_token_ids=[])
        assert new == list(want_new) and np.max(np.abs(logits[0] - want_logits[0])) < 1e-2
        assert [s["tokens"] for s in stats] == [len(ids), 1]
        client_keys = FheKeys(TEST_PRESET, host.rotation_steps, insecure_ok=True, refresh="client")
        with pytest.raises((RemoteError, ProtocolError), match="refresh"):
            with FheClient(*srv.address, insecure_ok=True, keys=client_keys, timeout=60.0, refresh="client") as c:
                c.next_logits([1, 2])
    finally:
        srv.shutdown()
        t.join(timeout=10)
        host.executor.shutdown()


def test_bench_aegis_cli(tmp_path, monkeypatch):
    """`cipherlm bench aegis` end to end (bert-tiny, workers in process): a row per W and
    placement, measured bytes equal to Table 2 at the measured levels, the figure written."""
    import json

    from cipherlm.cli import main

    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path))
    report, fig = tmp_path / "a.json", tmp_path / "a.png"
    assert main(["bench", "aegis", "--workloads", "bert-tiny", "--tokens", "4", "--workers", "1,2", "--runtime",
                 "inline", "--insecure-test-preset", "--report", str(report), "--plot", str(fig),
                 "--dispatch", "async,sync"]) == 0
    doc = json.loads(report.read_text())
    assert doc["model"] == "bert-tiny (random weights)"
    res = doc["extra"]["aegis"]
    assert [(r["W"], r["placement"], r["dispatch"]) for r in res["runs"]] == [
        (1, "aegis", "async"), (2, "aegis", "async"), (2, "aegis", "sync"), (2, "megatron", "async"),
        (2, "megatron", "sync")]
    assert res["runs"][1]["collectives"] == res["runs"][2]["collectives"]
    for r in res["runs"]:
        assert r["max_abs_error"] < 1e-3
        assert r["bytes"] == sum(r["bytes_by_part"].values())
        for k, b in r["bytes_by_part"].items():
            assert r["formula_bytes_by_part"][k] <= b <= r["formula_bytes_by_part"][k] * 1.01 + 4096
    assert res["runs"][0]["bytes"] == 0 and res["runs"][3]["bytes"] > 0
    assert fig.stat().st_size > 10_000


def test_bench_aegis_merge_of_runs_made_apart():
    """Per-W results made in separate processes merge into one, with T1 / (W T_W) against
    the one-worker run; results of different workloads are refused."""
    from cipherlm.bench import aegis

    def result(W, seconds, attention, ffn, workload="bert-base"):
        return {"workload": workload, "layers": 1, "tokens": 4, "preset": "p", "n": 1024, "load_average": [0.5],
                "runs": [{"W": W, "placement": "aegis", "seconds": seconds,
                          "part_seconds": {"L0.attention": attention, "L0.ffn": ffn}}]}

    m = aegis.merge([result(1, 80.0, 50.0, 30.0), result(2, 50.0, 25.0, 20.0), result(4, 25.0, 16.0, 7.5)])
    assert [r["W"] for r in m["runs"]] == [1, 2, 4]
    assert m["runs"][0]["efficiency_total"] == 1.0
    assert m["runs"][1]["efficiency_total"] == pytest.approx(0.8)
    assert m["runs"][1]["efficiency"] == pytest.approx({"L0.attention": 1.0, "L0.ffn": 0.75})
    assert m["runs"][2]["efficiency"]["L0.ffn"] == pytest.approx(1.0)
    assert "efficiency" not in aegis.merge([result(2, 50.0, 25.0, 20.0)])["runs"][0]
    with pytest.raises(ValueError, match="different runs"):
        aegis.merge([result(1, 80.0, 50.0, 30.0), result(2, 50.0, 25.0, 20.0, workload="bert-tiny")])

"""`cipherlm bench mpc` (cipherlm.mpc.bench) on tiny sizes: one report entry per
operation with the required fields, errors measured against numpy within each
operation's documented bound; the SPU side-by-side script when SPU is set up."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cipherlm.cli import main
from cipherlm.mpc import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_mpc_report(tmp_path, capsys):
    rep = tmp_path / "mpc.json"
    assert main(["bench", "mpc", "--elements", "256", "--rows", "2", "--report", str(rep)]) == 0
    ops = json.loads(rep.read_text())["extra"]["operations"]
    assert [o["name"] for o in ops] == [o.name for o in bench.ops()]
    by = {o["name"]: o for o in ops}
    for o in ops:
        for k in ("name", "size", "bytes", "rounds", "seconds", "max_error"):
            assert k in o, (o["name"], k)
        assert o["max_error"] <= o["bound"], o
        # amortised: the refill bytes that fell inside replaced by the COTs' steady-state share
        assert o["bytes_amortised"] == pytest.approx(
            o["bytes"] - o["ferret_refill_bytes"] + o["ferret_cots"] * bench.REFILL_BYTES_PER_COT)
        assert set(o["network_seconds"]) >= {"LAN", "WAN"}
        assert o["network_seconds"]["WAN"] >= o["network_seconds"]["LAN"] >= o["seconds"]
    assert by["gelu"]["size"] == [2, 3072] and by["softmax"]["size"] == [2, 128] and by["mul_fixed"]["size"] == [256]
    # local operations send nothing; interactive ones do, in proportion to their size
    assert by["trunc_local l=64 s=16"]["bytes"] == 0 and by["ring_to_field local"]["rounds"] == 0
    # the COT correction words alone (16 products of 16-bit limbs, both directions), with any OT backend
    assert by["mul l=64 (ring)"]["bytes"] > 256 * 2 * (64 + 48 + 32 + 16) * 16 / 8
    assert by["mul l=64 (ring)"]["rounds"] > 0
    assert by["exp (x <= 0)"]["max_error"] > 0  # an approximation: the error is really measured
    out = capsys.readouterr().out
    assert "max error" in out and "gelu" in out


def test_bench_inputs_are_deterministic_and_in_range():
    a, b = bench.inputs("reciprocal", 64), bench.inputs("reciprocal", 64)
    assert (a["x"] == b["x"]).all() and a["x"].min() >= 0.07 and a["x"].max() <= 4000
    t = bench.inputs("top8_of_64", rows=3)["x"]
    assert t.shape == (3, 64) and all(len(np.unique(r)) == 64 for r in t)
    with pytest.raises(KeyError):
        bench.op("no such op")


def test_bench_2pc_bert_base_binds_every_graph_tensor():
    """`cipherlm bench 2pc --workloads bert-base` once failed before running: the random BERT
    weights had no pooler, which the encoder graph binds (KeyError 'pooler.dense.weight')."""
    from cipherlm.bench import twopc as bench_twopc
    from cipherlm.runtime import twopc

    prep = bench_twopc.prepare("bert-base", tokens=2, layers=1)
    assert {"pooler.dense.weight", "pooler.dense.bias"} <= set(prep["weights"])
    server = twopc.server_weights(prep["config"], prep["weights"])
    plan = twopc.public_plan(prep["config"], server)
    assert plan["fusion"] == "none" and prep["ref"].shape == prep["x"].shape == (2, 768)


def test_bench_bad_name_fails_before_running():
    with pytest.raises(KeyError):
        bench.measure(["mul_fixed", "nope"], 16, 1)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".peers", "spu", "bin", "python")),
                    reason="SPU venv not set up (bash benchmarks/setup_peers.sh spu)")
def test_spu_side_by_side_small(tmp_path):
    rep = tmp_path / "spu.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_mpc_spu.py"), "--elements", "256",
                        "--rows", "1", "--only", "mul_fixed,less_than l=64,softmax,top8_of_64", "--report", str(rep)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ops = {o["name"]: o for o in json.loads(rep.read_text())["operations"]}
    for o in ops.values():
        assert o["bytes_spu"] > 0 and o["bytes_ours"] > 0 and o["seconds_spu"] > 0
        assert o["max_error_ours"] <= o["bound_ours"]
    assert ops["less_than l=64"]["max_error_spu"] == 0 and ops["top8_of_64"]["max_error_spu"] < 1e-3

"""`cipherlm bench blb` (issue 16 item 6, `cipherlm.bench.blb`): the tiny BERT (1 layer, 4
tokens) through the three rows (BFV+MPC, BLB, BLB+fused) in process, and a tiny GPT-2 through two:
the report's structure, bytes / flights
equal to the channel counters they come from (set-up excluded), the Figure 11-like breakdown
summing to them, the hidden-state errors against the plaintext executor, and the modelled
times from `NetworkModel.seconds` at the BLB paper's section 7.1 settings.  No timing
thresholds."""

import json

import numpy as np
import pytest

from cipherlm.bench import blb
from cipherlm.compile import build_graph
from cipherlm.compile.passes import blb_fusion
from cipherlm.net.netmodel import PRESETS
from cipherlm.runtime import twopc_blb

lattigo = pytest.importorskip("cipherlm.he.lattigo_backend")

TOKENS = 4


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    path = tmp_path_factory.mktemp("bench_blb") / "blb.json"
    out = blb.run_blb_bench("tiny", layers=1, tokens=TOKENS, report=str(path), command=["test"])
    return out, json.loads(path.read_text())


def _rows(out):
    return {(r["workload"], r["variant"]): r for r in out["rows"]}


def test_report_structure(bench):
    out, written = bench
    assert written["schema"] == out["schema"] == "cipherlm.bench.blb/1"
    assert written["command"] == ["test"]
    assert written["date"][:2] == "20"
    m = written["machine"]
    assert m["cores"] >= 1 and len(m["load_average"]) == 3 and len(m["load_average_end"]) == 3
    assert set(written["networks"]) == {"LAN", "WAN1", "WAN2", "WAN3"}
    rows = _rows(written)
    assert set(rows) == {("tiny", v) for v in blb.VARIANTS}
    for v in blb.VARIANTS:
        r = rows[("tiny", v)]
        assert r["status"] == "ok" and r["layers"] == 1 and r["tokens"] == TOKENS
        for key in ("bytes", "rounds", "flights", "seconds", "compute_seconds", "network", "setup", "breakdown",
                    "by_class", "max_abs_error", "channel"):
            assert key in r, (v, key)
        assert set(r["breakdown"]) == set(blb.CATEGORIES) | {"other"}
        assert r == json.loads(json.dumps(_rows(out)[("tiny", v)]))  # the file holds what was returned
    assert set(written["ratios"]) == {"tiny"}
    assert written["ratios"]["tiny"]["bytes"] == pytest.approx(
        rows[("tiny", "BFV+MPC")]["bytes"] / rows[("tiny", "BLB")]["bytes"])
    assert written["ratios_fused"]["tiny"]["bytes"] == pytest.approx(
        rows[("tiny", "BFV+MPC")]["bytes"] / rows[("tiny", "BLB+fused")]["bytes"])
    # the two BLB rows differ in the attention packing only: the same fused blocks
    assert rows[("tiny", "BLB+fused")]["he_blocks"]["count"] == rows[("tiny", "BLB")]["he_blocks"]["count"]


def _b(c):
    return c["bytes_sent"] + c["bytes_received"]


def _f(c):
    return c["rounds"] + c["flights_received"]


@pytest.mark.parametrize("variant", blb.VARIANTS)
def test_bytes_are_the_channel_counters(bench, variant):
    r = _rows(bench[0])[("tiny", variant)]
    ch, sp = r["channel"]["pass"], r["channel"]["setup_in_pass"]
    assert r["bytes"] == _b(ch) - _b(sp) > 0  # set-up excluded, as in the paper
    assert r["bytes_client_to_server"] + r["bytes_server_to_client"] == r["bytes"]
    assert r["bytes_client_to_server"] == ch["bytes_sent"] - sp["bytes_sent"]
    assert r["flights"] == _f(ch) - _f(sp) > 0
    assert r["rounds"] == ch["rounds"] - sp["rounds"]
    # every byte of the pass is metered: the per-class table and the breakdown add up to the total
    assert r["unmetered_bytes"] == 0
    assert sum(v["bytes"] for v in r["by_class"].values()) == r["bytes"]
    assert sum(r["breakdown"].values()) == r["bytes"]
    assert "setup" not in r["by_class"]
    assert r["setup"]["bytes"] >= r["setup"]["in_pass_bytes"] == _b(sp)
    assert r["setup"]["bytes"] > 0


def test_breakdown_categories(bench):
    rows = _rows(bench[0])
    base, fused = rows[("tiny", "BFV+MPC")]["breakdown"], rows[("tiny", "BLB")]["breakdown"]
    assert base["linear_he"] > 0 and base["nonlinear"] > 0 and base["embedding"] > 0
    # BLB: the linear operators are inside the CKKS blocks; what crosses is the conversions
    assert fused["linear_he"] == 0 and fused["conversions"] > 0 and fused["nonlinear"] > 0
    assert fused["embedding"] == base["embedding"]  # the same embedding protocol in both rows
    he = rows[("tiny", "BLB")]["he_blocks"]
    row = rows[("tiny", "BLB")]
    g = blb_fusion.run(build_graph(dict(blb.TINY_CONFIG, num_hidden_layers=1)), activation=row["activation"],
                       exp=row["exp"])
    assert he["count"] == len(g.meta["blb_blocks"]) == len(he["blocks"])
    peaks = [b["peak_rss_bytes"] for b in he["blocks"]]  # the process's peak so far: never falls
    assert peaks[0] > 0 and peaks == sorted(peaks)
    # the server's HE counts per block: the blocks with projections run them natively
    ops = [b["he"] for b in he["blocks"]]
    assert all(set(o) == set(twopc_blb.HE_OP_STATS) for o in ops)
    linear = {b["id"] for b in g.meta["blb_blocks"] if any(g.node(n).op == "linear" for n in b["nodes"])}
    with_weights = [b["he"] for b in he["blocks"] if b["block"] in linear and b["he"]["ct_pt"] > 1]
    assert with_weights and all(o["native_linear_s"] > 0 == o["encode_weights_s"] for o in with_weights)
    assert sum(o["rotations"] for o in ops) > 0 and sum(o["rescales"] for o in ops) > 0
    # the CKKS keys are made inside the pass (first use of each parameter set): set-up, not counted
    assert rows[("tiny", "BLB")]["setup"]["in_pass_bytes"] > 0


@pytest.mark.parametrize("variant", blb.VARIANTS)
def test_hidden_state_error_is_small(bench, variant):
    r = _rows(bench[0])[("tiny", variant)]
    # f = 16 fixed point through the cores, LayerNorm outputs of magnitude ~3 (tests/test_twopc_blb.py)
    assert np.isfinite(r["max_abs_error"]) and r["max_abs_error"] < 0.02


def test_modelled_times_follow_the_network_model(bench):
    out = bench[0]
    # BLB section 7.1: LAN 1 Gbps / 0.3 ms RTT; WAN1 400 Mbps / 4 ms; WAN2 100 Mbps / 4 ms; WAN3 100 Mbps / 80 ms
    expect = {"LAN": (1e9, 0.3e-3), "WAN1": (400e6, 4e-3), "WAN2": (100e6, 4e-3), "WAN3": (100e6, 80e-3)}
    for k, (bw, rtt) in expect.items():
        n = out["networks"][k]
        assert n["bandwidth_bits_per_s"] == bw and n["rtt_s"] == pytest.approx(rtt)
    for v in blb.VARIANTS:
        r = _rows(out)[("tiny", v)]
        assert 0 < r["compute_seconds"] <= r["seconds"]
        for k, p in blb.NETWORKS.items():
            assert r["network"][k] == pytest.approx(r["compute_seconds"] + PRESETS[p].seconds(r["bytes"], r["flights"]))
        assert r["network"]["LAN"] <= r["network"]["WAN1"] <= r["network"]["WAN2"] <= r["network"]["WAN3"]


def test_table_prints_every_row(bench):
    text = blb.format_table(bench[0]["rows"])
    assert all(f"tiny       {v:9}" in text for v in blb.VARIANTS)


def test_unknown_workload():
    with pytest.raises(ValueError):
        blb.run_blb_bench("gpt3", echo=False)


def test_cli_bench_blb_decoder_rows(tmp_path, capsys):
    """A decoder workload (a tiny GPT-2, its final norm at every position: teacher forcing) through
    the rows ``--variants`` picks: both run, their logits near the plaintext executor's, BLB's
    bytes are conversions and cores only; an unknown row is a clear error."""
    from cipherlm.cli import main

    path = tmp_path / "rows.json"
    assert main(["bench", "blb", "--workloads", "tiny-gpt2", "--variants", "BFV+MPC,BLB+fused", "--report",
                 str(path)]) == 0
    rows = _rows(json.loads(path.read_text()))
    assert set(rows) == {("tiny-gpt2", "BFV+MPC"), ("tiny-gpt2", "BLB+fused")}
    for r in rows.values():
        assert r["status"] == "ok" and r["bytes"] > 0 and r["max_abs_error"] < 0.05, r["variant"]
    fused = rows[("tiny-gpt2", "BLB+fused")]
    assert fused["fusion"] == "blb" and fused["breakdown"]["linear_he"] == 0 and fused["breakdown"]["conversions"] > 0
    assert any(c["value"].endswith(".qk") for c in fused["conversions"])  # the causal scores left their block
    assert "tiny-gpt2" in capsys.readouterr().out
    assert main(["bench", "blb", "--workloads", "tiny-gpt2", "--variants", "BLB,bolt"]) == 2
    assert "unknown bench blb rows ['bolt']" in capsys.readouterr().err


def test_row_as_two_processes_matches_in_process(bench):
    """``run_row(processes=True)`` (the SPU side-by-side's setting: two OS processes over
    loopback TCP) on the fixture's input: the same bytes and flights as the in-process row."""
    ref = _rows(bench[0])[("tiny", "BLB+fused")]
    prep = blb.prepare("tiny", 1, TOKENS)
    row = blb.run_row(prep, "BLB+fused", processes=True, timeout=600)
    assert (row["bytes"], row["flights"]) == (ref["bytes"], ref["flights"])
    assert row["max_abs_error"] < 0.05


def test_prepare_takes_given_ids():
    ids = np.array([3, 1, 4, 1], np.int64)
    prep = blb.prepare("tiny", 1, TOKENS, ids=ids)
    assert np.array_equal(prep["ids"], ids) and prep["ref"].shape[0] == TOKENS
    with pytest.raises(ValueError, match="token ids"):
        blb.prepare("tiny", 1, TOKENS, ids=ids[:3])
    with pytest.raises(ValueError, match="token ids"):
        blb.prepare("tiny", 1, TOKENS, ids=np.array([0, 1, 2, 10 ** 6]))

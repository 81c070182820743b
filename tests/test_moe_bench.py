"""`cipherlm bench moe` plumbing on a tiny shape: per-row accounting, the n/s
extrapolation of sampled experts against a full run, the CLI entry."""

from __future__ import annotations

import json

import pytest

from cipherlm.bench import moe as B

TINY = dict(d=16, n=4, k=2, f=8, m=8, sample=None)


@pytest.fixture(scope="module")
def full_row():
    return B.run_row(TINY, "cryptomoe", 2.0, timeout=300)


def test_row_accounting(full_row):
    r = full_row
    assert r["t"] == 8 and not r["extrapolated"]
    assert r["bytes"] == sum(p["bytes"] for p in r["phases"].values()) > 0
    assert set(r["phases"]) == {"gate", "dispatch", "experts", "combine"}
    assert r["mb_per_token"] == pytest.approx(r["bytes"] / 8 / 1e6)
    lan, wan = r["network_seconds"]["LAN"], r["network_seconds"]["WAN"]
    assert r["seconds"] < lan < wan
    assert 0 < r["dispatch_combine_share"]["LAN"] < 1
    assert "cryptomoe t=2.0" in B.format_rows([r])


def test_sampled_experts_extrapolate_to_the_full_cost(full_row):
    r = B.run_row(dict(TINY, sample=2), "cryptomoe", 2.0, timeout=300)
    assert r["extrapolated"] and r["expert_sample"] == 2
    full, est = full_row["phases"], r["phases"]
    assert est["experts"]["bytes"] == pytest.approx(full["experts"]["bytes"], rel=0.05)
    assert est["experts"]["flights"] == full["experts"]["flights"]      # one batched call per projection
    assert est["dispatch"]["bytes"] == full["dispatch"]["bytes"]        # not sampled


def test_targets_and_cli(tmp_path, monkeypatch):
    rows = [dict(name="dense", bytes=400, seconds=4.0, network_seconds={"LAN": 8.0}),
            dict(name="cipherprune t=1.0", bytes=300, seconds=1.0, network_seconds={"LAN": 2.0}),
            dict(name="cryptomoe t=2.0", bytes=100, seconds=1.0, network_seconds={"LAN": 2.0},
                 dispatch_combine_share={"LAN": 0.2})]
    tg = B.targets(rows)
    assert tg["bytes_vs_dense"] == 4 and tg["lan_time_vs_dense"] == 4 and tg["bytes_vs_cipherprune"] == 3
    assert tg["dispatch_combine_share_lan"] == 0.2
    from cipherlm import cli

    monkeypatch.setitem(B.SHAPES, "reduced", TINY)
    rep = tmp_path / "moe.json"
    assert cli.main(["bench", "moe", "--variants", "cryptomoe t=1.0,insecure", "--report", str(rep)]) == 0
    data = json.loads(rep.read_text())
    names = [r["name"] for r in data["extra"]["moe"]["rows"]]
    assert names == ["insecure", "cryptomoe t=1.0"]
    with pytest.raises(SystemExit):
        B.run(type("A", (), {"shape": "nope"})())


def test_simd_rows_report_rotations():
    """The ablation's SIMD rows: per-expert vs batch MatMul rotation counts (planned = done)."""
    rows = [B.run_row(TINY, "cryptomoe", 2.0, batched=b, packing="simd", timeout=300) for b in (False, True)]
    assert [r["name"] for r in rows] == ["cryptomoe t=2.0 SIMD per-expert", "cryptomoe t=2.0 SIMD batch"]
    per, bat = (r["simd"] for r in rows)
    assert per["rotations"] == per["server_rotations"] == per["planned"]["per_expert"]["rotations"]
    assert bat["rotations"] == bat["server_rotations"] == bat["planned"]["batched"]["rotations"]
    assert bat["rotations"] < per["rotations"]
    assert rows[1]["phases"]["experts"]["bytes"] > 0

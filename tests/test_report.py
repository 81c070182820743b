"""RunReport: schema, channel accounting, modelled network time, PNG, summary."""

import json

import numpy as np
import pytest

from cipherlm.net import PRESETS, inprocess_pair
from cipherlm.report import SCHEMA, RunReport


def _traffic():
    a, b = inprocess_pair(timeout=5)
    for _ in range(3):
        with a.step("linear"):
            a.send({"x": np.zeros(1000)})
        with b.step("linear"):
            b.recv()
            b.send({"y": np.zeros(10)})
        with a.step("linear"):
            a.recv()
    with a.step("softmax"):
        a.send({"z": 1})
    with b.step("softmax"):
        b.recv()
    return a, b


def _report():
    a, b = _traffic()
    r = RunReport.from_channel(a, "offload", "tiny-model", peer=b, command=["cipherlm", "demo", "--x", "a b"])
    r.merge_he_ops({"linear": {"rotate": 10, "mul_plain": 4}})
    r.add_he_ops({"rotate": 2}, "linear")
    r.add_seconds("linear", 0.5)
    with r.timed("softmax"):
        pass
    prof = r.profiler
    with prof("softmax"):
        pass
    prof.add("softmax", 0.25)
    prof.count("encrypt", 3, "softmax")
    r.agreement = 0.97
    r.extra["tokens"] = np.int64(12)
    r.finish(wall_seconds=2.0)
    return r, a, b


def test_schema_and_values(tmp_path):
    r, a, b = _report()
    p = r.write_json(tmp_path / "sub" / "report.json")
    d = json.loads(p.read_text())
    for key in ("schema", "mode", "model", "parties", "rounds", "wall_seconds", "breakdown", "network",
                "agreement", "extra", "machine", "command"):
        assert key in d
    assert d["schema"] == SCHEMA and d["mode"] == "offload" and d["model"] == "tiny-model"
    assert d["command"] == "cipherlm demo --x 'a b'"
    ta, tb = a.totals(), b.totals()
    assert d["parties"] == {
        "client": {"bytes_sent": ta["bytes_sent"], "bytes_received": ta["bytes_received"]},
        "server": {"bytes_sent": tb["bytes_sent"], "bytes_received": tb["bytes_received"]},
    }
    assert d["rounds"] == 7  # 3 ping-pongs (6 flights) + 1
    lin = d["breakdown"]["linear"]
    assert lin["rounds"] == 6 and lin["seconds"] == 0.5
    assert lin["he_ops"] == {"rotate": 12, "mul_plain": 4}
    assert lin["bytes"] == a.stats()["linear"]["bytes_sent"] + a.stats()["linear"]["bytes_received"]
    assert set(d["breakdown"]) == {"linear", "softmax"}
    assert d["breakdown"]["softmax"]["seconds"] >= 0.25
    assert d["breakdown"]["softmax"]["he_ops"] == {"encrypt": 3}
    for op in d["breakdown"].values():
        assert set(op) >= {"bytes", "rounds", "seconds", "he_ops"}
    total = ta["bytes_sent"] + ta["bytes_received"]
    for name in ("LAN", "WAN"):
        m = PRESETS[name]
        assert d["network"][name] == pytest.approx(2.0 + total * 8 / m.bandwidth_bits_per_s + 7 * m.latency_s)
    assert d["agreement"] == 0.97 and d["extra"] == {"tokens": 12}
    assert set(d["machine"]) >= {"cpu_model", "cores", "python", "platform"}


def test_mirrored_parties_and_accumulation():
    a, b = _traffic()
    r = RunReport("demo", "m", command="x")
    r.add_channel_stats(b.stats(), party="server")
    assert r.parties["client"]["bytes_sent"] == a.totals()["bytes_sent"]
    assert r.parties["client"]["bytes_received"] == a.totals()["bytes_received"]
    assert r.rounds == 7
    r.add_channel_stats(a.stats(), party="client")
    assert r.rounds == 14
    with pytest.raises(ValueError):
        r.add_channel_stats({}, party="eve")


def test_custom_presets_and_compute_seconds():
    r = RunReport("bench", "m", command="x", presets={k: PRESETS[k] for k in ("blb-WAN3", "fastquery-9Mbps")})
    r.add_channel_stats({"other": {"bytes_sent": 1_000_000, "bytes_received": 125_000, "rounds": 2, "flights_received": 2}})
    r.set_compute_seconds(1.0).finish(5.0)
    net = r.network()
    assert set(net) == {"blb-WAN3", "fastquery-9Mbps"}
    assert net["fastquery-9Mbps"] == pytest.approx(1.0 + 1.0)
    assert net["blb-WAN3"] == pytest.approx(1.0 + 0.09 + 4 * 0.04)


def test_plot_png_and_summary(tmp_path):
    r, _, _ = _report()
    p = r.plot_png(tmp_path / "r.png")
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    empty = RunReport("demo", "m", command="x").finish(0.1)
    assert empty.plot_png(tmp_path / "e.png").stat().st_size > 1000
    s = r.summary_text()
    assert "offload" in s and "linear" in s and "rotate=12" in s and "LAN" in s and "WAN" in s
    assert "kB" in s and "0.9700" in s
    assert "rounds" in empty.summary_text()


def test_add_prediction_accumulates_and_prints():
    r, _, _ = _report()
    assert "predicted" not in r.summary_text()
    r.add_prediction({"linear": {"bytes": 10_000, "rounds": 4, "he_ops": {"rotations": 1}}})
    r.add_prediction({"linear": {"bytes": 14_000, "rounds": 2}})
    assert r.extra["predicted"] == {"linear": {"bytes": 24_000, "rounds": 6}}
    s = r.summary_text()
    assert "predicted" in s and "meas/pred" in s
    row = next(line for line in s.splitlines() if line.split()[:1] == ["linear"])
    assert "24.00 kB" in row and f"{r.breakdown['linear']['bytes'] / 24_000:.3f}" in row
    soft = next(line for line in s.splitlines() if line.split()[:1] == ["softmax"])
    assert " - " in soft

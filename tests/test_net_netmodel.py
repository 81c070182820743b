"""Network cost model and the papers' presets."""

import pytest

from cipherlm.net import PRESETS, NetworkModel, default_presets, get_preset


def test_formula():
    m = NetworkModel("x", 8e6, 0.01)  # 1 MB/s, 10 ms one-way
    assert m.seconds(1_000_000, 3) == pytest.approx(1.0 + 0.03)
    assert m.seconds(0, 0) == 0.0
    r = NetworkModel.from_rtt("y", 1e9, 0.3e-3)
    assert r.latency_s == pytest.approx(0.15e-3) and r.rtt_s == pytest.approx(0.3e-3)
    # a request/response pair (2 flights) costs one RTT
    assert r.seconds(0, 2) == pytest.approx(0.3e-3)
    with pytest.raises(ValueError):
        NetworkModel("bad", 0, 0)


@pytest.mark.parametrize("name,bw,one_way", [
    ("cryptomoe-LAN", 3e9, 0.2e-3), ("cryptomoe-WAN", 400e6, 40e-3),
    ("blb-LAN", 1e9, 0.15e-3), ("blb-WAN1", 400e6, 2e-3), ("blb-WAN2", 100e6, 2e-3), ("blb-WAN3", 100e6, 40e-3),
    ("fastquery-384Mbps", 384e6, 0.0), ("fastquery-44Mbps", 44e6, 0.0), ("fastquery-9Mbps", 9e6, 0.0),
    ("LAN", 3e9, 0.2e-3), ("WAN", 400e6, 40e-3),
])
def test_presets(name, bw, one_way):
    m = PRESETS[name]
    assert m.bandwidth_bits_per_s == pytest.approx(bw) and m.latency_s == pytest.approx(one_way)
    assert get_preset(name.lower()) == m


def test_defaults():
    d = default_presets()
    assert set(d) >= {"LAN", "WAN"} and d["LAN"] == PRESETS["LAN"]
    with pytest.raises(KeyError):
        get_preset("nope")

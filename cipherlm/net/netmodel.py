"""Analytic network cost model and the papers' network settings (DESIGN.md "Network model").

    seconds(total_bytes, rounds) = total_bytes * 8 / bandwidth_bits_per_s + rounds * latency_s

* ``total_bytes``: all bytes exchanged, both directions (as counted by
  `cipherlm.net.channel.Channel`, frame headers included).  Transfers are
  charged serially against one link bandwidth, i.e. no overlap of the two
  directions — the usual convention of the papers' analytic estimates.
* ``rounds``: one-way flights (see the round definition in `channel`); a
  request/response pair is 2 flights.
* ``latency_s``: **one-way** latency charged per flight.  A round-trip time
  (RTT) covers two flights, so a preset given as an RTT stores ``latency_s = RTT/2``
  and charges one RTT per request/response pair.

Sources:

* CryptoMoE §5.1 (experimental setup): "LAN setting with 3Gbps bandwidth and
  0.2ms latency; WAN setting with 400Mbps bandwidth and 40ms latency".  Taken as
  one-way latency per flight.
* BLB §7.1 (test environment, Linux tc): "LAN ... 1 Gbps bandwidth and a 0.3ms
  roundtrip time"; WAN1 (400Mbps, 4ms), WAN2 (100Mbps, 4ms), WAN3 (100Mbps, 80ms).
  The WAN delays are stated in the same sentence as the LAN round-trip time, so
  all four are treated as RTTs (``latency_s = RTT/2``).
* FastQuery §5.3 ("different bandwidth evaluation"): 384 Mb/s, 44 Mb/s and 9 Mb/s,
  "selected from the experiments of Cheetah and Falcon".  The paper states **no
  latency** for these settings, so these presets are bandwidth-only
  (``latency_s = 0``); use `NetworkModel.with_latency` to add one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class NetworkModel:
    """A link with a bandwidth (bits/s) and a one-way latency (s) per flight."""

    name: str
    bandwidth_bits_per_s: float
    latency_s: float
    source: str = ""

    def __post_init__(self):
        if self.bandwidth_bits_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        if self.latency_s < 0:
            raise ValueError("latency must be non-negative")

    @classmethod
    def from_rtt(cls, name: str, bandwidth_bits_per_s: float, rtt_s: float, source: str = "") -> "NetworkModel":
        """A model from a round-trip time: one-way latency = rtt_s / 2."""
        return cls(name, bandwidth_bits_per_s, rtt_s / 2.0, source)

    @property
    def rtt_s(self) -> float:
        return 2.0 * self.latency_s

    def transfer_seconds(self, total_bytes: int | float) -> float:
        return float(total_bytes) * 8.0 / self.bandwidth_bits_per_s

    def latency_seconds(self, rounds: int | float) -> float:
        return float(rounds) * self.latency_s

    def seconds(self, total_bytes: int | float, rounds: int | float) -> float:
        """Modelled network time: bytes*8/bandwidth + rounds*latency (rounds = one-way flights)."""
        return self.transfer_seconds(total_bytes) + self.latency_seconds(rounds)

    def with_latency(self, latency_s: float, name: str | None = None) -> "NetworkModel":
        return replace(self, latency_s=latency_s, name=name or self.name)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "bandwidth_bits_per_s": self.bandwidth_bits_per_s,
            "latency_s": self.latency_s,
            "rtt_s": self.rtt_s,
            "source": self.source,
        }


MBPS = 1e6
GBPS = 1e9
MS = 1e-3

_CM = "CryptoMoE §5.1: bandwidth, one-way latency"
_BLB = "BLB §7.1: bandwidth, round-trip time"
_FQ = "FastQuery §5.3: bandwidth only (no latency stated)"

PRESETS: dict[str, NetworkModel] = {
    m.name: m
    for m in (
        NetworkModel("cryptomoe-LAN", 3 * GBPS, 0.2 * MS, _CM),
        NetworkModel("cryptomoe-WAN", 400 * MBPS, 40 * MS, _CM),
        NetworkModel.from_rtt("blb-LAN", 1 * GBPS, 0.3 * MS, _BLB),
        NetworkModel.from_rtt("blb-WAN1", 400 * MBPS, 4 * MS, _BLB),
        NetworkModel.from_rtt("blb-WAN2", 100 * MBPS, 4 * MS, _BLB),
        NetworkModel.from_rtt("blb-WAN3", 100 * MBPS, 80 * MS, _BLB),
        NetworkModel("fastquery-384Mbps", 384 * MBPS, 0.0, _FQ),
        NetworkModel("fastquery-44Mbps", 44 * MBPS, 0.0, _FQ),
        NetworkModel("fastquery-9Mbps", 9 * MBPS, 0.0, _FQ),
    )
}
# The default LAN/WAN are CryptoMoE's (DESIGN.md).
PRESETS["LAN"] = replace(PRESETS["cryptomoe-LAN"], name="LAN")
PRESETS["WAN"] = replace(PRESETS["cryptomoe-WAN"], name="WAN")


def default_presets() -> dict[str, NetworkModel]:
    """The settings a report models by default: LAN and WAN (CryptoMoE's)."""
    return {"LAN": PRESETS["LAN"], "WAN": PRESETS["WAN"]}


def get_preset(name: str) -> NetworkModel:
    """A preset by name (case-insensitive)."""
    for k, v in PRESETS.items():
        if k.lower() == name.lower():
            return v
    raise KeyError(f"unknown network preset {name!r}; known: {', '.join(PRESETS)}")

"""Run reports: one JSON schema written by every CLI command and mode.

A `RunReport` gathers the traffic counted by a `cipherlm.net.Channel` (per
protocol step = operator class), the measured compute time, HE operation
counters, an optional agreement score against the plaintext reference, and
models the end-to-end time under the papers' network settings
(`cipherlm.net.netmodel`, DESIGN.md "Network model")::

    network[preset] = compute_seconds + total_bytes*8/bandwidth + rounds*latency

``compute_seconds`` is the measured wall time of the run unless set explicitly
(`set_compute_seconds`): runs use an in-process or loopback channel whose own
transfer time is negligible next to the modelled one.  ``rounds`` are one-way
flights between the parties (see `cipherlm.net.channel`).

JSON schema (``schema = "cipherlm.report/1"``)::

    {schema, mode, model, command, timestamp,
     parties: {client: {bytes_sent, bytes_received}, server: {bytes_sent, bytes_received}},
     total_bytes, rounds, wall_seconds, compute_seconds,
     breakdown: {op_class: {bytes, bytes_client_to_server, bytes_server_to_client,
                            messages, rounds, seconds, he_ops: {name: count}}},
     network: {preset: modelled_seconds},
     network_detail: {preset: {bandwidth_bits_per_s, latency_s, transfer_seconds,
                               latency_seconds, compute_seconds, total_seconds}},
     agreement, extra, machine: {cpu_model, cores, usable_cores, python, platform, numpy}}

``extra["predicted"]`` (offload / 2pc runs, `add_prediction`): {op_class: {bytes, rounds}},
the run's passes priced by `cipherlm.runtime.predict` before anything ran.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .net.netmodel import NetworkModel, default_presets

SCHEMA = "cipherlm.report/1"
PARTIES = ("client", "server")


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, Python version and platform of this machine."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu_model": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
    }


def _jsonable(o: Any):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


class Profiler:
    """What a report hands to executors (``report.profiler``) to record compute
    time and HE operation counts per operator class::

        with profiler("linear"): ...          # or profiler.timed("linear")
        profiler.add("softmax", 0.12)         # seconds
        profiler.count("rotate", 8, "linear") # HE ops
    """

    def __init__(self, report: "RunReport"):
        self._report = report

    def timed(self, op_class: str):
        return self._report.timed(op_class)

    __call__ = timed

    def add_seconds(self, op_class: str, seconds: float) -> None:
        """The executors' profiler interface (same as `add`)."""
        self._report.add_seconds(op_class, seconds)

    def add(self, op_class: str, seconds: float) -> None:
        self._report.add_seconds(op_class, seconds)

    def count(self, name: str, n: int = 1, op_class: str = "other") -> None:
        self._report.add_he_ops({name: n}, op_class)


class RunReport:
    """Builder of the JSON run report (see module docstring for the schema)."""

    def __init__(
        self,
        mode: str,
        model: str,
        *,
        command: str | Sequence[str] | None = None,
        presets: Mapping[str, NetworkModel] | None = None,
    ):
        self.mode = mode
        self.model = model
        if command is None:
            command = sys.argv
        self.command = command if isinstance(command, str) else shlex.join([str(c) for c in command])
        self.presets: dict[str, NetworkModel] = dict(presets) if presets is not None else default_presets()
        self.parties = {p: {"bytes_sent": 0, "bytes_received": 0} for p in PARTIES}
        self.rounds = 0
        self.breakdown: dict[str, dict[str, Any]] = {}
        self.wall_seconds: float | None = None
        self.compute_seconds: float | None = None
        self.agreement: float | None = None
        self.extra: dict[str, Any] = {}
        self.timestamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------ building

    def op_class(self, name: str) -> dict[str, Any]:
        """The breakdown entry of an operator class (created empty if new)."""
        return self.breakdown.setdefault(
            name,
            {
                "bytes": 0,
                "bytes_client_to_server": 0,
                "bytes_server_to_client": 0,
                "messages": 0,
                "rounds": 0,
                "seconds": 0.0,
                "he_ops": {},
            },
        )

    def add_channel_stats(
        self,
        stats: Mapping[str, Mapping[str, int]],
        party: str = "client",
        peer_stats: Mapping[str, Mapping[str, int]] | None = None,
    ) -> "RunReport":
        """Add the traffic of a channel, from `Channel.stats()` of `party`'s end.

        The other party's counters are mirrored (what one sends the other
        receives) unless its own `peer_stats` are given.  Breakdown and rounds
        come from `stats` (rounds = this side's rounds + flights received = all
        one-way flights).  Calls accumulate.
        """
        if party not in PARTIES:
            raise ValueError(f"party must be one of {PARTIES}")
        peer = "server" if party == "client" else "client"
        for label, c in stats.items():
            e = self.op_class(label)
            sent, recvd = int(c.get("bytes_sent", 0)), int(c.get("bytes_received", 0))
            e["bytes"] += sent + recvd
            e["bytes_client_to_server" if party == "client" else "bytes_server_to_client"] += sent
            e["bytes_server_to_client" if party == "client" else "bytes_client_to_server"] += recvd
            e["messages"] += int(c.get("messages_sent", 0)) + int(c.get("messages_received", 0))
            flights = int(c.get("rounds", 0)) + int(c.get("flights_received", 0))
            e["rounds"] += flights
            self.parties[party]["bytes_sent"] += sent
            self.parties[party]["bytes_received"] += recvd
            self.rounds += flights
            if peer_stats is None:
                self.parties[peer]["bytes_sent"] += recvd
                self.parties[peer]["bytes_received"] += sent
        if peer_stats is not None:
            for c in peer_stats.values():
                self.parties[peer]["bytes_sent"] += int(c.get("bytes_sent", 0))
                self.parties[peer]["bytes_received"] += int(c.get("bytes_received", 0))
        return self

    @classmethod
    def from_channel(cls, channel, mode: str, model: str, *, party: str = "client", peer=None, **kw) -> "RunReport":
        """A report from a channel's counters (and optionally the peer channel's)."""
        rep = cls(mode, model, **kw)
        rep.add_channel_stats(channel.stats(), party=party, peer_stats=None if peer is None else peer.stats())
        return rep

    def add_he_ops(self, counts: Mapping[str, int], op_class: str = "other") -> "RunReport":
        """Merge an HE operation counter {name: count} into `op_class`."""
        ops = self.op_class(op_class)["he_ops"]
        for name, n in counts.items():
            ops[str(name)] = ops.get(str(name), 0) + int(n)
        return self

    def merge_he_ops(self, by_class: Mapping[str, Mapping[str, int]]) -> "RunReport":
        """Merge counters grouped by operator class: {op_class: {name: count}}."""
        for op_class, counts in by_class.items():
            self.add_he_ops(counts, op_class)
        return self

    def he_ops_total(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.breakdown.values():
            for k, n in e["he_ops"].items():
                out[k] = out.get(k, 0) + n
        return out

    def add_seconds(self, op_class: str, seconds: float) -> "RunReport":
        """Add measured compute seconds to an operator class."""
        self.op_class(op_class)["seconds"] += float(seconds)
        return self

    @contextlib.contextmanager
    def timed(self, op_class: str) -> Iterator[None]:
        """``with report.timed("linear"): ...`` adds the block's wall time to `op_class`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(op_class, time.perf_counter() - t)

    @property
    def profiler(self) -> Profiler:
        """A `Profiler` recording into this report (for executors)."""
        return Profiler(self)

    def add_prediction(self, pred: Mapping[str, Mapping[str, Any]]) -> "RunReport":
        """Add a `runtime.predict.predict` result (one pass) to ``extra["predicted"]``
        ({op_class: {bytes, rounds}}); calls accumulate, so a run adds one per pass.  The
        summary table then shows predicted bytes and measured / predicted per class."""
        acc = self.extra.setdefault("predicted", {})
        for cls, e in pred.items():
            a = acc.setdefault(cls, {"bytes": 0, "rounds": 0})
            a["bytes"] += int(e.get("bytes", 0))
            a["rounds"] += int(e.get("rounds", 0))
        return self

    def set_compute_seconds(self, seconds: float) -> "RunReport":
        self.compute_seconds = float(seconds)
        return self

    def finish(self, wall_seconds: float | None = None) -> "RunReport":
        """Stop the clock (wall time since construction unless given)."""
        self.wall_seconds = float(wall_seconds) if wall_seconds is not None else time.perf_counter() - self._t0
        return self

    # ------------------------------------------------------------ derived

    @property
    def total_bytes(self) -> int:
        return self.parties["client"]["bytes_sent"] + self.parties["client"]["bytes_received"]

    def _compute_seconds(self) -> float:
        if self.compute_seconds is not None:
            return self.compute_seconds
        if self.wall_seconds is None:
            self.finish()
        return float(self.wall_seconds)

    def network_detail(self) -> dict[str, dict[str, float]]:
        comp = self._compute_seconds()
        out = {}
        for name, m in self.presets.items():
            tr, lat = m.transfer_seconds(self.total_bytes), m.latency_seconds(self.rounds)
            out[name] = {
                "bandwidth_bits_per_s": m.bandwidth_bits_per_s,
                "latency_s": m.latency_s,
                "transfer_seconds": tr,
                "latency_seconds": lat,
                "compute_seconds": comp,
                "total_seconds": comp + tr + lat,
            }
        return out

    def network(self) -> dict[str, float]:
        """{preset: modelled seconds} = compute + transfer + latency."""
        return {k: v["total_seconds"] for k, v in self.network_detail().items()}

    def to_dict(self) -> dict[str, Any]:
        if self.wall_seconds is None:
            self.finish()
        detail = self.network_detail()
        return {
            "schema": SCHEMA,
            "mode": self.mode,
            "model": self.model,
            "command": self.command,
            "timestamp": self.timestamp,
            "parties": {p: dict(v) for p, v in self.parties.items()},
            "total_bytes": self.total_bytes,
            "rounds": self.rounds,
            "wall_seconds": self.wall_seconds,
            "compute_seconds": self._compute_seconds(),
            "breakdown": {k: {**v, "he_ops": dict(v["he_ops"])} for k, v in self.breakdown.items()},
            "network": {k: v["total_seconds"] for k, v in detail.items()},
            "network_detail": detail,
            "agreement": None if self.agreement is None else float(self.agreement),
            "extra": self.extra,
            "machine": machine_info(),
        }

    # ------------------------------------------------------------ output

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_jsonable, allow_nan=True)

    def write_json(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json() + "\n", encoding="utf-8")
        return p

    def _sorted_classes(self) -> list[str]:
        return sorted(self.breakdown, key=lambda k: (-self.breakdown[k]["bytes"], -self.breakdown[k]["seconds"], k))

    def plot_png(self, path: str | os.PathLike, presets: Sequence[str] | None = None) -> Path:
        """Two bar panels per operator class: MB exchanged (by direction) and
        seconds (measured compute + modelled network per preset).  Uses the Agg
        canvas directly, so no global matplotlib backend is touched."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        classes = self._sorted_classes() or ["(none)"]
        bd = {k: self.breakdown.get(k, {}) for k in classes}
        names = list(presets) if presets is not None else list(self.presets)
        x = np.arange(len(classes))

        fig = Figure(figsize=(max(8.0, 1.6 * len(classes) + 4), 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(1, 2)

        c2s = np.array([bd[k].get("bytes_client_to_server", 0) for k in classes], dtype=float) / 1e6
        s2c = np.array([bd[k].get("bytes_server_to_client", 0) for k in classes], dtype=float) / 1e6
        ax1.bar(x, c2s, label="client → server")
        ax1.bar(x, s2c, bottom=c2s, label="server → client")
        ax1.set_title("Communication per operator class")
        ax1.set_ylabel("MB")
        ax1.set_xticks(x, classes, rotation=30, ha="right")
        ax1.legend(fontsize="small")

        groups = [("compute (measured)", [bd[k].get("seconds", 0.0) for k in classes])]
        for n in names:
            m = self.presets[n]
            groups.append(
                (f"network {n} (modelled)", [m.seconds(bd[k].get("bytes", 0), bd[k].get("rounds", 0)) for k in classes])
            )
        w = 0.8 / len(groups)
        for i, (label, vals) in enumerate(groups):
            ax2.bar(x - 0.4 + w * (i + 0.5), vals, width=w, label=label)
        ax2.set_title("Time per operator class")
        ax2.set_ylabel("seconds")
        ax2.set_xticks(x, classes, rotation=30, ha="right")
        ax2.legend(fontsize="small")
        fig.suptitle(f"{self.mode} — {self.model}")

        p = Path(path)
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, format="png", dpi=100)
        return p

    def summary_text(self) -> str:
        """A human-readable summary for the terminal."""
        d = self.to_dict()
        c, s = d["parties"]["client"], d["parties"]["server"]
        lines = [
            f"cipherlm {d['mode']} | model {d['model']}",
            f"wall {d['wall_seconds']:.3f} s | compute {d['compute_seconds']:.3f} s | "
            f"total {_human_bytes(d['total_bytes'])} in {d['rounds']} rounds",
            f"client sent {_human_bytes(c['bytes_sent'])}, received {_human_bytes(c['bytes_received'])} | "
            f"server sent {_human_bytes(s['bytes_sent'])}, received {_human_bytes(s['bytes_received'])}",
        ]
        if self.breakdown:
            w = max(8, *(len(k) for k in self.breakdown))
            pred = self.extra.get("predicted") or {}
            phead = f" {'predicted':>11} {'meas/pred':>9}" if pred else ""
            lines.append(f"  {'op class':<{w}} {'bytes':>11}{phead} {'rounds':>7} {'compute s':>10}  HE ops")
            for k in self._sorted_classes():
                e = self.breakdown[k]
                ops = ", ".join(f"{n}={v}" for n, v in sorted(e["he_ops"].items())) or "-"
                pcol = ""
                if pred:
                    p = pred.get(k, {}).get("bytes")
                    pcol = (f" {_human_bytes(p):>11} {e['bytes'] / p:>9.3f}" if p
                            else f" {'-':>11} {'-':>9}")
                lines.append(f"  {k:<{w}} {_human_bytes(e['bytes']):>11}{pcol} {e['rounds']:>7} {e['seconds']:>10.3f}  {ops}")
        if d["network"]:
            lines.append("modelled: " + " | ".join(f"{k} {v:.3f} s" for k, v in d["network"].items()))
        if d["agreement"] is not None:
            lines.append(f"agreement with plaintext: {d['agreement']:.4f}")
        return "\n".join(lines)

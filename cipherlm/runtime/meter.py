"""The one meter of every mode: bytes, messages, flights and seconds per operator class
and per graph node, from the channel's own counters.

``with meter(op_class, node=name): ...`` compares the channel's counters
(`cipherlm.net.channel.Channel.stats`, exact: every byte that crossed it) before
and after the block; nested blocks count towards the outermost one. Without a
channel (the plain mode) only the seconds are kept. Operator classes are
`cipherlm.compile.ir.OP_CLASSES`, the vocabulary of every report and plot.

Inside a linear-type block (linear, attention_matmul, embedding) the HE traffic
stays in the block's class and the rest of it (the sign extension of the HE
results: millionaires, OTs) is reported as ``conversions`` (BLB section 3's HE<->MPC
conversion); first-use set-up (base OTs, HE public keys) is ``setup``. The meter
never looks at data.

`stats()` is in `Channel.stats` format keyed by class (what
`RunReport.add_channel_stats` takes), `summary()` a JSON-able table, `by_node()`
the same per graph node.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from cipherlm.compile.ir import OP_CLASSES

#: channel steps that carry the HE products themselves (everything else inside a
#: linear-type block is the share conversion after it)
HE_STEPS = frozenset({"linear", "matmul-shared"})
SETUP_STEPS = frozenset({"he-keys", "ot.base"})
_LINEAR_CLASSES = frozenset({"linear", "attention_matmul"})

__all__ = ["Meter", "NoMeter", "OP_CLASSES", "HE_STEPS", "SETUP_STEPS"]


def _new_counter() -> dict[str, int]:
    return {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0, "messages_received": 0,
            "rounds": 0, "flights_received": 0}


def _add(acc: dict, delta: dict) -> None:
    for k, v in delta.items():
        acc[k] = acc.get(k, 0) + v


def _row(t: dict, seconds: float, calls: int) -> dict:
    return {"bytes": t["bytes_sent"] + t["bytes_received"], "bytes_sent": t["bytes_sent"],
            "flights": t["rounds"] + t["flights_received"], "seconds": seconds, "calls": calls}


class Meter:
    """Per operator class and per graph node, for one party's channel (None: seconds only)."""

    def __init__(self, chan=None):
        self.chan = chan
        self.traffic: dict[str, dict[str, int]] = defaultdict(_new_counter)
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.node_traffic: dict[str, dict[str, int]] = defaultdict(_new_counter)
        self.node_seconds: dict[str, float] = defaultdict(float)
        self.node_class: dict[str, str] = {}
        self._active = False

    @contextlib.contextmanager
    def __call__(self, op_class: str, node: str | None = None):
        if op_class not in OP_CLASSES:
            raise ValueError(f"unknown operator class {op_class!r}; one of {OP_CLASSES}")
        if self._active:
            yield
            return
        self._active = True
        before = self.chan.stats() if self.chan is not None else {}
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            after = self.chan.stats() if self.chan is not None else {}
            self._active = False
            self.seconds[op_class] += dt
            self.calls[op_class] += 1
            if node is not None:
                self.node_seconds[node] += dt
                self.node_class[node] = op_class
            for label, c in after.items():
                b = before.get(label, {})
                delta = {k: int(v) - int(b.get(k, 0)) for k, v in c.items()}
                if not any(delta.values()):
                    continue
                _add(self.traffic[self._classify(op_class, label)], delta)
                if node is not None:
                    _add(self.node_traffic[node], delta)

    def add_seconds(self, op_class: str, seconds: float) -> None:
        """Profiler interface (`GraphExecutor`'s ``profiler``): time only."""
        self.seconds[op_class] += seconds
        self.calls[op_class] += 1

    @staticmethod
    def _classify(op_class: str, label: str) -> str:
        if label in SETUP_STEPS or label.endswith(".setup"):
            return "setup"
        if op_class == "embedding":
            if label in HE_STEPS or (label.startswith("embedding.") and not label.endswith(".extend")):
                return "embedding"
            return "conversions"
        if op_class in _LINEAR_CLASSES and label not in HE_STEPS:
            return "conversions"
        return op_class

    def stats(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.traffic.items()}

    def summary(self) -> dict:
        """JSON-able: {op_class: {bytes, bytes_sent, flights, seconds, calls}}."""
        out = {}
        for k in sorted(set(self.traffic) | set(self.seconds)):
            out[k] = _row(self.traffic.get(k, _new_counter()), self.seconds.get(k, 0.0), self.calls.get(k, 0))
        return out

    def by_node(self) -> dict:
        """JSON-able: {graph node: {op_class, bytes, bytes_sent, flights, seconds}} (all traffic of
        the node's block, conversions and first-use set-up included)."""
        out = {}
        for k in sorted(set(self.node_traffic) | set(self.node_seconds)):
            r = _row(self.node_traffic.get(k, _new_counter()), self.node_seconds.get(k, 0.0), 0)
            r.pop("calls")
            out[k] = {"op_class": self.node_class.get(k), **r}
        return out


class NoMeter:
    """Meters nothing (the default when no meter is given)."""

    @contextlib.contextmanager
    def __call__(self, op_class, node=None):
        yield

    def add_seconds(self, op_class, seconds) -> None:
        pass

"""Which projections a model evaluates together, and what operator class each is.

A private mode evaluates the projections that share an input (q, k, v; gate, up)
as one stacked matrix, so it needs the groups in advance, before any request:
the model graph's `group_linears` pass lists them in call order
(`cipherlm.runtime.offload_server.discover_groups`); `RecordingLinear` records the
groups an executor actually calls (tests compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class LinearGroup:
    """Projections that share one input, evaluated as one stacked matrix."""

    index: int
    names: tuple[str, ...]
    d_in: int
    d_outs: tuple[int, ...]

    @property
    def d_out(self) -> int:
        return sum(self.d_outs)

    @property
    def op_class(self) -> str:
        return operator_class(self.names)


def operator_class(names: Sequence[str]) -> str:
    """Name the operator class of a group of projections, for reports and plots."""
    first = names[0]
    leaf = first.rsplit(".", 1)[-1]
    if first in ("lm_head",) or leaf == "lm_head":
        return "lm_head"
    if first.startswith("classifier") or leaf == "classifier":
        return "classifier"
    if "pooler" in first:
        return "pooler"
    if leaf in ("q_proj", "k_proj", "v_proj", "query", "key", "value", "c_attn") or "qkv" in leaf:
        return "attn_qkv"
    if leaf in ("o_proj", "out_proj") or first.endswith("attention.output.dense") or (
        ".attn." in first and leaf == "c_proj"
    ):
        return "attn_out"
    if leaf == "gate" or leaf.endswith("router") or first.endswith("mlp.gate"):
        return "moe_router"
    if leaf in ("gate_proj", "up_proj", "w1", "w3", "c_fc") or first.endswith("intermediate.dense"):
        return "ffn_in"
    if leaf in ("down_proj", "w2", "c_proj") or first.endswith("output.dense"):
        return "ffn_out"
    return "linear"


class RecordingLinear:
    """A LinearBackend that evaluates in the clear and records each call's group."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[tuple[str, ...], int, tuple[int, ...]]] = []

    def linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        outs = self.inner.linear(x, names)
        self.calls.append((tuple(names), int(x.shape[-1]), tuple(int(o.shape[-1]) for o in outs)))
        return outs


def groups_from_calls(calls) -> list[LinearGroup]:
    """Unique groups in first-call order."""
    seen: dict[tuple[str, ...], LinearGroup] = {}
    for names, d_in, d_outs in calls:
        if names not in seen:
            seen[names] = LinearGroup(len(seen), names, d_in, d_outs)
    return list(seen.values())


def groups_from_linears(server_linears: dict, extra_groups: Sequence[Sequence[str]] = ()) -> list[LinearGroup]:
    """Groups for explicitly listed name tuples, shapes read from the weights."""
    out = []
    for i, names in enumerate(extra_groups):
        mats = [server_linears[n][0] for n in names]
        d_in = mats[0].shape[1]
        if any(m.shape[1] != d_in for m in mats):
            raise ValueError(f"group {names} mixes input sizes")
        out.append(LinearGroup(i, tuple(names), d_in, tuple(m.shape[0] for m in mats)))
    return out

"""Bytes and flights per element of each primitive, measured through the channel
counters, against the cost formulas in the protocol docstrings / docs/mpc.md."""

import pytest

from cipherlm.mpc.costs import format_table, measure

N = 4096
# IKNP: 16 bytes per OT from the receiver; COT adds l bits; KK13 1-of-16: 32 + 16*2/8 bytes.
KK16 = 32 + 4
TRIPLE = 2 * 16
EXPECTED = {
    "and (bit triples + open)": TRIPLE + 2 * 2 / 8,
    "b2a l=64": 16 + 8,
    "mux l=64": 2 * (16 + 8),
    "mul l=64": 2 * (64 * 16 + sum(64 - lo for lo in (0, 16, 32, 48)) * 16 / 8),
    "millionaire l=64": 16 * KK16 + 15 * (TRIPLE + 2 * 3 / 8),
    "msb/drelu l=64": 16 * KK16 + 15 * (TRIPLE + 2 * 3 / 8),  # l-1 = 63 bits: 16 blocks
    "trunc_local l=64 s=16": 0,
    "ring_to_field local l=64": 0,
}


def test_measured_costs_match_formulas():
    rows = {r["name"]: r for r in measure(N)}
    print(format_table(list(rows.values())))
    for name, exp in EXPECTED.items():
        got = rows[name]["bytes_per_elem"]
        assert exp * 0.98 <= got <= exp * 1.05 + 1.0, (name, got, exp)
    assert rows["trunc_local l=64 s=16"]["flights"] == 0
    assert rows["b2a l=64"]["flights"] == 2 and rows["mux l=64"]["flights"] <= 4
    # 1-of-N (2 flights) + 2 ROT calls (1 each) + 4 tree levels (a simultaneous exchange: 1-2 flights)
    assert rows["millionaire l=64"]["flights"] <= 12

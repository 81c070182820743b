"""Bytes and flights per element of each primitive, measured through the channel
counters, against the cost formulas in the protocol docstrings / docs/mpc.md."""

import functools
import math

import pytest

from cipherlm.mpc.costs import format_table, measure
from cipherlm.mpc.ot import OTSession
from cipherlm.mpc.protocols import mul_he

N = 4096


def expected(ot_bytes: float, kk: float, m: int) -> dict:
    """Bytes per element: ot_bytes per 1-out-of-2 OT from the receiver (IKNP 16, Ferret
    1/8); a COT adds l bits; the comparison's 1-out-of-2^m OT of 2-bit messages costs kk
    (KK13, m = 4: 32 + 4; Ferret, m = 3: 3 correlated OTs + 2 bytes)."""
    triple = 2 * ot_bytes
    q64, q63 = -(-64 // m), -(-63 // m)
    return {
        "and (bit triples + open)": triple + 2 * 2 / 8,
        "b2a l=64": ot_bytes + 8,
        "mux l=64": 2 * (ot_bytes + 8),
        "mul l=64 (Gilboa)": 2 * (64 * ot_bytes + sum(64 - lo for lo in (0, 16, 32, 48)) * 16 / 8),
        "mul l=64 (HE)": mul_he.bytes_estimate(N, 64, 2, True) / N,
        "millionaire l=64": q64 * kk + (q64 - 1) * (triple + 2 * 3 / 8),
        "msb/drelu l=64": q63 * kk + (q63 - 1) * (triple + 2 * 3 / 8),
        "trunc_local l=64 s=16": 0,
        "ring_to_field local l=64": 0,
    }


def _session(chan, party, ferret):
    return OTSession(chan, party, ferret=ferret)


@pytest.mark.parametrize("ferret,ot_bytes,kk,m,slack", [(False, 16, 32 + 4, 4, 1.0), (True, 1 / 8, 3 / 8 + 2, 3, 2.0)],
                         ids=["iknp", "ferret"])
def test_measured_costs_match_formulas(ferret, ot_bytes, kk, m, slack):
    rows = {r["name"]: r for r in measure(N, ot_factory=functools.partial(_session, ferret=ferret))}
    print(format_table(list(rows.values())))
    for name, exp in expected(ot_bytes, kk, m).items():
        # a Ferret refill lands inside whichever operation drains the pool: its bytes are
        # counted there and reported separately; the formula is for the online part
        got = (rows[name]["bytes"] - rows[name]["ferret_refill_bytes"]) / N
        assert exp * 0.98 <= got <= exp * 1.05 + slack, (name, got, exp)
    refills = sum(r["ferret_refill_bytes"] for r in rows.values())
    assert (refills > 0) == ferret
    assert rows["trunc_local l=64 s=16"]["flights"] == 0
    assert rows["b2a l=64"]["flights"] == 2 and rows["mux l=64"]["flights"] <= 4
    # 1-of-N (2 flights) + 2 ROT calls (1 each) + the tree levels (a simultaneous exchange: 1-2 flights)
    levels = math.ceil(math.log2(-(-64 // m)))
    assert rows["millionaire l=64"]["flights"] <= 4 + 2 * levels

"""Measure bytes and rounds per element of every primitive through the channel counters.

`measure(n)` runs each primitive on n random elements in-process (two threads,
real OT unless another `ot_factory` is given) after a warm-up that performs the
one-time base OTs, and returns one entry per operation:
``{"name", "n", "bytes", "bytes_per_elem", "flights", "seconds"}`` where
``bytes`` counts both directions (frame headers included) and ``flights`` is the
number of one-way message flights (`Channel` "rounds" of both parties).
"""

from __future__ import annotations

import time

import numpy as np

from .ring import RingConfig, from_signed, mask
from .runner import run_inprocess
from .shares import AShare, BShare

Q_DEFAULT = (1 << 59) - 55


def _ops(ctx, n: int, q: int):
    from .protocols import b2a, bool_ops, compare, extend, field, millionaire, mul, mul_he, mux, trunc

    rng = np.random.default_rng(1234 + ctx.party)  # test data only (not secret)
    x = AShare(ctx, from_signed(rng.integers(-2**40, 2**40, n), 64), 64)
    y = AShare(ctx, from_signed(rng.integers(-2**40, 2**40, n), 64), 64)
    b = BShare(ctx, rng.integers(0, 2, n).astype(np.uint64))
    c = BShare(ctx, rng.integers(0, 2, n).astype(np.uint64))
    v = rng.integers(0, 2**63, n).astype(np.uint64)
    x32 = AShare(ctx, x.data & mask(32), 32)
    fq = rng.integers(0, q, n).astype(np.uint64)
    ops = [
        ("and (bit triples + open)", lambda: b & c),
        ("b2a l=64", lambda: b2a.b2a(ctx, b)),
        ("mul l=64 (Gilboa)", lambda: mul.mul(ctx, x, y, method="ot")),
        ("mul l=64 (HE)", lambda: mul.mul(ctx, x, y, method="he")),
        ("mux l=64", lambda: mux.mux(ctx, b, x)),
        ("millionaire l=64", lambda: millionaire.millionaire(ctx, v, 64)),
        ("equality l=64", lambda: millionaire.equality(ctx, v, 64)),
        ("msb/drelu l=64", lambda: compare.msb(ctx, x)),
        ("relu l=64", lambda: compare.relu(ctx, x)),
        ("trunc_faithful l=64 s=16", lambda: trunc.trunc_faithful(ctx, x, 16)),
        ("trunc_local l=64 s=16", lambda: trunc.trunc_local(ctx, x, 16)),
        # |x| < 2^40 < 2^62: sign=None (one bit of headroom), the same cost as sign=0 / 1
        ("trunc_known_sign l=64 s=16", lambda: trunc.trunc_known_sign(ctx, x, 16, None)),
        ("trunc_one_bit_error l=64 s=16", lambda: trunc.trunc_one_bit_error(ctx, x, 16, None)),
        ("sext 32->64", lambda: extend.sext(ctx, x32, 64)),
        ("zext 32->64", lambda: extend.zext(ctx, x32, 64)),
        ("trunc_extend l=32 s=12", lambda: trunc.trunc_extend(ctx, x32, 12)),
        ("field_to_ring q~2^59 l=64", lambda: field.field_to_ring(ctx, fq, q)),
        ("ring_to_field exact l=64", lambda: field.ring_to_field(ctx, x, q)),
        ("ring_to_field local l=64", lambda: field.ring_to_field(ctx, x, q, method="local")),
    ]
    # warm-up: base OTs of every kind in both directions
    bool_ops.and_bits(ctx, b.data[:16].astype(np.uint8), c.data[:16].astype(np.uint8))
    millionaire.millionaire(ctx, v[:16], 8)
    mux.mux(ctx, b[:16], x[:16])
    b2a.b2a_mod(ctx, b.data[:16], q)
    mul_he.setup(ctx)  # the HE product's public keys
    out = []
    for name, fn in ops:
        ctx.chan.send({"sync": 1})  # align the parties so each measurement starts clean
        ctx.chan.recv()
        ctx.chan.reset_stats()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        tot = ctx.chan.totals()
        nbytes = tot["bytes_sent"] + tot["bytes_received"]
        # Ferret pool refills (and its IKNP bootstrap) that happened to fall inside this
        # operation: included in "bytes", also reported on their own
        ref = ctx.chan.stats().get("ot.ferret", {})
        refill = ref.get("bytes_sent", 0) + ref.get("bytes_received", 0)
        out.append({"name": name, "n": n, "bytes": nbytes, "bytes_per_elem": nbytes / n, "ferret_refill_bytes": refill,
                    "flights": tot["rounds"] + tot["flights_received"], "seconds": dt})
    return out


# (name, measured shape, issue's shape for extrapolation)
NONLINEAR_SHAPES = [
    ("exp_neg", (1, 1 << 14), (1, 1 << 16)),
    ("reciprocal", (1, 1 << 14), (1, 1 << 16)),
    ("rsqrt", (1, 1 << 14), (1, 1 << 16)),
    ("softmax", (128, 128), (128, 128)),
    ("gelu", (8, 3072), (128, 3072)),
    ("silu", (8, 1536), (128, 1536)),
    ("layer_norm", (32, 768), (128, 768)),
    ("rms_norm", (32, 576), (128, 576)),
    ("top8_of_64", (128, 64), (128, 64)),
]


def _nl_ops(ctx, shapes):
    from . import nonlinear as nl
    from .protocols import bool_ops

    rng = np.random.default_rng(99 + ctx.party)  # test data only
    fns = {
        "exp_neg": lambda x: nl.exp_neg(ctx, x - np.uint64(1 << 20) if ctx.party == 0 else x),
        "reciprocal": lambda x: nl.reciprocal(ctx, x),
        "rsqrt": lambda x: nl.rsqrt(ctx, x),
        "softmax": lambda x: nl.softmax(ctx, x),
        "gelu": lambda x: nl.gelu(ctx, x),
        "silu": lambda x: nl.silu(ctx, x),
        "layer_norm": lambda x: nl.layer_norm(ctx, x),
        "rms_norm": lambda x: nl.rms_norm(ctx, x),
        "top8_of_64": lambda x: nl.topk_last(ctx, x, 8),
    }
    b = rng.integers(0, 2, 16).astype(np.uint8)
    bool_ops.and_bits(ctx, b, b)  # warm-up (base OTs)
    out = []
    for name, shape, full in shapes:
        # shares of small positive values: party 0 holds v + r, party 1 holds -r (r public test noise)
        r = np.random.default_rng(7).integers(0, 2**63, shape).astype(np.uint64)
        v = np.random.default_rng(8).integers(1 << 14, 1 << 18, shape).astype(np.uint64)
        x = AShare(ctx, v + r if ctx.party == 0 else np.uint64(0) - r, 64, 16)
        ctx.chan.send({"sync": 1})
        ctx.chan.recv()
        ctx.chan.reset_stats()
        t = time.perf_counter()
        fns[name](x)
        dt = time.perf_counter() - t
        tot = ctx.chan.totals()
        nbytes = tot["bytes_sent"] + tot["bytes_received"]
        n = int(np.prod(shape))
        scale = int(np.prod(full)) / n
        out.append({"name": name, "shape": list(shape), "n": n, "bytes": nbytes, "bytes_per_elem": nbytes / n,
                    "flights": tot["rounds"] + tot["flights_received"], "seconds": dt,
                    "issue_shape": list(full), "issue_bytes_est": nbytes * scale, "issue_seconds_est": dt * scale})
    return out


def measure_nonlinear(shapes=NONLINEAR_SHAPES, ot_factory=None, timeout: float = 600.0) -> list[dict]:
    """Bytes/flights/seconds of each nonlinear function on the given shapes, with a
    linear extrapolation to the issue's benchmark shapes."""
    res, _ = run_inprocess(_nl_ops, args0=(shapes,), args1=(shapes,), ring=RingConfig(64, 16),
                           ot_factory=ot_factory, timeout=timeout)
    return res


def measure(n: int = 1 << 14, q: int = Q_DEFAULT, ot_factory=None, timeout: float = 600.0) -> list[dict]:
    """Bytes/flights/seconds per primitive on n elements (see module docstring)."""
    res, _ = run_inprocess(_ops, args0=(n, q), args1=(n, q), ring=RingConfig(64, 16), ot_factory=ot_factory,
                           timeout=timeout)
    return res


def format_table(rows: list[dict]) -> str:
    lines = [f"{'operation':30s} {'n':>7s} {'bytes/elem':>11s} {'flights':>7s} {'seconds':>8s}"]
    for r in rows:
        lines.append(f"{r['name']:30s} {r['n']:7d} {r['bytes_per_elem']:11.1f} {r['flights']:7d} {r['seconds']:8.3f}")
    return "\n".join(lines)


def format_nonlinear(rows: list[dict]) -> str:
    lines = [f"{'function':12s} {'shape':>12s} {'bytes/elem':>11s} {'flights':>7s} {'seconds':>8s}"
             f" {'issue shape':>12s} {'MB (est)':>9s} {'s (est)':>8s}"]
    for r in rows:
        lines.append(f"{r['name']:12s} {'x'.join(map(str, r['shape'])):>12s} {r['bytes_per_elem']:11.0f} {r['flights']:7d}"
                     f" {r['seconds']:8.2f} {'x'.join(map(str, r['issue_shape'])):>12s} {r['issue_bytes_est'] / 1e6:9.1f}"
                     f" {r['issue_seconds_est']:8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m cipherlm.mpc.costs [N] [--nonlinear] [--report FILE.json]"""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m cipherlm.mpc.costs", description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=1 << 14, help="elements per primitive")
    ap.add_argument("--nonlinear", action="store_true", help="measure the nonlinear library instead")
    ap.add_argument("--report", help="write the rows as JSON to this file")
    a = ap.parse_args(argv)
    rows = measure_nonlinear() if a.nonlinear else measure(a.n)
    print(format_nonlinear(rows) if a.nonlinear else format_table(rows))
    if a.report:
        with open(a.report, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

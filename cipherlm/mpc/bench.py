"""`cipherlm bench mpc`: every 2PC primitive and nonlinear function on the issue's
sizes, with bytes, flights, compute seconds and the max error against numpy.

Sizes (issue 3, acceptance): primitives on 2^16 elements (``n``); softmax
128x128, GeLU 128x3072, LayerNorm 128x768, RMSNorm 128x576, SiLU 128x1536,
top-8 of 64 for 128 rows (``rows`` scales the row count of these shapes).

One operation = one `Op`: public test inputs drawn from a fixed seed (so both
parties and the numpy reference see the same data), shared by their owners
*before* the measured window (party 0 owns x, party 1 owns y and the bits),
the protocol call inside the window (channel counters reset at its start),
the output opened to both parties after the window and compared with numpy.

Each result row: ``name``, ``size`` (shape), ``n`` (elements), ``bytes`` (both
directions, frame headers included), ``rounds`` (one-way flights of both
parties, as `cipherlm.net.netmodel` charges them), ``seconds`` (wall time of
the protocol call), ``max_error`` (max abs difference from numpy in the
output's unit: real value for fixed-point outputs, integer for ring outputs,
0/1 for bits), ``bound`` (the documented bound the error is checked against).

`inputs(name, n, rows)` is also what benchmarks/bench_mpc_spu.py feeds to
SecretFlow-SPU, so both systems see identical data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import erf
from typing import Callable

import numpy as np

from .ferret import FERRET_MAIN
from .ring import RingConfig, from_signed

Q = (1 << 59) - 55  # prime modulus of the field<->ring conversions (as in costs.py)
FRAC = 16
SEED = 20260  # public test data only


# ----------------------------------------------------------------- references

def gelu_ref(v):
    return 0.5 * v * (1.0 + np.vectorize(erf)(v / np.sqrt(2.0)))


def silu_ref(v):
    return v / (1.0 + np.exp(-v))


def softmax_ref(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def layer_norm_ref(x, g, b, eps=1e-5):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def rms_norm_ref(x, g, eps=1e-6):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g


def topk_ref(x, k):
    idx = np.argsort(-x, -1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, -1), idx


# ----------------------------------------------------------------- operations

@dataclass(frozen=True)
class Op:
    name: str
    kind: str                      # "primitive" (n elements) | "nonlinear" (rows x cols)
    cols: int                      # nonlinear: columns of the shape
    make: Callable                 # (rng, shape) -> dict of public test arrays
    run: Callable                  # (ctx, shared inputs dict) -> output (share / tuple)
    open: Callable                 # (ctx, output) -> plaintext (both parties)
    ref: Callable                  # (inputs dict) -> expected plaintext
    bound: float                   # documented max abs error (0 = exact)
    spu: bool = False              # compared with SecretFlow-SPU in benchmarks/bench_mpc_spu.py


def _ints(rng, shape, mag):
    return rng.integers(-(2 ** mag), 2 ** mag, shape, dtype=np.int64)


def _fl(ctx, s):
    return s.reveal_float()


def _open_field(ctx, v):
    peer = ctx.exchange({"v": v})["v"]
    s = (v.astype(object) + peer.astype(object)) % Q
    return np.array([int(t) - Q if t > Q // 2 else int(t) for t in s.ravel()], np.int64).reshape(v.shape)


def _share_field(ctx, X):
    """Z_q shares of the public test integers X (both parties derive them from one seed)."""
    r = np.random.default_rng(SEED + 1).integers(0, Q, X.shape, dtype=np.uint64)
    xq = np.mod(X, Q).astype(np.uint64)
    if ctx.party == 0:
        return (xq + r) % np.uint64(Q)  # < 2^60: no overflow
    return (np.uint64(Q) - r) % np.uint64(Q)


def _eq_shares(ctx, x, y):
    from .protocols.millionaire import equality
    from .shares import BShare

    d = (x - y).data
    v = d if ctx.party == 0 else (np.uint64(0) - d)
    return BShare(ctx, equality(ctx, v, 64))


def _build_ops() -> list[Op]:
    from . import nonlinear as nl
    from .protocols import b2a, compare, extend, field, millionaire, mul, mux, trunc
    from .shares import BShare

    def lt_private(ctx, s):
        return BShare(ctx, millionaire.millionaire(ctx, s["pa"] if ctx.party == 0 else s["pb"], 64))

    def pair_u64(rng, shape):
        a = rng.integers(0, 2 ** 63, shape, dtype=np.uint64) | (rng.integers(0, 2, shape, dtype=np.uint64) << np.uint64(63))
        b = rng.integers(0, 2 ** 63, shape, dtype=np.uint64) | (rng.integers(0, 2, shape, dtype=np.uint64) << np.uint64(63))
        k = a.size // 8
        b.ravel()[:k] = a.ravel()[:k]
        return {"pa": a, "pb": b}

    def ints_xy(rng, shape, mag=40):
        X, Y = _ints(rng, shape, mag), _ints(rng, shape, mag)
        k = X.size // 8
        Y.ravel()[:k] = X.ravel()[:k]  # some equal pairs
        return {"x": X, "y": Y}

    def fl_xy(rng, shape):
        X, Y = rng.uniform(-8, 8, shape), rng.uniform(-8, 8, shape)
        k = X.size // 8
        Y.ravel()[:k] = X.ravel()[:k]
        return {"x": X, "y": Y}

    def bits_xb(rng, shape):
        return {"x": _ints(rng, shape, 40), "b": rng.integers(0, 2, shape, dtype=np.int64),
                "c": rng.integers(0, 2, shape, dtype=np.int64)}

    ulp = 2.0 ** -FRAC
    P, N = "primitive", "nonlinear"
    return [
        # ---- ring primitives (exact unless noted), n elements
        Op("and", P, 0, bits_xb, lambda ctx, s: s["b"] & s["c"], lambda ctx, o: o.reveal().astype(np.int64),
           lambda i: i["b"] & i["c"], 0),
        Op("b2a l=64", P, 0, bits_xb, lambda ctx, s: b2a.b2a(ctx, s["b"]), lambda ctx, o: o.reveal().astype(np.int64),
           lambda i: i["b"], 0),
        Op("mul l=64 (ring)", P, 0, lambda r, sh: ints_xy(r, sh, 30), lambda ctx, s: mul.mul(ctx, s["x"], s["y"]),
           lambda ctx, o: o.reveal_signed(), lambda i: i["x"] * i["y"], 0),
        Op("mux l=64", P, 0, bits_xb, lambda ctx, s: mux.mux(ctx, s["b"], s["x"]), lambda ctx, o: o.reveal_signed(),
           lambda i: np.where(i["b"] == 1, i["x"], 0), 0, spu=True),
        Op("millionaire l=64", P, 0, pair_u64, lt_private, lambda ctx, o: o.reveal().astype(np.int64),
           lambda i: (i["pa"] < i["pb"]).astype(np.int64), 0),
        Op("equality l=64", P, 0, ints_xy, lambda ctx, s: _eq_shares(ctx, s["x"], s["y"]),
           lambda ctx, o: o.reveal().astype(np.int64), lambda i: (i["x"] == i["y"]).astype(np.int64), 0, spu=True),
        Op("msb/drelu l=64", P, 0, ints_xy, lambda ctx, s: compare.msb(ctx, s["x"]),
           lambda ctx, o: o.reveal().astype(np.int64), lambda i: (i["x"] < 0).astype(np.int64), 0),
        Op("less_than l=64", P, 0, ints_xy, lambda ctx, s: compare.less_than(ctx, s["x"], s["y"]),
           lambda ctx, o: o.reveal().astype(np.int64), lambda i: (i["x"] < i["y"]).astype(np.int64), 0, spu=True),
        Op("relu l=64", P, 0, ints_xy, lambda ctx, s: compare.relu(ctx, s["x"]), lambda ctx, o: o.reveal_signed(),
           lambda i: np.maximum(i["x"], 0), 0, spu=True),
        Op("trunc_faithful l=64 s=16", P, 0, ints_xy, lambda ctx, s: trunc.trunc_faithful(ctx, s["x"], 16),
           lambda ctx, o: o.reveal_signed(), lambda i: i["x"] >> 16, 0),
        Op("trunc_local l=64 s=16", P, 0, ints_xy, lambda ctx, s: trunc.trunc_local(ctx, s["x"], 16),
           lambda ctx, o: o.reveal_signed(), lambda i: i["x"] >> 16, 1),
        # |x| < 2^40 < 2^62: sign=None (one bit of headroom), the same cost as a known sign
        Op("trunc_known_sign l=64 s=16", P, 0, ints_xy, lambda ctx, s: trunc.trunc_known_sign(ctx, s["x"], 16, None),
           lambda ctx, o: o.reveal_signed(), lambda i: i["x"] >> 16, 0),
        Op("trunc_one_bit_error l=64 s=16", P, 0, ints_xy,
           lambda ctx, s: trunc.trunc_one_bit_error(ctx, s["x"], 16, None), lambda ctx, o: o.reveal_signed(),
           lambda i: i["x"] >> 16, 1),
        Op("sext 32->64", P, 0, lambda r, sh: {"x": _ints(r, sh, 30)}, lambda ctx, s: extend.sext(ctx, s["x32"], 64),
           lambda ctx, o: o.reveal_signed(), lambda i: i["x"], 0),
        Op("zext 32->64", P, 0, lambda r, sh: {"x": _ints(r, sh, 30)}, lambda ctx, s: extend.zext(ctx, s["x32"], 64),
           lambda ctx, o: o.reveal().astype(np.int64), lambda i: from_signed(i["x"], 32).astype(np.int64), 0),
        Op("trunc_extend l=32 s=12", P, 0, lambda r, sh: {"x": _ints(r, sh, 30)},
           lambda ctx, s: trunc.trunc_extend(ctx, s["x32"], 12), lambda ctx, o: o.reveal_signed(),
           lambda i: i["x"] >> 12, 1),
        Op("field_to_ring q~2^59", P, 0, lambda r, sh: {"x": _ints(r, sh, 40)},
           lambda ctx, s: field.field_to_ring(ctx, s["xq"], Q), lambda ctx, o: o.reveal_signed(),
           lambda i: i["x"], 0),
        Op("ring_to_field exact", P, 0, ints_xy, lambda ctx, s: field.ring_to_field(ctx, s["x"], Q), _open_field,
           lambda i: i["x"], 0),
        Op("ring_to_field local", P, 0, ints_xy, lambda ctx, s: field.ring_to_field(ctx, s["x"], Q, method="local"),
           _open_field, lambda i: i["x"], 0),
        # ---- fixed point (l = 64, f = 16), n elements
        Op("mul_fixed", P, 0, fl_xy, lambda ctx, s: nl.mulf(ctx, s["x"], s["y"]), _fl, lambda i: i["x"] * i["y"],
           10 * ulp, spu=True),
        Op("exp (x <= 0)", P, 0, lambda r, sh: {"x": -r.uniform(0, 16, sh)}, lambda ctx, s: nl.exp_neg(ctx, s["x"]),
           _fl, lambda i: np.exp(i["x"]), 5e-3, spu=True),
        Op("reciprocal", P, 0, lambda r, sh: {"x": np.exp(r.uniform(np.log(0.07), np.log(4000), sh))},
           lambda ctx, s: nl.reciprocal(ctx, s["x"]), _fl, lambda i: 1 / i["x"], 2e-4 / 0.07 + 4 * ulp, spu=True),
        Op("rsqrt", P, 0, lambda r, sh: {"x": np.exp(r.uniform(np.log(0.07), np.log(4000), sh))},
           lambda ctx, s: nl.rsqrt(ctx, s["x"]), _fl, lambda i: 1 / np.sqrt(i["x"]), 1e-4 / 0.07 ** 0.5 + 4 * ulp,
           spu=True),
        # ---- nonlinear library on the shapes (rows x cols)
        Op("softmax", N, 128, lambda r, sh: {"x": r.uniform(-8, 8, sh)}, lambda ctx, s: nl.softmax(ctx, s["x"]), _fl,
           lambda i: softmax_ref(i["x"]), 5e-3, spu=True),
        Op("gelu", N, 3072, lambda r, sh: {"x": r.uniform(-6, 6, sh)}, lambda ctx, s: nl.gelu(ctx, s["x"]), _fl,
           lambda i: gelu_ref(i["x"]), 0.005, spu=True),
        Op("layer_norm", N, 768, lambda r, sh: {"x": r.normal(0.5, 3, sh), **_gb(sh[-1])},
           lambda ctx, s: nl.layer_norm(ctx, s["x"], s["gamma"], s["beta"]), _fl,
           lambda i: layer_norm_ref(i["x"], i["gamma"], i["beta"]), 2e-3, spu=True),
        Op("rms_norm", N, 576, lambda r, sh: {"x": r.normal(0.5, 3, sh), **_gb(sh[-1])},
           lambda ctx, s: nl.rms_norm(ctx, s["x"], s["gamma"]), _fl, lambda i: rms_norm_ref(i["x"], i["gamma"]), 2e-3,
           spu=True),
        Op("silu", N, 1536, lambda r, sh: {"x": r.uniform(-8, 8, sh)}, lambda ctx, s: nl.silu(ctx, s["x"]), _fl,
           lambda i: silu_ref(i["x"]), 0.0025, spu=True),
        Op("top8_of_64", N, 64, _distinct, lambda ctx, s: nl.topk_last(ctx, s["x"], 8),
           lambda ctx, o: np.concatenate([o[0].reveal_float(), o[1].reveal_signed().astype(float)], -1),
           lambda i: np.concatenate([topk_ref(i["x"], 8)[0], topk_ref(i["x"], 8)[1].astype(float)], -1),
           2.0 ** -FRAC, spu=True),
    ]


def _gb(d):
    return {"gamma": np.linspace(0.5, 1.5, d), "beta": np.linspace(-1, 1, d)}


def _distinct(rng, shape):
    rows, cols = shape
    x = np.stack([rng.permutation(np.linspace(-10, 10, cols)) for _ in range(rows)])
    return {"x": x + rng.uniform(-0.01, 0.01, (rows, 1))}


_OPS: list[Op] | None = None


def ops() -> list[Op]:
    global _OPS
    if _OPS is None:
        _OPS = _build_ops()
    return _OPS


def op(name: str) -> Op:
    for o in ops():
        if o.name == name:
            return o
    raise KeyError(f"unknown operation {name!r}; known: {', '.join(o.name for o in ops())}")


def shape_of(o: Op, n: int, rows: int) -> tuple:
    return (n,) if o.kind == "primitive" else (rows, o.cols)


def inputs(name: str, n: int = 1 << 16, rows: int = 128) -> dict:
    """The public test inputs of one operation (same for every caller)."""
    o = op(name)
    return o.make(np.random.default_rng(SEED), shape_of(o, n, rows))


# ----------------------------------------------------------------- running

def _share(ctx, o: Op, raw: dict) -> dict:
    from .shares import share_bits_input, share_input

    s = {}
    for k, v in raw.items():
        if k in ("gamma", "beta", "pa", "pb"):
            s[k] = v  # public norm weights; the millionaire's private inputs (each party passes its own)
        elif k in ("b", "c"):  # shared bits: b owned by party 1, c by party 0
            owner = 1 if k == "b" else 0
            s[k] = share_bits_input(ctx, v if ctx.party == owner else None, owner)
        elif v.dtype.kind == "f":
            owner = 1 if k == "y" else 0
            s[k] = share_input(ctx, v if ctx.party == owner else None, owner, frac=FRAC)
        else:
            owner = 1 if k == "y" else 0
            s[k] = share_input(ctx, from_signed(v, 64) if ctx.party == owner else None, owner, frac=0)
            if k == "x":
                s["x32"] = share_input(ctx, from_signed(v, 32) if ctx.party == owner else None, owner, bits=32, frac=0)
                s["xq"] = _share_field(ctx, v)  # Z_q shares, for field_to_ring
    return s


#: steady-state Ferret refill traffic per COT served (one main iteration's message over its
#: usable COTs, ~0.45 bit): a refill lands inside whichever operation drains the pool, so
#: "bytes" jumps by ~1.1 MB when one falls in; "bytes_amortised" replaces the refill bytes
#: that fell inside by this share of the COTs the operation used (both directions)
REFILL_BYTES_PER_COT = FERRET_MAIN.msg_len / FERRET_MAIN.usable


def _served_cots(ctx) -> int:
    """COTs this party's Ferret pools (both directions) have served so far (0 on IKNP)."""
    ext = getattr(ctx.ot, "ext", None)
    return sum(getattr(getattr(ext, k, None), "served", 0) for k in ("sender_pool", "receiver_pool"))


def _party(ctx, names: list[str], n: int, rows: int, warm: bool = True) -> list[dict]:
    from .protocols import bool_ops, millionaire, mul_he, mux
    from .shares import AShare, BShare

    if warm:  # one-time base OTs of every kind in both directions, outside the measurements
        ctx.ot.prime()  # Ferret's main base in both directions, as SPU's warm-up runs emp-ot's Ferret set-up
        b = np.array([0, 1] * 8, np.uint8)
        bool_ops.and_bits(ctx, b, b)
        millionaire.millionaire(ctx, np.arange(16, dtype=np.uint64), 8)
        mux.mux(ctx, BShare(ctx, b.astype(np.uint64)), AShare(ctx, np.arange(16, dtype=np.uint64), 64, 0))
        mul_he.setup(ctx)  # the HE product's key exchange (one per session, like the base OTs)
    out = []
    for name in names:
        o = op(name)
        shape = shape_of(o, n, rows)
        raw = o.make(np.random.default_rng(SEED), shape)
        s = _share(ctx, o, raw)
        ctx.chan.send({"sync": 1})  # align the parties so each measurement starts clean
        ctx.chan.recv()
        ctx.chan.reset_stats()
        served = _served_cots(ctx)
        t = time.perf_counter()
        res = o.run(ctx, s)
        dt = time.perf_counter() - t
        tot = ctx.chan.totals()
        # Ferret pool refills that fell inside this operation (counted in "bytes" too)
        ref = ctx.chan.stats().get("ot.ferret", {})
        refill = ref.get("bytes_sent", 0) + ref.get("bytes_received", 0)
        served = _served_cots(ctx) - served
        got = np.asarray(o.open(ctx, res), dtype=np.float64)
        want = np.asarray(o.ref(raw), dtype=np.float64)
        err = float(np.abs(got - want).max())
        out.append({"name": name, "kind": o.kind, "size": list(shape), "n": int(np.prod(shape)),
                    "bytes": tot["bytes_sent"] + tot["bytes_received"], "ferret_refill_bytes": refill,
                    "ferret_cots": served,
                    "bytes_amortised": tot["bytes_sent"] + tot["bytes_received"] - refill + served * REFILL_BYTES_PER_COT,
                    "rounds": tot["rounds"] + tot["flights_received"], "seconds": dt,
                    "max_error": err, "bound": o.bound})
    return out


def measure(names: list[str] | None = None, n: int = 1 << 16, rows: int = 128, *, processes: bool = False,
            timeout: float = 3600.0) -> list[dict]:
    """Run the named operations (default all) as two parties, in-process threads
    or (``processes=True``) two OS processes over TCP on loopback; party 0's rows."""
    from .runner import run_inprocess, run_processes

    names = [o.name for o in ops()] if names is None else list(names)
    for nm in names:
        op(nm)  # unknown names fail before anything starts
    run = run_processes if processes else run_inprocess
    a, _ = run(_party, args0=(names, n, rows), args1=(names, n, rows), ring=RingConfig(64, FRAC), timeout=timeout)
    for r in a:
        r["bytes_per_elem"] = r["bytes"] / r["n"]
    return a


def add_network(rows: list[dict]) -> list[dict]:
    """Modelled seconds (compute + bytes / bandwidth + flights x latency) for every preset."""
    from ..net.netmodel import default_presets

    presets = default_presets()
    for r in rows:
        r["network_seconds"] = {k: r["seconds"] + m.seconds(r["bytes"], r["rounds"]) for k, m in presets.items()}
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'operation':26s} {'size':>9s} {'MB':>9s} {'MB amort':>9s} {'B/elem':>8s} {'rounds':>6s} {'compute s':>9s}"
    keys = list(rows[0].get("network_seconds", {})) if rows else []
    head += "".join(f" {k[:9] + ' s':>11s}" for k in keys) + f" {'max error':>9s} {'bound':>8s}"
    lines = [head]
    for r in rows:
        line = (f"{r['name']:26s} {'x'.join(map(str, r['size'])):>9s} {r['bytes'] / 1e6:9.2f}"
                f" {r.get('bytes_amortised', r['bytes']) / 1e6:9.2f} {r['bytes'] / r['n']:8.0f}"
                f" {r['rounds']:6d} {r['seconds']:9.2f}")
        line += "".join(f" {r['network_seconds'][k]:11.2f}" for k in keys)
        line += f" {r['max_error']:9.2e} {r['bound']:8.1e}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m cipherlm.mpc.bench [--elements N] [--rows R] [--only a,b] [--processes] [--report FILE]"""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m cipherlm.mpc.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 16)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--only", help="comma-separated operation names")
    ap.add_argument("--processes", action="store_true")
    ap.add_argument("--report")
    a = ap.parse_args(argv)
    rows = add_network(measure(a.only.split(",") if a.only else None, a.elements, a.rows, processes=a.processes))
    print(format_rows(rows))
    if a.report:
        with open(a.report, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

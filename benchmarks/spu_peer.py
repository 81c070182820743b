"""SecretFlow-SPU side of benchmarks/bench_mpc_spu.py.  Runs with the SPU venv's
python (bash benchmarks/setup_peers.sh spu), never with the project's .venv:

    .peers/spu/bin/python benchmarks/spu_peer.py IN_DIR OUT_DIR op1 op2 ...

IN_DIR holds <op>.npz (inputs written by bench_mpc_spu.py from
`cipherlm.mpc.bench.inputs`, so both systems see the same data).  For every
operation this compiles the jax function below (CompilerOptions with
enable_optimize_denominator_with_broadcast=True, as SPU's PUMA examples do),
secret-shares the inputs (`Io.make_shares`, VIS_SECRET, no owner: plain
additive shares as for any intermediate value), and runs it under
CHEETAH / FM64 (SPU's defaults otherwise: 18 fraction bits, Ferret OT) with the
two parties as two OS processes linked by `libspu.link.create_brpc` on
127.0.0.1.  Both parties keep one Runtime for all operations; a warm-up
executable runs first so the one-time OT set-up is not charged to the first
operation (as `cipherlm.mpc.bench` excludes the base OTs).

Bytes and send actions come from SPU's own profile log
(``enable_pphlo_profile``: "Link details: total send bytes ..., recv bytes ...,
send actions ..." per Run), which each party prints to its stdout/stderr;
the parties write those to OUT_DIR/party<r>.log and parse them after each
run.  Seconds: wall time of `Runtime.run` on party 0 after a link barrier.
Results: OUT_DIR/results.json (one entry per operation) and
OUT_DIR/<op>.out.npz (the reconstructed outputs).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import socket
import sys
import time
import traceback

import numpy as np

LINK_RE = re.compile(r"Link details: total send bytes (\d+), recv bytes (\d+), send actions (\d+), recv actions (\d+)")
EXEC_RE = re.compile(r"\[Profiling\] SPU execution (\S+) completed.*?execution took ([0-9.e+-]+)s")


def _functions():
    import jax
    import jax.numpy as jnp

    def layer_norm(x, g, b):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b

    def rms_norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    # name -> (function of the secret inputs, secret input keys, public input keys)
    fns = {
        "mux l=64": (lambda x, b: jnp.where(b, x, 0), ("x", "b"), ()),
        "equality l=64": (lambda x, y: x == y, ("x", "y"), ()),
        "less_than l=64": (lambda x, y: x < y, ("x", "y"), ()),
        "relu l=64": (lambda x: jnp.maximum(x, 0), ("x",), ()),
        "mul_fixed": (lambda x, y: x * y, ("x", "y"), ()),
        "exp (x <= 0)": (jnp.exp, ("x",), ()),
        "reciprocal": (lambda x: 1.0 / x, ("x",), ()),
        "rsqrt": (jax.lax.rsqrt, ("x",), ()),
        "softmax": (lambda x: jax.nn.softmax(x, axis=-1), ("x",), ()),
        "gelu": (jax.nn.gelu, ("x",), ()),  # jax default: tanh form
        "layer_norm": (layer_norm, ("x",), ("gamma", "beta")),
        "rms_norm": (rms_norm, ("x",), ("gamma",)),
        "silu": (jax.nn.silu, ("x",), ()),
        "top8_of_64": (lambda x: jax.lax.top_k(x, 8), ("x",), ()),
    }
    import spu_models  # the Transformer layers of bench_2pc_spu.py (same directory)

    fns.update(spu_models.functions())
    return fns


def _config(profile: bool):
    import spu.libspu as L

    cfg = L.RuntimeConfig(protocol=L.ProtocolKind.CHEETAH, field=L.FieldType.FM64)
    cfg.enable_pphlo_profile = profile
    return cfg


def _compile(name, data):
    import spu.libspu as L
    import spu.utils.frontend as fe

    fn, secret, public = _functions()[name]
    pub = [np.asarray(data[k], np.float32) for k in public]  # public norm weights: compile-time constants

    def f(*a):
        return fn(*a, *pub)

    f.__name__ = re.sub(r"\W", "_", name)
    args = [_as_input(k, data[k]) for k in secret]
    copts = L.CompilerOptions()
    copts.enable_optimize_denominator_with_broadcast = True
    ex, _ = fe.compile(fe.Kind.JAX, f, args, {}, [f"in{i}" for i in range(len(args))],
                       [L.Visibility.VIS_SECRET] * len(args), lambda out: [f"out{i}" for i in range(len(out))],
                       copts=copts)
    return ex, args


def _as_input(key, v):
    v = np.asarray(v)
    if key == "b":  # shared bits
        return v.astype(bool)
    return v.astype(np.float32) if v.dtype.kind == "f" else v.astype(np.int64)


def _party(rank, ports, jobs, log_path, q):
    """One SPU party: jobs = [(name, executable bytes, input names, output names, [(meta, chunks)] )]."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        import spu.libspu as L
        from spu.api import Runtime

        desc = L.link.Desc()
        for r, p in enumerate(ports):
            desc.add_party(f"p{r}", f"127.0.0.1:{p}")
        desc.recv_timeout_ms = 3600 * 1000
        desc.http_timeout_ms = 3600 * 1000
        desc.http_max_payload_size = 1 << 30
        desc.throttle_window_size = 0
        lctx = L.link.create_brpc(desc, rank)
        rt = Runtime(lctx, _config(profile=True))
        res = []
        for name, code, in_names, out_names, shares in jobs:
            ex = L.Executable()
            ex.ParseFromString(code)
            for nm, (meta, chunks) in zip(in_names, shares):
                s = L.Share()
                s.meta, s.share_chunks = meta, chunks
                rt.set_var(nm, s)
            lctx.barrier()
            sys.stdout.flush()
            with open(log_path, "rb") as f:
                start = len(f.read())
            t = time.perf_counter()
            rt.run(ex)
            dt = time.perf_counter() - t
            time.sleep(0.05)
            with open(log_path, "rb") as f:
                text = f.read()[start:].decode("utf-8", "replace")
            links = LINK_RE.findall(text)
            if not links:
                raise RuntimeError(f"no 'Link details' line in the SPU log after {name}: {text[-2000:]!r}")
            sb, rb, sa, ra = map(int, links[-1])
            outs = []
            for nm in out_names:
                s = rt.get_var(nm)
                outs.append((s.meta, list(s.share_chunks)))
            res.append({"name": name, "seconds": dt, "send_bytes": sb, "recv_bytes": rb, "send_actions": sa,
                        "recv_actions": ra, "outs": outs})
            for nm in list(in_names) + list(out_names):
                rt.del_var(nm)
        q.put((rank, "ok", res))
    except BaseException as e:  # reported to the parent
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    in_dir, out_dir, names = argv[0], argv[1], argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    import spu.libspu as L
    from spu.api import Io

    io = Io(2, _config(profile=False))
    warm = np.linspace(-1, 1, 64).astype(np.float32)
    jobs = {0: [], 1: []}
    meta = {}
    for name in ["warm-up"] + names:
        if name == "warm-up":
            import jax.numpy as jnp
            import spu.utils.frontend as fe

            ex, _ = fe.compile(fe.Kind.JAX, lambda x, y: (x * y, x < y, jnp.exp(x), 1.0 / (x + 2)), [warm, warm], {},
                               ["in0", "in1"], [L.Visibility.VIS_SECRET] * 2,
                               lambda out: [f"out{i}" for i in range(len(out))])
            args = [warm, warm]
        else:
            data = dict(np.load(os.path.join(in_dir, name.replace(" ", "_").replace("/", "_") + ".npz")))
            t = time.perf_counter()
            ex, args = _compile(name, data)
            meta[name] = {"compile_seconds": time.perf_counter() - t}
        shares = [io.make_shares(a, L.Visibility.VIS_SECRET) for a in args]
        code = ex.SerializeToString()
        for r in (0, 1):
            jobs[r].append((name, code, list(ex.input_names), list(ex.output_names),
                            [(s[r].meta, list(s[r].share_chunks)) for s in shares]))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = _free_ports(2)
    procs = [ctx.Process(target=_party, args=(r, ports, jobs[r], os.path.join(out_dir, f"party{r}.log"), q))
             for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(2):
        rank, kind, res = q.get(timeout=4 * 3600)
        if kind == "err":
            for p in procs:
                p.terminate()
            print(f"SPU party {rank} failed: {res}", file=sys.stderr)
            return 1
        got[rank] = res
    for p in procs:
        p.join(30)
    rows = []
    for k, name in enumerate(["warm-up"] + names):
        r0, r1 = got[0][k], got[1][k]
        outs = []
        for (m0, c0), (m1, c1) in zip(r0["outs"], r1["outs"]):
            s0, s1 = L.Share(), L.Share()
            s0.meta, s0.share_chunks = m0, c0
            s1.meta, s1.share_chunks = m1, c1
            outs.append(np.asarray(io.reconstruct([s0, s1])))
        if name != "warm-up":
            np.savez(os.path.join(out_dir, name.replace(" ", "_").replace("/", "_") + ".out.npz"),
                     **{f"out{i}": o for i, o in enumerate(outs)})
        rows.append({"name": name, "seconds": r0["seconds"], "seconds_party1": r1["seconds"],
                     "bytes": r0["send_bytes"] + r1["send_bytes"],
                     "bytes_recv_check": r0["recv_bytes"] + r1["recv_bytes"],
                     "send_actions": r0["send_actions"] + r1["send_actions"], **meta.get(name, {})})
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""SEAL (tenseal.sealapi, the offload engine's calls) vs Lattigo v6 (cipherlm.he.lattigo_backend)
on the same CKKS operations, same N and prime count, in one run (issue 15).

    make lattigo   # once: native/lattigo/build/libclattigo.so
    .venv/bin/python benchmarks/bench_he_backends.py [--sets "8192:60,40,60;16384:60,40,40,40,60"] [--reps 30] [--json out.json]

Per parameter set: encode (N/2 slots), symmetric encrypt, ct x pt multiply (no rescale), add,
rescale, one rotation, 8 rotations of one ciphertext (SEAL: 8 sequential rotate_vector calls,
it has no hoisting; Lattigo: 8 sequential Rotate calls and one RotateHoisted call of 8 steps;
both: the 8 split over 2 Python threads), a BSGS matrix-vector product with 64 diagonals and a
rescale (SEAL: 8 baby x 8 giant steps in Python, the loop the offload engine runs; Lattigo: one
lintrans call with hoisted baby steps, LOG_BSGS_RATIO), decrypt + decode at all data primes and
at 1 prime (a product rescaled and switched down to q0, what the offload client decrypts).
``--offload-matmul``: instead, the offload mode's one-call matmul on Lattigo
(`cipherlm.he.matmul.apply` on a `LattigoEncodedMatrix`) for SmolLM2-135M's served shapes
(q,k,v 960x576, o 576x576, gate,up 3072x576, down 576x1536, LM head 49152x576; random
weights), one token each: wall and CPU (process) ms, min and median over --reps, error
against numpy, per-token total (30 layers + head); ``--ab OLD_TREE --rounds R``: the same
in child processes, this tree and OLD_TREE (a `git worktree` of an older commit with its own
library built: PYTHONPATH selects which cipherlm, and so which library, a child loads)
alternated R times, then the per-token ratios (issue 15 A/B).

    .venv/bin/python benchmarks/bench_he_backends.py --offload-matmul --ab /tmp/old --rounds 3 --reps 5

Medians over --reps, the two backends interleaved rep by rep so that load changes on a shared
machine hit both; ratio = SEAL / Lattigo (> 1: Lattigo faster).  One thread, one call at a
time, except the 2-thread row.  Also prints nproc, the load average before and after, the CPU
and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tenseal.sealapi as seal

from cipherlm.he import ClientKeys, HEContext, HEParams
from cipherlm.he.lattigo_backend import (
    TEST_INSECURE_PRESET,
    LattigoBackend,
    available,
    chebyshev_coefficients,
    ckks_params,
    library_path,
)

STEPS8 = [1, 2, 3, 4, 5, 6, 7, 8]
N_DIAG, N1 = 64, 8  # the BSGS matvec: 64 diagonals = 8 baby x 8 giant steps (SEAL)
#: Lattigo's log2(baby / giant) for the matvec: the fastest of -1..3 here (its baby steps are
#: hoisted, so more of them cost less than in SEAL)
LOG_BSGS_RATIO = 3
POLY_DEGREE = 7
POLY_ROW = f"Chebyshev degree {POLY_DEGREE} on [-1, 1] (GeLU(4x))"
_POOL = ThreadPoolExecutor(2)


def _two_threads(fn, steps=STEPS8):
    """The 8 steps split over 2 Python threads (ctypes releases the GIL, pybind11-SEAL does not)."""
    half = len(steps) // 2
    t = time.perf_counter()
    for f in [_POOL.submit(fn, steps[:half]), _POOL.submit(fn, steps[half:])]:
        f.result()
    return time.perf_counter() - t


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def _timer(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Seal:
    name = "SEAL 4.3 (tenseal)"

    def __init__(self, params: HEParams, x, w, diags):
        self.ctx = HEContext(params)
        self.keys = ClientKeys(self.ctx)
        self.ev = self.ctx.evaluator
        self.enc = self.ctx.encoder
        self.scale = 2.0 ** params.coeff_modulus_bits[-2]
        self.pid = self.ctx.parms_id_at(len(self.ctx.coeff_moduli))
        self.gk = self.keys.galois_keys(STEPS8)
        self.x, self.w = x.tolist(), w.tolist()
        self.pt_x, self.pt_w = self._encode(self.x), self._encode(self.w)
        self.ct = self.keys.encrypt(self.pt_x)
        self.ct2 = self.keys.encrypt(self.pt_w)
        self.prod = seal.Ciphertext()
        self.ev.multiply_plain(self.ct, self.pt_w, self.prod)
        # BSGS: y = sum_j rot_{j n1}(sum_i roll(v_{j n1 + i}, j n1) * rot_i(x)), as he.matmul does
        self.diags = diags
        self.gk_bsgs = self.keys.galois_keys(list(range(1, N1)) + [j * N1 for j in range(1, N_DIAG // N1)])
        self.bsgs_pts = [[self._encode(np.roll(diags[j * N1 + i], j * N1).tolist()) for i in range(N1)]
                         for j in range(N_DIAG // N1)]
        self.rk = seal.RelinKeys()
        self.keys._keygen.create_relin_keys(self.rk)
        self.low = seal.Ciphertext()  # the product rescaled, then down to q0 (what offload decrypts)
        self.ev.rescale_to_next(self.prod, self.low)
        self.ev.mod_switch_to_inplace(self.low, self.ctx.parms_id_at(1))

    def mul_relin(self):
        out = seal.Ciphertext()
        self.ev.multiply(self.ct, self.ct2, out)
        self.ev.relinearize_inplace(out, self.rk)
        return out

    def _encode(self, v):
        pt = seal.Plaintext()
        self.enc.encode(v, self.pid, self.scale, pt)
        return pt

    def ops(self):
        ev, ct, gk = self.ev, self.ct, self.gk
        out = seal.Ciphertext()
        outs = [seal.Ciphertext() for _ in STEPS8]

        def rescale():
            return _timer(lambda: ev.rescale_to_next(self.prod, out))

        def add():
            return _timer(lambda: ev.add(ct, ct, out))

        def dec(c):
            pt = seal.Plaintext()
            self.keys._decryptor.decrypt(c, pt)
            return self.enc.decode_double(pt)

        return {
            "encode": lambda: _timer(lambda: self._encode(self.x)),
            "encrypt": lambda: _timer(lambda: self.keys.encrypt(self.pt_x)),
            "ct x pt": lambda: _timer(lambda: ev.multiply_plain(ct, self.pt_w, out)),
            "ct x ct + relin": lambda: _timer(self.mul_relin),
            POLY_ROW: None,  # no polynomial evaluator in SEAL (nor in this wrapper)
            "add": add,
            "rescale": rescale,
            "rotate": lambda: _timer(lambda: ev.rotate_vector(ct, 1, gk, out)),
            "8 rotations (sequential)": lambda: _timer(
                lambda: [ev.rotate_vector(ct, s, gk, outs[i]) for i, s in enumerate(STEPS8)]),
            "8 rotations (hoisted)": None,
            f"BSGS matvec, {N_DIAG} diagonals + rescale": lambda: _timer(self.bsgs),
            "8 rotations (2 threads x 4)": lambda: _two_threads(
                lambda st: [ev.rotate_vector(ct, s, gk, seal.Ciphertext()) for s in st]),
            "decrypt + decode (all data primes)": lambda: _timer(lambda: dec(ct)),
            "decrypt + decode (1 prime)": lambda: _timer(lambda: dec(self.low)),
        }

    def bsgs(self):
        ev, gk, ct = self.ev, self.gk_bsgs, self.ct
        baby = [ct] + [seal.Ciphertext() for _ in range(1, N1)]
        for i in range(1, N1):
            ev.rotate_vector(ct, i, gk, baby[i])
        acc, t = None, seal.Ciphertext()
        for j, row in enumerate(self.bsgs_pts):
            inner = seal.Ciphertext()
            ev.multiply_plain(baby[0], row[0], inner)
            for i in range(1, N1):
                ev.multiply_plain(baby[i], row[i], t)
                ev.add_inplace(inner, t)
            if j:
                ev.rotate_vector_inplace(inner, j * N1, gk)
            if acc is None:
                acc = inner
            else:
                ev.add_inplace(acc, inner)
        ev.rescale_to_next_inplace(acc)
        return acc

    def bsgs_error(self, want) -> float:
        pt = seal.Plaintext()
        self.keys._decryptor.decrypt(self.bsgs(), pt)
        return float(np.abs(np.asarray(self.enc.decode_double(pt)) - want).max())

    def error(self, want) -> float:
        c = seal.Ciphertext()
        self.ev.rescale_to_next(self.prod, c)
        pt = seal.Plaintext()
        self.keys._decryptor.decrypt(c, pt)
        return float(np.abs(np.asarray(self.enc.decode_double(pt)) - want).max())


class Lattigo:
    name = "Lattigo v6.2.0"

    def __init__(self, params: HEParams, x, w, diags):
        self.be = be = LattigoBackend()
        self.ctx = be.context(params)
        self.keys = be.keygen(self.ctx)
        self.gk = self.keys.galois_keys(STEPS8)
        self.x, self.w = x, w
        self.pt_x, self.pt_w = be.encode_slots(self.ctx, x), be.encode_slots(self.ctx, w)
        self.ct = self.keys.encrypt(self.pt_x)
        self.ct2 = self.keys.encrypt(self.pt_w)
        self.ev = self.keys.eval_keys(relin=True)
        self.cheb = chebyshev_coefficients(lambda v: _gelu(4 * v), POLY_DEGREE, (-1, 1))
        self.prod = be.multiply_plain(self.ctx, self.ct, self.pt_w)
        self.lt = be.linear_transform_encode(self.ctx, dict(enumerate(diags)), log_bsgs_ratio=LOG_BSGS_RATIO)
        self.gk_lt = self.keys.galois_keys_for_elements(self.lt.galois_elements())
        self.low = be.ciphertext_from_bytes(self.ctx, be.ciphertext_to_bytes(self.prod))
        be.rescale_inplace(self.ctx, self.low)
        be.mod_switch_to_inplace(self.ctx, self.low, be.level(self.ctx, 1))

    def ops(self):
        be, ctx, ct, gk = self.be, self.ctx, self.ct, self.gk
        out = be.multiply_plain(ctx, ct, self.pt_w)

        def rescale():
            c = be.ciphertext_from_bytes(ctx, be.ciphertext_to_bytes(self.prod))
            t = time.perf_counter()
            be.rescale_inplace(ctx, c)
            return time.perf_counter() - t

        def add():
            c = be.ciphertext_from_bytes(ctx, be.ciphertext_to_bytes(ct))
            t = time.perf_counter()
            be.add_inplace(ctx, c, ct)
            return time.perf_counter() - t

        return {
            "encode": lambda: _timer(lambda: be.encode_slots(ctx, self.x)),
            "encrypt": lambda: _timer(lambda: self.keys.encrypt(self.pt_x)),
            "ct x pt": lambda: _timer(lambda: be.multiply_plain(ctx, ct, self.pt_w, out=out)),
            "ct x ct + relin": lambda: _timer(lambda: be.multiply(ctx, ct, self.ct2, self.ev)),
            POLY_ROW: (lambda: _timer(lambda: be.evaluate_chebyshev(ctx, ct, self.cheb, (-1, 1), self.ev)))
            if ctx.max_level >= be.chebyshev_levels(POLY_DEGREE) else None,
            "add": add,
            "rescale": rescale,
            "rotate": lambda: _timer(lambda: be.rotate_rows(ctx, ct, 1, gk)),
            "8 rotations (sequential)": lambda: _timer(lambda: [be.rotate_rows(ctx, ct, s, gk) for s in STEPS8]),
            "8 rotations (hoisted)": lambda: _timer(lambda: be.rotate_hoisted(ctx, ct, STEPS8, gk)),
            f"BSGS matvec, {N_DIAG} diagonals + rescale": lambda: _timer(self.bsgs),
            "8 rotations (2 threads x 4)": lambda: _two_threads(
                lambda st: [be.rotate_rows(ctx, ct, s, gk) for s in st]),
            "decrypt + decode (all data primes)": lambda: _timer(lambda: be.decode_slots(ctx, self.keys.decrypt(ct))),
            "decrypt + decode (1 prime)": lambda: _timer(lambda: be.decode_slots(ctx, self.keys.decrypt(self.low))),
        }

    def bsgs(self):
        y = self.be.linear_transform(self.ctx, self.ct, self.lt, self.gk_lt)
        self.be.rescale_inplace(self.ctx, y)
        return y

    def bsgs_error(self, want) -> float:
        return float(np.abs(self.be.decode_slots(self.ctx, self.keys.decrypt(self.bsgs())) - want).max())

    def error(self, want) -> float:
        c = self.be.ciphertext_from_bytes(self.ctx, self.be.ciphertext_to_bytes(self.prod))
        self.be.rescale_inplace(self.ctx, c)
        return float(np.abs(self.be.decode_slots(self.ctx, self.keys.decrypt(c)) - want).max())


def bench_set(n: int, bits: tuple[int, ...], reps: int) -> dict:
    params = ckks_params(f"bench-ckks-{n}", n, bits)
    rng = np.random.default_rng(0)
    x, w = rng.uniform(-1, 1, n // 2), rng.uniform(-1, 1, n // 2)
    diags = rng.uniform(-1, 1, (N_DIAG, n // 2)) / 8
    s, l = Seal(params, x, w, diags), Lattigo(params, x, w, diags)
    so, lo = s.ops(), l.ops()
    rows = []
    for op in so:
        fs, fl = so[op], lo[op]
        ts, tl = [], []
        for f in (fs, fl):  # warm-up
            if f is not None:
                f()
        for _ in range(reps):
            if fs is not None:
                ts.append(fs())
            if fl is not None:
                tl.append(fl())
        ms = statistics.median(ts) * 1e3 if ts else None
        ml = statistics.median(tl) * 1e3 if tl else None
        rows.append({"op": op, "seal_ms": ms, "lattigo_ms": ml, "ratio": (ms / ml) if ms and ml else None})
    hoisted = next(r for r in rows if r["op"] == "8 rotations (hoisted)")
    seq = next(r for r in rows if r["op"] == "8 rotations (sequential)")
    hoisted["ratio"] = seq["seal_ms"] / hoisted["lattigo_ms"]  # SEAL's only option is sequential
    want = x * w
    want_mv = sum(diags[d] * np.roll(x, -d) for d in range(N_DIAG))
    return {"n": n, "bits": list(bits), "slots": n // 2, "rows": rows,
            "max_err_mul_rescale": {"seal": s.error(want), "lattigo": l.error(want)},
            "max_err_bsgs": {"seal": s.bsgs_error(want_mv), "lattigo": l.bsgs_error(want_mv)}}


def bench_bootstrap(preset: str, reps: int) -> dict:
    """Lattigo's CKKS bootstrapping at a preset (`LattigoContext.from_preset`): key generation
    once, then per rep one bootstrap of a level-0 ciphertext (full slots, uniform [-1, 1]), a
    degree-15 Chebyshev GeLU on [-8, 8] and a ct x ct product with relinearisation at the top
    level.  SEAL has no bootstrapping (nor polynomial evaluator): not applicable.  Peak RSS is
    the process's (ru_maxrss)."""
    be = LattigoBackend()
    ctx = be.bootstrappable_context(preset, allow_insecure_for_tests=preset == TEST_INSECURE_PRESET)
    keys = be.keygen(ctx)
    rss0 = _peak_rss_gb()
    t = time.perf_counter()
    bk = keys.bootstrapping_keys()
    keygen_s = time.perf_counter() - t
    ev = keys.eval_keys(relin=True)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, ctx.slots)
    c0 = keys.encrypt(be.encode_slots(ctx, x, level=0))
    top = keys.encrypt(be.encode_slots(ctx, x))
    top2 = keys.encrypt(be.encode_slots(ctx, rng.uniform(-1, 1, ctx.slots)))
    cheb = chebyshev_coefficients(_gelu, 15, (-8, 8))
    xg = 8 * x
    topg = keys.encrypt(be.encode_slots(ctx, xg))
    t_btp, t_poly, t_mul, errs = [], [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        r = be.bootstrap(ctx, c0, bk)
        t_btp.append(time.perf_counter() - t)
        errs.append(float(np.abs(be.decode_slots(ctx, keys.decrypt(r)) - x).max()))
        t_poly.append(_timer(lambda: be.evaluate_chebyshev(ctx, topg, cheb, (-8, 8), ev)))
        t_mul.append(_timer(lambda: be.multiply(ctx, top, top2, ev)))
    g = be.evaluate_chebyshev(ctx, topg, cheb, (-8, 8), ev)
    poly_err = float(np.abs(be.decode_slots(ctx, keys.decrypt(g)) - np.polynomial.chebyshev.chebval(x, cheb)).max())
    out = {"preset": preset, "n": ctx.n, "slots": ctx.slots, "test_only": ctx.test_only,
           "log_qp_bootstrap": round(ctx.bootstrap_log_qp, 1), "keygen_s": round(keygen_s, 2),
           "key_bytes": bk.size_bytes, "galois_keys": bk.n_galois_keys, "out_level": r.level, "depth": bk.depth,
           "bootstrap_s_median": round(statistics.median(t_btp), 3), "bootstrap_s_all": [round(v, 3) for v in t_btp],
           "bootstrap_precision_bits_min": round(-np.log2(max(errs)), 2),
           "poly15_ms_median": round(statistics.median(t_poly) * 1e3, 1), "poly15_err_bits": round(-np.log2(poly_err), 2),
           "mul_relin_ms_median": round(statistics.median(t_mul) * 1e3, 2),
           "peak_rss_gb": round(_peak_rss_gb(), 2), "rss_before_keygen_gb": round(rss0, 2), "reps": reps}
    bk.close()
    return out


def _print_bootstrap(b: dict) -> None:
    print(f"\nBootstrapping: {b['preset']}{' (INSECURE, test only)' if b['test_only'] else ''}, N = {b['n']}, "
          f"{b['slots']} slots, log2 QP = {b['log_qp_bootstrap']}; {b['reps']} reps")
    print("| operation | SEAL | Lattigo |")
    print("|---|---|---:|")
    na = "n/a: SEAL has no bootstrapping"
    print(f"| bootstrapping keygen (s) | {na} | {b['keygen_s']:.1f} |")
    print(f"| bootstrapping keys (Lattigo binary size) | {na} | {b['key_bytes'] / 1e9:.2f} GB, "
          f"{b['galois_keys']} Galois keys |")
    print(f"| one bootstrap, level 0 -> {b['out_level']} (s, median) | {na} | {b['bootstrap_s_median']:.2f} |")
    print(f"| bootstrap precision (min bits over slots) | {na} | {b['bootstrap_precision_bits_min']} |")
    print(f"| Chebyshev degree 15 GeLU on [-8, 8] at the top level (ms) | n/a: no polynomial evaluator | "
          f"{b['poly15_ms_median']:.1f} ({b['poly15_err_bits']} bits vs numpy) |")
    print(f"| ct x ct + relin at the top level (ms) | - (not run at this N) | {b['mul_relin_ms_median']:.2f} |")
    print(f"| peak RSS of the process (GB) | - | {b['peak_rss_gb']:.2f} (before keygen {b['rss_before_keygen_gb']:.2f}) |")


#: SmolLM2-135M's offload groups as served, (d_out, d_in), and how many per token
MATMUL_SHAPES = {"qkv": ((960, 576), 30), "o": ((576, 576), 30), "gate_up": ((3072, 576), 30),
                 "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}


def bench_offload_matmul(names, reps: int, workers: int = 1) -> dict:
    """One token through each named shape on the Lattigo offload matmul (in this process)."""
    from cipherlm.he import OFFLOAD_CKKS
    from cipherlm.he import matmul as mm

    ctx = mm.make_context(OFFLOAD_CKKS, "lattigo")
    keys = mm.client_keys(ctx)
    rng = np.random.default_rng(0)
    out = {}
    for name in names:
        (d_out, d_in), per_token = MATMUL_SHAPES[name]
        W = rng.standard_normal((d_out, d_in)) * 0.04  # no bias: SmolLM2's projections have none
        plan = mm.plan_matmul(d_out, d_in, ctx.slots, backend="lattigo")
        enc = mm.encode_matrix(ctx, W, None, plan)
        enc.workers = workers
        gk = mm.load_galois_keys(ctx, keys.galois_keys_bytes(plan.rotation_steps), [plan])
        x = rng.standard_normal(d_in)
        ct = mm.encrypt_input(keys, x, plan)
        mm.apply(enc, ct, gk)  # warm-up
        wall, cpu = [], []
        for _ in range(reps):
            c0, t0 = time.process_time(), time.perf_counter()
            res = mm.apply(enc, ct, gk)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        y = mm.decrypt_output(keys, res, plan)
        err = float(np.max(np.abs(y - W @ x)) / (np.max(np.abs(W)) * np.max(np.abs(x))))
        out[name] = {"shape": [d_out, d_in], "per_token": per_token,
                     "plan": {k: getattr(plan, k) for k in ("c", "m", "n_blocks", "g", "b")},
                     "wall_ms_min": min(wall) * 1e3, "wall_ms_median": statistics.median(wall) * 1e3,
                     "cpu_ms_min": min(cpu) * 1e3, "cpu_ms_median": statistics.median(cpu) * 1e3,
                     "max_rel_err": err}
        del enc
    return out


def _per_token(res: dict, key: str) -> float:
    return sum(r[key] * r["per_token"] for r in res.values()) / 1e3


def offload_matmul_main(args) -> None:
    names = args.shapes.split(",")
    if not args.ab:
        res = bench_offload_matmul(names, args.reps, args.workers)
        if args.child:
            print(json.dumps(res))
            return
        _print_matmul({"this tree": [res]}, names)
        return
    trees = {"new (this tree)": str(Path(__file__).resolve().parents[1]), "old": str(Path(args.ab).resolve())}
    runs: dict[str, list] = {k: [] for k in trees}
    loads = []
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for label in order:
            env = dict(os.environ, PYTHONPATH=trees[label])
            env.pop("CIPHERLM_LATTIGO_LIB", None)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--offload-matmul", "--child", "--shapes", args.shapes,
                   "--reps", str(args.reps), "--workers", str(args.workers)]
            load = _load()
            t0 = time.strftime("%H:%M:%S")
            # cwd outside both trees: PYTHONPATH alone picks the cipherlm (and so the library)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd="/")
            if p.returncode != 0:
                sys.exit(f"{label} child failed:\n{p.stderr[-3000:]}")
            runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
            loads.append((rnd + 1, label, t0, load))
            print(f"# round {rnd + 1} {label} started {t0} UTC, load {load}: per token CPU "
                  f"{_per_token(runs[label][-1], 'cpu_ms_min'):.2f} s", file=sys.stderr, flush=True)
    _print_matmul(runs, names)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "loads": loads, "command": " ".join(sys.argv)}, indent=1))


def _print_matmul(runs: dict, names) -> None:
    print(f"# offload matmul on Lattigo, one token per shape; {time.strftime('%Y-%m-%d %H:%M %Z')}, "
          f"nproc {os.cpu_count()}, cpu {_cpu()}, load now {_load()}")
    print("| tree | shape | plan c/m/blocks/g/b | CPU ms (min over rounds of the min) | wall ms (same) | max rel err |")
    print("|---|---|---|---:|---:|---:|")
    best = {}
    for label, rs in runs.items():
        for name in names:
            r0 = rs[0][name]
            p = r0["plan"]
            cpu = min(r[name]["cpu_ms_min"] for r in rs)
            wall = min(r[name]["wall_ms_min"] for r in rs)
            err = max(r[name]["max_rel_err"] for r in rs)
            best[(label, name)] = cpu
            print(f"| {label} | {name} {r0['shape'][0]}x{r0['shape'][1]} | {p['c']}/{p['m']}/{p['n_blocks']}/{p['g']}/{p['b']} "
                  f"| {cpu:.1f} | {wall:.1f} | {err:.1e} |")
    for label, rs in runs.items():
        cpu = [_per_token(r, "cpu_ms_min") for r in rs]
        wall = [_per_token(r, "wall_ms_min") for r in rs]
        print(f"# {label}: per token (30 layers + head, min per shape) CPU s per round {', '.join(f'{c:.2f}' for c in cpu)}; "
              f"wall s {', '.join(f'{w:.2f}' for w in wall)}")
    labels = list(runs)
    if len(labels) == 2 and all(n in MATMUL_SHAPES for n in names):
        a, b = labels
        for name in names:
            print(f"# CPU ratio {b} / {a}, {name}: {best[(b, name)] / best[(a, name)]:.2f}")


def _fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="8192:60,40,60;16384:60,40,40,40,60",
                    help="N:bits,... (the last prime is the special prime); several separated by ';'")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--offload-matmul", action="store_true", help="time the offload matmul on Lattigo instead")
    ap.add_argument("--shapes", default=",".join(MATMUL_SHAPES), help="--offload-matmul: which of " + ",".join(MATMUL_SHAPES))
    ap.add_argument("--workers", type=int, default=1, help="--offload-matmul: goroutines per request")
    ap.add_argument("--ab", help="--offload-matmul: an older tree (git worktree, library built) to alternate with")
    ap.add_argument("--rounds", type=int, default=3, help="--offload-matmul --ab: alternations")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", metavar="PRESET",
                    help=f"also time Lattigo's bootstrapping at PRESET (N16QP1546H192H32: several GB, "
                         f"about a minute of keygen; {TEST_INSECURE_PRESET}: insecure, seconds)")
    ap.add_argument("--bootstrap-reps", type=int, default=3)
    args = ap.parse_args()
    if not available():
        sys.exit(f"Lattigo library {library_path()} not built: run `make lattigo`")
    if args.offload_matmul:
        offload_matmul_main(args)
        return
    load0 = _load()
    t0 = time.time()
    results = []
    for spec in filter(None, args.sets.split(";")):
        n_s, bits_s = spec.split(":")
        results.append(bench_set(int(n_s), tuple(int(b) for b in bits_s.split(",")), args.reps))
    btp = bench_bootstrap(args.bootstrap, args.bootstrap_reps) if args.bootstrap else None
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "nproc": os.cpu_count(),
        "nproc_cmd": subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip(),
        "cpu": _cpu(),
        "loadavg_before": load0,
        "loadavg_after": _load(),
        "wall_s": round(time.time() - t0, 1),
        "reps": args.reps,
    }
    print("# HE backends: SEAL 4.3 (tenseal) vs Lattigo v6.2.0, CKKS, one thread")
    print(f"# {info['date']}  nproc={info['nproc_cmd']}  cpu={info['cpu']}")
    print(f"# loadavg before {info['loadavg_before']}  after {info['loadavg_after']}  wall {info['wall_s']} s")
    print(f"# command: {info['command']}")
    for r in results:
        print(f"\nN = {r['n']}, primes {r['bits']} bits (last = special), {r['slots']} slots; "
              f"median of {args.reps} reps, ms")
        print("| operation | SEAL ms | Lattigo ms | SEAL / Lattigo |")
        print("|---|---:|---:|---:|")
        for row in r["rows"]:
            note = " (vs SEAL sequential)" if row["op"] == "8 rotations (hoisted)" else ""
            print(f"| {row['op']} | {_fmt(row['seal_ms'])} | {_fmt(row['lattigo_ms'])} | "
                  f"{_fmt(row['ratio'], 2)}{note} |")
        e = r["max_err_mul_rescale"]
        print(f"\nmax |error| of x*w after rescale (|x|, |w| <= 1): SEAL {e['seal']:.2e}, Lattigo {e['lattigo']:.2e}")
        e = r["max_err_bsgs"]
        print(f"max |error| of the BSGS matvec (|y| <= 8): SEAL {e['seal']:.2e}, Lattigo {e['lattigo']:.2e}")
    if btp:
        _print_bootstrap(btp)
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "results": results, "bootstrap": btp}, indent=1))


if __name__ == "__main__":
    main()

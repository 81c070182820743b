#!/usr/bin/env python3
"""Concrete ML 1.9.0 ``HybridFHEModel`` as a peer of cipherlm's offload mode.

Runs ONLY inside the peer venv made by ``benchmarks/setup_peers.sh``::

    .peers/concrete/bin/python benchmarks/concrete_ml_peer.py 64x64 576x576 \
        --calls 3 --json reports/concrete_ml_peer.json

For each ``DINxDOUT`` shape: a torch model holding one ``nn.Linear(DIN, DOUT)``
(random weights, fixed seed) is wrapped with ``HybridFHEModel`` with that
linear as the remote module, compiled on a calibration set, and then called on
ONE token (input shape (1, DIN), as in token-by-token decode) in an FHE mode
that really encrypts. Concrete ML picks one of two back ends by itself:

* ``tfhe`` (Concrete Python circuit, any layer with DIN<512 or DOUT<512):
  run in ``fhe="remote"`` mode. The wheel has no REST server, so the HTTP
  calls the client makes (``requests.get/post`` in hybrid_model.py) are
  answered in-process by Concrete ML's own ``HybridFHEModelServer`` over the
  directory written by ``save_and_clear_private_info``. Bytes are the exact
  bodies the client would send/receive: ``quantize_encrypt_serialize()``
  output (up), the server's ``FHEModelServer.run`` result (down), and the
  ``get_serialized_evaluation_keys()`` upload (key, once). Time per call is
  the whole ``hybrid_model(x, fhe="remote")`` (client encrypt + server, which
  re-loads and deserialises the evaluation key per call as Concrete ML's
  server does, + client decrypt), without network time.
* ``glwe`` (concrete-ml-extensions GLWE matmul, chosen when every remote
  layer is an nn.Linear with DIN>=512 and DOUT>=512): Concrete ML 1.9.0
  asserts "Remote optimized linear layers are not yet implemented" in remote
  mode, so it is run in ``fhe="execute"`` mode (client and server in one
  process). The executor's extension calls are wrapped so every encrypted
  input is ``serialize()``d and deserialised before the server matmul, and
  every encrypted result likewise before decryption: bytes up/down are those
  serialised sizes, key bytes the serialised compression key (the only key
  a server needs). Time per call includes these (de)serialisations.

``--backend tfhe`` forces the Concrete Python path even for >=512 layers
(what Concrete ML does when concrete-ml-extensions is absent).

No cipherlm import: this file must work with only the peer venv.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

try:
    import importlib.metadata as _md

    import concrete.ml.torch.hybrid_model as hm
    from concrete.ml.quantization.linear_op_glwe_backend import has_glwe_backend
    from concrete.ml.torch.hybrid_model import HybridFHEModel, HybridFHEModelServer
except ImportError as exc:  # pragma: no cover
    sys.exit(
        f"concrete-ml not importable ({exc}); run benchmarks/setup_peers.sh and use "
        ".peers/concrete/bin/python"
    )

CML_VERSION = _md.version("concrete-ml")
SERVER_URL = "http://in-process-emulated-server"


class OneLinear(nn.Module):
    """The smallest model that has the linear layer as a named sub-module."""

    def __init__(self, din: int, dout: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(din, dout, bias=bias)

    def forward(self, x):
        return self.fc(x)


def parse_shape(s: str) -> tuple[int, int]:
    try:
        a, b = s.lower().split("x")
        return int(a), int(b)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"shape must be DINxDOUT, got {s!r}") from exc


# --------------------------------------------------------------------------
# tfhe back end: fhe="remote" against an in-process HybridFHEModelServer
# --------------------------------------------------------------------------


class _Resp:
    def __init__(self, status: int, content: bytes = b"", js=None):
        self.status_code = status
        self.content = content
        self._js = js

    def json(self):
        return self._js


class InProcessTransport:
    """Stands in for the ``requests`` module inside hybrid_model.py.

    Routes the client's HTTP calls to Concrete ML's HybridFHEModelServer and
    records the byte count of every request/response body.
    """

    def __init__(self, server: HybridFHEModelServer):
        self.server = server
        self.log: list[dict] = []

    @staticmethod
    def _route(url: str) -> str:
        assert url.startswith(SERVER_URL), url
        return url[len(SERVER_URL):]

    def get(self, url, data=None, **_):
        route = self._route(url)
        try:
            if route == "/list_shapes":
                shapes = list(self.server.list_shapes(data["model_name"], data["module_name"]))
                return _Resp(200, json.dumps(shapes).encode(), shapes)
            if route == "/get_client":
                path = self.server.get_client(
                    data["model_name"], data["module_name"], data["input_shape"]
                )
                body = Path(path).read_bytes()
                self.log.append({"route": route, "down": len(body)})
                return _Resp(200, body)
        except ValueError as exc:
            return _Resp(500, str(exc).encode())
        return _Resp(404, f"no route {route}".encode())

    def post(self, url, data=None, files=None, **_):
        route = self._route(url)
        if route == "/add_key":
            key = files["key"].getvalue()
            out = self.server.add_key(
                key, data["model_name"], data["module_name"], data["input_shape"]
            )
            self.log.append({"route": route, "up": len(key)})
            return _Resp(200, json.dumps(out).encode(), out)
        if route == "/compute":
            body = files["model_input"].getvalue()
            t0 = time.perf_counter()
            res = self.server.compute(
                body, data["uid"], data["model_name"], data["module_name"], data["input_shape"]
            )
            t1 = time.perf_counter()
            self.log.append(
                {"route": route, "up": len(body), "down": len(res), "server_s": t1 - t0}
            )
            return _Resp(200, res)
        return _Resp(404, f"no route {route}".encode())


def run_tfhe_remote(hybrid, model_name, xs, workdir: Path, log):
    """Save for the server, start the emulated one, init the client, run calls."""
    model_dir = workdir / "server_models"
    (model_dir / model_name).mkdir(parents=True)
    t0 = time.perf_counter()
    hybrid.save_and_clear_private_info(model_dir / model_name, via_mlir=True)
    log(f"    saved server artefacts in {time.perf_counter() - t0:.1f}s")
    server = HybridFHEModelServer(workdir / "server_keys", model_dir, None)
    transport = InProcessTransport(server)
    real_requests = hm.requests
    hm.requests = transport  # the client code calls requests.get/post
    try:
        t0 = time.perf_counter()
        hybrid.init_client(
            path_to_clients=workdir / "clients", path_to_keys=workdir / "client_keys"
        )
        keygen_s = time.perf_counter() - t0
        key_bytes = sum(e["up"] for e in transport.log if e["route"] == "/add_key")
        client_zip = sum(e["down"] for e in transport.log if e["route"] == "/get_client")
        log(f"    client init + keygen {keygen_s:.1f}s, eval key {key_bytes} B")
        # warm-up (the server loads / compiles its circuit on first use)
        t0 = time.perf_counter()
        hybrid(xs[0], fhe="remote")
        warm_s = time.perf_counter() - t0
        log(f"    warm-up call {warm_s:.2f}s")
        transport.log.clear()
        times, outs = [], []
        for x in xs:
            t0 = time.perf_counter()
            y = hybrid(x, fhe="remote")
            times.append(time.perf_counter() - t0)
            outs.append(y.detach().numpy())
        calls = [e for e in transport.log if e["route"] == "/compute"]
        assert len(calls) == len(xs), "expected exactly one /compute per one-token call"
    finally:
        hm.requests = real_requests
    return {
        "mode": 'fhe="remote" (in-process HybridFHEModelServer)',
        "times": times,
        "outs": outs,
        "bytes_up": [c["up"] for c in calls],
        "bytes_down": [c["down"] for c in calls],
        "server_s": [c["server_s"] for c in calls],
        "key_bytes": key_bytes,
        "keygen_s": keygen_s,
        "warmup_s": warm_s,
        "client_zip_bytes": client_zip,
    }


# --------------------------------------------------------------------------
# glwe back end: fhe="execute" with serialisation of each ciphertext
# --------------------------------------------------------------------------


class WireFhext:
    """Proxy of concrete_ml_extensions used by GLWELinearLayerExecutor.

    Serialises every ciphertext that would cross the wire and deserialises it
    on the other side, recording sizes and per-step times.
    """

    def __init__(self, fhext):
        self._f = fhext
        self.events: list[dict] = []

    def __getattr__(self, name):
        return getattr(self._f, name)

    def encrypt_matrix(self, **kw):
        t0 = time.perf_counter()
        ct = self._f.encrypt_matrix(**kw)
        blob = ct.serialize()
        t1 = time.perf_counter()
        self.events.append({"kind": "up", "bytes": len(blob), "client_s": t1 - t0})
        return self._f.EncryptedMatrix.deserialize(blob)

    def matrix_multiplication(self, **kw):
        t0 = time.perf_counter()
        res = self._f.matrix_multiplication(**kw)
        blob = res.serialize()
        t1 = time.perf_counter()
        self.events.append({"kind": "down", "bytes": len(blob), "server_s": t1 - t0})
        return self._f.CompressedResultEncryptedMatrix.deserialize(blob)


def run_glwe_execute(hybrid, xs, log):
    ex = hybrid.executor
    assert ex is not None, "GLWE executor expected"
    wire = WireFhext(ex.fhext)
    ex.fhext = wire
    t0 = time.perf_counter()
    ex.keygen()
    keygen_s = time.perf_counter() - t0
    key_bytes = len(ex.compression_key.serialize())
    log(f"    GLWE keygen {keygen_s:.2f}s, compression key {key_bytes} B")
    t0 = time.perf_counter()
    hybrid(xs[0], fhe="execute")
    warm_s = time.perf_counter() - t0
    wire.events.clear()
    times, outs, per_call = [], [], []
    for x in xs:
        wire.events.clear()
        t0 = time.perf_counter()
        y = hybrid(x, fhe="execute")
        times.append(time.perf_counter() - t0)
        outs.append(y.detach().numpy())
        per_call.append(list(wire.events))
    for ev in per_call:
        assert sum(e["kind"] == "up" for e in ev) == 1, "expected one encrypted input per call"
    return {
        "mode": 'fhe="execute" (GLWE executor; ciphertexts serialised/deserialised)',
        "times": times,
        "outs": outs,
        "bytes_up": [sum(e["bytes"] for e in ev if e["kind"] == "up") for ev in per_call],
        "bytes_down": [sum(e["bytes"] for e in ev if e["kind"] == "down") for ev in per_call],
        "server_s": [sum(e.get("server_s", 0.0) for e in ev) for ev in per_call],
        "key_bytes": key_bytes,
        "keygen_s": keygen_s,
        "warmup_s": warm_s,
    }


# --------------------------------------------------------------------------


def quant_bits(hybrid, name="fc"):
    """Actual bit widths of the compiled quantised module (input, weights)."""
    qm = hybrid.private_q_modules[name]
    info = {"input_n_bits": int(qm.input_quantizers[0].quant_options.n_bits)}
    try:
        _, op = next(iter(qm.quant_layers_dict.values()))
        w = list(op.constant_inputs.values())[0]
        info["weight_n_bits"] = int(w.quantizer.quant_options.n_bits)
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def bench_shape(din, dout, args, log):
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    model = OneLinear(din, dout, bias=not args.no_bias).eval()
    reference = copy.deepcopy(model)
    calib = torch.randn(args.calib, din)
    xs = [torch.randn(1, din) for _ in range(args.calls)]
    with torch.no_grad():
        refs = [reference(x).numpy() for x in xs]

    backend_forced = args.backend == "tfhe"
    real_has_glwe = hm.has_glwe_backend
    if backend_forced:
        hm.has_glwe_backend = lambda: False
    try:
        model_name = f"linear_{din}x{dout}"
        hybrid = HybridFHEModel(
            model, module_names="fc", server_remote_address=SERVER_URL, model_name=model_name
        )
        backend = (
            "glwe"
            if hybrid._has_only_large_linear_layers and hm.has_glwe_backend()  # noqa: SLF001
            else "tfhe"
        )
        log(f"  {din}x{dout}: backend {backend}; compiling on {args.calib} calibration rows")
        t0 = time.perf_counter()
        hybrid.compile_model(calib, n_bits=args.n_bits)
        compile_s = time.perf_counter() - t0
        log(f"    compile {compile_s:.1f}s")
        bits = quant_bits(hybrid)
        # quantised-but-clear output: separates quantisation error from FHE noise
        with torch.no_grad():
            qclear = [hybrid(x, fhe="disable").numpy() for x in xs]
        with tempfile.TemporaryDirectory(prefix="cml_peer_") as tmp:
            if backend == "glwe":
                r = run_glwe_execute(hybrid, xs, log)
            else:
                r = run_tfhe_remote(hybrid, model_name, xs, Path(tmp), log)
    finally:
        hm.has_glwe_backend = real_has_glwe

    err = max(float(np.max(np.abs(o - f))) for o, f in zip(r["outs"], refs))
    qerr = max(float(np.max(np.abs(q - f))) for q, f in zip(qclear, refs))
    fhe_vs_q = max(float(np.max(np.abs(o - q))) for o, q in zip(r["outs"], qclear))
    ref_scale = max(float(np.max(np.abs(f))) for f in refs)
    med = statistics.median(r["times"])
    notes = (
        f"Concrete ML {CML_VERSION} HybridFHEModel, remote module = nn.Linear({din},{dout}"
        f"{', bias' if not args.no_bias else ''}), backend={backend}"
        f"{' (forced)' if backend_forced else ''}, mode {r['mode']}. "
        f"One token per call (input (1,{din})), median of {len(r['times'])} calls after one "
        "warm-up; wall time = client quantise+encrypt+serialise, server compute, "
        "client deserialise+decrypt+dequantise, in one process, no network time; "
        f"torch threads={torch.get_num_threads()} on {os.cpu_count()} CPUs. "
        "bytes_up/down = serialised encrypted input/output per call; key_bytes = "
        "serialised server-side key sent once "
        + ("(compression key)." if backend == "glwe" else "(evaluation keys).")
    )
    return {
        "shape": f"{din}x{dout}",
        "din": din,
        "dout": dout,
        "backend": backend,
        "mode": r["mode"],
        "seconds_per_call": med,
        "seconds_per_call_all": r["times"],
        "server_seconds_per_call": statistics.median(r["server_s"]),
        "bytes_up_per_call": int(statistics.median(r["bytes_up"])),
        "bytes_down_per_call": int(statistics.median(r["bytes_down"])),
        "key_bytes": int(r["key_bytes"]),
        "keygen_seconds": r["keygen_s"],
        "compile_seconds": compile_s,
        "warmup_seconds": r["warmup_s"],
        "n_bits": args.n_bits,
        **bits,
        "max_abs_err": err,
        "max_abs_err_quantised_clear": qerr,
        "max_abs_diff_fhe_vs_quantised_clear": fhe_vs_q,
        "max_abs_float_output": ref_scale,
        "calibration_rows": args.calib,
        "calls": len(r["times"]),
        "seed": args.seed,
        "concrete_ml_version": CML_VERSION,
        "notes": notes,
        **({"client_zip_bytes": r["client_zip_bytes"]} if "client_zip_bytes" in r else {}),
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", type=parse_shape, help="DINxDOUT, e.g. 576x1536")
    ap.add_argument("--calls", type=int, default=3, help="timed one-token calls per shape")
    ap.add_argument("--calib", type=int, default=100, help="calibration rows")
    ap.add_argument("--n-bits", type=int, default=8, help="quantisation bits (CML default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bias", action="store_true")
    ap.add_argument(
        "--backend",
        choices=["auto", "tfhe"],
        default="auto",
        help="auto = what HybridFHEModel picks; tfhe = force Concrete Python circuits",
    )
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"Concrete ML {CML_VERSION}, torch {torch.__version__}, GLWE ext: {has_glwe_backend()}")
    results = []
    for din, dout in args.shapes:
        results.append(bench_shape(din, dout, args, log))
        if args.json:  # write as we go: long runs keep what they measured
            _write_json(args.json, results)

    hdr = (
        f"{'shape':>11} {'backend':>7} {'s/call':>8} {'server s':>8} {'up/call':>11} "
        f"{'down/call':>11} {'key':>11} {'n_bits':>6} {'max|err|':>9} {'quant-only':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(
            f"{r['shape']:>11} {r['backend']:>7} {r['seconds_per_call']:8.3f} "
            f"{r['server_seconds_per_call']:8.3f} {fmt_bytes(r['bytes_up_per_call']):>11} "
            f"{fmt_bytes(r['bytes_down_per_call']):>11} {fmt_bytes(r['key_bytes']):>11} "
            f"{r['n_bits']:>6} {r['max_abs_err']:9.4f} {r['max_abs_err_quantised_clear']:10.4f}"
        )
    if args.json:
        print(f"wrote {args.json}")


def _write_json(path: Path, results):
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "peer": "concrete-ml HybridFHEModel",
        "concrete_ml_version": CML_VERSION,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "results": results,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

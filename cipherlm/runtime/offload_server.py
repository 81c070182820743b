"""Offload-mode server: holds the weights, evaluates projections on ciphertexts.

Implements the server side of the client-aided offload protocol
(``fhe_offload_llama_003`` sections 4-6; messages in
:mod:`cipherlm.runtime.offload_protocol`).  The weights are encoded as CKKS
plaintexts once, at start-up, and reused for every layer and every request.
Each client connection is a session in its own thread; an error in one
session (malformed message, wrong ciphertext, disconnect, stall) ends that
session only.  The server never logs activations, prompts or keys: it only
ever sees ciphertexts.

Work limits (`ServerLimits`, docs/reliability.md): a ``linear`` request
carries at most ``max_cts_per_request`` ciphertexts and a session has
``max_work_per_session`` ciphertexts to spend in all; both are checked before
any work starts.  Between ciphertexts the session checks that the client is
still connected (and the session lifetime), so a client that leaves stops the
work within one ciphertext.  The client bundle is sent at most once per
session.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from cipherlm.he import HEError
from cipherlm.runtime import offload_engine
from cipherlm.runtime.linear_groups import LinearGroup, groups_from_calls
from cipherlm.runtime.offload_protocol import MAX_TOKENS_PER_REQUEST, PROTOCOL_VERSION, ProtocolError
from cipherlm.runtime.session_server import LimitExceeded, MessageSession, ServerLimits, SessionServer
from cipherlm.runtime.session_workers import session_processes_for

log = logging.getLogger("cipherlm.serve")

DEFAULT_TIMEOUT = 300.0  # seconds a session may stay silent (the per-frame idle timeout)
DEFAULT_LIMITS = ServerLimits()
#: the environment variable `run_server` reads when no HE backend is given (so that a server
#: started by another tool, e.g. ``cipherlm bench offload``, can be put on Lattigo)
HE_BACKEND_ENV = "CIPHERLM_OFFLOAD_HE_BACKEND"


def discover_groups(config: dict, client_params: dict, server_linears: dict,
                    client_side: Sequence[str] = ()) -> list[LinearGroup]:
    """The projection groups in the order the executor calls them: the model graph's
    `group_linears` pass (every MoE expert included) without the projections in
    ``client_side`` (a tied LM head the client computes), then any server linear outside the
    graph (an encoder's "classifier" head), one group each. No forward pass is run."""
    from cipherlm.compile import build_graph, passes

    g = passes.group_linears.run(build_graph(config))
    calls = [(names, d_in, d_outs) for names, d_in, d_outs in g.meta["linear_groups"]
             if not set(names) & set(client_side)]
    covered = {n for names, _, _ in calls for n in names}
    unknown = sorted(covered - set(server_linears))
    if unknown:
        raise ValueError(f"the server holds no weights for the projections {unknown[:3]}")
    calls += [((n,), server_linears[n][0].shape[1], (server_linears[n][0].shape[0],))
              for n in sorted(set(server_linears) - covered)]
    return groups_from_calls(calls)


class ModelHost:
    """One model, its client bundle and its HE-encoded projections (built once)."""

    def __init__(self, model_name: str, progress=None, workers: int = 1, he_backend: str = "seal",
                 prefill_tokens: int | None = None):
        """``he_backend``: "seal" or "lattigo" (`cipherlm serve`'s default "auto" is resolved by
        `run_server`; this class keeps SEAL as its default).  ``prefill_tokens``: token rows per
        packed prefill ciphertext (`offload_engine.ServerEngine`; None: ``$CIPHERLM_OFFLOAD_PREFILL_PACK``,
        else 2; 1: every row its own ciphertext)."""
        from cipherlm.models import load_model
        from cipherlm.runtime.bundle import bundle_digest, chat_template_meta
        from cipherlm.runtime.plain import split_params

        t0 = time.perf_counter()
        lm = load_model(model_name)
        self.name = lm.name
        self.config = lm.config
        client_params, server_linears = split_params(lm.config, lm.weights)
        self.labels = None
        if lm.config.get("model_type") == "bert" and lm.tokenizer is not None:
            # the encoder's classifier head (the polarity probe) is served like any projection
            from cipherlm.runtime.plain import polarity_classifier

            _, _, probe = polarity_classifier(lm)
            server_linears = dict(server_linears) | probe.as_linear()
            self.labels = list(probe.labels)
        # a tied LM head is the embedding matrix the client's bundle holds: the client computes it
        from cipherlm.runtime.plain import tied_head_tensor

        self.client_lm_head = tied_head_tensor(client_params, server_linears) \
            if offload_engine.client_head_from_env() else None
        if self.client_lm_head is not None:
            server_linears = {k: v for k, v in server_linears.items() if k != "lm_head"}
        self.groups = discover_groups(lm.config, client_params, server_linears,
                                      ("lm_head",) if self.client_lm_head else ())
        self.bundle = {
            "type": "bundle",
            "tensors": {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in client_params.items()},
            "tokenizer": lm.tokenizer.to_str() if lm.tokenizer is not None else None,
        }
        self.bundle_digest = bundle_digest(self.bundle["tensors"], self.bundle["tokenizer"])
        # the chat template of the model's tokenizer metadata (in the welcome: a proxy that does not
        # have the model renders chat messages with it)
        self.chat_template = chat_template_meta(lm.path)
        self.engine = offload_engine.ServerEngine(self.groups, server_linears, progress=progress, workers=workers,
                                                  he_backend=he_backend, prefill_tokens=prefill_tokens)
        # sessions in forked worker processes (session_workers) need a host without threads of its own
        self.fork_safe = he_backend == "seal" and workers == 1
        self.fork_unsafe_reason = (
            "the Lattigo backend runs Go threads (it releases the GIL: sessions in threads use every core)"
            if he_backend != "seal" else "--workers > 1 runs an HE process pool (use session processes or HE "
            "workers, not both)")
        self.startup_seconds = time.perf_counter() - t0

    def welcome(self) -> dict:
        return {
            "type": "welcome",
            "protocol": PROTOCOL_VERSION,
            "model": self.name,
            "config": self.config,
            "groups": [{"names": list(g.names), "d_in": g.d_in, "d_outs": list(g.d_outs)} for g in self.groups],
            "bundle_digest": self.bundle_digest,
            "labels": self.labels,
            "chat_template": self.chat_template,
            **({"client_lm_head": self.client_lm_head} if self.client_lm_head else {}),
            **self.engine.public_setup(),
        }


class OffloadServer(SessionServer):
    """Accepts sessions on a TCP port and serves one :class:`ModelHost`."""

    expected_errors = SessionServer.expected_errors + (HEError,)
    thread_name = "offload-session"
    default_limits = DEFAULT_LIMITS
    default_timeout = DEFAULT_TIMEOUT
    log_name = log.name

    def new_session(self, chan) -> "Session":
        return Session(self.host, chan)


class Session(MessageSession):
    """Server side of one client session (see offload_protocol for the message flow)."""

    mode = "offload"
    protocol_version = PROTOCOL_VERSION

    def __init__(self, host: ModelHost, chan):
        self.host = host
        self.chan = chan
        self.keys = None
        self.seconds = defaultdict(float)
        self.work_done = 0  # ciphertexts evaluated in this session (against max_work_per_session)
        self.bundle_sent = False

    def close(self) -> None:
        """Drop this session's key material."""
        if self.keys is not None:
            self.host.engine.release(self.keys)

    def welcome(self) -> dict:
        lim = self.limits
        return {**self.host.welcome(),
                "limits": {"max_cts_per_request": lim.max_cts_per_request,
                           "max_work_per_session": lim.max_work_per_session,
                           "session_lifetime": lim.session_lifetime}}

    def _get_bundle(self, msg: dict) -> None:
        if self.bundle_sent:
            raise LimitExceeded("the client bundle is sent once per session")
        self.bundle_sent = True
        with self.chan.step("setup"):
            self.chan.send(self.host.bundle)

    def _keys(self, msg: dict) -> None:
        t0 = time.perf_counter()
        if self.keys is not None:
            raise ProtocolError("keys were already sent in this session")
        self.keys = self.host.engine.load_client_keys(msg.get("galois_keys"), msg.get("ring_switch_key"),
                                                      msg.get("input_switch_key"))
        self.seconds["setup"] += time.perf_counter() - t0
        with self.chan.step("setup"):
            self.chan.send({"type": "ready"})

    def _linear(self, msg: dict) -> None:
        if self.keys is None:
            raise ProtocolError("linear request before keys")
        gid = msg.get("group")
        if not isinstance(gid, int) or not 0 <= gid < len(self.host.groups):
            raise ProtocolError(f"unknown linear group {gid!r}")
        cts = msg.get("cts")
        if not isinstance(cts, list) or not cts:
            raise ProtocolError("cts must be a non-empty list of ciphertext blobs")
        # packed: each ciphertext packs up to T token rows (the prefill's packed plan of this group);
        # it counts as T rows against the limits (its work is about that of T rows)
        packed = msg.get("packed", False)
        if not isinstance(packed, bool):
            raise ProtocolError("packed must be a bool")
        engine = self.host.engine
        weight = 1
        if packed:
            if getattr(engine, "packed_of", None) is None or engine.packed_of[gid] < 0:
                raise ProtocolError(f"linear group {gid} has no packed prefill plan")
            weight = engine.packed_plans[engine.packed_of[gid]].tokens
        n = len(cts)
        cap = min(self.limits.max_cts_per_request, MAX_TOKENS_PER_REQUEST)
        if n * weight > cap:
            raise LimitExceeded(f"{n * weight} token rows in one request: this server takes at most {cap}")
        budget = self.limits.max_work_per_session
        if self.work_done + n * weight > budget:
            raise LimitExceeded(f"this request would go past the session's work budget of {budget} ciphertexts "
                                f"({self.work_done} evaluated, {n * weight} more asked)")
        group = self.host.groups[gid]
        t0 = time.perf_counter()
        out = []
        try:
            for i, ct in enumerate(cts):
                self.check_alive(f"{i} of {n} ciphertexts evaluated")
                out.append(engine.apply(gid, ct, self.keys, packed=True) if packed else engine.apply(gid, ct, self.keys))
                self.work_done += weight
        finally:
            self.seconds[group.op_class] += time.perf_counter() - t0
        with self.chan.step(group.op_class):
            self.chan.send({"type": "result", "cts": out})

    def _stats(self, msg: dict) -> None:
        self.chan.send({"type": "stats", "seconds": dict(self.seconds),
                        "he_ops": self.keys.he_ops() if self.keys else {},
                        "work": {"cts": self.work_done, "budget": self.limits.max_work_per_session}})

    handlers = {"get_bundle": _get_bundle, "keys": _keys, "linear": _linear, "stats": _stats}


def default_workers(he_backend: str) -> int:
    """The offload server's HE workers per request when ``--workers`` is not given: on Lattigo one
    goroutine per core this process may run on (the client is idle while the server computes; on
    this 2-vCPU machine 2 goroutines took a SmolLM2 later token 0.71-0.77x the time of one, CPU
    0.87-1.01x, docs/offload.md "Goroutines per request"); on SEAL 1 (its workers are processes
    that hold copies of the encoded weights)."""
    if he_backend != "lattigo":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def run_server(model: str, host: str, port: int, timeout: float | None = None, workers: int | None = None,
               limits: ServerLimits | None = None, he_backend: str | None = None,
               session_processes: int | None = None) -> None:
    """Entry point of ``cipherlm serve --mode offload`` (`timeout` None: `DEFAULT_TIMEOUT`;
    `limits` None: `DEFAULT_LIMITS`; `he_backend` None: `$CIPHERLM_OFFLOAD_HE_BACKEND`, else
    "auto": Lattigo where its library is built, else SEAL with a log line saying why
    (`he.matmul.resolve_offload_backend`; "lattigo" without the library: `HEError` naming
    ``make lattigo``); on Lattigo `workers` are goroutines per request (None: `default_workers`);
    `session_processes` None: one worker process per core when the host is fork-safe
    (SEAL, one HE worker), else sessions in threads)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from cipherlm.he.matmul import resolve_offload_backend
    from cipherlm.progress import Progress

    asked = he_backend or os.environ.get(HE_BACKEND_ENV) or "auto"
    he_backend, why = resolve_offload_backend(asked)  # before the model is loaded: fail fast
    if he_backend == "seal" and str(asked).strip().lower() != "seal":
        log.warning("HE backend SEAL (%s; `--he-backend seal` silences this)", why)
    elif he_backend == "lattigo" and session_processes is not None and session_processes > 1:
        from cipherlm.runtime.session_workers import SessionProcessesError

        raise SessionProcessesError(
            f"{session_processes} session processes need the SEAL backend (`--he-backend seal`): the Lattigo "
            "backend runs Go threads, which do not survive fork(); its sessions run in threads and use every core")
    workers = default_workers(he_backend) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    with Progress(f"encoding weights as CKKS plaintexts ({he_backend})", stream=sys.stderr) as bar:
        model_host = ModelHost(model, progress=bar.update, workers=workers, he_backend=he_backend)
    processes = session_processes_for(model_host, session_processes)
    server = OffloadServer(model_host, host, port, session_timeout=timeout, limits=limits, processes=processes)
    h, p = server.address
    log.info("model %s ready in %.1f s (HE backend %s: %s; %d worker%s, sessions in %s)", model_host.name,
             model_host.startup_seconds, he_backend, why.split(" (")[0], workers, "" if workers == 1 else "s",
             f"{processes} processes" if processes > 1 else "threads")
    print(f"LISTENING {h}:{p}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        model_host.engine.close()

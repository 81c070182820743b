"""2pc mode over TCP: `cipherlm serve --mode 2pc` and its client.

The server (party 1) holds the weights; the client (party 0) the prompt and,
at the end, the output (BLB sections 2-3; CryptoMoE section 2.2's semi-honest
two-party setting).  One TCP connection per session carries a short control
dialogue and, for each request, the whole two-party computation of
`cipherlm.runtime.twopc` on the same framed, accounted channel:

=========  ==============================================  =========================================
step       client -> server                                server -> client
=========  ==============================================  =========================================
hello      ``{type: hello, protocol, mode: "2pc", model}``  ``{type: welcome, protocol, model, config,
                                                           config_digest, plan, labels, tokenizer,
                                                           chat_template, ring, limits}``
request    ``{type: generate, n_prompt, max_new_tokens}``  ``{type: go}`` then the 2PC run (prefill,
           or ``{type: classify, n_tokens}``                decode passes with one ``{continue}`` per
                                                           token from the client)
stats      ``{type: stats}``                               ``{type: stats, seconds, traffic}``
bye        ``{type: bye}``                                 (connection closed)
=========  ==============================================  =========================================

What the server learns: the model name, the number of prompt tokens, the
generation budget and how many tokens were produced (the shapes of the
exchange show them anyway).  It opens nothing: the token ids reach it only
inside the client's HE ciphertexts and shares.  Its log holds session
open/close and error kinds, never payloads, shares or values.

Faults: every receive has the session timeout; frames are size-checked and
decoded without pickle (`cipherlm.net.message`); a malformed or unexpected
message, a bad request, a peer that crashes or stalls ends that session only
(``{type: error}`` is sent when the channel still works) and the server goes
on serving others.  Each session runs in its own thread.  The server's
limits (sessions at once, in all and per address, with a "server busy"
error beyond them; a small frame cap before the hello; an absolute session
lifetime) are `cipherlm.runtime.session_server.ServerLimits`, with this
mode's defaults in `DEFAULT_LIMITS` (docs/reliability.md "Server limits").
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time

import numpy as np

from cipherlm.mpc.context import Context, MPCError
from cipherlm.mpc.ot_common import OTError
from cipherlm.net.channel import TCPChannel
from cipherlm.runtime import twopc
from cipherlm.runtime.bundle import check_chat_template
from cipherlm.runtime.offload_protocol import ProtocolError, RemoteError, expect
from cipherlm.runtime.plan_check import check_twopc_welcome
from cipherlm.runtime.session_server import MessageSession, ServerLimits, SessionClient, SessionServer
from cipherlm.runtime.session_workers import session_processes_for
from cipherlm.runtime.twopc_executors import make_twopc_executor

log = logging.getLogger("cipherlm.serve2pc")

PROTOCOL_VERSION = 1
MAX_NEW_TOKENS = 512
DEFAULT_TIMEOUT = 600.0  # seconds a session may stay silent (server and client)
# a 2PC session is long (a MiniLM sentence ~2 min, a SmolLM2 pass 10-20 min) and heavy
DEFAULT_LIMITS = ServerLimits(max_sessions=8, max_sessions_per_address=4, session_lifetime=24 * 3600.0)


def config_digest(config: dict) -> str:
    """sha256 of the canonical JSON of a model config (both sides check it)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class TwoPCHost:
    """One model as the 2pc server holds it: weights (prepared once), public config and plan."""

    def __init__(self, model_name: str, embedding: str = "auto", lm=None, classifier=None, labels=None,
                 moe_capacity: float = twopc.DEFAULT_MOE_CAPACITY, linear_packing: str = "coeff",
                 network: str = "LAN", fusion: str = "auto"):
        """`lm`: an already loaded model (anything with name, config, weights, tokenizer);
        `classifier`: (W (C, d), b) for an encoder without the polarity probe;
        `moe_capacity`: CryptoMoE's capacity factor for MoE models (public, in the plan);
        `linear_packing` / `network`: the linear layers' packing and the network preset
        its cost model assumes (`twopc.LINEAR_PACKINGS`; public, in the plan); `fusion`:
        "none", "blb" (BLB's fused blocks, encoders: `twopc_blb`) or "auto" (`twopc.resolve_fusion`:
        BLB for an encoder on a network model of at most 100 Mbps); public, in the plan."""
        from cipherlm.models import load_model
        from cipherlm.runtime.bundle import chat_template_meta

        t0 = time.perf_counter()
        lm = lm if lm is not None else load_model(model_name)
        self.name = lm.name
        # as config.json has it (str keys: HF's to_dict() has int-keyed id2label)
        self.config = json.loads(json.dumps(lm.config, default=str))
        self.labels = list(labels) if labels is not None else None
        if classifier is not None and self.labels is None:
            self.labels = [f"class{i}" for i in range(np.asarray(classifier[0]).shape[0])]
        if classifier is None and lm.config.get("model_type") in twopc.ENCODER_TYPES and lm.tokenizer is not None:
            from cipherlm.runtime.plain import polarity_classifier

            _, _, probe = polarity_classifier(lm)
            classifier = probe.as_linear()["classifier"]
            self.labels = list(probe.labels)
        fusion = twopc.resolve_fusion(lm.config, fusion, network)
        if fusion == "blb" and twopc.model_kind(lm.config)[0] == "decoder":
            raise twopc.TwoPCError("BLB fusion runs a decoder's whole passes only (no KV cache across passes, so "
                                   "no generation to serve yet); use --fusion none")
        self.weights = twopc.server_weights(lm.config, lm.weights, classifier=classifier,
                                            keep_bound=fusion == "blb")
        self.plan = twopc.public_plan(lm.config, self.weights, embedding, moe_capacity=moe_capacity,
                                      linear_packing=linear_packing, network=network, fusion=fusion)
        self.tokenizer_json = lm.tokenizer.to_str() if lm.tokenizer is not None else None
        self.chat_template = chat_template_meta(getattr(lm, "path", None))  # {template, bos, eos} or None
        self.digest = config_digest(self.config)
        self.max_tokens = twopc.model_kind(self.config)[2]
        self.startup_seconds = time.perf_counter() - t0

    @property
    def kind(self) -> str:
        return "encoder" if self.config.get("model_type") in twopc.ENCODER_TYPES else "decoder"

    def welcome(self) -> dict:
        from cipherlm.mpc.ring import RingConfig

        ring = RingConfig()
        return {"type": "welcome", "protocol": PROTOCOL_VERSION, "mode": "2pc", "model": self.name,
                "config": self.config, "config_digest": self.digest, "plan": self.plan, "labels": self.labels,
                "tokenizer": self.tokenizer_json, "chat_template": self.chat_template,
                "ring": {"bits": ring.bits, "frac": ring.frac},
                "limits": {"max_tokens": self.max_tokens, "max_new_tokens": MAX_NEW_TOKENS}}


def _int_field(msg: dict, key: str, lo: int, hi: int) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"{key} must be an integer in {lo}..{hi}")
    return v


class ServerSession(MessageSession):
    """The server side of one 2pc session."""

    mode = "2pc"
    protocol_version = PROTOCOL_VERSION
    handshake_step = "handshake"

    def __init__(self, host: TwoPCHost, chan):
        self.host = host
        self.chan = chan
        self.ctx = Context(chan, 1)
        self.meter = twopc.OpMeter(chan)
        self.executor = None
        self.requests = 0

    def _executor(self):
        if self.executor is None:
            self.executor = make_twopc_executor(self.ctx, self.host.config, self.host.weights,
                                                      self.host.plan, meter=self.meter)
        return self.executor

    def _go(self):
        """Accept a checked request: the executor, after telling the client to start."""
        ex = self._executor()
        with self.chan.step("handshake"):
            self.chan.send({"type": "go"})
        self.requests += 1
        return ex

    def _stats(self, msg: dict) -> None:
        self.chan.send({"type": "stats", "seconds": dict(self.meter.seconds), "traffic": self.meter.stats(),
                        "requests": self.requests})

    def _generate(self, msg: dict) -> None:
        if self.host.kind != "decoder":
            raise ProtocolError(f"model {self.host.name!r} is an encoder: use classify")
        n = _int_field(msg, "n_prompt", 1, self.host.max_tokens)
        m = _int_field(msg, "max_new_tokens", 1, MAX_NEW_TOKENS)
        self._go().generate(None, n, m)

    def _classify(self, msg: dict) -> None:
        if self.host.kind != "encoder" or not self.host.plan.get("classes"):
            raise ProtocolError(f"model {self.host.name!r} has no classifier head")
        n = _int_field(msg, "n_tokens", 1, self.host.max_tokens)
        self._go().classify(None, n)

    handlers = {"stats": _stats, "generate": _generate, "classify": _classify}


class TwoPCServer(SessionServer):
    """Accepts sessions on a TCP port, one thread per session, and serves one `TwoPCHost`."""

    expected_errors = SessionServer.expected_errors + (MPCError, OTError)  # OTError: an OT message out of step
    thread_name = "2pc-session"
    default_limits = DEFAULT_LIMITS
    default_timeout = DEFAULT_TIMEOUT
    log_name = log.name

    def new_session(self, chan) -> ServerSession:
        return ServerSession(self.host, chan)


def _raise_remote_errors(chan) -> None:
    """Make `chan.recv` raise RemoteError when the server's error report arrives where a
    protocol message was expected (mid-computation the client is always waiting on it)."""
    recv = chan.recv

    def checked(timeout=None):
        msg = recv(timeout)
        if isinstance(msg, dict) and msg.get("type") == "error" and set(msg) == {"type", "message"}:
            chan.close()
            raise RemoteError(f"server: {msg.get('message')}")
        return msg

    chan.recv = checked


class TwoPCClient(SessionClient):
    """A session with a 2pc server: handshake, then `generate` / `classify` requests."""

    def __init__(self, host: str, port: int, model: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 progress=None):
        t0 = time.perf_counter()
        self.progress = progress
        self.chan = TCPChannel.connect(host, port, timeout=timeout)
        _raise_remote_errors(self.chan)
        try:
            with self.chan.step("handshake"):
                self.chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "2pc", "model": model})
                welcome = expect(self.chan.recv(), "welcome")
            self._check_welcome(welcome)
        except BaseException:
            self.chan.close()
            raise
        self.model = welcome["model"]
        self.config = welcome["config"]
        self.plan = welcome["plan"]
        self.labels = welcome.get("labels")
        self.limits = welcome.get("limits") or {}
        self.tokenizer = None
        if welcome.get("tokenizer"):
            from cipherlm.runtime.plan_check import load_tokenizer

            try:  # a malformed tokenizer is a ProtocolError, never the parser's bare Exception
                self.tokenizer = load_tokenizer(welcome["tokenizer"])
            except ProtocolError:
                self.chan.close()
                raise
        self.chat_template = check_chat_template(welcome.get("chat_template"))  # (checked above)
        self.ctx = Context(self.chan, 0)
        self.meter = twopc.OpMeter(self.chan)
        self._executor = None
        self.setup_seconds = time.perf_counter() - t0

    @staticmethod
    def _check_welcome(w: dict) -> None:
        # (types first: an array here would make `!=` raise ValueError)
        if type(w.get("protocol")) is not int or w.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"server speaks protocol {repr(w.get('protocol'))[:40]}, this client {PROTOCOL_VERSION}")
        if not isinstance(w.get("mode"), str) or w.get("mode") != "2pc":
            raise ProtocolError(f"the server at this address is not a 2pc server (mode {repr(w.get('mode'))[:40]})")
        check_twopc_welcome(w)  # strict types; the plan allow-listed (no `insecure` MoE, known embeddings)
        check_chat_template(w.get("chat_template"))  # None or {template, bos_token, eos_token}, size-capped
        cfg = w.get("config")
        if not isinstance(cfg, dict) or config_digest(cfg) != w.get("config_digest"):
            raise ProtocolError("the model config does not match its digest")
        from cipherlm.mpc.ring import RingConfig

        ring = RingConfig()
        if w.get("ring") != {"bits": ring.bits, "frac": ring.frac}:
            raise ProtocolError(f"server ring {w.get('ring')!r} differs from this client's")
        if not isinstance(w.get("plan"), dict):
            raise ProtocolError("welcome without a plan")

    @property
    def kind(self) -> str:
        return "encoder" if self.config.get("model_type") in twopc.ENCODER_TYPES else "decoder"

    def executor(self):
        if self._executor is None:
            self._executor = make_twopc_executor(self.ctx, self.config, None, self.plan, meter=self.meter,
                                                       progress=self._layer_progress)
        return self._executor

    def _layer_progress(self, done, total, note=""):
        if self.progress is not None:
            self.progress(done, total, note)

    def _request(self, msg: dict) -> None:
        with self.chan.step("handshake"):
            self.chan.send(msg)
            expect(self.chan.recv(), "go")

    def _run(self, fn):
        """Run the client's half of the 2PC computation; a server error or a vanished
        server surfaces as RemoteError / ChannelClosed / ChannelTimeout."""
        try:
            return fn()
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, MPCError) as exc:
            # the peer sent something other than the protocol message we expected: most
            # likely its error report; read it if it is there
            raise RemoteError(f"the server broke off the computation ({type(exc).__name__})") from exc

    def generate(self, prompt_ids, max_new_tokens: int, eos_ids=(), on_token=None, should_stop=None) -> list[int]:
        """Greedy generation; `should_stop()` (checked after each token) ends it early as EOS
        would (the server gets "continue: false"; the session stays usable)."""
        if self.kind != "decoder":
            raise ProtocolError(f"model {self.model!r} is an encoder: use classify")
        ids = [int(i) for i in prompt_ids]
        self._request({"type": "generate", "n_prompt": len(ids), "max_new_tokens": int(max_new_tokens)})
        ex = self.executor()
        return self._run(lambda: ex.generate(ids, len(ids), max_new_tokens, eos_ids, on_token, should_stop))

    def classify(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        self._request({"type": "classify", "n_tokens": int(ids.size)})
        ex = self.executor()
        return self._run(lambda: ex.classify(ids, ids.size))



def run_server(model: str, host: str, port: int, timeout: float | None = None, embedding: str = "auto",
               moe_capacity: float = twopc.DEFAULT_MOE_CAPACITY, linear_packing: str = "coeff",
               network: str = "LAN", limits: ServerLimits | None = None,
               session_processes: int | None = None, fusion: str = "auto") -> None:
    """Entry point of ``cipherlm serve --mode 2pc`` (`timeout` None: `DEFAULT_TIMEOUT`;
    `limits` None: `DEFAULT_LIMITS`; `session_processes` None: one worker process per core)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    model_host = TwoPCHost(model, embedding=embedding, moe_capacity=moe_capacity, linear_packing=linear_packing,
                           network=network, fusion=fusion)
    processes = session_processes_for(model_host, session_processes)
    server = TwoPCServer(model_host, host, port, session_timeout=timeout, limits=limits, processes=processes)
    h, p = server.address
    log.info("model %s ready in %.1f s (2pc, embedding %s, sessions in %s)", model_host.name,
             model_host.startup_seconds, model_host.plan["embedding"],
             f"{processes} processes" if processes > 1 else "threads")
    print(f"LISTENING {h}:{p}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


__all__ = ["TwoPCHost", "TwoPCServer", "TwoPCClient", "ServerSession", "run_server", "config_digest",
           "PROTOCOL_VERSION", "DEFAULT_TIMEOUT", "DEFAULT_LIMITS"]


# ----------------------------------------------------------------------------- reports


def add_client_stats(report, client: TwoPCClient) -> dict:
    """Traffic and seconds per operator class of a 2pc session into a `RunReport`
    (the client's channel counters; the server's compute seconds go to extra)."""
    stats = client.meter.stats()
    hs = client.chan.stats().get("handshake")
    if hs:  # hello/welcome (config, tokenizer) and the request messages
        stats["handshake"] = hs
    report.add_channel_stats(stats, party="client")
    for op_class, seconds in client.meter.seconds.items():
        report.add_seconds(op_class, seconds)
    try:
        server = client.server_stats()
    except Exception:  # the session may be gone after an error; the client's figures stand
        server = {}
    report.extra["server_seconds"] = dict(server.get("seconds", {}))
    report.extra["client_seconds"] = dict(client.meter.seconds)
    report.extra["op_classes"] = client.meter.summary()
    report.extra["embedding"] = client.plan.get("embedding")
    report.extra["linear_packing"] = twopc.linear_packing_report(client.ctx, client.plan)
    report.extra["setup_seconds"] = client.setup_seconds
    return server


class LayerProgress:
    """Progress lines for the 2pc forward passes (one update per layer)."""

    def __init__(self, label: str = "2pc forward pass", stream=None):
        from cipherlm.progress import Progress

        self._cls = Progress
        self.label = label
        self.stream = stream
        self.bar = None

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if self.bar is None:
            self.bar = self._cls(f"{self.label}, {note}" if note else self.label, stream=self.stream)
        self.bar.update(done, total)
        if done >= total:
            self.bar.__exit__()
            self.bar = None

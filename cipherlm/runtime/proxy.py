"""An OpenAI-compatible HTTP proxy in front of a private-inference server.

``cipherlm proxy --server HOST:PORT --mode offload|2pc`` runs this module's
`ProxyApp` (FastAPI on uvicorn) on 127.0.0.1:8080 by default.  Any program that
speaks the OpenAI HTTP API (the ``openai`` package, chat front-ends, agents,
``curl``) gets private inference by changing its base URL to
``http://127.0.0.1:8080/v1``.  The proxy is the *client* of the private
protocol: the secret keys (offload) and the client's shares (2pc) live in this
process and never leave it; the server sees ciphertexts or shares only.
docs/proxy.md is the user's guide.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` (messages rendered with the model's own chat
template), ``POST /v1/completions``, ``POST /v1/embeddings`` (encoder models
in the offload mode: mean-pooled, L2-normalised sentence embeddings, as
`EncoderExecutor.sentence_embedding`), ``GET /health``, and ``GET /``: a chat page
from the package (``proxy_static/index.html``, no other origin) that streams replies
and shows each reply's cost and what the server saw (the ``cipherlm`` field every
response carries: channel counters, ciphertext and message counts, never data).

Sessions: every request opens its own private session (fresh keys, fresh
shares: nothing is shared between requests or users) in a worker thread, and
ends it with ``bye`` when the answer is complete, when a stop string or the
token budget is reached, or when the HTTP client goes away: a stream whose
client disconnects sets the job's cancel flag, the offload client stops
before its next projection request, the 2pc client answers ``continue: false``
at the next token, and either way the session is closed normally (the server
logs ``session closed``, not a fault).

Errors are OpenAI error objects ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad fields and a prompt beyond the model's context, 401
for a missing or wrong bearer token (``--api-key``), 404 for an unknown model
or path, 502 when the server breaks off a session, 503 when the server
cannot be reached or is busy.

Logging: the proxy logs request kinds, token *counts*, durations and error
kinds, never prompts, messages, outputs, token ids or embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from starlette.requests import Request  # module level: FastAPI resolves the handlers' annotations here

log = logging.getLogger("cipherlm.proxy")

DEFAULT_MAX_TOKENS = 256  # completion budget when the request names none (clipped to the context)
SESSION_TIMEOUT = 600.0  # idle seconds per frame on the private session
OFFLOAD_MAX_ROWS = 512  # an offload server's default max_cts_per_request: the longest prompt in one pass
MAX_STOP_STRINGS = 4
STATIC_DIR = Path(__file__).with_name("proxy_static")

PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# ChatML, used only when neither the model's metadata nor --chat-template gives a template
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- errors


class ProxyError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", param, code)


def upstream_error(exc: BaseException, server: str, opening: bool) -> ProxyError:
    """A private-session failure as the proxy's answer (no payloads: the messages name kinds)."""
    from cipherlm.net.channel import ChannelClosed, ChannelTimeout
    from cipherlm.runtime.offload_protocol import ProtocolError, RemoteError

    text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    if isinstance(exc, RemoteError) and "server busy" in text:
        return ProxyError(503, f"the private inference server at {server} is busy: {text}", "server_error",
                          None, "server_busy")
    if opening and isinstance(exc, (OSError, ChannelTimeout, ChannelClosed)):
        return ProxyError(503, f"the private inference server at {server} is unreachable "
                               f"({type(exc).__name__}: {text})", "server_error", None, "server_unreachable")
    if isinstance(exc, (RemoteError, ProtocolError, ChannelClosed, ChannelTimeout, OSError)):
        return ProxyError(502, f"the private session with {server} failed ({type(exc).__name__}: {text})",
                          "server_error", None, "upstream_error")
    return ProxyError(500, f"internal error in the proxy ({type(exc).__name__})", "server_error", None,
                      "internal_error")


# ----------------------------------------------------------------------------- chat templates


class ChatTemplate:
    """A Hugging Face chat template (Jinja2), rendered as transformers does (sandboxed,
    trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``).

    `untrusted`: the template came from the server (its welcome), so it is code from the
    other party.  It is compiled and rendered in the same sandbox, in a worker thread, and
    each rendering must be *content-oblivious* (`render`): the server learns the number of
    prompt tokens, so a template that looked inside the messages could turn that number
    into a report on them."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "",
                 untrusted: bool = False):
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise ValueError("the chat template must be a non-empty string")

        def raise_exception(message):
            raise _bad(f"the model's chat template refused the messages: {message}", "messages")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {str(exc)[:200]}") from None
        except (RecursionError, MemoryError):
            raise ValueError("the chat template does not compile: too deeply nested or too large") from None
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.origin = origin
        self.untrusted = untrusted

    @classmethod
    def from_file(cls, path: str | Path) -> "ChatTemplate":
        """A tokenizer_config.json (its ``chat_template``) or a file holding the template itself."""
        from cipherlm.runtime.bundle import named_chat_template, special_token_text

        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            cfg = json.loads(text)
            tpl = named_chat_template(cfg.get("chat_template")) if isinstance(cfg, dict) else None
            if tpl is None:
                raise ValueError(f"{path} has no chat_template")
            bos, eos = (special_token_text(cfg.get(k)) for k in ("bos_token", "eos_token"))
            return cls(tpl, bos, eos, str(path))
        return cls(text, origin=str(path))

    @classmethod
    def from_server(cls, meta: dict, server: str) -> "ChatTemplate":
        """The template a server's welcome carried (`cipherlm.runtime.bundle.check_chat_template`
        checked its types and sizes); ValueError when it does not compile in the sandbox."""
        return cls(meta["template"], meta.get("bos_token", ""), meta.get("eos_token", ""),
                   f"the server {server} (its model's tokenizer metadata)", untrusted=True)

    def _render(self, messages: list[dict], add_generation_prompt: bool, now: float) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token,
                                        strftime_now=lambda fmt: time.strftime(fmt, time.localtime(now)))
        except ProxyError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, MemoryError) as exc:
            raise _bad(f"the model's chat template failed on these messages ({type(exc).__name__})",
                       "messages") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text.  For an `untrusted` template the rendering must equal its *frame*
        (the same messages with each content replaced by a random marker) with the markers
        replaced by the contents, trimmed as the template trimmed the markers' padding; any
        other rendering (a template that branches on, measures or rewrites the text) is a 400
        ``chat_template_refused``."""
        now = time.time()
        if not self.untrusted:
            return self._render(messages, add_generation_prompt, now)
        nonce = secrets.token_hex(8)
        marks = [f"\u27e6cipherlm-{nonce}-{i}\u27e7" for i in range(len(messages))]
        frame = self._render([dict(m, content=" \n" + mk + "\n ") for m, mk in zip(messages, marks)],
                             add_generation_prompt, now)
        real = self._render(messages, add_generation_prompt, now)
        index = {mk: i for i, mk in enumerate(marks)}
        pattern = re.compile("( \n)?(" + "|".join(re.escape(mk) for mk in marks) + ")(\n )?")

        def content(m: re.Match) -> str:
            c = messages[index[m.group(2)]]["content"]
            c = c if m.group(1) else c.lstrip()
            return c if m.group(3) else c.rstrip()

        if real != pattern.sub(content, frame):
            raise _bad("the chat template sent by the server renders these messages as more than their text "
                       "inserted in a fixed frame (it looks inside them); refused, since the server sees the "
                       "length of the rendered prompt. Start the proxy with --chat-template FILE to use a "
                       "template you trust", "messages", "chat_template_refused")
        return real


def find_chat_template(model: str) -> ChatTemplate | None:
    """The template in a model's tokenizer metadata when the model (a registered name or a
    path, as the server names it) is on this machine: an HF directory's
    ``chat_template.jinja`` or tokenizer_config.json (`cipherlm.runtime.bundle.chat_template_meta`,
    as the server reads it), the converted copy of a GGUF, or the GGUF's
    ``tokenizer.chat_template`` (read from the file's header)."""
    from cipherlm.models import cache_dir, resolve
    from cipherlm.runtime.bundle import chat_template_meta

    try:
        _, path = resolve(model)
    except (ValueError, OSError):
        return None
    d = path if path.is_dir() else cache_dir() / "models" / (path.stem + "-f32")
    meta = chat_template_meta(d)
    if meta is not None:
        try:
            return ChatTemplate(meta["template"], meta["bos_token"], meta["eos_token"], str(d))
        except ValueError as exc:
            log.warning("the chat template in %s is unusable (%s)", d, exc)
    if path.is_file() and path.suffix == ".gguf":
        try:
            import gguf

            from cipherlm.models.gguf_convert import _field

            reader = gguf.GGUFReader(str(path))
            tpl = _field(reader, "tokenizer.chat_template")
            tokens = _field(reader, "tokenizer.ggml.tokens")

            def tok(key):
                i = _field(reader, key)
                return tokens[i] if i is not None and tokens is not None else ""

            if isinstance(tpl, str) and tpl.strip():
                return ChatTemplate(tpl, tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id"),
                                    f"{path} (GGUF metadata)")
        except Exception:  # an unreadable header: no template from here
            return None
    return None


# ----------------------------------------------------------------------------- upstream servers


@dataclass
class Upstream:
    """One private-inference server and what its welcome told about its model."""

    host: str
    port: int
    mode: str
    chat_template: ChatTemplate | None = None  # --chat-template (else local, else the server's, else ChatML)
    timeout: float = SESSION_TIMEOUT
    model: str | None = None
    kind: str | None = None  # "decoder" | "encoder"
    config: dict = field(default_factory=dict)
    tokenizer: object = None
    context: int = 0  # longest prompt + completion, in tokens
    max_new_tokens: int = 1 << 30
    eos_ids: set = field(default_factory=set)
    created: int = 0
    template_from: str | None = None  # "file" | "local" | "server" | "chatml" (see `_choose_template`)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def probed(self) -> bool:
        return self.model is not None

    def open(self):
        """A new private session (its own keys / shares) with this server."""
        if self.mode == "2pc":
            from cipherlm.runtime.twopc_session import TwoPCClient

            return TwoPCClient(self.host, self.port, model=self.model, timeout=self.timeout)
        from cipherlm.runtime.offload_client import OffloadClient

        client = OffloadClient(self.host, self.port, model=self.model, timeout=self.timeout)
        client.backend.show_progress = False
        return client

    def probe(self) -> None:
        """Learn the model (name, config, tokenizer, limits) through one session; idempotent."""
        with self._lock:
            if self.probed:
                return
            try:
                client = self.open()
            except Exception as exc:
                raise upstream_error(exc, self.address, opening=True) from None
            try:
                self._learn(client)
            finally:
                client.close()

    def _learn(self, client) -> None:
        from cipherlm.runtime.twopc import ENCODER_TYPES

        config = dict(client.config)
        self.kind = "encoder" if config.get("model_type") in ENCODER_TYPES else "decoder"
        self.config = config
        self.tokenizer = client.tokenizer
        ctx = int(config.get("max_position_embeddings") or 0) or 1 << 30
        if self.mode == "2pc":
            lim = getattr(client, "limits", {}) or {}
            ctx = min(ctx, int(lim.get("max_tokens") or ctx))
            self.max_new_tokens = int(lim.get("max_new_tokens") or self.max_new_tokens)
        else:
            ctx = min(ctx, OFFLOAD_MAX_ROWS)
        self.context = ctx
        self.eos_ids = _eos_ids(config, self.tokenizer)
        if self.kind == "decoder":
            self._choose_template(client)
        self.created = int(time.time())
        self.model = client.model
        log.info("server %s: model %s (%s, %s mode, context %d tokens)", self.address, self.model, self.kind,
                 self.mode, self.context)


    def _choose_template(self, client) -> None:
        """The chat template, in order: --chat-template FILE; the model's own on this machine
        (`find_chat_template`: trusted, the user's copy); the one the server's welcome carried
        (its model's tokenizer metadata; untrusted: compiled in the sandbox, each rendering
        checked to be content-oblivious, `ChatTemplate.render`); ChatML, with a warning."""
        if self.chat_template is not None:
            self.template_from = self.template_from or "file"
            return
        tpl = find_chat_template(client.model)
        if tpl is not None:
            self.chat_template, self.template_from = tpl, "local"
            return
        meta = getattr(client, "chat_template", None)
        if meta is not None:
            try:
                self.chat_template, self.template_from = ChatTemplate.from_server(meta, self.address), "server"
                return
            except ValueError as exc:  # a bad template is refused, not fatal: the next source is used
                log.warning("server %s sent a chat template this proxy cannot use (%s): not used", self.address,
                            exc)
        log.warning("no chat template for model %s (not on this machine, none usable from the server): ChatML "
                    "is used (pass --chat-template FILE for the model's own)", client.model)
        self.chat_template, self.template_from = ChatTemplate(CHATML_TEMPLATE, origin="ChatML (fallback)"), "chatml"


def _eos_ids(config: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos if isinstance(e, int))
    if tokenizer is not None:
        for tok in ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end|>"):
            tid = tokenizer.token_to_id(tok)
            if tid is not None:
                ids.add(tid)
    return ids


# ----------------------------------------------------------------------------- requests


@dataclass
class GenParams:
    prompt_ids: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = ()
    compare: bool = False  # also run the local plaintext model (`PlaintextReference`)


def _opt_number(body: dict, key: str, lo: float, hi: float, default):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi):
        raise _bad(f"'{key}' must be a number in [{lo:g}, {hi:g}]", key)
    return v


def _opt_int(body: dict, key: str, lo: int, hi: int | None = None):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(f"'{key}' must be an integer" + (f" >= {lo}" if hi is None else f" in [{lo}, {hi}]"), key)
    return v


def _model_field(body: dict) -> str:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise _bad("'model' is required (a name from GET /v1/models)", "model")
    return m


def _stop_field(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stop)


def _unsupported(body: dict, defaults: dict) -> None:
    """Fields this proxy does not implement are refused unless they hold their no-op value."""
    for key, ok in defaults.items():
        if key in body and body[key] is not None and body[key] not in ok:
            raise _bad(f"'{key}' is not supported by this proxy", key, "unsupported_parameter")


_CHAT_NOOPS = {"n": (1,), "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",),
               "functions": ([],), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
               "logit_bias": ({},), "parallel_tool_calls": (False, True)}
_COMPLETION_NOOPS = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (0, None), "suffix": ("",),
                     "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},)}


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}].role must be system, developer, user or assistant", "messages")
        if m.get("tool_calls"):
            raise _bad("tool calls are not supported by this proxy", "messages", "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# ----------------------------------------------------------------------------- text assembly


class TextAssembler:
    """Token ids -> text deltas, holding back incomplete UTF-8 and possible stop-string
    prefixes; `done` once a stop string appears (the text ends before it)."""

    def __init__(self, tokenizer, stop: tuple = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # the answer so far (after the stop cut when done)
        self.sent = 0  # characters of `text` handed out
        self.done = False

    def feed(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.done = text[:cut], True
            return self._take(len(self.text))
        self.text = text
        hold = 0
        for s in self.stop:  # a suffix that may grow into a stop string stays back
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = len(text) - hold
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out


# ----------------------------------------------------------------------------- jobs


class _Stop(Exception):
    """Raised inside the offload generation to end it between two protocol requests."""


class Job:
    """One request's private session, run in a worker thread.

    Events go to an asyncio queue: ``("opened", None)``, ``("delta", text)``,
    ``("done", result)`` or ``("error", ProxyError)`` (always last).  `cancel()` stops
    the work at the next safe point and the session still ends with ``bye``."""

    def __init__(self, proxy: "ProxyApp", upstream: Upstream, loop: asyncio.AbstractEventLoop):
        self.proxy = proxy
        self.upstream = upstream
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.cancelled = False
        self.result: dict | None = None
        self.private_ids: list[int] = []
        self.after = None  # called with the result once the session is closed (plaintext comparison)

    def cancel(self) -> None:
        self._cancel.set()

    def _emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def start(self, work) -> None:
        threading.Thread(target=self._run, args=(work,), daemon=True, name="proxy-session").start()

    def _run(self, work) -> None:
        up = self.upstream
        self.proxy._job_started()
        t0 = time.perf_counter()
        try:
            try:
                client = up.open()
            except Exception as exc:
                raise upstream_error(exc, up.address, opening=True) from None
            self._emit("opened", None)
            try:
                result = work(self, client)
                result["cost"] = session_cost(client, up, result, time.perf_counter() - t0, self)
            finally:
                client.close()
            if self.after is not None and not self.cancelled:
                result["cost"]["plaintext"] = self.after(result)
            self.result = result
            self._emit("done", result)
        except ProxyError as exc:
            self._emit("error", exc)
        except Exception as exc:
            err = upstream_error(exc, up.address, opening=False)
            log.warning("session with %s failed: %s", up.address, type(exc).__name__)
            self._emit("error", err)
        finally:
            self.proxy._job_ended(self)

    # ---- the generation, in the worker thread

    def generate(self, client, params: GenParams, on_delta) -> dict:
        up = self.upstream
        asm = TextAssembler(up.tokenizer, params.stop)
        times: list[float] = []
        t_start = time.perf_counter()

        def should_stop() -> bool:
            return asm.done or self._cancel.is_set()

        def on_token(tok: int) -> None:
            times.append(time.perf_counter())
            self.private_ids.append(int(tok))
            if int(tok) in up.eos_ids:
                return
            delta = asm.feed(tok)
            if delta:
                on_delta(delta)
            if up.mode == "offload" and should_stop():
                raise _Stop

        if up.mode == "2pc":
            # the client tells the server "continue: false" at the next token: the request ends
            # as at EOS and the session stays usable (then bye)
            ids = client.generate(params.prompt_ids, params.max_tokens, eos_ids=sorted(up.eos_ids),
                                  on_token=on_token, should_stop=should_stop)
        else:
            ex = client.executor()
            linear = client.backend.linear

            def guarded(x, names):  # between two projection requests: stop if the client left
                if self._cancel.is_set():
                    raise _Stop
                self.ciphertexts += int(np.prod(np.shape(x)[:-1]))
                return linear(x, names)

            client.backend.linear = guarded
            try:
                ids = ex.generate(params.prompt_ids, max_new_tokens=params.max_tokens, temperature=params.temperature,
                                  top_p=params.top_p, seed=params.seed, eos_token_ids=up.eos_ids, on_token=on_token)
            except _Stop:
                ids = list(asm.ids)
        n = len(times)
        if self._cancel.is_set():
            self.cancelled = True
            finish = "cancelled"
        elif asm.done or (n and ids and int(ids[-1]) in up.eos_ids):
            finish = "stop"
        else:
            finish = "length"
        tail = asm.flush() if finish != "cancelled" else ""
        if tail:
            on_delta(tail)
        return {"text": asm.text, "finish_reason": finish, "prompt_tokens": len(params.prompt_ids),
                "completion_tokens": n,
                "first_token_seconds": (times[0] - t_start) if times else None,
                "per_token_seconds": ((times[-1] - times[0]) / (n - 1)) if n > 1 else None}

    ciphertexts = 0


def session_cost(client, up: Upstream, result: dict, seconds: float, job: Job) -> dict:
    """What one private session cost and what the server received (counts and sizes only)."""
    totals = client.chan.totals()
    by_step = {step: {"messages": c["messages_sent"], "bytes": c["bytes_sent"]}
               for step, c in client.chan.stats().items() if c["messages_sent"]}
    saw = {"messages": totals["messages_sent"], "bytes": totals["bytes_sent"], "by_step": by_step,
           "plaintext": "none"}
    if up.mode == "offload":
        saw["ciphertexts"] = job.ciphertexts
        saw["what"] = "CKKS ciphertexts of activations (and the public Galois keys)"
    else:
        saw["what"] = "additive secret shares and HE ciphertexts of shares"
    return {"mode": up.mode, "server": up.address, "bytes_up": totals["bytes_sent"],
            "bytes_down": totals["bytes_received"], "rounds": totals["rounds"], "seconds": round(seconds, 4),
            "first_token_seconds": result.get("first_token_seconds"),
            "per_token_seconds": result.get("per_token_seconds"), "server_saw": saw}


class PlaintextReference:
    """The optional "compare with plaintext": the same request on the plaintext executor of
    a model that is on this machine (a debugging and demonstration aid: it needs the
    weights, which a real user of a private server does not have).  `paths` maps served
    model names to local model names or paths; with `by_name`, a served name that
    `cipherlm.models.resolve` knows is used as it is.  Nothing of it is logged."""

    def __init__(self, paths: dict | None = None, by_name: bool = False):
        self.paths = dict(paths or {})
        self.by_name = by_name
        self._cache: dict = {}
        self._lock = threading.Lock()

    def source(self, model: str | None) -> str | None:
        if model is None:
            return None
        if model in self.paths:
            return str(self.paths[model])
        if self.by_name:
            from cipherlm.models import resolve

            try:
                resolve(model)
                return model
            except (ValueError, OSError):
                return None
        return None

    def executor(self, model: str):
        with self._lock:
            if model not in self._cache:
                from cipherlm.models import load_model
                from cipherlm.runtime.plain import plain_executor

                self._cache[model] = plain_executor(load_model(self.source(model)))
            return self._cache[model]

    def compare(self, up: "Upstream", params: GenParams, private_ids: list[int]) -> dict:
        t0 = time.perf_counter()
        ex = self.executor(up.model)
        ref = ex.generate(params.prompt_ids, max_new_tokens=max(len(private_ids), 1), temperature=params.temperature,
                          top_p=params.top_p, seed=params.seed, eos_token_ids=up.eos_ids)
        ref = [int(t) for t in ref]
        asm = TextAssembler(up.tokenizer, params.stop)
        for t in ref:
            if t not in up.eos_ids and not asm.done:
                asm.feed(t)
        return {"text": asm.text, "same_tokens": ref == list(private_ids), "tokens": len(ref),
                "seconds": round(time.perf_counter() - t0, 4)}


# ----------------------------------------------------------------------------- the app


class _Guard:
    """ASGI middleware in front of every handler.

    ``allowed_hosts``: the Host header must name one of them (the proxy on loopback answers
    only to 127.0.0.1 / localhost / ::1, so a web page cannot reach it through DNS
    rebinding); ``api_key``: every /v1 path needs ``Authorization: Bearer <api_key>`` (401
    otherwise).  A plain ASGI wrapper, not Starlette's BaseHTTPMiddleware, so that the
    handlers still see the client's disconnect (`Request.is_disconnected`)."""

    def __init__(self, app, api_key: str | None = None, allowed_hosts: frozenset | None = None):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.allowed_hosts = allowed_hosts

    @staticmethod
    async def _refuse(scope, receive, send, err: ProxyError) -> None:
        from starlette.responses import JSONResponse

        await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if self.allowed_hosts is not None:
                host = headers.get(b"host", b"").decode("latin-1").strip().lower()
                name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
                if name.strip("[]") not in self.allowed_hosts:
                    return await self._refuse(scope, receive, send, ProxyError(
                        400, "this proxy answers only to requests for its own address (Host header)",
                        "invalid_request_error", None, "invalid_host"))
            if self.key is not None and scope.get("path", "").startswith("/v1"):
                scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
                if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                    return await self._refuse(scope, receive, send, ProxyError(
                        401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_request_error",
                        None, "invalid_api_key"))
        await self.app(scope, receive, send)


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_BODY_BYTES = 16 << 20  # a request body beyond it is refused (413)


class ProxyApp:
    """The proxy: upstream servers, the request handlers, the FastAPI application (`app`)."""

    def __init__(self, servers: list[tuple[str, int]], mode: str, api_key: str | None = None,
                 chat_template: ChatTemplate | None = None, timeout: float = SESSION_TIMEOUT,
                 allowed_hosts=None, plaintext: PlaintextReference | None = None):
        """`allowed_hosts`: host names the Host header may carry (None: any; `serve` passes
        `LOOPBACK_HOSTS` when the proxy listens on loopback)."""
        if mode not in ("offload", "2pc"):
            raise ValueError(f"mode must be offload or 2pc, not {mode!r}")
        if not servers:
            raise ValueError("at least one server is needed")
        self.mode = mode
        self.api_key = api_key or None
        self.plaintext = plaintext
        self.allowed_hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        self.upstreams = [Upstream(h, p, mode, chat_template, timeout) for h, p in servers]
        self._lock = threading.Lock()
        self.active_jobs = 0
        self.jobs_done = 0
        self.jobs_cancelled = 0
        self.last_result: dict | None = None
        self.app = self._build()

    # ---- bookkeeping

    def _job_started(self) -> None:
        with self._lock:
            self.active_jobs += 1

    def _job_ended(self, job: Job) -> None:
        with self._lock:
            self.active_jobs -= 1
            self.jobs_done += 1
            self.jobs_cancelled += int(job.cancelled)
            if job.result is not None:
                self.last_result = {k: v for k, v in job.result.items() if k not in ("text", "embeddings")}

    def probe_all(self) -> None:
        """Learn every server's model now (failures are logged; retried on the next request)."""
        for up in self.upstreams:
            try:
                up.probe()
            except ProxyError as exc:
                log.warning("server %s not reachable yet: %s", up.address, exc.code)

    async def find(self, model: str) -> Upstream:
        unreachable = None
        for up in self.upstreams:
            if not up.probed:
                try:
                    await asyncio.to_thread(up.probe)
                except ProxyError as exc:
                    unreachable = exc
                    continue
            if up.model == model:
                return up
        if unreachable is not None:
            raise unreachable
        raise ProxyError(404, f"the model '{model}' does not exist here (GET /v1/models lists the models)",
                         "invalid_request_error", "model", "model_not_found")

    # ---- request parsing

    def _gen_params(self, up: Upstream, body: dict, prompt_ids: list) -> GenParams:
        temperature = _opt_number(body, "temperature", 0.0, 2.0, 0.0)
        top_p = _opt_number(body, "top_p", 0.0, 1.0, 1.0)
        if top_p == 0:
            raise _bad("'top_p' must be in (0, 1]", "top_p")
        seed = _opt_int(body, "seed", -(1 << 63), (1 << 63) - 1)
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
        stop = _stop_field(body)
        if up.mode == "2pc" and temperature > 0:
            raise _bad("the 2pc mode decodes greedily (the argmax is computed on shares): use temperature 0 "
                       "or leave it out", "temperature", "unsupported_value")
        n = len(prompt_ids)
        if n == 0:
            raise _bad("the prompt is empty", "prompt")
        if n >= up.context:
            raise _bad(f"this model's context is {up.context} tokens; the prompt has {n}", "messages",
                       "context_length_exceeded")
        room = min(up.context - n, up.max_new_tokens)
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            raise _bad(f"this model's context is {up.context} tokens: {n} in the prompt leave room for at most "
                       f"{room} completion tokens, not {max_tokens}", "max_tokens", "context_length_exceeded")
        compare = body.get("compare_plaintext", False)
        if not isinstance(compare, bool):
            raise _bad("'compare_plaintext' must be true or false", "compare_plaintext")
        if compare and (self.plaintext is None or self.plaintext.source(up.model) is None):
            raise _bad(f"no plaintext copy of '{up.model}' on this proxy (start it with --compare-plaintext "
                       "on a machine that has the model)", "compare_plaintext", "unsupported_parameter")
        return GenParams(list(prompt_ids), int(max_tokens), float(temperature), float(top_p),
                         None if seed is None else int(seed) % (1 << 63), stop, compare)

    def _encode(self, up: Upstream, text: str, special: bool) -> list[int]:
        if up.tokenizer is None:
            raise _bad(f"the server of '{up.model}' sent no tokenizer: send token ids as the prompt", "prompt")
        return list(up.tokenizer.encode(text, add_special_tokens=special).ids)

    # ---- the FastAPI application

    def _build(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException

        app = FastAPI(title="cipherlm proxy", docs_url=None, redoc_url=None, openapi_url=None)
        proxy = self

        @app.exception_handler(ProxyError)
        async def _proxy_error(request, exc: ProxyError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, exc):
            kind = "not_found" if exc.status_code == 404 else None
            msg = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
            return JSONResponse(ProxyError(exc.status_code, msg, "invalid_request_error", None, kind).body(),
                                status_code=exc.status_code)

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request, exc):
            return JSONResponse(_bad("invalid request").body(), status_code=400)

        if self.api_key or self.allowed_hosts is not None:
            app.add_middleware(_Guard, api_key=self.api_key, allowed_hosts=self.allowed_hosts)

        async def body_of(request: Request) -> dict:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ProxyError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB",
                                     "invalid_request_error", None, "request_too_large")
                chunks.append(chunk)
            try:
                body = json.loads(b"".join(chunks))
            except Exception:
                raise _bad("the request body must be a JSON object") from None
            if not isinstance(body, dict):
                raise _bad("the request body must be a JSON object")
            return body

        @app.get("/health")
        async def health():
            return {"status": "ok", "mode": proxy.mode, "active_sessions": proxy.active_jobs,
                    "servers": [{"server": u.address, "model": u.model, "kind": u.kind} for u in proxy.upstreams]}

        @app.get("/v1/models")
        async def models():
            for up in proxy.upstreams:
                if not up.probed:
                    try:
                        await asyncio.to_thread(up.probe)
                    except ProxyError:
                        pass
            return {"object": "list", "data": [proxy._model_card(u) for u in proxy.upstreams if u.probed]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            return proxy._model_card(await proxy.find(model_id))

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await body_of(request)
            up = await proxy.find(_model_field(body))
            if up.kind != "decoder":
                raise _bad(f"'{up.model}' is an encoder: use /v1/embeddings", "model")
            _unsupported(body, _CHAT_NOOPS)
            fmt = body.get("response_format")
            if fmt not in (None, {"type": "text"}):
                raise _bad("only the text response format is supported", "response_format", "unsupported_parameter")
            msgs = _messages(body)
            # in a worker thread: a template (possibly the server's) never holds up the event loop
            prompt = await asyncio.to_thread(up.chat_template.render, msgs, True)
            params = proxy._gen_params(up, body, self._encode(up, prompt, special=False))
            return await proxy._generation(request, up, body, params, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await body_of(request)
            up = await proxy.find(_model_field(body))
            if up.kind != "decoder":
                raise _bad(f"'{up.model}' is an encoder: use /v1/embeddings", "model")
            _unsupported(body, _COMPLETION_NOOPS)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self._encode(up, prompt, special=True)
            elif (isinstance(prompt, list) and prompt
                  and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
                vocab = int(up.config.get("vocab_size") or 0)
                if any(not 0 <= t < vocab for t in prompt):
                    raise _bad(f"token ids must be in [0, {vocab})", "prompt")
                ids = list(prompt)
            else:
                raise _bad("'prompt' must be a string, a list of token ids, or a list of one of them", "prompt")
            params = proxy._gen_params(up, body, ids)
            return await proxy._generation(request, up, body, params, chat=False)

        @app.post("/v1/embeddings")
        async def embeddings(request: Request):
            body = await body_of(request)
            up = await proxy.find(_model_field(body))
            if up.kind != "encoder":
                raise _bad(f"'{up.model}' is not a sentence-embedding model", "model")
            if up.mode != "offload":
                raise _bad("embeddings are served in the offload mode only (the 2pc server has no "
                           "embedding request)", "model", "unsupported_mode")
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise _bad("'encoding_format' must be float or base64", "encoding_format")
            if body.get("dimensions") is not None:
                raise _bad("'dimensions' is not supported", "dimensions", "unsupported_parameter")
            seqs = proxy._embedding_inputs(up, body.get("input"))
            return await proxy._embed(request, up, body, seqs, fmt)

        @app.get("/")
        async def index():
            page = STATIC_DIR / "index.html"
            if not page.exists():
                raise ProxyError(404, "no chat page in this installation", code="not_found")
            # the page is one file with inline style and script: the policy forbids any other origin
            return FileResponse(page, media_type="text/html; charset=utf-8", headers={
                "Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})

        self._StreamingResponse = StreamingResponse
        self._JSONResponse = JSONResponse
        return app

    def _model_card(self, up: Upstream) -> dict:
        return {"id": up.model, "object": "model", "created": up.created, "owned_by": f"cipherlm-{up.mode}",
                "cipherlm": {"mode": up.mode, "kind": up.kind, "server": up.address, "context": up.context,
                             "chat_template": up.template_from,
                             "plaintext_available": bool(self.plaintext and self.plaintext.source(up.model))}}

    # ---- generation responses

    async def _first_event(self, request, job: Job):
        """Wait for the session to open (or fail) while watching for the client leaving."""
        return await self._next_event(request, job)

    async def _result(self, request, job) -> dict:
        """The job's result once it is done (deltas skipped); its error raised; a client that
        left gives ProxyError 499."""
        while True:
            ev = await self._next_event(request, job)
            if ev is None:
                raise ProxyError(499, "client closed the request", code="cancelled")
            if ev[0] == "error":
                raise ev[1]
            if ev[0] == "done":
                return ev[1]

    async def _next_event(self, request, job: Job):
        while True:
            try:
                return await asyncio.wait_for(job.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None

    async def _generation(self, request, up: Upstream, body: dict, params: GenParams, chat: bool):
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("'stream' must be true or false", "stream")
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        loop = asyncio.get_running_loop()
        job = Job(self, up, loop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completions" if chat else "completions"
        if params.compare:
            job.after = lambda res: self.plaintext.compare(up, params, job.private_ids)
        job.start(lambda j, client: j.generate(client, params, lambda d: j._emit("delta", d)))
        first = await self._first_event(request, job)
        if first is None:
            raise ProxyError(499, "client closed the request", code="cancelled")
        if first[0] == "error":
            raise first[1]

        def usage(res: dict) -> dict:
            return {"prompt_tokens": res["prompt_tokens"], "completion_tokens": res["completion_tokens"],
                    "total_tokens": res["prompt_tokens"] + res["completion_tokens"]}

        def log_done(res: dict) -> None:
            log.info("%s: model %s, %d prompt tokens, %d completion tokens, %s, %.2f s", kind, up.model,
                     res["prompt_tokens"], res["completion_tokens"], res["finish_reason"], res["cost"]["seconds"])

        if not stream:
            res = await self._result(request, job)
            log_done(res)
            finish = "stop" if res["finish_reason"] == "cancelled" else res["finish_reason"]
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": res["text"], "refusal": None},
                          "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": res["text"], "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": up.model, "system_fingerprint": f"cipherlm-{up.mode}", "choices": [choice],
                    "usage": usage(res), "cipherlm": res["cost"]}

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta=None, finish=None, extra=None) -> str:
            if chat:
                choices = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": (delta or {}).get("content", ""), "logprobs": None,
                            "finish_reason": finish}]
            out = {"id": rid, "object": obj, "created": created, "model": up.model,
                   "system_fingerprint": f"cipherlm-{up.mode}", "choices": choices}
            if extra:
                out.update(extra)
            return f"data: {json.dumps(out)}\n\n"

        async def events():
            try:
                if chat:
                    yield chunk({"role": "assistant", "content": ""})
                while True:
                    ev = await self._next_event(request, job)
                    if ev is None:  # the client went away
                        break
                    kind_, value = ev
                    if kind_ == "delta":
                        yield chunk({"content": value})
                    elif kind_ == "error":
                        yield f"data: {json.dumps(value.body())}\n\n"
                        break
                    elif kind_ == "done":
                        log_done(value)
                        yield chunk({}, value["finish_reason"], {"cipherlm": value["cost"]})
                        if include_usage:
                            u = {"id": rid, "object": obj, "created": created, "model": up.model, "choices": [],
                                 "usage": usage(value)}
                            yield f"data: {json.dumps(u)}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:  # normal end, or the client went away (the generator is closed / cancelled)
                job.cancel()

        return self._StreamingResponse(events(), media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- embeddings

    def _embedding_inputs(self, up: Upstream, inp) -> list[list[int]]:
        if isinstance(inp, str):
            inp = [inp]
        elif isinstance(inp, list) and inp and all(isinstance(t, int) and not isinstance(t, bool) for t in inp):
            inp = [inp]
        if not isinstance(inp, list) or not inp or len(inp) > 64:
            raise _bad("'input' must be a string, a list of 1..64 strings, or token ids", "input")
        seqs = []
        vocab = int(up.config.get("vocab_size") or 0)
        for item in inp:
            if isinstance(item, str):
                if not item:
                    raise _bad("'input' holds an empty string", "input")
                ids = self._encode(up, item, special=True)
            elif (isinstance(item, list) and item
                  and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in item)):
                ids = list(item)
            else:
                raise _bad("'input' must be a string, a list of strings, or token ids", "input")
            if len(ids) > up.context:
                raise _bad(f"this model's context is {up.context} tokens; an input has {len(ids)}", "input",
                           "context_length_exceeded")
            seqs.append(ids)
        return seqs

    async def _embed(self, request, up: Upstream, body: dict, seqs: list[list[int]], fmt: str):
        loop = asyncio.get_running_loop()
        job = Job(self, up, loop)

        def work(j: Job, client) -> dict:
            ex = client.executor()
            linear = client.backend.linear

            def counted(x, names):
                if j._cancel.is_set():
                    raise _Stop
                j.ciphertexts += int(np.prod(np.shape(x)[:-1]))
                return linear(x, names)

            client.backend.linear = counted
            vecs = []
            try:
                for ids in seqs:
                    vecs.append(np.asarray(ex.sentence_embedding(np.asarray(ids, np.int64)), np.float32))
            except _Stop:
                j.cancelled = True
            n = sum(len(s) for s in seqs)
            return {"embeddings": vecs, "prompt_tokens": n, "completion_tokens": 0, "finish_reason":
                    "cancelled" if j.cancelled else "stop"}

        job.start(work)
        res = await self._result(request, job)
        log.info("embeddings: model %s, %d inputs, %d tokens, %.2f s", up.model, len(seqs), res["prompt_tokens"],
                 res["cost"]["seconds"])
        data = []
        for i, v in enumerate(res["embeddings"]):
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": up.model,
                "usage": {"prompt_tokens": res["prompt_tokens"], "total_tokens": res["prompt_tokens"]},
                "cipherlm": res["cost"]}


def serve(servers: list[tuple[str, int]], mode: str, host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, chat_template: ChatTemplate | None = None,
          compare_plaintext: bool = False) -> None:
    """Entry point of ``cipherlm proxy``: probe the servers, then serve HTTP until interrupted."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loopback = host in LOOPBACK_HOSTS
    proxy = ProxyApp(servers, mode, api_key=api_key, chat_template=chat_template,
                     allowed_hosts=LOOPBACK_HOSTS if loopback else None,
                     plaintext=PlaintextReference(by_name=True) if compare_plaintext else None)
    proxy.probe_all()
    if not loopback and not api_key:
        log.warning("the proxy listens on %s without an API key: anyone who reaches it uses your sessions", host)
    print(f"PROXY http://{host}:{port}/v1 (models: "
          f"{', '.join(u.model or '?' for u in proxy.upstreams)})", flush=True)
    uvicorn.run(proxy.app, host=host, port=port, log_level="info")


__all__ = ["ProxyApp", "ProxyError", "PlaintextReference", "ChatTemplate", "TextAssembler", "Upstream", "find_chat_template", "serve",
           "CHATML_TEMPLATE", "DEFAULT_MAX_TOKENS"]

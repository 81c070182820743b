"""The OpenAI-compatible proxy (cipherlm.runtime.proxy) in front of real offload and 2pc
servers on tiny random models with a tiny character tokenizer: the official `openai`
client and `curl` against it, answers equal to the plaintext executor's, errors,
a client that disconnects mid-stream, and logs free of prompts and answers."""

from __future__ import annotations

import json
import shutil
import socket
import string
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from cipherlm.models import LoadedModel, load_model  # noqa: E402
from cipherlm.runtime.offload_server import ModelHost, OffloadServer  # noqa: E402
from cipherlm.runtime.plain import EncoderExecutor, PlainLinear, make_executor, split_params  # noqa: E402
from cipherlm.runtime.proxy import (CHATML_TEMPLATE, ChatTemplate, PlaintextReference, ProxyApp,  # noqa: E402
                                    TextAssembler, find_chat_template)

# 96 tokens: the tiny Llama's vocabulary size (ids 0..2 special; <|im_end|> = 2 = LlamaConfig's eos)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = string.ascii_letters + string.digits + " \n.,!?:;'-" + "\"#$%&()*+/<=>@[]^_{|}"
TEMPLATE = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "zebras?"  # distinctive: asserted absent from every log line


def char_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    assert len(vocab) == 96
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def _with_tokenizer(src: str | None, dst: Path, template: str | None) -> Path:
    if src is not None:
        shutil.copytree(src, dst)
    char_tokenizer().save(str(dst / "tokenizer.json"))
    if template is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}))
    return dst


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def chat_dir(tiny_llama_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    return _with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("m") / "tiny-chat", TEMPLATE)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, chat_dir):
    torch.manual_seed(1)
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=512, initializer_range=0.1)
    path = tmp_path_factory.mktemp("m") / "tiny-embed"
    transformers.BertModel(cfg).eval().save_pretrained(path)
    return _with_tokenizer(None, path, None)


def _serve(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def servers(chat_dir, bert_dir):
    chat = _serve(OffloadServer(ModelHost(str(chat_dir)), "127.0.0.1", 0, session_timeout=30.0))
    embed = _serve(OffloadServer(ModelHost(str(bert_dir)), "127.0.0.1", 0, session_timeout=30.0))
    yield chat, embed
    chat.shutdown()
    embed.shutdown()


class RunningProxy:
    def __init__(self, proxy: ProxyApp):
        self.proxy = proxy
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(proxy.app, host="127.0.0.1", port=self.port, log_config=None, log_level="info")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 20, "proxy did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def proxy(servers, chat_dir):
    chat, embed = servers
    p = RunningProxy(ProxyApp([chat.address, embed.address], "offload",
                              chat_template=ChatTemplate.from_file(chat_dir / "tokenizer_config.json"),
                              plaintext=PlaintextReference({"tiny-chat": str(chat_dir)})))
    yield p
    p.stop()


def _plain_answer(model_dir, messages, max_tokens):
    lm = load_model(str(model_dir))
    cp, sl = split_params(lm.config, lm.weights)
    ex = make_executor(lm.config, cp, PlainLinear(sl))
    prompt = ChatTemplate.from_file(Path(model_dir) / "tokenizer_config.json").render(messages)
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False).ids
    new = ex.generate(ids, max_new_tokens=max_tokens, eos_token_ids=[2])
    return lm.tokenizer.decode(new, skip_special_tokens=True), len(ids), new


def _debug_logs(caplog) -> None:
    """Every record of the proxy and the servers at DEBUG; the HTTP client of the test itself
    (httpcore, under the openai client) at INFO: its DEBUG records echo raw response headers
    as bytes, which the log guard of tests/conftest.py takes for a value dump."""
    import logging

    caplog.set_level(logging.DEBUG)
    for name in ("httpcore", "httpcore2"):
        caplog.set_level(logging.INFO, logger=name)


# ----------------------------------------------------------------------------- offload


def test_models_listed(proxy):
    ids = {m.id for m in proxy.client().models.list().data}
    assert ids == {"tiny-chat", "tiny-embed"}


def test_chat_greedy_equals_plaintext_and_stream_equals_non_stream(proxy, chat_dir):
    msgs = [{"role": "user", "content": PROMPT}]
    want, n_prompt, new = _plain_answer(chat_dir, msgs, 10)
    assert want  # the random model says something
    c = proxy.client()
    r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ("stop" if 2 in new else "length")
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(new)
    cost = r.model_extra["cipherlm"]
    assert cost["mode"] == "offload" and cost["bytes_up"] > 0 and cost["bytes_down"] > 0 and cost["rounds"] > 0
    assert cost["server_saw"]["ciphertexts"] >= n_prompt and cost["server_saw"]["plaintext"] == "none"

    parts, finish, usage = [], None, None
    for ch in c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == want
    assert finish == r.choices[0].finish_reason and usage.completion_tokens == len(new)


def test_stop_string_and_seeded_sampling(proxy, chat_dir):
    msgs = [{"role": "user", "content": "hi"}]
    want, _, _ = _plain_answer(chat_dir, msgs, 8)
    c = proxy.client()
    stop = want[3:5]
    r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=8, stop=[stop])
    assert r.choices[0].message.content == want[:want.find(stop)] and r.choices[0].finish_reason == "stop"
    a, b = (c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=3, temperature=1.0, top_p=0.9,
                                      seed=7).choices[0].message.content for _ in range(2))
    assert a == b  # the same seed, the same sample


def test_completions_with_curl(proxy, chat_dir):
    body = {"model": "tiny-chat", "prompt": "abc", "max_tokens": 5}
    out = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", json.dumps(body),
                          proxy.url + "/v1/completions"], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout)
    lm = load_model(str(chat_dir))
    cp, sl = split_params(lm.config, lm.weights)
    new = make_executor(lm.config, cp, PlainLinear(sl)).generate(lm.tokenizer.encode("abc").ids, max_new_tokens=5,
                                                                 eos_token_ids=[2])
    assert r["object"] == "text_completion"
    assert r["choices"][0]["text"] == lm.tokenizer.decode(new, skip_special_tokens=True)
    out = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d",
                          json.dumps(body | {"stream": True}), proxy.url + "/v1/completions"],
                         capture_output=True, text=True, timeout=60, check=True)
    events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == r["choices"][0]["text"]
    # an error through curl: OpenAI error JSON and its status
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-d",
                          json.dumps({"model": "nope", "prompt": "x"}), proxy.url + "/v1/completions"],
                         capture_output=True, text=True, timeout=60, check=True)
    text, code = out.stdout.rsplit("\n", 1)
    assert code == "404" and json.loads(text)["error"]["code"] == "model_not_found"


def test_embeddings_equal_plaintext(proxy, bert_dir):
    texts = ["hello there", "a zebra"]
    r = proxy.client().embeddings.create(model="tiny-embed", input=texts)
    got = np.array([d.embedding for d in r.data])
    lm = load_model(str(bert_dir))
    cp, sl = split_params(lm.config, lm.weights)
    ex = EncoderExecutor(lm.config, cp, PlainLinear(sl))
    want = np.stack([ex.sentence_embedding(np.array(lm.tokenizer.encode(t).ids)) for t in texts])
    assert got.shape == want.shape and np.max(np.abs(got - want)) < 1e-4
    assert r.usage.prompt_tokens == sum(len(lm.tokenizer.encode(t).ids) for t in texts)
    b64 = proxy.client().embeddings.create(model="tiny-embed", input="a zebra", encoding_format="base64")
    import base64

    vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")
    assert np.max(np.abs(vec - want[1])) < 1e-4


def test_errors_are_openai_errors(proxy, servers):
    c = proxy.client()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=msgs)
    assert e.value.code == "model_not_found"
    for bad in ({"temperature": 5}, {"max_tokens": 0}, {"stop": ["a"] * 5}, {"n": 2}, {"top_p": "x"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-chat", messages=msgs, **bad)
        assert e.value.body["param"] == next(iter(bad))
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-chat", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x" * 80}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=60)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model="tiny-chat", input="x")
    r = httpx.post(proxy.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(proxy.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()

    # a bearer token
    chat, _ = servers
    keyed = RunningProxy(ProxyApp([chat.address], "offload", api_key="s3cret",
                                  chat_template=ChatTemplate("{{ messages[0]['content'] }}"),
                                  allowed_hosts={"127.0.0.1", "localhost"}))
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").models.list()
        assert httpx.get(keyed.url + "/v1/models").status_code == 401
        assert [m.id for m in keyed.client("s3cret").models.list().data] == ["tiny-chat"]
        # DNS rebinding: a request naming another host is refused, even with the key
        r = httpx.get(keyed.url + "/v1/models", headers={"Host": "evil.example", "Authorization": "Bearer s3cret"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert httpx.get(keyed.url.replace("127.0.0.1", "localhost") + "/").status_code == 200
        r = httpx.post(keyed.url + "/v1/completions", content=b" " * (17 << 20),
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 413
    finally:
        keyed.stop()

    # a server that is not there: 503
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()
    gone = RunningProxy(ProxyApp([dead], "offload", timeout=1.0))
    try:
        with pytest.raises(openai.InternalServerError) as e:
            gone.client().chat.completions.create(model="tiny-chat", messages=msgs)
        assert e.value.status_code == 503 and e.value.code == "server_unreachable"
    finally:
        gone.stop()


def test_client_disconnect_cancels_and_session_ends_cleanly(proxy, servers):
    chat, _ = servers
    proxy.client().models.list()  # the proxy has learnt the models (a session of its own)
    failed0, served0 = chat.sessions_failed, chat.sessions_served
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
            "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content": ""' not in line:
                    break  # the first token: hang up
    t0 = time.time()
    while proxy.proxy.active_jobs or chat.active_sessions:
        assert time.time() - t0 < 20, "the session did not end"
        time.sleep(0.05)
    res = proxy.proxy.last_result
    assert res["finish_reason"] == "cancelled" and res["completion_tokens"] < 20
    assert chat.sessions_served == served0 + 1 and chat.sessions_failed == failed0  # closed with bye


def test_logs_hold_no_prompt_or_answer(proxy, chat_dir, caplog):
    _debug_logs(caplog)
    msgs = [{"role": "user", "content": PROMPT}]
    c = proxy.client()
    r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10)
    answer = r.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, stream=True)
                       if ch.choices)
    assert streamed == answer and len(answer) >= 4
    logs = caplog.text
    assert "cipherlm.proxy" in logs and "chat.completions" in logs  # the proxy did log its requests
    assert "cipherlm.serve" in logs  # and the server its sessions
    assert PROMPT not in logs and "zebra" not in logs and answer not in logs


# ----------------------------------------------------------------------------- units


def test_text_assembler_holds_back_stop_prefixes():
    tok = char_tokenizer()
    ids = tok.encode("ab--cd").ids
    asm = TextAssembler(tok, stop=("--c",))
    out = [asm.feed(i) for i in ids]
    assert "".join(out) + asm.flush() == "ab" and asm.done
    asm = TextAssembler(tok, stop=("xyz",))
    assert "".join(asm.feed(i) for i in tok.encode("abx").ids) == "ab" and asm.flush() == "x"


def test_chat_template_from_model_dir(chat_dir):
    tpl = find_chat_template(str(chat_dir))
    assert tpl is not None and tpl.source == TEMPLATE
    assert tpl.render([{"role": "user", "content": "x"}]).startswith("<|im_start|>system\nBe brief.")


# ----------------------------------------------------------------------------- 2pc


@pytest.fixture(scope="module")
def twopc_proxy():
    from test_twopc import llama_model

    from cipherlm.runtime.twopc_session import TwoPCHost, TwoPCServer

    config, w = llama_model(seed=2)
    lm = LoadedModel("tiny-2pc", config, w, char_tokenizer())
    server = _serve(TwoPCServer(TwoPCHost("tiny-2pc", embedding="onehot-linear", lm=lm), "127.0.0.1", 0,
                                session_timeout=60))
    p = RunningProxy(ProxyApp([server.address], "2pc", chat_template=ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}\n{% endfor %}")))
    yield p, server, config, w
    p.stop()
    server.shutdown()


def test_twopc_behind_the_proxy(twopc_proxy, caplog):
    from test_twopc import plain_decoder

    _debug_logs(caplog)
    p, server, config, w = twopc_proxy
    c = p.client()
    msgs = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-2pc", messages=msgs, temperature=0.7)
    assert e.value.param == "temperature"
    r = c.chat.completions.create(model="tiny-2pc", messages=msgs, max_tokens=2)
    tok = char_tokenizer()
    ids = tok.encode(f"<|im_start|>{PROMPT}\n", add_special_tokens=False).ids
    assert r.usage.prompt_tokens == len(ids) and 1 <= r.usage.completion_tokens <= 2
    assert r.model_extra["cipherlm"]["mode"] == "2pc" and r.model_extra["cipherlm"]["bytes_up"] > 0
    # greedy equals plaintext where the plaintext top-2 margin is clear of the fixed-point error
    ref, logits = plain_decoder(config, w).generate(ids, max_new_tokens=2, eos_token_ids=[2], return_logits=True)
    margin = np.diff(np.sort(logits[0])[-2:])[0]
    if margin > 0.1:
        assert tok.decode(ref[:1], skip_special_tokens=True) == r.choices[0].message.content[:1] or ref[0] in (0, 1, 2)
    t0 = time.time()
    while server.active_sessions:
        assert time.time() - t0 < 10
        time.sleep(0.05)
    assert server.sessions_failed == 0
    assert "cipherlm.serve2pc" in caplog.text and "cipherlm.proxy" in caplog.text
    assert PROMPT not in caplog.text and "zebra" not in caplog.text


def test_twopc_disconnect_ends_with_continue_false(twopc_proxy):
    p, server, _, _ = twopc_proxy
    p.client().models.list()
    failed0, served0 = server.sessions_failed, server.sessions_served
    body = {"model": "tiny-2pc", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", p.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content": ""' not in line:
                    break
    t0 = time.time()
    while p.proxy.active_jobs or server.active_sessions:
        assert time.time() - t0 < 30, "the 2pc session did not end"
        time.sleep(0.05)
    res = p.proxy.last_result
    assert res["finish_reason"] == "cancelled" and res["completion_tokens"] < 30
    assert server.sessions_served == served0 + 1 and server.sessions_failed == failed0


def test_cli_proxy_process(servers):
    """`cipherlm proxy` as its own process: binds 127.0.0.1, answers /v1/models, stops on SIGINT."""
    import os
    import signal
    import sys

    chat, _ = servers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, CIPHERLM_PROXY_API_KEY="k3y")
    proc = subprocess.Popen([sys.executable, "-m", "cipherlm", "proxy", "--server", "%s:%d" % chat.address,
                             "--mode", "offload", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"PROXY http://127.0.0.1:{port}/v1"), line
        t0 = time.time()
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer k3y"})
                break
            except httpx.ConnectError:
                assert time.time() - t0 < 30
                time.sleep(0.1)
        assert [m["id"] for m in r.json()["data"]] == ["tiny-chat"]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_concurrent_requests_are_isolated(proxy, chat_dir):
    """Two chats at once: two sessions with their own keys; each answer equals its solo answer."""
    from concurrent.futures import ThreadPoolExecutor

    asks = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two?"}]]
    want = [_plain_answer(chat_dir, m, 6)[0] for m in asks]
    c = proxy.client()
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda m: c.chat.completions.create(model="tiny-chat", messages=m, max_tokens=6)
                            .choices[0].message.content, asks))
    assert got == want


def test_chat_page_served_from_the_package(proxy):
    """The page at / is one file from the package: no other origin (CDN, fonts) is referenced, and
    its content security policy forbids loading from one; it uses the streaming chat API and shows
    the cost fields the API returns (the page in a real browser: tests/test_proxy_browser.py)."""
    import re

    r = httpx.get(proxy.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "@import" not in page and "url(" not in page and "https://" not in page and "http://" not in page
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    for needle in ('id="prompt"', 'id="send"', "/v1/chat/completions", "stream: true", "bytes_up", "bytes_down",
                   "rounds", "per_token_seconds", "server_saw", "textContent", 'name="viewport"'):
        assert needle in page, needle
    assert "innerHTML" not in page  # model output is never parsed as HTML


def test_chat_page_script_streams_a_reply(proxy, chat_dir):
    """The page's own script, run by Node over a minimal DOM stand-in (tests/data/page_driver.js),
    sends a prompt to the proxy and shows the streamed reply (equal to the plaintext greedy
    answer) and the cost and "what the server saw" beside it. Not the headless-browser test."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    import cipherlm.runtime.proxy as proxy_mod

    want, _, _ = _plain_answer(chat_dir, [{"role": "user", "content": "hi"}], 5)
    out = subprocess.run([node, str(Path(__file__).parent / "data" / "page_driver.js"),
                          str(proxy_mod.STATIC_DIR / "index.html"), proxy.url, "hi", "5", "compare"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout)
    assert state["models"] == ["tiny-chat"]  # the encoder is not offered for chat
    assert state["reply"] == want and "error" not in state["replyClass"]
    for needle in ("Cost of this reply", "mode", "offload", "bytes up", "rounds", "per later token",
                   "What the server saw", "ciphertexts", "plaintext", "none", "Compare with plaintext",
                   "same tokensyes"):
        assert needle in state["cost"], needle
    assert state["compareShown"] and want not in state["cost"]


def test_non_stream_client_leaving_cancels(proxy, servers):
    chat, _ = servers
    proxy.client().models.list()
    failed0 = chat.sessions_failed
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    t0 = time.time()
    while proxy.proxy.active_jobs or chat.active_sessions:
        assert time.time() - t0 < 20, "the session did not end"
        time.sleep(0.05)
    assert proxy.proxy.last_result["finish_reason"] == "cancelled"
    assert chat.sessions_failed == failed0


def test_compare_with_plaintext(proxy, twopc_proxy):
    msgs = [{"role": "user", "content": "hi"}]
    r = proxy.client().chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=4,
                                               extra_body={"compare_plaintext": True})
    p = r.model_extra["cipherlm"]["plaintext"]
    assert p["same_tokens"] and p["text"] == r.choices[0].message.content
    cards = {m.id: m.model_extra["cipherlm"] for m in proxy.client().models.list().data}
    assert cards["tiny-chat"]["plaintext_available"] and not cards["tiny-embed"]["plaintext_available"]
    with pytest.raises(openai.BadRequestError) as e:  # a proxy without the model's weights
        twopc_proxy[0].client().chat.completions.create(model="tiny-2pc", messages=msgs, max_tokens=1,
                                                        extra_body={"compare_plaintext": True})
    assert e.value.param == "compare_plaintext"


# ----------------------------------------------------------------------------- the server's chat template

# a template unlike the test proxy's and unlike ChatML (it uses the bos token), so that a proxy that
# falls back to either renders another prompt
SERVER_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def remote_dir(tiny_llama_dir, tmp_path_factory):
    """A chat model with the SERVER_TEMPLATE, under a name no proxy can resolve on its machine."""
    d = _with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("m") / "remote-only-chat", None)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
         "chat_template": SERVER_TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def remote_server(remote_dir, chat_dir):  # chat_dir: the module's cache directory is set
    server = _serve(OffloadServer(ModelHost(str(remote_dir)), "127.0.0.1", 0, session_timeout=30.0))
    yield server
    server.shutdown()


def test_server_ships_the_chat_template_and_the_proxy_renders_with_it(remote_server, remote_dir, caplog):
    """A proxy that cannot find the served model on its machine renders with the template of
    the model's tokenizer metadata that the server's welcome carries (bos token included):
    the greedy answer equals the plaintext executor's on that rendering."""
    import logging

    from cipherlm.runtime.offload_client import OffloadClient

    assert find_chat_template("remote-only-chat") is None  # not on "this machine"
    with OffloadClient(*remote_server.address, timeout=30) as client:
        assert client.chat_template == {"template": SERVER_TEMPLATE, "bos_token": "<|im_start|>",
                                        "eos_token": "<|im_end|>"}
    caplog.set_level(logging.INFO)
    p = RunningProxy(ProxyApp([remote_server.address], "offload"))
    try:
        c = p.client()
        card = c.models.retrieve("remote-only-chat").model_extra["cipherlm"]
        assert card["chat_template"] == "server"
        msgs = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": PROMPT}]
        prompt = f"<|im_start|>system: Be brief.\nuser: {PROMPT}\nassistant:"
        assert ChatTemplate(SERVER_TEMPLATE, "<|im_start|>").render(msgs) == prompt
        lm = load_model(str(remote_dir))
        ids = lm.tokenizer.encode(prompt, add_special_tokens=False).ids
        cp, sl = split_params(lm.config, lm.weights)
        new = make_executor(lm.config, cp, PlainLinear(sl)).generate(ids, max_new_tokens=8, eos_token_ids=[2])
        want = lm.tokenizer.decode(new, skip_special_tokens=True)
        r = c.chat.completions.create(model="remote-only-chat", messages=msgs, max_tokens=8)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(new)
        assert r.choices[0].message.content == want
        chatml = ChatTemplate(CHATML_TEMPLATE).render(msgs)
        assert len(lm.tokenizer.encode(chatml, add_special_tokens=False).ids) != len(ids)  # the test can tell
    finally:
        p.stop()
    assert "ChatML is used" not in caplog.text and PROMPT not in caplog.text


def test_a_local_template_or_the_option_comes_before_the_servers(remote_server, chat_dir):
    """--chat-template FILE first, then the model on this machine, then the server's."""
    from cipherlm.runtime.proxy import Upstream

    class Client:
        model = str(chat_dir)  # a path this machine has
        chat_template = {"template": SERVER_TEMPLATE, "bos_token": "", "eos_token": ""}

    up = Upstream("127.0.0.1", 1, "offload")
    up._choose_template(Client)
    assert up.template_from == "local" and up.chat_template.source == TEMPLATE and not up.chat_template.untrusted
    up = Upstream("127.0.0.1", 1, "offload", chat_template=ChatTemplate("{{ messages[0]['content'] }}"))
    up._choose_template(Client)
    assert up.template_from == "file" and up.chat_template.source == "{{ messages[0]['content'] }}"
    Client.model = "remote-only-chat"
    up = Upstream("127.0.0.1", 1, "offload")
    up._choose_template(Client)
    assert up.template_from == "server" and up.chat_template.untrusted


def test_a_bad_server_template_is_refused_clearly(remote_server, caplog):
    """The template is untrusted input: wrong types and oversize ones end the session with a
    ProtocolError naming the field; one that does not compile in the sandbox is not used
    (ChatML, with a warning that says why); the proxy keeps serving."""
    import logging

    from cipherlm.runtime.bundle import MAX_CHAT_TEMPLATE_CHARS, check_chat_template
    from cipherlm.runtime.offload_protocol import ProtocolError

    assert check_chat_template(None) is None
    ok = {"template": "x", "bos_token": None, "eos_token": "</s>", "extra": 1}
    assert check_chat_template(ok) == {"template": "x", "bos_token": "", "eos_token": "</s>"}
    for bad in ("{{ x }}", ["x"], {"template": 3}, {"template": " "}, {"template": b"x"},
                {"template": "x" * (MAX_CHAT_TEMPLATE_CHARS + 1)}, {"template": "x", "bos_token": 1},
                {"template": "x", "eos_token": "e" * 300}):
        with pytest.raises(ProtocolError, match="chat"):
            check_chat_template(bad)

    host = remote_server.host
    saved = host.chat_template
    try:
        host.chat_template = {"template": "x" * (MAX_CHAT_TEMPLATE_CHARS + 1)}
        p = RunningProxy(ProxyApp([remote_server.address], "offload", timeout=10))
        try:
            with pytest.raises(openai.APIStatusError) as e:
                p.client().models.retrieve("remote-only-chat")
            assert e.value.status_code == 502 and "ProtocolError" in e.value.message and "chat template" in \
                e.value.message
        finally:
            p.stop()
        caplog.set_level(logging.WARNING)
        host.chat_template = {"template": "{% for m in messages %}{{ m['content'] }", "bos_token": "",
                              "eos_token": ""}
        p = RunningProxy(ProxyApp([remote_server.address], "offload"))
        try:
            c = p.client()
            assert c.models.retrieve("remote-only-chat").model_extra["cipherlm"]["chat_template"] == "chatml"
            r = c.chat.completions.create(model="remote-only-chat", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1)
            assert r.usage.completion_tokens == 1
        finally:
            p.stop()
        assert "cannot use (the chat template does not compile" in caplog.text and "ChatML is used" in caplog.text
    finally:
        host.chat_template = saved


def test_server_templates_must_not_look_inside_the_messages():
    """A server's template decides the prompt's length, which the server sees: each rendering
    must be the template's frame with the message texts inserted (trimmed or not)."""
    from cipherlm.runtime.proxy import ProxyError

    msgs = [{"role": "user", "content": "  the secret plan \n"}]
    for tpl in (SERVER_TEMPLATE, TEMPLATE, CHATML_TEMPLATE,
                "{% for m in messages %}[{{ m['content'] | trim }}][{{ m['content'] }}]{% endfor %}"):
        trusted = ChatTemplate(tpl, "<s>").render(msgs)
        assert ChatTemplate(tpl, "<s>", untrusted=True).render(msgs) == trusted
    leaky = ("{% for m in messages %}{{ m['content'] }}{% if 'secret' in m['content'] %}"
             "{{ ' pad' * 50 }}{% endif %}{% endfor %}")
    benign = [{"role": "user", "content": "hello"}]
    assert ChatTemplate(leaky, untrusted=True).render(benign) == "hello"
    for tpl in (leaky, "{{ messages[0]['content'] | length }}", "{{ messages[0]['content'] | upper }}",
                "{{ messages[0]['content'][:4] }}"):
        ChatTemplate(tpl).render(msgs)  # a trusted one renders
        with pytest.raises(ProxyError) as e:
            ChatTemplate(tpl, untrusted=True).render(msgs)
        assert e.value.status == 400 and e.value.code == "chat_template_refused"


def test_twopc_welcome_carries_the_chat_template(remote_dir):
    """The 2pc server ships the template too; its client checks it with the welcome, and a
    proxy without the model renders with it."""
    from test_twopc import llama_model

    from cipherlm.runtime.offload_protocol import ProtocolError
    from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost, TwoPCServer

    config, w = llama_model(seed=2)
    host = TwoPCHost("remote-2pc", embedding="onehot-linear",
                     lm=LoadedModel("remote-2pc", config, w, char_tokenizer(), path=remote_dir))
    welcome = host.welcome()
    assert welcome["chat_template"] == {"template": SERVER_TEMPLATE, "bos_token": "<|im_start|>",
                                        "eos_token": "<|im_end|>"}
    TwoPCClient._check_welcome(welcome)
    for bad in ("{{ x }}", {"template": 3}, {"template": "x", "bos_token": ["<s>"]}):
        with pytest.raises(ProtocolError, match="chat_template"):
            TwoPCClient._check_welcome(dict(welcome, chat_template=bad))
    server = _serve(TwoPCServer(host, "127.0.0.1", 0, session_timeout=60))
    p = RunningProxy(ProxyApp([server.address], "2pc"))
    try:
        c = p.client()
        assert c.models.retrieve("remote-2pc").model_extra["cipherlm"]["chat_template"] == "server"
        msgs = [{"role": "user", "content": "hi"}]
        r = c.chat.completions.create(model="remote-2pc", messages=msgs, max_tokens=1)
        ids = char_tokenizer().encode("<|im_start|>user: hi\nassistant:", add_special_tokens=False).ids
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    finally:
        p.stop()
        server.shutdown()

"""2pc mode over TCP: handshake, generate / classify sessions, bad input and peer crashes
(the server keeps serving), and one run with the server as a separate OS process."""

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cipherlm.models import LoadedModel
from cipherlm.net.channel import ChannelClosed, ChannelTimeout, TCPChannel
from cipherlm.runtime import twopc
from cipherlm.runtime.offload_protocol import ProtocolError, RemoteError
from cipherlm.runtime.twopc_session import PROTOCOL_VERSION, TwoPCClient, TwoPCHost, TwoPCServer, config_digest
from test_twopc import bert_model, llama_model, plain_decoder


@pytest.fixture(scope="module")
def llama():
    return llama_model(seed=2)


def _serve(host: TwoPCHost, timeout: float = 30.0):
    server = TwoPCServer(host, "127.0.0.1", 0, session_timeout=timeout)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def llama_server(llama):
    config, w = llama
    host = TwoPCHost("tiny-llama", embedding="onehot-linear", lm=LoadedModel("tiny-llama", config, w))
    server = _serve(host)
    yield server
    server.shutdown()


def _raw_hello(addr, **fields):
    chan = TCPChannel.connect(*addr, timeout=20)
    chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "2pc", **fields})
    return chan


def test_generate_over_tcp_matches_plaintext_greedy(llama, llama_server):
    config, w = llama
    ex = plain_decoder(config, w)

    def margin(p):
        lg = np.sort(ex.forward(p)[-1])
        return lg[-1] - lg[-2]

    # the candidate prompt whose first greedy step is clear of the fixed-point error
    prompt = max(([3, 17, 5, 88], [1, 2, 3, 4], [50, 60, 70, 80], [11, 22, 33, 44], [90, 8, 7, 6]), key=margin)
    ref_ids, ref_logits = ex.generate(prompt, max_new_tokens=3, eos_token_ids=[], return_logits=True)
    seen = []
    with TwoPCClient(*llama_server.address, model="tiny-llama", timeout=60) as client:
        assert client.kind == "decoder" and client.plan["embedding"] == "onehot-linear"
        assert client.config["hidden_size"] == config["hidden_size"] and client.config["vocab_size"] == 97
        ids = client.generate(prompt, 3, eos_ids=[], on_token=seen.append)
        stats = client.server_stats()
        summary = client.meter.summary()
    assert ids == seen and len(ids) == 3
    # greedy tokens equal the plaintext ones wherever the plaintext top-2 margin exceeds the
    # fixed-point error; the first step is checked unconditionally (margin asserted)
    margins = [np.diff(np.sort(lg)[-2:])[0] for lg in ref_logits]
    assert margins[0] > 0.1
    assert ids[0] == ref_ids[0]
    for a, b, m in zip(ids, ref_ids, margins):
        if a != b:
            assert m < 0.1
            break
    assert stats["requests"] == 1 and stats["seconds"]["linear"] > 0
    assert summary["linear"]["bytes"] > 0 and summary["sampling"]["bytes"] > 0


def test_unknown_model_and_wrong_mode_are_refused(llama_server):
    with pytest.raises(RemoteError, match="unknown model 'nope'"):
        TwoPCClient(*llama_server.address, model="nope", timeout=20)
    chan = _raw_hello(llama_server.address, model=None)
    chan.close()
    chan = TCPChannel.connect(*llama_server.address, timeout=20)
    chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload"})
    msg = chan.recv()
    assert msg["type"] == "error" and "2pc" in msg["message"]
    chan.close()


def test_bad_requests_get_errors_and_the_server_goes_on(llama_server):
    addr = llama_server.address
    for bad in ({"type": "generate", "n_prompt": 0, "max_new_tokens": 2},
                {"type": "generate", "n_prompt": 10 ** 9, "max_new_tokens": 2},
                {"type": "generate", "n_prompt": "4", "max_new_tokens": 2},
                {"type": "classify", "n_tokens": 3},
                {"type": "launch"}):
        chan = _raw_hello(addr)
        assert chan.recv()["type"] == "welcome"
        chan.send(bad)
        msg = chan.recv()
        assert msg["type"] == "error", bad
        chan.close()
    # malformed frames: bad magic; a header announcing a 1 TB payload; a payload that does not decode
    for raw in (b"XXXX" + b"\x00" * 60, struct.pack(">4sBBHQ", b"CLMF", 1, 0, 0, 1 << 40),
                struct.pack(">4sBBHQ", b"CLMF", 1, 0, 0, 8) + b"\xff" * 8):
        s = socket.create_connection(addr, timeout=10)
        s.sendall(raw)
        s.settimeout(10)
        try:
            s.recv(1 << 16)  # the server closes the session (an error reply at most)
        except OSError:
            pass
        s.close()
    # still serving: a proper handshake works
    with TwoPCClient(*addr, timeout=20) as client:
        assert client.model == "tiny-llama"


def test_client_crash_mid_inference_ends_only_that_session(llama_server):
    addr = llama_server.address
    before = llama_server.sessions_failed
    chan = _raw_hello(addr)
    welcome = chan.recv()
    assert welcome["config_digest"] == config_digest(welcome["config"])
    chan.send({"type": "generate", "n_prompt": 3, "max_new_tokens": 2})
    assert chan.recv()["type"] == "go"
    chan.close()  # the client vanishes before its first protocol message
    deadline = time.time() + 20
    while llama_server.sessions_failed == before and time.time() < deadline:
        time.sleep(0.1)
    assert llama_server.sessions_failed == before + 1
    with TwoPCClient(*addr, timeout=20) as client:  # the server goes on
        assert client.limits["max_new_tokens"] >= 1


def test_stalled_client_times_out(llama):
    config, w = llama
    host = TwoPCHost("tiny-llama", embedding="onehot-linear", lm=LoadedModel("tiny-llama", config, w))
    server = _serve(host, timeout=1.5)
    try:
        chan = _raw_hello(server.address)
        chan.recv()
        chan.send({"type": "generate", "n_prompt": 2, "max_new_tokens": 1})
        chan.recv()  # go; then silence (the server's first protocol messages are not answered)
        t0 = time.time()
        msg = chan.recv(timeout=15)
        while msg.get("type") != "error":
            msg = chan.recv(timeout=15)
        assert "Timeout" in msg["message"]
        assert time.time() - t0 < 10
        chan.close()
    finally:
        server.shutdown()


def test_classify_over_tcp():
    config, w, cls = bert_model()
    host = TwoPCHost("tiny-bert", embedding="onehot-linear", lm=LoadedModel("tiny-bert", config, w),
                     classifier=cls, labels=["neg", "pos"])
    server = _serve(host)
    try:
        from cipherlm.runtime.plain import EncoderExecutor, PlainLinear, split_params

        client_p, server_l = split_params(config, w)
        ex = EncoderExecutor(config, client_p, PlainLinear(dict(server_l) | {"classifier": cls}, dtype=np.float64))
        ids = np.array([101, 7, 9, 33, 102])
        ref = ex.classify(ids[None])[0]
        with TwoPCClient(*server.address, timeout=60) as client:
            assert client.labels == ["neg", "pos"]
            logits = client.classify(ids)
            with pytest.raises(ProtocolError, match="encoder"):
                client.generate([1, 2], 1)
        assert np.abs(logits - ref).max() < 0.05
    finally:
        server.shutdown()


def test_server_process_and_server_crash(tmp_path, llama):
    """`cipherlm serve --mode 2pc` as its own process (the model from an HF directory);
    a session runs; then the server is killed mid-inference and the client fails fast."""
    import torch
    import transformers as T

    config, _ = llama
    cfg = T.LlamaConfig(**{k: v for k, v in config.items() if k in T.LlamaConfig().to_dict()})
    torch.manual_seed(2)
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny", safe_serialization=True)
    from cipherlm.commands import start_server_process, stop_process

    env_model = str(tmp_path / "tiny")
    proc, addr = start_server_process(env_model, timeout=120, mode="2pc")
    try:
        with TwoPCClient(*addr, timeout=60) as client:
            ids = client.generate([3, 4, 5], 1, eos_ids=[])
            assert len(ids) == 1 and 0 <= ids[0] < config["vocab_size"]
        client = TwoPCClient(*addr, timeout=60)
        killer = threading.Timer(1.0, proc.kill)
        killer.start()
        t0 = time.time()
        with pytest.raises((RemoteError, ChannelClosed, ChannelTimeout, ConnectionError)):
            client.generate([3, 4, 5, 6, 7, 8, 9, 10], 20, eos_ids=[])
        assert time.time() - t0 < 30
        client.chan.close()
    finally:
        stop_process(proc)

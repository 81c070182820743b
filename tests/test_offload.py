"""Offload mode end to end on a tiny random Llama: correctness against the plaintext
executor, and the server's behaviour under bad input (it must keep serving)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cipherlm.net.channel import TCPChannel  # noqa: E402
from cipherlm.runtime.offload_client import OffloadClient  # noqa: E402
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION, RemoteError  # noqa: E402
from cipherlm.runtime.offload_server import ModelHost, OffloadServer  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    host = ModelHost(str(tiny_llama_dir))
    srv = OffloadServer(host, "127.0.0.1", 0, session_timeout=3.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def plain_logits(model_dir, ids):
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import PlainLinear, make_executor, split_params

    lm = load_model(str(model_dir))
    cp, sl = split_params(lm.config, lm.weights)
    ex = make_executor(lm.config, cp, PlainLinear(sl))
    return ex, ex.forward(np.asarray(ids), ex.new_cache())


def test_offload_matches_plaintext(server, tiny_llama_dir):
    ids = [3, 17, 42, 5, 9]
    with OffloadClient(*server.address) as client:
        ex = client.executor()
        logits = ex.forward(np.asarray(ids), ex.new_cache())
    _, ref = plain_logits(tiny_llama_dir, ids)
    err = np.max(np.abs(logits - ref)) / np.max(np.abs(ref))
    assert err < 1e-5, err


def test_offload_greedy_generation_identical(server, tiny_llama_dir):
    prompt = [1, 2, 3, 4]
    with OffloadClient(*server.address) as client:
        new_ids, _ = client.executor().generate(prompt, max_new_tokens=6, return_logits=True)
        stats = client.server_stats()
        totals = client.chan.totals()
    ref_ex, _ = plain_logits(tiny_llama_dir, prompt)
    ref_ids, _ = ref_ex.generate(prompt, max_new_tokens=6, return_logits=True)
    assert list(new_ids) == list(ref_ids)
    assert sum(ops.get("multiply_plain", 0) for ops in stats["he_ops"].values()) > 0
    assert set(stats["he_ops"]) >= {"attn_qkv", "attn_out", "ffn_in", "ffn_out", "lm_head"}
    assert totals["bytes_sent"] > 0 and totals["bytes_received"] > 0


def test_bundle_is_cached_on_second_session(server):
    with OffloadClient(*server.address):
        pass
    with OffloadClient(*server.address) as client:
        assert client.bundle_from_cache


def _assert_server_still_serves(server):
    with OffloadClient(*server.address) as client:
        ex = client.executor()
        out = ex.forward(np.asarray([1, 2]), ex.new_cache())
        assert np.all(np.isfinite(out))


def _send_raw_and_drain(server, data: bytes) -> None:
    """Send raw bytes on a fresh connection and read whatever the server answers before closing."""
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(data)
        s.settimeout(5)
        try:
            s.recv(1 << 16)
        except (ConnectionError, socket.timeout):
            pass


def test_garbage_bytes_then_server_keeps_serving(server):
    _send_raw_and_drain(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
    _assert_server_still_serves(server)


def test_oversized_frame_header_rejected(server):
    from cipherlm.net import framing

    # a valid header announcing 2^60 bytes: the server must refuse before allocating
    _send_raw_and_drain(server, framing.encode_header(framing.KIND_MESSAGE, 1 << 60))
    _assert_server_still_serves(server)


def test_unknown_model_is_a_clear_error(server):
    with pytest.raises(RemoteError, match="unknown model"):
        OffloadClient(*server.address, model="no-such-model")
    _assert_server_still_serves(server)


def test_client_of_another_mode_is_a_clear_error(server):
    from cipherlm.net.channel import TCPChannel

    chan = TCPChannel.connect(*server.address, timeout=5)
    try:
        chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "2pc", "model": None})
        reply = chan.recv()
    finally:
        chan.close()
    assert reply["type"] == "error" and "offload mode, not '2pc'" in reply["message"], reply
    _assert_server_still_serves(server)


def _error_reply(server, msg: dict) -> str:
    """Open a session, send ``msg``, return the server's error message."""
    client = OffloadClient(*server.address)
    try:
        client.chan.send(msg)
        reply = client.chan.recv()
        assert reply["type"] == "error", reply
        return reply["message"]
    finally:
        client.chan.close()


def test_wrong_group_and_wrong_ciphertext(server):
    assert "group" in _error_reply(server, {"type": "linear", "group": 10_000, "cts": [b"x"]})
    _error_reply(server, {"type": "linear", "group": 0, "cts": [b"not a ciphertext"]})
    _assert_server_still_serves(server)


def test_client_disconnect_mid_request(server):
    client = OffloadClient(*server.address)
    group = client.groups[0]
    ct = client.engine.encrypt(group.index, np.ones(group.d_in))
    client.chan.send({"type": "linear", "group": group.index, "cts": [ct] * 4})
    client.chan.close()  # gone before the answer
    _assert_server_still_serves(server)


def test_stalled_client_times_out_and_server_keeps_serving(server):
    chan = TCPChannel.connect(*server.address, timeout=10)
    chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload", "model": None})
    chan.recv()
    time.sleep(server.session_timeout + 1.0)  # say nothing: the server drops us
    reply = chan.recv(timeout=5)
    assert reply["type"] == "error" and "Timeout" in reply["message"]
    chan.close()
    _assert_server_still_serves(server)


def test_truncated_frame_then_server_keeps_serving(server):
    from cipherlm.net import framing

    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(framing.encode_header(framing.KIND_MESSAGE, 1000) + b"x" * 10)  # then vanish
    _assert_server_still_serves(server)


def test_ciphertext_of_other_parameters_is_rejected(server):
    from cipherlm.he import ClientKeys, HEContext, HEParams
    from cipherlm.he.matmul import encrypt_input

    client = OffloadClient(*server.address)
    try:
        group = client.groups[0]
        other = HEContext(HEParams("other", "ckks", 8192, (60, 40, 40, 60)))
        plan = client.engine.plans[client.engine.parts[group.index][0]]
        foreign = encrypt_input(ClientKeys(other), np.ones(group.d_in), plan)
        client.chan.send({"type": "linear", "group": group.index, "cts": [foreign]})
        reply = client.chan.recv()
        assert reply["type"] == "error" and "HEError" in reply["message"]
    finally:
        client.chan.close()
    _assert_server_still_serves(server)


def test_server_logs_no_payloads(server, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    with OffloadClient(*server.address) as client:
        ex = client.executor()
        ex.forward(np.asarray([7, 8, 9]), ex.new_cache())
    time.sleep(0.2)
    server_records = [r for r in caplog.records if r.name.startswith("cipherlm.serve")]
    assert server_records, "the server logs session events"
    for r in server_records:
        msg = r.getMessage()
        assert "session" in msg and len(msg) < 200, msg

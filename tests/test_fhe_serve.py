"""The fhe mode served over TCP (issue 17): whole blocks on CKKS ciphertexts with
bootstrapping, one upload and one result per request, at the INSECURE test preset.

* a tiny random BERT with a random classifier head: the class logits over loopback match
  the plaintext computation (argmax, and within 1e-2);
* the tiny Llama (`tiny_llama_dir`): next-token logits' argmax and a 2-token greedy
  generation match the plaintext executor's;
* the transcript of a request: one message up, one message down, nothing in between
  (the channel's counters; a client that got anything else would say so);
* bad input (ciphertexts of the wrong size or garbage, the wrong number of them, too many
  tokens, a request before the keys, malformed key uploads, a client that leaves during
  the evaluation) ends that session with a clear error and the server serves the next.

One server per model for the module (threads), keys made once per model.  Skipped only
when the Lattigo library is not built.
"""

from __future__ import annotations

import importlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cipherlm.net.channel import ChannelClosed, TCPChannel  # noqa: E402
from cipherlm.runtime.fhe_protocol import (  # noqa: E402
    KEY_BLOBS,
    PROTOCOL_VERSION,
    TEST_PRESET,
    ProtocolError,
    RemoteError,
)

from conftest import wait_for  # noqa: E402

MAX_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def lattigo():
    """The backend module, imported here, not at collection; skips when it is not built."""
    mod = importlib.import_module("cipherlm.he.lattigo_backend")
    if not mod.available():
        pytest.skip(f"the Lattigo library {mod.library_path()} is not built: {mod.BUILD_HINT}")
    return mod


@pytest.fixture(scope="module", autouse=True)
def bundle_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("fhe-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-bert")
    transformers.BertModel(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def head():
    rng = np.random.default_rng(2)
    return rng.normal(size=(2, 32)), rng.normal(size=2) * 0.1


def _serve(host):
    from cipherlm.runtime.fhe_server import FheServer

    srv = FheServer(host, "127.0.0.1", 0, session_timeout=30.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv, t


@pytest.fixture(scope="module")
def bert(tiny_bert_dir, head):
    """(server, host, keys) of the tiny BERT with its classifier head."""
    from cipherlm.runtime.fhe_client import FheKeys
    from cipherlm.runtime.fhe_server import FheHost

    host = FheHost(tiny_bert_dir, preset=TEST_PRESET, max_tokens=MAX_TOKENS, insecure_test_preset=True,
                   classifier=head, labels=["neg", "pos"])
    srv, t = _serve(host)
    keys = FheKeys(TEST_PRESET, host.rotation_steps, insecure_ok=True)
    yield srv, host, keys
    srv.shutdown()
    t.join(timeout=10)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    from cipherlm.runtime.fhe_client import FheKeys
    from cipherlm.runtime.fhe_server import FheHost

    host = FheHost(tiny_llama_dir, preset=TEST_PRESET, max_tokens=MAX_TOKENS, insecure_test_preset=True)
    srv, t = _serve(host)
    keys = FheKeys(TEST_PRESET, host.rotation_steps, insecure_ok=True)
    yield srv, host, keys
    srv.shutdown()
    t.join(timeout=10)


def client(srv, keys, **kw):
    from cipherlm.runtime.fhe_client import FheClient

    return FheClient(*srv.address, insecure_ok=True, keys=keys, timeout=30.0, **kw)


def raw(srv) -> TCPChannel:
    """A channel past the hello (no bundle, no keys)."""
    chan = TCPChannel.connect(*srv.address, timeout=30.0)
    chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "fhe", "model": None})
    w = chan.recv()
    assert w["type"] == "welcome"
    return chan


def refused(chan, *needles) -> str:
    """The server's error for this session, which it then closes."""
    reply = chan.recv()
    assert reply["type"] == "error", reply.get("type")
    for n in needles:
        assert n in reply["message"], reply["message"]
    with pytest.raises(ChannelClosed):
        chan.recv()
    chan.close()
    return reply["message"]


def good_infer(c, ids, task="classify") -> dict:
    P = c.packing(len(ids))
    return {"type": "infer", "task": task, "tokens": len(ids), "cts": c.keys.encrypt_rows(P.pack(c.embed(ids)))}


# ----------------------------------------------------------------------------- set-up


def test_welcome_and_insecure_refusal(bert, monkeypatch):
    from cipherlm.runtime.fhe_client import FheClient, InsecureServerError
    from cipherlm.runtime.fhe_server import FheServer

    srv, host, keys = bert
    sessions = []
    real_new_session = FheServer.new_session

    def keep(self, chan):
        sessions.append(real_new_session(self, chan))
        return sessions[-1]

    monkeypatch.setattr(FheServer, "new_session", keep)
    with pytest.raises(InsecureServerError, match="INSECURE"):
        FheClient(*srv.address, timeout=30.0)  # insecure_ok not given: refused after the welcome
    with client(srv, keys) as c:
        w = c.welcome
        assert w["insecure"] is True and w["preset"] == TEST_PRESET and w["kind"] == "encoder"
        assert w["rotation_steps"] == host.rotation_steps and w["max_tokens"] == MAX_TOKENS
        assert w["labels"] == ["neg", "pos"] and w["tasks"] == ["classify"] and w["d"] == 32
        sizes = keys.sizes()
        # the exact sizes the server derives for the preset are those of real keys
        assert sizes["relin"] == w["key_sizes"]["relin"] and sizes["bootstrap"] == w["key_sizes"]["bootstrap"]
        assert sizes["galois"] == w["key_sizes"]["galois_max"]
        assert c.server_stats()["infers"] == 0
        bk = sessions[-1].bootstrap_keys
        assert bk is not None and bk.h
    # the session's keys are dropped when it ends (the bootstrapping keys freed at once)
    wait_for(lambda: sessions[-1].bootstrap_keys is None and sessions[-1].eval_keys is None and bk.h == 0,
             "keys dropped")


def test_cli_refuses_the_test_preset_without_the_flag(capsys):
    from cipherlm.cli import build_parser
    from cipherlm.commands import UserError, cmd_serve

    args = build_parser().parse_args(["serve", "--mode", "fhe", "--fhe-preset", TEST_PRESET, "--port", "0"])
    assert args.max_tokens is None and not args.insecure_test_preset
    with pytest.raises(UserError, match="insecure-test-preset"):
        cmd_serve(args)
    args = build_parser().parse_args(["classify", "--mode", "fhe", "--server", "127.0.0.1:1", "--insecure-ok"])
    assert args.insecure_ok and args.server == ("127.0.0.1", 1)


# ----------------------------------------------------------------------------- bad input


def test_infer_before_keys(bert):
    srv, host, keys = bert
    chan = raw(srv)
    chan.send({"type": "infer", "task": "classify", "tokens": 3, "cts": [b"x"]})
    refused(chan, "infer before keys")


def _keys_msg(sizes, parts):
    return {"type": "keys", "sizes": sizes, "parts": parts}


@pytest.mark.parametrize("case", ["bootstrap size", "relin size", "index", "blob order", "short", "garbage",
                                  "part without keys"])
def test_malformed_key_upload(bert, case):
    srv, host, keys = bert
    sizes = keys.sizes()
    parts = keys.parts(64 << 20)  # relin, galois, bootstrap: one part each at the test preset
    assert [b for b, _ in parts] == list(KEY_BLOBS)
    chan = raw(srv)
    if case == "bootstrap size":
        chan.send(_keys_msg({**sizes, "bootstrap": sizes["bootstrap"] + 8}, 3))
        refused(chan, "bootstrapping keys of")
    elif case == "relin size":
        chan.send(_keys_msg({**sizes, "relin": sizes["relin"] - 1}, 3))
        refused(chan, "relinearisation key of")
    elif case == "index":
        chan.send(_keys_msg(sizes, 3))
        chan.send({"type": "keys_part", "index": 1, "total": 3, "blob": "relin", "data": parts[0][1]})
        refused(chan, "out of order")
    elif case == "blob order":
        chan.send(_keys_msg(sizes, 3))
        chan.send({"type": "keys_part", "index": 0, "total": 3, "blob": "galois", "data": parts[1][1]})
        refused(chan, "'relin' was expected")
    elif case == "short":
        chan.send(_keys_msg(sizes, 3))
        chan.send({"type": "keys_part", "index": 0, "total": 3, "blob": "relin", "data": b"\0" * 1000})
        refused(chan, "parts below")
    elif case == "garbage":  # the right sizes, bytes that are no keys
        chan.send(_keys_msg(sizes, 3))
        for i, (blob, data) in enumerate(parts):
            chan.send({"type": "keys_part", "index": i, "total": 3, "blob": blob, "data": b"\xff" * len(data)})
        refused(chan, "HEError")
    else:
        chan.send({"type": "keys_part", "index": 0, "total": 1, "blob": "relin", "data": b"x"})
        refused(chan, "unexpected message type")


def test_second_key_upload_is_refused(bert):
    srv, host, keys = bert
    c = client(srv, keys)
    c.chan.send(_keys_msg(keys.sizes(), 3))
    refused(c.chan, "already sent")


@pytest.mark.parametrize("case", ["garbage ct", "ct of the wrong size", "not bytes", "too many cts", "too few cts",
                                  "too many tokens", "zero tokens", "wrong task", "client refresh"])
def test_bad_infer(bert, case):
    srv, host, keys = bert
    c = client(srv, keys)
    ids = [5, 7, 9]
    msg = good_infer(c, ids)
    ct = msg["cts"][0]
    if case == "garbage ct":
        msg["cts"] = [b"\x00garbage" * 4]
        want = ("HEError",)
    elif case == "ct of the wrong size":
        msg["cts"] = [ct[:-8]]
        want = ("HEError", "expected")
    elif case == "not bytes":
        msg["cts"] = ["abc"]
        want = ("not a byte blob",)
    elif case == "too many cts":
        msg["cts"] = [ct, ct]
        want = ("must be a list of 1 ciphertexts",)
    elif case == "too few cts":
        msg["cts"] = []
        want = ("must be a list of 1 ciphertexts",)
    elif case == "too many tokens":
        msg["tokens"] = MAX_TOKENS + 1
        want = ("LimitExceeded", f"1..{MAX_TOKENS}")
    elif case == "zero tokens":
        msg["tokens"] = 0
        want = ("LimitExceeded",)
    elif case == "wrong task":
        msg["task"] = "logits"
        want = ("no 'logits' task",)
    else:
        msg["refresh"] = "client"
        want = ("this session refreshes by 'bootstrap'",)
    c.chan.send(msg)
    refused(c.chan, *want)
    assert srv.infers_done == 0


def test_client_checks_its_requests(bert):
    srv, host, keys = bert
    with client(srv, keys) as c:
        with pytest.raises(ValueError, match="at most"):
            c.classify(list(range(MAX_TOKENS + 1)))
        with pytest.raises(ValueError, match="token ids"):
            c.classify([1000])


def test_disconnect_mid_evaluation_stops_the_work(bert, caplog):
    srv, host, keys = bert
    failed = srv.sessions_failed
    c = client(srv, keys)
    with caplog.at_level(logging.INFO, logger="cipherlm.serve"):
        c.chan.send(good_infer(c, [4, 8, 15, 16]))
        c.chan.close()  # gone right after the upload: the server notices after the first layer
        wait_for(lambda: srv.sessions_failed > failed, "the session ended", limit=60)
    assert "disconnected" in caplog.text and "after layer 1 of 2" in caplog.text, caplog.text
    assert srv.infers_done == 0
    assert "layer 2 of 2 done" not in caplog.text


# ----------------------------------------------------------------------------- results


def test_classify_matches_plaintext_and_sends_nothing_in_between(bert, tiny_bert_dir, head, log_secrets):
    """After every bad session above, the same server serves a good one."""
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    srv, host, keys = bert
    ids = [11, 42, 7, 93, 28, 64, 3]
    log_secrets.add("11, 42, 7, 93")
    with client(srv, keys) as c:
        got = c.classify(ids)
        traffic = c.last_infer_traffic
        stats = c.infer_stats[-1]
    W, b = head
    e = plain_executor(load_model(tiny_bert_dir), dtype=np.float64).sentence_embedding(np.asarray(ids))
    want = e @ W.T + b
    assert got.shape == (2,)
    assert int(np.argmax(got)) == int(np.argmax(want))
    assert np.max(np.abs(got - want)) < 1e-2, (got, want)
    # the transcript of the request: one frame up (the upload), one frame down (the result),
    # one flight each way; anything the server sent meanwhile would be a second message received
    assert traffic["messages_sent"] == 1 and traffic["rounds"] == 1, traffic
    assert traffic["messages_received"] == 1 and traffic["flights_received"] == 1, traffic
    assert stats["counts"].get("bootstrap", 0) > 0 and stats["layers"] == 2
    assert srv.infers_done == 1


def test_client_refuses_a_message_before_the_result(bert):
    """The other side of the transcript check: a server that talks during the evaluation
    (here a fake one that sends a progress frame first) is a protocol error for the client."""
    srv, host, keys = bert
    with client(srv, keys) as c:
        a, b = socket.socketpair()
        real, c.chan = c.chan, TCPChannel(a, timeout=10.0)
        fake = TCPChannel(b, timeout=10.0)

        def serve_fake():
            fake.recv()
            fake.send({"type": "progress", "layer": 1})
            fake.send({"type": "result", "task": "classify", "d": 2, "cts": [], "stats": {}})

        t = threading.Thread(target=serve_fake, daemon=True)
        t.start()
        with pytest.raises(ProtocolError, match="expected a 'result' message"):
            c.classify([1, 2, 3])
        t.join(timeout=10)
        c.chan.close()
        fake.close()
        c.chan = real


def test_llama_next_token_and_greedy_generation(llama, tiny_llama_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    srv, host, keys = llama
    ids = [3, 17, 42, 5, 9]
    t0 = time.perf_counter()
    with client(srv, keys) as c:
        assert c.kind == "decoder" and c.tasks == ["logits"]
        new, logits = c.generate(ids, 2)
        traffic = c.last_infer_traffic
    ex = plain_executor(load_model(tiny_llama_dir), dtype=np.float64)
    want_new, want_logits = ex.generate(ids, max_new_tokens=2, return_logits=True, eos_token_ids=[])
    assert int(np.argmax(logits[0])) == int(np.argmax(want_logits[0]))
    assert np.max(np.abs(logits[0] - want_logits[0])) < 1e-2
    assert new == list(want_new)
    assert traffic["messages_sent"] == 1 and traffic["messages_received"] == 1
    steps = [(s["tokens"]) for s in c.infer_stats]
    assert steps == [len(ids), 1]  # the second token's pass carried only the first new token (KV cache)
    assert time.perf_counter() - t0 < 120


def test_decoding_steps_must_follow_the_kv_cache(llama):
    """A decoding step (offset > 0) must start where the session's KV cache ends; a classify
    request takes no offset; offset 0 starts a new cache."""
    srv, host, keys = llama
    with client(srv, keys) as c:
        with pytest.raises(RemoteError, match="KV cache holds 0"):
            c.next_logits([4], offset=3)
    with client(srv, keys) as c:
        c.next_logits([3, 4])
        with pytest.raises(RemoteError, match="KV cache holds 2"):
            c.next_logits([5], offset=1)
    with client(srv, keys) as c:  # the session ended at the error; a new one is served
        c.next_logits([3, 4])
        c.next_logits([5], offset=2)
        c.next_logits([6, 7], offset=0)  # a new prompt: a new cache


def test_remote_error_reaches_the_client(llama):
    """A decoder server has no classify task: the client says so before sending anything;
    a request the server refuses comes back as RemoteError."""
    srv, host, keys = llama
    with client(srv, keys) as c:
        with pytest.raises(ValueError, match="no 'classify' task"):
            c.classify([1, 2])
        c.tasks = ["logits", "classify"]  # pretend, so the request goes out
        with pytest.raises(RemoteError, match="no 'classify' task"):
            c.classify([1, 2])


# ----------------------------------------------------------------------------- client-aided refresh


@pytest.fixture(scope="module")
def client_keys(bert):
    from cipherlm.runtime.fhe_client import FheKeys

    srv, host, _ = bert
    return FheKeys(TEST_PRESET, host.rotation_steps, insecure_ok=True, refresh="client")


def test_client_refresh_classify_matches_plaintext(bert, client_keys, tiny_bert_dir, head, log_secrets):
    """--refresh client: no bootstrapping keys go up, the server never bootstraps, every
    refresh is one round trip (one message each way, counted by the channel), and the class
    logits match the plaintext computation as closely as with bootstrapping."""
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import plain_executor

    srv, host, _ = bert
    ids = [11, 42, 7, 93, 28, 64, 3]
    log_secrets.add("11, 42, 7, 93")
    with client(srv, client_keys, refresh="client") as c:
        assert "bootstrap" not in client_keys.sizes() and c.welcome["refresh"] == ["bootstrap", "client"]
        setup_up = c.chan.bytes_sent
        got = c.classify(ids)
        traffic, stats = c.last_infer_traffic, c.infer_stats[-1]
        rounds = c.client_refreshes
    W, b = head
    e = plain_executor(load_model(tiny_bert_dir), dtype=np.float64).sentence_embedding(np.asarray(ids))
    want = e @ W.T + b
    assert int(np.argmax(got)) == int(np.argmax(want))
    assert np.max(np.abs(got - want)) < 1e-2, (got, want)
    assert stats["refresh"] == "client" and stats["counts"].get("bootstrap", 0) == 0
    assert rounds == stats["client_refreshes"] == stats["refresh_rounds_answered"] > 0
    assert stats["counts"]["client_refresh"] >= rounds
    assert traffic["messages_sent"] == 1 + rounds and traffic["messages_received"] == 1 + rounds, traffic
    assert setup_up < host.key_sizes["bootstrap"]  # the upload carried no bootstrapping keys


def test_client_refresh_greedy_generation(llama, tiny_llama_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_client import FheKeys
    from cipherlm.runtime.plain import plain_executor

    srv, host, _ = llama
    keys = FheKeys(TEST_PRESET, host.rotation_steps, insecure_ok=True, refresh="client")
    ids = [3, 17, 42, 5, 9]
    with client(srv, keys, refresh="client") as c:
        new, logits = c.generate(ids, 2)
        steps = [(s["tokens"], s["refresh"]) for s in c.infer_stats]
    want_new, want_logits = plain_executor(load_model(tiny_llama_dir), dtype=np.float64).generate(
        ids, max_new_tokens=2, return_logits=True, eos_token_ids=[])
    assert new == list(want_new) and np.max(np.abs(logits[0] - want_logits[0])) < 1e-2
    assert steps == [(len(ids), "client"), (1, "client")]


@pytest.mark.parametrize("case", ["garbage", "wrong count", "not a list", "error report", "vanishes"])
def test_bad_client_refresh_answers_end_only_that_session(bert, client_keys, case):
    srv, host, _ = bert
    failed = srv.sessions_failed
    c = client(srv, client_keys, refresh="client")
    c.chan.send(good_infer(c, [4, 8, 15]))
    msg = c.chan.recv()
    assert msg["type"] == "refresh" and all(isinstance(b, bytes) for b in msg["cts"])
    if case == "vanishes":
        c.chan.close()
        wait_for(lambda: srv.sessions_failed > failed, "the session ended", limit=60)
    else:
        fresh = c.keys.reencrypt(msg["cts"])
        reply = {"garbage": {"type": "refreshed", "cts": [b"\x00junk" * 8] * len(fresh)},
                 "wrong count": {"type": "refreshed", "cts": fresh + fresh},
                 "not a list": {"type": "refreshed", "cts": "abc"},
                 "error report": {"type": "error", "message": "no"}}[case]
        c.chan.send(reply)
        want = {"garbage": "HEError", "wrong count": "refreshed 2", "not a list": "must be a list",
                "error report": "error report"}[case]
        if case == "wrong count" and len(fresh) != 1:
            want = "refreshed"
        refused(c.chan, want)
    assert srv.infers_done >= 0
    with client(srv, client_keys, refresh="client") as good:  # the server serves the next session
        assert good.classify([5, 6]).shape == (2,)


@pytest.mark.parametrize("case", ["unknown path", "bootstrap keys with client", "no bootstrap keys"])
def test_refresh_path_of_the_key_upload_is_checked(bert, case):
    srv, host, keys = bert
    chan = raw(srv)
    sizes = {"relin": host.key_sizes["relin"], "galois": 1 << 20, "bootstrap": host.key_sizes["bootstrap"]}
    if case == "unknown path":
        chan.send({"type": "keys", "refresh": "teleport", "sizes": sizes, "parts": 3})
        refused(chan, "unknown refresh path 'teleport'")
    elif case == "bootstrap keys with client":
        chan.send({"type": "keys", "refresh": "client", "sizes": sizes, "parts": 3})
        refused(chan, "sizes must give the bytes of ['relin', 'galois']")
    else:
        del sizes["bootstrap"]
        chan.send({"type": "keys", "sizes": sizes, "parts": 2})
        refused(chan, "sizes must give the bytes of ['relin', 'galois', 'bootstrap']")

"""Malformed SEAL blobs never reach SEAL's stream loader (he/serialize.py).

The corpus (tests/seal_corpus.py): truncated and corrupted zstd streams with
valid headers, random bytes posing as zstd/zlib, a zstd bomb, broken layouts,
for both schemes and for ciphertexts, public keys and Galois keys, plus the
crash shapes a fuzzer found.  Everything that could abort a process runs in a
child process: the loaders themselves, and live `cipherlm serve` servers of
both modes, which must answer each bad blob with an error and then serve a
legitimate client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import seal_corpus

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cipherlm.commands import start_server_process, stop_process  # noqa: E402
from cipherlm.net.channel import TCPChannel  # noqa: E402
from cipherlm.runtime.offload_protocol import RemoteError  # noqa: E402

TESTS = os.path.dirname(__file__)


def _may_load(desc: str) -> bool:
    """Random byte changes inside a zstd literal can leave a well-formed object (see
    test_every_corpus_blob_is_rejected_with_heerror): those may be accepted."""
    return "corrupted" in desc


def _child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_corpus_has_every_scheme_and_kind_and_the_fuzzer_crashers():
    assert seal_corpus.crashers(), "tests/data/seal_crashers is empty"
    for scheme in seal_corpus.SCHEMES:
        kinds = {k for k, _, _ in seal_corpus.corpus(scheme)}
        assert kinds == set(seal_corpus.KINDS)


@pytest.mark.parametrize("name", [c[0] for c in seal_corpus.crashers()])
def test_stored_crashers_abort_an_unguarded_seal_load(name):
    """The stored fuzzer finds are real crash shapes: SEAL's own loader, fed the blob
    unchecked (as the code before the fix did), kills the process with SIGABRT."""
    proc = _child(f"""
        import os, seal_corpus, tenseal.sealapi as seal
        from cipherlm.he import HEContext
        [(_, scheme, kind, blob)] = [c for c in seal_corpus.crashers() if c[0] == {name!r}]
        ctx = HEContext(seal_corpus.params(scheme))
        obj = {{"ciphertext": seal.Ciphertext, "public_key": seal.PublicKey, "galois_keys": seal.GaloisKeys}}[kind]()
        fd = os.memfd_create("blob")
        os.write(fd, blob)
        try:
            obj.load(ctx.seal, f"/proc/self/fd/{{fd}}")
        except Exception as e:
            print("caught", type(e).__name__)
    """)
    assert proc.returncode == -6, (proc.returncode, proc.stdout, proc.stderr[-500:])


@pytest.mark.parametrize("scheme", seal_corpus.SCHEMES)
def test_every_corpus_blob_is_rejected_with_heerror(scheme):
    """In a child process (a regression must not take pytest down): each malformed blob
    is refused by the loader of its kind with HEError; the genuine blobs still load.
    A few changed bytes inside a zstd literal can leave a well-formed object whose
    coefficients are still reduced (nothing in SEAL's format can tell): those few
    "corrupted" items may load; nothing may raise anything else or crash."""
    proc = _child(f"""
        import json, seal_corpus
        from cipherlm.he import HEContext, HEError, serialize as S
        ctx = HEContext(seal_corpus.params({scheme!r}))
        load = {{"ciphertext": lambda b: S.ciphertext_from_bytes(ctx, b, size=None),
                 "public_key": lambda b: S.public_key_from_bytes(ctx, b),
                 "galois_keys": lambda b: S.galois_keys_from_bytes(ctx, b)}}
        out = {{}}
        for kind, blobs in seal_corpus.legit_blobs({scheme!r}).items():
            for b in blobs:
                load[kind](b)
        for kind, desc, blob in seal_corpus.corpus({scheme!r}):
            try:
                load[kind](blob)
                out[desc] = "loaded"
            except HEError:
                out[desc] = "HEError"
            except Exception as e:
                out[desc] = type(e).__name__
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 60
    wrong = {d: r for d, r in results.items() if r != "HEError" and not (r == "loaded" and _may_load(d))}
    assert not wrong, wrong


# --------------------------------------------------------------------------- live servers


def _server(model_dir: str, mode: str):
    # offload: SEAL asked for by name (the corpus is SEAL's blobs; `serve`'s default is auto)
    extra = ("--he-backend", "seal") if mode == "offload" else ()
    proc, addr = start_server_process(model_dir, timeout=300, mode=mode, extra_args=extra)
    return proc, addr


def _offload_session(addr, send: dict) -> dict:
    from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION

    chan = TCPChannel.connect(*addr, timeout=60)
    try:
        chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload", "model": None})
        welcome = chan.recv()
        assert welcome["type"] == "welcome"
        for msg in send(welcome) if callable(send) else [send]:
            chan.send(msg)
            reply = chan.recv()
            if reply.get("type") == "error":
                return reply
        return reply
    finally:
        chan.close()


def test_live_offload_server_answers_malformed_keys_and_ciphertexts_and_keeps_serving(
        tiny_llama_dir, tmp_path, monkeypatch):
    from cipherlm.runtime import offload_engine
    from cipherlm.runtime.linear_groups import LinearGroup
    from cipherlm.runtime.offload_client import OffloadClient

    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path / "cache"))
    items = seal_corpus.corpus("ckks")
    proc, addr = _server(tiny_llama_dir, "offload")
    try:
        # malformed Galois keys in place of the session's keys
        for kind, desc, blob in items:
            if kind != "galois_keys":
                continue
            reply = _offload_session(addr, {"type": "keys", "galois_keys": blob})
            assert (reply["type"] == "error" and "HEError" in reply["message"]
                    or reply["type"] == "ready" and _may_load(desc)), (desc, reply)
            assert proc.poll() is None, desc
        # genuine keys, then malformed ciphertexts (and the BFV crashers: foreign parameters)
        bad_cts = [(d, b) for k, d, b in items if k == "ciphertext"]
        bad_cts += [(f"crasher {n}", b) for n, _, k, b in seal_corpus.crashers() if k == "ciphertext"]

        def requests(welcome):
            groups = [LinearGroup(i, tuple(g["names"]), int(g["d_in"]), tuple(g["d_outs"]))
                      for i, g in enumerate(welcome["groups"])]
            engine = offload_engine.ClientEngine(welcome, groups)
            yield {"type": "keys", "galois_keys": engine.galois_keys_blob()}
            yield {"type": "linear", "group": 0, "cts": [engine.encrypt(0, np.ones(groups[0].d_in))] + [bad]}

        for desc, bad in bad_cts:
            reply = _offload_session(addr, requests)
            assert (reply["type"] == "error" and "HEError" in reply["message"]
                    or reply["type"] == "result" and _may_load(desc)), (desc, reply)
            assert proc.poll() is None, desc
        with OffloadClient(*addr) as client:
            ex = client.executor()
            assert np.all(np.isfinite(ex.forward(np.asarray([1, 2]), ex.new_cache())))
        assert proc.poll() is None
    finally:
        stop_process(proc)


def test_live_2pc_server_answers_malformed_public_keys_and_ciphertexts_and_keeps_serving(
        tiny_llama_dir, monkeypatch):
    from cipherlm.he import keys as he_keys
    from cipherlm.mpc import he_session
    from cipherlm.runtime.twopc_session import TwoPCClient

    items = seal_corpus.corpus("bfv")
    # one of each shape (a session costs seconds: the embedding lookup runs first); the
    # loader test above runs the whole corpus
    shapes = ("zstd truncated to half", "random bytes as zstd", "zstd bomb", "layout counts flipped")
    bad_pks = [(d, b) for k, d, b in items if k == "public_key" and any(x in d for x in shapes)]
    # the cross terms' inputs travel in the Rust core's seeded format ({"c0", "seeds"},
    # `HESession.encrypt_native`), not as SEAL blobs (SEAL's loader keeps the corpus test above)
    real_encrypt = he_session.HESession.encrypt_native

    def bad_inputs(kind):
        def encrypt(self, polys):
            msg = real_encrypt(self, polys)
            c0, seeds = msg["c0"], msg["seeds"]
            return {"truncated c0": {"c0": c0[: len(c0) // 2], "seeds": seeds},
                    "c0 residues above their primes": {"c0": b"\xff" * len(c0), "seeds": seeds},
                    "one seed short": {"c0": c0, "seeds": seeds[:-32]},
                    "c0 not bytes": {"c0": [1, 2, 3], "seeds": seeds}}[kind]
        return encrypt

    bad_cts = ["truncated c0", "c0 residues above their primes", "one seed short", "c0 not bytes"]
    proc, addr = _server(tiny_llama_dir, "2pc")
    try:
        def attempt(desc):
            try:
                with TwoPCClient(*addr, timeout=60) as client:
                    client.generate([1, 2, 3], 1, eos_ids=[])
                # a well-formed key of another key pair: garbage out, but nothing to refuse
                assert _may_load(desc), f"{desc} was accepted"
            except (RemoteError, ConnectionError, TimeoutError) as exc:
                assert "HEError" in str(exc) or isinstance(exc, ConnectionError), (desc, exc)
            assert proc.poll() is None, desc

        with monkeypatch.context() as m:
            for desc, blob in bad_pks:
                m.setattr(he_keys.ClientKeys, "public_key_bytes", lambda self, b=blob: b)
                attempt(desc)
        with monkeypatch.context() as m:
            for desc in bad_cts:
                m.setattr(he_session.HESession, "encrypt_native", bad_inputs(desc))
                attempt(desc)
        with TwoPCClient(*addr, timeout=60) as client:
            ids = client.generate([1, 2, 3], 1, eos_ids=[])
        assert len(ids) == 1 and 0 <= ids[0] < 96
        assert proc.poll() is None
    finally:
        stop_process(proc)

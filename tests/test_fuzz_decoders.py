"""Property-based fuzzing of every decoder that reads a peer's bytes (docs/reliability.md,
"Fuzzing and fault injection": the inventory table lists each target, its module and the
error types it documents; tests/fuzz_targets.py defines them).

Every input must decode or raise the decoder's documented errors; anything else, a hang
(20 s per input) or a crash is a finding.  Deterministic (``derandomize=True``, no example
database) with a bounded number of examples per target (the targets' ``ci_examples``);
the targets that call native code on peer bytes (SEAL, Lattigo, tokenizers) run in one
child process, so that a crash fails the test with the input that caused it instead of
taking pytest down.  benchmarks/fuzz_long.py runs the same targets with a long budget.
net.message's own fuzzer is tests/test_net_message_fuzz.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

import fuzz_targets as F  # noqa: E402

PY_TARGETS = sorted(n for n, t in F.TARGETS.items() if not t.native)
NATIVE_TARGETS = sorted(n for n, t in F.TARGETS.items() if t.native)


def test_inventory_covers_each_network_decoder():
    """The inventory the docs table is made from: frames, messages' consumers, both servers'
    request loops, every client check, the HE loaders of each backend, MPC and ring messages."""
    want = {"frame_header", "channel_stream", "offload_server_requests", "twopc_server_requests", "expect",
            "offload_welcome", "twopc_welcome", "twopc_plan", "offload_bundle", "offload_result",
            "offload_client_engine", "tokenizer_json", "twopc_control", "ot_message", "ring_ciphertext",
            "offload_ct_list", "seal_params", "lattigo_params", "message", "share_messages"}
    want |= {f"seal_{s}_{k}" for s, k in (("ckks", "ciphertext"), ("ckks", "galois_keys"), ("bfv", "ciphertext"),
                                          ("bfv", "public_key"), ("bfv", "galois_keys"))}
    want |= {f"lattigo_{k}" for k in ("ciphertext", "public_key", "galois_keys", "ring_switch_key")}
    assert want <= set(F.TARGETS)
    for t in F.TARGETS.values():
        assert t.errors() and all(isinstance(e, type) and issubclass(e, BaseException) for e in t.errors())


@pytest.mark.parametrize("name", PY_TARGETS)
def test_python_decoder(name):
    res = F.run(name, F.TARGETS[name].ci_examples)
    assert res["examples"] >= F.TARGETS[name].ci_examples


@pytest.fixture(scope="module")
def native_run():
    """All native targets in one child process (one interpreter start-up): {name: result}."""
    runnable = [n for n in NATIVE_TARGETS if F.TARGETS[n].needs() is None]
    out = F.run_in_child_many(runnable, timeout=240)
    return runnable, out


@pytest.mark.parametrize("name", NATIVE_TARGETS)
def test_native_decoder_in_a_child_process(name, native_run):
    runnable, out = native_run
    why = F.TARGETS[name].needs()
    if why:
        pytest.skip(why)  # (Lattigo: reported as not run; the SEAL targets always run)
    assert name in runnable
    res = out["results"].get(name)
    assert res is not None, (f"the child died before {name} finished: returncode {out['returncode']}, "
                             f"last input {out['crash_input']!r}, stderr {out['stderr'][-1500:]}")
    assert res["findings"] == [], res["findings"]
    assert res["examples"] >= F.TARGETS[name].ci_examples

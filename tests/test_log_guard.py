"""The log guard every test runs under (tests/conftest.py `_no_secrets_in_logs`): it flags
registered secrets and value dumps, and lets the server's ordinary lines through."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import log_leaks

ORDINARY = [
    "session 127.0.0.1:40312 opened",
    "session 127.0.0.1:40312 ended: ProtocolError: expected (4, 576) float32 shares, got (4, 575)",
    "model smollm2-135m ready in 22.1 s (HE backend seal, 1 worker, sessions in 2 processes)",
    "chat completion: 14 prompt tokens, 8 completion tokens, finish length, 3.2 s",
    'server 127.0.0.1:7070: model tiny-chat (decoder, offload mode, context 64 tokens)',
]


@pytest.mark.parametrize("line", ORDINARY)
def test_ordinary_lines_pass(line):
    assert log_leaks([("cipherlm.serve", line)], {"zebras?"}) == []


@pytest.mark.parametrize("line", [
    f"logits {np.arange(10.0) / 3!r}",
    f"shares: {list(range(100, 120))}",
    "values 0.25 -1.5 3e-4 7 8 9 10 11.5 12",
    f"key {bytes(range(40))!r}",
    "blob " + "QUJD" * 20,
    "user asked: zebras? please",
])
def test_dumps_and_secrets_are_flagged(line):
    assert log_leaks([("cipherlm.serve", line)], {"zebras?"})


def test_the_guard_sees_records_of_the_running_test(log_secrets):
    """The fixture's handler is on the root logger while the test runs (so a leak would be caught)."""
    log_secrets.add("a private prompt")
    assert any(type(h).__name__ == "_RecordKeeper" for h in logging.getLogger().handlers)

"""Prefill with several token rows packed per ciphertext (issue 15, item 2): the packed
plans of `cipherlm.he.matmul` (token lanes inside each chunk block, one set of rotations for
all rows of a ciphertext) give what the one-row plans and numpy give, on SEAL and Lattigo,
and an offload prefill through packed plans gives the logits of the per-row prefill and of
the plaintext executor."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cipherlm.he import OFFLOAD_CKKS
from cipherlm.he.matmul import (
    apply,
    client_keys,
    decrypt_output,
    decrypt_slots,
    encode_group,
    encrypt_input,
    make_context,
    plan_matmul,
    resolve_offload_backend,
)

BACKENDS = ["seal", pytest.param("lattigo", marks=pytest.mark.skipif(
    resolve_offload_backend("auto")[0] != "lattigo", reason="the Lattigo library is not built (make lattigo)"))]


def _backend_auto() -> str:
    return resolve_offload_backend("auto")[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_matmul_equals_per_row_and_numpy(backend):
    """Packed plans (T = 2, 4, 8; chunks c = 1 and > 1; bias; several output blocks; a partial
    pack) against the one-row plan on each row and against numpy; every slot of a packed
    result is an output (real part), its imaginary form, or zero, as for one row."""
    ctx = make_context(OFFLOAD_CKKS, backend)
    keys = client_keys(ctx)
    rng = np.random.default_rng(7)
    cases = [(96, 80, True, 4, 3), (300, 1000, False, 2, 2), (200, 120, True, 8, 5), (900, 200, True, 4, 4)]
    for d_out, d_in, bias, T, n_rows in cases:
        W = rng.standard_normal((d_out, d_in)) * 0.05
        b = rng.standard_normal(d_out) * 0.1 if bias else None
        X = rng.standard_normal((n_rows, d_in))
        ref = X @ W.T + (0 if b is None else b)
        one = plan_matmul(d_out, d_in, ctx.slots, has_bias=bias, backend=backend)
        pk = plan_matmul(d_out, d_in, ctx.slots, has_bias=bias, backend=backend, tokens=T)
        assert pk.tokens == T and pk.rows + pk.m <= pk.lane and pk.c * pk.tokens * pk.lane == ctx.slots
        gk = keys.galois_keys_bytes(sorted(set(one.rotation_steps) | set(pk.rotation_steps)))
        enc1 = encode_group(ctx, [W], None if b is None else [b], plan=one)
        encp = encode_group(ctx, [W], None if b is None else [b], plan=pk)
        per_row = np.stack([decrypt_output(keys, apply(enc1, encrypt_input(keys, x, one), gk), one) for x in X])
        out = apply(encp, encrypt_input(keys, X, pk), gk)
        packed = decrypt_output(keys, out, pk)
        assert packed.shape == (T, d_out)
        scale = np.max(np.abs(W)) * max(np.max(np.abs(X)), 1.0) * d_in
        assert np.max(np.abs(packed[:n_rows] - ref)) < 1e-6 * scale, (d_out, d_in, T)
        assert np.max(np.abs(packed[:n_rows] - per_row)) < 1e-6 * scale
        assert np.max(np.abs(packed[n_rows:]), initial=0.0) < 1e-6 * scale  # missing rows: zero lanes
        # what one result carries: lane t of every chunk block holds row t's outputs (+ i x the
        # second form, as for one row); every other slot is zero
        from cipherlm.he.matmul import unpack_cts

        for o, blob in enumerate(unpack_cts(out, pk.n_blocks)):
            v = decrypt_slots(keys, blob).reshape(pk.c, T, pk.lane)
            rows = slice(o * pk.rows, min((o + 1) * pk.rows, d_out))
            k = rows.stop - rows.start
            full = np.zeros((T, k))
            full[:n_rows] = ref[:, rows]
            assert np.max(np.abs(v[:, :, :k].real - full[None])) < 1e-6 * scale
            assert np.max(np.abs(v[:, :, k:])) < 1e-6 * scale


@pytest.mark.skipif(_backend_auto() != "lattigo", reason="the Lattigo library is not built (make lattigo)")
def test_lattigo_compressed_packed_diagonals_are_bit_identical():
    """Lattigo: a packed plan's diagonals with one chunk (period S / T in the slots, residues in
    runs of T) are stored at 1/T of the memory (`bsgs_matrix` ``repeat``), and the result
    ciphertexts are byte for byte those of the same diagonals stored whole; with c > 1 chunks
    (no period) nothing is compressed and the results are the same too."""
    from cipherlm.he.matmul import unpack_cts

    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    rng = np.random.default_rng(3)
    # (d_out, d_in, bias, T, the planner's chunk count): one chunk with 4 and 2 tokens (stored
    # at 1/T), 2 and 4 chunks (stored whole)
    for d_out, d_in, bias, T, want_c in [(900, 200, True, 4, 1), (1200, 200, True, 2, 1), (500, 300, True, 2, 2),
                                         (300, 200, False, 2, 4)]:
        pk = plan_matmul(d_out, d_in, ctx.slots, has_bias=bias, backend="lattigo", tokens=T)
        assert pk.c == want_c, "the planner's choice moved: pick shapes that test what the comment says"
        W = rng.standard_normal((d_out, d_in)) * 0.05
        b = rng.standard_normal(d_out) * 0.1 if bias else None
        X = rng.standard_normal((T, d_in))
        gk = keys.galois_keys_bytes(pk.rotation_steps)
        whole = encode_group(ctx, [W], None if b is None else [b], plan=pk, compress=False)
        small = encode_group(ctx, [W], None if b is None else [b], plan=pk)
        assert small.n_plaintexts == whole.n_plaintexts
        assert whole.nbytes == whole.n_plaintexts * 2 * ctx.n * 8
        assert small.nbytes * (T if pk.c == 1 else 1) == whole.nbytes, (d_out, d_in, T, pk.c)
        ct = encrypt_input(keys, X, pk)
        a, c = apply(whole, ct, gk), apply(small, ct, gk)
        assert unpack_cts(a, pk.n_blocks) == unpack_cts(c, pk.n_blocks)
        ref = X @ W.T + (0 if b is None else b)
        scale = np.max(np.abs(W)) * max(np.max(np.abs(X)), 1.0) * d_in
        assert np.max(np.abs(decrypt_output(keys, c, pk) - ref)) < 1e-6 * scale


@pytest.mark.skipif(_backend_auto() != "lattigo", reason="the Lattigo library is not built (make lattigo)")
def test_lattigo_packed_plans_with_several_input_ciphertexts():
    """Lattigo, T = 16 and 32 rows per ciphertext: a lane of S / T slots cannot hold a whole
    input row and its outputs, so the planner cuts the input into P ciphertexts (``in_cts``)
    whose products the server sums per block before one rescale and giant step.  Against numpy
    (a partial pack, bias, several output blocks), with the diagonals at 1/T of the memory; every
    slot of a result is a lane's output (+ i its second form, as for one row) or zero; the wrong number of input ciphertexts is an
    `HEError`."""
    from cipherlm.he import HEError
    from cipherlm.he.matmul import pack_cts, unpack_cts

    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    rng = np.random.default_rng(11)
    for d_out, d_in, bias, T, n_rows in [(960, 576, True, 32, 29), (576, 1536, False, 16, 16)]:
        pk = plan_matmul(d_out, d_in, ctx.slots, has_bias=bias, backend="lattigo", tokens=T, max_in_cts=64)
        assert pk.in_cts > 1 and pk.tokens == T and pk.c == 1 and pk.rows + pk.m <= pk.lane
        assert pk.in_cts * pk.c * pk.m >= pk.n and pk.op_counts()["ciphertexts_in"] == pk.in_cts
        W = rng.standard_normal((d_out, d_in)) * 0.05
        b = rng.standard_normal(d_out) * 0.1 if bias else None
        X = rng.standard_normal((n_rows, d_in))
        ref = X @ W.T + (0 if b is None else b)
        enc = encode_group(ctx, [W], None if b is None else [b], plan=pk)
        assert enc.nbytes * T == enc.n_plaintexts * 2 * ctx.n * 8  # every diagonal at 1/T
        gk = keys.galois_keys_bytes(pk.rotation_steps)
        ct = encrypt_input(keys, X, pk)
        assert len(unpack_cts(ct, pk.in_cts)) == pk.in_cts
        out = apply(enc, ct, gk)
        y = decrypt_output(keys, out, pk)
        scale = np.max(np.abs(W)) * max(np.max(np.abs(X)), 1.0) * d_in
        assert np.max(np.abs(y[:n_rows] - ref)) < 1e-6 * scale, (d_out, d_in, T)
        assert np.max(np.abs(y[n_rows:]), initial=0.0) < 1e-6 * scale
        for o, blob in enumerate(unpack_cts(out, pk.n_blocks)):
            v = decrypt_slots(keys, blob).reshape(T, pk.lane)
            rows = slice(o * pk.rows, min((o + 1) * pk.rows, d_out))
            k = rows.stop - rows.start
            full = np.zeros((T, k))
            full[:n_rows] = ref[:, rows]
            assert np.max(np.abs(v[:, :k].real - full)) < 1e-6 * scale
            assert np.max(np.abs(v[:, k:])) < 1e-6 * scale  # (an output slot's imaginary part: its second form)
        with pytest.raises(HEError):
            apply(enc, pack_cts(unpack_cts(ct)[:-1]), gk)


def test_packed_plans_are_cheaper_per_row_on_smollm2_shapes():
    """The planner's packed plans for SmolLM2's layer groups cost less per row than the one-row
    plans in the Lattigo cost model (what `offload_engine.packed_plan` requires)."""
    from cipherlm.runtime.offload_engine import packed_plan

    for d_out, d_in in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        one = plan_matmul(d_out, d_in, 4096, backend="lattigo")
        pk = packed_plan(one, 2, "lattigo")
        assert pk is not None and pk.tokens == 2
        assert pk.op_counts()["rotations"] < 2 * one.op_counts()["rotations"]


@pytest.fixture(scope="module")
def packed_servers(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama served three times on the default backend: rows one by one
    (prefill_tokens=1), packed 4 rows per ciphertext, and up to 64 (on Lattigo with rows cut into
    several input ciphertexts: a lane of 64 slots cannot hold a row of 64 and its outputs)."""
    from cipherlm.runtime.offload_server import ModelHost, OffloadServer

    mp = pytest.MonkeyPatch()
    mp.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    servers = {}
    for T in (1, 4, 64):
        srv = OffloadServer(ModelHost(tiny_llama_dir, he_backend=_backend_auto(), prefill_tokens=T),
                            "127.0.0.1", 0, session_timeout=30.0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[T] = srv
    yield servers
    for srv in servers.values():
        srv.shutdown()
        srv.host.engine.close()
    mp.undo()


def _prefill(server, ids, last_only=False):
    from cipherlm.runtime.offload_client import OffloadClient

    with OffloadClient(*server.address) as client:
        ex = client.executor()
        cache = ex.new_cache()
        t0 = client.chan.totals()
        logits = ex.forward(np.asarray(ids), cache, last_only=last_only)
        t1 = client.chan.totals()
        nxt = ex.forward(np.asarray([int(np.argmax(logits[-1]))]), cache, last_only=True)
        stats = client.server_stats()
        packed_welcome = client.engine.prefill_tokens
    sent = t1["bytes_sent"] - t0["bytes_sent"]
    recv = t1["bytes_received"] - t0["bytes_received"]
    return logits, nxt, sent, recv, stats, packed_welcome


def test_packed_prefill_equals_per_row_prefill_and_plaintext(packed_servers, tiny_llama_dir):
    """A 7-row prefill (packs of up to 4 rows, the last one partial) and one decode token:
    logits of every row from the packed server equal the per-row server's and the plaintext
    executor's within the offload tolerance, so does the decode token after it; a prefill as
    generation runs it (last row only to the LM head) sends fewer bytes and rotates less."""
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import PlainLinear, make_executor, split_params

    ids = [3, 17, 42, 5, 9, 11, 2]
    lm = load_model(str(tiny_llama_dir))
    cp, sl = split_params(lm.config, lm.weights)
    ex = make_executor(lm.config, cp, PlainLinear(sl))
    cache = ex.new_cache()
    ref = ex.forward(np.asarray(ids), cache, last_only=False)
    ref_next = ex.forward(np.asarray([int(np.argmax(ref[-1]))]), cache, last_only=True)

    l1, n1, up1, down1, st1, t1 = _prefill(packed_servers[1], ids)
    l4, n4, up4, down4, st4, t4 = _prefill(packed_servers[4], ids)
    assert (t1, t4) == (1, 4)
    scale = np.max(np.abs(ref))
    for logits in (l1, l4):
        assert np.max(np.abs(logits - ref)) / scale < 1e-5
    assert np.max(np.abs(l4 - l1)) / scale < 1e-5
    assert np.argmax(l4[-1]) == np.argmax(l1[-1]) == np.argmax(ref[-1])
    for nxt in (n1, n4):
        assert np.max(np.abs(nxt - ref_next)) / np.max(np.abs(ref_next)) < 1e-5
    # as generation runs it: 7 ciphertexts per layer group -> ceil(7 / T) (LM head: last row)
    _, _, up1, down1, st1, _ = _prefill(packed_servers[1], ids, last_only=True)
    _, _, up4, down4, st4, _ = _prefill(packed_servers[4], ids, last_only=True)
    assert up4 < up1 * 0.75 and down4 < down1
    ops1, ops4 = st1["he_ops"], st4["he_ops"]
    for cls in ("attn_qkv", "attn_out", "ffn_in", "ffn_out"):
        assert ops4[cls]["rotations"] < ops1[cls]["rotations"], cls
    # a packed ciphertext counts as T rows against the session's work budget
    assert st4["work"]["cts"] >= st1["work"]["cts"]


def test_packed_request_without_packed_plan_is_refused(packed_servers):
    """A ``packed`` request to a server without packed plans is an error for that session."""
    from cipherlm.runtime.offload_client import OffloadClient
    from cipherlm.runtime.offload_protocol import RemoteError, expect

    with OffloadClient(*packed_servers[1].address) as client:
        ct = client.engine.encrypt(0, np.zeros(client.groups[0].d_in))
        client.chan.send({"type": "linear", "group": 0, "cts": [ct], "packed": True})
        with pytest.raises(RemoteError, match="no packed prefill plan"):
            expect(client.chan.recv(), "result")


@pytest.mark.skipif(_backend_auto() != "lattigo", reason="the Lattigo library is not built (make lattigo)")
def test_packed_prefill_with_several_input_ciphertexts(packed_servers, tiny_llama_dir):
    """Lattigo, up to 64 rows per ciphertext: the packed plans cut each row into several input
    ciphertexts; a 7-row prefill gives the logits of the per-row server, and its bytes and
    rotations are those `cipherlm inspect` predicts (`runtime.predict`)."""
    import json

    from cipherlm.runtime import predict as P

    ids = [3, 17, 42, 5, 9, 11, 2]
    srv = packed_servers[64]
    assert any(p.in_cts > 1 for p in srv.host.engine.packed_plans)
    l1, n1, *_ = _prefill(packed_servers[1], ids)
    l64, n64, *_, t64 = _prefill(srv, ids)
    assert t64 == 64
    scale = np.max(np.abs(l1))
    assert np.max(np.abs(l64 - l1)) / scale < 1e-5 and np.max(np.abs(n64 - n1)) / np.max(np.abs(n1)) < 1e-5
    _, _, up, down, st, _ = _prefill(srv, ids, last_only=True)
    config = json.loads(open(f"{tiny_llama_dir}/config.json").read())
    pred = P.predict(config, "offload", len(ids), phase="prefill", he_backend="lattigo", prefill_tokens=64)
    dec = P.predict(config, "offload", len(ids), phase="decode", he_backend="lattigo", prefill_tokens=64)
    measured, want = up + down, P.total(pred)["bytes"]
    assert abs(measured - want) <= 5e-4 * want, (measured, want)
    for cls in ("attn_qkv", "attn_out", "ffn_in", "ffn_out"):  # this session: the prefill and one decode token
        rot = pred[cls]["he_ops"]["rotations"] + dec[cls]["he_ops"]["rotations"]
        assert st["he_ops"][cls]["rotations"] == rot, cls

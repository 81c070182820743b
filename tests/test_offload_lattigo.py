"""Offload mode on the Lattigo HE backend (``--he-backend lattigo``, issue 15): a tiny
random Llama over TCP gives the plaintext executor's logits (the tolerance of
tests/test_offload.py), the handshake names the backend and the client checks it, a
SEAL server's welcome is unchanged, and bad ciphertexts end only their session.

Skipped only when the Lattigo library is not built (`make lattigo`); CI builds it.
The backend module is imported in a fixture, never at collection (see `lattigo`)."""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cipherlm.he import OFFLOAD_CKKS, HEError
from cipherlm.he.matmul import (
    apply,
    client_keys,
    decrypt_output,
    encode_matrix,
    encrypt_input,
    load_galois_keys,
    make_context,
    plan_matmul,
)
from cipherlm.net.channel import TCPChannel
from cipherlm.runtime import offload_engine
from cipherlm.runtime.linear_groups import LinearGroup
from cipherlm.runtime.offload_client import OffloadClient
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION, ProtocolError
from cipherlm.runtime.offload_server import ModelHost, OffloadServer
from cipherlm.runtime.plan_check import check_offload_welcome


@pytest.fixture(scope="module", autouse=True)
def lattigo():
    """The backend module, imported here and not at collection (importing it registers
    "lattigo", and tests/test_he_backend.py's BFV suite is parametrised over the registry
    when it is collected); skips when the library is not built."""
    mod = importlib.import_module("cipherlm.he.lattigo_backend")
    if not mod.available():
        pytest.skip(f"the Lattigo library {mod.library_path()} is not built: {mod.BUILD_HINT}")
    return mod


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    host = ModelHost(str(tiny_llama_dir), workers=2, he_backend="lattigo")
    srv = OffloadServer(host, "127.0.0.1", 0, session_timeout=5.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def plain_logits(model_dir, ids):
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import PlainLinear, make_executor, split_params

    lm = load_model(str(model_dir))
    cp, sl = split_params(lm.config, lm.weights)
    ex = make_executor(lm.config, cp, PlainLinear(sl))
    return ex, ex.forward(np.asarray(ids), ex.new_cache())


def test_offload_lattigo_matches_plaintext(server, tiny_llama_dir):
    ids = [3, 17, 42, 5, 9]
    with OffloadClient(*server.address) as client:
        assert client.engine.he_backend == "lattigo"
        ex = client.executor()
        logits = ex.forward(np.asarray(ids), ex.new_cache())
    _, ref = plain_logits(tiny_llama_dir, ids)
    err = np.max(np.abs(logits - ref)) / np.max(np.abs(ref))
    assert err < 1e-5, err


def test_offload_lattigo_greedy_generation_identical(server, tiny_llama_dir):
    prompt = [1, 2, 3, 4]
    with OffloadClient(*server.address) as client:
        new_ids, _ = client.executor().generate(prompt, max_new_tokens=6, return_logits=True)
        stats = client.server_stats()
    ref_ex, _ = plain_logits(tiny_llama_dir, prompt)
    ref_ids, _ = ref_ex.generate(prompt, max_new_tokens=6, return_logits=True)
    assert list(new_ids) == list(ref_ids)
    ops = stats["he_ops"]
    assert set(ops) >= {"attn_qkv", "attn_out", "ffn_in", "ffn_out", "lm_head"}
    assert sum(o.get("multiply_plain", 0) for o in ops.values()) > 0
    assert sum(o.get("rotations", 0) for o in ops.values()) > 0


def test_welcome_names_the_backend(server):
    w = server.host.welcome()
    assert w["he_backend"] == "lattigo"
    assert w["he_params"].startswith(b"CLGPARAMS")
    check_offload_welcome(w, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError):
        check_offload_welcome({**w, "he_backend": "palisade"}, PROTOCOL_VERSION)
    groups = [LinearGroup(i, tuple(g["names"]), g["d_in"], tuple(g["d_outs"])) for i, g in enumerate(w["groups"])]
    # a welcome whose blob is not the named backend's is refused before any key is made
    seal_blob = offload_engine.params_to_bytes(OFFLOAD_CKKS)
    with pytest.raises(HEError):
        offload_engine.ClientEngine({**w, "he_params": seal_blob}, groups)
    no_name = {k: v for k, v in w.items() if k != "he_backend"}  # read as SEAL: a Lattigo blob fails
    with pytest.raises(HEError):
        offload_engine.ClientEngine(no_name, groups)


def test_seal_welcome_unchanged():
    """A SEAL engine's public set-up has exactly the fields it had before the backend choice
    (without packed prefill plans; with them, the one ``packed`` field more)."""
    rng = np.random.default_rng(0)
    g = LinearGroup(0, ("w",), 16, (8,))
    eng = offload_engine.ServerEngine([g], {"w": (rng.standard_normal((8, 16)), None)}, prefill_tokens=1)
    assert set(eng.public_setup()) == {"he_params", "plans", "parts", "rotation_steps"}
    assert eng.public_setup()["he_params"] == offload_engine.params_to_bytes(OFFLOAD_CKKS)
    eng = offload_engine.ServerEngine([g], {"w": (rng.standard_normal((8, 16)), None)}, prefill_tokens=2)
    assert set(eng.public_setup()) == {"he_params", "plans", "parts", "rotation_steps", "packed"}


def test_bad_ciphertext_ends_only_that_session(server):
    chan = TCPChannel.connect(*server.address, timeout=10.0)
    try:
        chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload", "model": None})
        w = chan.recv()
        groups = [LinearGroup(i, tuple(g["names"]), g["d_in"], tuple(g["d_outs"])) for i, g in enumerate(w["groups"])]
        ce = offload_engine.ClientEngine(w, groups)
        chan.send(ce.keys_message())
        assert chan.recv()["type"] == "ready"
        good = ce.encrypt(0, np.ones(groups[0].d_in))
        bad = bytearray(good)
        bad[-1] ^= 0xFF  # the last coefficient pushed out of range, or a different residue
        bad = bytes(bad[:-9])  # and truncated: must be refused, never reach Lattigo's parser
        chan.send({"type": "linear", "group": 0, "cts": [bad]})
        reply = chan.recv()
        assert reply["type"] == "error"
    finally:
        chan.close()
    with OffloadClient(*server.address) as client:  # the server goes on serving
        ex = client.executor()
        ex.forward(np.asarray([1, 2]), ex.new_cache())


def test_client_refuses_a_seal_result_on_lattigo():
    """Each side parses only its backend's ciphertexts: a SEAL ciphertext is an HEError."""
    ctx_l = make_context(OFFLOAD_CKKS, "lattigo")
    ctx_s = make_context(OFFLOAD_CKKS, "seal")
    rng = np.random.default_rng(1)
    W = rng.standard_normal((20, 30))
    plan = plan_matmul(20, 30, ctx_l.slots, backend="lattigo")
    ks, kl = client_keys(ctx_s), client_keys(ctx_l)
    ct_seal = encrypt_input(ks, rng.standard_normal(30), plan)
    enc = encode_matrix(ctx_l, W, plan=plan)
    gk = load_galois_keys(ctx_l, kl.galois_keys_bytes(plan.rotation_steps), [plan])
    with pytest.raises(HEError):
        apply(enc, ct_seal, gk)
    x = rng.standard_normal(30)
    out = apply(enc, encrypt_input(kl, x, plan), gk)
    np.testing.assert_allclose(decrypt_output(kl, out, plan), W @ x, atol=1e-5)


@pytest.mark.parametrize("shape,bias", [((96, 64), True), ((160, 64), False), ((64, 160), False), ((700, 3000), True)])
@pytest.mark.parametrize("workers", [1, 2])
def test_lattigo_matmul_matches_numpy(shape, bias, workers):
    """The one-call Lattigo matmul (`LattigoEncodedMatrix`) against numpy, for plans with
    chunks, several output blocks, input parts' sizes and the goroutine split."""
    d_out, d_in = shape
    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    rng = np.random.default_rng(d_out + d_in)
    W = rng.standard_normal((d_out, d_in)) * 0.1
    b = rng.standard_normal(d_out) if bias else None
    plan = plan_matmul(d_out, d_in, ctx.slots, has_bias=bias, backend="lattigo")
    enc = encode_matrix(ctx, W, b, plan=plan)
    enc.workers = workers
    gk = load_galois_keys(ctx, keys.galois_keys_bytes(plan.rotation_steps), [plan])
    x = rng.standard_normal(d_in)
    y = decrypt_output(keys, apply(enc, encrypt_input(keys, x, plan), gk), plan)
    ref = W @ x + (b if b is not None else 0)
    assert np.max(np.abs(y - ref)) < 1e-5 * max(1.0, np.max(np.abs(ref)))


def test_lattigo_keys_must_cover_the_plan():
    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    plan = plan_matmul(300, 500, ctx.slots, backend="lattigo")
    assert len(plan.rotation_steps) > 1
    with pytest.raises(HEError):
        load_galois_keys(ctx, keys.galois_keys_bytes(plan.rotation_steps[:-1]), [plan])


def _bsgs_reference(D, g, chunk_steps, xs):
    """What clg_bsgs_eval computes, in numpy (rot(v, s) = np.roll(v, -s)), for the inputs ``xs``
    (input p's m diagonals at D[o, p m : (p + 1) m]): per block o, y_o = sum_p sum_k
    roll(D[o, p m + k], -(k // g) g) * roll(x_p, -k), then y_o += roll(y_o, -s) per chunk step s;
    None for a block whose diagonals are all zero."""
    m = D.shape[1] // len(xs)
    out = []
    for blk in D:
        if not np.any(blk):
            out.append(None)
            continue
        y = np.zeros(D.shape[2], complex)
        for p, x in enumerate(xs):
            for k, d in enumerate(blk[p * m:(p + 1) * m]):
                y += np.roll(d, -(k // g) * g) * np.roll(x, -k)
        for s in chunk_steps:
            y = y + np.roll(y, -s)
        out.append(y)
    return out


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("workers,parts", [(1, 1), (3, 1), (1, 3), (2, 3)])
def test_bsgs_eval_sparse_blocks_against_numpy(lattigo, level, workers, parts):
    """The native matmul on hand-made diagonals against numpy: a block with every diagonal
    zero (no result), a block without giant step 0, scattered zero diagonals, chunk-sum
    steps, more goroutines than some shares need; with several input ciphertexts (``parts``:
    every block sums the products of all of them; the baby-step shares split an input between
    goroutines).  Level 1 (two primes under the special prime: the offload parameters' fast
    path, tiled products and one-digit giant steps) and level 2 (three primes: the generic
    path) must both match."""
    be = lattigo.LattigoBackend()
    ctx = be.context(lattigo.ckks_params("lattigo-ckks-3q", 8192, (60, 40, 40, 60)))
    keys = be.keygen(ctx)
    S = ctx.slots
    rng = np.random.default_rng(10 * level + workers + 100 * parts)
    n_blocks, m, g = 4, 11, 3
    D = (rng.standard_normal((n_blocks, parts * m, S)) + 1j * rng.standard_normal((n_blocks, parts * m, S))) * 0.1
    D[1] = 0  # no result
    D[2, [p * m + j for p in range(parts) for j in range(g)]] = 0  # no giant step 0
    D[0, [1, 4, 5]] = 0  # scattered zero diagonals (one giant step keeps one of three)
    D[3, 6:9] = 0  # a whole giant step of block 3 (of its first input) is zero
    chunk_steps = [S // 4, S // 2]
    # the offload scales: 2^45 x 2^40, rescaled by a 40-bit prime -> 2^45 (key-switching
    # noise at one prime is ~2^15, 2^-30 of that)
    mat = be.bsgs_matrix(ctx, D, g=g, chunk_steps=chunk_steps, scale=2.0**40, level=level, parts=parts)
    xs = [(rng.standard_normal(S) + 1j * rng.standard_normal(S)) * 0.5 for _ in range(parts)]
    cts = [keys.encrypt(be.encode_slots(ctx, x, level=level, scale_bits=45)) for x in xs]
    ct = cts if parts > 1 else cts[0]
    steps = sorted(set(range(1, g)) | {i * g for i in range(1, -(-m // g))} | set(chunk_steps))
    gk = keys.galois_keys(steps)
    res, counts = be.bsgs_apply(ctx, ct, mat, gk, workers=workers)
    want = _bsgs_reference(D, g, chunk_steps, xs)
    assert [r is None for r in res] == [w is None for w in want]
    for r, w in zip(res, want):
        if w is None:
            continue
        assert r.level == level - 1
        got = be.decode_slots(ctx, keys.decrypt(r), complex_out=True)
        assert np.max(np.abs(got - w)) < 1e-7 * np.max(np.abs(w)), np.max(np.abs(got - w))
    nz = int(np.sum(np.any(D != 0, axis=2)))
    assert counts["multiply_plain"] == nz
    assert counts["rotations"] >= parts * (g - 1)
    # bad inputs are errors, not crashes: the wrong level, keys without a giant step, the wrong
    # number of inputs, inputs of two scales
    wrong = keys.encrypt(be.encode_slots(ctx, xs[0], level=3 - level, scale_bits=45))
    with pytest.raises(HEError):
        be.bsgs_apply(ctx, [wrong] + cts[1:] if parts > 1 else wrong, mat, gk, workers=workers)
    with pytest.raises(HEError):
        be.bsgs_apply(ctx, ct, mat, keys.galois_keys([s for s in steps if s != g]), workers=workers)
    with pytest.raises(HEError, match="input ciphertexts"):
        be.bsgs_apply(ctx, cts + cts[:1], mat, gk, workers=workers)
    if parts > 1:
        other = keys.encrypt(be.encode_slots(ctx, xs[1], level=level, scale_bits=44))
        with pytest.raises(HEError, match="one scale"):
            be.bsgs_apply(ctx, [cts[0], other] + cts[2:], mat, gk, workers=workers)


def test_ring_switch_keeps_the_real_parts(lattigo):
    """`LattigoBackend.ring_switch` against numpy: real slot j of the half-ring (conjugate-
    invariant) ciphertext decrypts to Re(z_j) of the full ring's complex slots z, every j < S;
    half the bytes; the key round-trips."""
    from cipherlm.he.backend import get_backend

    be = get_backend("lattigo")
    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    half_keys, blob = keys.ring_switch_key()
    assert half_keys.ctx.n == ctx.n // 2 and half_keys.ctx.q_moduli == ctx.q_moduli[:1]
    rsk = be.ring_switch_key_from_bytes(ctx, blob)
    rng = np.random.default_rng(5)
    S = ctx.slots
    z = rng.normal(size=S) + 1j * rng.normal(size=S)
    ct = keys.encrypt(be.encode_slots(ctx, z, level=0, scale_bits=40))
    small = be.ring_switch(ct, rsk)
    v = be.decode_slots(half_keys.ctx, half_keys.decrypt(small))
    assert v.shape == (S,)
    np.testing.assert_allclose(v, z.real, atol=1e-6)
    assert 2 * (len(be.ciphertext_to_bytes(small)) - 20) == len(be.ciphertext_to_bytes(ct)) - 20
    # bit-packed ("CLGP", the offload results): 60 of 64 bits, and it reads back the same
    packed = be.ciphertext_to_bytes(small, packed=True)
    assert len(packed) == 20 + 2 * 4096 * 60 // 8
    back = be.decode_slots(half_keys.ctx, half_keys.decrypt(be.ciphertext_from_bytes(half_keys.ctx, packed, level=0)))
    np.testing.assert_array_equal(back, v)
    bad = packed[:-8] + b"\xff" * 8  # the last coefficient 2^60 - 1 > q0
    with pytest.raises(HEError):
        be.ciphertext_from_bytes(half_keys.ctx, bad, level=0)
    # the full-ring key cannot read the half-ring ciphertext, nor the half-ring key a full one
    with pytest.raises(HEError):
        be.ciphertext_from_bytes(ctx, be.ciphertext_to_bytes(small), level=0)
    with pytest.raises(HEError):
        be.ring_switch(small, rsk)


@pytest.mark.parametrize("blob_edit", ["truncated", "header", "unreduced", "not_bytes"])
def test_malformed_ring_switch_key_is_an_heerror(lattigo, blob_edit):
    from cipherlm.he.backend import get_backend

    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    _, blob = client_keys(ctx).ring_switch_key()
    bad = {"truncated": blob[:-1], "header": b"XXXX" + blob[4:], "unreduced": blob[:40] + b"\xff" * (len(blob) - 40),
           "not_bytes": "key"}[blob_edit]
    with pytest.raises(HEError):
        get_backend("lattigo").ring_switch_key_from_bytes(ctx, bad)


@pytest.mark.parametrize("shape,max_chunks,tokens", [((96, 64), None, 1), ((700, 3000), None, 1),
                                                     ((1000, 300), 1, 1), ((3000, 64), 1, 1), ((200, 64), None, 4)])
def test_half_ring_results_match_numpy(shape, max_chunks, tokens):
    """Results in the half ring: plans with chunk blocks, several output blocks, one block
    (R <= S/2 and R > S/2) and packed token rows, against numpy; every result half the
    coefficients of its full-ring one, bit-packed at 60 bits."""
    from cipherlm.he.backend import get_backend
    from cipherlm.he.matmul import unpack_cts

    d_out, d_in = shape
    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    half_keys, blob = keys.ring_switch_key()
    rsk = get_backend("lattigo").ring_switch_key_from_bytes(ctx, blob)
    rng = np.random.default_rng(d_out)
    W = rng.standard_normal((d_out, d_in)) * 0.1
    b = rng.standard_normal(d_out)
    plan = plan_matmul(d_out, d_in, ctx.slots, has_bias=True, max_chunks=max_chunks, backend="lattigo", tokens=tokens)
    enc = encode_matrix(ctx, W, b, plan=plan)
    gk = load_galois_keys(ctx, keys.galois_keys_bytes(plan.rotation_steps), [plan])
    x = rng.standard_normal((tokens, d_in)) if tokens > 1 else rng.standard_normal(d_in)
    ct = encrypt_input(keys, x, plan)
    full = apply(enc, ct, gk)
    half = apply(enc, ct, gk, ring_switch_key=rsk)
    ref = x @ W.T + b
    y = decrypt_output(keys, half, plan, half_keys=half_keys)
    assert np.max(np.abs(y - ref)) < 1e-5 * max(1.0, np.max(np.abs(ref)))
    sizes_full = [len(c) for c in unpack_cts(full, plan.n_blocks)]
    sizes_half = [len(c) for c in unpack_cts(half, plan.n_blocks)]
    assert all(h - 20 == (f - 20) // 2 * 60 // 64 for h, f in zip(sizes_half, sizes_full))  # half, 60-bit packed
    if tokens == 1:  # what the client decrypts: the outputs in each chunk block, zero elsewhere, all real
        be = get_backend("lattigo")
        blob = unpack_cts(half, plan.n_blocks)[0]
        v = be.decode_slots(half_keys.ctx, half_keys.decrypt(be.ciphertext_from_bytes(half_keys.ctx, blob, level=0)),
                            complex_out=True)
        want = np.zeros(ctx.slots)
        for a in range(plan.c):
            want[a * plan.stride: a * plan.stride + plan.rows] = ref[: plan.rows]
        assert np.max(np.abs(v - want)) < 1e-5 * max(1.0, np.max(np.abs(ref)))


@pytest.mark.parametrize("mode", ["inputs", "results"])
def test_half_ring_offer_and_refusal(mode):
    """A Lattigo engine offers half-ring results (unless $CIPHERLM_OFFLOAD_HALF_RING=off): with
    real inputs (the default) as "even" and then requires the client's input switching key, with
    complex inputs ("results") as true; the client makes the keys the welcome asks for; a key
    sent to an engine that did not offer it is refused; the welcome check accepts the field only
    as true or "even" from a Lattigo server."""
    rng = np.random.default_rng(0)
    g = LinearGroup(0, ("w",), 64, (96,))
    lin = {"w": (rng.standard_normal((96, 64)), None)}
    eng = offload_engine.ServerEngine([g], lin, he_backend="lattigo", prefill_tokens=1, half_ring=mode)
    real = mode == "inputs"
    assert eng.public_setup()["half_ring_results"] == ("even" if real else True)
    assert all(p.real_input == real for p in eng.plans)
    ce = offload_engine.ClientEngine(eng.public_setup(), [g])
    assert ce.ring_switch_key is not None and (ce.input_switch_key is not None) == real
    msg = ce.keys_message()
    assert ("input_switch_key" in msg) == real
    if real:
        with pytest.raises(HEError, match="input_switch_key"):
            eng.load_client_keys(msg["galois_keys"], msg["ring_switch_key"])
    else:
        _, other = offload_engine.ClientEngine(
            offload_engine.ServerEngine([g], lin, he_backend="lattigo", prefill_tokens=1).public_setup(),
            [g]).keys.input_switch_key()
        with pytest.raises(HEError, match="input_switch_key"):
            eng.load_client_keys(msg["galois_keys"], msg["ring_switch_key"], other)
    keys = eng.load_client_keys(msg["galois_keys"], msg["ring_switch_key"], msg.get("input_switch_key"))
    x = rng.standard_normal(64)
    ct = ce.encrypt(0, x)
    assert len(ct) == (51_252 if real else 102_452)
    np.testing.assert_allclose(ce.decrypt(0, eng.apply(0, ct, keys)), lin["w"][0] @ x, atol=1e-5)
    assert keys.by_class[g.op_class].ring_switch == 1
    assert keys.by_class[g.op_class].input_switch == int(real)
    off = offload_engine.ServerEngine([g], lin, he_backend="lattigo", prefill_tokens=1, half_ring="off")
    assert "half_ring_results" not in off.public_setup() and not any(p.real_input for p in off.plans)
    with pytest.raises(HEError):
        off.load_client_keys(ce.galois_keys_blob(), ce.ring_switch_key)
    if real:
        with pytest.raises(HEError):
            off.load_client_keys(ce.galois_keys_blob(), None, ce.input_switch_key)
    w = {"protocol": PROTOCOL_VERSION, "model": "m", "config": {}, "groups": [{"names": ["w"], "d_in": 64,
         "d_outs": [96]}], "bundle_digest": "0" * 64, **eng.public_setup()}
    check_offload_welcome(w, PROTOCOL_VERSION)
    for bad in ({**w, "half_ring_results": 1}, {**w, "half_ring_results": "odd"},
                {**{k: v for k, v in w.items() if k != "he_backend"}}):
        with pytest.raises(ProtocolError):
            check_offload_welcome(bad, PROTOCOL_VERSION)
    # a welcome whose results do not match its plans' inputs is refused by the client
    with pytest.raises(HEError):
        offload_engine.ClientEngine({**eng.public_setup(), "half_ring_results": True if real else "even"}, [g])
    with pytest.raises(ValueError):
        offload_engine.half_ring_mode("sideways")


def test_real_to_complex_keeps_the_slots(lattigo):
    """`LattigoBackend.real_to_complex` against numpy: N/2 real values encrypted in the
    conjugate-invariant ring at both data primes come out as the complex slots (imaginary part
    zero) of the full ring at the same level and scale, at half the bytes up; the even fold
    (`ring_switch`, kind "even") of a result with period S/2 keeps its first S/2 complex slots;
    malformed input keys are an HEError."""
    from cipherlm.he.backend import get_backend

    be = get_backend("lattigo")
    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    in_keys, blob = keys.input_switch_key()
    assert in_keys.ctx.n == ctx.n // 2 and in_keys.ctx.q_moduli == ctx.q_moduli and in_keys.ctx.slots == ctx.slots
    isk = be.input_switch_key_from_bytes(ctx, blob)
    rng = np.random.default_rng(6)
    v = rng.normal(size=ctx.slots)
    data = in_keys.encrypt_seeded(be.encode_slots(in_keys.ctx, v, level=in_keys.ctx.max_level, scale_bits=45))
    assert len(data) == 20 + 32 + 4096 * (60 + 40) // 8
    full = be.real_to_complex(be.ciphertext_from_bytes(in_keys.ctx, data, level=in_keys.ctx.max_level), isk)
    z = be.decode_slots(ctx, keys.decrypt(full), complex_out=True)
    np.testing.assert_allclose(z.real, v, atol=1e-7)
    np.testing.assert_allclose(z.imag, 0, atol=1e-7)
    # a full-ring ciphertext is not an input of the half ring
    with pytest.raises(HEError):
        be.real_to_complex(keys.encrypt(be.encode_slots(ctx, v, level=ctx.max_level)), isk)
    for bad in (blob[:-1], b"XXXX" + blob[4:], blob[:40] + b"\xff" * (len(blob) - 40), "key"):
        with pytest.raises(HEError):
            be.input_switch_key_from_bytes(ctx, bad)
    # the even fold
    even_keys, eblob = keys.ring_switch_key("even")
    assert even_keys.ctx.slots == ctx.slots // 2
    w = rng.normal(size=ctx.slots // 2) + 1j * rng.normal(size=ctx.slots // 2)
    ct = keys.encrypt(be.encode_slots(ctx, np.concatenate([w, w]), level=0, scale_bits=40))
    small = be.ring_switch(ct, be.ring_switch_key_from_bytes(ctx, eblob, "even"))
    np.testing.assert_allclose(be.decode_slots(even_keys.ctx, even_keys.decrypt(small), complex_out=True), w, atol=1e-6)
    assert len(be.ciphertext_to_bytes(small, packed=True)) == 20 + 2 * 4096 * 60 // 8


@pytest.mark.parametrize("shape,bias,max_chunks", [((96, 64), True, None), ((700, 2000), False, None),
                                                   ((3001, 300), True, 2), ((9000, 64), False, None)])
def test_real_input_plans_match_numpy(shape, bias, max_chunks):
    """Real-input plans (half-ring inputs, two output rows per slot, even-folded results)
    against numpy: chunk blocks, several output blocks, an odd d_out, the bias; what the client
    decrypts is the outputs in each chunk block's first R slots (y[2r] + i y[2r+1]) and zeros
    elsewhere: no partial sums, no imaginary linear forms."""
    from cipherlm.he.backend import get_backend
    from cipherlm.he.matmul import unpack_cts

    be = get_backend("lattigo")
    d_out, d_in = shape
    ctx = make_context(OFFLOAD_CKKS, "lattigo")
    keys = client_keys(ctx)
    half_keys, blob = keys.ring_switch_key("even")
    rsk = be.ring_switch_key_from_bytes(ctx, blob, "even")
    in_keys, iblob = keys.input_switch_key()
    isk = be.input_switch_key_from_bytes(ctx, iblob)
    rng = np.random.default_rng(d_out)
    W = rng.standard_normal((d_out, d_in)) * 0.1
    b = rng.standard_normal(d_out) if bias else None
    plan = plan_matmul(d_out, d_in, ctx.slots, has_bias=bias, max_chunks=max_chunks, backend="lattigo",
                       real_input=True)
    assert plan.real_input and plan.c >= 2 and plan.n == d_in + bias
    enc = encode_matrix(ctx, W, b, plan=plan)
    gk = load_galois_keys(ctx, keys.galois_keys_bytes(plan.rotation_steps), [plan])
    x = rng.standard_normal(d_in)
    ct = encrypt_input(keys, x, plan, input_keys=in_keys)
    with pytest.raises(HEError):
        encrypt_input(keys, x, plan)  # a real-input plan needs the half-ring input keys
    with pytest.raises(HEError):
        apply(enc, ct, gk, ring_switch_key=rsk)  # ... and the server the input switching key
    res = apply(enc, ct, gk, ring_switch_key=rsk, input_switch_key=isk)
    ref = W @ x + (0 if b is None else b)
    y = decrypt_output(keys, res, plan, half_keys=half_keys)
    assert y.shape == (d_out,)
    assert np.max(np.abs(y - ref)) < 1e-6 * max(1.0, np.max(np.abs(ref)))
    assert [len(c) for c in unpack_cts(res, plan.n_blocks)] == [20 + 2 * 4096 * 60 // 8] * plan.n_blocks
    full = apply(enc, ct, gk, input_switch_key=isk)  # full-ring results decrypt the same
    np.testing.assert_allclose(decrypt_output(keys, full, plan), y, atol=1e-6 * max(1.0, np.max(np.abs(ref))))
    v = be.decode_slots(half_keys.ctx, half_keys.decrypt(be.ciphertext_from_bytes(
        half_keys.ctx, unpack_cts(res, plan.n_blocks)[0], level=0)), complex_out=True)
    r = ref[: 2 * plan.rows]
    r = np.concatenate([r, np.zeros(2 * plan.rows - r.size)])
    want = np.zeros(ctx.slots // 2, complex)
    for a in range(plan.c // 2):
        want[a * plan.stride: a * plan.stride + plan.rows] = r[0::2] + 1j * r[1::2]
    assert np.max(np.abs(v - want)) < 1e-6 * max(1.0, np.max(np.abs(ref)))
    # a conjugate-invariant key is refused for a real-input plan's results
    _, cblob = keys.ring_switch_key()
    with pytest.raises(HEError):
        apply(enc, ct, gk, ring_switch_key=be.ring_switch_key_from_bytes(ctx, cblob), input_switch_key=isk)

@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama whose LM head is its embedding matrix (as SmolLM2's)."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tied-llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def test_tied_lm_head_on_the_client(tied_llama_dir, tmp_path, monkeypatch):
    """A tied LM head is the bundle's embedding matrix: the server offers no lm_head group and
    names the tensor (`client_lm_head`), the client computes the logits in the clear, and a
    greedy generation is identical to the plaintext executor's; the per-token bytes fall by the
    head's input and results, as `predict` says; with $CIPHERLM_OFFLOAD_CLIENT_HEAD=0 the server
    serves the head under HE as before; a welcome naming a tensor the bundle lacks is refused."""
    from cipherlm.runtime import predict as P

    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path / "cache"))
    prompt = [1, 2, 3, 4]
    ref_ex, _ = plain_logits(tied_llama_dir, prompt)
    ref_ids, _ = ref_ex.generate(prompt, max_new_tokens=4, return_logits=True)
    per_token = {}
    for env in ("1", "0"):
        monkeypatch.setenv("CIPHERLM_OFFLOAD_CLIENT_HEAD", env)
        host = ModelHost(tied_llama_dir, he_backend="lattigo")
        w = host.welcome()
        check_offload_welcome(w, PROTOCOL_VERSION)
        names = [tuple(g["names"]) for g in w["groups"]]
        assert (("lm_head",) in names) == (env == "0")
        assert w.get("client_lm_head") == ("model.embed_tokens.weight" if env == "1" else None)
        srv = OffloadServer(host, "127.0.0.1", 0, session_timeout=5.0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            with OffloadClient(*srv.address) as client:
                ex = client.executor()
                ids, _ = ex.generate(prompt, max_new_tokens=4, return_logits=True)
                cache = ex.new_cache()
                ex.forward(np.asarray(prompt), cache, last_only=True)
                t0 = client.chan.totals()
                ex.forward(np.asarray([5]), cache, last_only=True)
                t1 = client.chan.totals()
                stats = client.server_stats()
        finally:
            srv.shutdown()
        assert list(ids) == list(ref_ids)
        assert ("lm_head" in stats["he_ops"]) == (env == "0")
        per_token[env] = sum(t1[k] - t0[k] for k in ("bytes_sent", "bytes_received"))
        pred = P.total(P.predict(host.config, "offload", 4, phase="decode", he_backend="lattigo"))["bytes"]
        assert abs(per_token[env] - pred) <= 0.01 * pred, (env, per_token[env], pred)
    assert per_token["1"] < per_token["0"]
    with pytest.raises(ProtocolError):
        check_offload_welcome({**w, "client_lm_head": 3}, PROTOCOL_VERSION)
    # a server naming a tensor that is not the vocabulary's matrix, or naming one while it also
    # serves lm_head (the last host: env "0"), is refused by the client at set-up
    welcome = host.welcome
    for bad in ("model.norm.weight", "no.such.tensor", "model.embed_tokens.weight"):
        host.welcome = lambda bad=bad: {**welcome(), "client_lm_head": bad}
        srv = OffloadServer(host, "127.0.0.1", 0, session_timeout=5.0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            with pytest.raises(ProtocolError, match="client_lm_head"):
                OffloadClient(*srv.address)
        finally:
            srv.shutdown()

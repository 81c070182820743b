"""The Lattigo v6 CKKS backend (issue 15, first part): results against numpy within CKKS
precision, serialisation round trips, malformed bytes -> HEError (never a crash), the
128-bit security check of its parameters, and that only cipherlm/he/ imports it.

Skipped only when the c-shared library is not built (`make install` builds it when Go is
found); the module is imported inside the fixture so that test_he_backend.py's
conformance suite (BFV, parametrised over the registry at collection) never sees it."""

from __future__ import annotations

import ast
import gc
import importlib
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from _threads import run_threads

from cipherlm.he.backend import get_backend
from cipherlm.he.errors import HEError
from cipherlm.he.params import HEParams, check_security, max_logq

ROOT = Path(__file__).resolve().parents[1] / "cipherlm"
N = 8192
BITS = (60, 40, 60)  # the offload set's shape: 2 data primes + 1 special prime
STEPS = [1, 2, 3, 4, 5, 6, 7, 8, -1, 100]
TOL = 1e-5  # CKKS at scale 2^40: errors ~1e-8 for |values| <= 1


@pytest.fixture(scope="module")
def lat():
    mod = importlib.import_module("cipherlm.he.lattigo_backend")
    if not mod.available():
        pytest.skip(f"Lattigo library {mod.library_path()} not built ({mod.BUILD_HINT})")
    be = mod.LattigoBackend()
    ctx = be.context(mod.ckks_params(f"lattigo-ckks-{N}", N, BITS))
    keys = be.keygen(ctx)
    gk = keys.galois_keys(STEPS)
    return mod, be, ctx, keys, gk


def _vec(seed, n=N // 2):
    return np.random.default_rng(seed).uniform(-1, 1, n)


def _dec(be, ctx, keys, ct, n=None):
    return be.decode_slots(ctx, keys.decrypt(ct), n=n)


def test_only_he_imports_lattigo_wrapper():
    def imports_it(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.split(".")[-1] == "lattigo_backend" for n in names):
                return True
        return False

    outside = {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
               if p.relative_to(ROOT).parts[0] != "he" and imports_it(p)}
    assert outside == set()


def test_parameters_128_bit(lat):
    mod, be, ctx, _keys, _gk = lat
    check_security(ctx.params)
    # the primes Lattigo actually chose: log2(Q P) within the HomomorphicEncryption.org bound
    log_qp = sum(math.log2(q) for q in ctx.q_moduli + ctx.p_moduli)
    assert log_qp <= max_logq(N)
    assert [q.bit_length() for q in ctx.q_moduli] == list(BITS[:-1])
    assert [p.bit_length() for p in ctx.p_moduli] == list(BITS[-1:])
    assert all(q % (2 * N) == 1 for q in ctx.q_moduli + ctx.p_moduli)
    assert len(set(ctx.q_moduli + ctx.p_moduli)) == 3
    assert be.special_modulus(ctx) == ctx.p_moduli[0] and be.special_modulus(ctx) not in ctx.coeff_moduli
    # a 2^14 set, and insecure sets refused before Lattigo sees them
    big = be.context(mod.ckks_params("lattigo-ckks-16384", 16384, (60, 40, 40, 40, 60)))
    assert sum(math.log2(q) for q in big.q_moduli + big.p_moduli) <= max_logq(16384)
    with pytest.raises(HEError):
        be.context(HEParams("too-big", "ckks", N, (60, 60, 60, 60)))
    with pytest.raises(HEError):
        mod.ckks_params("too-big", 4096, (60, 60))
    blob = be.params_to_bytes(ctx.params)
    assert be.params_from_bytes(blob) == ctx.params
    bad = blob.replace(b"[60, 40, 60]", b"[60, 60, 60, 60]")
    assert bad != blob
    for b in (bad, b"garbage" * 4, blob[:20], b""):
        with pytest.raises(HEError):
            be.params_from_bytes(b)
    ps = be.primes(N, [40, 40, 50])
    assert len(set(ps)) == 3 and all(p % (2 * N) == 1 for p in ps)
    assert [p.bit_length() for p in ps] == [40, 40, 50]


def test_registered(lat):
    mod, *_ = lat
    assert isinstance(get_backend("lattigo"), mod.LattigoBackend)
    assert get_backend("lattigo").name == "lattigo"
    cm = get_backend("lattigo").cost_model
    assert cm is mod.LATTIGO_COSTS and 0 < cm.offload.multiply_plain < cm.offload.rotate_low < cm.offload.rotate


def test_encrypt_decrypt_round_trip(lat):
    _mod, be, ctx, keys, _gk = lat
    x = _vec(1)
    ct = keys.encrypt(be.encode_slots(ctx, x))
    assert ct.level == ctx.max_level == 1 and be.is_ntt(ct)
    assert abs(ct.scale_bits - 40) < 1e-9
    assert np.abs(_dec(be, ctx, keys, ct) - x).max() < TOL
    short = np.array([0.5, -0.25, 3.0])
    got = _dec(be, ctx, keys, keys.encrypt(be.encode_slots(ctx, short)))
    assert np.abs(got[:3] - short).max() < TOL and np.abs(got[3:]).max() < TOL
    z = (_vec(2, 16) + 1j * _vec(3, 16))
    ctz = keys.encrypt(be.encode_slots(ctx, z, level=0))
    assert ctz.level == 0
    assert np.abs(be.decode_slots(ctx, keys.decrypt(ctz), n=16, complex_out=True) - z).max() < TOL
    pk = be.load_public_key(ctx, keys.public_key_bytes())
    ctp = be.encrypt_public(ctx, pk, be.encode_slots(ctx, x))
    assert np.abs(_dec(be, ctx, keys, ctp) - x).max() < TOL
    for bad in (np.zeros(N // 2 + 1), np.zeros((2, 2)), np.array([np.nan])):
        with pytest.raises(HEError):
            be.encode_slots(ctx, bad)


def test_tiled_encoding_is_the_repeated_vector(lat):
    """encode_slots(..., tile=True) of P values (sparse dimension log2 P) is bit for bit the
    encoding of the vector repeated over all slots (real and complex), and decrypts to it."""
    _mod, be, ctx, keys, _gk = lat
    for P, v in ((64, _vec(4, 64)), (8, _vec(5, 8) + 1j * _vec(6, 8)), (N // 2, _vec(7))):
        full = np.tile(v, (N // 2) // P)
        a = be.encode_slots(ctx, v, level=0, scale_bits=35, tile=True)
        b = be.encode_slots(ctx, full, level=0, scale_bits=35)
        assert (a.coefficients() == b.coefficients()).all()
        got = be.decode_slots(ctx, keys.decrypt(keys.encrypt(a)), complex_out=True)
        assert np.abs(got - full).max() < TOL
    assert not (be.encode_slots(ctx, _vec(4, 64), level=0, tile=True).coefficients()
                == be.encode_slots(ctx, _vec(4, 64), level=0).coefficients()).all()  # zero-padded: another one
    with pytest.raises(HEError, match="power-of-two"):
        be.encode_slots(ctx, np.ones(12), tile=True)


def test_rotations_and_hoisted(lat):
    _mod, be, ctx, keys, gk = lat
    x = _vec(4)
    ct = keys.encrypt(be.encode_slots(ctx, x))
    for s in (1, 7, -1, 100):
        assert np.abs(_dec(be, ctx, keys, be.rotate_rows(ctx, ct, s, gk)) - np.roll(x, -s)).max() < TOL
    steps = [1, 2, 3, 4, 5, 6, 7, 8]
    outs = be.rotate_hoisted(ctx, ct, steps, gk)
    assert len(outs) == 8
    for s, c in zip(steps, outs):
        assert np.abs(_dec(be, ctx, keys, c) - np.roll(x, -s)).max() < TOL
    # repeated and zero steps, negative steps
    outs = be.rotate_hoisted(ctx, ct, [0, -1, 3, 3], gk)
    for s, c in zip([0, -1, 3, 3], outs):
        assert np.abs(_dec(be, ctx, keys, c) - np.roll(x, -s)).max() < TOL
    assert outs[2].h != outs[3].h
    assert be.rotate_hoisted(ctx, ct, [], gk) == []
    c2 = keys.encrypt(be.encode_slots(ctx, x))
    be.rotate_rows_inplace(ctx, c2, 2, gk)
    assert np.abs(_dec(be, ctx, keys, c2) - np.roll(x, -2)).max() < TOL
    for bad in ([9], [N // 2], [1, 9]):  # no key / out of range: an error, never a crash
        with pytest.raises(HEError):
            be.rotate_hoisted(ctx, ct, bad, gk)
    with pytest.raises(HEError):
        be.rotate_rows(ctx, ct, 9, gk)
    assert gk.has_steps(STEPS) and not gk.has_steps([9])


def test_multiply_plain_add_rescale(lat):
    _mod, be, ctx, keys, _gk = lat
    x, y, w, v, b = (_vec(s) for s in (5, 6, 7, 8, 9))
    cx, cy = keys.encrypt(be.encode_slots(ctx, x)), keys.encrypt(be.encode_slots(ctx, y))
    acc = be.multiply_plain(ctx, cx, be.encode_slots(ctx, w))
    assert abs(acc.scale_bits - 80) < 1e-6 and acc.level == 1
    buf = be.multiply_plain(ctx, cy, be.encode_slots(ctx, np.ones(4)))
    assert be.multiply_plain(ctx, cy, be.encode_slots(ctx, v), out=buf) is buf
    be.add_inplace(ctx, acc, buf)
    be.rescale_inplace(ctx, acc)
    assert acc.level == 0 and abs(acc.scale_bits - 40) < 0.01  # 2^80 / q1, q1 ~ 2^40
    be.add_plain_inplace(ctx, acc, be.encode_slots(ctx, b, level=0, scale_bits=acc.scale_bits))
    assert np.abs(_dec(be, ctx, keys, acc) - (x * w + y * v + b)).max() < TOL
    with pytest.raises(HEError):
        be.rescale_inplace(ctx, acc)  # level 0
    # dropping a prime keeps the value (CKKS mod switch)
    cz = keys.encrypt(be.encode_slots(ctx, x))
    be.mod_switch_to_inplace(ctx, cz, be.level(ctx, 1))
    assert cz.level == 0 and np.abs(_dec(be, ctx, keys, cz) - x).max() < TOL
    with pytest.raises(HEError):
        be.level(ctx, 3)


def _diag_matvec(diags, x):
    """numpy reference: y[i] = sum_d v_d[i] x[(i + d) % n]."""
    return sum(v * np.roll(x, -d) for d, v in diags.items())


@pytest.mark.parametrize("ratio", [1, -1])
def test_bsgs_linear_transform(lat, ratio):
    _mod, be, ctx, keys, _gk = lat
    slots = ctx.slots
    rng = np.random.default_rng(20)
    # a banded 4096 x 4096 matrix: 24 diagonals, some negative indices, values ~ 1/sqrt(24)
    idx = list(range(20)) + [-1, -2, 100, slots - 3]
    diags = {d: rng.uniform(-1, 1, slots) / 5 for d in idx}
    x = _vec(21)
    lt = be.linear_transform_encode(ctx, diags, log_bsgs_ratio=ratio)
    els = lt.galois_elements()
    assert els and all(g % 2 == 1 and g < 2 * N for g in els)
    if ratio >= 0:
        assert len(els) < len(idx)  # BSGS: fewer keys than diagonals
    gk = keys.galois_keys_for_elements(els)
    gk2 = be.galois_keys_from_bytes(ctx, keys.galois_keys_bytes_for_elements(els))
    ct = keys.encrypt(be.encode_slots(ctx, x))
    y_local = be.linear_transform(ctx, ct, lt, gk)
    be.rescale_inplace(ctx, y_local)
    y = be.linear_transform(ctx, ct, lt, gk2)
    be.rescale_inplace(ctx, y)
    assert y.level == 0 and abs(y.scale_bits - 40) < 0.01
    want = _diag_matvec(diags, x)
    assert np.abs(_dec(be, ctx, keys, y) - want).max() < 1e-4
    assert np.abs(_dec(be, ctx, keys, y_local) - want).max() < 1e-4
    with pytest.raises(HEError):  # keys for other automorphisms
        be.linear_transform(ctx, ct, lt, keys.galois_keys([1]))
    with pytest.raises(HEError):
        be.linear_transform_encode(ctx, {0: np.ones(slots), slots: np.ones(slots)})
    with pytest.raises(HEError):
        be.linear_transform_encode(ctx, {0: np.ones(slots - 1)})
    with pytest.raises(HEError):
        be.linear_transform_encode(ctx, {1: np.ones(slots), 1 - slots: np.ones(slots)})  # the same diagonal
    with pytest.raises(HEError):
        keys.galois_keys_for_elements([2])


def test_threads_release_the_gil(lat):
    _mod, be, ctx, keys, gk = lat
    x = _vec(10)
    ct = keys.encrypt(be.encode_slots(ctx, x))
    results = run_threads([lambda: [be.rotate_rows(ctx, ct, s, gk) for s in (1, 2, 3)]] * 4)
    for outs in results:
        for s, c in zip((1, 2, 3), outs):
            assert np.abs(_dec(be, ctx, keys, c) - np.roll(x, -s)).max() < TOL


def test_serialisation_round_trip(lat):
    _mod, be, ctx, keys, gk = lat
    x = _vec(11)
    ct = keys.encrypt(be.encode_slots(ctx, x))
    blob = be.ciphertext_to_bytes(ct)
    assert len(blob) == 20 + 2 * 2 * N * 8
    ct2 = be.ciphertext_from_bytes(ctx, blob, level=be.level(ctx, 2))
    assert be.ciphertext_to_bytes(ct2) == blob
    assert np.abs(_dec(be, ctx, keys, ct2) - x).max() < TOL
    with pytest.raises(HEError):  # wrong level
        be.ciphertext_from_bytes(ctx, blob, level=be.level(ctx, 1))
    # after a product and a rescale the scale is not a power of two: it must survive
    m = be.multiply_plain(ctx, ct, be.encode_slots(ctx, x))
    be.rescale_inplace(ctx, m)
    m2 = be.ciphertext_from_bytes(ctx, be.ciphertext_to_bytes(m))
    assert m2.level == 0 and m2.scale_bits == m.scale_bits
    assert np.abs(_dec(be, ctx, keys, m2) - x * x).max() < TOL
    # raw view
    arr = be.ciphertext_to_numpy(ct)
    assert arr.shape == (2, 2, N) and arr.dtype == np.uint64
    assert np.array_equal(be.ciphertext_to_numpy(be.numpy_to_ciphertext(ctx, arr)), arr)
    bad = arr.copy()
    bad[1, 1, 5] = np.uint64(ctx.q_moduli[1])
    with pytest.raises(HEError):
        be.numpy_to_ciphertext(ctx, bad)
    # keys: the peer's Galois keys and public key
    gblob = keys.galois_keys_bytes([1, 3])  # seeded: about half of the expanded keys
    g2 = be.galois_keys_from_bytes(ctx, gblob, required_steps=[1, 3])
    full = g2.to_bytes()
    assert gblob[5] == 2 and full[5] == 0
    # seeded: the uniform halves go (a seed instead), and each row is bit-packed at its prime's
    # bits: packed / expanded polys = sum of the primes' bits / (2 halves x rows x 64)
    mods = list(ctx.q_moduli) + list(ctx.p_moduli)
    packed, expanded = len(gblob) - 12 - 2 * (8 + 32), len(full) - 12 - 2 * 8
    assert packed * 2 * len(mods) * 64 == expanded * sum((m - 1).bit_length() for m in mods)
    g3 = be.galois_keys_from_bytes(ctx, full, required_steps=[1, 3])
    assert g3.to_bytes() == full
    assert np.abs(_dec(be, ctx, keys, be.rotate_rows(ctx, ct, 1, g3)) - np.roll(x, -1)).max() < TOL
    assert np.abs(_dec(be, ctx, keys, be.rotate_hoisted(ctx, ct, [3], g2)[0]) - np.roll(x, -3)).max() < TOL
    with pytest.raises(HEError):
        be.galois_keys_from_bytes(ctx, gblob, required_steps=[2])
    with pytest.raises(HEError):
        be.galois_keys_from_bytes(ctx, gblob, max_keys=1)
    pblob = keys.public_key_bytes()
    pk = be.load_public_key(ctx, pblob)
    z = be.encrypt_zero(ctx, pk, be.level(ctx, 2))
    be.add_inplace(ctx, ct2, z)
    assert np.abs(_dec(be, ctx, keys, ct2) - x).max() < TOL
    # seeded symmetric encryption: a 32-byte seed instead of c1, c0 bit-packed, same message
    sblob = keys.encrypt_seeded(be.encode_slots(ctx, x))
    assert len(sblob) == 20 + 32 + N * (60 + 40) // 8 == _seeded_len(ctx, 1)
    cs = be.ciphertext_from_bytes(ctx, sblob, level=be.level(ctx, 2))
    assert np.abs(_dec(be, ctx, keys, cs) - x).max() < TOL
    assert np.abs(_dec(be, ctx, keys, be.rotate_rows(ctx, cs, 1, gk)) - np.roll(x, -1)).max() < TOL
    assert keys.encrypt_seeded(be.encode_slots(ctx, x))[20:52] != sblob[20:52]  # a fresh seed
    for cut in (20, 52, len(sblob) - 1):
        with pytest.raises(HEError):
            be.ciphertext_from_bytes(ctx, sblob[:cut])
    with pytest.raises(HEError):
        be.ciphertext_from_bytes(ctx, sblob, level=be.level(ctx, 1))
    tampered = bytearray(sblob)
    tampered[20] ^= 1  # another seed: loads (it is just bytes) but no longer decrypts to x
    assert np.abs(_dec(be, ctx, keys, be.ciphertext_from_bytes(ctx, bytes(tampered))) - x).max() > 1


def _seeded_len(ctx, level):
    """The seeded layout's length, from the primes: header + seed + ceil(N b_j / 8) per row."""
    return 20 + 32 + sum(-(-ctx.n * (q - 1).bit_length() // 8) for q in ctx.q_moduli[: level + 1])


def _seeded_rows(ctx, blob, level):
    """c0's rows of a seeded blob, unpacked here from the documented layout (big integers):
    row j holds N values of b_j = bitlen(q_j - 1) bits, LSB first, padded to whole bytes."""
    rows, off = [], 52
    for q in ctx.q_moduli[: level + 1]:
        w = (q - 1).bit_length()
        rl = -(-ctx.n * w // 8)
        v = int.from_bytes(blob[off:off + rl], "little")
        rows.append([(v >> (i * w)) & ((1 << w) - 1) for i in range(ctx.n)])
        off += rl
    assert off == len(blob)
    return np.array(rows, np.uint64)


def _set_seeded_coeff(ctx, blob, row, i, value):
    """``blob`` with c0's coefficient i of ``row`` replaced by ``value`` (< 2^b_row)."""
    b, off = bytearray(blob), 52
    for q in ctx.q_moduli[:row]:
        off += -(-ctx.n * (q - 1).bit_length() // 8)
    w = (ctx.q_moduli[row] - 1).bit_length()
    rl = -(-ctx.n * w // 8)
    v = int.from_bytes(b[off:off + rl], "little")
    v = (v & ~(((1 << w) - 1) << (i * w))) | (int(value) << (i * w))
    b[off:off + rl] = v.to_bytes(rl, "little")
    return bytes(b)


def test_seeded_bit_packed_layout(lat):
    """The seeded layout (wire version 2): c0's row j bit-packed with bitlen(q_j - 1) bits a
    coefficient, at every level of a chain whose primes are not byte multiples (Lattigo's
    "35-bit" prime here has 36 bits: the length follows the primes, not the requested bits).
    Round trips decrypt to the values; a length off by one, an unreduced coefficient in any
    row, a level that does not match the length, and the old version byte are refused."""
    mod, be, _ctx, _keys, _gk = lat
    ctx = be.context(mod.ckks_params("lattigo-packed-8192", N, (50, 35, 27, 45)))
    keys = be.keygen(ctx)
    load = lambda d, **kw: be.ciphertext_from_bytes(ctx, d, **kw)
    assert ctx.max_level == 2
    for lvl in range(ctx.max_level + 1):
        x = _vec(20 + lvl)
        blob = keys.encrypt_seeded(be.encode_slots(ctx, x, level=lvl))
        assert blob[:4] == b"CLGS" and blob[4] == 2 and blob[6] == lvl
        assert len(blob) == _seeded_len(ctx, lvl) == be.seeded_ciphertext_bytes(ctx, lvl)
        assert len(blob) < 52 + 8 * N * (lvl + 1) - N * (lvl + 1)  # at least a byte a coefficient saved
        ct = load(blob, level=lvl)
        assert np.abs(_dec(be, ctx, keys, ct) - x).max() < 1e-3  # scale 2^27
        c0 = _seeded_rows(ctx, blob, lvl)
        assert np.array_equal(be.ciphertext_to_numpy(ct)[0], c0)
        full = be.ciphertext_to_bytes(ct)  # the unseeded layout: unchanged, 8 bytes a word
        assert full[:5] == b"CLGC\x02" and len(full) == 20 + 2 * (lvl + 1) * N * 8
        assert np.array_equal(np.frombuffer(full[20:20 + c0.nbytes], np.uint64).reshape(c0.shape), c0)
        # the seeded blob of a raw plaintext (BLB Algorithm 2): c0 re-packed on the Python side
        coeffs = np.array([np.random.default_rng(lvl).integers(0, q, N, dtype=np.uint64)
                           for q in ctx.q_moduli[: lvl + 1]])
        rblob = keys.encrypt_seeded(be.plaintext_from_coeffs(ctx, coeffs, scale=2.0 ** 30))
        assert len(rblob) == len(blob) and struct.unpack_from("<d", rblob, 12)[0] == 2.0 ** 30
        got = be.decrypt_coeffs(ctx, keys, load(rblob, level=lvl))
        for j, q in enumerate(ctx.q_moduli[: lvl + 1]):  # m + e, e small (fresh encryption)
            d = (got[j].astype(object) - coeffs[j].astype(object)) % q
            assert max(min(int(v), q - int(v)) for v in d) < 2 ** 12
        # length: one byte short or long, the seed alone, and another level's length
        for bad in (blob[:-1], blob + b"\0", blob[:52], blob[:20]):
            with pytest.raises(HEError):
                load(bad)
        with pytest.raises(HEError, match="expected"):
            load(blob + b"\0")
        for other in range(ctx.max_level + 1):
            if other != lvl:
                hb = bytearray(blob)
                hb[6] = other  # the header's level no longer matches the rows
                with pytest.raises(HEError, match="expected"):
                    load(bytes(hb))
        # an unreduced coefficient (q_j itself, and the largest b_j-bit value) in every row
        for j, q in enumerate(ctx.q_moduli[: lvl + 1]):
            w = (q - 1).bit_length()
            for i, v in ((0, q), (N - 1, (1 << w) - 1), (N // 2, q + 1)):
                with pytest.raises(HEError, match="not reduced"):
                    load(_set_seeded_coeff(ctx, blob, j, i, v))
            ok = _set_seeded_coeff(ctx, blob, j, N - 1, q - 1)  # the largest residue loads
            assert be.ciphertext_to_numpy(load(ok))[0, j, N - 1] == q - 1
        # the previous wire version (1, 8-byte words) gets the magic/version error
        old = bytearray(blob)
        old[4] = 1
        with pytest.raises(HEError, match="bad magic or version"):
            load(bytes(old))
        words = bytes(old[:52]) + c0.astype("<u8").tobytes()  # a complete version-1 blob
        with pytest.raises(HEError, match="bad magic or version"):
            load(words)
        fold = bytearray(full)
        fold[4] = 1
        with pytest.raises(HEError, match="bad magic or version"):
            load(bytes(fold))
    with pytest.raises(HEError):
        be.seeded_ciphertext_bytes(ctx, ctx.max_level + 1)


def _expect_heerror(fn, data):
    with pytest.raises(HEError):
        fn(data)


def test_malformed_bytes_give_heerror(lat):
    _mod, be, ctx, keys, _gk = lat
    ct = keys.encrypt(be.encode_slots(ctx, _vec(12)))
    blob = be.ciphertext_to_bytes(ct)
    load = lambda d: be.ciphertext_from_bytes(ctx, d)
    for cut in (0, 1, 10, 19, 20, len(blob) // 2, len(blob) - 1):
        _expect_heerror(load, blob[:cut])
    _expect_heerror(load, blob + b"\0")
    _expect_heerror(load, b"\xff" * len(blob))
    _expect_heerror(load, "not bytes")

    def patched(off, fmt, value):
        b = bytearray(blob)
        struct.pack_into(fmt, b, off, value)
        return bytes(b)

    for off, fmt, value in [(4, "B", 1), (4, "B", 3), (5, "B", 2), (5, "B", 0), (6, "B", 2), (6, "B", 255),
                            (7, "B", 0), (8, "B", 13), (9, "B", 1), (12, "<d", float("nan")),
                            (12, "<d", float("inf")), (12, "<d", -1.0), (12, "<d", 0.0), (12, "<d", 2.0 ** 400)]:
        _expect_heerror(load, patched(off, fmt, value))
    # an unreduced coefficient (the first of c1 mod q1)
    q1 = ctx.q_moduli[1]
    _expect_heerror(load, patched(20 + 8 * (2 * N + N), "<Q", q1))
    _expect_heerror(load, patched(20, "<Q", 2 ** 64 - 1))
    # random mutations: each loads or gives HEError, never anything else
    rng = np.random.default_rng(0)
    sblob = keys.encrypt_seeded(be.encode_slots(ctx, _vec(12)))
    for src in (blob, sblob):
        for _ in range(150):
            b = bytearray(src)
            for i in rng.integers(0, 56, size=3):
                b[i] = int(rng.integers(0, 256))
            if rng.random() < 0.3:
                b[:4] = b"CLGS" if src is blob else b"CLGC"  # the other layout's magic
            try:
                load(bytes(b))
            except HEError:
                pass
    # keys
    gload = lambda d: be.galois_keys_from_bytes(ctx, d)
    for seeded in (True, False):
        gb = keys.galois_keys_bytes([1]) if seeded else keys.galois_keys([1]).to_bytes()
        for cut in (0, 8, 12, 20, 52, len(gb) - 1):
            _expect_heerror(gload, gb[:cut])
        _expect_heerror(gload, gb + b"\0" * 8)
        bad = bytearray(gb)
        bad[5] = 0 if seeded else 2  # the other layout's flag: the length no longer matches
        _expect_heerror(gload, bytes(bad))
        for flag in (1, 3):  # 1: the retired seeded layout with 64-bit words
            bad[5] = flag
            _expect_heerror(gload, bytes(bad))
        bad = bytearray(gb)
        struct.pack_into("<Q", bad, len(gb) - 8, 2 ** 64 - 1)  # unreduced last word
        _expect_heerror(gload, bytes(bad))
    gblob = keys.galois_keys([1]).to_bytes()
    gb = bytearray(gblob)
    struct.pack_into("<I", gb, 8, 2 ** 31)  # a huge key count: refused before any allocation
    _expect_heerror(gload, bytes(gb))
    for g in (0, 2, 1, 2 * N + 1):  # even, identity, out of range
        gb = bytearray(gblob)
        struct.pack_into("<Q", gb, 12, g)
        _expect_heerror(gload, bytes(gb))
    gb = bytearray(gblob)
    struct.pack_into("<Q", gb, 20, 2 ** 64 - 1)  # unreduced key coefficient
    _expect_heerror(gload, bytes(gb))
    two = keys.galois_keys([1, 2]).to_bytes()
    dup = bytearray(two)
    per = (len(two) - 12) // 2
    dup[12 + per: 20 + per] = dup[12:20]  # the same Galois element twice
    _expect_heerror(gload, bytes(dup))
    pblob = keys.public_key_bytes()
    pload = lambda d: be.load_public_key(ctx, d)
    for cut in (0, 4, 8, len(pblob) - 8):
        _expect_heerror(pload, pblob[:cut])
    pb = bytearray(pblob)
    pb[0] = ord("X")
    _expect_heerror(pload, bytes(pb))
    pb = bytearray(pblob)
    struct.pack_into("<Q", pb, 8, 2 ** 64 - 1)
    _expect_heerror(pload, bytes(pb))
    _expect_heerror(pload, blob)  # a ciphertext is not a key


def test_not_implemented_and_bad_handles(lat):
    mod, be, ctx, keys, gk = lat
    t = be.primes(4096, [20])[0]
    with pytest.raises(NotImplementedError):
        be.context(HEParams("bfv", "bfv", 4096, (36, 36, 37), plain_modulus=t))
    ct = keys.encrypt(be.encode_slots(ctx, _vec(13)))
    for call in (lambda: be.encode_coeffs(ctx, np.zeros(4, np.uint64)), lambda: be.to_ntt_inplace(ctx, ct),
                 lambda: be.from_ntt_inplace(ctx, ct), lambda: be.pack_lwes_stream(ctx, gk, 2, iter([])),
                 lambda: be.plaintext_to_numpy(keys.decrypt(ct))):
        with pytest.raises(NotImplementedError):
            call()
    # objects of another context (even with the same parameters) are refused
    ctx2 = be.context(ctx.params)
    keys2 = be.keygen(ctx2)
    ct2 = keys2.encrypt(be.encode_slots(ctx2, _vec(13)))
    pt = be.encode_slots(ctx, _vec(13))
    for call in (lambda: be.multiply_plain(ctx, ct, pt, out=ct2), lambda: be.add_inplace(ctx, ct, ct2),
                 lambda: keys.decrypt(ct2), lambda: be.multiply_plain(ctx2, ct2, pt),
                 lambda: be.rotate_rows(ctx, ct, 1, keys2.galois_keys([1]))):
        with pytest.raises(HEError):
            call()
    # a handle of the wrong kind is an error from Go, not a crash
    with pytest.raises(HEError):
        mod._call("clg_rescale", gk.h)
    with pytest.raises(HEError):
        mod._call("clg_rescale", 0)


def test_forked_child_refuses(lat):
    """The Go runtime's threads are gone in a fork()ed child: an HEError, not a hang."""
    import multiprocessing as mp

    mod, *_ = lat
    q = mp.get_context("fork").Queue()

    def child(q):
        try:
            mod._call("clg_rescale", 0)
            q.put("called")
        except HEError as e:
            q.put(str(e))

    p = mp.get_context("fork").Process(target=child, args=(q,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert "forked" in q.get(timeout=5)


def test_handles_are_freed(lat):
    mod, be, ctx, keys, gk = lat
    lib = mod._load()
    x = _vec(14)
    gc.collect()
    before = lib.clg_live_objects()
    for _ in range(20):
        ct = keys.encrypt(be.encode_slots(ctx, x))
        be.rotate_hoisted(ctx, ct, [1, 2], gk)
        keys.decrypt(ct)
    del ct
    gc.collect()
    assert lib.clg_live_objects() == before


def test_release_memory_returns_the_freed_heap(lat):
    """`release_memory` (what the test suite calls after each module) hands the heap of freed
    Go objects back to the OS: resident memory after dropping ~0.6 GB of ciphertexts and
    releasing falls back near where it was, and live objects are untouched."""
    mod, be, ctx, keys, gk = lat
    lib = mod._load()

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    gc.collect()
    mod.release_memory()
    base, live = rss(), lib.clg_live_objects()
    arr = be.ciphertext_to_numpy(keys.encrypt(be.encode_slots(ctx, _vec(14))))
    many = [be.numpy_to_ciphertext(ctx, arr) for _ in range(600 * 2**20 // arr.nbytes)]  # copies in Go
    grown = rss()
    del many
    gc.collect()
    mod.release_memory()
    assert lib.clg_live_objects() == live
    assert grown - base > 200 * 2**20 and rss() - base < (grown - base) / 2, (base, grown, rss())

"""The HE backend interface (issue 13 part 3): no module outside ``cipherlm/he/``
imports SEAL (tenseal), the protocols import only the interface from ``he/``, and
every registered backend passes the same conformance test, written against
`cipherlm.he.backend.HEBackend` (ring backends: `RingBackend`) only."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from cipherlm.he.backend import (HEBackend, HECostModel, OffloadCostModel, RingBackend, TwoPCCostModel, backend_names,
                                 get_backend)
from cipherlm.he.errors import HEError
from cipherlm.he.params import HEParams

ROOT = Path(__file__).resolve().parents[1] / "cipherlm"


def _imports_tenseal(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):  # lazy imports included
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tenseal" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tenseal":
            return True
    return False


def test_only_he_imports_tenseal():
    outside = {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
               if p.relative_to(ROOT).parts[0] != "he" and _imports_tenseal(p)}
    assert outside == set(), f"modules outside cipherlm/he/ importing tenseal: {sorted(outside)}"


def _he_imports(path: Path) -> set[str]:
    """Modules of ``cipherlm.he`` a file imports (relative imports resolved for protocols/)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 2:
                mod = "cipherlm." + mod
            elif node.level == 1:
                mod = "cipherlm.protocols." + mod
            if mod == "cipherlm.he":
                out |= {f"cipherlm.he.{a.name}" for a in node.names}
            elif mod.startswith("cipherlm.he."):
                out.add(mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("cipherlm.he.")}
    return out


def test_embedding_protocol_imports_only_the_interface():
    """protocols/embedding*.py reach the HE engines through `he.backend` (the numpy RLWE
    engine is the ``numpy`` ring backend, he/numpy_rlwe.py), plus parameter sets
    (`he.params`)."""
    for name in ("embedding.py", "embedding_he.py"):
        got = _he_imports(ROOT / "protocols" / name)
        assert "cipherlm.he.backend" in got or name == "embedding.py"
        assert got <= {"cipherlm.he.backend", "cipherlm.he.params"}, (name, got)


def test_scan_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import tenseal.sealapi as seal\n")
    assert _imports_tenseal(f)
    f.write_text("def f():\n    from tenseal import sealapi\n")
    assert _imports_tenseal(f)


# ----------------------------------------------------------------------------- conformance
N = 4096


@pytest.fixture(scope="module", params=[n for n in backend_names() if "bfv" in get_backend(n).schemes])
def env(request):
    be: HEBackend = get_backend(request.param)
    t = be.primes(N, [20])[0]  # a batching plaintext prime, t = 1 mod 2N
    params = HEParams(f"conformance-bfv-{N}", "bfv", N, (36, 36, 37), plain_modulus=t)
    ctx = be.context(params)
    keys = be.keygen(ctx)
    return be, ctx, keys, t


def _rand(t, size=N, seed=1):
    return np.random.default_rng(seed).integers(0, t, size=size, dtype=np.uint64)


def _coeffs(be, keys, ct):
    out = np.zeros(N, np.uint64)
    pt = be.plaintext_to_numpy(keys.decrypt(ct))
    out[: pt.size] = pt
    return out


def test_interface_basics(env):
    be, ctx, _keys, t = env
    assert isinstance(be.cost_model, HECostModel)  # one cost model per backend, every planner's constants
    assert isinstance(be.cost_model.twopc, TwoPCCostModel) and isinstance(be.cost_model.offload, OffloadCostModel)
    assert ctx.n == N and len(ctx.coeff_moduli) == 2
    assert all(q % (2 * N) == 1 for q in ctx.coeff_moduli)
    assert be.special_modulus(ctx) not in ctx.coeff_moduli
    assert t % (2 * N) == 1
    with pytest.raises(HEError):
        get_backend("no-such-backend")


@pytest.mark.parametrize("k", [2, 1])
def test_encrypt_decrypt_each_level(env, k):
    be, ctx, keys, t = env
    m = _rand(t)
    ct = keys.encrypt(be.encode_coeffs(ctx, m))
    if k != 2:
        be.mod_switch_to_inplace(ctx, ct, be.level(ctx, k))
    assert be.ciphertext_to_numpy(ct).shape == (2, k, N)
    assert np.array_equal(_coeffs(be, keys, ct), m)


def test_seeded_encryption_loads(env):
    be, ctx, keys, t = env
    m = _rand(t, seed=2)
    blob = keys.encrypt_seeded(be.encode_coeffs(ctx, m))
    ct = be.ciphertext_from_bytes(ctx, blob, level=be.level(ctx, 2))
    assert not be.is_ntt(ct)
    assert np.array_equal(_coeffs(be, keys, ct), m)
    with pytest.raises(HEError):  # wrong level
        be.ciphertext_from_bytes(ctx, blob, level=be.level(ctx, 1))
    with pytest.raises(HEError):  # truncated
        be.ciphertext_from_bytes(ctx, blob[: len(blob) // 2])


def _negacyclic(a, b, t):
    full = np.zeros(2 * N, dtype=object)
    for i in np.nonzero(b)[0]:
        full[i: i + N] += a.astype(object) * int(b[i])
    return np.array([(x - y) % t for x, y in zip(full[:N], full[N:])], np.uint64)


def test_multiply_plain_add(env):
    be, ctx, keys, t = env
    a = _rand(t, seed=3)
    w = np.zeros(N, np.uint64)
    w[[0, 5, N - 1]] = [3, t - 2, 7]  # small signed weights, centred lift
    top = be.level(ctx, 2)
    ct = keys.encrypt(be.encode_coeffs(ctx, a))
    be.to_ntt_inplace(ctx, ct)
    assert be.is_ntt(ct)
    prod = be.multiply_plain(ctx, ct, be.encode_coeffs(ctx, w, level=top, ntt=True))
    buf = be.multiply_plain(ctx, ct, be.encode_coeffs(ctx, np.ones(1, np.uint64), level=top, ntt=True))
    buf2 = be.multiply_plain(ctx, ct, be.encode_coeffs(ctx, w, level=top, ntt=True), out=buf)
    assert buf2 is buf
    be.add_inplace(ctx, prod, buf)
    be.from_ntt_inplace(ctx, prod)
    r = _rand(t, seed=4)
    be.add_plain_inplace(ctx, prod, be.encode_coeffs(ctx, r))
    want = (_negacyclic(a, w, t).astype(object) * 2 + r.astype(object)) % t
    assert np.array_equal(_coeffs(be, keys, prod), want.astype(np.uint64))


def test_rotation_and_slots(env):
    be, ctx, keys, t = env
    v = _rand(t, seed=5)
    ct = keys.encrypt(be.encode_slots(ctx, v))
    gk = be.galois_keys_from_bytes(ctx, keys.galois_keys_bytes([1]), required_steps=[1])
    rot = be.rotate_rows(ctx, ct, 1, gk)
    rows = v.reshape(2, N // 2)
    want = np.roll(rows, -1, axis=1).reshape(-1)
    assert np.array_equal(be.decode_slots(ctx, _coeffs(be, keys, rot)), want)
    be.rotate_rows_inplace(ctx, ct, 1, gk)
    assert np.array_equal(be.decode_slots(ctx, _coeffs(be, keys, ct)), want)
    with pytest.raises(HEError):  # a step the keys lack
        be.galois_keys_from_bytes(ctx, keys.galois_keys_bytes([1]), required_steps=[2])


def test_raw_view_round_trip(env):
    be, ctx, keys, t = env
    m = _rand(t, seed=6)
    ct = keys.encrypt(be.encode_coeffs(ctx, m))
    arr = be.ciphertext_to_numpy(ct)
    ct2 = be.numpy_to_ciphertext(ctx, arr, level=be.level(ctx, 2), ntt=False)
    assert np.array_equal(be.ciphertext_to_numpy(ct2), arr)
    assert np.array_equal(_coeffs(be, keys, ct2), m)
    bad = arr.copy()
    bad[0, 0, 0] = np.uint64(ctx.coeff_moduli[0])
    with pytest.raises(HEError):
        be.numpy_to_ciphertext(ctx, bad, level=be.level(ctx, 2))
    assert np.array_equal(be.plaintext_to_numpy(be.encode_coeffs(ctx, m))[:N], m)


def test_serialise_validate_load(env):
    be, ctx, keys, t = env
    m = _rand(t, seed=7)
    ct = keys.encrypt(be.encode_coeffs(ctx, m))
    blob = be.ciphertext_to_bytes(ct)
    assert np.array_equal(_coeffs(be, keys, be.ciphertext_from_bytes(ctx, blob)), m)
    for cut in (0, 10, len(blob) - 1):
        with pytest.raises(HEError):
            be.ciphertext_from_bytes(ctx, blob[:cut])
    assert be.params_from_bytes(be.params_to_bytes(ctx.params)) == ctx.params
    with pytest.raises(HEError):
        be.params_from_bytes(b"garbage" * 4)
    # the peer's public key: re-randomising with an encryption of zero keeps the message
    pk = be.load_public_key(ctx, keys.public_key_bytes())
    z = be.encrypt_zero(ctx, pk, be.level(ctx, 2))
    assert not be.is_ntt(z)
    be.add_inplace(ctx, ct, z)
    assert np.array_equal(_coeffs(be, keys, ct), m)
    with pytest.raises(HEError):
        be.load_public_key(ctx, keys.public_key_bytes()[:-8])


def test_pack_lwes_automorphisms(env):
    """PackLWEs over two leaves (Galois keys for the automorphisms X -> X^(2^k + 1)):
    coefficient j N / 2 of the result holds N times the constant coefficient of leaf j."""
    be, ctx, keys, t = env
    elts = [(1 << k) + 1 for k in range(1, N.bit_length())]
    gk = be.galois_keys_from_bytes(ctx, keys.galois_keys_bytes_for_elements(elts))
    ms = _rand(t, size=2, seed=8)
    leaves = []
    for m in ms:
        poly = _rand(t, seed=int(m) % 1000)
        poly[0] = m
        leaves.append(keys.encrypt(be.encode_coeffs(ctx, poly)))
    out = _coeffs(be, keys, be.pack_lwes_stream(ctx, gk, 2, iter(leaves)))
    assert [int(out[0]), int(out[N // 2])] == [(N * int(m)) % t for m in ms]
    # the public facts of PackLWEs: a backend may override them, never change them
    assert be.pack_lwes_elements(N) == HEBackend.pack_lwes_elements(be, N) == elts
    for k in (1, 2, 5, 8):
        assert be.pack_lwes_order(k) == HEBackend.pack_lwes_order(be, k)
    assert be.pack_lwes_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]


# ----------------------------------------------------------------------------- ring backends
@pytest.fixture(scope="module", params=backend_names("ring"))
def ring(request):
    r = get_backend(request.param)
    assert isinstance(r, RingBackend)
    return r


def test_registry_kinds():
    assert "numpy" in backend_names("ring") and "numpy" not in backend_names()
    assert "seal" in backend_names() and "seal" not in backend_names("ring")
    assert all(isinstance(get_backend(n), HEBackend) for n in backend_names())


def test_ring_products_exact(ring):
    primes = get_backend().primes(N, [20, 25, 28])
    rns = ring.rns(primes, N)
    assert rns.k == 3 and rns.Q == primes[0] * primes[1] * primes[2]
    rng = np.random.default_rng(11)
    a = rng.integers(0, primes[0], N).astype(np.uint64)
    s = ring.sample_ternary(rng, N)
    assert set(np.unique(s)) <= {-1, 0, 1}
    got = ring.mul_small(a[None, :], ring.transform(s), np.array(primes[:1], np.uint64))[0]
    assert np.array_equal(got.astype(np.int64), np.mod(ring.negacyclic(a.astype(np.int64), s), primes[0]))
    small = rng.integers(-50, 50, N)
    assert np.array_equal(ring.inverse_transform(ring.transform(small)), small)
    # mod 2^K: the same product
    K = 30
    a2 = rng.integers(0, 1 << K, N).astype(np.uint64)
    got2 = ring.mul_small_pow2(a2, ring.transform(s), K)
    want2 = np.mod(ring.negacyclic(a2.astype(np.int64), s), 1 << K).astype(np.uint64)
    assert np.array_equal(got2, want2)
    limbs = ring.split_limbs(a2, K, 11)
    assert np.array_equal(sum(x.astype(np.uint64) << np.uint64(11 * i) for i, x in enumerate(limbs)), a2)


def test_ring_sampling_and_switching(ring):
    primes = get_backend().primes(N, [25, 28])
    rns = ring.rns(primes, N)
    u1 = ring.expand_uniform(b"s" * 32, b"x", rns, 2)
    assert u1.shape == (2, 2, N) and np.array_equal(u1, ring.expand_uniform(b"s" * 32, b"x", rns, 2))
    assert not np.array_equal(u1, ring.expand_uniform(b"s" * 32, b"y", rns, 2))
    assert np.all(u1 < rns.q[None, :, None])
    e = ring.sample_error(np.random.default_rng(3), 100_000)
    assert np.abs(e).max() <= ring.error_bound and abs(e.std() - ring.error_sigma) < 0.05
    # x = Delta m + e decodes to m; dropping the last prime keeps it decodable
    t = 1 << 8
    m = np.random.default_rng(4).integers(0, t, N)
    x = rns.add(rns.mul_scalar(rns.from_signed(m), rns.Q // t), rns.from_signed(e[:N]))
    assert np.array_equal(rns.decode_top(x, t), m)
    low = rns.switch_to(x, 1)
    assert low.shape == (1, N) and np.array_equal(rns.sub(1).decode_top(low, t), m)
    p2 = rns.to_pow2(x, 20)
    assert np.array_equal(((p2 + np.uint64(1 << 11)) >> np.uint64(12)) % np.uint64(t), m.astype(np.uint64))

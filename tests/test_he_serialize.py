import numpy as np
import pytest
import tenseal.sealapi as seal

from cipherlm.he import (
    ClientKeys,
    HEContext,
    HEError,
    HEParams,
    OFFLOAD_CKKS,
    ciphertext_from_bytes,
    ciphertext_to_bytes,
    ciphertext_to_numpy,
    galois_keys_from_bytes,
    numpy_to_ciphertext,
    numpy_to_plaintext,
    plaintext_from_bytes,
    plaintext_to_bytes,
    plaintext_to_numpy,
)


@pytest.fixture(scope="module")
def ck():
    ctx = HEContext(OFFLOAD_CKKS)
    return ctx, ClientKeys(ctx)


def _pt(ctx, vals, scale=2.0**40):
    pt = seal.Plaintext()
    ctx.encoder.encode(list(vals), ctx.parms_id_at(2), scale, pt)
    return pt


def test_seeded_ciphertext_roundtrip_and_size(ck):
    ctx, keys = ck
    vals = np.linspace(-1, 1, ctx.slots)
    seeded = keys.encrypt_seeded(_pt(ctx, vals))
    ct = ciphertext_from_bytes(ctx, seeded, n_primes=2)
    full = ciphertext_to_bytes(ct)
    assert len(seeded) < 0.55 * len(full)
    got = np.array(ctx.encoder.decode_double(keys.decrypt(ciphertext_from_bytes(ctx, full, n_primes=2))))
    np.testing.assert_allclose(got, vals, atol=1e-6)


def test_reject_wrong_level_params_and_corruption(ck):
    ctx, keys = ck
    data = keys.encrypt_seeded(_pt(ctx, [0.5] * 8))
    with pytest.raises(HEError, match="level|parameters"):
        ciphertext_from_bytes(ctx, data, n_primes=1)
    with pytest.raises(HEError, match="size"):
        ciphertext_from_bytes(ctx, data, n_primes=2, size=3)
    other = HEContext(HEParams("other", "ckks", 8192, (50, 40, 50)))
    with pytest.raises(HEError):
        ciphertext_from_bytes(other, data)
    with pytest.raises(HEError):
        ciphertext_from_bytes(ctx, data[:-100])
    bad = bytearray(data)
    bad[5] = 7  # unknown compression mode
    with pytest.raises(HEError, match="compression"):
        ciphertext_from_bytes(ctx, bytes(bad))
    # Bit flips inside the compressed body: SEAL's format has no MAC, so a flip
    # that still decodes to reduced coefficients goes undetected; anything else
    # must surface as HEError (never another exception or a crash).
    rng = np.random.default_rng(0)
    for _ in range(20):
        bad = bytearray(data)
        pos = int(rng.integers(16, len(bad)))
        bad[pos] ^= int(rng.integers(1, 256))
        try:
            ciphertext_from_bytes(ctx, bytes(bad), n_primes=2)
        except HEError:
            pass
    with pytest.raises(HEError):
        ciphertext_from_bytes(ctx, b"\x00" * 64)


def test_galois_keys_roundtrip(ck):
    ctx, keys = ck
    blob = keys.galois_keys_bytes([1, 5])
    gk = galois_keys_from_bytes(ctx, blob, required_steps=[1, 5])
    with pytest.raises(HEError, match="lack"):
        galois_keys_from_bytes(ctx, blob, required_steps=[2])
    vals = np.arange(ctx.slots, dtype=float) / ctx.slots
    ct = keys.encrypt(_pt(ctx, vals))
    out = seal.Ciphertext()
    ctx.evaluator.rotate_vector(ct, 5, gk, out)
    got = np.array(ctx.encoder.decode_double(keys.decrypt(out)))
    # left rotation; at scale 2^40 with key switching the slot error reaches ~1e-6
    # (CI saw 1.2e-6 once), so the bound is 1e-5 -- still far below the 2.4e-4 slot spacing
    np.testing.assert_allclose(got, np.roll(vals, -5), atol=1e-5)


def test_ciphertext_raw_roundtrip(ck):
    ctx, keys = ck
    vals = np.cos(np.arange(ctx.slots))
    ct = keys.encrypt(_pt(ctx, vals))
    arr = ciphertext_to_numpy(ct)
    assert arr.shape == (2, 2, ctx.n) and arr.dtype == np.uint64
    ct2 = numpy_to_ciphertext(ctx, arr, scale=ct.scale)
    np.testing.assert_array_equal(ciphertext_to_numpy(ct2), arr)
    got = np.array(ctx.encoder.decode_double(keys.decrypt(ct2)))
    np.testing.assert_allclose(got, vals, atol=1e-6)
    # numpy -> ct -> numpy from arbitrary reduced coefficients
    q = np.array(ctx.coeff_moduli, dtype=np.uint64)
    rng = np.random.default_rng(3)
    rnd = (rng.integers(0, 2**63, size=(2, 2, ctx.n), dtype=np.uint64) % q[None, :, None]).astype(np.uint64)
    np.testing.assert_array_equal(ciphertext_to_numpy(numpy_to_ciphertext(ctx, rnd, scale=2.0**40)), rnd)
    bad = rnd.copy()
    bad[0, 1, 7] = q[1]
    with pytest.raises(HEError, match="reduced"):
        numpy_to_ciphertext(ctx, bad)


def test_plaintext_raw_and_bytes_roundtrip(ck):
    ctx, _ = ck
    pt = _pt(ctx, np.sin(np.arange(ctx.slots)))
    arr = plaintext_to_numpy(pt, ctx)
    assert arr.shape == (2, ctx.n)
    pt2 = numpy_to_plaintext(ctx, arr, scale=pt.scale)
    np.testing.assert_array_equal(plaintext_to_numpy(pt2, ctx), arr)
    pt3 = plaintext_from_bytes(ctx, plaintext_to_bytes(pt), parms_id=ctx.parms_id_at(2))
    np.testing.assert_array_equal(plaintext_to_numpy(pt3, ctx), arr)
    np.testing.assert_allclose(
        np.array(ctx.encoder.decode_double(pt2)), np.array(ctx.encoder.decode_double(pt)), atol=1e-9
    )


def test_secret_key_not_picklable(ck):
    import pickle

    _, keys = ck
    with pytest.raises(TypeError):
        pickle.dumps(keys)


def test_transparent_ciphertext_is_an_heerror(ck):
    """A ciphertext whose c1 is zero would make SEAL's multiply_plain raise a bare
    RuntimeError deep in a protocol; the loader refuses it with HEError instead."""
    ctx, keys = ck
    arr = ciphertext_to_numpy(keys.encrypt(_pt(ctx, np.zeros(4))))
    arr[1] = 0
    blob = ciphertext_to_bytes(numpy_to_ciphertext(ctx, arr, scale=2.0 ** 40))
    with pytest.raises(HEError, match="transparent"):
        ciphertext_from_bytes(ctx, blob, n_primes=arr.shape[1])
    arr[1, 0, 0] = 1  # one non-zero coefficient: a valid (if useless) ciphertext
    ciphertext_from_bytes(ctx, ciphertext_to_bytes(numpy_to_ciphertext(ctx, arr, scale=2.0 ** 40)),
                          n_primes=arr.shape[1])

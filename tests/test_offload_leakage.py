"""What the offload client sees in a decrypted result (security review finding 8).

The server sums the input chunks itself (`cipherlm.he.matmul`: y += rot(y, 2^i B), c B = S),
so every slot block of a result holds the whole output, never one chunk's partial sum, and
the slots between the outputs are zero.  Decrypted here with the client's own secret key,
slot by slot, for groups whose plans have several chunks (in process and through the
worker pool).  What remains (counted in docs/offload.md): the imaginary part of each
output slot (one more linear form in W per output) and, for inputs wider than one
ciphertext, each part's partial sums.
"""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.he import HEOpCounter
from cipherlm.he.matmul import decrypt_slots, unpack_cts
from cipherlm.runtime.linear_groups import LinearGroup
from cipherlm.runtime.offload_engine import ClientEngine, ServerEngine


def _pair(linears, groups, workers=1):
    server = ServerEngine(groups, linears, workers=workers)
    client = ClientEngine(server.public_setup(), groups)
    keys = server.load_client_keys(client.galois_keys_blob())
    return server, client, keys


def _complex_result(W, b, x):
    """sum_j w_c[r, j] x_c[j] with the packing's complex pairs (real part = W x + b)."""
    Wb = np.concatenate([W, b[:, None]], axis=1) if b is not None else W
    xb = np.concatenate([x, [1.0]]) if b is not None else x
    if Wb.shape[1] % 2:
        Wb, xb = np.concatenate([Wb, np.zeros((Wb.shape[0], 1))], axis=1), np.concatenate([xb, [0.0]])
    return (Wb[:, 0::2] - 1j * Wb[:, 1::2]) @ (xb[0::2] + 1j * xb[1::2])


def _check_result_slots(client, gid, blob, want: np.ndarray, tol: float) -> int:
    """Every slot of every result ciphertext: output rows (real part = the output, in every
    slot block) or zero.  Returns the number of chunk blocks seen."""
    plan = client.plans[client.parts[gid][0]]
    blobs = unpack_cts(blob, plan.n_blocks)
    for o, ct in enumerate(blobs):
        v = decrypt_slots(client.keys, ct)
        rows = want[o * plan.rows:(o + 1) * plan.rows]
        R = rows.size
        if plan.c > 1:
            assert plan.c * plan.stride == v.size
        for a in range(plan.c):
            blk = v[a * plan.stride:(a + 1) * plan.stride]
            # the outputs themselves (real part), identical in every block: no partial sums
            np.testing.assert_allclose(blk[:R].real, rows.real, atol=tol)
            # the residue: each output's imaginary part (a second linear form in W)
            np.testing.assert_allclose(blk[:R].imag, rows.imag, atol=tol)
            # everything else in the block is zero
            assert np.max(np.abs(blk[R:]), initial=0.0) < tol
        assert np.max(np.abs(v[plan.c * plan.stride:]), initial=0.0) < tol
    return plan.c


@pytest.mark.parametrize("workers", [1, 2], ids=["in-process", "pool"])
@pytest.mark.parametrize("d_outs,d_in,bias", [((128, 256), 384, True), ((576,), 1536, False)],
                         ids=["384-in-bias", "down-1536"])
def test_result_holds_only_the_outputs(d_outs, d_in, bias, workers):
    rng = np.random.default_rng(sum(d_outs) + d_in)
    Ws = [rng.standard_normal((o, d_in)) * 0.05 for o in d_outs]
    bs = [rng.standard_normal(o) * 0.1 if bias else None for o in d_outs]
    names = tuple(f"w{i}" for i in range(len(d_outs)))
    group = LinearGroup(0, names, d_in, tuple(d_outs))
    server, client, keys = _pair({n: (W, b) for n, W, b in zip(names, Ws, bs)}, [group], workers=workers)
    try:
        plan = client.plans[0]
        assert plan.c >= 4  # several chunks, so the first version sent partial sums
        x = rng.standard_normal(d_in)
        blob = server.apply(0, client.encrypt(0, x), keys)
        W = np.concatenate(Ws)
        b = np.concatenate(bs) if bias else None
        want = _complex_result(W, b, x)
        tol = 1e-6 * np.max(np.abs(W)) * max(np.max(np.abs(x)), 1.0) * plan.n
        assert _check_result_slots(client, 0, blob, want, tol) == plan.c
        y = client.decrypt(0, blob)
        np.testing.assert_allclose(y, want.real, atol=tol)
    finally:
        server.close()


def test_chunk_sum_rotations_are_planned_and_keyed():
    rng = np.random.default_rng(4)
    W = rng.standard_normal((384, 384)) * 0.05
    group = LinearGroup(0, ("w",), 384, (384,))
    server, client, keys = _pair({"w": (W, None)}, [group])
    plan = server.plans[0]
    assert plan.chunk_steps and set(plan.chunk_steps) <= set(server.public_setup()["rotation_steps"])
    server.apply(0, client.encrypt(0, rng.standard_normal(384)), keys)
    ops = keys.by_class[group.op_class]
    assert ops.rotations == plan.op_counts()["rotations"]
    assert plan.op_counts()["chunk_rotations"] == plan.n_blocks * (plan.c.bit_length() - 1)


def test_several_output_blocks():
    rng = np.random.default_rng(5)
    W = rng.standard_normal((4000, 768)) * 0.05
    group = LinearGroup(0, ("w",), 768, (4000,))
    server, client, keys = _pair({"w": (W, None)}, [group])
    plan = client.plans[0]
    assert plan.n_blocks > 1 and plan.c > 1
    x = rng.standard_normal(768)
    blob = server.apply(0, client.encrypt(0, x), keys)
    _check_result_slots(client, 0, blob, _complex_result(W, None, x), 1e-6 * np.max(np.abs(W)) * 4 * plan.n)


def test_residue_of_wide_inputs_is_the_parts_partial_sums():
    """Inputs wider than one ciphertext (here 9000 = 3 parts) are still summed by the
    client: it sees each part's partial sums, (parts - 1) x d_out values beyond the outputs."""
    rng = np.random.default_rng(6)
    W = rng.standard_normal((8, 9000)) / 95
    group = LinearGroup(0, ("w",), 9000, (8,))
    server, client, keys = _pair({"w": (W, None)}, [group])
    assert len(client.parts[0]) == 3
    x = rng.standard_normal(9000)
    blobs = unpack_cts(server.apply(0, client.encrypt(0, x), keys), 3)
    for pid, cols, blob in zip(client.parts[0], client.columns[0], blobs):
        plan = client.plans[pid]
        v = decrypt_slots(client.keys, unpack_cts(blob, plan.n_blocks)[0])
        np.testing.assert_allclose(v[:8].real, W[:, cols] @ x[cols], atol=1e-5)

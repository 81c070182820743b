"""Oblivious transfer (cipherlm.mpc.ot, cipherlm._core): correctness of every
OT kind in-process and across two OS processes over TCP, the native helpers,
bad input, and stalled peers.  View tests are in test_mpc_ot_views.py."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from cipherlm import _core
from cipherlm.mpc.ot import OTError, OTSession, bytes_per_ot
from cipherlm.net.channel import TCPChannel, inprocess_pair, listen
from cipherlm.net.framing import ChannelTimeout

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1) if bits < 64 else M64


def run_both(f0, f1, *, timeout: float = 30.0, batch: int = 1 << 19, join: float = 60.0):
    """Run f0(session of party 0) and f1(session of party 1) in two threads over
    an in-process channel; return (results, errors, (chan0, chan1))."""
    a, b = inprocess_pair(timeout=timeout)
    # IKNP (with KK13): these tests check its wire format; Ferret: tests/test_mpc_ferret.py
    sessions = (OTSession(a, 0, batch=batch, ferret=False), OTSession(b, 1, batch=batch, ferret=False))
    res: list = [None, None]
    errs: list = [None, None]

    def work(i, f):
        try:
            res[i] = f(sessions[i])
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errs[i] = e

    th = [threading.Thread(target=work, args=(i, f), daemon=True) for i, f in enumerate((f0, f1))]
    for t in th:
        t.start()
    for t in th:
        t.join(join)
        assert not t.is_alive(), "OT call hung"
    return res, errs, (a, b)


def ok(f0, f1, **kw):
    res, errs, chans = run_both(f0, f1, **kw)
    for e in errs:
        if e is not None:
            raise e
    return res, chans


RNG = np.random.default_rng(12345)  # test inputs only; OT randomness is the OS CSPRNG


# --------------------------------------------------------------- native helpers


def test_transpose_matches_numpy():
    for rows, cols in [(128, 8), (128, 1024 + 48), (256, 64), (32, 16)]:
        a = RNG.integers(0, 256, rows * cols // 8, dtype=np.uint8)
        t = np.frombuffer(_core.transpose_bits(a, rows, cols), np.uint8)
        A = np.unpackbits(a.reshape(rows, cols // 8), axis=1, bitorder="little")
        T = np.unpackbits(t.reshape(cols, rows // 8), axis=1, bitorder="little")
        assert (A.T == T).all()
    with pytest.raises(ValueError):
        _core.transpose_bits(bytes(10), 128, 8)


@pytest.mark.parametrize("bits", [1, 2, 3, 13, 32, 63, 64])
def test_pack_unpack(bits):
    v = RNG.integers(0, 2**63, 1001, dtype=np.uint64) & mask(bits)
    p = _core.pack_bits(v.view(np.uint8), bits)
    assert len(p) == (1001 * bits + 7) // 8
    assert (np.frombuffer(_core.unpack_bits(p, 1001, bits), np.uint64) == v).all()
    with pytest.raises(ValueError):
        _core.unpack_bits(p[:-1], 1001, bits)


def test_fixed_key_aes_known_answer_on_every_path():
    """The core's own AES-128 (VAES, AES-NI, and the `aes` crate's) against FIPS-197
    appendix C.1 and against each other on random blocks: the OT hashes and GGM trees
    run on it, and a wrong round would still give consistent (but insecure) OTs."""
    key, pt = bytes(range(16)), bytes(i * 0x11 for i in range(16))
    want = bytes.fromhex("69c4e0d86a7b0430d8cdb78070b4c55a")
    data = np.random.default_rng(7).integers(0, 256, 16 * 1037, dtype=np.uint8).tobytes()
    ref, used = _core.aes128_blocks(key, data, "soft")
    assert used == "soft"
    for path in ("vaes512", "aesni", "soft"):
        ct, used = _core.aes128_blocks(key, pt * 21, path)  # 21 blocks: the 16-, 4- and 1-block loops
        assert bytes(ct) == want * 21, (path, used)
        assert bytes(_core.aes128_blocks(key, data, path)[0]) == bytes(ref), (path, used)
    with pytest.raises(ValueError, match="16-byte blocks"):
        _core.aes128_blocks(key, b"x" * 17, "soft")
    with pytest.raises(ValueError, match="unknown AES path"):
        _core.aes128_blocks(key, pt, "sse")


def test_aes_prg_deterministic():
    s = bytes(range(16))
    assert _core.aes_prg(s, 100) == _core.aes_prg(s, 100)
    assert _core.aes_prg(s, 100) != _core.aes_prg(bytes(16), 100)
    with pytest.raises(ValueError):
        _core.aes_prg(b"short", 10)


def test_base_ot_direct():
    a, A = _core.baseot_sender_init()
    c = RNG.integers(0, 2, 64, dtype=np.uint8)
    B, kc = _core.baseot_receiver(A, c)
    k0, k1 = _core.baseot_sender_keys(a, A, B)
    kc, k0, k1 = (np.frombuffer(x, np.uint8).reshape(64, 16) for x in (kc, k0, k1))
    assert (kc == np.where(c[:, None] == 1, k1, k0)).all()
    assert (kc != np.where(c[:, None] == 1, k0, k1)).any(axis=1).all()
    with pytest.raises(ValueError, match="Ristretto"):
        _core.baseot_receiver(b"\xff" * 32, c)
    with pytest.raises(ValueError):
        _core.baseot_sender_keys(a, A, bytes(B)[:-1])
    with pytest.raises(ValueError):
        _core.baseot_receiver(A, np.array([2], np.uint8))


def test_extension_rejects_bad_lengths():
    s = _core.OtExtSender(bytes(16), bytes(16 * 128))
    with pytest.raises(ValueError, match="expected"):
        s.extend(bytes(100), 16)
    with pytest.raises(ValueError):
        _core.OtExtSender(bytes(15), bytes(16 * 120))
    r = _core.OtExtReceiver(bytes(16 * 128), bytes(16 * 128))
    with pytest.raises(ValueError, match="0 or 1"):
        r.extend(np.array([0, 2], np.uint8))
    with pytest.raises(ValueError):
        _core.chosen_receiver(bytes(32), np.array([0, 1], np.uint8), 0, bytes(3), 64)


def test_ot_flavours_validate_arguments():
    two = np.array([0, 1], np.uint8)
    with pytest.raises(ValueError, match="multiple of 16"):
        _core.rot_receiver(bytes(17), 0, 64)
    with pytest.raises(ValueError, match="Delta must be 16"):
        _core.rot_sender(bytes(32), bytes(15), 0, 64)
    with pytest.raises(ValueError, match="bits"):
        _core.rot_sender(bytes(32), bytes(16), 0, 65)
    with pytest.raises(ValueError, match="correlations has 8 bytes, expected 16"):
        _core.acot_sender(bytes(32), bytes(16), 0, bytes(8), 64)
    with pytest.raises(ValueError, match="0 or 1"):
        _core.acot_receiver(bytes(32), np.array([0, 2], np.uint8), 0, bytes(16), 64)
    with pytest.raises(ValueError, match="1 choices for 2 OTs"):
        _core.chosen_bytes_receiver(bytes(32), two[:1], 0, bytes(4 * 4), 4)
    with pytest.raises(ValueError, match="Delta must be 32"):
        _core.kk13_sender(bytes(64), bytes(16), 0, 4, bytes(64), 64)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        _core.kk13_receiver(bytes(64), np.array([0, 4], np.uint8), 0, 4, bytes(64), 64)
    # well-formed arguments still go through
    y = _core.kk13_sender(bytes(64), bytes(32), 0, 4, bytes(64), 64)
    assert len(_core.kk13_receiver(bytes(64), np.array([0, 3], np.uint8), 0, 4, y, 64)) == 16


# --------------------------------------------------------------- correctness in-process


@pytest.mark.parametrize("bits", [1, 8, 37, 64])
def test_random_ot(bits):
    n = 1000
    c = RNG.integers(0, 2, n).astype(bool)
    ((m0, m1), (cc, mc)), _ = ok(lambda s: s.send_random(n, bits), lambda s: s.recv_random(c, bits))
    assert (cc == c).all()
    assert (mc == np.where(c, m1, m0)).all()
    assert ((m0 | m1) & ~mask(bits) == 0).all()
    assert (m0 != m1).mean() > 0.45  # keys differ (for 1 bit, half the time)


def test_random_ot_random_choices():
    ((m0, m1), (c, mc)), _ = ok(lambda s: s.send_random(777), lambda s: s.recv_random(None, n=777))
    assert c.dtype == bool and c.shape == (777,) and 300 < c.sum() < 477
    assert (mc == np.where(c, m1, m0)).all()


@pytest.mark.parametrize("bits", [1, 5, 32, 64])
def test_chosen_ot(bits):
    n = 1500
    c = RNG.integers(0, 2, n).astype(bool)
    m0 = RNG.integers(0, 2**64, n, dtype=np.uint64)
    m1 = RNG.integers(0, 2**64, n, dtype=np.uint64)
    (_, out), (a, _b) = ok(lambda s: s.send_chosen(m0, m1, bits), lambda s: s.recv_chosen(c, bits))
    assert (out == np.where(c, m1, m0) & mask(bits)).all()
    # sender's payload: 2*bits per OT (+ header)
    sent = a.stats()["other"]["bytes_sent"]
    assert 2 * n * bits / 8 <= sent <= 2 * n * bits / 8 + 300


@pytest.mark.parametrize("bits", [1, 16, 40, 64])
def test_arith_cot(bits):
    n = 2000
    c = RNG.integers(0, 2, (40, 50)).astype(bool)
    corr = RNG.integers(0, 2**64, (40, 50), dtype=np.uint64)
    (r, out), (a, b) = ok(lambda s: s.send_cot(corr, bits), lambda s: s.recv_cot(c, bits))
    assert r.shape == out.shape == (40, 50)
    assert (out == (r + c.astype(np.uint64) * corr) & mask(bits)).all()
    st0, st1 = a.stats()["other"], b.stats()["other"]
    assert n * bits / 8 <= st0["bytes_sent"] <= n * bits / 8 + 300
    assert n * 16 <= st1["bytes_sent"] <= n * 16 + 300


def test_bool_cot():
    n = 999
    c = RNG.integers(0, 2, n).astype(bool)
    ((q, delta), t), _ = ok(lambda s: s.send_bool_cot(n), lambda s: s.recv_bool_cot(c))
    assert q.shape == t.shape == (n, 2) and delta.shape == (2,)
    assert (t == q ^ (c[:, None].astype(np.uint64) * delta)).all()


@pytest.mark.parametrize("N,bits", [(2, 64), (16, 2), (16, 8), (256, 1), (100, 33)])
def test_1ofN(N, bits):
    n = 700
    msgs = RNG.integers(0, 2**64, (n, N), dtype=np.uint64)
    ch = RNG.integers(0, N, n)
    (_, out), (a, _b) = ok(lambda s: s.send_1ofN(msgs, bits), lambda s: s.recv_1ofN(ch, N, bits))
    assert (out == msgs[np.arange(n), ch] & mask(bits)).all()


@pytest.mark.parametrize("L", [1, 16, 17, 100])
def test_chosen_bytes(L):
    n = 300
    c = RNG.integers(0, 2, n).astype(bool)
    m0 = RNG.integers(0, 256, (n, L), dtype=np.uint8)
    m1 = RNG.integers(0, 256, (n, L), dtype=np.uint8)
    (_, out), _ = ok(lambda s: s.send_chosen_bytes(m0, m1), lambda s: s.recv_chosen_bytes(c, L))
    assert (out == np.where(c[:, None], m1, m0)).all()


def test_batches_both_directions_and_mixed_kinds():
    """Small batches (many extension messages), both parties as sender, all
    kinds interleaved on one session pair, odd sizes and n = 0."""
    sizes = [0, 1, 15, 16, 17, 333]
    data = []
    for n in sizes:
        data.append(
            dict(
                c=RNG.integers(0, 2, n).astype(bool),
                m0=RNG.integers(0, 2**64, n, dtype=np.uint64),
                m1=RNG.integers(0, 2**64, n, dtype=np.uint64),
                msgs=RNG.integers(0, 16, (n, 16), dtype=np.uint64),
                ch=RNG.integers(0, 16, n),
            )
        )

    def script(me):
        def f(s):
            out = []
            for i, d in enumerate(data):
                sender = i % 2  # alternate directions
                if s.party == sender:
                    s.send_chosen(d["m0"], d["m1"])
                    out.append(s.send_cot(d["m0"], 20))
                    s.send_1ofN(d["msgs"], 4)
                    out.append(s.send_random(len(d["c"]), 9))
                else:
                    out.append(s.recv_chosen(d["c"]))
                    out.append(s.recv_cot(d["c"], 20))
                    out.append(s.recv_1ofN(d["ch"], 16, 4))
                    out.append(s.recv_random(d["c"], 9))
            return out

        return f

    (o0, o1), _ = ok(script(0), script(1), batch=32)
    # reassemble per size
    p = {0: iter(o0), 1: iter(o1)}
    for i, d in enumerate(data):
        snd, rcv = p[i % 2], p[1 - i % 2]
        got = next(rcv)
        assert (got == np.where(d["c"], d["m1"], d["m0"])).all()
        r = next(snd)
        assert (next(rcv) == (r + d["c"].astype(np.uint64) * d["m0"]) & mask(20)).all()
        assert (next(rcv) == d["msgs"][np.arange(len(d["ch"])), d["ch"]]).all()
        m0, m1 = next(snd)
        _c, mc = next(rcv)
        assert (mc == np.where(d["c"], m1, m0)).all()


def test_bytes_per_ot_formula():
    # IKNP / KK13 (this file's sessions pin ferret=False; the default is Ferret:
    # tests/test_mpc_ferret.py test_bytes_per_ot_formula)
    assert bytes_per_ot("random", ferret=False) == 16
    assert bytes_per_ot("cot", 64, ferret=False) == 24
    assert bytes_per_ot("chosen", 64, ferret=False) == 32
    assert bytes_per_ot("1ofN", 2, N=16, ferret=False) == 36
    n = 4096
    corr = RNG.integers(0, 2**64, n, dtype=np.uint64)
    c = RNG.integers(0, 2, n).astype(bool)

    def f0(s):
        s.setup()
        s.chan.reset_stats()
        return s.send_cot(corr, 64)

    def f1(s):
        s.setup()
        s.chan.reset_stats()
        return s.recv_cot(c, 64)

    _, (a, _b) = ok(f0, f1)
    tot = a.totals()
    per = (tot["bytes_sent"] + tot["bytes_received"]) / n
    assert bytes_per_ot("cot", 64, ferret=False) <= per <= bytes_per_ot("cot", 64, ferret=False) + 0.2


# --------------------------------------------------------------- two OS processes over TCP


def _tcp_peer(port: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 5000
    c = rng.integers(0, 2, n).astype(bool)
    ch = rng.integers(0, 16, n)
    msgs = rng.integers(0, 4, (n, 16), dtype=np.uint64)
    chan = TCPChannel.connect("127.0.0.1", port, timeout=60)
    s = OTSession(chan, 1)
    out = {}
    out["chosen"] = s.recv_chosen(c, 64)
    out["cot"] = s.recv_cot(c, 32)
    c2, out["rot"] = s.recv_random(None, 64, n=n)
    out["rot_c"] = c2.astype(np.uint8)
    s.send_1ofN(msgs, 2)
    chan.send(out)
    chan.recv()  # wait for the parent to finish reading
    chan.close()


def test_two_processes_tcp():
    seed = 77
    rng = np.random.default_rng(seed)
    n = 5000
    c = rng.integers(0, 2, n).astype(bool)
    ch = rng.integers(0, 16, n)
    msgs = rng.integers(0, 4, (n, 16), dtype=np.uint64)
    m0 = RNG.integers(0, 2**64, n, dtype=np.uint64)
    m1 = RNG.integers(0, 2**64, n, dtype=np.uint64)
    corr = RNG.integers(0, 2**32, n, dtype=np.uint64)
    srv = listen()
    port = srv.getsockname()[1]
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_tcp_peer, args=(port, seed), daemon=True)
    p.start()
    try:
        chan = TCPChannel.accept(srv, timeout=60, accept_timeout=60)
        s = OTSession(chan, 0)
        s.send_chosen(m0, m1, 64)
        r = s.send_cot(corr, 32)
        r0, r1 = s.send_random(n, 64)
        got = s.recv_1ofN(ch, 16, 2)
        out = chan.recv()
        chan.send({"done": True})
        assert (out["chosen"] == np.where(c, m1, m0)).all()
        assert (out["cot"] == (r + c.astype(np.uint64) * corr) & mask(32)).all()
        assert (out["rot"] == np.where(out["rot_c"] == 1, r1, r0)).all()
        assert (got == msgs[np.arange(n), ch]).all()
        chan.close()
    finally:
        srv.close()
        p.join(30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


# --------------------------------------------------------------- bad input and stalls


def _fake_receiver_msg(s: OTSession, msg: dict):
    """Act as a (malicious/broken) receiver: run the real base OTs, then send `msg`."""
    s._receiver_ext(128)
    s.chan.send(msg)


def _expect_error(f_sender, f_fake, exc=OTError, match=None):
    res, errs, _ = run_both(f_sender, f_fake, timeout=5)
    assert isinstance(errs[0], exc), errs
    if match:
        assert match in str(errs[0]), str(errs[0])


def test_truncated_extension_matrix():
    n = 100
    m = np.zeros(n, np.uint64)
    msg = {"op": "chosen", "k": 128, "n": n, "at": 0, "bits": 64, "u": np.zeros(100, np.uint8)}
    _expect_error(lambda s: s.send_chosen(m, m), lambda s: _fake_receiver_msg(s, msg), match="truncated")


def test_malformed_extension_messages():
    n = 100
    m = np.zeros(n, np.uint64)
    good_u = np.zeros(128 * 112 // 8, np.uint8)
    base = {"op": "chosen", "k": 128, "n": n, "at": 0, "bits": 64, "u": good_u}
    for bad, what in [
        ({**base, "op": "cot"}, "expected OT message"),
        ({**base, "bits": 32}, "bits"),
        ({**base, "n": 99}, "n="),
        ({**base, "at": 5}, "at="),
        ({**base, "u": good_u.astype(np.uint16)}, "uint8"),
        ({k: v for k, v in base.items() if k != "u"}, "uint8"),
    ]:
        _expect_error(lambda s: s.send_chosen(m, m), lambda s, bad=bad: _fake_receiver_msg(s, bad), match=what)


def test_truncated_reply():
    n = 64
    c = np.zeros(n, bool)

    def fake_sender(s):
        st = s._sender_ext(128)
        s.chan.recv()  # the extension matrix
        s.chan.send({"op": "chosen_y", "y": np.zeros(10, np.uint8)})

    res, errs, _ = run_both(fake_sender, lambda s: s.recv_chosen(c), timeout=5)
    assert isinstance(errs[1], OTError) and "truncated" in str(errs[1])


def test_bad_base_ot_point():
    def fake(s):
        s.chan.send({"op": "base_A", "k": 128, "A": np.full(32, 0xFF, np.uint8)})
        s.chan.recv()

    res, errs, _ = run_both(lambda s: s.send_random(10), fake, timeout=2)
    assert isinstance(errs[0], OTError) and "Ristretto" in str(errs[0])


def test_bad_arguments():
    a, _b = inprocess_pair(timeout=1)
    s = OTSession(a, 0)
    with pytest.raises(ValueError):
        OTSession(a, 2)
    with pytest.raises(ValueError):
        s.recv_chosen(np.array([0, 2]))
    with pytest.raises(ValueError):
        s.send_chosen(np.zeros(3, np.uint64), np.zeros(4, np.uint64))
    with pytest.raises(ValueError):
        s.recv_cot(np.array([0, 1]), bits=65)
    with pytest.raises(ValueError):
        s.recv_1ofN(np.array([16]), 16)
    with pytest.raises(ValueError):
        s.send_1ofN(np.zeros((3, 257), np.uint64))


@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_stalled_peer_times_out(role):
    c = np.zeros(64, bool)
    m = np.zeros(64, np.uint64)
    f = (lambda s: s.send_chosen(m, m)) if role == "sender" else (lambda s: s.recv_chosen(c))
    t0 = time.monotonic()
    res, errs, _ = run_both(f, lambda s: time.sleep(1.5), timeout=0.4, join=10)
    assert isinstance(errs[0], ChannelTimeout), errs
    assert time.monotonic() - t0 < 5


def test_peer_stalls_after_base_ot():
    """The peer completes the base OTs and then never sends its matrix."""
    m = np.zeros(64, np.uint64)

    def stall(s):
        s._receiver_ext(128)
        time.sleep(1.5)

    res, errs, _ = run_both(lambda s: s.send_chosen(m, m), stall, timeout=0.5, join=10)
    assert isinstance(errs[0], ChannelTimeout), errs

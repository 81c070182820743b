"""A corpus of malformed SEAL blobs for the loader tests (tests/test_he_blob_corpus.py).

Every item keeps a valid 16-byte SEAL header (magic, version, compression mode,
a size equal to the blob's length) around a broken body, because that is the
shape that made SEAL's own stream loader abort the process
(``std::__ios_failure`` thrown where it cannot be caught): truncated or
corrupted zstd streams, random bytes posing as zstd or zlib, a zstd bomb,
and broken layouts inside a well-formed stream.  Both schemes (the offload
CKKS set, the 2pc BFV set); ciphertexts (seeded and full), public keys and
Galois keys.

``tests/data/seal_crashers/*.bin`` holds blobs a fuzzer found that abort an
unguarded ``obj.load`` (first byte: 0 = CKKS / 1 = BFV set, second: 0 =
ciphertext, 1 = public key, 2 = Galois keys, then the blob).  Parameter ids are
hashes of the public parameters, so the files stay valid on every machine.
"""

from __future__ import annotations

import functools
import random
import struct
from pathlib import Path

import numpy as np
import zstandard

SCHEMES = ("ckks", "bfv")
KINDS = ("ciphertext", "public_key", "galois_keys")
CRASHERS = Path(__file__).parent / "data" / "seal_crashers"


def params(scheme: str):
    from cipherlm.he import OFFLOAD_CKKS
    from cipherlm.mpc.he_session import TWOPC_BFV

    return {"ckks": OFFLOAD_CKKS, "bfv": TWOPC_BFV}[scheme]


def legit_blobs(scheme: str) -> dict:
    """One genuine blob of each kind under fresh keys: {kind: [bytes, ...]}."""
    import tenseal.sealapi as seal

    from cipherlm.he import HEContext, serialize
    from cipherlm.he.keys import ClientKeys

    ctx = HEContext(params(scheme))
    keys = ClientKeys(ctx)
    if scheme == "ckks":
        pt = seal.Plaintext()
        ctx.encoder.encode([0.5] * ctx.slots, 2.0 ** 40, pt)
    else:
        pt = serialize.numpy_to_plaintext(ctx, np.arange(ctx.n, dtype=np.uint64) % 1000)
    return {
        "ciphertext": [keys.encrypt_seeded(pt), serialize.ciphertext_to_bytes(keys.encrypt(pt))],
        "public_key": [keys.public_key_bytes()],
        "galois_keys": [keys.galois_keys_bytes([1, 2])],
    }


def _with_size(b: bytearray) -> bytes:
    struct.pack_into("<Q", b, 8, len(b))
    return bytes(b)


def _with_body(blob: bytes, body: bytes, compr: int | None = None) -> bytes:
    head = bytearray(blob[:16])
    if compr is not None:
        head[5] = compr
    return _with_size(head + body)


@functools.lru_cache(maxsize=1)
def _bomb() -> bytes:
    return zstandard.ZstdCompressor(level=1).compress(bytes(1 << 28))


def mutations(blob: bytes, seed: int) -> list[tuple[str, bytes]]:
    """Malformed variants of one genuine (zstd-compressed) blob, each with a valid header."""
    r = random.Random(seed)
    body = blob[16:]
    out = [
        ("zstd truncated to half", _with_body(blob, body[: len(body) // 2])),
        ("zstd truncated by 1 byte", _with_body(blob, body[:-1])),
        ("zstd frame header only", _with_body(blob, body[:16])),
        ("empty body", _with_body(blob, b"")),
        ("random bytes as zstd", _with_body(blob, r.randbytes(len(body)))),
        ("random bytes as zlib", _with_body(blob, r.randbytes(4096), compr=1)),
        ("random bytes uncompressed", _with_body(blob, r.randbytes(4096), compr=0)),
        ("zstd bomb (256 MiB of zeros)", _with_body(blob, _bomb())),
    ]
    for i in range(6):
        b = bytearray(blob)
        for _ in range(r.randrange(1, 8)):
            b[r.randrange(16, len(b))] = r.randrange(256)
        out.append((f"zstd bytes corrupted #{i}", bytes(b)))
    for i in range(3):
        b = bytearray(blob)
        j = r.randrange(16, len(b))
        b[j:j + 4096] = r.randbytes(len(b[j:j + 4096]))
        out.append((f"zstd span replaced #{i}", bytes(b)))
    # a well-formed zstd stream around a broken layout
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(body)
    for name, bad in (("layout truncated", raw[: len(raw) // 3]), ("layout padded", raw + b"\0" * 64),
                      ("layout counts flipped", raw[:40] + bytes([raw[40] ^ 0xFF]) + raw[41:])):
        out.append((name, _with_body(blob, zstandard.ZstdCompressor().compress(bad))))
    return out


def crashers() -> list[tuple[str, str, str, bytes]]:
    """(file name, scheme, kind, blob) of the stored fuzzer finds."""
    out = []
    for path in sorted(CRASHERS.glob("*.bin")):
        data = path.read_bytes()
        out.append((path.name, SCHEMES[data[0]], KINDS[data[1]], data[2:]))
    return out


def corpus(scheme: str, seed: int = 0) -> list[tuple[str, str, bytes]]:
    """(kind, description, blob) for one scheme: mutations of genuine blobs plus the crashers."""
    items = []
    for kind, blobs in legit_blobs(scheme).items():
        for i, blob in enumerate(blobs):
            items += [(kind, f"{kind}[{i}] {name}", b) for name, b in mutations(blob, seed + i)]
    items += [(kind, f"crasher {name}", b) for name, s, kind, b in crashers() if s == scheme]
    return items

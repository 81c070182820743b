"""Client-side key material (the secret key never leaves this object).

Only the client builds a ``ClientKeys``.  It encrypts with the secret key
(symmetric, seeded: see ``serialize``), decrypts, and produces the *public*
Galois keys for the rotation steps the server's plans need.  There is no
method that serialises the secret key for sending; ``export_secret_key`` is
for the client's own local storage and is deliberately separate.
"""

from __future__ import annotations

import numpy as np
import tenseal.sealapi as seal

from . import serialize
from .backend import SecretKeys
from .context import HEContext
from .errors import HEError


class ClientKeys(SecretKeys):
    def __init__(self, ctx: HEContext):
        self.ctx = ctx
        # SEAL's KeyGenerator samples the secret from its PRNG seeded by the OS
        # random device (std::random_device -> Blake2xb/SHAKE256).
        self._keygen = seal.KeyGenerator(ctx.seal)
        self._sk = self._keygen.secret_key()
        self._encryptor = seal.Encryptor(ctx.seal, self._sk)
        self._decryptor = seal.Decryptor(ctx.seal, self._sk)

    def __repr__(self) -> str:  # never print key material
        return f"ClientKeys({self.ctx.params.name})"

    def __getstate__(self):
        raise TypeError("ClientKeys holds the secret key and is not picklable")

    # -- public key material for the server ------------------------------------
    def galois_keys_bytes(self, steps) -> bytes:
        """Seeded (half-size) serialised Galois keys for the given rotation steps."""
        steps = sorted({int(s) % self.ctx.slots for s in steps} - {0})
        if not steps:
            raise HEError("no rotation steps requested")
        elts = self.ctx.galois_elts(steps)
        return serialize.galois_keys_to_bytes(self._keygen.create_galois_keys(elts))

    def galois_keys_bytes_for_elements(self, elements) -> bytes:
        """Seeded serialised Galois keys for the automorphisms X -> X^g, g in ``elements``."""
        return serialize.galois_keys_to_bytes(self._keygen.create_galois_keys([int(g) for g in elements]))

    def galois_keys(self, steps) -> seal.GaloisKeys:
        """Galois keys as a local object (tests / in-process use)."""
        steps = sorted({int(s) % self.ctx.slots for s in steps} - {0})
        gk = seal.GaloisKeys()
        self._keygen.create_galois_keys(self.ctx.galois_elts(steps), gk)
        return gk

    def public_key_bytes(self) -> bytes:
        """Serialised public key (for a peer that re-randomises results under our key).
        This tenseal build does not bind SEAL's seeded ``Serializable<PublicKey>``,
        so it is full size (2 polynomials at the key level)."""
        pk = seal.PublicKey()
        self._keygen.create_public_key(pk)
        return serialize.public_key_to_bytes(pk)

    # -- encryption ---------------------------------------------------------------
    def encrypt_seeded(self, pt: seal.Plaintext) -> bytes:
        """Symmetric encryption, serialised with the seed instead of the random half."""
        return serialize.ciphertext_to_bytes(self._encryptor.encrypt_symmetric(pt))

    def encrypt(self, pt: seal.Plaintext) -> seal.Ciphertext:
        ct = seal.Ciphertext()
        self._encryptor.encrypt_symmetric(pt, ct)
        return ct

    def decrypt(self, ct: seal.Ciphertext) -> seal.Plaintext:
        pt = seal.Plaintext()
        self._decryptor.decrypt(ct, pt)
        return pt

    def secret_key_ntt(self) -> np.ndarray:
        """The secret key's NTT-form residues at the data primes (k, N), for this process's
        native encryption and decryption only (cached; never serialised for sending)."""
        if getattr(self, "_sk_ntt", None) is None:
            arr = serialize.plaintext_to_numpy(self._sk.data(), self.ctx)  # (k + 1, N): key level
            self._sk_ntt = np.ascontiguousarray(arr[: len(self.ctx.coeff_moduli)])
        return self._sk_ntt

    def export_secret_key(self) -> bytes:
        """For the client's own storage only; never send this."""
        return serialize._save(self._sk)

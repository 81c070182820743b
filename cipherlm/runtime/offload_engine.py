"""The HE side of offload mode: projection groups as CKKS ct x pt products.

Binds the projection groups of a model (:mod:`cipherlm.runtime.linear_groups`)
to the packed encrypted matrix product of :mod:`cipherlm.he.matmul`
(complex packing, input-chunk blocks, baby-step giant-step; op counts and
bytes in ``docs/he_matmul.md``):

* :class:`ServerEngine` plans and encodes every group once, at start-up, and
  evaluates requests with the Galois keys of each session;
* :class:`ClientEngine` owns the secret key, creates the Galois keys the
  plans need, encrypts inputs and decrypts results.

Both count HE operations per operator class for the run report.

What a decrypted result carries (security review finding 8; docs/offload.md): the
server sums a plan's input chunks before sending (:mod:`cipherlm.he.matmul`), so each
result ciphertext holds the group's outputs (real parts, one copy per chunk block),
their imaginary parts (one more linear form in W per output) and zeros; no chunk's
partial sum.  The residue the client still adds itself: for an input wider than one
ciphertext (:func:`input_parts`, d_in + bias > 4096; none of SmolLM2's or MiniLM's
projections) it decrypts one result per part, i.e. (parts - 1) x d_out partial sums
beyond the outputs.

``ServerEngine(..., he_backend="lattigo")`` runs the same plans on the Lattigo
backend (`cipherlm.he.matmul.make_context`; one native call per request, W
goroutines for ``workers=W``, no worker processes); `ClientEngine` follows the
backend the welcome names.

``ServerEngine(..., workers=W)`` with W > 1 (SEAL) evaluates through a
:class:`cipherlm.he.parallel.ApplyPool` of W worker processes (each holds a
share of every encoded group; plans are made for W workers); W = 1 is the
in-process path.  A session's keys are released with
``engine.release(session_keys)`` (or ``session_keys.release()``), the engine
with ``engine.close()`` (also a context manager).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Sequence

import numpy as np

from cipherlm.he import (
    OFFLOAD_CKKS,
    HEError,
    HEOpCounter,
    MatmulPlan,
    apply,
    decrypt_output,
    encode_group,
    encrypt_input,
    load_galois_keys,
    params_to_bytes,
    plan_matmul,
)
from cipherlm.he.matmul import (
    OFFLOAD_BACKENDS,
    client_keys,
    make_context,
    offload_costs,
    offload_params_from_bytes,
    offload_params_to_bytes,
    pack_cts,
    result_ring_kind,
    unpack_cts,
)
from cipherlm.he.params import check_security
from cipherlm.runtime.linear_groups import LinearGroup


#: the environment variable that sets a server's token rows per packed prefill ciphertext
#: (`ServerEngine`'s ``prefill_tokens`` when not given; 1: no packing, every row its own
#: ciphertext, as before issue 15 item 2)
PREFILL_PACK_ENV = "CIPHERLM_OFFLOAD_PREFILL_PACK"
#: the default token rows per packed prefill ciphertext: 1 (packing off) while the packed
#: plans cost a second copy of the weights: on Lattigo those with one chunk are kept at 1/T
#: (period S/T), those with c > 1 cannot be (SmolLM2 at T = 2: 8.21 GiB of server memory
#: against 3.98 per-row, 10.12 stored whole; start 48-95 s against 23-32 s; first token
#: 0.60-1.00x as long under load; docs/offload.md "Packed prefill: compressed diagonals");
#: ``$CIPHERLM_OFFLOAD_PREFILL_PACK=2`` turns it on
DEFAULT_PREFILL_TOKENS = 1


#: "0": the packed plans' diagonals are stored whole (A/B of their compression only; default:
#: those of period S / T, the plans with one chunk, at 1/T of the memory, same results,
#: `cipherlm.he.matmul.encode_matrix` ``compress``; Lattigo only)
PACK_COMPRESS_ENV = "CIPHERLM_OFFLOAD_PACK_COMPRESS"

#: What a Lattigo server sends in rings of degree N/2 (docs/offload.md "Half-ring results", "Real
#: inputs in the half ring"); the modes of `half_ring_mode`:
#: - "inputs" (the default; "1" too): real inputs in the conjugate-invariant ring (half the bytes
#:   up), complex outputs, every one-row result even-folded (half the bytes down);
#: - "results": complex inputs in the full ring, every one-row result in the conjugate-invariant
#:   ring (the real parts of its slots; the default of 2026-11-30);
#: - "off" ("0"): everything in the full ring (A/B only).
HALF_RING_ENV = "CIPHERLM_OFFLOAD_HALF_RING"
HALF_RING_MODES = ("inputs", "results", "off")

#: "0": a decoder whose LM head is its embedding matrix (tied) still has the server evaluate
#: it under HE (A/B only; default: the client, which holds that matrix in its bundle for the
#: token embeddings, computes the logits in the clear; docs/offload.md "Tied LM head on the
#: client")
CLIENT_HEAD_ENV = "CIPHERLM_OFFLOAD_CLIENT_HEAD"


def client_head_from_env() -> bool:
    """Whether a tied LM head is computed by the client: yes unless ``$CIPHERLM_OFFLOAD_CLIENT_HEAD=0``."""
    return os.environ.get(CLIENT_HEAD_ENV, "1").strip() != "0"


def half_ring_mode(value: str | bool | None = None) -> str:
    """The half-ring mode ``value`` names (True: "inputs", False: "off"), or with None
    ``$CIPHERLM_OFFLOAD_HALF_RING``'s (unset: "inputs"); anything else is an `HEError`."""
    if value is None:
        value = os.environ.get(HALF_RING_ENV, "")
    if isinstance(value, bool):
        return "inputs" if value else "off"
    v = str(value).strip().lower()
    mode = {"": "inputs", "1": "inputs", "0": "off"}.get(v, v)
    if mode not in HALF_RING_MODES:
        raise HEError(f"${HALF_RING_ENV} must be one of {HALF_RING_MODES} (or 1 / 0), got {value!r}")
    return mode


def prefill_tokens_from_env(value: int | None = None) -> int:
    """``value`` if given, else ``$CIPHERLM_OFFLOAD_PREFILL_PACK``, else `DEFAULT_PREFILL_TOKENS`
    (a power of two >= 1)."""
    import os

    if value is None:
        raw = os.environ.get(PREFILL_PACK_ENV, "").strip()
        try:
            value = int(raw) if raw else DEFAULT_PREFILL_TOKENS
        except ValueError:
            raise HEError(f"${PREFILL_PACK_ENV} must be a power of two >= 1, got {raw!r}") from None
    value = int(value)
    if value < 1 or value & (value - 1):
        raise HEError(f"prefill tokens per ciphertext must be a power of two >= 1, got {value}")
    return value


#: the most input ciphertexts a packed prefill plan may cut a row into on Lattigo (`packed_plan`;
#: SEAL plans take one)
MAX_PACKED_IN_CTS = 64


def packed_plan(plan: MatmulPlan, tokens: int, backend: str) -> MatmulPlan | None:
    """The prefill plan for a group whose one-token plan is ``plan`` (one input part): of the
    plans packing T = 2, 4, ..., ``tokens`` rows per ciphertext that fit, the one cheapest per
    row in the backend's cost model, if cheaper per row than ``plan``; else None.  On Lattigo a
    packed plan may take its rows in up to `MAX_PACKED_IN_CTS` input ciphertexts (``in_cts``: a
    lane of S / T slots then holds a slice of each row, so T is not bounded by the row's width)."""
    cm = offload_costs(None, backend)
    best, best_cost = None, plan.cost(cm)
    max_in_cts = MAX_PACKED_IN_CTS if backend == "lattigo" else 1
    t = 2
    while t <= tokens:
        try:
            p = plan_matmul(plan.d_out, plan.d_in, plan.slots, has_bias=plan.has_bias, splits=plan.splits,
                            backend=backend, tokens=t, max_in_cts=max_in_cts)
        except HEError:
            break  # does not fit T rows: nor more
        if p.cost(cm) / t < best_cost:
            best, best_cost = p, p.cost(cm) / t
        t *= 2
    return best


def rotation_steps(plans: Sequence[MatmulPlan]) -> list[int]:
    """Every rotation step any plan needs (the Galois keys a client creates)."""
    return sorted({s for p in plans for s in p.rotation_steps})


class _Counters:
    """One HEOpCounter per operator class."""

    def __init__(self):
        self.by_class: dict[str, HEOpCounter] = defaultdict(HEOpCounter)

    def he_ops(self) -> dict[str, dict[str, int]]:
        out = {}
        for op_class, c in self.by_class.items():
            snap = c.snapshot()
            snap.pop("server_seconds", None)
            out[op_class] = {k: int(v) for k, v in snap.items() if v}
        return out


class SessionKeys(_Counters):
    """A session's public key material on the server, and its op counters.

    With a worker pool the keys live in the workers and ``pool_session`` is
    their handle (``galois_keys`` is None)."""

    def __init__(self, galois_keys, pool_session=None, ring_switch=None, input_switch=None):
        super().__init__()
        self.galois_keys = galois_keys
        self.pool_session = pool_session
        self.ring_switch = ring_switch  # Lattigo: the client's half-ring key (None: full-ring results)
        self.input_switch = input_switch  # Lattigo: the client's half-ring input key (real-input plans)

    def release(self) -> None:
        """Drop the key material (in the workers too); idempotent."""
        self.galois_keys = None
        self.ring_switch = None
        self.input_switch = None
        ps, self.pool_session = self.pool_session, None
        if ps is not None:
            ps.close()


def input_parts(d_in: int, has_bias: bool, slots: int, real_input: bool = False) -> list[slice]:
    """Column slices of a matrix whose input is too wide for one ciphertext.

    One ciphertext packs at most ``slots`` complex inputs (two reals each) and
    the packing needs room for output rows as well, so an input wider than
    ``slots`` reals (half the slots in complex inputs; ``slots`` / 2 reals with
    ``real_input``, one real per slot) is cut into equal parts,
    each evaluated as its own product; the client adds the parts' results
    (e.g. LLaMA-7B's down projection, d_in = 11008, is three parts).
    """
    if real_input:
        slots //= 2
    n_parts = -(-(d_in + int(has_bias)) // slots)
    size = -(-d_in // n_parts)
    return [slice(i, min(d_in, i + size)) for i in range(0, d_in, size)]


class ServerEngine:
    """Plans and encodes every projection group once; evaluates requests.

    A group is one or more *parts* (column slices, see :func:`input_parts`),
    each a planned, encoded matrix; the bias goes with the first part.
    """

    def __init__(
        self,
        groups: Sequence[LinearGroup],
        server_linears: dict,
        params=OFFLOAD_CKKS,
        progress=None,
        workers: int = 1,
        he_backend: str = "seal",
        prefill_tokens: int | None = None,
        half_ring: bool | str | None = None,
    ):
        """``prefill_tokens`` T (None: `prefill_tokens_from_env`): each group of one input part
        also gets a plan packing T token rows per ciphertext (`packed_plan`), served to a
        prefill's ``linear`` requests marked ``packed``; 1, or the SEAL worker pool: none.
        ``half_ring`` (Lattigo only; a mode of `half_ring_mode`, None: ``$CIPHERLM_OFFLOAD_HALF_RING``,
        default "inputs"): "inputs" plans every one-row group with real inputs
        (`cipherlm.he.matmul.plan_matmul` ``real_input``) and needs the client's input
        switching key; "inputs" and "results" offer half-ring results
        (`cipherlm.he.matmul.apply`'s ``ring_switch_key``) to clients that send a
        ring-switching key of the kind the welcome names."""
        if he_backend not in OFFLOAD_BACKENDS:
            raise HEError(f"unknown offload HE backend {he_backend!r}; known: {OFFLOAD_BACKENDS}")
        self.params = params
        self.he_backend = he_backend
        self.ctx = make_context(params, he_backend)
        self.groups = list(groups)
        self.workers = max(1, int(workers))
        mode = half_ring_mode(half_ring) if he_backend == "lattigo" else "off"
        self.half_ring = mode != "off"
        self.real_inputs = mode == "inputs"
        # Lattigo: the workers are goroutines inside one native call per request (baby steps
        # shared, not repeated per worker): its plans are those of one worker
        plan_workers = self.workers if he_backend == "seal" else 1
        self.pool = None
        self.parts: list[list[int]] = []  # group -> indices into self.plans / encoded
        self.plans = []
        part_weights = []
        for g in self.groups:
            Ws = [server_linears[n][0] for n in g.names]
            bs = [server_linears[n][1] for n in g.names]
            has_bias = any(b is not None for b in bs)
            ids = []
            for k, cols in enumerate(input_parts(g.d_in, has_bias, self.ctx.slots, self.real_inputs)):
                part_bs = bs if k == 0 else [None] * len(bs)
                plan = plan_matmul(
                    g.d_out, cols.stop - cols.start, self.ctx.slots,
                    has_bias=k == 0 and has_bias, splits=g.d_outs, workers=plan_workers,
                    backend=he_backend, real_input=self.real_inputs,
                )
                ids.append(len(self.plans))
                self.plans.append(plan)
                part_weights.append(([W[:, cols] for W in Ws], part_bs))
            self.parts.append(ids)
        total = sum(p.n_blocks * p.m for p in self.plans)
        offset = 0
        self.encoded = []
        if self.workers > 1 and he_backend == "seal":
            from cipherlm.he.parallel import ApplyPool

            self.pool = ApplyPool(params, self.workers)
            try:
                for pid, (plan, (Ws, bs)) in enumerate(zip(self.plans, part_weights)):
                    self.pool.add_matrix(pid, Ws, bs, plan)
                    offset += plan.n_blocks * plan.m
                    if progress is not None:
                        progress(offset, total)
            except BaseException:
                self.pool.close()
                raise
        else:
            for plan, (Ws, bs) in zip(self.plans, part_weights):
                report = None if progress is None else (lambda done, _t, off=offset: progress(off + done, total))
                enc = encode_group(self.ctx, Ws, bs, plan=plan, progress=report)
                if he_backend == "lattigo":
                    enc.workers = self.workers
                self.encoded.append(enc)
                offset += plan.n_blocks * plan.m
        # prefill: several token rows per ciphertext (in process only, groups of one part)
        self.prefill_tokens = prefill_tokens_from_env(prefill_tokens) if self.pool is None else 1
        self.packed_plans: list[MatmulPlan] = []
        self.packed_encoded = []
        self.packed_of: list[int] = []  # group -> index into packed_plans, -1: rows one by one
        compress = os.environ.get(PACK_COMPRESS_ENV, "1").strip() != "0"
        for g, ids in zip(self.groups, self.parts):
            # (not the LM head: a decoder's prefill sends it its last row only)
            pp = packed_plan(self.plans[ids[0]], self.prefill_tokens, he_backend) \
                if len(ids) == 1 and g.op_class != "lm_head" else None
            if pp is None:
                self.packed_of.append(-1)
                continue
            Ws, bs = part_weights[ids[0]]
            self.packed_of.append(len(self.packed_plans))
            self.packed_plans.append(pp)
            enc = encode_group(self.ctx, Ws, bs, plan=pp, compress=compress)
            if he_backend == "lattigo":
                enc.workers = self.workers
            self.packed_encoded.append(enc)
        self.steps = rotation_steps(self.plans + self.packed_plans)

    @property
    def plaintext_bytes(self) -> int:
        if self.pool is not None:
            return self.pool.plaintext_bytes
        return sum(e.nbytes for e in self.encoded) + sum(e.nbytes for e in self.packed_encoded)

    def _packed_setup(self) -> dict:
        if not self.packed_plans:
            return {}  # no packing: the welcome is as it was
        return {"packed": {"tokens": self.prefill_tokens, "plans": [p.to_dict() for p in self.packed_plans],
                           "groups": list(self.packed_of)}}

    def public_setup(self) -> dict:
        """What a client needs to talk to this engine (nothing secret: params and plans).
        ``he_backend`` only when it is not SEAL (a SEAL welcome stays as it was); the
        parameter blob is the backend's own (`HEBackend.params_to_bytes`)."""
        if self.he_backend == "seal":
            return {
                "he_params": params_to_bytes(self.params),
                "plans": [p.to_dict() for p in self.plans],
                "parts": self.parts,
                "rotation_steps": self.steps,
                **self._packed_setup(),
            }
        return {
            "he_backend": self.he_backend,
            "he_params": offload_params_to_bytes(self.params, self.he_backend),
            "plans": [p.to_dict() for p in self.plans],
            "parts": self.parts,
            "rotation_steps": self.steps,
            **({"half_ring_results": "even" if self.real_inputs else True} if self.half_ring else {}),
            **self._packed_setup(),
        }

    def load_client_keys(self, blob, ring_switch_key=None, input_switch_key=None) -> SessionKeys:
        """A session's keys: the Galois keys, and (Lattigo, when this engine offers half-ring
        results) the client's optional ring-switching key, of the kind the welcome names; with
        real-input plans the client's input switching key, required.  A key not offered is
        refused."""
        if not isinstance(blob, (bytes, bytearray)):
            raise HEError("galois_keys must be bytes")
        from cipherlm.he.backend import get_backend

        rsk = isk = None
        if ring_switch_key is not None:
            if not self.half_ring:
                raise HEError("this server does not offer half-ring results: no ring_switch_key expected")
            if not isinstance(ring_switch_key, (bytes, bytearray)):
                raise HEError("ring_switch_key must be bytes")
            rsk = get_backend("lattigo").ring_switch_key_from_bytes(
                self.ctx, bytes(ring_switch_key), result_ring_kind(self.real_inputs))
        if self.real_inputs:
            if input_switch_key is None:
                raise HEError("this server's plans take half-ring inputs: the keys message must carry input_switch_key")
            if not isinstance(input_switch_key, (bytes, bytearray)):
                raise HEError("input_switch_key must be bytes")
            isk = get_backend("lattigo").input_switch_key_from_bytes(self.ctx, bytes(input_switch_key))
        elif input_switch_key is not None:
            raise HEError("this server's plans take full-ring inputs: no input_switch_key expected")
        if self.pool is not None:
            return SessionKeys(None, self.pool.open_session(bytes(blob)))
        return SessionKeys(load_galois_keys(self.ctx, bytes(blob), self.plans + self.packed_plans), ring_switch=rsk,
                           input_switch=isk)

    def apply(self, gid: int, ct: bytes, keys: SessionKeys, packed: bool = False) -> bytes:
        """One token row of group ``gid``: one ciphertext per part in, one result per part out.
        ``packed``: the ciphertext packs up to ``prefill_tokens`` rows (the group's packed plan;
        an `HEError` when the group has none)."""
        if not isinstance(ct, (bytes, bytearray)):
            raise HEError("a ciphertext must be bytes")
        if not 0 <= gid < len(self.groups):
            raise HEError(f"unknown group {gid}")
        counter = keys.by_class[self.groups[gid].op_class]
        if packed:
            k = self.packed_of[gid] if self.packed_plans else -1
            if k < 0:
                raise HEError(f"group {gid} has no packed prefill plan")
            if keys.galois_keys is None:
                raise HEError("session keys were released")
            return apply(self.packed_encoded[k], bytes(ct), keys.galois_keys, counter=counter)
        ids = self.parts[gid]
        cts = [bytes(ct)] if len(ids) == 1 else unpack_cts(bytes(ct), expected=len(ids))
        out = [self._apply_part(pid, c, keys, counter) for pid, c in zip(ids, cts)]
        return out[0] if len(ids) == 1 else pack_cts(out)

    def _apply_part(self, pid: int, ct: bytes, keys: SessionKeys, counter) -> bytes:
        if self.pool is not None:
            if keys.pool_session is None:
                raise HEError("session keys were released")
            return self.pool.apply(pid, ct, keys.pool_session, counter=counter)
        if keys.galois_keys is None:
            raise HEError("session keys were released")
        return apply(self.encoded[pid], ct, keys.galois_keys, counter=counter, ring_switch_key=keys.ring_switch,
                     input_switch_key=keys.input_switch)

    def release(self, keys: SessionKeys) -> None:
        """A session ended: drop its Galois keys (in the workers too)."""
        keys.release()

    def close(self) -> None:
        """Shut the worker pool down (no-op in process)."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> ServerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ClientEngine(_Counters):
    """Client side: keys, encryption of inputs, decryption of results."""

    def __init__(self, welcome: dict, groups: Sequence[LinearGroup]):
        super().__init__()
        he_backend = welcome.get("he_backend", "seal")
        if he_backend not in OFFLOAD_BACKENDS:
            raise HEError(f"the server's HE backend {he_backend!r} is not one this client runs {OFFLOAD_BACKENDS}")
        # the backend's own blob and parser: a SEAL blob announced as Lattigo's is refused, and back
        params = offload_params_from_bytes(welcome["he_params"], he_backend)
        check_security(params)  # never use parameters a server proposes below 128 bits
        self.he_backend = he_backend
        self.ctx = make_context(params, he_backend)
        self.keys = client_keys(self.ctx)
        self.groups = list(groups)
        self.plans = [MatmulPlan.from_dict(d) for d in welcome["plans"]]
        real = {p.real_input for p in self.plans}
        if len(real) > 1 or (True in real and he_backend != "lattigo"):
            raise HEError("the server's plans mix real and complex inputs, or take real inputs off Lattigo")
        real_inputs = True in real
        # half-ring results (Lattigo): a secret of the half ring and the key the server needs;
        # real-input plans: a secret of the half ring the inputs are encrypted in, and its key
        self.half_keys, self.ring_switch_key = None, None
        self.input_keys, self.input_switch_key = None, None
        hr = welcome.get("half_ring_results")
        if hr and he_backend == "lattigo":
            kind = "even" if hr == "even" else "real"
            if (kind == "even") != real_inputs:
                raise HEError("the server's half-ring results do not match its plans' inputs")
            self.half_keys, self.ring_switch_key = self.keys.ring_switch_key(kind)
        if real_inputs:
            self.input_keys, self.input_switch_key = self.keys.input_switch_key()
        self.parts = [list(map(int, ids)) for ids in welcome.get("parts", [[i] for i in range(len(self.plans))])]
        if len(self.parts) != len(self.groups) or sorted(i for ids in self.parts for i in ids) != list(range(len(self.plans))):
            raise HEError("the server sent parts that do not match its groups and plans")
        for g, ids in zip(self.groups, self.parts):
            plans = [self.plans[i] for i in ids]
            cols = [c for c in input_parts(g.d_in, plans[0].has_bias, self.ctx.slots, real_inputs)]
            if len(cols) != len(plans) or any(
                (p.d_in, p.d_out, p.slots) != (c.stop - c.start, g.d_out, self.ctx.slots) for p, c in zip(plans, cols)
            ):
                raise HEError(f"plans for group {g.names} do not match its shape")
        self.columns = [input_parts(g.d_in, self.plans[ids[0]].has_bias, self.ctx.slots, real_inputs)
                        for g, ids in zip(self.groups, self.parts)]

        # the prefill's packed plans (absent: every row its own ciphertext)
        self.prefill_tokens = 1
        self.packed_plans: list[MatmulPlan] = []
        self.packed_of = [-1] * len(self.groups)
        pk = welcome.get("packed")
        if pk is not None:
            self.prefill_tokens = int(pk["tokens"])
            self.packed_plans = [MatmulPlan.from_dict(d) for d in pk["plans"]]
            self.packed_of = [int(k) for k in pk["groups"]]
            if len(self.packed_of) != len(self.groups) or sorted(k for k in self.packed_of if k >= 0) != list(
                    range(len(self.packed_plans))):
                raise HEError("the server's packed plans do not match its groups")
            for g, ids, k in zip(self.groups, self.parts, self.packed_of):
                if k < 0:
                    continue
                p, one = self.packed_plans[k], self.plans[ids[0]]
                if len(ids) != 1 or not 2 <= p.tokens <= self.prefill_tokens or (
                        p.d_in, p.d_out, p.slots, p.has_bias) != (g.d_in, g.d_out, self.ctx.slots, one.has_bias):
                    raise HEError(f"packed plan for group {g.names} does not match its shape")

    def packed_rows(self, gid: int) -> int:
        """Token rows per packed prefill ciphertext of group ``gid`` (1: rows one by one)."""
        k = self.packed_of[gid]
        return self.packed_plans[k].tokens if k >= 0 else 1

    def galois_keys_blob(self) -> bytes:
        return self.keys.galois_keys_bytes(rotation_steps(self.plans + self.packed_plans))

    def keys_message(self) -> dict:
        """The session's ``keys`` message: the Galois keys, and the half-ring keys the welcome
        asked for (``ring_switch_key`` when the server offered half-ring results,
        ``input_switch_key`` when its plans take half-ring inputs)."""
        msg = {"type": "keys", "galois_keys": self.galois_keys_blob()}
        if self.ring_switch_key is not None:
            msg["ring_switch_key"] = self.ring_switch_key
        if self.input_switch_key is not None:
            msg["input_switch_key"] = self.input_switch_key
        return msg

    def encrypt_packed(self, gid: int, rows: np.ndarray) -> bytes:
        """Up to `packed_rows` token rows of group ``gid`` in one ciphertext (its packed plan)."""
        counter = self.by_class[self.groups[gid].op_class]
        return encrypt_input(self.keys, np.asarray(rows, dtype=np.float64), self.packed_plans[self.packed_of[gid]],
                             counter=counter)

    def decrypt_packed(self, gid: int, blob: bytes, n_rows: int) -> np.ndarray:
        """The group's outputs for the first ``n_rows`` rows of a packed result, (n_rows, d_out)."""
        if not isinstance(blob, (bytes, bytearray)):
            raise HEError("a result must be bytes")
        counter = self.by_class[self.groups[gid].op_class]
        y = decrypt_output(self.keys, bytes(blob), self.packed_plans[self.packed_of[gid]], counter=counter)
        return y[:n_rows]

    def encrypt(self, gid: int, x: np.ndarray) -> bytes:
        counter = self.by_class[self.groups[gid].op_class]
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        cts = [encrypt_input(self.keys, x[cols], self.plans[pid], counter=counter, input_keys=self.input_keys)
               for pid, cols in zip(self.parts[gid], self.columns[gid])]
        return cts[0] if len(cts) == 1 else pack_cts(cts)

    def decrypt(self, gid: int, blob: bytes) -> np.ndarray:
        """The group's outputs; the chunks are summed by the server, the input parts
        (if any, see :func:`input_parts`) here."""
        if not isinstance(blob, (bytes, bytearray)):
            raise HEError("a result must be bytes")
        counter = self.by_class[self.groups[gid].op_class]
        ids = self.parts[gid]
        blobs = [bytes(blob)] if len(ids) == 1 else unpack_cts(bytes(blob), expected=len(ids))
        return sum(decrypt_output(self.keys, b, self.plans[pid], counter=counter, half_keys=self.half_keys)
                   for pid, b in zip(ids, blobs))

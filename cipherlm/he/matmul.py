"""Encrypted activation x plaintext weight product, y = W x (+ b), CKKS.

Client-aided offload mode (``fhe_offload_llama_003``, sections 4-5): the client
holds the keys and encrypts one token's activation row x; the server holds W
(d_out, d_in) in the clear and returns Enc(W x + b); the client decrypts.
The packing is the diagonal method (Halevi-Shoup) with baby-step giant-step
rotations, as used for ct-pt MatMul by BLB (``blb_004``, BSGS section), plus:

* **complex packing** -- CKKS slots are complex.  x_c[j] = x[2j] + i x[2j+1],
  w_c[r, j] = W[r, 2j] - i W[r, 2j+1]; Re(sum_j w_c[r,j] x_c[j]) = (W x)[r].
  n = ceil(d_in / 2) complex inputs: half the slots, plaintexts and products.
  The imaginary part is junk the client drops (weights are not protected
  from the client in this mode).
* **input-chunk blocks** -- the n complex inputs are cut into c chunks of
  m = ceil(n / c), c a power of two; slot block a (stride B = S / c for c > 1,
  B = R + m for c = 1; R + m <= B) holds R output rows for chunk a.  The
  client lays out slot a*B + u = x_c[a*m + (u mod m)], u < B (it knows x, so
  any layout is free); diagonal k < m has, at slot a*B + r,
  w_c[r, a*m + (r+k) mod m].  sum_k diag_k * rot(x, k) leaves at a*B + r the
  partial dot product of chunk a.  **Chunk sum on the server** (before
  sending): y += rot(y, 2^i B) for i < log2 c.  Because c B = S exactly,
  rotations are cyclic over the c blocks and every block ends up holding the
  *whole* sum, sum_a Y_a (block b gets sum_a Y_{(a+b) mod c}); slots
  a*B + r, r >= R, carry zero weights and stay zero.  So a decrypted result
  holds only the outputs (c identical copies), never a chunk's partial sum
  (security review finding 8: the first version sent the c blocks and let the
  client add them, c R partial sums against R outputs, 2-6x more linear
  equations in W).  The log2 c extra rotations run at one prime after the
  rescale (~0.7 ms each); their steps are in ``rotation_steps``.
  d_out is split into ``n_blocks`` output ciphertexts of R rows when it does
  not fit.  What a decrypted result still carries besides the outputs: the
  imaginary part of each output slot, sum_j W[r,2j] x[2j+1] - W[r,2j+1] x[2j]
  (one more linear form in W per output; removing it needs a conjugation key,
  which `he.keys.ClientKeys` does not make), and CKKS noise that depends on W
  (no flooding in this mode); weights are not protected against the client
  in offload mode anyway (docs/offload.md).
* **real inputs** (``MatmulPlan.real_input``, Lattigo's default since 2026-11-30; docs/offload.md
  "Real inputs in the half ring") -- the complex packing moves from the inputs to the outputs:
  the client lays out x real, one value per slot (n = d_in (+1) real inputs), and encrypts it in
  the conjugate-invariant ring of degree N/2 (half the bytes up; the server unfolds it,
  `LattigoBackend.real_to_complex`); each diagonal carries two rows, w_c[r', j] = W[2r', j] +
  i W[2r'+1, j], so result slot r' holds y[2r'] + i y[2r'+1] (``rows`` counts such slot rows,
  2 ``rows`` outputs per result).  Same slot-products per output as complex inputs.  The plan
  has c >= 2 chunk copies, so every result's slots have period S / c <= S / 2: its message is
  even in X and it goes down in the standard ring of degree N/2 (`LattigoBackend.ring_switch`,
  kind "even"), N/4 complex slots = N/2 outputs, half the bytes.  A decrypted result then holds
  the outputs only: no imaginary linear forms.
* **BSGS** -- m <= g*b; baby steps rot(x, j), j < g, once per request and
  shared by all output blocks; giant steps sum_i rot(sum_j diag'_{ig+j} *
  rot(x, j), ig) with diag' = rot(diag, -ig) pre-rotated at encode time.
* **bias** -- folded into the product: the client appends a constant 1 to x
  and the server appends b as an extra column of W (no per-request encode).
* **packed tokens** (``MatmulPlan.tokens`` T > 1, the offload prefill) -- each
  chunk block's B = S / c slots are cut into T lanes of L = B / T slots
  (R + m <= L); token row t sits in lane t of every block (slot a B + t L + u =
  x_t,c[a m + (u mod m)]) and every diagonal holds the same weights in each lane.
  Rotations by k < m stay inside a lane and the chunk sum's steps (multiples of
  B) keep the lane, so one request's baby steps, giant steps and chunk sum serve
  all T rows; lane t of the result is row t's one-row result (outputs, their
  imaginary forms, zeros), a missing row's lane is all zero.  The same
  evaluation code (SEAL's `evaluate_blocks`, Lattigo's `clg_bsgs_eval`) runs it:
  only the diagonals and the layout differ.  Costs per ciphertext are those of
  the plan at S / T slots; the plaintexts are about T times those of a
  one-row plan of the same matrix (each holds the weights T times).

Per request (one token, one matrix group):

    rotations      (g - 1) + n_blocks * (b - 1) + n_blocks * log2(c)  (chunk sum)
    multiply_plain n_blocks * m      (all-zero diagonals are skipped)
    add            n_blocks * (m - 1) (+ giant-step adds, counted)
    rescale        n_blocks
    bytes up       1 seeded ciphertext at 2 primes   (~116 kB, N = 8192)
    bytes down     n_blocks ciphertexts at 1 prime   (~131 kB each)

The plan (c, g, b, n_blocks) is chosen per matrix by ``plan_matmul`` from a
cost model (measured op times and a per-byte network cost).  Measured numbers
for SmolLM2-135M's projections are in docs/he_matmul.md.

Scales: the client picks Delta_x = 2^45 / max|x| per request; the server picks
Delta_w = 2^w / max|W| once, with w = min(40, 96 - 45 - ceil(log2(2n))) so that
|sum| * Delta_x * Delta_w <= 2n * 2^(45+w) <= 2^96 < q0*q1/2 never wraps (and after
the rescale by q1 (~2^40) the result still fits q0 (60 bits)).  The result is
rescaled before sending so the down-link ciphertext has one prime.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
import time
from typing import Callable, Sequence

import numpy as np
import tenseal.sealapi as seal

from . import serialize
from .backend import DEFAULT_BACKEND, OffloadCostModel, get_backend
from .context import HEContext
from .errors import HEError

#: the default HE backend of this engine (SEAL, called directly); its cost model's
#: ``offload`` constants are the planner's default.  ``"lattigo"`` (`OFFLOAD_BACKENDS`) runs
#: the same plans on Lattigo: a context from `make_context(params, "lattigo")` selects it
#: in every function below (`LattigoEncodedMatrix`, one native call per request)
OFFLOAD_BACKEND = DEFAULT_BACKEND
#: the HE backends the offload matmul runs on
OFFLOAD_BACKENDS = ("seal", "lattigo")
#: what ``cipherlm serve --mode offload --he-backend`` and ``cipherlm inspect --he-backend`` take
#: (`resolve_offload_backend`): "auto", the default, is Lattigo where its library is built, else SEAL
OFFLOAD_BACKEND_CHOICES = ("auto",) + OFFLOAD_BACKENDS


class OffloadBackendUnavailable(HEError):
    """An offload HE backend asked for by name whose library is not there (`resolve_offload_backend`)."""


def resolve_offload_backend(name: str | None = "auto") -> tuple[str, str]:
    """The offload HE backend that ``name`` stands for, and why: ``(backend, reason)``.

    ``"auto"`` (or None): ``"lattigo"`` when its library is built and loads
    (`lattigo_backend.available`), else ``"seal"``, the reason then saying why Lattigo is
    not there and naming ``make lattigo``.  ``"seal"`` / ``"lattigo"``: that backend; Lattigo
    whose library is not built or does not load is an `HEError` naming ``make lattigo``."""
    name = "auto" if name is None else str(name).strip().lower()
    if name not in OFFLOAD_BACKEND_CHOICES:
        raise HEError(f"unknown offload HE backend {name!r}; choose one of {OFFLOAD_BACKEND_CHOICES}")
    if name == "seal":
        return "seal", "asked for"
    from . import lattigo_backend  # noqa: F401 (registers "lattigo"; not at import: see make_context)

    why = lattigo_backend.unavailable_reason()
    if why is None:
        return "lattigo", "asked for" if name == "lattigo" else "auto: the Lattigo library is built"
    if "make lattigo" not in why:
        why = f"{why}; {lattigo_backend.BUILD_HINT}"
    if name == "lattigo":
        raise OffloadBackendUnavailable(f"the Lattigo HE backend is not available: {why}")
    return "seal", f"auto: the Lattigo library is not available ({why})"


def make_context(params, backend: str = OFFLOAD_BACKEND):
    """The offload matmul's context for ``params`` on HE backend ``backend`` ("seal": an
    `HEContext`; "lattigo": a `lattigo_backend.LattigoContext`, `HEError` when the library
    is not built)."""
    if backend == "seal":
        return HEContext(params)
    if backend == "lattigo":
        from . import lattigo_backend  # noqa: F401 (registers "lattigo"; not at import: test_he_backend's BFV suite)

        return get_backend("lattigo").context(params)
    raise HEError(f"the offload matmul runs on {OFFLOAD_BACKENDS}, not {backend!r}")


def offload_params_to_bytes(params, backend: str = OFFLOAD_BACKEND) -> bytes:
    """The parameter blob of backend ``backend`` (what the welcome carries)."""
    if backend == "seal":
        return serialize.params_to_bytes(params)
    if backend not in OFFLOAD_BACKENDS:
        raise HEError(f"the offload matmul runs on {OFFLOAD_BACKENDS}, not {backend!r}")
    from . import lattigo_backend  # noqa: F401 (registers "lattigo")

    return get_backend(backend).params_to_bytes(params)


def offload_params_from_bytes(data: bytes, backend: str = OFFLOAD_BACKEND):
    """Parse and security-check a server's parameter blob with backend ``backend``'s own parser
    (a blob of the other backend is refused: `HEError`)."""
    if backend == "seal":
        return serialize.params_from_bytes(data)
    if backend not in OFFLOAD_BACKENDS:
        raise HEError(f"the offload matmul runs on {OFFLOAD_BACKENDS}, not {backend!r}")
    from . import lattigo_backend  # noqa: F401 (registers "lattigo")

    return get_backend(backend).params_from_bytes(data)


def backend_of(ctx) -> str:
    """The HE backend of an offload context ("seal" or "lattigo")."""
    mod = sys.modules.get("cipherlm.he.lattigo_backend")
    return "lattigo" if mod is not None and isinstance(ctx, mod.LattigoContext) else "seal"


def client_keys(ctx):
    """A fresh secret key for the client side (`keys.ClientKeys` for SEAL, the backend's
    `SecretKeys` for Lattigo): ``encrypt_seeded``, ``decrypt``, ``galois_keys_bytes``."""
    if backend_of(ctx) == "lattigo":
        return get_backend("lattigo").keygen(ctx)
    from .keys import ClientKeys

    return ClientKeys(ctx)

# --------------------------------------------------------------------------- counters


@dataclasses.dataclass
class HEOpCounter:
    """Homomorphic operation counts and bytes, for reports."""

    rotations: int = 0
    multiply_plain: int = 0
    add: int = 0
    rescale: int = 0
    ring_switch: int = 0  # results sent in the half ring (`apply`'s ``ring_switch_key``)
    input_switch: int = 0  # half-ring inputs taken to the full ring (`apply`'s ``input_switch_key``)
    encode: int = 0
    encrypt: int = 0
    decrypt: int = 0
    bytes_in: int = 0  # client -> server ciphertext bytes
    bytes_out: int = 0  # server -> client ciphertext bytes
    server_seconds: float = 0.0

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(0))

    def snapshot(self) -> dict:
        return dataclasses.asdict(self)

    def __iadd__(self, other: HEOpCounter) -> HEOpCounter:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


#: process-wide counter every call also updates (callers may pass their own too)
GLOBAL_COUNTER = HEOpCounter()


def _count(counter: HEOpCounter | None, **kw) -> None:
    for c in (GLOBAL_COUNTER, counter):
        if c is not None:
            for k, v in kw.items():
                setattr(c, k, getattr(c, k) + v)


# --------------------------------------------------------------------------- cost model


#: the matmul's machine constants are the HE backend's (`HEBackend.cost_model.offload`,
#: `he.backend.OffloadCostModel`; was defined here, the name stays)
CostModel = OffloadCostModel


def offload_costs(cost_model: CostModel | None = None, backend: str | None = None) -> CostModel:
    """``cost_model`` if given, else the offload constants of HE backend ``backend``
    (default `OFFLOAD_BACKEND`, the backend this engine runs on)."""
    if cost_model is not None:
        return cost_model
    if backend == "lattigo":
        from . import lattigo_backend  # noqa: F401 (registers "lattigo"; its costs need no library)
    return get_backend(backend or OFFLOAD_BACKEND).cost_model.offload


def result_ring_kind(real_input: bool) -> str:
    """`MatmulPlan.result_ring` of plans with or without real inputs."""
    return "even" if real_input else "real"


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
    """Packing of one (d_out, d_in) matrix (bias folded in when ``has_bias``)."""

    d_out: int
    d_in: int
    has_bias: bool
    slots: int
    n: int  # complex inputs (real ones with ``real_input``; bias column included)
    c: int  # input chunks
    m: int  # chunk size = number of diagonals
    rows: int  # output slot rows per output ciphertext (R; two outputs each with ``real_input``)
    n_blocks: int  # output ciphertexts
    g: int  # baby steps
    b: int  # giant steps
    splits: tuple[int, ...] = ()  # group member sizes (sum = d_out), () = single
    tokens: int = 1  # token rows packed per ciphertext (T; > 1: the prefill's packed plans)
    real_input: bool = False  # inputs real (the half ring), two output rows per slot (see the module doc)
    in_cts: int = 1  # input ciphertexts (P), each of c chunks of m inputs; the server sums their products

    def __post_init__(self):
        if self.c < 1 or self.c & (self.c - 1):
            raise HEError(f"a plan's chunk count must be a power of two (the server sums the chunks), got {self.c}")
        if self.tokens < 1 or self.tokens & (self.tokens - 1):
            raise HEError(f"a plan's token count must be a power of two, got {self.tokens}")
        if self.rows + self.m > self.lane:
            raise HEError("plan does not fit its slots")
        if self.real_input and self.c < 2:
            raise HEError("a real-input plan needs c >= 2 chunk copies (its results fold to the half ring)")
        if self.in_cts < 1 or self.in_cts * self.c * self.m < self.n or (self.in_cts - 1) * self.c * self.m >= self.n:
            raise HEError(f"{self.in_cts} input ciphertexts of {self.c} x {self.m} inputs for {self.n} inputs")

    @property
    def result_ring(self) -> str:
        """The half ring its results fold to (`LattigoContext.half_ring` kind): "even" for a
        real-input plan (two outputs per slot), else "real" (the real parts)."""
        return result_ring_kind(self.real_input)

    @property
    def out_rows(self) -> int:
        """Outputs per result ciphertext: R, or 2 R with real inputs (two per slot)."""
        return 2 * self.rows if self.real_input else self.rows

    @property
    def stride(self) -> int:
        """Slot block size B: S / c when there are chunks (so c B = S and the chunk
        sum's rotations are cyclic over the blocks), else R + m (S with packed tokens)."""
        if self.tokens > 1:
            return self.slots // self.c
        return self.slots // self.c if self.c > 1 else self.rows + self.m

    @property
    def lane(self) -> int:
        """Slots of one token inside a block: L = B / T with packed tokens (token t of
        chunk block a at slots a B + t L + u, u < L; R + m <= L), else B."""
        if self.tokens > 1:
            return self.slots // (self.c * self.tokens)
        return self.slots // self.c if self.c > 1 else self.slots

    @property
    def chunk_steps(self) -> list[int]:
        """Rotation steps of the server-side chunk sum: B, 2B, ..., (c/2) B."""
        return [self.stride << i for i in range(self.c.bit_length() - 1)]

    @property
    def rotation_steps(self) -> list[int]:
        baby = list(range(1, self.g))
        giant = [i * self.g for i in range(1, self.b) if i * self.g < self.m]
        return sorted(set(baby + giant + self.chunk_steps))

    def op_counts(self) -> dict:
        n_giant = len([i for i in range(1, self.b) if i * self.g < self.m])
        n_chunk = len(self.chunk_steps)
        return {
            "rotations": self.in_cts * (self.g - 1) + self.n_blocks * (n_giant + n_chunk),
            "giant_rotations": self.n_blocks * n_giant,
            "chunk_rotations": self.n_blocks * n_chunk,
            "multiply_plain": self.n_blocks * self.in_cts * self.m,
            "rescale": self.n_blocks * (n_giant + 1),
            "plaintexts": self.n_blocks * self.in_cts * self.m,
            "ciphertexts_in": self.in_cts,
            "ciphertexts_out": self.n_blocks,
        }

    def cost(
        self, cm: CostModel | None = None, ct_bytes_in: int = 116_000, ct_bytes_out: int = 118_000, workers: int = 1
    ) -> float:
        """Modelled seconds per request.  ``workers`` > 1: the critical path of the
        parallel apply (:mod:`cipherlm.he.parallel`), where every worker repeats the
        g-1 baby steps and does 1/workers of the giant steps and products.  ``cm``:
        default the offload constants of `OFFLOAD_BACKEND`'s cost model."""
        cm = offload_costs(cm)
        o = self.op_counts()
        baby, giant, mul, rescale = self.in_cts * (self.g - 1), o["giant_rotations"], o["multiply_plain"], o["rescale"]
        chunk = o["chunk_rotations"]
        if workers > 1:
            giant, mul, rescale = giant / workers, mul / workers, rescale / workers
            # every worker chunk-sums its own partial of each block it touches
            chunk = len(self.chunk_steps) * -(-self.n_blocks // workers)
        return (
            baby * cm.rotate
            + (giant + chunk) * cm.rotate_low
            + chunk * cm.add
            + mul * (cm.multiply_plain + cm.add)
            + rescale * cm.rescale
            + self.n_blocks * cm.decrypt_decode
            + (self.in_cts * ct_bytes_in + self.n_blocks * ct_bytes_out) * cm.byte
            + len(self.rotation_steps) * cm.galois_key_tiebreak
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["splits"] = list(self.splits)
        if self.tokens == 1:
            del d["tokens"]  # one-token plans are sent as before
        if not self.real_input:
            del d["real_input"]
        if self.in_cts == 1:
            del d["in_cts"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MatmulPlan:
        d = dict(d)
        d["splits"] = tuple(d.get("splits", ()))
        return cls(**d)


def plan_matmul(
    d_out: int,
    d_in: int,
    slots: int = 4096,
    *,
    has_bias: bool = False,
    splits: Sequence[int] = (),
    cost_model: CostModel | None = None,
    max_chunks: int | None = None,
    workers: int = 1,
    backend: str | None = None,
    tokens: int = 1,
    real_input: bool = False,
    max_in_cts: int = 1,
) -> MatmulPlan:
    """Choose (P, c, g, b, n_blocks) minimising the cost model (per-worker critical path
    when ``workers`` > 1: fewer baby steps, see :mod:`cipherlm.he.parallel`).  The
    constants: ``cost_model`` if given, else those of HE backend ``backend`` (default
    `OFFLOAD_BACKEND`), ``get_backend(backend).cost_model.offload``.  ``tokens`` T > 1:
    a plan whose ciphertext packs T token rows (each block's S / c slots cut into T
    lanes of L = S / (c T) slots, R + m <= L; the cost is per ciphertext, i.e. T rows).
    ``real_input``: a plan taking real inputs, two output rows per slot, c >= 2 (module doc).
    ``max_in_cts``: the input may be cut into up to that many ciphertexts P (each c chunks of
    m inputs; Lattigo only, `LattigoBackend.bsgs_apply`): smaller m leaves room for more output
    rows in a lane, at P (g - 1) baby steps."""
    if d_out < 1 or d_in < 1:
        raise HEError(f"bad matrix shape ({d_out}, {d_in})")
    if tokens < 1 or tokens & (tokens - 1):
        raise HEError(f"tokens per ciphertext must be a power of two, got {tokens}")
    if max_in_cts < 1:
        raise HEError(f"max_in_cts must be >= 1, got {max_in_cts}")
    cost_model = offload_costs(cost_model, backend)
    if real_input:
        n, slot_rows, c_min = d_in + int(has_bias), -(-d_out // 2), 2
    else:
        n, slot_rows, c_min = (d_in + int(has_bias) + 1) // 2, d_out, 1
    best = None
    last_n_part = None
    for n_cts in range(1, max_in_cts + 1):
        n_part = -(-n // n_cts)  # inputs per ciphertext
        if n_part == last_n_part:
            continue  # the same split as fewer ciphertexts
        last_n_part = n_part
        c, last_m = c_min, None
        while c <= (max_chunks or n_part):  # powers of two: c B = S for the server's chunk sum
            m = -(-n_part // c)
            c_now, c = c, c * 2
            if m == last_m:
                continue  # same chunk size as a smaller c: no gain
            last_m = m
            r_max = slots // (c_now * tokens) - m
            if r_max < 1:
                break
            if (n_cts - 1) * c_now * m >= n:
                continue  # fewer ciphertexts hold these chunks
            n_blocks = -(-slot_rows // r_max)
            rows = -(-slot_rows // n_blocks)
            for g in range(1, m + 1):
                b = -(-m // g)
                if g > 1 and -(-m // (g - 1)) == b and g > b:
                    continue
                p = MatmulPlan(d_out, d_in, has_bias, slots, n, c_now, m, rows, n_blocks, g, b, tuple(splits), tokens,
                               real_input, n_cts)
                cost = p.cost(cost_model, workers=workers)
                if best is None or cost < best[0]:
                    best = (cost, p)
    if best is None:
        raise HEError(f"matrix ({d_out}, {d_in}) does not fit {slots} slots")
    return best[1]


# --------------------------------------------------------------------------- server: encode


@dataclasses.dataclass
class EncodedMatrix:
    """Server-side cache: every (pre-rotated) diagonal as an NTT-form Plaintext."""

    ctx: HEContext
    plan: MatmulPlan
    plaintexts: list[list[seal.Plaintext | None]]  # [block][k]
    weight_scale: float
    input_parms_id: list[int]

    @property
    def n_plaintexts(self) -> int:
        return sum(p is not None for blk in self.plaintexts for p in blk)

    @property
    def nbytes(self) -> int:
        """Memory of the cached plaintexts' coefficient data."""
        k = len(self.ctx.moduli_of(self.input_parms_id))
        return self.n_plaintexts * k * self.ctx.n * 8


def _complex_weights(W: np.ndarray, b: np.ndarray | None, real_input: bool = False) -> np.ndarray:
    """The complex matrix the diagonals are cut from: pairs of columns, w_c[r, j] = W[r, 2j] -
    i W[r, 2j+1] (complex inputs), or with ``real_input`` pairs of rows, w_c[r', j] = W[2r', j] +
    i W[2r'+1, j]; the bias as the last column either way."""
    W = np.asarray(W, dtype=np.float64)
    if b is not None:
        W = np.concatenate([W, np.asarray(b, dtype=np.float64).reshape(-1, 1)], axis=1)
    if real_input:
        if W.shape[0] % 2:
            W = np.concatenate([W, np.zeros((1, W.shape[1]))], axis=0)
        return W[0::2] + 1j * W[1::2]
    if W.shape[1] % 2:
        W = np.concatenate([W, np.zeros((W.shape[0], 1))], axis=1)
    return W[:, 0::2] - 1j * W[:, 1::2]


def weight_scale_bits(ctx: HEContext, n: int) -> int:
    xbits = ctx.params.input_scale_bits
    total = sum(math.log2(q) for q in ctx.coeff_moduli)
    return int(min(ctx.params.weight_scale_bits, math.floor(total) - 3 - xbits - math.ceil(math.log2(2 * n))))


def one_lane(plan: MatmulPlan) -> bool:
    """Whether the plan's diagonals repeat every lane (a packed plan with one chunk: period
    L = S / T in the slots), so that `diagonals` may give one lane of each."""
    return plan.tokens > 1 and plan.c == 1


def diagonals(plan: MatmulPlan, W: np.ndarray, b: np.ndarray | None = None, *, lane_only: bool = False) -> np.ndarray:
    """The pre-rotated diagonal slot vectors, complex (n_blocks, P m, S): input ciphertext p's
    m diagonals at p m (its inputs are columns p c m .. (p + 1) c m - 1 of the complex matrix).
    ``lane_only`` (a plan of `one_lane`): one period, (n_blocks, P m, L), the whole vectors being
    it repeated T times (the pre-rotations, by multiples of g < L, keep the period)."""
    Wc = _complex_weights(W, b, plan.real_input)
    p = plan
    if Wc.shape != (-(-p.d_out // 2) if p.real_input else p.d_out, p.n):
        raise HEError(f"weights {W.shape} do not match the plan ({p.d_out}, {p.d_in})")
    if lane_only and not one_lane(p):
        raise HEError("only a packed plan with one chunk has diagonals of one lane's period")
    per_ct = p.c * p.m
    return np.concatenate([_part_diagonals(p, Wc[:, k * per_ct:(k + 1) * per_ct], lane_only) for k in range(p.in_cts)],
                          axis=1)


def _part_diagonals(p: MatmulPlan, Wc: np.ndarray, lane_only: bool = False) -> np.ndarray:
    """`diagonals` of one input ciphertext, whose inputs are the (at most c m) columns of Wc."""
    Wp = np.zeros((p.n_blocks * p.rows, p.c * p.m), dtype=np.complex128)
    Wp[: Wc.shape[0], : Wc.shape[1]] = Wc
    r = np.arange(p.rows)
    k = np.arange(p.m)
    idx = (r[:, None] + k[None, :]) % p.m  # (R, m)
    out = np.zeros((p.n_blocks, p.m, p.lane if lane_only else p.slots), dtype=np.complex128)
    for o in range(p.n_blocks):
        Wo = Wp[o * p.rows : (o + 1) * p.rows].reshape(p.rows, p.c, p.m)
        D = np.take_along_axis(Wo, np.broadcast_to(idx[:, None, :], Wo.shape), axis=2)  # [r, a, k]
        if lane_only:  # one lane of the one chunk block
            out[o, :, : p.rows] = D[:, 0, :].T
        elif p.tokens > 1:  # the same weights in every token's lane of every chunk block
            V = out[o].reshape(p.m, p.c, p.tokens, p.lane)
            V[:, :, :, : p.rows] = D.transpose(2, 1, 0)[:, :, None, :]
        else:
            V = out[o, :, : p.c * p.stride].reshape(p.m, p.c, p.stride)
            V[:, :, : p.rows] = D.transpose(2, 1, 0)
        for kk in range(p.m):
            shift = (kk // p.g) * p.g
            if shift:
                out[o, kk] = np.roll(out[o, kk], shift)
    return out


@dataclasses.dataclass
class LattigoEncodedMatrix:
    """Server-side cache on the Lattigo backend: the same pre-rotated diagonals, encoded
    in Go (`lattigo_backend.LattigoBSGSMatrix`); `apply` evaluates a request in one native
    call with ``workers`` goroutines (hoisted baby steps)."""

    ctx: object
    plan: MatmulPlan
    matrix: object
    weight_scale: float
    n_plaintexts: int
    workers: int = 1

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes


def encode_matrix(
    ctx: HEContext,
    W: np.ndarray,
    b: np.ndarray | None = None,
    plan: MatmulPlan | None = None,
    *,
    splits: Sequence[int] = (),
    progress: Callable[[int, int], None] | None = None,
    counter: HEOpCounter | None = None,
    keep: Callable[[int, int], bool] | None = None,
    compress: bool = True,
) -> EncodedMatrix:
    """Server, once at start-up: encode every diagonal at the input level (NTT form).

    ``keep(block, k)``: encode only the diagonals it accepts (a worker's share in
    :mod:`cipherlm.he.parallel`); the others are left ``None``.  The weight scale
    is always that of the whole matrix.  ``compress`` (Lattigo, a packed plan, T =
    ``plan.tokens``): diagonals of period S / T (one chunk) kept at 1/T of the memory,
    same results (`LattigoBackend.bsgs_matrix` ``repeat``); False: stored whole."""
    W = np.asarray(W)
    if W.ndim != 2:
        raise HEError("W must be (d_out, d_in)")
    if plan is None:
        plan = plan_matmul(W.shape[0], W.shape[1], ctx.slots, has_bias=b is not None, splits=splits)
    if plan.slots != ctx.slots:
        raise HEError("plan was made for another slot count")
    if plan.real_input and backend_of(ctx) != "lattigo":
        raise HEError("real-input plans (half-ring inputs) run on the Lattigo backend only")
    wmax = float(np.max(np.abs(W))) if W.size else 0.0
    if b is not None:
        wmax = max(wmax, float(np.max(np.abs(b))))
    wbits = weight_scale_bits(ctx, plan.n)
    scale = 2.0**wbits / (wmax if wmax > 0 else 1.0)
    lattigo = backend_of(ctx) == "lattigo"
    # (Lattigo: diagonals of one lane's period are encoded sparse, from one lane)
    D = diagonals(plan, W, b, lane_only=lattigo and one_lane(plan))
    total = plan.n_blocks * plan.in_cts * plan.m
    if plan.in_cts > 1 and not lattigo:
        raise HEError("plans with several input ciphertexts run on the Lattigo backend only")
    if backend_of(ctx) == "lattigo":
        if keep is not None:
            raise HEError("the Lattigo backend encodes whole matrices (its workers are goroutines)")
        # a packed plan's diagonals with one chunk have period S / T: stored at 1/T (bit-identical)
        rep = plan.tokens if compress else 1
        mat = get_backend("lattigo").bsgs_matrix(ctx, D, g=plan.g, chunk_steps=plan.chunk_steps, scale=scale,
                                                 repeat=rep, parts=plan.in_cts)
        n_pt = mat.n_plaintexts
        _count(counter, encode=n_pt)
        if progress is not None:
            progress(total, total)
        return LattigoEncodedMatrix(ctx, plan, mat, scale, n_pt)
    pid = ctx.parms_id_at(len(ctx.coeff_moduli))
    pts: list[list[seal.Plaintext | None]] = []
    done = 0
    for o in range(plan.n_blocks):
        row: list[seal.Plaintext | None] = []
        for k in range(plan.m):
            v = D[o, k]
            if (keep is not None and not keep(o, k)) or not np.any(v):
                row.append(None)
            else:
                pt = seal.Plaintext()
                ctx.encoder.encode(v.tolist(), pid, scale, pt)
                row.append(pt)
                _count(counter, encode=1)
            done += 1
            if progress is not None:
                progress(done, total)
        pts.append(row)
    return EncodedMatrix(ctx, plan, pts, scale, pid)


def encode_group(
    ctx: HEContext,
    Ws: Sequence[np.ndarray],
    bs: Sequence[np.ndarray | None] | None = None,
    **kw,
) -> EncodedMatrix:
    """Several matrices sharing one input (q,k,v; gate,up) stacked as one."""
    if not Ws:
        raise HEError("empty group")
    d_in = Ws[0].shape[1]
    if any(w.shape[1] != d_in for w in Ws):
        raise HEError("group members must share d_in")
    W = np.concatenate([np.asarray(w) for w in Ws], axis=0)
    b = None
    if bs is not None and any(x is not None for x in bs):
        b = np.concatenate([np.zeros(w.shape[0]) if x is None else np.asarray(x).reshape(-1) for w, x in zip(Ws, bs)])
    return encode_matrix(ctx, W, b, splits=[w.shape[0] for w in Ws], **kw)


# --------------------------------------------------------------------------- framing


def pack_cts(blobs: Sequence[bytes]) -> bytes:
    return struct.pack("<I", len(blobs)) + b"".join(struct.pack("<Q", len(x)) + x for x in blobs)


def unpack_cts(data: bytes, expected: int | None = None) -> list[bytes]:
    try:
        (n,) = struct.unpack_from("<I", data, 0)
        off, out = 4, []
        for _ in range(n):
            (ln,) = struct.unpack_from("<Q", data, off)
            off += 8
            if off + ln > len(data):
                raise HEError("truncated ciphertext list")
            out.append(bytes(data[off : off + ln]))
            off += ln
    except struct.error:
        raise HEError("truncated ciphertext list") from None
    if off != len(data):
        raise HEError("trailing bytes after ciphertext list")
    if expected is not None and n != expected:
        raise HEError(f"expected {expected} ciphertexts, got {n}")
    return out


# --------------------------------------------------------------------------- client


def _chunks(plan: MatmulPlan, row: np.ndarray) -> np.ndarray:
    """One input row (d_in,) as (P, c, m) complex chunks: the bias constant 1 appended when the
    plan has one, pairs of reals as complex numbers (real inputs: the reals), zero padding to
    P c m; input ciphertext p holds inputs p c m .. (p + 1) c m - 1."""
    if plan.has_bias:
        row = np.concatenate([row, [1.0]])
    if not plan.real_input:
        if row.size % 2:
            row = np.concatenate([row, [0.0]])
        row = row[0::2] + 1j * row[1::2]
    xc = np.zeros(plan.in_cts * plan.c * plan.m, dtype=np.complex128)
    xc[: plan.n] = row
    return xc.reshape(plan.in_cts, plan.c, plan.m)


def input_layouts(plan: MatmulPlan, x: np.ndarray) -> np.ndarray:
    """Complex slot vectors (P, S) of input x (d_in,) under ``plan``, one per input ciphertext;
    for a plan with packed tokens (``plan.tokens`` T > 1) x is (t, d_in), t <= T rows: row i in
    lane i of every chunk block, the lanes of missing rows all zero (no bias constant either)."""
    if plan.tokens > 1:
        X = np.asarray(x, dtype=np.float64)
        X = X.reshape(-1, plan.d_in) if X.size else X.reshape(0, plan.d_in)
        if X.ndim != 2 or X.shape[1] != plan.d_in or not 1 <= X.shape[0] <= plan.tokens:
            raise HEError(f"input has shape {np.shape(x)}, plan expects 1 to {plan.tokens} rows of {plan.d_in}")
        v = np.zeros((plan.in_cts, plan.c, plan.tokens, plan.lane), dtype=np.complex128)
        u = np.arange(plan.lane) % plan.m
        for t, row in enumerate(X):
            v[:, :, t, :] = _chunks(plan, row)[:, :, u]
        return v.reshape(plan.in_cts, -1)
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if x.size != plan.d_in:
        raise HEError(f"input has {x.size} entries, plan expects {plan.d_in}")
    u = np.arange(plan.stride) % plan.m
    lay = _chunks(plan, x)[:, :, u]  # (P, c, B)
    v = np.zeros((plan.in_cts, plan.slots), dtype=np.complex128)
    v[:, : plan.c * plan.stride] = lay.reshape(plan.in_cts, -1)
    return v


def input_layout(plan: MatmulPlan, x: np.ndarray) -> np.ndarray:
    """The slot vector (S,) of input x under a plan with one input ciphertext (`input_layouts`)."""
    if plan.in_cts != 1:
        raise HEError(f"the plan takes {plan.in_cts} input ciphertexts: use input_layouts")
    return input_layouts(plan, x)[0]


def encrypt_input(keys, x: np.ndarray, plan: MatmulPlan, counter: HEOpCounter | None = None, *,
                  input_keys=None) -> bytes:
    """Client: layout + scale 2^45/max|x| + seeded symmetric encryption -> bytes (x:
    (d_in,), or up to ``plan.tokens`` rows (t, d_in) for a packed plan, one scale for all).
    A real-input plan is encrypted under ``input_keys`` (`LattigoSecretKeys.input_switch_key`,
    the conjugate-invariant half ring: real slots, half the bytes)."""
    ctx = keys.ctx
    if plan.real_input:
        if input_keys is None:
            raise HEError("a real-input plan is encrypted with the session's half-ring input keys")
        keys, ctx = input_keys, input_keys.ctx
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise HEError("input has non-finite entries")
    xmax = max(float(np.max(np.abs(x))) if x.size else 0.0, 1.0 if plan.has_bias else 0.0)
    scale = 2.0 ** ctx.params.input_scale_bits / (xmax if xmax > 0 else 1.0)
    if backend_of(ctx) == "lattigo":
        be = get_backend("lattigo")
        blobs = []
        for lay in input_layouts(plan, x):  # one scale for every input ciphertext
            pt = be.encode_slots(ctx, lay.real if plan.real_input else lay, level=ctx.max_level,
                                 scale_bits=math.log2(scale))
            blobs.append(keys.encrypt_seeded(pt))
            _count(counter, encode=1, encrypt=1, bytes_in=len(blobs[-1]))
        return blobs[0] if plan.in_cts == 1 else pack_cts(blobs)
    if plan.in_cts != 1:
        raise HEError("plans with several input ciphertexts run on the Lattigo backend only")
    pt = seal.Plaintext()
    ctx.encoder.encode(input_layout(plan, x).tolist(), ctx.parms_id_at(len(ctx.coeff_moduli)), scale, pt)
    data = keys.encrypt_seeded(pt)
    _count(counter, encode=1, encrypt=1, bytes_in=len(data))
    return data


def decrypt_slots(keys, blob: bytes) -> np.ndarray:
    """Client: every (complex) slot of one result ciphertext (tests inspect what a
    result carries besides the outputs)."""
    ctx = keys.ctx
    if backend_of(ctx) == "lattigo":
        be = get_backend("lattigo")
        return be.decode_slots(ctx, keys.decrypt(be.ciphertext_from_bytes(ctx, blob, level=0)), complex_out=True)
    ct = serialize.ciphertext_from_bytes(ctx, blob, n_primes=1)
    return np.asarray(ctx.encoder.decode_complex(keys.decrypt(ct)))


def decrypt_output(
    keys, data: bytes, plan: MatmulPlan, counter: HEOpCounter | None = None, *, split: bool = False,
    half_keys=None,
) -> np.ndarray | list[np.ndarray]:
    """Client: decrypt the n_blocks result ciphertexts -> (d_out,).  The server has
    summed the chunks (every slot block holds the whole sum): block 0 is read.
    ``half_keys`` (Lattigo, `LattigoSecretKeys.ring_switch_key`): the session's half-ring
    secret; the results then arrive in the half ring (`apply`'s ``ring_switch_key``): the
    conjugate-invariant one, whose N/2 real slots are the real parts of the full ring's slots,
    at the same positions, or for a real-input plan the even one, whose N/4 complex slots are
    the first N/4 of the full ring's (each holding two outputs, y[2r] + i y[2r+1])."""
    ctx = keys.ctx
    blobs = unpack_cts(data, plan.n_blocks)
    T, L = plan.tokens, plan.lane
    R, cplx = plan.rows, plan.real_input
    y = np.zeros((T, plan.n_blocks * plan.out_rows))
    n_read = (T - 1) * L + R  # lane t of block 0 at t L, its R slot rows first
    for o, blob in enumerate(blobs):
        if not blob:
            continue  # all-zero block
        if half_keys is not None:
            be = get_backend("lattigo")
            ct = be.ciphertext_from_bytes(half_keys.ctx, blob, level=0)
            v = be.decode_slots(half_keys.ctx, half_keys.decrypt(ct), n=n_read, complex_out=cplx)
        elif backend_of(ctx) == "lattigo":
            be = get_backend("lattigo")
            v = be.decode_slots(ctx, keys.decrypt(be.ciphertext_from_bytes(ctx, blob, level=0)), n=n_read,
                                complex_out=cplx)
        else:
            ct = serialize.ciphertext_from_bytes(ctx, blob, n_primes=1)
            v = np.asarray(ctx.encoder.decode_double(keys.decrypt(ct)))
        for t in range(T):
            u = v[t * L : t * L + R]
            if cplx:  # slot r holds outputs 2r (real part) and 2r + 1 (imaginary part)
                u = np.stack([u.real, u.imag], axis=1).reshape(-1)
            y[t, o * plan.out_rows : (o + 1) * plan.out_rows] = u
        _count(counter, decrypt=1)
    _count(counter, bytes_out=len(data))
    y = y[:, : plan.d_out]
    if T == 1:
        y = y[0]
        if split:
            return split_output(plan, y)
        return y
    # packed tokens: (T, d_out), one row per lane (rows of missing tokens are zero)
    if split:
        return [split_output(plan, row) for row in y]
    return y


def split_output(plan: MatmulPlan, y: np.ndarray) -> list[np.ndarray]:
    if not plan.splits:
        return [y]
    return np.split(y, np.cumsum(plan.splits)[:-1])


# --------------------------------------------------------------------------- server: apply


def load_galois_keys(ctx: HEContext, data: bytes, plans: Sequence[MatmulPlan] = ()) -> seal.GaloisKeys:
    steps = sorted({s for p in plans for s in p.rotation_steps})
    if backend_of(ctx) == "lattigo":
        return get_backend("lattigo").galois_keys_from_bytes(ctx, data, required_steps=steps or None)
    return serialize.galois_keys_from_bytes(ctx, data, required_steps=steps or None)


def evaluate_blocks(
    enc: EncodedMatrix,
    ct_bytes: bytes,
    galois_keys: seal.GaloisKeys,
    blocks: Sequence[tuple[int, Sequence[int]]],
    g_needed: int,
) -> tuple[list[tuple[int, bytes]], dict[str, int]]:
    """The BSGS core: for each (output block o, giant steps ii), the sum
    sum_{i in ii} rot(rescale(sum_j diag_{ig+j} * rot(x, j)), ig), chunk-summed
    (``y += rot(y, 2^i B)``, i < log2 c: every slot block then holds the sum over the
    c chunks), serialised (b"" when all its diagonals are zero), and the op counts.
    ``g_needed`` baby steps are computed once and shared by all blocks. :func:`apply`
    runs every block; a worker of :mod:`cipherlm.he.parallel` runs its share (the chunk
    sum is linear, so partials of one block chunk-summed apart still add up)."""
    ctx, p = enc.ctx, enc.plan
    ev = ctx.evaluator
    ct = serialize.ciphertext_from_bytes(ctx, ct_bytes, parms_id=enc.input_parms_id, size=2)
    n = {"rotations": 0, "multiply_plain": 0, "add": 0, "rescale": 0}
    baby = [ct]
    for j in range(1, g_needed):
        r = seal.Ciphertext()
        ev.rotate_vector(ct, j, galois_keys, r)
        baby.append(r)
        n["rotations"] += 1
    out = []
    for o, giant_steps in blocks:
        acc = None
        for i in giant_steps:
            inner = None
            for j in range(p.g):
                k = i * p.g + j
                if k >= p.m:
                    break
                pt = enc.plaintexts[o][k]
                if pt is None:
                    continue
                t = seal.Ciphertext()
                ev.multiply_plain(baby[j], pt, t)
                n["multiply_plain"] += 1
                if inner is None:
                    inner = t
                else:
                    ev.add_inplace(inner, t)
                    n["add"] += 1
            if inner is None:
                continue
            # rescale before the giant step: rotating at one prime costs about half
            # of rotating at two (key switching is per prime), more than the extra rescale
            ev.rescale_to_next_inplace(inner)
            n["rescale"] += 1
            if i > 0:
                ev.rotate_vector_inplace(inner, i * p.g, galois_keys)
                n["rotations"] += 1
            if acc is None:
                acc = inner
            else:
                ev.add_inplace(acc, inner)
                n["add"] += 1
        if acc is None:
            out.append((o, b""))
            continue
        for step in p.chunk_steps:  # at one prime, after the rescale
            t = seal.Ciphertext()
            ev.rotate_vector(acc, step, galois_keys, t)
            ev.add_inplace(acc, t)
            n["rotations"] += 1
            n["add"] += 1
        out.append((o, serialize.ciphertext_to_bytes(acc)))
    return out, n


def apply(
    enc: EncodedMatrix,
    ct_bytes: bytes,
    galois_keys: seal.GaloisKeys | bytes,
    counter: HEOpCounter | None = None,
    ring_switch_key=None,
    input_switch_key=None,
) -> bytes:
    """Server: Enc(x) -> Enc(W x + b) as ``n_blocks`` rescaled one-prime ciphertexts.
    ``ring_switch_key`` (Lattigo, the client's `LattigoRingSwitchKey`): the results are sent
    in a ring of degree N/2 (`LattigoBackend.ring_switch`), half the bytes (docs/offload.md
    "Half-ring results"): the conjugate-invariant one (the real parts of every slot) for a
    complex-input plan, the even one for a real-input plan.  A real-input plan's input comes in
    the conjugate-invariant half ring and ``input_switch_key`` (`LattigoInputSwitchKey`) takes
    it to the full ring first (`LattigoBackend.real_to_complex`)."""
    t0 = time.perf_counter()
    p = enc.plan
    if isinstance(galois_keys, (bytes, bytearray, memoryview)):
        galois_keys = load_galois_keys(enc.ctx, bytes(galois_keys), [p])
    if isinstance(enc, LattigoEncodedMatrix):
        be = get_backend("lattigo")
        half = ring_switch_key is not None
        if half and ring_switch_key.small.half_kind != p.result_ring:
            raise HEError(f"a {'real' if p.real_input else 'complex'}-input plan's results take a "
                          f"{'even' if p.real_input else 'conjugate-invariant'} ring-switching key")
        blobs = [ct_bytes] if p.in_cts == 1 else unpack_cts(ct_bytes, expected=p.in_cts)
        if p.real_input:
            if input_switch_key is None:
                raise HEError("a real-input plan needs the client's input switching key")
            small = input_switch_key.small
            cts = [be.real_to_complex(be.ciphertext_from_bytes(small, blob, level=small.max_level), input_switch_key)
                   for blob in blobs]
        else:
            cts = [be.ciphertext_from_bytes(enc.ctx, blob, level=enc.ctx.max_level) for blob in blobs]
        res, n = be.bsgs_apply(enc.ctx, cts if p.in_cts > 1 else cts[0], enc.matrix, galois_keys,
                               workers=enc.workers)
        if p.real_input:
            n["input_switch"] = len(cts)
        if half:  # the half-ring results go bit-packed at q0's 60 bits
            res = [None if r is None else be.ring_switch(r, ring_switch_key) for r in res]
            n["ring_switch"] = sum(r is not None for r in res)
        _count(counter, server_seconds=time.perf_counter() - t0, **n)
        return pack_cts([b"" if r is None else be.ciphertext_to_bytes(r, packed=half) for r in res])
    if p.in_cts != 1:
        raise HEError("plans with several input ciphertexts run on the Lattigo backend only")
    blocks = [(o, range(p.b)) for o in range(p.n_blocks)]
    out, n = evaluate_blocks(enc, ct_bytes, galois_keys, blocks, p.g)
    _count(counter, server_seconds=time.perf_counter() - t0, **n)
    return pack_cts([blob for _, blob in out])


# --------------------------------------------------------------------------- calibration


def measure_costs(ctx: HEContext, keys, reps: int = 20) -> CostModel:
    """Time rotate / multiply_plain / add / rescale on this machine (client keys needed)."""
    ev = ctx.evaluator
    pid = ctx.parms_id_at(len(ctx.coeff_moduli))
    rng = np.random.default_rng(0)
    pt = seal.Plaintext()
    ctx.encoder.encode(rng.standard_normal(ctx.slots).tolist(), pid, 2.0**40, pt)
    ct = keys.encrypt(pt)
    gk = keys.galois_keys([1])
    t = seal.Ciphertext()

    def tm(f):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t0) / reps

    rot = tm(lambda: ev.rotate_vector(ct, 1, gk, t))
    mul = tm(lambda: ev.multiply_plain(ct, pt, t))
    ev.multiply_plain(ct, pt, t)
    t2 = seal.Ciphertext()
    ev.multiply_plain(ct, pt, t2)
    add = tm(lambda: ev.add_inplace(t2, t))

    u = seal.Ciphertext()
    rescale = tm(lambda: ev.rescale_to_next(t, u))
    return CostModel(rotate=rot, multiply_plain=mul, add=add, rescale=rescale)

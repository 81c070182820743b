"""HE layer: the backend interface the protocols use (`backend`: HEBackend,
get_backend; docs/he_backend.md) with SEAL behind it (`seal_backend`); SEAL (via
tenseal.sealapi) parameter sets, keys, serialisation, raw coefficient I/O, and the
client-aided offload ct x pt MatMul."""

from .backend import (
    HEBackend,
    HECostModel,
    OffloadCostModel,
    RingBackend,
    SecretKeys,
    TwoPCCostModel,
    backend_names,
    get_backend,
    register_backend,
)
from .context import HEContext
from .errors import HEError
from .keys import ClientKeys
from .matmul import (
    GLOBAL_COUNTER,
    CostModel,
    EncodedMatrix,
    HEOpCounter,
    MatmulPlan,
    apply,
    decrypt_output,
    encode_group,
    encode_matrix,
    encrypt_input,
    load_galois_keys,
    plan_matmul,
)
from .params import OFFLOAD_CKKS, HEParams, check_security, get_params
from .serialize import (
    ciphertext_from_bytes,
    ciphertext_to_bytes,
    ciphertext_to_numpy,
    galois_keys_from_bytes,
    galois_keys_to_bytes,
    numpy_to_ciphertext,
    numpy_to_plaintext,
    params_from_bytes,
    params_to_bytes,
    plaintext_from_bytes,
    plaintext_to_bytes,
    plaintext_to_numpy,
)

__all__ = [name for name in dir() if not name.startswith("_")]

import pytest

from cipherlm.he import HEContext, HEError, HEParams, OFFLOAD_CKKS, check_security, get_params
from cipherlm.he.params import HES_128_CLASSIC_MAX_LOGQ
from cipherlm.he.serialize import params_from_bytes, params_to_bytes


def test_default_is_secure():
    check_security(OFFLOAD_CKKS)
    assert get_params() == OFFLOAD_CKKS
    assert OFFLOAD_CKKS.poly_modulus_degree == 8192
    assert OFFLOAD_CKKS.coeff_modulus_bits == (60, 40, 60)
    assert OFFLOAD_CKKS.total_logq <= HES_128_CLASSIC_MAX_LOGQ[8192]


def test_table_values():
    assert HES_128_CLASSIC_MAX_LOGQ == {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}


def test_reject_insecure():
    bad = HEParams("bad", "ckks", 4096, (60, 40, 40, 60))  # 200 bits > 109
    with pytest.raises(HEError, match="insecure"):
        check_security(bad)
    with pytest.raises(HEError, match="insecure"):
        HEContext(bad)
    with pytest.raises(HEError):
        check_security(HEParams("odd", "ckks", 3000, (30,)))
    with pytest.raises(HEError):
        get_params("nope")


def test_edge_of_table_accepted():
    check_security(HEParams("edge", "ckks", 4096, (49, 30, 30)))  # exactly 109


def test_params_bytes_roundtrip_and_tamper():
    blob = params_to_bytes(OFFLOAD_CKKS)
    assert params_from_bytes(blob) == OFFLOAD_CKKS
    tampered = blob.replace(b'"poly_modulus_degree": 8192', b'"poly_modulus_degree": 4096')
    with pytest.raises(HEError):
        params_from_bytes(tampered)
    with pytest.raises(HEError):
        params_from_bytes(b"garbage")

"""The client validates what a server sends: the 2pc plan's allow-list (no `insecure` MoE
downgrade, known embeddings / packings / presets, no unknown keys), strict welcome types in
both modes, HE parameters at 128-bit security, and the offload bundle's sha256 (on download
and in the cache).  Crafted welcomes go to the check functions directly and, end to end,
through fake servers on TCP (a thread answering hello with a crafted welcome)."""

from __future__ import annotations

import copy
import json
import struct
import threading

import numpy as np
import pytest

from cipherlm.he import HEError, OFFLOAD_CKKS
from cipherlm.he.matmul import plan_matmul
from cipherlm.he.serialize import params_to_bytes
from cipherlm.models import LoadedModel
from cipherlm.net.channel import ChannelClosed, ChannelTimeout, TCPChannel, listen
from cipherlm.runtime import twopc
from cipherlm.runtime.bundle import bundle_digest, bundle_dir, load_bundle, store_bundle
from cipherlm.runtime.offload_client import OffloadClient
from cipherlm.runtime.offload_engine import ClientEngine
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION as OFFLOAD_PROTOCOL
from cipherlm.runtime.offload_protocol import ProtocolError
from cipherlm.runtime.plan_check import check_offload_welcome, check_twopc_plan, check_twopc_welcome
from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost
from test_twopc import bert_model, llama_model
from test_twopc_moe import _model as moe_model


# --------------------------------------------------------------------------- models and plans


@pytest.fixture(scope="module")
def models():
    """(config, server weights) of a dense decoder, an MoE decoder and an encoder (tiny, random)."""
    out = {}
    config, w = llama_model(seed=4)
    out["decoder"] = (config, w, twopc.server_weights(config, w))
    config, w = moe_model("mixtral", seed=4)
    out["moe"] = (config, w, twopc.server_weights(config, w))
    config, w, cls = bert_model(seed=4)
    out["encoder"] = (config, w, twopc.server_weights(config, w, classifier=cls), cls)
    return out


def _plan(models, kind, **kw):
    config, _, sw = models[kind][:3]
    return config, twopc.public_plan(config, sw, **kw)


@pytest.mark.parametrize("kind", ["decoder", "moe", "encoder"])
@pytest.mark.parametrize("kw", [{}, {"embedding": "onehot-linear"}, {"embedding": "fastquery"},
                                {"embedding": "cheetah", "linear_packing": "simd", "network": "WAN"},
                                {"linear_packing": "auto"}])
def test_public_plans_are_accepted(models, kind, kw):
    config, plan = _plan(models, kind, **kw)
    out = check_twopc_plan(plan, config)
    assert out == plan  # the checked copy is the plan itself
    assert check_twopc_plan(plan) == plan  # also without the config
    if kind == "moe":
        assert out["moe"]["variant"] == "cryptomoe"


@pytest.mark.parametrize("variant", ["insecure", "dense", "cipherprune", "CryptoMoE", "", None, 1, ["cryptomoe"]])
def test_moe_variant_other_than_cryptomoe_is_refused(models, variant):
    config, plan = _plan(models, "moe")
    plan["moe"]["variant"] = variant
    with pytest.raises(ProtocolError, match="MoE variant"):
        check_twopc_plan(plan, config)


@pytest.mark.parametrize("capacity", [0, 0.0, -1.0, float("nan"), float("inf"), True, "2.0", None])
def test_moe_capacity_must_be_finite_and_positive(models, capacity):
    config, plan = _plan(models, "moe")
    plan["moe"]["capacity"] = capacity
    with pytest.raises(ProtocolError, match="capacity"):
        check_twopc_plan(plan, config)


@pytest.mark.parametrize("method", ["auto", "plaintext", "clear", "EXACT", "", None, 3, "+blockot-insecure"])
def test_unknown_embedding_method_is_refused(models, method):
    config, plan = _plan(models, "decoder")
    plan["embedding"] = method
    with pytest.raises(ProtocolError, match="embedding"):
        check_twopc_plan(plan, config)


@pytest.mark.parametrize("linear", [{"packing": "plain", "network": "LAN"}, {"packing": None, "network": "LAN"},
                                    {"packing": "coeff", "network": "moon"}, {"packing": "coeff"},
                                    {"packing": "coeff", "network": "LAN", "open": True}, None, "coeff"])
def test_unknown_packing_or_network_is_refused(models, linear):
    config, plan = _plan(models, "decoder")
    plan["linear"] = linear
    with pytest.raises(ProtocolError, match="linear|packing|network"):
        check_twopc_plan(plan, config)


@pytest.mark.parametrize("kind,extra", [("decoder", {"reveal": True}), ("moe", {"routing": "open"}),
                                        ("encoder", {"debug": None}), ("decoder", {"moe": None})])
def test_unknown_plan_keys_are_refused(models, kind, extra):
    config, plan = _plan(models, kind)
    plan.update(extra)
    with pytest.raises(ProtocolError, match="unknown keys|MoE settings"):
        check_twopc_plan(plan, config)


def test_unknown_keys_inside_the_moe_settings_are_refused(models):
    config, plan = _plan(models, "moe")
    plan["moe"]["open_routing"] = True
    with pytest.raises(ProtocolError, match="variant, capacity"):
        check_twopc_plan(plan, config)


def test_plan_keys_must_fit_the_model(models):
    config, plan = _plan(models, "moe")
    del plan["moe"]  # an MoE model without its MoE settings
    with pytest.raises(ProtocolError, match="do not fit"):
        check_twopc_plan(plan, config)
    dense_config, dense_plan = _plan(models, "decoder")
    dense_plan["moe"] = {"variant": "cryptomoe", "capacity": 2.0}  # MoE settings on a dense model
    with pytest.raises(ProtocolError, match="do not fit"):
        check_twopc_plan(dense_plan, dense_config)
    enc_config, enc_plan = _plan(models, "encoder")
    with pytest.raises(ProtocolError, match="do not fit"):
        check_twopc_plan(dict(enc_plan, fold_norms=True), enc_config)
    decoder_as_encoder = {k: v for k, v in dense_plan.items() if k not in ("moe", "fold_norms")} | {"classes": 2}
    with pytest.raises(ProtocolError, match="do not fit"):
        check_twopc_plan(decoder_as_encoder, dense_config)


@pytest.mark.parametrize("kind,key,value", [("encoder", "classes", True), ("encoder", "classes", 0),
                                            ("encoder", "classes", "2"), ("encoder", "classes", 2.0),
                                            ("decoder", "fold_norms", None), ("decoder", "fold_norms", 1),
                                            ("decoder", "fold_norms", "yes")])
def test_classes_and_fold_norms_types(models, kind, key, value):
    config, plan = _plan(models, kind)
    plan[key] = value
    with pytest.raises(ProtocolError, match=key):
        check_twopc_plan(plan, config)


# --------------------------------------------------------------------------- the 2pc welcome


@pytest.fixture(scope="module")
def hosts(models):
    out = {}
    for kind in ("decoder", "moe"):
        config, w, _ = models[kind]
        out[kind] = TwoPCHost(f"tiny-{kind}", lm=LoadedModel(f"tiny-{kind}", config, w))
    config, w, _, cls = models["encoder"]
    out["encoder"] = TwoPCHost("tiny-bert", lm=LoadedModel("tiny-bert", config, w), classifier=cls)
    return out


@pytest.mark.parametrize("kind", ["decoder", "moe", "encoder"])
def test_hosts_welcomes_are_accepted(hosts, kind):
    w = hosts[kind].welcome()
    TwoPCClient._check_welcome(w)
    assert check_twopc_welcome(w)["plan"] == w["plan"]


def test_insecure_moe_welcome_is_refused_by_the_client_check(hosts):
    w = copy.deepcopy(hosts["moe"].welcome())
    TwoPCClient._check_welcome(w)
    w["plan"]["moe"]["variant"] = "insecure"
    with pytest.raises(ProtocolError, match="MoE variant 'insecure' refused"):
        TwoPCClient._check_welcome(w)


BAD_WELCOME_FIELDS = [
    ("protocol", True), ("protocol", 1.0), ("mode", None), ("model", 3), ("config", []),
    ("config", {"model_type": "llama", "blob": b"\x00"}), ("config", {"model_type": "llama", "w": np.zeros(2)}),
    ("config_digest", None), ("plan", None), ("plan", []), ("labels", "positive"), ("labels", [1, 2]),
    ("tokenizer", b"{}"), ("tokenizer", 5), ("ring", {"bits": 64.0, "frac": 16}), ("ring", None),
    ("limits", None), ("limits", {"max_tokens": "64", "max_new_tokens": 512}),
    ("limits", {"max_tokens": True, "max_new_tokens": 512}), ("limits", {"max_tokens": 64}),
    ("limits", {"max_tokens": 64, "max_new_tokens": 512, "session_lifetime": "1h"}),
]


@pytest.mark.parametrize("key,value", BAD_WELCOME_FIELDS, ids=[f"{k}={v!r}"[:40] for k, v in BAD_WELCOME_FIELDS])
def test_welcome_fields_are_type_checked(hosts, key, value):
    w = dict(hosts["decoder"].welcome())
    TwoPCClient._check_welcome(w)
    w[key] = value
    with pytest.raises(ProtocolError):
        TwoPCClient._check_welcome(w)


def test_welcome_labels_must_match_the_classes(hosts):
    w = dict(hosts["encoder"].welcome())
    assert w["plan"]["classes"] == 2 and w["labels"] == ["class0", "class1"]
    with pytest.raises(ProtocolError, match="labels"):
        TwoPCClient._check_welcome(dict(w, labels=["only"]))


def test_welcome_extra_keys_and_limits_are_tolerated(hosts):
    """A newer server may add welcome fields and limits the client does not read."""
    w = dict(hosts["decoder"].welcome())
    w["motd"] = "hello"
    w["limits"] = dict(w["limits"], session_lifetime=3600.0, max_sessions=None)
    TwoPCClient._check_welcome(w)


# --------------------------------------------------------------------------- fake servers


class FakeServer:
    """Answers each request type with a canned message (a callable gets the request);
    records the request types it received, per connection."""

    def __init__(self, replies: dict):
        self.replies = replies
        self.sock = listen("127.0.0.1", 0)
        self.address = self.sock.getsockname()[:2]
        self.sessions: list[list[str]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            chan = TCPChannel(conn, timeout=30)
            seen: list[str] = []
            self.sessions.append(seen)
            try:
                while True:
                    msg = chan.recv()
                    seen.append(msg.get("type"))
                    reply = self.replies.get(msg.get("type"))
                    if reply is None:
                        break
                    chan.send(reply(msg) if callable(reply) else reply)
            except (ChannelClosed, ChannelTimeout, OSError):
                pass
            finally:
                chan.close()

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _wait(server: FakeServer, n: int = 1):
    for _ in range(200):
        if len(server.sessions) >= n:
            break
        threading.Event().wait(0.01)


def test_2pc_client_over_tcp_refuses_an_insecure_moe_plan(hosts):
    good = hosts["moe"].welcome()
    bad = copy.deepcopy(good)
    bad["plan"]["moe"]["variant"] = "insecure"
    with FakeServer({"hello": good}) as server:  # control: the honest welcome is accepted
        with TwoPCClient(*server.address, timeout=30) as client:
            assert client.plan["moe"]["variant"] == "cryptomoe"
    with FakeServer({"hello": bad}) as server:
        with pytest.raises(ProtocolError, match="insecure"):
            TwoPCClient(*server.address, timeout=30)
    _wait(server)
    # the client hung up after the welcome: no request ever reached the server
    assert server.sessions and server.sessions[0] == ["hello"]


def test_2pc_client_over_tcp_refuses_an_unknown_embedding(hosts):
    bad = copy.deepcopy(hosts["decoder"].welcome())
    bad["plan"]["embedding"] = "plaintext"
    with FakeServer({"hello": bad}) as server:
        with pytest.raises(ProtocolError, match="embedding"):
            TwoPCClient(*server.address, timeout=30)


# --------------------------------------------------------------------------- offload: welcome and HE parameters


def _offload_bundle(seed: int = 0):
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((16, 4)).astype(np.float32),
               "model.norm.weight": rng.standard_normal(4).astype(np.float32)}
    tok = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1},
                                                    "unk_token": "[UNK]"}})
    return tensors, tok


def _offload_welcome(tensors, tok, he_params: bytes | None = None) -> dict:
    plan = plan_matmul(256, 64, OFFLOAD_CKKS.slot_count)  # (a plan with rotations: the client makes keys)
    return {"type": "welcome", "protocol": OFFLOAD_PROTOCOL, "model": "fake",
            "config": {"model_type": "llama", "hidden_size": 4},
            "groups": [{"names": ["lm_head"], "d_in": 64, "d_outs": [256]}],
            "bundle_digest": bundle_digest(tensors, tok), "labels": None,
            "he_params": params_to_bytes(OFFLOAD_CKKS) if he_params is None else he_params,
            "plans": [plan.to_dict()], "parts": [[0]], "rotation_steps": plan.rotation_steps}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CIPHERLM_CACHE", str(tmp_path))
    return tmp_path


def test_offload_welcome_accepted_then_fields_type_checked():
    tensors, tok = _offload_bundle()
    w = _offload_welcome(tensors, tok)
    assert check_offload_welcome(w, OFFLOAD_PROTOCOL) is w
    bad = [("protocol", True), ("protocol", 2), ("model", None), ("config", {"x": b"1"}), ("groups", []),
           ("groups", [{"names": ["a"], "d_in": "4", "d_outs": [8]}]),
           ("groups", [{"names": ["a"], "d_in": True, "d_outs": [8]}]),
           ("groups", [{"names": "a", "d_in": 4, "d_outs": [8]}]),
           ("groups", [{"names": ["a"], "d_in": 4, "d_outs": [8, 1]}]),
           ("groups", [{"names": ["a"], "d_in": 4, "d_outs": [8], "bias": 1}]),
           ("groups", [["a", 4, [8]]]), ("bundle_digest", "A" * 64), ("bundle_digest", "../" + "a" * 61),
           ("labels", [None]), ("he_params", "ckks"), ("plans", [dict(w["plans"][0], evil=1)]),
           ("plans", [dict(w["plans"][0], g="3")]), ("plans", [dict(w["plans"][0], has_bias=0)]),
           ("parts", [[5]]), ("parts", [["0"]]), ("rotation_steps", [1.5]),
           ("limits", {"max_cts_per_request": "many"})]
    for key, value in bad:
        with pytest.raises(ProtocolError):
            check_offload_welcome(dict(w, **{key: value}), OFFLOAD_PROTOCOL)


def _insecure_params_bytes(seal_matches: bool) -> bytes:
    """A parameter blob naming N = 8192 with log q = 240 > 218 (below 128-bit security);
    with `seal_matches` the SEAL blob says the same (built around the security check)."""
    from cipherlm.he import serialize

    good = params_to_bytes(OFFLOAD_CKKS)
    (n,) = struct.unpack_from("<I", good, 6)
    d = json.loads(good[10:10 + n])
    d.update(name="weak", coeff_modulus_bits=[60, 60, 60, 60])
    js = json.dumps(d, sort_keys=True).encode()
    seal_blob = good[10 + n:]
    if seal_matches:
        import tenseal.sealapi as seal

        parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
        parms.set_poly_modulus_degree(8192)
        parms.set_coeff_modulus(seal.CoeffModulus.Create(8192, [60, 60, 60, 60]))
        seal_blob = serialize._save(parms)
    return good[:6] + struct.pack("<I", len(js)) + js + seal_blob


@pytest.mark.parametrize("seal_matches", [False, True])
def test_offload_he_params_below_128_bits_are_refused(cache, seal_matches):
    tensors, tok = _offload_bundle()
    w = _offload_welcome(tensors, tok, he_params=_insecure_params_bytes(seal_matches))
    from cipherlm.runtime.linear_groups import LinearGroup

    with pytest.raises(HEError, match="insecure|128"):
        ClientEngine(w, [LinearGroup(0, ("lm_head",), 64, (256,))])
    # end to end: the client refuses before it makes or sends any key
    replies = {"hello": w, "get_bundle": {"type": "bundle", "tensors": tensors, "tokenizer": tok},
               "keys": {"type": "ready"}}
    with FakeServer(replies) as server:
        with pytest.raises(HEError, match="insecure|128"):
            OffloadClient(*server.address, timeout=30)
    _wait(server)
    assert "keys" not in server.sessions[0]


# --------------------------------------------------------------------------- offload: the bundle's digest


def test_bundle_digest_binds_names_shapes_dtypes_and_tokenizer():
    tensors, tok = _offload_bundle()
    d = bundle_digest(tensors, tok)
    assert d == bundle_digest(dict(reversed(list(tensors.items()))), tok)  # order-free
    emb = tensors["model.embed_tokens.weight"]
    variants = [
        dict(tensors, **{"model.embed_tokens.weight": emb.reshape(8, 8)}),  # same bytes, other shape
        dict(tensors, **{"model.embed_tokens.weight": emb.view(np.int32)}),  # same bytes, other dtype
        {"model.embed_tokens.weightm": emb, "odel.norm.weight": tensors["model.norm.weight"]},  # names shifted
        dict(tensors, **{"model.norm.weight": tensors["model.norm.weight"] + 1}),
    ]
    for v in variants:
        assert bundle_digest(v, tok) != d
    assert bundle_digest(tensors, None) != bundle_digest(tensors, "")
    assert bundle_digest(tensors, tok + " ") != d


def test_store_bundle_refuses_a_mismatch_and_writes_nothing(cache):
    tensors, tok = _offload_bundle()
    digest = bundle_digest(tensors, tok)
    other = dict(tensors, **{"model.norm.weight": np.zeros(4, np.float32)})
    with pytest.raises(ProtocolError, match="does not match"):
        store_bundle(digest, other, tok)
    assert not bundle_dir(digest).exists()
    assert not any((cache / "bundles").rglob("*")) if (cache / "bundles").exists() else True
    store_bundle(digest, tensors, tok)
    got, got_tok = load_bundle(digest)
    assert got_tok == tok and set(got) == set(tensors)
    for k in tensors:
        np.testing.assert_array_equal(got[k], tensors[k])


@pytest.mark.parametrize("tamper", ["tensor-values", "tokenizer", "truncated", "tokenizer-removed"])
def test_load_bundle_refuses_a_tampered_cache_entry(cache, tamper):
    from safetensors.numpy import save_file

    tensors, tok = _offload_bundle()
    digest = bundle_digest(tensors, tok)
    store_bundle(digest, tensors, tok)
    assert load_bundle(digest) is not None
    d = bundle_dir(digest)
    if tamper == "tensor-values":
        save_file(dict(tensors, **{"model.norm.weight": np.full(4, 9.0, np.float32)}), str(d / "tensors.safetensors"))
    elif tamper == "tokenizer":
        (d / "tokenizer.json").write_text(tok.replace('"a"', '"b"'))
    elif tamper == "truncated":
        data = (d / "tensors.safetensors").read_bytes()
        (d / "tensors.safetensors").write_bytes(data[:-7])
    else:
        (d / "tokenizer.json").unlink()
    assert load_bundle(digest) is None


def _bundle_server(welcome, bundle_tensors, tok):
    return FakeServer({"hello": welcome, "get_bundle": {"type": "bundle", "tensors": bundle_tensors,
                                                        "tokenizer": tok},
                       "keys": {"type": "ready"}})


def test_offload_client_refuses_a_bundle_that_does_not_match_the_digest(cache):
    tensors, tok = _offload_bundle(seed=0)
    poison, _ = _offload_bundle(seed=1)  # another bundle, announced under the first one's digest
    with _bundle_server(_offload_welcome(tensors, tok), poison, tok) as server:
        with pytest.raises(ProtocolError, match="does not match"):
            OffloadClient(*server.address, timeout=30)
    _wait(server)
    assert server.sessions[0] == ["hello", "get_bundle"]  # no keys sent after the refusal
    assert not (cache / "bundles").exists() or not any((cache / "bundles").rglob("*"))
    assert load_bundle(bundle_digest(tensors, tok)) is None


def test_offload_client_verifies_caches_and_reuses_an_honest_bundle(cache):
    tensors, tok = _offload_bundle(seed=0)
    welcome = _offload_welcome(tensors, tok)
    with _bundle_server(welcome, tensors, tok) as server:
        with OffloadClient(*server.address, timeout=30) as client:
            assert not client.bundle_from_cache and client.tokenizer is not None
            np.testing.assert_array_equal(client.client_params["model.norm.weight"], tensors["model.norm.weight"])
        with OffloadClient(*server.address, timeout=30) as client:
            assert client.bundle_from_cache
    _wait(server, 2)
    assert server.sessions[0][:3] == ["hello", "get_bundle", "keys"]
    assert server.sessions[1][:2] == ["hello", "keys"]


def test_offload_client_does_not_use_a_tampered_cached_bundle(cache):
    from safetensors.numpy import save_file

    tensors, tok = _offload_bundle(seed=0)
    digest = bundle_digest(tensors, tok)
    store_bundle(digest, tensors, tok)
    evil = dict(tensors, **{"model.embed_tokens.weight": np.zeros((16, 4), np.float32)})
    save_file(evil, str(bundle_dir(digest) / "tensors.safetensors"))
    with _bundle_server(_offload_welcome(tensors, tok), tensors, tok) as server:
        with OffloadClient(*server.address, timeout=30) as client:
            assert not client.bundle_from_cache  # the cache entry was refused: downloaded again
            np.testing.assert_array_equal(client.client_params["model.embed_tokens.weight"],
                                          tensors["model.embed_tokens.weight"])
    _wait(server)
    assert "get_bundle" in server.sessions[0]
    assert load_bundle(digest) is not None  # and the entry is repaired with the verified bundle

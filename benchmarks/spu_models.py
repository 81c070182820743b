"""Transformer layers in JAX for the SecretFlow-SPU side of benchmarks/bench_2pc_spu.py.

Imported by benchmarks/spu_peer.py (SPU venv).  Each entry: name -> (function
of the secret inputs followed by the public ones, secret input keys, public
input keys).  Weights are the server's private inputs (secret in SPU, as in
cipherlm's 2pc mode); RoPE tables, the causal mask and the shape constants are
public compile-time constants.  The layers are the same as the plaintext
executor's (cipherlm.runtime.plain): BERT post-norm layers (GeLU in JAX's tanh
form: SPU has no erf) and one Llama block (RMSNorm, RoPE, GQA, causal
softmax with a finite -100 mask since SPU's exp is wrong far below zero,
SwiGLU).  Weight matrices are (d_in, d_out).
"""

from __future__ import annotations

BERT_KEYS = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "g1", "b1", "wi", "bi", "wo2", "bo2", "g2", "b2")
LLAMA_KEYS = ("wq", "wk", "wv", "wo", "g1", "g2", "wg", "wu", "wd")


def functions():
    import jax
    import jax.numpy as jnp

    def layer_norm(x, g, b, eps):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + eps) * g + b

    def bert_layers(x, *args):
        ws, (heads, eps) = args[:len(BERT_KEYS)], args[len(BERT_KEYS):]
        p = dict(zip(BERT_KEYS, ws))
        H, eps = int(heads), float(eps)
        T, d = x.shape
        hd = d // H
        for i in range(p["wq"].shape[0]):
            q = (x @ p["wq"][i] + p["bq"][i]).reshape(T, H, hd).transpose(1, 0, 2)
            k = (x @ p["wk"][i] + p["bk"][i]).reshape(T, H, hd).transpose(1, 0, 2)
            v = (x @ p["wv"][i] + p["bv"][i]).reshape(T, H, hd).transpose(1, 0, 2)
            s = q @ k.transpose(0, 2, 1) * (hd ** -0.5)
            c = (jax.nn.softmax(s, axis=-1) @ v).transpose(1, 0, 2).reshape(T, d)
            x = layer_norm(c @ p["wo"][i] + p["bo"][i] + x, p["g1"][i], p["b1"][i], eps)
            f = jax.nn.gelu(x @ p["wi"][i] + p["bi"][i])
            x = layer_norm(f @ p["wo2"][i] + p["bo2"][i] + x, p["g2"][i], p["b2"][i], eps)
        return x

    def llama_block(x, *args):
        ws, (cos, sin, mask, heads, kv_heads, eps) = args[:len(LLAMA_KEYS)], args[len(LLAMA_KEYS):]
        p = dict(zip(LLAMA_KEYS, ws))
        H, Hkv, eps = int(heads), int(kv_heads), float(eps)
        T, d = x.shape
        hd = p["wq"].shape[1] // H

        def rms(v, g):
            return v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + eps) * g

        def rope(v):  # v (heads, T, hd); rotate-half form
            h = hd // 2
            rot = jnp.concatenate([-v[..., h:], v[..., :h]], axis=-1)
            return v * cos + rot * sin

        h = rms(x, p["g1"])
        q = rope((h @ p["wq"]).reshape(T, H, hd).transpose(1, 0, 2))
        k = rope((h @ p["wk"]).reshape(T, Hkv, hd).transpose(1, 0, 2))
        v = (h @ p["wv"]).reshape(T, Hkv, hd).transpose(1, 0, 2)
        k = jnp.repeat(k, H // Hkv, axis=0)
        v = jnp.repeat(v, H // Hkv, axis=0)
        s = q @ k.transpose(0, 2, 1) * (hd ** -0.5) + mask
        c = (jax.nn.softmax(s, axis=-1) @ v).transpose(1, 0, 2).reshape(T, H * hd)
        x = x + c @ p["wo"]
        h = rms(x, p["g2"])
        return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]

    return {
        "bert_layers": (bert_layers, ("x",) + BERT_KEYS, ("heads", "eps")),
        "llama_block": (llama_block, ("x",) + LLAMA_KEYS, ("cos", "sin", "mask", "heads", "kv_heads", "eps")),
    }

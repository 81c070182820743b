"""cipherlm: private inference for Transformer language models.

Layers (each imports only the ones below it)::

    cli            cipherlm serve | generate | classify | bench | demo | models
    runtime        executors: plain (numpy reference) | offload (client-aided HE)
    he             SEAL backend (tenseal.sealapi): params, keys, packing, matmul
    net            channel (TCP / in-process), framing, accounting, LAN/WAN model
    models         loaders (HF safetensors dirs, GGUF), registry, tokenizers
    _core (Rust)   CSPRNG/PRG today; OT extension and ring kernels later
"""

__version__ = "0.1.0"

"""cipherlm: private inference for Transformer language models.

Layers (each imports only the ones below it; DESIGN.md "Layers", checked by
tests/test_layering.py, lazy imports included, no import cycles)::

    cli / serve    cli, commands, launch, bench/, report
    runtime        executors: plain (numpy reference) | offload (client-aided HE) | 2pc
    compile        (not there yet)
    protocols      protocols/ (HE linear layers, embedding), moe/ (CryptoMoE)
    mpc            shares, OT, primitives, nonlinear library
    he             backend interface (he/backend.py; only he/ imports tenseal, checked by
                   tests/test_he_backend.py), SEAL backend, params, keys, packing, matmul
    net            channel (TCP / in-process), framing, accounting, LAN/WAN model
    _core (Rust)   CSPRNG/PRG, base OT, OT extension, Ferret, ring kernels
    models         side layer used by runtime and above: loaders, registry, tokenizers, data
"""

__version__ = "0.1.0"

"""Read safetensors files into float32 numpy arrays without torch.

safetensors' own numpy loader rejects bfloat16, which numpy lacks; the format is
simple (8-byte little-endian header length, JSON header, raw little-endian data),
so we read it directly and widen BF16/F16 to float32.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str | Path, floats_only: bool = True) -> dict[str, np.ndarray]:
    """All tensors of one file; floating tensors come back as float32 arrays.
    Integer buffers (e.g. BERT's position_ids) are skipped when floats_only."""
    path = Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    base = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        dt = info["dtype"]
        if dt not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt}")
        is_float = dt in ("F64", "F32", "F16", "BF16")
        if floats_only and not is_float:
            continue
        start, end = info["data_offsets"]
        raw = mm[base + start : base + end]
        arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[dt]).newbyteorder("<"))
        if dt == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        elif is_float:
            arr = arr.astype(np.float32)
        else:
            arr = np.array(arr)
        out[name] = arr.reshape(info["shape"])
    return out

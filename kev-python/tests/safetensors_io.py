"""Just enough of the safetensors format (8-byte little-endian header size, JSON header, raw
data) to edit fixture files in tests without another dependency."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, List, Tuple

#: name -> (dtype, shape, raw bytes)
Tensors = Dict[str, Tuple[str, List[int], bytes]]


def load(path: Path) -> Tensors:
    data = Path(path).read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    header.pop("__metadata__", None)
    return {
        name: (t["dtype"], t["shape"], body[t["data_offsets"][0] : t["data_offsets"][1]])
        for name, t in header.items()
    }


def save(tensors: Tensors, path: Path) -> None:
    header, body, at = {}, b"", 0
    for name, (dtype, shape, raw) in sorted(tensors.items()):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        body += raw
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + body)


def narrow_rows(tensor: Tuple[str, List[int], bytes], rows: int) -> Tuple[str, List[int], bytes]:
    """The first `rows` rows (along dimension 0)."""
    dtype, shape, raw = tensor
    row_bytes = len(raw) // shape[0]
    return dtype, [rows, *shape[1:]], raw[: rows * row_bytes]


def transpose_2d(tensor: Tuple[str, List[int], bytes]) -> Tuple[str, List[int], bytes]:
    """A 2-D tensor transposed (any element size)."""
    dtype, (r, c), raw = tensor
    size = len(raw) // (r * c)
    out = bytearray(len(raw))
    for i in range(r):
        for j in range(c):
            src = (i * c + j) * size
            dst = (j * r + i) * size
            out[dst : dst + size] = raw[src : src + size]
    return dtype, [c, r], bytes(out)

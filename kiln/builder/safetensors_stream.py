"""Write one safetensors file tensor group by tensor group, hashing as it goes.

The header (names, dtypes, shapes, offsets) is known before any data exists, so the file is
streamed: memory stays bounded by one group, and the sha256 comes for free.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

_ST_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
}


class SafetensorsStreamWriter:
    """``write(name, tensor)`` in the order of ``shapes``; ``close()`` → (sha256, size).

    Every tensor has ``dtype`` unless ``dtypes`` names another for it (FP8 engines mix e4m3
    weights, float32 scales and engine-dtype norms).
    """

    def __init__(
        self,
        path: Path,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        metadata: dict[str, str] | None = None,
        dtypes: dict[str, torch.dtype] | None = None,
    ) -> None:
        self._dtypes = {name: (dtypes or {}).get(name, dtype) for name in shapes}
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, shape in shapes.items():
            itemsize = torch.empty((), dtype=self._dtypes[name]).element_size()
            nbytes = itemsize * int(torch.Size(shape).numel())
            header[name] = {
                "dtype": _ST_DTYPES[self._dtypes[name]],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._order = list(shapes)
        self._shapes = shapes
        self._dtype = dtype
        self._next = 0
        self._hash = hashlib.sha256()
        self._file = open(path, "wb")
        self._emit(struct.pack("<Q", len(raw)) + raw)
        self.size = 8 + len(raw) + offset

    def _emit(self, data: bytes | memoryview) -> None:
        self._hash.update(data)
        self._file.write(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"tensor {name} written out of order; expected {expected}")
        if tuple(tensor.shape) != self._shapes[name] or tensor.dtype != self._dtypes[name]:
            raise ValueError(
                f"tensor {name} is {list(tensor.shape)} {tensor.dtype}, header says "
                f"{list(self._shapes[name])} {self._dtypes[name]}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._emit(memoryview(flat.numpy()))
        self._next += 1

    def close(self) -> tuple[str, int]:
        self._file.close()
        if self._next != len(self._order):
            raise ValueError(
                f"only {self._next} of {len(self._order)} tensors written; "
                f"next was {self._order[self._next]}"
            )
        return self._hash.hexdigest(), self.size

    def abort(self) -> None:
        self._file.close()

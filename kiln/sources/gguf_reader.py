"""A GGUF file's header (metadata, tensor table) read directly, and its tensors dequantized.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a numpy view
per array element: on a 151,936-token vocabulary that takes 6 s per open, this parser 0.1 s.
Tensor data is a memory map; ``dequantize`` hands each tensor's blocks to
``gguf.quants.dequantize`` (the gguf package's own numpy dequantization), so a weight kiln
builds is exactly what the gguf package makes of it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import SourceError

MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Fixed-size metadata value types: uint8, int8, uint16, int16, uint32, int32, float32, bool,
# (8 string, 9 array), uint64, int64, float64.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_CHUNK_ELEMENTS = 1 << 21  # rows dequantized per numpy call: ~8 MB of float32 output
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in torch order (GGUF stores ne0, the row length,
    first), ``offset`` from the start of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (string arrays are kept as their length only: the tokenizer is read by
    transformers) and the tensor table, in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def count(self) -> int:
        """A uint64 length or count, which no valid file makes larger than itself."""
        n = self.unpack("<Q")
        if n > len(self.buf):
            raise ValueError(f"count {n} at byte {self.pos - 8} exceeds the file size")
        return n

    def string(self) -> str:
        n = self.count()
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise ValueError(f"string at byte {self.pos} runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, n: int) -> None:
        for _ in range(n):
            self.pos += 8 + self.unpack("<Q")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.count()
            if etype == _STRING:
                self.skip_strings(n)
                return n
            if etype not in _NUMPY:
                raise ValueError(f"array of metadata type {etype}")
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        if vtype not in _SCALAR:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALAR[vtype])


def _tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the block size {block}")
    return prod(shape) // block * type_size


def read_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s header; SourceError (naming the file) when it is not a complete GGUF."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != MAGIC:
                raise ValueError(f"it starts with {bytes(mm[:4])!r}, not {MAGIC!r}")
            cur = _Cursor(mm)
            cur.pos = 4
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (kiln reads 2 and 3)")
            n_tensors, n_kv = cur.count(), cur.count()
            metadata = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.unpack("<I"))
            table = []
            for _ in range(n_tensors):
                name = cur.string()
                ndim = cur.unpack("<I")
                dims = tuple(cur.unpack("<Q") for _ in range(ndim))
                ggml_type, offset = cur.unpack("<I"), cur.unpack("<Q")
                table.append((name, tuple(reversed(dims)), ggml_type, offset))
            align = int(metadata.get("general.alignment", 32))
            data_start = -(-cur.pos // align) * align
    except (ValueError, struct.error, OverflowError, KeyError, OSError) as e:
        raise SourceError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
            "it may be truncated or corrupt"
        ) from e
    tensors = {}
    for name, shape, ggml_type, offset in table:
        try:
            nbytes = _tensor_nbytes(ggml_type, shape)
        except (ValueError, KeyError) as e:
            raise SourceError(
                f"{path}: tensor {name} of GGML type {ggml_type} and shape {list(shape)} cannot "
                f"be read ({type(e).__name__}: {e}); the file is corrupt or uses a type the "
                "installed gguf package does not know (upgrade it: pip install -U gguf)"
            ) from e
        tensors[name] = TensorInfo(name, shape, ggml_type, data_start + offset, nbytes)
    end = max((t.offset + t.nbytes for t in tensors.values()), default=data_start)
    if end > size:
        raise SourceError(
            f"{path} is truncated or corrupt: its tensors need {end:,} bytes, the file has "
            f"{size:,}; download it again"
        )
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


class TensorData:
    """Reads and dequantizes tensors of one file through a shared read-only memory map."""

    def __init__(self, header: GGUFHeader) -> None:
        self.header = header
        self._map = np.memmap(header.path, dtype=np.uint8, mode="r")

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of ``name``, one row (``shape[-1]`` elements) per array row."""
        info = self.header.tensors[name]
        rows = prod(info.shape[:-1])
        # a plain ndarray view: numpy's memmap subclass costs a Python call per slice
        return np.asarray(self._map[info.offset : info.offset + info.nbytes]).reshape(rows, -1)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 array of ``name`` in torch order: ``gguf.quants.dequantize``'s values.

        Quantized tensors go through the same per-type ``dequantize_rows`` that
        ``gguf.quants.dequantize`` applies 16 rows at a time, here ~2M elements at a time: the
        blocks are independent, so the values are identical, in a third of the time."""
        import gguf.quants as gq
        from gguf import GGMLQuantizationType

        info = self.header.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = self.raw(name)
        quant = getattr(gq, qtype.name, None)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or not hasattr(
                quant, "dequantize_rows"):
            out = gq.dequantize(raw, qtype)  # raises NotImplementedError for an unknown type
            return np.asarray(out, dtype=np.float32).reshape(info.shape)
        out = np.empty((raw.shape[0], info.shape[-1]), dtype=np.float32)
        step = max(1, _CHUNK_ELEMENTS // info.shape[-1])
        for i in range(0, raw.shape[0], step):
            out[i : i + step] = quant.dequantize_rows(raw[i : i + step])
        return out.reshape(info.shape)

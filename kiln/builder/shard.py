"""Tensor-parallel weight files: one streamed safetensors file per rank.

The builder prepares each full runtime tensor once (fused, FP8-quantized, as for tp 1) and
``ShardedWriter`` cuts it into the ranks' slices (kiln.artifact.parallel's rules), so every
shard is the tp-1 engine's tensor sliced, never a tensor prepared twice: a per-tensor FP8
scale made from the whole tensor stays that tensor's scale on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.artifact.parallel import ParallelConfig, shard_file
from kiln.builder.safetensors_stream import SafetensorsStreamWriter
from kiln.config import ModelConfig


class ShardedWriter:
    """``write(name, full tensor)`` in layout order; ``close()`` → engine.json
    ``weights.files`` ({shard file: {"sha256", "size"}}, rank order)."""

    def __init__(self, directory: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 dtype: torch.dtype, cfg: ModelConfig, parallel: ParallelConfig,
                 metadata: dict[str, str]):
        self._cfg, self._par = cfg, parallel
        shapes = {name: parallel.shard_shape(cfg, name, shape)
                  for name, (shape, _) in layout.items()}
        dtypes = {name: dt for name, (_, dt) in layout.items()}
        self._files = [shard_file(r, parallel.tp) for r in range(parallel.tp)]
        self._writers: list[SafetensorsStreamWriter] = []
        try:
            for r, file in enumerate(self._files):
                meta = {**metadata, "tp_rank": str(r), "tp": str(parallel.tp)}
                self._writers.append(SafetensorsStreamWriter(directory / file, shapes, dtype,
                                                             metadata=meta, dtypes=dtypes))
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        for rank, writer in enumerate(self._writers):
            writer.write(name, self._par.shard(self._cfg, name, tensor, rank))

    def close(self) -> dict[str, Any]:
        files = {}
        for file, writer in zip(self._files, self._writers):
            sha, size = writer.close()
            files[file] = {"sha256": sha, "size": size}
        return files

    def abort(self) -> None:
        for writer in self._writers:
            writer.abort()

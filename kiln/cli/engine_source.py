"""ENGINE_OR_SOURCE: the engine directory that `serve`, `generate` and `bench throughput |
latency` run, built first when they are given a model source.

A model source (``smollm2-135m``, a HF directory, a ``.gguf`` file, ``random:tiny-llama``, a
hub id) is built once into ``$KILN_CACHE/engines/<name>-<dtype>`` (bfloat16 on CUDA, float32
on the CPU) and reused by every later command. Nothing heavy is imported before it is needed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kiln.artifact import ENGINE_JSON
from kiln.errors import KilnError


def _looks_local(text: str) -> bool:
    """A path the user means on this machine, not a hub id or an alias: absolute, ./ ~/ ../,
    more than one level, or under a directory that exists here (`engines/smol`)."""
    if text.startswith(("/", ".", "~")) or text.count("/") > 1:
        return True
    return "/" in text and Path(text.split("/", 1)[0]).expanduser().is_dir()


def _other_output(path: Path) -> str:
    """An output path next to ``path`` for the engine (``path`` itself is taken)."""
    text = str(path).rstrip("/")
    if path.name in ("", ".", ".."):
        return f"engines/{path.resolve().name or 'model'}"
    return f"{text}-engine"


def check_engine_or_source(text: str) -> None:
    """Fail fast (before loading or building anything) when ``text`` is neither an engine
    directory nor something ``kiln build`` may read; the rest is open_source's to check."""
    path = Path(text).expanduser()
    if (path / ENGINE_JSON).is_file():
        return
    if path.is_dir():
        if (path / "config.json").is_file():
            return  # a model directory: used as a source
        raise KilnError(
            f"{path} has no {ENGINE_JSON}, so it is not a kiln engine, and no config.json, so "
            f"it is not a model directory to build one from either; build an engine with "
            f"`kiln build MODEL -o {_other_output(path)}` (e.g. MODEL=smollm2-135m) and pass "
            "that directory, or pass a model source (smollm2-135m, a HF directory, a .gguf "
            "file) to build and cache one")
    if path.exists():
        if path.suffix == ".gguf":
            return
        raise KilnError(f"{path} is a file, not an engine directory or a model source; pass "
                        "the directory `kiln build -o` wrote, a model directory or a .gguf file")
    from kiln.sources.builtin import BUILTINS

    if text.startswith("random:") or text in BUILTINS:
        return
    if _looks_local(text):
        raise KilnError(f"engine directory {path} does not exist; build one with "
                        f"`kiln build MODEL -o {path}` (e.g. MODEL=smollm2-135m)")
    # anything else is for open_source: a hub id, or its "does not exist" error


def cached_engine_dir(source: str, dtype: str) -> Path:
    """Where a source's engine is cached: ``$KILN_CACHE/engines/<source>-<dtype>``."""
    from kiln.env import cache_dir

    path = Path(source).expanduser()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(path.resolve()) if path.exists() else source)
    return cache_dir() / "engines" / f"{safe.strip('_')}-{dtype}"


def default_dtype(device: str | None = None) -> str:
    """The dtype of a build that names none: bfloat16 for CUDA (``device``, default: CUDA
    when available), float32 for the CPU (bfloat16 matmuls are slow on most CPUs)."""
    import torch

    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return "bfloat16" if on_cuda else "float32"


def engine_dir_for(source: str, device: str | None) -> tuple[Path, bool]:
    """(engine dir, built now) for ENGINE_OR_SOURCE; builds a source into the cache."""
    check_engine_or_source(source)
    path = Path(source).expanduser()
    if (path / ENGINE_JSON).is_file():
        return path, False
    dtype = default_dtype(device)
    out = cached_engine_dir(source, dtype)
    stale = _older_sections(out / ENGINE_JSON)
    if (out / ENGINE_JSON).is_file() and not stale:
        return out, False
    from kiln.builder import build_engine

    what = f"{source} is a model directory, not an engine:" if path.is_dir() else ""
    if stale:
        what = f"the cached engine {out} was built by an older kiln (no {', '.join(stale)}):"
    print(f"{what} building {source} into {out} ({dtype}; once, later runs reuse it)".lstrip(),
          file=sys.stderr)
    build_engine(source, out, dtype=dtype, progress=True, force=bool(stale))
    return out, True


def _older_sections(engine_json: Path) -> list[str]:
    """The engine.json sections this kiln writes that a cached engine lacks (it was built by
    an older kiln, e.g. without generation defaults): the cache is kiln's, so it is rebuilt
    rather than served without them. [] when there is no such file or it is complete."""
    import dataclasses
    import json

    from kiln.artifact.spec import EngineSpec

    try:
        keys = set(json.loads(engine_json.read_text()))
    except (OSError, ValueError, TypeError):
        return []  # no engine there (or a broken one: loading it says so)
    # sections this kiln leaves out when they hold nothing: ``parallel`` (tp 1)
    optional = {"parallel"}
    return sorted(f.name for f in dataclasses.fields(EngineSpec)
                  if f.name not in keys and f.name not in optional)

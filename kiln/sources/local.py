"""A local Hugging Face directory: config.json + *.safetensors (sharded or not) + tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.config import ModelConfig
from kiln.errors import SourceError
from kiln.sources.base import SourceModel, merged_eos, read_generation_defaults, sha256_file


def read_hf_config(directory: Path) -> ModelConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise SourceError(
            f"{directory} has no config.json; a model directory needs config.json, "
            "*.safetensors and tokenizer files"
        )
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{cfg_path} is not valid JSON ({e})") from e
    try:
        return ModelConfig.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(f"{cfg_path} cannot be read as a llama-family config: {e!r}") from e


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SourceError(f"{index} is not a valid safetensors index ({e!r})") from e
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceError(f"{index} lists shards that are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {found}: convert them to safetensors first)" if found else ""
        raise SourceError(f"{directory} has no *.safetensors weights{hint}")
    return files


def load_tokenizer(directory: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except Exception as e:  # transformers raises many types here
        raise SourceError(
            f"cannot load a tokenizer from {directory} ({type(e).__name__}: {e}); "
            "save one next to the weights with tokenizer.save_pretrained()"
        ) from e


def open_local(directory: Path, *, progress: bool = True) -> SourceModel:
    """Open a local HF checkpoint directory lazily (tensors are read on demand)."""
    from safetensors import safe_open

    config = read_hf_config(directory)
    files = _weight_files(directory)
    handles: dict[str, Any] = {}
    where: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            h = safe_open(str(f), framework="pt")
            for name in h.keys():
                shapes[name] = tuple(h.get_slice(name).get_shape())
                where[name] = f.name
        except Exception as e:  # SafetensorError, OSError: truncated or corrupt header
            raise SourceError(
                f"{f} is not a readable safetensors file ({type(e).__name__}: {e}); "
                "it may be truncated or corrupt: re-download or re-save it"
            ) from e
        handles[f.name] = h

    def get(name: str):
        try:
            return handles[where[name]].get_tensor(name)
        except KeyError:
            raise
        except Exception as e:
            raise SourceError(
                f"cannot read tensor {name} from {directory / where[name]} "
                f"({type(e).__name__}: {e}); the file may be truncated or corrupt"
            ) from e

    tokenizer = load_tokenizer(directory)
    config = merged_eos(
        config, generation_config=directory / "generation_config.json", tokenizer=tokenizer
    )
    provenance = {
        "kind": "local",
        "path": str(directory.resolve()),
        "files": {f.name: sha256_file(f) for f in files},
    }
    gen_path = directory / "generation_config.json"
    return SourceModel(
        config=config,
        tokenizer=tokenizer,
        provenance=provenance,
        tensor_names=list(where),
        _get=get,
        tensor_shapes=shapes,
        generation_defaults=read_generation_defaults(gen_path),
        generation_source=str(gen_path.resolve()) if gen_path.is_file() else None,
    )

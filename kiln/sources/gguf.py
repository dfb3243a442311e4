"""A ``.gguf`` file, dequantized to float32 through transformers' GGUF loader."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kiln.config import ModelConfig
from kiln.errors import SourceError
from kiln.sources.base import SourceModel, merged_eos, sha256_file


def open_gguf(
    path: Path, *, progress: bool = True, provenance: dict[str, Any] | None = None
) -> SourceModel:
    """Read config and tokenizer of a GGUF file now; its weights are dequantized to float32
    (all in memory) on first use, see ``SourceModel.materialize``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not path.is_file():
        raise SourceError(f"GGUF file {path} does not exist")
    directory, name = str(path.parent), path.name
    try:
        hf_config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except Exception as e:  # gguf raises ValueError/struct errors/... on bad files
        raise SourceError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
            "it may be truncated or corrupt, or of an architecture transformers cannot read"
        ) from e
    config = ModelConfig.from_hf(hf_config.to_dict())  # fails fast on unsupported archs

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as e:
        raise SourceError(
            f"cannot load the tokenizer from GGUF file {path} ({type(e).__name__}: {e}); "
            "it may be truncated or corrupt"
        ) from e
    config = merged_eos(config, generation_config=None, tokenizer=tokenizer)
    prov = {"kind": "gguf", "path": str(path.resolve()), "files": {name: sha256_file(path)}}
    if provenance:
        prov = {**provenance, "gguf": prov["path"], "files": prov["files"]}

    def load(source: SourceModel) -> None:
        """Dequantize all weights to float32 (the heavy part, deferred until needed)."""
        from rich.console import Console

        if not progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        status = Console(stderr=True).status(f"Dequantizing {name}…", spinner="dots")
        try:
            with status if progress else nullcontext():
                model = AutoModelForCausalLM.from_pretrained(
                    directory, gguf_file=name, dtype="float32"
                )
        except Exception as e:
            raise SourceError(
                f"cannot load weights from GGUF file {path} ({type(e).__name__}: {e}); "
                "it may be truncated or corrupt"
            ) from e
        state = {k: v.detach() for k, v in model.state_dict().items()}
        source.tensor_names = list(state)
        source._get = state.__getitem__
        source.tensor_shapes = {k: tuple(v.shape) for k, v in state.items()}

    return SourceModel(config=config, tokenizer=tokenizer, provenance=prov, _materialize=load)

"""A Hugging Face Hub id (``org/name``), downloaded with huggingface_hub into its cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kiln.errors import SourceError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]


def looks_like_hub_id(spec: str) -> bool:
    return bool(HUB_ID.match(spec)) and not spec.startswith((".", "~"))


def download_hub(repo_id: str, *, progress: bool = True) -> Path:
    """``snapshot_download`` of the files kiln needs; SourceError when the hub is unreachable."""
    try:
        from huggingface_hub import constants, snapshot_download

        # Fail fast instead of waiting on a dead network (unless the user chose timeouts).
        if "HF_HUB_ETAG_TIMEOUT" not in os.environ:
            constants.HF_HUB_ETAG_TIMEOUT = 10
        if "HF_HUB_DOWNLOAD_TIMEOUT" not in os.environ:
            constants.HF_HUB_DOWNLOAD_TIMEOUT = 30
        if not progress:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()

        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # offline, DNS, 401/404: all end here
        raise SourceError(
            f"cannot download {repo_id!r} from the Hugging Face Hub: the hub is unreachable or "
            f"the repo does not exist ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"no local directory named {repo_id!r} exists either: download the model elsewhere "
            "and pass its local directory (config.json + *.safetensors + tokenizer)"
        ) from e

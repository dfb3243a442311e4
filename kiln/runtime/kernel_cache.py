"""Compiled Triton kernels shipped inside an engine directory (``kernels/<tag>/``).

On a machine whose Triton cache is empty (a fresh container, a new host), the engine's
start-up JIT-compiles every kernel variant its CUDA graphs capture: that made the 8B
engine's graph capture 10.6-14.9 s instead of 2.2 s with a warm cache, and ``kiln serve``
~21-26 s to ready instead of 15.

``kiln build --precompile-kernels`` (on the serving GPU type) starts the built engine once in a
subprocess whose Triton cache is a fresh folder, then copies that folder's entries into the
engine under a tag naming the Triton version and the GPU's compute capability. Loading an
engine on CUDA copies the entries for this machine's tag into the active Triton cache where
they are missing (``install_kernels``), before anything compiles. Triton keys each entry by
kernel source, specialisation, compiler and target, so an entry this machine cannot use is
never looked up; a whole cache of another tag is skipped. The build's side (the first start
and the export) is kiln/cli/precompile.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kiln.artifact import KERNELS_DIR

_SKIP = shutil.ignore_patterns("lock", "*.tmp*")


def cache_tag(device=None) -> str:
    """``triton-<version>-sm<major><minor>``: what a shipped cache must match here."""
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return f"triton-{triton.__version__}-sm{major}{minor}"


def triton_cache_dir() -> Path:
    """The folder Triton reads and writes compiled kernels in (TRITON_CACHE_DIR or default)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def export_kernels(src: Path, engine_dir: Path, tag: str) -> int:
    """Copy every Triton cache entry (one folder per key) of ``src`` into
    ``engine_dir/kernels/<tag>/``; returns how many."""
    dest = Path(engine_dir) / KERNELS_DIR / tag
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for entry in sorted(Path(src).iterdir()):
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, ignore=_SKIP, dirs_exist_ok=True)
            _relocate_groups(dest / entry.name, None)
            n += 1
    return n


def _relocate_groups(entry: Path, home: Path | None) -> None:
    """Point an entry's ``__grp__*.json`` files at ``home`` (the folder the entry will live
    in), or at bare file names when ``home`` is None (as shipped).

    Triton records a compiled kernel's files in a group file by absolute path and treats a
    group whose paths are missing as a cache miss: a cache copied elsewhere without this
    recompiles everything (an 8B engine on an empty Triton cache captured
    its graphs in 8.4-10.0 s with copied entries, 2.4-2.6 s with relocated ones)."""
    for grp in entry.glob("__grp__*.json"):
        try:
            data = json.loads(grp.read_text())
            paths = data["child_paths"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a group file Triton would read either: it recompiles that one
        data["child_paths"] = {
            name: (os.path.basename(p) if home is None else os.path.join(home, os.path.basename(p)))
            for name, p in paths.items()}
        grp.write_text(json.dumps(data))


def install_kernels(engine_dir: Path, tag: str, dest: Path | None = None) -> dict[str, int]:
    """Copy the engine's cache entries for ``tag`` into Triton's cache (``dest``, default the
    active one) where missing. Returns {"shipped": n, "installed": k}, empty when the engine
    ships none for this tag. A new entry lands whole or not at all (copied beside, renamed); an
    existing one Triton could not use (a folder made on a miss, group files naming missing
    files) is filled in."""
    src = Path(engine_dir) / KERNELS_DIR / tag
    if not src.is_dir():
        return {}
    dest = Path(dest) if dest is not None else triton_cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    shipped = installed = 0
    for entry in sorted(src.iterdir()):
        if not entry.is_dir():
            continue
        shipped += 1
        target = dest / entry.name
        if _usable(entry, target):
            continue
        if target.exists():  # an empty or broken entry (Triton makes the folder on a miss)
            try:
                _repair(entry, target)
                installed += 1
            except OSError:  # another process is writing it: Triton compiles it if need be
                pass
            continue
        part = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=dest))
        try:
            shutil.copytree(entry, part, dirs_exist_ok=True)
            _relocate_groups(part, target.resolve())
            os.replace(part, target)
            installed += 1
        except OSError:  # another process installed it first: theirs is as good
            shutil.rmtree(part, ignore_errors=True)
    return {"shipped": shipped, "installed": installed}


def _usable(entry: Path, target: Path) -> bool:
    """Whether the cache already holds ``entry`` as Triton would find it: every shipped file
    present, and every group file naming files that exist."""
    if not target.is_dir():
        return False
    if any(not (target / f.name).exists() for f in entry.iterdir() if f.is_file()):
        return False
    for grp in target.glob("__grp__*.json"):
        try:
            paths = json.loads(grp.read_text())["child_paths"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        if not all(os.path.exists(p) for p in paths):
            return False
    return True


def _repair(entry: Path, target: Path) -> None:
    """Fill an existing entry folder with the shipped files it lacks (and the shipped group
    files, relocated), each file copied beside and renamed into place."""
    for f in entry.iterdir():
        if f.is_file() and (f.name.startswith("__grp__") or not (target / f.name).exists()):
            tmp = target / f".{f.name}.kiln-tmp"
            shutil.copy2(f, tmp)
            os.replace(tmp, target / f.name)
    _relocate_groups(target, target.resolve())


def install_for_engine(engine_dir: Path, device) -> tuple[dict[str, int], float]:
    """What loading an engine on CUDA does: install its kernels for this machine's tag
    (``install_kernels``), saying on stderr why none were used when it ships some. Returns
    (the counts, empty when none apply; seconds). Never fails the start-up."""
    t0 = time.perf_counter()
    tag = cache_tag(device)
    try:
        kernels = install_kernels(engine_dir, tag)
    except OSError as e:  # e.g. a read-only Triton cache: compile as without them
        print(f"kiln: could not install the engine's compiled kernels ({e}); they are "
              "compiled at start-up instead", file=sys.stderr)
        kernels = {}
    other = shipped_tags(engine_dir)
    if not kernels and other and tag not in other:
        print(f"kiln: the engine ships compiled kernels for {', '.join(other)}, not for this "
              f"machine ({tag}); they are compiled at start-up instead (rebuild here with "
              "--precompile-kernels to ship them)", file=sys.stderr)
    return kernels, time.perf_counter() - t0


def shipped_kernels(engine_dir: Path) -> dict[str, int]:
    """How many compiled kernels an engine ships, per tag (``kiln inspect``)."""
    root = Path(engine_dir) / KERNELS_DIR
    if not root.is_dir():
        return {}
    return {t.name: sum(1 for e in t.iterdir() if e.is_dir())
            for t in sorted(root.iterdir()) if t.is_dir()}


def shipped_tags(engine_dir: Path) -> list[str]:
    """The tags an engine ships compiled kernels for (messages at load)."""
    return list(shipped_kernels(engine_dir))

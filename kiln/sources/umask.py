"""Files kiln writes keep the modes the user's umask asks for."""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask: from /proc on Linux, else by setting and restoring it (which
    races with other threads creating files, hence the /proc read first)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(root: Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``mkdir`` / ``open`` would:
    0o777 / 0o666 minus the umask. ``tempfile.mkdtemp`` / ``mkstemp`` make 0700 / 0600
    (private by design), which a directory renamed into place must not keep: a server
    running as another user could not read the engine."""
    mask = current_umask()
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)

"""Owner-only files and directories: what Tidekv writes that others on the host must not read
or replace (SSD blocks, logs). Directories 0700, files 0600, whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


def private_dir(path: Path) -> Path:
    """Makes ``path`` and every missing parent 0700 (an existing ``path`` is narrowed to 0700;
    existing parents are left as they are). Returns ``path``. OSError as ``mkdir`` raises it."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask
    os.chmod(path, DIR_MODE)
    return path

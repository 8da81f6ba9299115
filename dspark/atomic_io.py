"""Atomic file writes: write a temporary sibling, fsync, rename; a crash never leaves a torn file under the name."""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Callable

TEMP_MARK = ".tmp-"  # temporary siblings are named `.<name>.tmp-<pid>`


def temp_path(path: Path) -> Path:
    """The temporary sibling `path` is written to before the rename."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = True) -> Path:
    """Call `write(file)` on a temporary sibling, fsync it and rename it onto `path`; returns `path`."""
    p = Path(path)
    tmp = temp_path(p)
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p

"""Atomic file writes (a temp file in the target folder renamed over the target) and JSON files.

A reader never sees a half-written file, and a failed write leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from dspark.util.validate import check_path

T = TypeVar("T")


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(temp_path)`, then rename the temp file to `path` (parents created; the file gets the
    usual permissions, 0o666 less the umask, not mkstemp's private 0o600). ValueError naming the path when it is
    a folder or a parent is a file."""
    path = check_path("path", path)
    if path.is_dir():
        raise ValueError(f"cannot write {str(path)!r}: it is a folder; pass a file path")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"cannot write {str(path)!r}: {str(blocker)!r} is a file, not a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def temp_dir_beside(path: str | os.PathLike) -> Path:
    """A fresh folder next to `path` (same file system, so it can be renamed onto `path` atomically),
    with the usual permissions (0o777 less the umask, not mkdtemp's private 0o700)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` atomically."""
    return atomic_write(path, lambda p: p.write_text(text))


def write_json_atomic(path: str | os.PathLike, obj: object) -> Path:
    """Write strict JSON (no NaN) atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def load_json_as(path: str | os.PathLike, from_dict: Callable[[object], T]) -> T:
    """`from_dict` of a JSON file's contents; its ValueError / TypeError re-raised as a ValueError naming the file."""
    d = read_json(path)
    try:
        return from_dict(d)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def read_json(path: str | os.PathLike) -> object:
    """Parse a JSON file; a missing file -> FileNotFoundError, a folder or corrupt JSON (not UTF-8, not JSON) ->
    ValueError, each naming the path."""
    path = check_path("path", path)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder, not a JSON file")
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r}: no such JSON file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid JSON (not UTF-8 text: {err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err

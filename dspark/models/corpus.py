"""Text that ships with Python: the standard library's `.py` files, split into train, calibration and held-out.

Nothing is downloaded, and every machine with the same Python version holds the same files, so a seeded
draw of prompt windows is the same everywhere. Sorted by name, top-level file i is in
  - `train` when i % 10 != 0 (9 of 10): the draft distils on these, and on every `.py` file of the
    `TRAIN_PACKAGES` (stdlib packages that every CPython build ships; their test folders left out), so the
    draft sees more than twice the files and generalises across files rather than memorising few;
  - `calibration` when i % 20 == 10 (every twentieth): only the confidence head is fitted on these. The
    draft never trains on them, so their acceptance is that of unseen text; a head fitted on train files
    learns the higher acceptance of text the draft has partly memorised;
  - `heldout` when i % 20 == 0 (every twentieth): evaluation only (the demo, perf scripts, the manifest's
    acceptance). Nothing is fitted on them.
Calibration and held-out are the two halves of the original every-tenth held-out set, so a draft trained
before the calibration split existed never saw either.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from dspark.util.validate import check_int

SPLITS = ("train", "calibration", "heldout")
TRAIN_PACKAGES = ("asyncio", "collections", "concurrent", "ctypes", "curses", "dbm", "email", "html", "http",
                  "importlib", "json", "logging", "multiprocessing", "re", "sqlite3", "tomllib", "unittest", "urllib",
                  "venv", "wsgiref", "xml", "xmlrpc", "zoneinfo")
_SKIP_PARTS = {"test", "tests", "__pycache__"}
Encode = Callable[[str], list]  # text -> token ids


def stdlib_files(split: str) -> list[Path]:
    """Stdlib `.py` files of `split`: its top-level files sorted by name, then (train only) the
    `TRAIN_PACKAGES`' files; see the module docstring for which."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no .py files found under {root}: this Python has no standard library sources")
    keep = {"train": lambda i: i % 10 != 0, "calibration": lambda i: i % 20 == 10,
            "heldout": lambda i: i % 20 == 0}[split]
    top = [f for i, f in enumerate(files) if keep(i)]
    if split != "train":
        return top
    return top + [f for pkg in TRAIN_PACKAGES for f in sorted((root / pkg).rglob("*.py"))
                  if not _SKIP_PARTS & set(f.relative_to(root).parts)]


def prompt_windows(split: str, encode: Encode, count: int, length: int, seed: int,
                   max_chars: int = 60_000) -> Tensor:
    """[count, length] int64 token windows at seeded random starts, spread evenly over the split's files
    (each file's first `max_chars` characters)."""
    check_int("count", count, 1)
    check_int("length", length, 1)
    gen = torch.Generator().manual_seed(seed)
    files = stdlib_files(split)
    files = [files[i] for i in torch.randperm(len(files), generator=gen)]
    docs = [ids for ids in (encode(f.read_text(encoding="utf-8", errors="replace")[:max_chars]) for f in files)
            if len(ids) > length]
    if not docs:
        raise ValueError(f"no {split} file has more than length={length} tokens")
    per_doc = -(-count // len(docs))
    rows = []
    for ids in docs:
        starts = torch.randint(0, len(ids) - length, (per_doc,), generator=gen)
        rows += [ids[s: s + length] for s in starts.tolist()]
    return torch.tensor(rows[:count], dtype=torch.int64)

"""Before / after runs of a perf script side by side: each run's entry stored under its label in one JSON file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_labelled(path: str | Path, label: str, entry: Any) -> dict:
    """Merge `entry` under `label` into the JSON object at `path` (created if missing) and write it atomically
    (a temporary file renamed over it); returns the whole object."""
    out = Path(path)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[label] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)
    return data

"""The optional `models` extra: a missing package is named, with the install command, before any work."""
from __future__ import annotations

import importlib.util

INSTALL_EXTRA = "pip install 'dspark[models]'"


def require(*modules: str) -> None:
    """ImportError naming every module of `modules` that is not installed, and the extra that brings it."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"dspark.models needs {', '.join(missing)} (not installed); install it with "
                          f"{INSTALL_EXTRA}")

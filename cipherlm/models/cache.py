"""Where cipherlm keeps converted models and trained probes.

`$CIPHERLM_CACHE`, else `$XDG_CACHE_HOME/cipherlm`, else `~/.cache/cipherlm`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache directory (created on first use)."""
    root = os.environ.get("CIPHERLM_CACHE")
    if root:
        path = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else Path.home() / ".cache") / "cipherlm"
    path.mkdir(parents=True, exist_ok=True)
    return path

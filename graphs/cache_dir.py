"""Where paradecode keeps what it caches per user: `$XDG_CACHE_HOME/paradecode` (`~/.cache/paradecode` by default)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    """`$XDG_CACHE_HOME/paradecode/<parts>`, ~/.cache where XDG_CACHE_HOME is unset or empty (the XDG convention)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "paradecode", *parts)

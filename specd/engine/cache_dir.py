"""Where specd keeps what it builds once per machine: the default target's converted folder,
the few-row kernel's shared library."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """$SPECD_CACHE_DIR, else $XDG_CACHE_HOME/specd, else ~/.cache/specd."""
    explicit = os.environ.get("SPECD_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "specd"

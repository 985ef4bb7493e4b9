"""What the names of models and weight dtypes on the command line stand for: a model is the
default target's converted folder, a local folder, or a hub id.

Apart from specd.engine.loading (which imports torch and transformers, ~9 s on the 2-core machine) so
that `specd up` can refuse a missing folder before it starts anything, and the workers' settings
(and their --help) load, without that import.
"""

from __future__ import annotations

import pathlib

from specd.engine import default_target

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype's choices: torch dtypes of these names


def resolve(name: str) -> str:
    """What from_pretrained should load for `name`: the default target's name becomes its
    converted folder (converted on first use); a name that looks like a path must exist."""
    if name == default_target.NAME:
        return str(default_target.target_folder())
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or pathlib.Path(name).exists():
        path = pathlib.Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no such folder: {name} (a model is a local folder or a hub id like org/name)")
        return str(path)
    return name

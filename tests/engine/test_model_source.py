"""A model name is checked before transformers is called: a folder with no model in it, and a
hub id while the hub cannot be reached, fail at once with a message; a hub id already in the hub
cache loads from the cache alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from specd.engine.model_names import model_source
from tests.cli.test_cli_messages import _closed_port


def test_a_folder_without_config_json_holds_no_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no model: no config.json"):
        model_source(str(tmp_path))
    (tmp_path / "model-q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"holds no model: GGUF files \(model-q4.gguf\)"):
        model_source(str(tmp_path))


def test_a_model_folder_loads_as_it_is(tiny_pair):
    assert model_source(tiny_pair[0]) == (tiny_pair[0], {})


def _cache(hf_home, repo: str, folder: str) -> None:
    """`folder` as the hub cache holds `repo` after a download."""
    repo_dir = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    revision = "0" * 40
    shutil.copytree(folder, repo_dir / "snapshots" / revision)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)


def test_a_cached_hub_id_loads_from_the_cache_while_the_hub_is_unreachable(tiny_pair, tmp_path):
    _cache(tmp_path / "hf", "someorg/tiny", tiny_pair[0])
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": ""}
    code = ("from specd.engine.loading import load_causal_lm; from specd.engine.model_names import model_source; "
            "print(model_source('someorg/tiny')[1]); print(load_causal_lm('someorg/tiny').vocab_size)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["{'local_files_only':", "True}", str(_vocab(tiny_pair[0]))], run.stdout
    env["HF_HOME"] = str(tmp_path / "empty")
    run = subprocess.run([sys.executable, "-c", "from specd.engine.model_names import model_source; model_source('someorg/tiny')"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1 and "is not in the hub cache; pass a local model folder instead" in run.stderr


def _vocab(folder: str) -> int:
    from specd.engine.loading import load_causal_lm

    return load_causal_lm(folder).vocab_size

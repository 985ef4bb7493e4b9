"""Where the bundled demo pair lives: the default models of `specd up` and `specd bench`."""

import pathlib

MODELS_DIR = pathlib.Path(__file__).resolve().parent.parent / "models" / "demo"
DEMO_TARGET = str(MODELS_DIR / "target")
DEMO_DRAFT = str(MODELS_DIR / "draft")

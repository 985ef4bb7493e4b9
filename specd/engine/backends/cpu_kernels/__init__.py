"""The CPU backend's fast paths: prepacked linear layers, specd's few-row kernel, grouped attention."""

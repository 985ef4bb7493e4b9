"""The model engine: loading, KV caches, forwards, batch schedulers and device backends."""

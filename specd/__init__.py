"""specd: speculative speculative decoding over gRPC (shared core)."""

__version__ = "0.1.0"

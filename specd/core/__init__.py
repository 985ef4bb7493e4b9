"""Plain types and speculation math: no grpc, no transformers; the plain types import without torch."""

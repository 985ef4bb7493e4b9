"""Tracing and metrics for the three services: no torch."""

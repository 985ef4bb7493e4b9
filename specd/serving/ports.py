"""Binding a gRPC server's port, with one error for a port that cannot be had."""

from __future__ import annotations


def add_port(server, address: str, credentials=None) -> int:
    """The port `server` (grpc or grpc.aio) listens on at `address` (HOST:PORT; port 0: a free
    one), over TLS with `credentials`; OSError, one line for the command line, if it cannot bind."""
    try:
        bound = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    except RuntimeError:  # grpcio 1.85 raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind {address} (is the port taken?)")
    return bound

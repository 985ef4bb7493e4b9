"""A server never shares its port: gRPC binds with SO_REUSEPORT unless told not to, and then a
second server on a port already served starts without error and takes half its connections."""

from __future__ import annotations

import asyncio

import pytest

from specd.serving.server import create_server


def test_a_second_server_on_a_served_port_fails_to_start():
    async def two_servers():
        first, port, _ = create_server("127.0.0.1", 0, lambda server: None, [])
        await first.start()
        try:
            with pytest.raises(OSError, match="is the port taken"):  # `specd serve` prints it as one line
                create_server("127.0.0.1", port, lambda server: None, [])
        finally:
            await first.stop(None)
        # Once the first has stopped, the port serves again.
        again, bound, _ = create_server("127.0.0.1", port, lambda server: None, [])
        assert bound == port
        await again.stop(None)

    asyncio.run(two_servers())



def test_a_span_receiver_on_a_served_port_fails_to_start(tmp_path):
    """`specd trace --listen` where Jaeger already holds the port: one line, no traceback."""
    from specd.cli.trace_store import Receiver

    first = Receiver(tmp_path / "a.jsonl", port=0).start()
    try:
        with pytest.raises(OSError, match="is the port taken"):
            Receiver(tmp_path / "b.jsonl", port=first.port)
    finally:
        first.stop()

"""Server-sent events as OpenAI streams them: `data: JSON` events, ended by `data: [DONE]`."""

from __future__ import annotations

import json

from aiohttp import web

DONE = b"data: [DONE]\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    """A 200 event stream, its headers sent: from here on, errors travel as events."""
    response = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, data: dict) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


async def send_done(response: web.StreamResponse) -> None:
    await response.write(DONE)
    await response.write_eof()

"""The metrics port: prometheus_client's WSGI app on /metrics, 404 on every other path.

prometheus_client's own start_http_server answers every path with the metrics (and 200), so
a probe or a client that reaches the port by mistake (GET /health, GET /v1/models) would be
told it succeeded. The server here is the same standard-library WSGI server, one thread per
scrape, in front of the same app: /metrics is unchanged.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

METRICS_PATH = "/metrics"


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    # Daemon threads: a scrape in progress never holds up the service's exit.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        """No access log: Prometheus scrapes every few seconds."""


def metrics_only(app):
    """A WSGI app that passes GET /metrics (with its query) to `app` and answers 404 elsewhere."""

    def serve(environ, start_response):
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: this port serves {METRICS_PATH} only\n".encode()]
        return app(environ, start_response)

    return serve


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread (port 0: a free one).
    Stop it with .shutdown() and .server_close()."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    # The address family follows the host: "::" or an IPv6 address binds IPv6.
    server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
    server = make_server(address[0], port, metrics_only(make_wsgi_app(registry)), server_class, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server

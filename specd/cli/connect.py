"""How the CLI's clients reach a coordinator: TLS files and the bearer token, from flags or env.

`specd generate` and `specd bench --address` share these flags. Each reads its env var when not
given (SPECD_TLS_CA_FILE, SPECD_TLS_CERT_FILE, SPECD_TLS_KEY_FILE, SPECD_AUTH_TOKEN_FILE); the token
itself may also come from SPECD_AUTH_TOKEN.
"""

from __future__ import annotations

import argparse
import collections
import os

import grpc

from coordinator.auth import read_token
from specd.serving.tls import channel_credentials

TOKEN_ENV = "SPECD_AUTH_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--tls-ca-file", default=env("SPECD_TLS_CA_FILE", ""),
                        help="PEM CA that signed the coordinator's certificate: connect over TLS "
                             "(env SPECD_TLS_CA_FILE; default: none: plaintext, or with --tls-cert-file the system's CAs)")
    parser.add_argument("--tls-cert-file", default=env("SPECD_TLS_CERT_FILE", ""),
                        help="PEM client certificate, for a coordinator that requires one "
                             "(env SPECD_TLS_CERT_FILE; default: none)")
    parser.add_argument("--tls-key-file", default=env("SPECD_TLS_KEY_FILE", ""),
                        help="PEM private key of --tls-cert-file (env SPECD_TLS_KEY_FILE; default: none)")
    parser.add_argument("--auth-token-file", default=env("SPECD_AUTH_TOKEN_FILE", ""),
                        help=f"file holding the coordinator's token, sent as `authorization: Bearer TOKEN` "
                             f"(env SPECD_AUTH_TOKEN_FILE; default: the token itself in env {TOKEN_ENV}, else none)")


def auth_token(args: argparse.Namespace) -> str:
    """The token to send: from --auth-token-file, else SPECD_AUTH_TOKEN, else none ("")."""
    if args.auth_token_file:
        return read_token(args.auth_token_file)
    return os.environ.get(TOKEN_ENV, "").strip()


_CALL_FIELDS = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")


class _CallDetails(collections.namedtuple("_CallDetails", _CALL_FIELDS), grpc.ClientCallDetails):
    pass


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call on the channel it intercepts."""

    def __init__(self, token: str):
        self._pair = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._pair]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


def open_channel(address: str, args: argparse.Namespace):
    """A grpc.Channel to `address`: TLS if a CA or client certificate is given, the token on every call.

    Raises specd.core.config.ConfigError for a lone certificate or key, or a file that cannot be read.
    """
    credentials = channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    token = auth_token(args)
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, BearerToken(token)) if token else channel

"""TLS credentials from PEM files, for specd's servers, the coordinator's worker links and clients.

A server with a certificate and key serves TLS; with a client CA as well it asks every client for a
certificate and refuses one that CA did not sign (mTLS). A client with a CA file checks the
server's certificate against it (without one, against the system's roots) and, given a
certificate and key, presents them to an mTLS server.
"""

from __future__ import annotations

import ssl

import grpc

from specd.core.config import ConfigError


def read_pem(path: str, flag: str) -> bytes:
    """The file's bytes; a file that cannot be read is a ConfigError naming its flag."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if not data.strip():
        raise ConfigError(f"{flag} {path}: the file is empty")
    return data


def check_pair(cert_file: str, key_file: str, cert_flag: str, key_flag: str) -> None:
    """A certificate and its key come together or not at all."""
    if bool(cert_file) != bool(key_file):
        given, missing = (cert_flag, key_flag) if cert_file else (key_flag, cert_flag)
        raise ConfigError(f"{given} is set but {missing} is not: a certificate needs its private key and back")


def check_server_settings(cert_file: str, key_file: str, client_ca_file: str, prefix: str = "--tls") -> None:
    """ConfigError for settings that cannot make a TLS server: a lone cert or key, a CA without TLS."""
    check_pair(cert_file, key_file, f"{prefix}-cert-file", f"{prefix}-key-file")
    if client_ca_file and not cert_file:
        raise ConfigError(
            f"{prefix}-client-ca-file needs {prefix}-cert-file and {prefix}-key-file: "
            "client certificates (mTLS) are checked only on a TLS server"
        )


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials | None:
    """TLS (and, with a client CA, mTLS) server credentials; None for a plaintext server."""
    check_server_settings(cert_file, key_file, client_ca_file)
    if not cert_file:
        return None
    pair = (read_pem(key_file, "--tls-key-file"), read_pem(cert_file, "--tls-cert-file"))
    client_ca = read_pem(client_ca_file, "--tls-client-ca-file") if client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def channel_credentials(ca_file: str, cert_file: str, key_file: str, prefix: str = "--tls") -> grpc.ChannelCredentials | None:
    """Client credentials: TLS when any of the three is set, else None (a plaintext channel).

    `prefix` names the flags in errors: --tls for clients, --worker-tls for the coordinator's links.
    """
    check_pair(cert_file, key_file, f"{prefix}-cert-file", f"{prefix}-key-file")
    if not (ca_file or cert_file):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, f"{prefix}-ca-file") if ca_file else None,
        private_key=read_pem(key_file, f"{prefix}-key-file") if key_file else None,
        certificate_chain=read_pem(cert_file, f"{prefix}-cert-file") if cert_file else None,
    )


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext | None:
    """server_credentials' settings for a server outside gRPC (the coordinator's HTTP API): TLS, and
    with a client CA, mTLS; None for plaintext. The same files, read and checked as they are for gRPC."""
    check_server_settings(cert_file, key_file, client_ca_file)
    if not cert_file:
        return None
    for path, flag in ((cert_file, "--tls-cert-file"), (key_file, "--tls-key-file"), (client_ca_file, "--tls-client-ca-file")):
        if path:
            read_pem(path, flag)  # a missing or empty file is told by its flag
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
        if client_ca_file:
            context.load_verify_locations(cafile=client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        raise ConfigError(f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: not a usable certificate and key ({exc})") from None
    return context

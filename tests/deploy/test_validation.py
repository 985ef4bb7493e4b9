"""Every rendering is valid Kubernetes: validated with kubernetes-validate --strict (a misspelled
field fails) against the newest Kubernetes version it knows, and the validator is strict."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.manifests import kv, named, needs_tools, render

pytestmark = needs_tools


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


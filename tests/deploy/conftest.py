"""The `docs` fixture: the rendering of each kustomization in turn (see manifests.py)."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import KUSTOMIZATIONS, render


@pytest.fixture(params=KUSTOMIZATIONS)
def docs(request) -> tuple[dict, ...]:
    return render(request.param)

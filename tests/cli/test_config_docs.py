"""docs/configuration.md is exactly what tools/gen_config_docs.py renders from the config dataclasses."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

from coordinator.config import PROFILE_SETTINGS, CoordinatorConfig
from coordinator.profiles import PROFILES
from draft_service.config import DraftConfig
from specd.core.config import env_name, flag_name
from target_service.config import TargetConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "tools" / "gen_config_docs.py"
COMMITTED = ROOT / "docs" / "configuration.md"


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_committed_page_is_what_the_generator_renders(tmp_path):
    out = tmp_path / "configuration.md"
    result = generate("--out", str(out))
    assert result.returncode == 0, result.stderr
    assert COMMITTED.read_text() == out.read_text(), (
        "docs/configuration.md is stale: run python tools/gen_config_docs.py and commit it"
    )


def test_check_exits_1_on_a_stale_page_and_0_on_a_current_one(tmp_path):
    out = tmp_path / "configuration.md"
    assert generate("--check", "--out", str(out)).returncode == 1  # missing
    assert generate("--out", str(out)).returncode == 0
    assert generate("--check", "--out", str(out)).returncode == 0
    out.write_text(out.read_text().replace("SPECD_PORT", "SPECD_PORTS", 1))
    stale = generate("--check", "--out", str(out))
    assert stale.returncode == 1 and "gen_config_docs.py" in stale.stderr


def test_the_generator_does_not_import_torch():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('gen_config_docs', {str(GENERATOR)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.render()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _rows(text: str) -> dict[str, list[str]]:
    """Each section's table rows, by section heading."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line
            sections[current] = []
        elif line.startswith("| `--") and current:
            sections[current].append(line)
    return sections


def test_every_setting_of_every_service_has_a_row_with_its_flag_env_var_and_meaning():
    sections = _rows(COMMITTED.read_text())
    for role, config in (("coordinator", CoordinatorConfig), ("target", TargetConfig), ("draft", DraftConfig)):
        (rows,) = [rows for heading, rows in sections.items() if heading.endswith(f"`specd serve {role}`")]
        for field in dataclasses.fields(config):
            (row,) = [r for r in rows if r.startswith(f"| `{flag_name(field.name)}`")]
            assert f"`{env_name(field.name)}`" in row
            assert field.metadata["help"].split()[0] in row


def test_profile_defaults_list_every_profiles_value():
    (coordinator_rows,) = [rows for heading, rows in _rows(COMMITTED.read_text()).items() if "coordinator" in heading]
    for name in PROFILE_SETTINGS:
        (row,) = [r for r in coordinator_rows if r.startswith(f"| `{flag_name(name)}`")]
        assert "the device profile's" in row
        for device, profile in PROFILES.items():
            assert f"{device} `{getattr(profile, name)}`" in row, (name, device)

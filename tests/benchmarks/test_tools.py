"""The benchmarks and measurement tools (benchmarks/, recipes/, tools/) still run against the code they measure.

The README and docs quote figures these tools printed; a tool that no longer starts (a renamed
import, a changed signature) leaves those figures without a way to take them again. Figures are
not checked here, only that the tools run and say what they measured.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specd.engine.backends.cpu_kernels import prepacked_linear

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    str(path.relative_to(ROOT))
    for folder in ("benchmarks", "recipes", "tools")
    for path in (ROOT / folder).glob("*.py")
    if "__main__" in path.read_text() and "argparse" in path.read_text()
)


# A chat template for the tiny target, which has none: chat prompts need one.
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_tool_starts_and_explains_itself(script):
    run = _run(script, "--help", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "usage:" in run.stdout


def test_sweep_k_runs_each_k_through_a_stack_of_its_own(tiny_pair):
    target, draft = tiny_pair
    run = _run(
        "benchmarks/sweep_k.py", "--ks", "2,3", "--modes", "sd,ssd", "--num-prompts", "2", "--max-new-tokens", "6",
        "--target", target, "--draft", draft, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for cell in ("off  K=1", "sd   K=2", "sd   K=3", "ssd  K=2", "ssd  K=3"):
        assert cell in run.stdout, run.stdout
    assert "greedy outputs identical: True" in run.stdout


@pytest.mark.skipif(not prepacked_linear._ops_available(), reason="torch built without oneDNN")
def test_measure_prepack_times_every_copy(tiny_pair):
    target, _ = tiny_pair
    run = _run(
        "benchmarks/measure_prepack.py", "--model", target, "--lengths", "1,3", "--context", "8", "--trials", "2", timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.strip().startswith("plain:") for line in lines)
    assert any(line.strip().startswith("prepacked:") and "3 tokens" in line for line in lines), run.stdout
    kernel_runs = any(line.strip().startswith("kernel:") and "3 tokens" in line for line in lines)
    assert kernel_runs != ("does not run here" in run.stdout), run.stdout


def test_measure_decisions_times_a_batch_of_verifies_both_ways():
    run = _run("benchmarks/measure_decisions.py", "--vocab", "64", "--batches", "1,3", "--repeats", "3", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "together / alone" in line]
    assert [line.split(":")[0].split()[-1] for line in lines] == ["1", "3"], run.stdout


def test_measure_tree_times_the_draft_as_its_worker_serves_it(tiny_pair):
    _, draft = tiny_pair
    run = _run("benchmarks/measure_tree.py", "--builds", "--model", draft, "--k", "2", "--context", "8", "--repeats", "2", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "prepacked weights: True" in run.stdout
    assert "Propose of 2 tokens:" in run.stdout and "build B= 8" in run.stdout, run.stdout


def test_ab_stacks_runs_each_arm_through_a_stack_of_its_own(tiny_pair):
    target, draft = tiny_pair
    flags = f"--target {target} --draft {draft}"
    run = _run(
        "benchmarks/ab_stacks.py", "--arm", f"one={flags}", "--arm", f"two={flags} --no-pin-cpus", "--passes", "1",
        "--num-prompts", "2", "--max-new-tokens", "6", timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert "one: mean" in run.stdout and "two: mean" in run.stdout, run.stdout
    assert "greedy outputs identical: True" in run.stdout, run.stdout


def test_measure_ssd_measures_each_setting_through_a_coordinator_of_its_own(tiny_pair):
    target, draft = tiny_pair
    run = _run(
        "benchmarks/measure_ssd.py", "--target", target, "--draft", draft, "--settings", "off", "ssd:ssd_budget=4",
        "--max-new", "8", "--prompts", "2", timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["off"], ["ssd:ssd_budget=4"])}
    assert set(rows) == {"off", "ssd:ssd_budget=4"}, run.stdout
    assert float(rows["off"][4]) == 1.0  # target-only: one token a round
    assert 1.0 <= float(rows["ssd:ssd_budget=4"][4]) <= 5.0  # K = 4: at most 4 drafted plus the target's own


def test_ab_ssd_runs_each_arm_in_front_of_the_same_workers(tiny_pair):
    target, draft = tiny_pair
    run = _run(
        "benchmarks/ab_ssd.py", "--target", target, "--draft", draft, "--arm", "one=", "--arm", "two=--ssd-budget 4",
        "--passes", "1", "--num-prompts", "2", "--max-new-tokens", "6", timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert "one: mean" in run.stdout and "two: mean" in run.stdout, run.stdout
    assert "greedy outputs identical: True" in run.stdout, run.stdout


def test_measure_long_prompts_times_each_length_in_each_mode(tiny_pair):
    from tests.conftest import running_stack

    with running_stack(*tiny_pair) as stack:
        run = _run("benchmarks/measure_long_prompts.py", "--address", stack.address, "--lengths", "20,60", "--modes", "off,ssd",
                   "--max-new-tokens", "4", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and all(" tokens: " in line and "(ok, 4 tokens" in line for line in lines), run.stdout


def test_measure_long_prompts_times_chats_beside_a_long_prompt(tiny_pair, tmp_path):
    from tests.conftest import copy_target, running_stack

    target = copy_target(tiny_pair[0], tmp_path / "chat_target", chat_template=CHAT_TEMPLATE)
    with running_stack(target, tiny_pair[1]) as stack:
        run = _run("benchmarks/measure_long_prompts.py", "--address", stack.address, "--lengths", "20", "--beside", "150",
                   "--chats", "2", "--chat-mode", "sd", "--long-mode", "ssd", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    beside = run.stdout.splitlines()[-1]
    assert beside.startswith("a 32-token chat (sd) alone: ") and "beside a 150-token prompt (ssd), one after another: " in beside
    assert beside.count(" s") >= 3 and "the long prompt" in beside, run.stdout


EXACTNESS_PROMPTS = ["def main():\n", [{"role": "user", "content": "Read a line."}]]


def _exactness_prompts(tmp_path) -> pathlib.Path:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(EXACTNESS_PROMPTS))
    return prompts


def test_check_exactness_finds_the_stack_exact_and_counts_its_rounds(tiny_pair, tmp_path):
    """The target's EOS is a token it writes for the code prompt, so that prompt ends there, as
    transformers' generate ends it (the EOS included)."""
    from tests.conftest import copy_target, greedy_reference, load_reference, running_stack

    model, tokenizer = load_reference(tiny_pair[0])
    ends_code = greedy_reference(model, tokenizer.encode(EXACTNESS_PROMPTS[0]), 12)[3]
    target = copy_target(tiny_pair[0], tmp_path / "chat_target", eos_token_ids=[ends_code], chat_template=CHAT_TEMPLATE)
    report = tmp_path / "report.json"
    with running_stack(target, tiny_pair[1]) as stack:
        run = _run("benchmarks/check_exactness.py", "--address", stack.address, "--prompts-file", str(_exactness_prompts(tmp_path)),
                   "--reference", target, "--max-new-tokens", "12", "--json", str(report), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    lines = run.stdout.splitlines()
    for mode in ("off", "sd", "ssd"):
        assert any(line.startswith(f"{mode}: 2 of 2 identical, 0 near-tie, 0 diverge; tokens per round code ") for line in lines), run.stdout
    assert lines[-1] == "greedy outputs exact: yes"
    modes = json.loads(report.read_text())["modes"]
    assert modes["off"]["outcomes"][0]["tokens"] <= 4  # it ended at its EOS
    assert modes["off"]["tokens_per_round"]["all"] == 1.0 and modes["off"]["draft_tokens_per_round"]["all"] == 0.0
    assert modes["sd"]["draft_tokens_per_round"]["all"] > 0 and modes["sd"]["tokens_per_round"]["all"] >= 1.0
    assert all(outcome["tokens_per_round"] >= 1.0 for outcome in modes["sd"]["outcomes"])  # each prompt's own


def test_check_exactness_fails_against_another_model(tiny_pair, tmp_path):
    """A reference the stack does not serve (another seed's random weights): its greedy output differs."""
    from tests.conftest import copy_target, running_stack
    from tests.tiny_models import save_pair

    target = copy_target(tiny_pair[0], tmp_path / "chat_target", chat_template=CHAT_TEMPLATE)
    other = copy_target(save_pair(tmp_path / "other", seed=7)[0], tmp_path / "chat_other", chat_template=CHAT_TEMPLATE)
    with running_stack(target, tiny_pair[1]) as stack:
        run = _run("benchmarks/check_exactness.py", "--address", stack.address, "--prompts-file", str(_exactness_prompts(tmp_path)),
                   "--reference", other, "--modes", "off", "--max-new-tokens", "12", timeout=300)
    assert run.returncode == 1, run.stderr[-3000:] + run.stdout[-3000:]
    assert "off code prompt 1: diverges at generated position " in run.stdout, run.stdout
    assert run.stdout.splitlines()[-1].startswith("greedy outputs exact: NO, "), run.stdout


def test_check_exactness_under_a_repetition_penalty(tiny_pair, tmp_path):
    """--repetition-penalty goes to the stack and to the reference's generate alike."""
    from tests.conftest import copy_target, running_stack

    target = copy_target(tiny_pair[0], tmp_path / "chat_target", chat_template=CHAT_TEMPLATE)
    report = tmp_path / "report.json"
    with running_stack(target, tiny_pair[1]) as stack:
        run = _run("benchmarks/check_exactness.py", "--address", stack.address, "--prompts-file", str(_exactness_prompts(tmp_path)),
                   "--reference", target, "--max-new-tokens", "24", "--repetition-penalty", "1.5", "--json", str(report),
                   timeout=300)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert run.stdout.splitlines()[-1] == "greedy outputs exact: yes"
    assert json.loads(report.read_text())["repetition_penalty"] == 1.5


def test_the_gpu_check_finds_everything_it_uses():
    """tools/gpu_check.sh --dry-run: every file, flag and model the GPU check uses is here."""
    run = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "gpu_check --dry-run: ready" in run.stdout

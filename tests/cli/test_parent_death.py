"""specd/cli/parent_death.py: a service `specd up` started ends when `specd up` is killed, though it
runs in a process group of its own."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from specd.cli.parent_death import PARENT_PID_VARIABLE, stop_with_parent

# A parent that starts a child as `specd up` starts a service, prints the child's pid, then waits.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "from specd.cli.parent_death import stop_with_parent; import time; "
     "assert stop_with_parent(); print('armed', flush=True); time.sleep(120)"],
    env={**os.environ, "%s": str(os.getpid())}, process_group=0, stdout=sys.stdout,
)
print(child.pid, flush=True)
time.sleep(120)
""" % PARENT_PID_VARIABLE


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody has reaped yet."""
    status = pathlib.Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" in status.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_service_ends_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed"
        assert not _gone(child)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while not _gone(child):
            assert time.monotonic() < deadline, "the child outlived its killed parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_without_a_parent_named_nothing_is_arranged():
    assert not stop_with_parent({})
    assert not stop_with_parent({PARENT_PID_VARIABLE: "not a pid"})

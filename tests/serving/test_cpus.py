"""CPU affinity (specd/serving/cpus.py): the cpu-list format, `specd up`'s layout, and pinning a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specd.core.config import ConfigError
from specd.serving.cpus import (
    available_cpus,
    check_cpus,
    cpus_flags,
    describe_cpus,
    format_cpu_list,
    local_layout,
    parse_cpu_list,
    stack_layout,
)


def test_cpu_lists_parse_and_format_both_ways():
    assert parse_cpu_list("") == frozenset()
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0-2, 5,7-8") == {0, 1, 2, 5, 7, 8}
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_cpu_list({4}) == "4"
    for text in ("0-2,5,7-8", "1", "0,2,4"):
        assert format_cpu_list(parse_cpu_list(text)) == text


def test_a_layout_becomes_each_services_cpus_flag():
    layout = local_layout({0, 1, 2, 3}, 2)
    assert cpus_flags(layout) == {"target": ["--cpus", "0-1"], "draft": ["--cpus", "2-3"], "coordinator": ["--cpus", "2-3"]}
    assert cpus_flags({}) == {}


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "0-x"])
def test_a_bad_cpu_list_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--cpus"):
        parse_cpu_list(text)


def test_cpus_the_process_may_not_use_are_refused():
    assert available_cpus() == frozenset(os.sched_getaffinity(0))
    check_cpus("")
    check_cpus(format_cpu_list(os.sched_getaffinity(0)))
    with pytest.raises(ConfigError, match="not available"):
        check_cpus(str(max(os.sched_getaffinity(0)) + 1000))


def test_specd_up_gives_the_target_cpus_of_its_own_only_with_one_to_spare():
    assert local_layout({0, 1}, 1) == {"target": {0}, "draft": {1}, "coordinator": {1}}
    assert local_layout({4, 5, 6, 7}, 2) == {"target": {4, 5}, "draft": {6, 7}, "coordinator": {6, 7}}
    assert local_layout({0, 1}, 2) == {}  # the target's threads take every CPU
    assert local_layout({0}, 1) == {}
    assert local_layout({0, 1, 2}, 0) == {}
    assert stack_layout(0) == {}  # torch's own thread count: nothing to lay out
    assert (describe_cpus({0}), describe_cpus({1, 2, 3})) == ("CPU 0", "CPUs 1-3")


def test_pin_process_moves_the_threads_there_and_those_started_later():
    cpu = max(os.sched_getaffinity(0))
    script = f"""
import os, threading
from specd.serving.cpus import pin_process
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
pin_process("{cpu}")
after = threading.Thread(target=stop.wait); after.start()
print(sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}))
stop.set()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([(cpu,)])

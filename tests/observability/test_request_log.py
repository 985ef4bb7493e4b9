"""A request's record: one log line and one count, whichever way it ends first."""

from __future__ import annotations

import logging

from coordinator.request_log import RequestRecord
from coordinator.stats import RequestStats
from specd.observability.metrics import CoordinatorMetrics
from specd.v1 import coordinator_pb2 as pb


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coordinator.request_log"]


def test_a_finished_request_is_not_counted_again_as_failed(caplog):
    caplog.set_level(logging.INFO, logger="coordinator.request_log")
    metrics = CoordinatorMetrics()
    record = RequestRecord(request_id="r1", trace_id="ab" * 16, prompt_tokens=4)
    stats = RequestStats(requested_mode="sd", seed=1, rounds=3, ran_speculation=True, draft_tokens=8, accepted_tokens=6)
    record.add_stats(stats, generated_tokens=9)
    record.finished(metrics, pb.FINISH_REASON_STOP)
    record.failed(metrics, "CANCELLED")  # its caller left after the last message
    value = metrics.registry.get_sample_value
    assert value("specd_request_success_total", {"finished_reason": "stop"}) == 1
    assert value("specd_request_failure_total", {"code": "CANCELLED"}) is None
    assert value("specd_prompt_tokens_total") == 4 and value("specd_generation_tokens_total") == 9
    (line,) = _lines(caplog)
    assert line.startswith("request request_id=r1 mode=sd status=stop prompt_tokens=4 generated_tokens=9 rounds=3 acceptance=0.750 ")
    assert line.endswith(f"trace_id={'ab' * 16}")


def test_a_request_failed_before_it_ran_says_what_it_knows(caplog):
    caplog.set_level(logging.INFO, logger="coordinator.request_log")
    metrics = CoordinatorMetrics()
    record = RequestRecord()
    record.failed(metrics, "RESOURCE_EXHAUSTED")
    record.failed(metrics, "CANCELLED")
    value = metrics.registry.get_sample_value
    assert value("specd_request_failure_total", {"code": "RESOURCE_EXHAUSTED"}) == 1
    assert value("specd_request_failure_total", {"code": "CANCELLED"}) is None
    assert value("specd_prompt_tokens_total") == 0
    (line,) = _lines(caplog)
    assert line.startswith("request request_id=- mode=- status=RESOURCE_EXHAUSTED prompt_tokens=0 generated_tokens=0 rounds=0 ")
    assert line.endswith("trace_id=-")


def test_a_caller_id_cannot_split_the_line(caplog):
    caplog.set_level(logging.INFO, logger="coordinator.request_log")
    RequestRecord(request_id="a b\nrequest request_id=forged").failed(None, "INVALID_ARGUMENT")
    (line,) = _lines(caplog)
    assert "\n" not in line
    assert line.startswith('request request_id="a b\\nrequest request_id=forged" mode=- status=INVALID_ARGUMENT ')


def test_outcomes_are_counted_by_label():
    metrics = CoordinatorMetrics()
    metrics.observe_success("stop", prompt_tokens=5, generation_tokens=3)
    metrics.observe_success("length", prompt_tokens=7, generation_tokens=16)
    metrics.observe_failure("INVALID_ARGUMENT")
    metrics.observe_failure("INVALID_ARGUMENT")
    value = metrics.registry.get_sample_value
    assert value("specd_request_success_total", {"finished_reason": "stop"}) == 1
    assert value("specd_request_success_total", {"finished_reason": "length"}) == 1
    assert value("specd_request_failure_total", {"code": "INVALID_ARGUMENT"}) == 2
    assert value("specd_prompt_tokens_total") == 12
    assert value("specd_generation_tokens_total") == 19

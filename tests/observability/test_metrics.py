"""After known runs, each service's /metrics (scraped over HTTP) equals the sums of the
responses' own stats."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specd.observability.metrics import CoordinatorMetrics, WorkerMetrics
from specd.v1 import common_pb2
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, running_stack


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _request(mode, temperature: float = 0.0) -> pb.GenerateRequest:
    # K = 1: every round proposes 0 or 1 token, so drafts (rounds that proposed) = draft tokens.
    return pb.GenerateRequest(
        prompt="for i in range(10):",
        max_new_tokens=10,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=temperature, seed=7),
        speculation=pb.SpeculationParams(mode=mode, num_speculative_tokens=1),
    )


def test_counters_equal_the_responses_stats(tiny_pair):
    on = {"metrics_port": 0}
    with running_stack(*tiny_pair, coordinator_overrides=on, draft_overrides=on, target_overrides=on) as stack:
        stub = stack.stub()
        requests = [
            _request(pb.SPECULATION_MODE_SD),
            _request(pb.SPECULATION_MODE_SD, temperature=0.8),
            _request(pb.SPECULATION_MODE_OFF),
        ]
        stats = [stub.Generate(r, timeout=CALL_TIMEOUT_S).stats for r in requests]
        coordinator = scrape(stack.coordinator.metrics.port)
        target = scrape(stack.target.metrics.port)
        draft = scrape(stack.draft.metrics.port)

    def c(name, **labels):
        return coordinator[(name, tuple(sorted(labels.items())))]

    draft_tokens = sum(s.draft_tokens for s in stats)
    assert draft_tokens > 0
    assert c("specd_spec_decode_num_drafts_total") == draft_tokens
    assert c("specd_spec_decode_num_draft_tokens_total") == draft_tokens
    assert c("specd_spec_decode_num_accepted_tokens_total") == sum(s.accepted_tokens for s in stats)
    assert c("specd_spec_decode_num_accepted_tokens_per_pos_total", position="0") == sum(
        s.accepted_per_position[0] for s in stats if s.accepted_per_position
    )
    assert c("specd_speculation_cache_hits_total") == sum(s.cache_hits for s in stats)
    assert c("specd_speculation_cache_misses_total") == sum(s.cache_misses for s in stats)
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert c(f"specd_{histogram}_seconds_count") == len(requests)
    assert c("specd_requests_in_flight") == 0

    rounds = sum(s.rounds for s in stats)
    assert target[("specd_forward_seconds_count", (("op", "verify"),))] == rounds
    assert draft[("specd_forward_seconds_count", (("op", "propose"),))] == draft_tokens
    assert ("specd_active_sessions", ()) in target and ("specd_active_sessions", ()) in draft


def test_registries_are_per_service():
    # Two of each in one process: no "Duplicated timeseries" error, and counts stay apart.
    first, second = CoordinatorMetrics(), CoordinatorMetrics()
    WorkerMetrics(), WorkerMetrics()
    first.num_drafts.inc(3)
    assert first.registry.get_sample_value("specd_spec_decode_num_drafts_total") == 3
    assert second.registry.get_sample_value("specd_spec_decode_num_drafts_total") == 0

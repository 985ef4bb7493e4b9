"""8 greedy requests at once give each the tokens it gives alone (near-tie rule as always):
a request's output does not depend on what runs beside it."""

from __future__ import annotations

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, load_reference, request, running_stack

CONCURRENT = 8
MODES = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD)
# Prompts of different lengths, so that the requests' contexts differ as they run side by side.
PROMPTS = ([5, 17, 33], [8, 41, 12, 90, 3], [200, 7], [64, 65, 66, 67, 68, 69, 70], [11], [300, 12, 9, 4], [77, 78], [19, 23, 29, 31, 37, 41])


def _requests() -> list[pb.GenerateRequest]:
    return [
        request(PROMPTS[i], mode=MODES[i % len(MODES)], max_new_tokens=16 + 4 * (i % 3), k=2 + i % 3)
        for i in range(CONCURRENT)
    ]


def test_concurrent_greedy_requests_match_their_runs_alone(tiny_pair):
    model, _ = load_reference(tiny_pair[0])
    with running_stack(*tiny_pair) as stack:
        stub = stack.stub()
        alone = [list(stub.Generate(r, timeout=CALL_TIMEOUT_S).token_ids) for r in _requests()]
        calls = [stub.Generate.future(r, timeout=CALL_TIMEOUT_S) for r in _requests()]
        together = [call.result() for call in calls]
    for message, want, got in zip(_requests(), alone, together):
        assert got.finish_reason == pb.FINISH_REASON_LENGTH
        assert_greedy_equal_or_near_tie(model, list(message.prompt_token_ids.ids), list(got.token_ids), want)

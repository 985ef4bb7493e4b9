"""A draft worker with no room for a request's session (its --max-sessions, shared with other
coordinators) is up, not down: that request's rounds go target-only, saying why, while the draft
keeps serving the sessions it holds, and the next request drafts as before."""

from __future__ import annotations

import logging

import grpc

from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, request, running_stack

PROMPT = [5, 17, 42, 99, 7, 3]


def _hold_the_drafts_session(draft_port: int) -> draft_pb2_grpc.DraftWorkerStub:
    channel = grpc.insecure_channel(f"127.0.0.1:{draft_port}")
    draft = draft_pb2_grpc.DraftWorkerStub(channel)
    committed = common_pb2.CommittedTokens(start=0, token_ids=PROMPT)
    draft.Prefill(draft_pb2.DraftPrefillRequest(session_id="holder", committed=committed), timeout=CALL_TIMEOUT_S)
    return draft


def test_a_draft_without_room_for_a_session_is_not_taken_for_down(tiny_pair, caplog):
    caplog.set_level(logging.WARNING, logger="coordinator.draft_link")
    with running_stack(*tiny_pair, draft_overrides={"max_sessions": 1}) as stack:
        draft = _hold_the_drafts_session(stack.draft.port)
        stub = stack.stub()
        refused = stub.Generate(request(PROMPT, mode=pb.SPECULATION_MODE_SD, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
        assert len(refused.token_ids) == 8 and refused.stats.draft_tokens == 0
        assert "no room for a session" in refused.stats.fallback_reason
        # Never taken for down (which would send every request target-only until its probe answers).
        assert not [r for r in caplog.records if "decoding target-only until the draft answers" in r.getMessage()]
        draft.EndSession(draft_pb2.DraftEndSessionRequest(session_id="holder"), timeout=CALL_TIMEOUT_S)
        drafted = stub.Generate(request(PROMPT, mode=pb.SPECULATION_MODE_SD, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
        assert drafted.stats.draft_tokens > 0 and not drafted.stats.fallback_reason
        assert drafted.token_ids == refused.token_ids  # greedy: the same tokens either way

"""The OpenAI-compatible HTTP API, called with the official `openai` client, httpx and curl: the same
request path as Generate (same text, admission, tracing, auth), OpenAI's shapes and error JSON."""

from __future__ import annotations

import asyncio
import http.client
import json
import secrets
import shutil
import subprocess
import types
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from tests.conftest import CALL_TIMEOUT_S, copy_target, running_stack
from tests.stack import RunnerGate, prefill_gate, wait_for
from tests.tracing import in_memory_tracing

TOKEN = "specd-test-" + secrets.token_hex(16)
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
# Greedy, past any EOS, in sd: what the gRPC reference below asks too.
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True, "speculation_mode": "sd"}}


@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    """A tiny pair whose target has a chat template; its coordinator serves HTTP on a free port,
    requires the token, runs one request at a time with one more queued, and records its spans."""
    folder = tmp_path_factory.mktemp("http_api")
    target = copy_target(tiny_pair[0], folder / "target", chat_template=CHAT_TEMPLATE)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    providers, exporters = in_memory_tracing()
    overrides = {"http_port": 0, "auth_token_file": str(token_file), "max_concurrent_requests": 1, "max_queued_requests": 1}
    with running_stack(target, tiny_pair[1], coordinator_overrides=overrides, tracer_providers=providers) as stack:
        yield stack, exporters["coordinator"]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    stack, _ = served
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=CALL_TIMEOUT_S)


def _model(stack) -> str:
    return stack.coordinator.servicer.facts.model


def _generate(stack, **fields) -> pb.GenerateResponse:
    """The same request over gRPC."""
    fields = {"max_new_tokens": 12, "ignore_eos": True, "speculation": pb.SpeculationParams(mode=pb.SPECULATION_MODE_SD), **fields}
    message = pb.GenerateRequest(**fields)
    message.sampling.temperature = 0.0
    with grpc.insecure_channel(stack.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return stub.Generate(message, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=CALL_TIMEOUT_S)


def _idle(stack) -> bool:
    """No request holds a place and neither worker holds a session."""
    sessions = [len(service.servicer.runner.sessions) for service in (stack.target, stack.draft)]
    return stack.coordinator.servicer.admission.running == 0 and sessions == [0, 0]


def test_a_greedy_chat_returns_what_generate_returns(served, client):
    stack, _ = served
    answer = client.chat.completions.create(model=_model(stack), messages=MESSAGES, logprobs=True, **GREEDY)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    reference = _generate(stack, messages=chat, return_logprobs=True)
    assert answer.choices[0].message.content == reference.text and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length" and answer.object == "chat.completion"
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (reference.usage.prompt_tokens, 12)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    specd = answer.model_extra["specd"]
    assert specd["stats"]["mode"] == "sd" and specd["stats"]["rounds"] >= 1 and len(specd["trace_id"]) == 32
    assert answer.id == "chatcmpl-" + specd["request_id"]
    tokens = answer.choices[0].logprobs.content
    assert [t.logprob for t in tokens] == pytest.approx(list(reference.logprobs)) and len(tokens) == 12
    assert "".join(t.token for t in tokens) == reference.text  # each token's own text, in order


def test_a_streamed_chat_is_the_same_text_with_a_usage_chunk_last(served, client):
    stack, _ = served
    whole = client.chat.completions.create(model=_model(stack), messages=MESSAGES, **GREEDY)
    chunks = list(client.chat.completions.create(model=_model(stack), messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_a_completion_returns_what_generate_returns_with_its_logprobs(served, client):
    stack, _ = served
    answer = client.completions.create(model=_model(stack), prompt="def add(a, b):", logprobs=0, **GREEDY)
    reference = _generate(stack, prompt="def add(a, b):", return_logprobs=True)
    choice = answer.choices[0]
    assert choice.text == reference.text and answer.object == "text_completion"
    assert choice.logprobs.token_logprobs == pytest.approx(list(reference.logprobs))
    assert len(choice.logprobs.tokens) == answer.usage.completion_tokens == 12
    assert answer.usage.prompt_tokens == reference.usage.prompt_tokens


def test_models_lists_the_target(served, client):
    stack, _ = served
    assert [model.id for model in client.models.list()] == [_model(stack)]


class Answer:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def _call(stack, method: str, path: str, body=None, headers=None) -> Answer:
    """One plain HTTP call (urllib), its status and body whatever the status."""
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    call = urllib.request.Request(stack.http_url + path, data=content, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(call, timeout=CALL_TIMEOUT_S) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read().decode())


def _post(stack, path: str, body, headers=None) -> Answer:
    return _call(stack, "POST", path, body, {"Authorization": f"Bearer {TOKEN}", **(headers or {})})


BAD = {
    "not json": (b"{", None),
    "not an object": ([1, 2], None),
    "temperature not a number": ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    "negative temperature": ({"messages": MESSAGES, "temperature": -1}, None),
    "n of 2": ({"messages": MESSAGES, "n": 2}, "n"),
    "no messages": ({"model": "x"}, "messages"),
    "max_tokens of 0": ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    "max_tokens past the limit": ({"messages": MESSAGES, "max_tokens": 10**6}, None),
    "a message without text": ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    "an unknown speculation mode": ({"messages": MESSAGES, "speculation_mode": "fast"}, "speculation_mode"),
    "tools": ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    "stream_options without stream": ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_body_is_a_400_in_openais_error_shape(served, case):
    stack, _ = served
    body, param = BAD[case]
    response = _post(stack, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "INVALID_ARGUMENT", param)


def test_an_unknown_model_is_a_404(served, client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert refused.value.body["code"] == "NOT_FOUND" and refused.value.body["param"] == "model"


@pytest.mark.parametrize("key", [None, "not-the-token"])
def test_without_the_token_every_api_route_is_a_401_and_health_stays_open(served, key):
    stack, _ = served
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        response = _call(stack, method, path, {"messages": MESSAGES} if method == "POST" else None, headers)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "UNAUTHENTICATED" and TOKEN not in response.text
    assert _call(stack, "GET", "/health").json() == {"status": "ok"}


def test_a_full_server_is_a_429_with_admissions_message(served, client):
    stack, _ = served
    admission = stack.coordinator.servicer.admission
    gate = prefill_gate(stack.target.servicer.runner)
    try:
        held = [_generate_in_background(stack)]
        assert gate.held.wait(CALL_TIMEOUT_S)
        held.append(_generate_in_background(stack))
        assert wait_for(lambda: (admission.running, admission.waiting) == (1, 1), 10.0)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=_model(stack), prompt="x", max_tokens=2)
        assert refused.value.body["code"] == "RESOURCE_EXHAUSTED" and refused.value.body["type"] == "rate_limit_error"
        assert refused.value.body["message"] == "specd is serving its maximum of 1 requests with 1 queued; retry later"
    finally:
        gate.release()
    assert [len(call.result(CALL_TIMEOUT_S).token_ids) for call in held] == [12, 12]


def _generate_in_background(stack):
    channel = grpc.insecure_channel(stack.address)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    message = pb.GenerateRequest(prompt="def f():", max_new_tokens=12, ignore_eos=True,
                                 speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_SD))
    return stub.Generate.future(message, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=CALL_TIMEOUT_S)


def test_a_traceparent_header_joins_the_callers_trace(served, client):
    stack, exporter = served
    caller_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    answer = client.chat.completions.create(
        model=_model(stack), messages=MESSAGES, extra_headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"}, **GREEDY
    )
    assert answer.model_extra["specd"]["trace_id"] == caller_trace
    roots = [s for s in exporter.get_finished_spans() if s.name == "llm_request" and s.context.trace_id == int(caller_trace, 16)]
    assert len(roots) == 1 and roots[0].parent.span_id == int(caller_span, 16)
    assert roots[0].attributes["url.path"] == "/v1/chat/completions"
    rounds = [s for s in exporter.get_finished_spans() if s.name == "spec_round" and s.parent.span_id == roots[0].context.span_id]
    assert rounds, "the request's rounds are not under its llm_request span"


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_gets_server_sent_events_ending_in_done(served):
    stack, _ = served
    body = {"model": _model(stack), "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    result = subprocess.run(
        ["curl", "-sSN", "--max-time", "60", stack.http_url + "/v1/completions", "-H", f"Authorization: Bearer {TOKEN}",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=90,
    )
    assert result.returncode == 0, result.stderr
    events = [line for line in result.stdout.split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["specd"]["stats"]["mode"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == _generate(stack, prompt="def add(a, b):", max_new_tokens=6).text


def test_a_client_that_goes_away_mid_stream_ends_its_request(served):
    stack, _ = served
    body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True, "speculation_mode": "sd"}
    connection = http.client.HTTPConnection("127.0.0.1", stack.coordinator.http.port, timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body),
                           {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        assert not _idle(stack)
    finally:
        connection.close()
    # Closed after its first event: the request ends, its place is let go and both sessions are ended.
    assert wait_for(lambda: _idle(stack), 10.0), "the request outlived its client"


def test_before_the_target_answers_requests_are_a_503_and_health_says_loading():
    async def answers() -> list[Answer]:
        # No target listens there: the coordinator serves its ports and waits for it.
        config = CoordinatorConfig(port=0, metrics_port=-1, http_port=0, target_address="127.0.0.1:1")
        service = await start_coordinator(config)
        stack = types.SimpleNamespace(http_url=f"http://127.0.0.1:{service.http.port}")
        try:
            calls = [("POST", "/v1/completions", {"prompt": "x"}), ("GET", "/v1/models", None), ("GET", "/health", None)]
            return [await asyncio.to_thread(_call, stack, *call) for call in calls]
        finally:
            await service.stop(0)

    completion, models, health = asyncio.run(answers())
    for answer in (completion, models):
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("UNAVAILABLE", "service_unavailable_error")
        assert error["message"] == "the coordinator is waiting for the target worker at 127.0.0.1:1"
    assert (health.status_code, health.json()) == (503, {"status": "loading"})


def test_a_failure_mid_stream_is_an_error_event_then_done(served):
    """After the 200 has gone, a failure travels as a `data: {"error": ...}` event, then `data: [DONE]`:
    here the target worker stops while the draft proposes (no call is cut), so the next Verify
    finds it gone."""
    stack, _ = served
    body = {"prompt": "def add(a, b):", "max_tokens": 400, "ignore_eos": True, "stream": True, "speculation_mode": "sd"}
    connection = http.client.HTTPConnection("127.0.0.1", stack.coordinator.http.port, timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        gate = RunnerGate(stack.draft.servicer.runner, "propose_job")
        try:
            assert gate.held.wait(CALL_TIMEOUT_S)
            stack.stop_target()
        finally:
            gate.release()
        events = [line.decode().strip() for line in response.read().split(b"\n\n") if line.strip()]
    finally:
        connection.close()
        stack.restart_target()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("UNAVAILABLE", "service_unavailable_error") and error["message"]


def test_a_stream_whose_first_round_fails_keeps_its_http_status(served):
    """The 200 of a stream waits for its first round: a target that is down is a 503 in OpenAI's
    error shape, as for a request that does not stream."""
    stack, _ = served
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "stream": True, "speculation_mode": "sd"}
    stack.stop_target()
    try:
        call = urllib.request.Request(stack.http_url + "/v1/completions", json.dumps(body).encode(),
                                      {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(call, timeout=CALL_TIMEOUT_S)
        error = json.loads(refused.value.read())["error"]
    finally:
        stack.restart_target()
    assert refused.value.code == 503 and error["code"] == "UNAVAILABLE"


def test_a_streamed_completion_counts_its_text_offsets_from_the_start_and_says_usage_null(served):
    stack, _ = served
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "speculation_mode": "sd", "stream_options": {"include_usage": True}}
    answer = _post(stack, "/v1/completions", body)
    events = [json.loads(e.removeprefix("data: ")) for e in answer.text.split("\n\n") if e and e != "data: [DONE]"]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 12
    text = ""
    for event in events[:-1]:
        choice = event["choices"][0]
        if choice["logprobs"] is not None and choice["logprobs"]["tokens"]:
            assert choice["logprobs"]["text_offset"][0] == len(text)
        text += choice["text"]
    assert sum(1 for e in events[:-1] if e["choices"][0]["logprobs"] and e["choices"][0]["logprobs"]["tokens"]) > 1


def test_a_401_names_the_bearer_scheme(served):
    stack, _ = served
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(stack.http_url + "/v1/models", timeout=CALL_TIMEOUT_S)
    assert denied.value.code == 401 and denied.value.headers["WWW-Authenticate"] == "Bearer"

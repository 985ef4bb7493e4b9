"""The end of a generation and chat prompts: each of a target's several EOS ids stops it (unless
ignore_eos), chat messages are rendered by the target's template, every chat role reaches it, and
chat messages without a template are refused. A second stack serves a target copy with both."""

from __future__ import annotations

import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    copy_target,
    greedy_reference,
    request,
    running_stack,
)
from tests.e2e.trio.conftest import MAX_NEW, PROMPTS

CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def eos_setup(tiny_pair, reference, tmp_path_factory):
    """A target copy whose generation_config lists two EOS ids, each the greedy continuation's
    token at some point of one prompt (and absent before it), plus a chat template."""
    _, _, prompts, greedy = reference
    a, b = greedy[PROMPTS[0]], greedy[PROMPTS[3]]
    # Prompt A must first meet x at ja and prompt B first meet y at jb (neither meets the other id first).
    ja, jb = next(
        (i, j)
        for i in range(3, len(a))
        for j in range(3, len(b))
        if a[i] not in a[:i] and b[j] not in b[:j] and a[i] != b[j] and b[j] not in a[: i + 1] and a[i] not in b[: j + 1]
    )
    x, y = a[ja], b[jb]
    folder = copy_target(tiny_pair[0], tmp_path_factory.mktemp("eos_target"), eos_token_ids=[x, y], chat_template=CHAT_TEMPLATE)
    with running_stack(folder, tiny_pair[1]) as running:
        yield running, {PROMPTS[0]: (ja, x), PROMPTS[3]: (jb, y)}, folder


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF], ids=["sd", "off"])
def test_each_eos_id_stops_generation(eos_setup, reference, mode):
    running, stops, _ = eos_setup
    _, _, prompts, greedy = reference
    stub = running.stub()
    for text, (index, eos) in stops.items():
        response = stub.Generate(request(prompts[text], mode=mode, ignore_eos=False, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_STOP
        assert response.stop_reason == "eos"
        assert list(response.token_ids) == greedy[text][: index + 1]
        assert response.token_ids[-1] == eos
        assert response.usage.completion_tokens == index + 1
        # ignore_eos runs on to the full length.
        full = stub.Generate(request(prompts[text], mode=mode, ignore_eos=True, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        assert full.finish_reason == pb.FINISH_REASON_LENGTH and list(full.token_ids) == greedy[text]


def test_chat_messages_use_the_template(eos_setup, reference):
    running, _, folder = eos_setup
    model, tokenizer, _, _ = reference
    stub = running.stub()
    messages = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="def add(a, b):")]
    rendered = "<system>Be brief.\n<user>def add(a, b):\n<assistant>"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    message = request(None, max_new_tokens=16)
    message.messages.messages.extend(messages)
    response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
    assert response.usage.prompt_tokens == len(ids)
    assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), greedy_reference(model, ids, 16))


def test_every_chat_role_is_rendered(eos_setup):
    """system, user, assistant and tool (OpenAI's roles that templates render) all reach the template."""
    running, _, folder = eos_setup
    from transformers import AutoTokenizer

    roles = ["system", "user", "assistant", "tool", "user"]
    message = request(None, max_new_tokens=2)
    message.messages.messages.extend(pb.ChatMessage(role=role, content=f"{role} {i}") for i, role in enumerate(roles))
    rendered = "".join(f"<{role}>{role} {i}\n" for i, role in enumerate(roles)) + "<assistant>"
    response = running.stub().Generate(message, timeout=CALL_TIMEOUT_S)
    assert response.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(folder).encode(rendered, add_special_tokens=False))


def test_chat_messages_without_a_template_are_refused(stub):
    import grpc

    message = request(None, max_new_tokens=4)
    message.messages.messages.append(pb.ChatMessage(role="user", content="hi"))
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(message, timeout=CALL_TIMEOUT_S)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template" in raised.value.details()

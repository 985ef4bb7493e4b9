"""End to end over real gRPC: a coordinator, a target worker and a draft worker with tiny models.

One stack serves every test in this folder (package scope: started once for all its files), with
the target run alone in plain transformers for the greedy references the tests compare against.
"""

from __future__ import annotations

import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, greedy_reference, load_reference, running_stack

MAX_NEW = 48
PROMPTS = [
    "def add(a, b):",
    "for i in range(10):\n",
    "class Point:\n    def",
    "The quick brown fox",
    "import os\nimport sys\n",
    "while True:\n    line =",
    "x = 1\ny = 2\nprint(x +",
    "Speculative decoding keeps",
]


@pytest.fixture(scope="package")
def stack(tiny_pair):
    with running_stack(*tiny_pair) as running:
        yield running


@pytest.fixture(scope="package")
def stub(stack):
    return stack.stub()


@pytest.fixture(scope="package")
def reference(tiny_pair):
    """The target in plain transformers, its tokenizer, and greedy references per prompt."""
    model, tokenizer = load_reference(tiny_pair[0])
    prompts = {text: tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS}
    greedy = {text: greedy_reference(model, ids, MAX_NEW) for text, ids in prompts.items()}
    return model, tokenizer, prompts, greedy


def collect_stream(stub, message) -> tuple[list[int], list[int], str, list[pb.GenerateStreamResponse]]:
    """Collect a stream: (all token ids, tokens per message, text, messages)."""
    messages = list(stub.GenerateStream(message, timeout=CALL_TIMEOUT_S))
    ids = [t for m in messages for t in m.token_ids]
    return ids, [len(m.token_ids) for m in messages], "".join(m.text for m in messages), messages

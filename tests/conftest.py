"""Shared fixtures and helpers: the tiny model pair, service stacks, greedy references."""

from __future__ import annotations

import contextlib
import copy
import pathlib

import pytest
import torch

from specd.core.logits import penalize_repeats
from specd.v1 import common_pb2
from specd.v1 import coordinator_pb2 as pb
from tests.stack import ServiceStack
from tests.tiny_models import save_pair

CALL_TIMEOUT_S = 60.0  # every test RPC has a deadline: a hang fails instead of blocking the suite
NEAR_TIE = 1e-4  # the contract's top-2 logit gap below which a greedy divergence is acceptable


@pytest.fixture
def one_thread():
    """A worker's setting under specd up: one torch thread (specd's few-row kernel serves one thread only)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny Llama target and its perturbed draft, sharing one tokenizer, built once per run."""
    return save_pair(tmp_path_factory.mktemp("tiny_models"))


@contextlib.contextmanager
def running_stack(target: str, draft: str | None, **kwargs):
    stack = ServiceStack(target, draft, **kwargs).start()
    try:
        yield stack
    finally:
        stack.close()


def load_reference(folder: str):
    """The target as plain transformers would run it (fp32, CPU), with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@torch.inference_mode()
def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """Plain transformers greedy decoding of the target alone, run on past any EOS (as ignore_eos does).

    Not `min_new_tokens`: that masks the EOS logits, so wherever EOS is the argmax it picks the
    runner-up, which is not what the target alone decodes. With no eos_token_id in the generation
    config (passing None is overridden by the model's defaults), generate neither stops nor masks.
    """
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        input_ids = torch.tensor([prompt_ids])
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
            **generate_kwargs,
        )
    finally:
        model.generation_config = saved
    tokens = output[0, len(prompt_ids) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


@torch.inference_mode()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Raw logits [len(ids), V] of one full forward (no cache)."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def assert_greedy_equal_or_near_tie(
    model, prompt_ids: list[int], got: list[int], want: list[int], repetition_penalty: float = 1.0
) -> None:
    """Greedy output must equal the reference, except after a near-tie, which is shown here.

    At the first divergence the target's top-2 logit gap, from a full forward over the reference
    prefix (under the request's repetition penalty), must be below NEAR_TIE; anything else is a bug.
    """
    assert len(got) == len(want), f"got {len(got)} tokens, want {len(want)}"
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    history = prompt_ids + want[:first]
    logits = penalize_repeats(full_logits(model, history)[-1:], history, [[]], repetition_penalty)[0]
    top2 = torch.topk(logits, 2)
    gap = float(top2.values[0] - top2.values[1])
    assert gap < NEAR_TIE, (
        f"greedy output diverges at generated position {first} ({got[first]} vs reference {want[first]}) "
        f"where the target's top-2 logit gap is {gap:.3g}, not a near-tie (< {NEAR_TIE})"
    )
    assert {got[first], want[first]} <= set(top2.indices.tolist()), "the divergent tokens are not the top two"


def request(
    prompt_ids: list[int] | None = None,
    *,
    prompt: str | None = None,
    mode: int = pb.SPECULATION_MODE_SD,
    k: int | None = 4,
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = True,
    **fields,
) -> pb.GenerateRequest:
    """A GenerateRequest with the fields the tests vary."""
    sampling = common_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    speculation = pb.SpeculationParams(mode=mode)
    if k is not None:
        speculation.num_speculative_tokens = k
    message = pb.GenerateRequest(
        sampling=sampling, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, speculation=speculation, **fields
    )
    if prompt is not None:
        message.prompt = prompt
    elif prompt_ids is not None:
        message.prompt_token_ids.ids.extend(prompt_ids)
    return message


def copy_target(source: str, dest: pathlib.Path, eos_token_ids=None, chat_template: str | None = None) -> str:
    """A copy of a saved target with another generation_config EOS and/or a chat template."""
    model, tokenizer = load_reference(source)
    if eos_token_ids is not None:
        model.generation_config.eos_token_id = eos_token_ids
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return str(dest)

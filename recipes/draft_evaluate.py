"""The evaluate stage: greedy tokens per round at K of the exported draft, as the draft worker
serves it and alone, on held-out prompts or a prompts file; how much of the target's output its
vocabulary covers; and the step times of draft and target at one thread."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import draft_data
from draft_generate import stdlib_folder
from draft_target import load_target


def greedy_tokens_per_round(runner, prompt_ids: list[int], target_tokens: list[int], k: int) -> tuple[int, int]:
    """Greedy speculative decoding replayed against the target's own greedy continuation:
    (tokens, rounds). Each round is the draft worker's own Propose (its session, KV rollback and
    forward) after the committed tokens; it keeps the matching prefix plus the target's next
    token, as a greedy verify would."""
    from specd.core.sampling import SamplingSettings
    from specd.engine.step_batcher import run_alone

    position, rounds = 0, 0
    while position < len(target_tokens):
        committed = prompt_ids + target_tokens[:position]
        proposal = runner.propose_job("evaluate", 0, committed, min(k, len(target_tokens) - position), SamplingSettings(), 1)
        drafted = run_alone(proposal).draft_tokens
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == target_tokens[position + accepted]:
            accepted += 1
        position += accepted + 1
        rounds += 1
    runner.end_session("evaluate")
    return len(target_tokens), rounds


def step_ms(model, context: int, repeats: int) -> float:
    """Median one-token forward time (ms) at `context` tokens of KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 8000, (1, context)), past_key_values=cache, use_cache=True)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - started) * 1000)
            cache.crop(-1)  # transformers 5: a negative count of tokens to drop
    return sorted(times)[len(times) // 2]


def replay_heldout(loaded_draft, heldout: dict[str, list[tuple[list[int], list[int]]]], copy, k: int, label: str) -> dict:
    """Tokens per round of greedy SD at K over the held-out (prompt, target continuation) pairs of each kind."""
    from draft_service.runner import DraftModelRunner
    from specd.engine.session_cache import SessionStore

    runner = DraftModelRunner(loaded_draft, SessionStore(max_sessions=1, idle_timeout_s=3600.0), max_support=1, copy=copy)
    report = {"kinds": {}}
    for kind, pairs in heldout.items():
        per_prompt = [greedy_tokens_per_round(runner, prompt, continuation, k) for prompt, continuation in pairs]
        tokens, rounds = sum(t for t, _ in per_prompt), sum(r for _, r in per_prompt)
        report["kinds"][kind] = {"prompts": len(pairs), "tokens": tokens, "rounds": rounds, "tokens_per_round": tokens / rounds,
                                 "per_prompt": [round(t / r, 3) for t, r in per_prompt]}
        print(f"{label}, {kind}: {tokens / rounds:.3f} tokens per round at K = {k} over {len(pairs)} prompts", flush=True)
    kinds = report["kinds"].values()
    report["tokens_per_round"] = sum(v["tokens"] for v in kinds) / sum(v["rounds"] for v in kinds)
    coded = [report["kinds"][kind] for kind in ("code", "chat") if kind in report["kinds"]]
    report["code_and_chat_tokens_per_round"] = sum(v["tokens"] for v in coded) / sum(v["rounds"] for v in coded)
    print(f"{label}: {report['code_and_chat_tokens_per_round']:.3f} tokens per round on code and chat, {report['tokens_per_round']:.3f} on all", flush=True)
    return report


def vocab_coverage(draft_model, heldout: dict[str, list[tuple[list[int], list[int]]]]) -> dict[str, float]:
    """Per kind, the fraction of the target's continuation tokens that the draft's output layer
    covers (a draft can never draft the others; copy drafting can). 1.0 for a full-vocabulary draft."""
    token_ids = getattr(draft_model.lm_head, "token_ids", None)  # [N], a reduced-vocabulary draft's
    if token_ids is None:
        return {kind: 1.0 for kind in heldout}
    coverage = {}
    for kind, pairs in heldout.items():
        emitted = torch.tensor([t for _, continuation in pairs for t in continuation], dtype=torch.long)  # [T]
        coverage[kind] = torch.isin(emitted, token_ids.cpu()).float().mean().item() if emitted.numel() else 1.0
    return coverage


def heldout_continuations(args, target, tokenizer, eos: set[int]) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The recipe's held-out prompts of each kind and the target's greedy continuation of each."""
    sources = draft_data.read_split(args.heldout_percent, heldout=True, root=stdlib_folder(args))
    definitions = draft_data.all_definitions(sources)
    heldout = {}
    # Prompt kinds by (chat, self) fractions; the held-out self-written requests come from a seed no shard uses.
    for kind, chat_fraction, self_fraction in (("code", 0.0, 0.0), ("chat", 1.0, 0.0), ("self", 0.0, 1.0)):
        prompts = draft_data.make_prompts(tokenizer, sources, definitions, args.eval_prompts, args.seed + 7, chat_fraction, args.max_prompt_tokens, self_fraction)
        draft_data.write_self_chats(target, tokenizer, prompts, definitions, args.seed + 8)
        ids = [tokenizer(p["text"])["input_ids"] for p in prompts]
        rows = draft_data.continue_batch(target, ids, args.eval_new_tokens, 0.0, 1.0, 1, eos, tokenizer.pad_token_id, 0)
        heldout[kind] = [(p, r["generated_ids"]) for p, r in zip(ids, rows)]
    return heldout


def file_continuations(path: Path, target, tokenizer, new_tokens: int, eos: set[int]) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The prompts of a JSON list (draft_data.prompts_file_ids) and the target's greedy
    continuation of each (to its end of turn, `new_tokens` at most), by kind."""
    by_kind: dict[str, list[list[int]]] = {}
    for kind, ids in draft_data.prompts_file_ids(path, tokenizer):
        by_kind.setdefault(kind, []).append(ids)
    continued = {}
    for kind, ids in by_kind.items():
        rows = draft_data.continue_batch(target, ids, new_tokens, 0.0, 1.0, 1, eos, tokenizer.pad_token_id, 0)
        continued[kind] = [(p, r["generated_ids"]) for p, r in zip(ids, rows)]
    return continued


def stage_evaluate(args) -> dict:
    from draft_service.config import DraftConfig
    from draft_service.copy_drafting import OFF
    from specd.engine.default_target import NAME
    from specd.engine.loading import load_causal_lm

    target, tokenizer = load_target(1)
    loaded_draft = load_causal_lm(str(args.out))
    eos = {int(tokenizer.convert_tokens_to_ids("<|im_end|>")), int(tokenizer.eos_token_id)}
    if args.prompts_file:
        heldout = file_continuations(args.prompts_file, target, tokenizer, args.eval_new_tokens, eos)
    else:
        heldout = heldout_continuations(args, target, tokenizer, eos)
    # As the draft worker serves it (copy drafting at its defaults), and the draft model alone.
    served = DraftConfig().copy_drafting()
    report = {"target": NAME, "k": args.eval_k, "copy_ngram": served.ngram, "copy_max_ngram": served.max_ngram, "copy_weight": served.weight,
              "prompts": str(args.prompts_file) if args.prompts_file else "held-out"}
    report.update(replay_heldout(loaded_draft, heldout, served, args.eval_k, "served"))
    report["draft_alone"] = replay_heldout(loaded_draft, heldout, OFF, args.eval_k, "draft alone")
    report["vocab_coverage"] = vocab_coverage(loaded_draft.model, heldout)
    for kind, covered in report["vocab_coverage"].items():
        print(f"draft vocabulary, {kind}: covers {covered:.4f} of the target's continuation tokens", flush=True)
    torch.set_num_threads(1)
    draft_ms, target_ms = step_ms(loaded_draft.model, 256, args.eval_repeats), step_ms(target, 256, args.eval_repeats)
    report.update(draft_step_ms=draft_ms, target_step_ms=target_ms, c=draft_ms / target_ms)
    print(f"served, all: {report['tokens_per_round']:.3f} tokens per round; draft step {draft_ms:.2f} ms, target step {target_ms:.2f} ms, c = {draft_ms / target_ms:.3f}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)  # evaluate may be the only stage run in this folder
    (args.work / "evaluation.json").write_text(json.dumps(report, indent=2))
    return report

#!/usr/bin/env python
"""Measure the bundled demo pair in-process (no servers): plain transformers + torch.

On prompts cut from the held-out stdlib files (models/demo/heldout_files.txt), one
thread per model, fp32, greedy:

* speculative decoding with K draft tokens per round and the standard greedy rule
  (accept draft tokens while each equals the target's argmax, then emit the target's
  own token), KV caches on both models, rolled back on rejection; reports the mean
  tokens per round (accepted + 1) and the per-token acceptance rate;
* checks that the speculative output is identical to the target's own greedy output
  (``target.generate(do_sample=False)``) on every prompt;
* one-token step times of the draft and of the target at a given context (default
  256 tokens, KV cache in use; median over repeats, the two models timed alternately
  so that they see the same machine load) and c = draft step / target step.

    python tools/measure_demo.py --json /tmp/demo-measure.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def heldout_prompts(tokenizer, heldout_list: Path, n: int, prompt_tokens: int, min_file_tokens: int):
    """n prompts of prompt_tokens tokens, each cut at a line start mid-way through a held-out file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [l.strip() for l in heldout_list.read_text().splitlines() if l.strip() and not l.startswith("#")]
    candidates = []
    for rel in rels:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_file_tokens:
            candidates.append((rel, text))
    if len(candidates) < n:
        raise SystemExit(f"only {len(candidates)} held-out files have >= {min_file_tokens} tokens")
    step = len(candidates) / n
    prompts = []
    for i in range(n):
        rel, text = candidates[int(i * step)]
        nl = text.find("\n", len(text) // 3)
        ids = tokenizer(text[nl + 1 :], add_special_tokens=False)["input_ids"][:prompt_tokens]
        prompts.append((rel, ids))
    return prompts


def crop_to(cache: DynamicCache, length: int):
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.no_grad()
def speculative_greedy(target, draft, prompt: list[int], new_tokens: int, k: int, eos_id):
    """Greedy speculative decoding. Returns (generated ids, tokens emitted per round)."""
    tokens = list(prompt)
    t_cache, d_cache = DynamicCache(), DynamicCache()
    # both caches hold every committed token except the last one
    target(torch.tensor([tokens[:-1]]), past_key_values=t_cache, use_cache=True)
    draft(torch.tensor([tokens[:-1]]), past_key_values=d_cache, use_cache=True)
    per_round = []
    end = len(prompt) + new_tokens
    while len(tokens) < end:
        kk = min(k, end - len(tokens) - 1)  # never propose past the length limit
        proposal = []
        if kk > 0:
            crop_to(d_cache, len(tokens) - 1)
            feed = tokens[d_cache.get_seq_length():]
            for _ in range(kk):
                logits = draft(torch.tensor([feed]), past_key_values=d_cache, use_cache=True).logits
                nxt = int(logits[0, -1].argmax())
                proposal.append(nxt)
                feed = [nxt]
        verify = torch.tensor([[tokens[-1]] + proposal])
        t_logits = target(verify, past_key_values=t_cache, use_cache=True).logits[0]
        t_choice = t_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == t_choice[accepted]:
            accepted += 1
        emitted = proposal[:accepted] + [t_choice[accepted]]
        if eos_id is not None and eos_id in emitted:
            emitted = emitted[: emitted.index(eos_id) + 1]
        tokens.extend(emitted)
        per_round.append(len(emitted))
        crop_to(t_cache, len(tokens) - 1)
        if eos_id is not None and tokens[-1] == eos_id:
            break
    return tokens[len(prompt):][:new_tokens], per_round


@torch.no_grad()
def target_greedy(target, prompt: list[int], new_tokens: int, eos_id):
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def step_times(target, draft, context: list[int], repeats: int, block: int, warmup: int = 10):
    """Median one-token step time (s) of each model after a `len(context)`-token prefill.

    block > 1: the models are timed in alternating blocks of `block` consecutive steps
    (each model's step time with its own weights warm in cache, as when the draft runs
    its K steps back to back; the alternation spreads machine load over both).
    block == 1: the models alternate every step (each step starts after the other
    model has run, i.e. with caches disturbed: a pessimistic figure for the draft)."""
    caches = {}
    for name, m in (("draft", draft), ("target", target)):
        c = DynamicCache()
        m(torch.tensor([context[:-1]]), past_key_values=c, use_cache=True)
        caches[name] = c
    last = torch.tensor([[context[-1]]])
    times = {"draft": [], "target": []}
    for name, m in (("draft", draft), ("target", target)):
        for _ in range(warmup):
            m(last, past_key_values=caches[name], use_cache=True)
            crop_to(caches[name], len(context) - 1)
    for _ in range(max(1, repeats // block)):
        for name, m in (("draft", draft), ("target", target)):
            c = caches[name]
            for _ in range(block):
                t0 = time.perf_counter()
                m(last, past_key_values=c, use_cache=True)
                times[name].append(time.perf_counter() - t0)
                crop_to(c, len(context) - 1)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    here = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(here / "models/demo/target"))
    p.add_argument("--draft", default=str(here / "models/demo/draft"))
    p.add_argument("--heldout", default=str(here / "models/demo/heldout_files.txt"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("-k", "--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--context", type=int, default=256, help="context for the step-time measurement")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--block", type=int, default=20, help="consecutive steps per model when timing")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--samples", type=int, default=3, help="greedy completions to print")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.target)
    tok.model_max_length = 10**9  # prompts are cut from whole files
    tok_d = AutoTokenizer.from_pretrained(args.draft)
    if tok.get_vocab() != tok_d.get_vocab():
        raise SystemExit("target and draft tokenizers differ")
    target, draft = load(args.target), load(args.draft)
    eos_id = tok.eos_token_id
    prompts = heldout_prompts(tok, Path(args.heldout), args.prompts, args.prompt_tokens,
                              min_file_tokens=max(3 * args.prompt_tokens, args.context * 2))

    rows, all_rounds, identical, samples = [], [], True, []
    t_spec = t_ref = 0.0
    for rel, ids in prompts:
        t0 = time.perf_counter()
        ref = target_greedy(target, ids, args.new_tokens, eos_id)
        t1 = time.perf_counter()
        spec, rounds = speculative_greedy(target, draft, ids, args.new_tokens, args.k, eos_id)
        t2 = time.perf_counter()
        t_ref += t1 - t0
        t_spec += t2 - t1
        same = spec == ref
        identical &= same
        all_rounds += rounds
        if len(samples) < args.samples:
            samples.append({"file": rel, "prompt_tail": tok.decode(ids[-48:]), "completion": tok.decode(ref[:64])})
        rows.append({"file": rel, "new_tokens": len(spec), "rounds": len(rounds),
                     "tokens_per_round": len(spec) / len(rounds), "identical": same})
        print(f"{rel:<40} {len(spec):>4} tokens {len(rounds):>3} rounds "
              f"{len(spec)/len(rounds):5.2f} tok/round  identical={same}", flush=True)

    # step times at a fixed context cut from the first long-enough held-out prompt source
    ctx_prompts = heldout_prompts(tok, Path(args.heldout), 1, args.context, min_file_tokens=args.context * 2)
    st = step_times(target, draft, ctx_prompts[0][1], args.repeats, block=args.block)
    st1 = step_times(target, draft, ctx_prompts[0][1], args.repeats, block=1)
    c_alt = st1["draft"] / st1["target"]
    full_rounds = [r for r in all_rounds]
    tokens_per_round = sum(full_rounds) / len(full_rounds)
    proposed = accepted = 0
    for r in full_rounds:
        accepted += r - 1
        proposed += args.k
    c = st["draft"] / st["target"]
    res = {
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "k": args.k,
        "threads_per_model": args.threads,
        "mean_tokens_per_round": tokens_per_round,
        "acceptance_per_token": accepted / proposed,
        "identical_to_target_greedy": identical,
        "context": args.context,
        "draft_step_ms": st["draft"] * 1e3,
        "target_step_ms": st["target"] * 1e3,
        "c": c,
        "step_block": args.block,
        "alternating_every_step": {"draft_step_ms": st1["draft"] * 1e3, "target_step_ms": st1["target"] * 1e3,
                                   "c": c_alt},
        "expected_speedup": tokens_per_round / (1 + args.k * c),
        "wall_target_greedy_s": t_ref,
        "wall_speculative_s": t_spec,
        "measured_speedup": t_ref / t_spec,
        "per_prompt": rows,
        "samples": samples,
        "torch": torch.__version__,
    }
    for smp in samples:
        print(f"\n--- {smp['file']} (prompt tail, then |>>> greedy completion, 64 tokens)\n"
              f"{smp['prompt_tail']}|>>>{smp['completion']}")
    print()
    print(f"{'metric':<38}{'value':>12}   target")
    print(f"{'mean tokens per round (K=%d)' % args.k:<38}{tokens_per_round:>12.3f}   >= 3.3")
    print(f"{'acceptance per draft token':<38}{accepted / proposed:>12.3f}")
    print(f"{'draft step @%d ctx (ms, median)' % args.context:<38}{st['draft'] * 1e3:>12.3f}")
    print(f"{'target step @%d ctx (ms, median)' % args.context:<38}{st['target'] * 1e3:>12.3f}")
    print(f"{'c = draft / target':<38}{c:>12.3f}   <= 0.15")
    print(f"{'c, models alternating every step':<38}{c_alt:>12.3f}   "
          f"({st1['draft'] * 1e3:.2f} / {st1['target'] * 1e3:.2f} ms)")
    print(f"{'identical to target greedy':<38}{str(identical):>12}   True")
    print(f"{'expected speedup tpr/(1+K*c)':<38}{res['expected_speedup']:>12.2f}")
    print(f"{'measured wall speedup (this run)':<38}{res['measured_speedup']:>12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

"""Cost of one speculation-tree step on CPU: B branch tokens over a shared prefix (4-D mask)
against a one-token draft step and against copying the prefix KV cache per branch.

    python benchmarks/measure_tree.py [--model models/smollm2-draft] [--threads 1] [--context 256]
    python benchmarks/measure_tree.py --builds                                 # whole builds vs Propose
    python benchmarks/measure_tree.py --builds --no-prepack-weights            # the same, weights as loaded

--builds loads the draft as its worker serves it (draft_service.server.load_runner: prepacked
weights unless --no-prepack-weights) and times the runner's own Propose and Speculate.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from draft_service.tree_mask import tree_mask  # noqa: E402
from specd.engine.default_pair import DEFAULT_DRAFT  # noqa: E402


def _timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


@torch.inference_mode()
def main() -> None:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from specd.engine.loading import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a draft folder; default: a random 128x2 Llama, vocab 4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--builds", action="store_true", help="time whole speculation builds (K tokens per branch, --k) against Propose")
    parser.add_argument("--k", type=int, default=4, help="--builds: draft tokens per Propose and per branch")
    parser.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="--builds: prepack the draft's weights as its worker does")
    parser.add_argument("--few-row-kernel", action=argparse.BooleanOptionalAction, default=True,
                        help="--builds: products of 2-8 rows on specd's kernel, as its worker takes them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.builds:
        _builds(args)
        return
    if args.model:
        model = load_causal_lm(args.model).model
    else:
        config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
        model = LlamaForCausalLM(config).eval()
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (1, args.context))
    cache = DynamicCache()
    model(input_ids=prefix, past_key_values=cache, use_cache=True)
    length = cache.get_seq_length()

    def one_token():
        model(input_ids=torch.tensor([[1]]), past_key_values=cache, use_cache=True)
        cache.crop(-1)

    base = _timed(one_token, args.repeats)
    print(f"one-token draft step, context {args.context}: {base:.2f} ms")
    for branches in (4, 8, 16, 24, 32):
        offsets = torch.randint(0, 4, (branches,))
        mask = tree_mask(model.config, length - 4 + offsets, length, 1, torch.float32)  # [1, 1, B, L + B]
        position_ids = (length - 4 + offsets).unsqueeze(0)  # [1, B]

        def tree_step():
            model(input_ids=torch.ones(1, branches, dtype=torch.long), attention_mask=mask,
                  position_ids=position_ids, past_key_values=cache, use_cache=True)
            cache.crop(-branches)

        def copied_step():
            # The alternative: B copies of the prefix cache, one token each, as a batch of B.
            batched = copy.deepcopy(cache)
            batched.batch_repeat_interleave(branches)
            model(input_ids=torch.ones(branches, 1, dtype=torch.long), past_key_values=batched, use_cache=True)

        tree = _timed(tree_step, args.repeats)
        copied = _timed(copied_step, args.repeats)
        print(f"B={branches:2d}: tree step {tree:6.2f} ms ({tree / base:4.2f}x one token)   "
              f"copied-prefix batch {copied:6.2f} ms ({copied / base:4.2f}x)")


def _builds(args) -> None:
    """The draft worker's runner in-process, loaded as the worker loads it: one Propose of K
    tokens, then builds of B branches, K tokens each."""
    import threading

    from draft_service.config import DraftConfig
    from draft_service.server import load_runner
    from specd.core.fanout import allocate
    from specd.core.sampling import SamplingSettings
    from specd.engine.step_batcher import run_alone

    config = DraftConfig(model=args.model or DEFAULT_DRAFT, threads=args.threads, prepack_weights=args.prepack_weights,
                         few_row_kernel=args.few_row_kernel)
    runner = load_runner(config)
    k = args.k
    prompt = list(range(10, 10 + args.context))
    greedy = SamplingSettings(temperature=0.0)
    runner.prefill("s", 0, prompt)
    drafts = run_alone(runner.propose_job("s", 0, prompt, k, greedy, 0)).draft_tokens
    propose = _timed(lambda: run_alone(runner.propose_job("s", 0, prompt, k, greedy, 0)), args.repeats)
    print(f"prepacked weights: {args.prepack_weights}, few-row kernel: {args.few_row_kernel}, context {args.context}, {args.threads} thread(s)")
    print(f"Propose of {k} tokens: {propose:.2f} ms")
    for budget in (0, 1, 2, 4, 8, 16, 24):
        fanout = allocate(0.87, k, budget, runner.loaded.vocab_size, 0.5)
        tree = lambda: run_alone(runner.speculate_job("s", 0, prompt, drafts, k, fanout, greedy, 0, 1.0, [], threading.Event()))  # noqa: E731
        ms = _timed(tree, args.repeats)
        print(f"build B={budget:2d} {fanout}: {ms:.2f} ms")


if __name__ == "__main__":
    main()

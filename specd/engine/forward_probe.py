"""Whether a second way of running a model's forward gives bitwise the logits of the first:
the load-time probe of specd's forward paths (specd/engine/lean_llama.py, specd/engine/backends/cpu_kernels/grouped_attention.py)."""

from __future__ import annotations

import torch

from specd.engine.kv_cache import GrowingKVCache


@torch.inference_mode()
def same_logits(reference, candidate, vocab_size: int, device) -> bool:
    """A probe of a second way to run a model's forward: a prefill of 7 tokens, a step of 3 (which
    carries a mask) and one of 1, each fed to `reference` and to `candidate` on fresh caches of
    their own. True if every step's logits are bitwise equal. Both are called as
    forward(input_ids=..., past_key_values=..., use_cache=True) and return an output with .logits."""
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, vocab_size, (1, n), generator=generator).to(device) for n in (7, 3, 1)]  # [1, n] each
    reference_cache, candidate_cache = GrowingKVCache(), GrowingKVCache()
    for ids in steps:
        want = reference(input_ids=ids, past_key_values=reference_cache, use_cache=True).logits  # [1, n, V]
        got = candidate(input_ids=ids, past_key_values=candidate_cache, use_cache=True).logits
        if not torch.equal(want, got):
            return False
    return True

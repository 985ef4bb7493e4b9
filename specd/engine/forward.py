"""One model forward over new tokens on top of a session's KV cache."""

from __future__ import annotations

import time

import torch


@torch.inference_mode()
def forward_logits(model, cache, tokens: list[int], num_logits: int) -> tuple[torch.Tensor, float]:
    """Feed `tokens` after what `cache` holds; return (logits [num_logits, V] float32, ms).

    The logits are those after the last `num_logits` tokens fed, on the model's device: the code
    that reads them decides what crosses to the host.
    """
    device = model.device
    input_ids = torch.tensor([tokens], dtype=torch.long, device=device)  # [1, L]
    started = time.perf_counter()
    output = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=num_logits)
    logits = output.logits[0, -num_logits:].float()  # [num_logits, V]
    return logits, elapsed_ms(started, device)


def elapsed_ms(started: float, device) -> float:
    """Milliseconds since `started` (time.perf_counter()), once the device has finished what was
    queued on it (a GPU runs a forward after the call returns)."""
    synchronize(device)
    return (time.perf_counter() - started) * 1000.0


def synchronize(device) -> None:
    """Wait for what is queued on a GPU (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(model) -> None:
    """One throwaway forward so that the first request does not pay for lazy initialisation."""
    from specd.engine.kv_cache import GrowingKVCache

    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=model.device), past_key_values=GrowingKVCache())


def prefill_session(model, session, start: int, tokens: list[int]) -> tuple[int, float]:
    """Cache every committed token but the last (the next forward feeds it); (cached, forward ms)."""
    _, feed = session.sync(start, tokens)
    forward_ms = 0.0
    if len(feed) > 1:
        try:
            _, forward_ms = forward_logits(model, session.cache, feed[:-1], 1)
        except BaseException:
            session.reset()  # failed part-way: some layers may hold the new entries, others not
            raise
        session.extend(feed[:-1])
    return len(session.cached_tokens), forward_ms

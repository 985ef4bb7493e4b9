"""`specd bench --concurrency 1,4,8`: the service modes with that many client streams at once.

At each level C, C client threads share one queue of requests (the prompt set C times over, so
each stream sends as many requests as the prompt set holds, on average) and send them as
GenerateStream calls, each taking the next request as soon as its last one has ended. A
level's modes do not each run once, one after the other: the machine's speed drifts over the
minutes a mode takes, and that drift would land on one mode alone (it once showed ssd at 0.83x
off where, side by side on one stack, the two were equal). Each mode's requests
run in two halves instead, the modes in order and then in reverse (off, sd, ssd, ssd, sd, off),
so that a drift steady over the level cancels out. A mode's tokens/s is its tokens over the
wall time of its halves, each from its first request's start to its last one's end; latency
is a request's start to its last message, TTFT its start to the first message that carries
tokens.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time

from benchmarks.bench import specd_request


@dataclasses.dataclass(frozen=True)
class StreamedRequest:
    """One request's outcome as its client saw it."""

    tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    error: str = ""  # the status that ended it, if it failed


def parse_levels(text: str) -> list[int]:
    """`1,4,8` as [1, 4, 8]; ValueError naming --concurrency if any is not a whole number >= 1."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"--concurrency {text!r}: give whole numbers >= 1, comma-separated, like 1,4,8")
    return list(dict.fromkeys(levels))  # each level once, in the order given


def stream_request(stub, request, timeout_s: float = 600.0) -> StreamedRequest:
    """One GenerateStream call, read to its end."""
    import grpc

    started = time.perf_counter()
    tokens, ttft_s = 0, None
    try:
        for message in stub.GenerateStream(request, timeout=timeout_s):
            if message.token_ids and ttft_s is None:
                ttft_s = time.perf_counter() - started
            tokens += len(message.token_ids)
    except grpc.RpcError as exc:
        return StreamedRequest(tokens, time.perf_counter() - started, ttft_s, f"{exc.code().name}: {exc.details()}")
    return StreamedRequest(tokens, time.perf_counter() - started, ttft_s)


def run_streams(stub, requests: list, streams: int) -> tuple[list[StreamedRequest], float]:
    """`requests` sent by `streams` clients at once: each request's outcome, and the wall time."""
    pending: queue.Queue = queue.Queue()
    for request in requests:
        pending.put(request)
    results: list[StreamedRequest] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                request = pending.get_nowait()
            except queue.Empty:
                return
            result = stream_request(stub, request)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, name=f"bench-stream-{i}", daemon=True) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def percentile(values: list[float], p: float) -> float | None:
    """The nearest-rank p-th percentile (p in (0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100.0 * len(ordered)) - 1)]


def summarize_level(results: list[StreamedRequest], wall_s: float) -> dict:
    """One mode at one level: aggregate tokens/s, latency p50 and p99, TTFT p50 (of the
    requests that completed), and how many requests ran and failed."""
    done = [r for r in results if not r.error]
    latencies = [r.latency_s for r in done]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "tokens_per_s": sum(r.tokens for r in done) / wall_s if wall_s > 0 and done else None,
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
        "p50_ttft_s": percentile(ttfts, 50),
        "requests": len(results),
        "failed_requests": len(results) - len(done),
    }


def palindromic_passes(modes: list[str], count: int) -> list[tuple[str, slice]]:
    """The order a level runs in: (mode, which of its `count` requests) for each pass, the modes
    in order over the first half and in reverse over the second. One pass each when there is
    only one request to send."""
    if count < 2:
        return [(mode, slice(0, count)) for mode in modes]
    first, second = slice(0, count // 2), slice(count // 2, count)
    return [(mode, first) for mode in modes] + [(mode, second) for mode in reversed(modes)]


def run_levels(stub, levels: list[int], modes: list[str], prompts: list[str], max_new_tokens: int, k: int,
               log=print) -> dict:
    """Every level, every mode: {"C": {"modes": {MODE: figures}}}. A mode's first failure is logged."""
    result = {}
    for level in levels:
        count = level * len(prompts)
        requests = {mode: [specd_request(prompts[i % len(prompts)], mode, max_new_tokens, k)
                           for i in range(count)] for mode in modes}
        outcomes = {mode: [] for mode in modes}
        wall_s = dict.fromkeys(modes, 0.0)
        for mode, part in palindromic_passes(modes, count):
            part_outcomes, part_wall_s = run_streams(stub, requests[mode][part], level)
            outcomes[mode] += part_outcomes
            wall_s[mode] += part_wall_s
        figures = {}
        for mode in modes:
            figures[mode] = summarize_level(outcomes[mode], wall_s[mode])
            errors = [r.error for r in outcomes[mode] if r.error]
            if errors:
                log(f"  concurrency {level} {mode}: {len(errors)} of {len(outcomes[mode])} requests failed, first: {errors[0]}")
            log(f"  concurrency {level} {mode:<4} {_describe(figures[mode])}")
        result[str(level)] = {"modes": figures}
    return result


def _fmt(value, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _describe(figures: dict) -> str:
    fmt = _fmt
    return (f"{fmt(figures['tokens_per_s'], '7.1f')} tok/s, latency p50 {fmt(figures['p50_latency_s'], '.2f')} s "
            f"p99 {fmt(figures['p99_latency_s'], '.2f')} s, TTFT p50 {fmt(figures['p50_ttft_s'], '.3f')} s")


def format_table(concurrency: dict) -> str:
    """The levels' figures, one line per level and mode."""
    lines = [f"{'streams':<9}{'mode':<6}{'tok/s':>8}{'p50 s':>8}{'p99 s':>8}{'TTFT p50 s':>12}{'failed':>8}"]
    fmt = _fmt
    for level, entry in concurrency.items():
        for mode, m in entry["modes"].items():
            lines.append(
                f"{level:<9}{mode:<6}{fmt(m['tokens_per_s'], '.1f'):>8}{fmt(m['p50_latency_s'], '.2f'):>8}"
                f"{fmt(m['p99_latency_s'], '.2f'):>8}{fmt(m['p50_ttft_s'], '.3f'):>12}{m['failed_requests']:>8}"
            )
    return "\n".join(lines)

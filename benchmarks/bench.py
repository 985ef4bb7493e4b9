"""`specd bench`: target-only, sd, ssd and HF assisted generation, side by side in one run.

The three specd modes go through real services over loopback gRPC; HF assisted
generation runs in this process on the same pair with the same total threads.
Modes run interleaved prompt by prompt (each prompt through every mode before the next) and
the whole set repeated, so that drift on a shared machine hits all modes alike.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import statistics
import time

from specd.wire.modes import OFF, SD, SSD, mode_value

SPECD_MODES = (OFF, SD, SSD)
ALL_MODES = (*SPECD_MODES, "hf_assisted")


@dataclasses.dataclass
class ModeRun:
    """One pass of one mode over the whole prompt set."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    verify_ms: float = 0.0  # the target's verify forwards, from the responses' stats
    outputs: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def specd_request(prompt: str, mode: str, max_new_tokens: int, k: int):
    """The bench's greedy GenerateRequest of `prompt` in `mode`."""
    from specd.v1 import common_pb2, coordinator_pb2

    return coordinator_pb2.GenerateRequest(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        ignore_eos=False,  # a chat answer ends at its EOS, as it would for a user; every mode stops there
        sampling=common_pb2.SamplingParams(temperature=0.0),
        speculation=coordinator_pb2.SpeculationParams(
            mode=mode_value(mode), num_speculative_tokens=k
        ),
    )


def add_specd_prompt(run: ModeRun, stub, prompt: str, mode: str, max_new_tokens: int, k: int, stream: bool = False) -> None:
    """One greedy request of `mode` through the stack behind `stub`, added to `run`: a Generate
    call, or with `stream` a GenerateStream read to its end."""
    request = specd_request(prompt, mode, max_new_tokens, k)
    started = time.perf_counter()
    response = streamed_response(stub, request) if stream else stub.Generate(request, timeout=600)
    run.seconds += time.perf_counter() - started
    run.tokens += len(response.token_ids)
    run.rounds += response.stats.rounds
    run.draft_tokens += response.stats.draft_tokens
    run.accepted_tokens += response.stats.accepted_tokens
    run.cache_hits += response.stats.cache_hits
    run.cache_misses += response.stats.cache_misses
    run.verify_ms += response.stats.verify_ms
    run.outputs.append(list(response.token_ids))


def streamed_response(stub, request):
    """A GenerateStream call read to its end, as the GenerateResponse's token ids and stats."""
    from specd.v1 import coordinator_pb2

    messages = list(stub.GenerateStream(request, timeout=600))
    return coordinator_pb2.GenerateResponse(token_ids=[t for m in messages for t in m.token_ids], stats=messages[-1].stats)


class HFAssisted:
    """transformers `generate(assistant_model=...)` on the same pair, in this process."""

    def __init__(self, target_path: str, draft_path: str, threads: int, worker_threads: int, device: str = "auto",
                 dtype: str = "auto", assisted: bool = True):
        import transformers

        from specd.engine.backends import FastPathOptions, backend_for
        from specd.engine.loading import load_causal_lm

        transformers.logging.set_verbosity_error()  # generate() warns about its defaults on every call
        self.threads = threads  # generate() gets the threads the two workers have together
        self.worker_threads = worker_threads  # a verify forward is timed as the target worker runs it
        backend = backend_for(device)  # the stack's device and dtype: a comparison on one machine
        self.device, self.dtype = backend.device, backend.dtype(dtype)
        # A verify is timed on the target as a target worker serves it by default.
        verify = load_causal_lm(target_path, dtype=self.dtype, device=self.device)
        self.tokenizer, self.verify_target = verify.tokenizer, verify.model
        backend.prepare(self.verify_target, FastPathOptions())
        # generate() runs transformers' models as they come, loaded as the workers load them
        # (names resolved, the draft's borrowed weights in); only when the mode runs: on a GPU a
        # large target's second and third copies are memory the stack may need.
        self.target = load_causal_lm(target_path, dtype=self.dtype, device=self.device).model if assisted else None
        self.draft = load_causal_lm(draft_path, dtype=self.dtype, device=self.device).model if assisted else None

    def add_prompt(self, run: ModeRun, prompt: str, max_new_tokens: int) -> None:
        """One greedy assisted generation of `prompt`, added to `run`."""
        import torch

        torch.set_num_threads(self.threads)
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)  # [1, P]
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(
                ids,
                assistant_model=self.draft,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or 0,
            )
        run.seconds += time.perf_counter() - started
        new = out[0, ids.shape[1] :].tolist()
        run.tokens += len(new)
        run.outputs.append(new)

    def verify_times_ms(
        self, prompts: list[str], k: int, context_extra: int, repeats: int = 5, cpus: frozenset[int] | None = None
    ) -> list[float]:
        """Times of one target forward over K+1 tokens with the KV cache in use, `repeats`
        per prompt, at the prompt's length plus `context_extra` tokens of context: the middle
        of a generation, where a verify in the stack runs on average. With `cpus`, on those
        CPUs, as the stack's target worker runs (`specd up` pins it)."""
        import torch

        torch.set_num_threads(self.worker_threads)
        if not cpus:
            return self._verify_times_ms(prompts, k, context_extra, repeats)
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)  # this thread: with one torch thread (the default) it runs the forward
        try:
            return self._verify_times_ms(prompts, k, context_extra, repeats)
        finally:
            os.sched_setaffinity(0, allowed)

    def _verify_times_ms(self, prompts: list[str], k: int, context_extra: int, repeats: int) -> list[float]:
        import torch

        from specd.engine.forward import elapsed_ms, synchronize
        from specd.engine.kv_cache import GrowingKVCache

        times = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)  # [1, P]
                # Any tokens time the same: the prompt repeated to the length wanted.
                length = ids.shape[1] + context_extra
                context = ids.repeat(1, -(-length // ids.shape[1]))[:, :length]  # [1, P+extra]
                block = context[:, -1:].repeat(1, k + 1)  # [1, K+1]
                for _ in range(repeats):
                    cache = GrowingKVCache()  # the cache a worker's session uses
                    self.verify_target(context, past_key_values=cache, use_cache=True)
                    synchronize(self.device)  # the context's forward is done before the clock starts
                    started = time.perf_counter()
                    self.verify_target(block, past_key_values=cache, use_cache=True, logits_to_keep=k + 1)
                    times.append(elapsed_ms(started, self.device))
        return times


def summarize(runs: dict[str, list[ModeRun]]) -> dict:
    """Median tokens/s over repeats, the spread, and the acceptance figures of all runs."""
    modes = {}
    for mode, mode_runs in runs.items():
        rates = [r.tokens_per_s for r in mode_runs]
        rounds = sum(r.rounds for r in mode_runs)
        draft = sum(r.draft_tokens for r in mode_runs)
        accepted = sum(r.accepted_tokens for r in mode_runs)
        lookups = sum(r.cache_hits + r.cache_misses for r in mode_runs)
        tokens = sum(r.tokens for r in mode_runs)
        seconds = sum(r.seconds for r in mode_runs)
        speculative = mode in (SD, SSD)
        modes[mode] = {
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates),
            "acceptance_rate": accepted / draft if draft else None,
            "tokens_per_round": tokens / rounds if rounds else None,
            "cache_hit_rate": sum(r.cache_hits for r in mode_runs) / lookups if lookups else None,
            # Where a round's time goes in the stack: its wall time (prefill included) and the
            # target's verify forward in it; the rest is the draft, RPCs and the event loops.
            "ms_per_round": seconds * 1000.0 / rounds if rounds else None,
            "verify_ms_per_round": sum(r.verify_ms for r in mode_runs) / rounds if rounds else None,
        }
        if not speculative:
            modes[mode]["acceptance_rate"] = modes[mode]["acceptance_rate"] if draft else None
        modes[mode]["skipped"] = None
    return modes


def skipped_mode(reason: str) -> dict:
    """A mode that did not run: the figures summarize gives, all null, and why."""
    figures = summarize({"any": [ModeRun(tokens=1, seconds=1.0)]})["any"]
    return {**dict.fromkeys(figures), "skipped": reason}


def format_table(result: dict) -> str:
    off = result["modes"].get(OFF, {}).get("tokens_per_s")
    lines = [f"{'mode':<12}{'tok/s':>8}{'spread':>16}{'x off':>8}{'accept':>8}{'tok/round':>10}{'hit rate':>10}"]

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    one_pass = result.get("settings", {}).get("repeats") == 1  # one pass has no spread to show
    for mode, m in result["modes"].items():
        if m.get("skipped"):
            lines.append(f"{mode:<12}skipped: {m['skipped']}")
            continue
        ratio = m["tokens_per_s"] / off if off else None
        spread = "-" if one_pass else f"{m['tokens_per_s_min']:.1f}-{m['tokens_per_s_max']:.1f}"
        lines.append(
            f"{mode:<12}{m['tokens_per_s']:>8.1f}{spread:>16}{fmt(ratio, '.2f'):>8}"
            f"{fmt(m['acceptance_rate'], '.3f'):>8}{fmt(m['tokens_per_round'], '.2f'):>10}"
            f"{fmt(m['cache_hit_rate'], '.2f'):>10}"
        )
    return "\n".join(lines)


def to_json(result: dict, path: str) -> None:
    """The results, stamped with where and when they were taken (run_stamp)."""
    with open(path, "w") as f:
        json.dump({"run": run_stamp(), **result}, f, indent=2)


def run_stamp() -> dict:
    """The commit measured, the machine and the UTC time: where a figure came from."""
    return {
        "commit": _commit(pathlib.Path(__file__).resolve().parent.parent),
        "machine": f"{os.cpu_count()} CPUs ({_cpu_model()}), torch {_torch_version()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _commit(root: pathlib.Path) -> str:
    """HEAD's commit, read from the repository's files (no process started); "unknown" outside a checkout."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = pathlib.Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        common = pathlib.Path((git / "commondir").read_text().strip()) if (git / "commondir").is_file() else git
        common = common if common.is_absolute() else git / common
        for folder in (git, common):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip()[:12]
        packed = (common / "packed-refs").read_text().splitlines()
        return next(line.split()[0][:12] for line in packed if line.endswith(" " + ref))
    except (OSError, IndexError, StopIteration):
        return "unknown"


def _cpu_model() -> str:
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "absent"
    device = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return torch.__version__ + device

"""`specd trace`: one request's rounds as a timeline picture, without Jaeger.

    specd trace --listen [HOST:]PORT [--spans FILE]   # an OTLP gRPC receiver storing spans
    specd trace TRACE_ID --spans FILE -o out.png      # draw one trace from the stored spans
    specd trace FILE -o out.png                       # the latest request in FILE (stored or OTLP JSON)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

DEFAULT_SPANS = "specd-spans.jsonl"
DEFAULT_LISTEN_PORT = 4317

# Lanes, top to bottom, and the spans drawn in each.
LANES = ("rounds", "target", "draft", "overlap")
COLORS = {
    "spec_round": ("#4c72b0", "#8fa8d6"),
    "spec_rounds": ("#9e9e9e", "#9e9e9e"),
    "spec_verify": "#dd8452",
    "prefill": "#937860",
    "spec_propose": "#55a868",
    "spec_speculate": "#8172b3",
    "overlap": "#c44e52",
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("trace", help="draw one request's rounds as a timeline (PNG), or receive spans")
    parser.add_argument("source", nargs="?", metavar="TRACE_ID|FILE", help="a trace id (read from --spans) or a spans file")
    parser.add_argument("--spans", default=None, help=f"stored spans (JSON lines) or an OTLP JSON export (default {DEFAULT_SPANS})")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default trace-<id>.png)")
    parser.add_argument("--listen", metavar="[HOST:]PORT", default=None, help="run an OTLP gRPC receiver storing spans to --spans")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the trace to appear in --spans")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.listen is not None:
        return listen(args.listen, args.spans or DEFAULT_SPANS)
    if not args.source:
        print("specd trace: give a TRACE_ID or FILE, or --listen [HOST:]PORT", file=sys.stderr)
        return 2
    from specd.trace_store import load_spans, trace_spans

    if os.path.exists(args.source):
        path, trace_id = args.source, None
    else:
        path, trace_id = args.spans or DEFAULT_SPANS, args.source
    deadline = time.monotonic() + args.wait
    while True:
        try:
            spans = trace_spans(load_spans(path), trace_id)
            break
        except (LookupError, OSError) as exc:
            if time.monotonic() >= deadline:
                print(f"specd trace: {path}: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    output = args.output or f"trace-{spans[0]['trace_id']}.png"
    summary = draw(spans, output)
    print(f"{output}: {summary}".replace("\n", " "))
    return 0


def listen(address: str, path: str) -> int:
    from specd.trace_store import Receiver

    host, _, port = address.rpartition(":")
    receiver = Receiver(path, host or "127.0.0.1", int(port or DEFAULT_LISTEN_PORT)).start()
    print(f"OTLP gRPC receiver on {receiver.endpoint}, storing spans to {path}", flush=True)
    print(f"  OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint} specd up", flush=True)
    try:
        receiver.server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()
    return 0


def _intervals(spans: list[dict], names: tuple[str, ...]) -> list[tuple[int, int]]:
    return sorted((s["start_ns"], s["end_ns"]) for s in spans if s["name"] in names)


def _prefills(spans: list[dict], service: str) -> list[tuple[int, int]]:
    """A worker's Prefill calls, from their gRPC SERVER spans (a prefill has no worker span)."""
    return sorted((s["start_ns"], s["end_ns"]) for s in spans if s["kind"] == "SERVER" and s["name"].endswith(f"{service}/Prefill"))


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Pieces of time covered by both interval lists."""
    pieces = []
    for a0, a1 in a:
        for b0, b1 in b:
            start, end = max(a0, b0), min(a1, b1)
            if start < end:
                pieces.append((start, end))
    return pieces


def target_occupancy(verify: list[tuple[int, int]], rounds: list[dict]) -> tuple[float, float] | None:
    """(fraction of the rounds' time the target spent verifying, median ms between one verify's
    end and the next's start), or None without rounds or verifies.

    A round can cost no less than its verification: the fraction is how close the request came
    to that, and the gap is what each round adds to it (RPCs, event loops, a draft the round
    waited for).
    """
    if not rounds or not verify:
        return None
    start = min(s["start_ns"] for s in rounds)
    end = max(s["end_ns"] for s in rounds)
    inside = [(max(a, start), min(b, end)) for a, b in verify if a < end and b > start]
    busy = sum(b - a for a, b in inside) / max(1, end - start)
    gaps = [(inside[i + 1][0] - inside[i][1]) / 1e6 for i in range(len(inside) - 1)]
    return busy, statistics.median(gaps) if gaps else 0.0


def draw(spans: list[dict], output: str | pathlib.Path) -> str:
    """Draw the trace's rounds, verify and draft work and their overlap; returns a summary line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roots = [s for s in spans if s["name"] == "llm_request"]
    root = roots[0] if roots else min(spans, key=lambda s: s["start_ns"])
    t0 = root["start_ns"]

    def ms(ns: int) -> float:
        return (ns - t0) / 1e6

    rounds = sorted((s for s in spans if s["name"] in ("spec_round", "spec_rounds")), key=lambda s: s["start_ns"])
    verify = _intervals(spans, ("spec_verify",))
    if not verify:  # a target without spec_verify spans: its Verify server spans
        verify = sorted((s["start_ns"], s["end_ns"]) for s in spans if s["kind"] == "SERVER" and s["name"].endswith("/Verify"))
    draft = _intervals(spans, ("spec_propose", "spec_speculate"))
    overlap = _overlap(draft, verify)

    width = max(8.0, min(24.0, 6.0 + 0.12 * len(rounds)))
    fig, ax = plt.subplots(figsize=(width, 3.4), dpi=120)
    y = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
    hits = misses = 0
    for i, s in enumerate(rounds):
        attrs = s["attributes"]
        if s["name"] == "spec_rounds":
            color, hatch = COLORS["spec_rounds"][0], "//"
            label = f"{attrs.get('specd.rounds.first_index', '')}-{attrs.get('specd.rounds.last_index', '')}"
            hits += attrs.get("specd.rounds.cache_hits", 0)
            misses += attrs.get("specd.rounds.cache_misses", 0)
        else:
            color, hatch = COLORS["spec_round"][i % 2], None
            label = str(attrs.get("specd.round.index", i))
            cache = attrs.get("specd.round.cache")
            if cache in ("hit", "miss"):
                hits += cache == "hit"
                misses += cache == "miss"
                marker, mcolor = ("^", "#2ca02c") if cache == "hit" else ("x", "#d62728")
                ax.plot(ms(s["start_ns"]), y["rounds"] + 0.42, marker=marker, color=mcolor, markersize=7, clip_on=False)
        left, span_ms = ms(s["start_ns"]), (s["end_ns"] - s["start_ns"]) / 1e6
        ax.barh(y["rounds"], span_ms, left=left, height=0.6, color=color, edgecolor="white", hatch=hatch, linewidth=0.5)
        if len(rounds) <= 40:
            k, acc = attrs.get("specd.round.num_draft"), attrs.get("specd.round.accepted")
            text = label if k is None else f"{label}\n{acc}/{k}"
            ax.text(left + span_ms / 2, y["rounds"], text, ha="center", va="center", fontsize=6, color="white")
    for lane, intervals, color in (
        ("target", _prefills(spans, "TargetWorker"), COLORS["prefill"]),
        ("target", verify, COLORS["spec_verify"]),
        ("overlap", overlap, COLORS["overlap"]),
    ):
        for start, end in intervals:
            ax.barh(y[lane], (end - start) / 1e6, left=ms(start), height=0.6, color=color)
    for s in spans:
        if s["name"] in ("spec_propose", "spec_speculate"):
            ax.barh(y["draft"], (s["end_ns"] - s["start_ns"]) / 1e6, left=ms(s["start_ns"]), height=0.6, color=COLORS[s["name"]])

    a = root["attributes"]
    overlap_ms = sum(end - start for start, end in overlap) / 1e6
    summary = (
        f"trace {root['trace_id']}:\n{a.get('gen_ai.usage.output_tokens', '?')} tokens in "
        f"{a.get('specd.rounds', len(rounds))} rounds, {a.get('specd.e2e_ms', ms(root['end_ns'])):.1f} ms, "
        f"ttft {a.get('specd.ttft_ms', float('nan')):.1f} ms, mean acceptance length "
        f"{a.get('specd.mean_acceptance_length', float('nan')):.2f}, draft/verify overlap {overlap_ms:.1f} ms"
    )
    if hits or misses:
        summary += f", cache {hits} hits / {misses} misses"
    occupancy = target_occupancy(verify, rounds)
    if occupancy is not None:
        summary += (f",\ntarget verifying {occupancy[0]:.0%} of the rounds' time "
                    f"(median gap between verifies {occupancy[1]:.1f} ms)")
    ax.set_yticks([y[lane] for lane in LANES], LANES)
    ax.set_xlabel("ms since the request started (llm_request)")
    ax.set_xlim(0, max(ms(root["end_ns"]), max((ms(s["end_ns"]) for s in spans), default=1.0)))
    ax.set_ylim(-0.6, len(LANES) - 0.2)
    ax.set_title(summary, fontsize=7)
    from matplotlib.patches import Patch

    legend = [
        Patch(color=COLORS["spec_round"][0], label="spec_round (accepted/K)"),
        Patch(color=COLORS["prefill"], label="Prefill"),
        Patch(color=COLORS["spec_verify"], label="spec_verify"),
        Patch(color=COLORS["spec_propose"], label="spec_propose"),
        Patch(color=COLORS["spec_speculate"], label="spec_speculate"),
        Patch(color=COLORS["overlap"], label="draft ∥ verify"),
    ]
    if any(s["name"] == "spec_rounds" for s in rounds):
        legend.append(Patch(facecolor=COLORS["spec_rounds"][0], hatch="//", label="spec_rounds (summary)"))
    ax.legend(handles=legend, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(legend), frameon=False)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
    return summary.replace("\n", " ")

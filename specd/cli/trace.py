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
    "spec_round_unused": "#c8c8c8",
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
    parser.add_argument("--listen", metavar="[HOST:]PORT", default=None,
                        help="run an OTLP gRPC receiver storing spans to --spans; HOST defaults to 127.0.0.1, PORT to "
                             f"{DEFAULT_LISTEN_PORT} (default: no receiver: draw TRACE_ID|FILE)")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for the trace to appear in --spans (default: %(default)s, no waiting)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.listen is not None:
        return listen(args.listen, args.spans or DEFAULT_SPANS)
    if not args.source:
        print("specd trace: give a TRACE_ID or FILE, or --listen [HOST:]PORT", file=sys.stderr)
        return 2
    from specd.cli.trace_store import load_spans, trace_spans

    if os.path.exists(args.source):
        path, trace_id = args.source, None
    else:
        path, trace_id = args.spans or DEFAULT_SPANS, args.source
    deadline = time.monotonic() + args.wait
    while True:
        try:
            spans = trace_spans(load_spans(path), trace_id)
            break
        except (LookupError, OSError, ValueError) as exc:  # ValueError: not JSON lines (or a last one half written)
            if time.monotonic() >= deadline:
                print(f"specd trace: {path}: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    output = args.output or f"trace-{spans[0]['trace_id']}.png"
    summary = draw(spans, output)
    print(f"{output}: {summary}".replace("\n", " "))
    return 0


def listen(address: str, path: str) -> int:
    from specd.cli.trace_store import Receiver

    host, _, port = address.rpartition(":")
    try:
        receiver = Receiver(path, host or "127.0.0.1", int(port or DEFAULT_LISTEN_PORT)).start()
    except ValueError:
        print(f"specd trace: --listen {address}: give [HOST:]PORT, the port a number", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"specd trace: {exc}", file=sys.stderr)
        return 1
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
    timeline = _Timeline(root["start_ns"])
    rounds = sorted((s for s in spans if s["name"] in ROUND_SPANS), key=lambda s: s["start_ns"])
    verify = _intervals(spans, ("spec_verify",))
    if not verify:  # a target without spec_verify spans: its Verify server spans
        verify = sorted((s["start_ns"], s["end_ns"]) for s in spans if s["kind"] == "SERVER" and s["name"].endswith("/Verify"))
    overlap = _overlap(_intervals(spans, ("spec_propose", "spec_speculate")), verify)

    width = max(8.0, min(24.0, 6.0 + 0.12 * len(rounds)))
    fig, ax = plt.subplots(figsize=(width, 3.4), dpi=120)
    hits, misses = _draw_rounds(ax, rounds, timeline)
    _draw_worker_lanes(ax, spans, verify, overlap, timeline)
    ran = [s for s in rounds if s["name"] != UNUSED_ROUND]
    summary = _summary(root, ran, verify, overlap, hits, misses, timeline)
    ax.set_yticks([LANE_Y[lane] for lane in LANES], LANES)
    ax.set_xlabel("ms since the request started (llm_request)")
    ax.set_xlim(0, max(timeline.ms(root["end_ns"]), max((timeline.ms(s["end_ns"]) for s in spans), default=1.0)))
    ax.set_ylim(-0.6, len(LANES) - 0.2)
    ax.set_title(summary, fontsize=7)
    legend = _legend(rounds, hits, misses)
    ax.legend(handles=legend, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=min(len(legend), 5), frameon=False)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
    return summary.replace("\n", " ")


LANE_Y = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
UNUSED_ROUND = "spec_round_unused"  # ssd: a round begun ahead that never ran (coordinator/round_trace.py)
ROUND_SPANS = ("spec_round", "spec_rounds", UNUSED_ROUND)
HIT_MARKER = ("^", "#2ca02c")
MISS_MARKER = ("x", "#d62728")


class _Timeline:
    """Milliseconds since the request started, the picture's x axis."""

    def __init__(self, t0_ns: int):
        self.t0_ns = t0_ns

    def ms(self, ns: int) -> float:
        return (ns - self.t0_ns) / 1e6


def overlapping(rounds: list[dict]) -> bool:
    """Whether a round starts before the one before it has ended (ssd: work started ahead)."""
    return any(b["start_ns"] < a["end_ns"] for a, b in zip(rounds, rounds[1:]))


def _draw_rounds(ax, rounds: list[dict], timeline: _Timeline) -> tuple[int, int]:
    """One bar per round (or per folded summary of rounds), a marker on ssd rounds for the cache
    outcome; returns (cache hits, cache misses) over all rounds. Rounds that overlap in time
    (ssd) alternate between two half-height rows, so that each stays visible."""
    hits = misses = 0
    split = overlapping(rounds)
    for i, s in enumerate(rounds):
        attrs = s["attributes"]
        y, height = (LANE_Y["rounds"] + (0.16 if i % 2 == 0 else -0.16), 0.3) if split else (LANE_Y["rounds"], 0.6)
        if s["name"] == UNUSED_ROUND:
            color, hatch, label = COLORS[UNUSED_ROUND], "..", str(attrs.get("specd.round.index", i))
        elif s["name"] == "spec_rounds":
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
                marker, marker_color = HIT_MARKER if cache == "hit" else MISS_MARKER
                ax.plot(timeline.ms(s["start_ns"]), LANE_Y["rounds"] + 0.42, marker=marker, color=marker_color,
                        markersize=7, clip_on=False)
        left, span_ms = timeline.ms(s["start_ns"]), (s["end_ns"] - s["start_ns"]) / 1e6
        ax.barh(y, span_ms, left=left, height=height, color=color, edgecolor="white", hatch=hatch, linewidth=0.5)
        if len(rounds) <= 40:
            k, acc = attrs.get("specd.round.num_draft"), attrs.get("specd.round.accepted")
            text = label if k is None else (f"{label} {acc}/{k}" if split else f"{label}\n{acc}/{k}")
            ax.text(left + span_ms / 2, y, text, ha="center", va="center", fontsize=6 if not split else 5, color="white")
    return hits, misses


def _draw_worker_lanes(ax, spans: list[dict], verify, overlap, timeline: _Timeline) -> None:
    for lane, intervals, color in (
        ("target", _prefills(spans, "TargetWorker"), COLORS["prefill"]),
        ("target", verify, COLORS["spec_verify"]),
        ("overlap", overlap, COLORS["overlap"]),
    ):
        for start, end in intervals:
            ax.barh(LANE_Y[lane], (end - start) / 1e6, left=timeline.ms(start), height=0.6, color=color)
    for s in spans:
        if s["name"] in ("spec_propose", "spec_speculate"):
            ax.barh(LANE_Y["draft"], (s["end_ns"] - s["start_ns"]) / 1e6, left=timeline.ms(s["start_ns"]), height=0.6,
                    color=COLORS[s["name"]])


def mode_ran(root: dict) -> str:
    """The mode the request ran in (ssd, sd or off), as the coordinator recorded it."""
    attrs = root["attributes"]
    return str(attrs.get("specd.mode") or attrs.get("specd.request.mode") or "?")


def _summary(root: dict, rounds, verify, overlap, hits: int, misses: int, timeline: _Timeline) -> str:
    a = root["attributes"]
    overlap_ms = sum(end - start for start, end in overlap) / 1e6
    mode = mode_ran(root)
    if a.get("specd.fallback_reason"):
        mode += f" (fell back: {a['specd.fallback_reason']})"
    summary = (
        f"trace {root['trace_id']}, mode {mode}:\n{a.get('gen_ai.usage.output_tokens', '?')} tokens in "
        f"{a.get('specd.rounds', len(rounds))} rounds, {a.get('specd.e2e_ms', timeline.ms(root['end_ns'])):.1f} ms, "
        f"ttft {a.get('specd.ttft_ms', float('nan')):.1f} ms, mean acceptance length "
        f"{a.get('specd.mean_acceptance_length', float('nan')):.2f}, draft/verify overlap {overlap_ms:.1f} ms"
    )
    if hits or misses:
        summary += f", cache {hits} hits / {misses} misses"
    occupancy = target_occupancy(verify, rounds)
    if occupancy is not None:
        summary += (f",\ntarget verifying {occupancy[0]:.0%} of the rounds' time "
                    f"(median gap between verifies {occupancy[1]:.1f} ms)")
    return summary


def _legend(rounds: list[dict], hits: int, misses: int) -> list:
    """A legend entry for every colour and marker the picture can hold (markers only when drawn)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    legend = [
        Patch(color=COLORS["spec_round"][0], label="spec_round (index, accepted/K)"
              + ("; rounds overlapping in time on alternate rows" if overlapping(rounds) else "")),
        Patch(color=COLORS["prefill"], label="Prefill"),
        Patch(color=COLORS["spec_verify"], label="spec_verify"),
        Patch(color=COLORS["spec_propose"], label="spec_propose"),
        Patch(color=COLORS["spec_speculate"], label="spec_speculate"),
        Patch(color=COLORS["overlap"], label="draft ∥ verify"),
    ]
    if any(s["name"] == "spec_rounds" for s in rounds):
        legend.append(Patch(facecolor=COLORS["spec_rounds"][0], hatch="//", label="spec_rounds (folded rounds first-last)"))
    if any(s["name"] == UNUSED_ROUND for s in rounds):
        legend.append(Patch(facecolor=COLORS[UNUSED_ROUND], hatch="..", label="round begun ahead, never ran"))
    for drawn, (marker, color), label in ((hits, HIT_MARKER, "ssd cache hit"), (misses, MISS_MARKER, "ssd cache miss")):
        if drawn:
            legend.append(Line2D([], [], linestyle="none", marker=marker, color=color, label=label))
    return legend

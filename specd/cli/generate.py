"""`specd generate`: one request to a running coordinator."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specd.cli import connect
from specd.wire.modes import AUTO, MODES, mode_name, mode_value

DEFAULT_ADDRESS = "localhost:50051"
FINISH_REASONS = {0: "", 1: "stop", 2: "length"}


def default_address() -> str:
    """SPECD_ADDRESS, else the address a running `specd up` printed, else localhost:50051."""
    if os.environ.get("SPECD_ADDRESS"):
        return os.environ["SPECD_ADDRESS"]
    from specd.cli.up import state_file

    try:
        state = json.loads(state_file().read_text())
        os.kill(int(state["pid"]), 0)
        return state["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_ADDRESS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text through a running coordinator")
    parser.add_argument(
        "prompt", metavar="PROMPT", help="the prompt text (with --chat: the user's message); '-' reads it from stdin"
    )
    parser.add_argument("--chat", action="store_true",
                        help="send PROMPT as one user message, rendered with the target's chat template "
                             "(default: off, PROMPT is sent as plain text)")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="with --chat: a system message before it (default: none)")
    parser.add_argument("--address", default=None,
                        help="coordinator HOST:PORT (env SPECD_ADDRESS; default: the one a running `specd up` printed, "
                             f"else {DEFAULT_ADDRESS})")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="most tokens to generate (default: the coordinator's --default-max-new-tokens, 128 "
                             "unless it is set)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature; 0 is greedy (default: the target checkpoint's generation "
                             "defaults, greedy when it has none)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample only among the K likeliest tokens; 0 is off (default: the target checkpoint's "
                             "generation defaults, off when it has none)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling: sample only among the likeliest tokens that together hold this much "
                             "probability, in (0, 1]; 1 is off (default: the target checkpoint's generation defaults, "
                             "off when it has none)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling, to repeat a sampled output (default: the coordinator picks one "
                             "and reports it in the stats)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="> 1 discourages every token of the prompt and output so far; 1 is off (default: the "
                             "target checkpoint's generation defaults, off when it has none)")
    parser.add_argument("--mode", choices=MODES, default=AUTO,
                        help="speculation mode (default: %(default)s: the coordinator's --default-mode, and where that "
                             "is auto too, ssd with a draft worker, else off)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                        help="K draft tokens per round (default: the coordinator's --num-speculative-tokens, its "
                             "target device's profile unless it is set)")
    parser.add_argument("--stop", action="append", default=[],
                        help="a stop string: generation ends where it appears, and the text leaves it out "
                             "(repeatable; default: none)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past EOS, up to --max-new-tokens (default: off, EOS ends the output)")
    parser.add_argument("--logprobs", action="store_true",
                        help="return each token's target log-probability, in the --json output (default: off)")
    parser.add_argument("--timeout", type=float, default=600.0, help="request deadline in seconds (default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print exactly one JSON object on stdout (default: off, the text streams to stdout "
                             "and a summary line to stderr)")
    connect.add_arguments(parser)
    parser.set_defaults(run=run)


class UnsendableValue(ValueError):
    """A flag's value that its field on the wire cannot hold (out of range, or text that is not UTF-8)."""


def _set(message, field: str, value, flag: str) -> None:
    try:
        setattr(message, field, value)
    except ValueError as exc:  # protobuf: "Value out of range"; UnicodeEncodeError is a ValueError too
        what = "is not UTF-8 text" if isinstance(exc, UnicodeError) else f"{value} is out of the range the field takes"
        raise UnsendableValue(f"{flag}: {what}") from None


def build_request(args: argparse.Namespace):
    """The GenerateRequest the flags ask for; UnsendableValue names a flag whose value cannot go."""
    from specd.v1 import common_pb2, coordinator_pb2

    sampling = common_pb2.SamplingParams()
    for field in ("temperature", "top_k", "top_p", "seed", "repetition_penalty"):
        value = getattr(args, field)
        if value is not None:
            _set(sampling, field, value, "--" + field.replace("_", "-"))
    speculation = coordinator_pb2.SpeculationParams(mode=mode_value(args.mode))
    if args.num_speculative_tokens is not None:
        _set(speculation, "num_speculative_tokens", args.num_speculative_tokens, "--num-speculative-tokens")
    request = coordinator_pb2.GenerateRequest(
        sampling=sampling, ignore_eos=args.ignore_eos, speculation=speculation, return_logprobs=args.logprobs
    )
    for stop in args.stop:
        try:
            request.stop.append(stop)
        except ValueError:
            raise UnsendableValue("--stop: is not UTF-8 text") from None
    if args.chat:
        if args.system is not None:
            _set(request.messages.messages.add(role="system"), "content", args.system, "--system")
        _set(request.messages.messages.add(role="user"), "content", args.prompt, "PROMPT")
    else:
        _set(request, "prompt", args.prompt, "PROMPT")
    if args.max_new_tokens is not None:
        _set(request, "max_new_tokens", args.max_new_tokens, "--max-new-tokens")
    return request


def stats_dict(stats) -> dict:
    return {
        "mode": mode_name(stats.mode),
        "rounds": stats.rounds,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "accepted_per_position": list(stats.accepted_per_position),
        "cache_hits": stats.cache_hits,
        "cache_misses": stats.cache_misses,
        "cache_hit_rate": stats.cache_hit_rate,
        "draft_wait_ms": stats.draft_wait_ms,
        "verify_ms": stats.verify_ms,
        "verified_ahead": stats.verified_ahead,
        "queue_ms": stats.queue_ms,
        "fallback_reason": stats.fallback_reason,
        "seed": stats.seed,
    }


def response_dict(response) -> dict:
    result = {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "finish_reason": FINISH_REASONS.get(response.finish_reason, ""),
        "stop_reason": response.stop_reason,
        "usage": {
            "prompt_tokens": response.usage.prompt_tokens,
            "completion_tokens": response.usage.completion_tokens,
            "total_tokens": response.usage.total_tokens,
        },
        "stats": stats_dict(response.stats),
        "trace_id": response.trace_id,
        "request_id": response.request_id,
    }
    if response.logprobs:
        result["logprobs"] = list(response.logprobs)
    return result


def run(args: argparse.Namespace) -> int:
    import grpc

    if args.system is not None and not args.chat:
        print("specd generate: --system needs --chat (a system message belongs to a chat)", file=sys.stderr)
        return 2
    from specd.core.config import ConfigError
    from specd.v1 import coordinator_pb2_grpc

    address = args.address or default_address()
    if args.prompt == "-":  # a long prompt (a file to summarise, code to complete) need not fit a command line
        args.prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")  # not UTF-8: said below
    try:
        request = build_request(args)
    except UnsendableValue as exc:
        print(f"specd generate: {exc}", file=sys.stderr)
        return 2
    try:
        channel = connect.open_channel(address, args)
    except ConfigError as exc:
        print(f"specd generate: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            if args.json:
                response = stub.Generate(request, timeout=args.timeout)
                print(json.dumps(response_dict(response)))
            else:
                last = None
                for message in stub.GenerateStream(request, timeout=args.timeout):
                    sys.stdout.write(message.text)
                    sys.stdout.flush()
                    last = message
                sys.stdout.write("\n")
                if last is not None:
                    stats = stats_dict(last.stats)
                    print(
                        f"[{FINISH_REASONS.get(last.finish_reason, '')}] {last.usage.completion_tokens} tokens, "
                        f"mode {stats['mode']}, {stats['rounds']} rounds, "
                        f"mean acceptance length {stats['mean_acceptance_length']:.2f}"
                        + (f", trace {last.trace_id}" if last.trace_id else ""),
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(error_line(exc, address, channel), file=sys.stderr)
            return 1
    return 0


def error_line(exc, address: str, channel) -> str:
    """`CODE: details`; when nothing answers at `address` at all, a hint at `specd up` instead
    (a coordinator that answers UNAVAILABLE itself, its target down, keeps its own details)."""
    import grpc

    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        try:
            grpc.channel_ready_future(channel).result(timeout=1.0)
        except grpc.FutureTimeoutError:
            return (f"UNAVAILABLE: nothing is serving at {address}; start a stack with `specd up`, "
                    "or give a coordinator's address with --address or SPECD_ADDRESS")
    return f"{exc.code().name}: {exc.details()}"

"""Long prompts against a running stack: how long a prompt of N tokens takes, and how a short
chat fares beside a long prompt (README, "Long prompts").

    python benchmarks/measure_long_prompts.py --address 127.0.0.1:50051 --lengths 512,1024,2048,4096 \
        --modes off --beside 6000

Prompts are token ids (the same synthetic sequence for every length, within the vocabulary), sent one at a time; each
asks for `--max-new-tokens`. With --beside N, one request of N tokens (8 new tokens, in
`--long-mode`) runs while `--chats` short chat requests (32 new tokens, in `--chat-mode`) are sent
one after another.
"""

import argparse
import pathlib
import sys
import threading
import time

import grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from specd.v1 import coordinator_pb2 as pb  # noqa: E402
from specd.v1 import coordinator_pb2_grpc  # noqa: E402
from specd.wire.modes import mode_value  # noqa: E402


def _ids(count: int, vocab_size: int) -> list[int]:
    return [(1000 + i % 5000) % vocab_size for i in range(count)]


def _generate(stub, ids: list[int], mode: str, max_new_tokens: int) -> tuple[float, str]:
    """Seconds the request took, and its outcome: the mode that ran, or the error status."""
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=max_new_tokens,
        speculation=pb.SpeculationParams(mode=mode_value(mode)),
    )
    started = time.monotonic()
    try:
        reply = stub.Generate(request, timeout=900)
        outcome = f"ok, {reply.usage.completion_tokens} tokens, mode {pb.SpeculationMode.Name(reply.stats.mode)}"
    except grpc.RpcError as error:
        outcome = f"{error.code().name}: {error.details()}"
    return time.monotonic() - started, outcome


def _chat(stub, mode: str) -> float:
    message = pb.ChatMessage(role="user", content="Write a haiku about rain.")
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[message]), max_new_tokens=32,
        speculation=pb.SpeculationParams(mode=mode_value(mode)),
    )
    started = time.monotonic()
    stub.Generate(request, timeout=900)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--modes", default="off", help="comma-separated: off, sd, ssd")
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--beside", type=int, default=0, help="a long prompt of this many tokens beside the chats (0: none)")
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--chat-mode", default="off", help="the chats' mode: off, sd or ssd")
    parser.add_argument("--long-mode", default="off", help="the long prompt's mode beside them: off, sd or ssd")
    args = parser.parse_args()
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(args.address))
    vocab_size = stub.ModelInfo(pb.ModelInfoRequest(), timeout=60).vocab_size
    for mode in args.modes.split(","):
        for length in map(int, args.lengths.split(",")):
            seconds, outcome = _generate(stub, _ids(length, vocab_size), mode, args.max_new_tokens)
            print(f"{mode:<4} {length:>6} tokens: {seconds:7.2f} s  ({outcome})", flush=True)
    if args.beside:
        alone = _chat(stub, args.chat_mode)
        result: dict[str, tuple[float, str]] = {}
        long = threading.Thread(target=lambda: result.setdefault("long", _generate(stub, _ids(args.beside, vocab_size), args.long_mode, 8)))
        long.start()
        time.sleep(2.0)  # the long prompt is being cached
        beside = [_chat(stub, args.chat_mode) for _ in range(args.chats)]
        long.join()
        print(f"a 32-token chat ({args.chat_mode}) alone: {alone:.2f} s; beside a {args.beside}-token prompt "
              f"({args.long_mode}), one after another: "
              + ", ".join(f"{s:.2f}" for s in beside) + f" s; the long prompt {result['long'][0]:.2f} s", flush=True)


if __name__ == "__main__":
    main()

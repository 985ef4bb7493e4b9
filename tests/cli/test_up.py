"""`specd up` supervises: a dead service is restarted while the rest serves; ports it is told
to use are checked before anything starts; each service's /metrics address is printed."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from specd.cli import up as up_module
from specd.v1 import common_pb2, coordinator_pb2_grpc
from specd.v1 import coordinator_pb2 as pb

RESTART_DEADLINE_S = 90.0  # a worker's restart loads torch and its model again on a busy machine


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _three_free_ports() -> int:
    rng = random.Random(os.getpid())
    while True:
        base = rng.randrange(20000, 60000)
        if all(_free(base + offset) for offset in range(3)):
            return base


class Up:
    """A `specd up` child with its stderr in a file, read as it grows."""

    def __init__(self, tmp_path, *args: str, log_dir: bool = True):
        """log_dir: pass --log-dir (tmp_path/logs); else `specd up` makes its own under tmp_path."""
        self.err_path = tmp_path / "up.err"
        # Its own state file and temporary folder; its own process group, as a terminal gives a command.
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TMPDIR": str(tmp_path)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specd", "up", "--no-pin-cpus", "--http-port", "0",
             *(["--log-dir", str(tmp_path / "logs")] if log_dir else []), *args],
            stdout=subprocess.PIPE, stderr=self.err_path.open("w"), text=True, env=self.env, process_group=0,
        )

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, pattern: str, deadline_s: float = RESTART_DEADLINE_S) -> re.Match:
        deadline = time.monotonic() + deadline_s
        while not (match := re.search(pattern, self.stderr())):
            assert self.process.poll() is None, f"specd up exited: {self.stderr()}"
            assert time.monotonic() < deadline, f"no {pattern!r} on stderr:\n{self.stderr()}"
            time.sleep(0.2)
        return match

    def pid_of(self, name: str) -> int:
        return int(re.findall(rf"the {name} \(pid (\d+)\)", self.stderr())[-1])


def _generate(address: str, mode=pb.SPECULATION_MODE_SSD) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=8, ignore_eos=True,
                                     sampling=common_pb2.SamplingParams(temperature=0.0),
                                     speculation=pb.SpeculationParams(mode=mode))
        return coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=30)


def _generate_within(address: str, accept, deadline_s: float = RESTART_DEADLINE_S) -> pb.GenerateResponse:
    """Generate until `accept(response)`; errors (a restarting service) are retried until the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            response = _generate(address)
            if accept(response):
                return response
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, f"still failing: {exc.code().name}: {exc.details()}"
        assert time.monotonic() < deadline, "no accepted response in time"
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_restarts_what_dies_while_the_rest_serves(tiny_pair, tmp_path):
    target, draft = tiny_pair
    metrics_base = _three_free_ports()
    up = Up(tmp_path, "--target", target, "--draft", draft, "--port", "0", "--metrics-port", str(metrics_base))
    pids = []
    try:
        line = up.process.stdout.readline()
        assert (match := re.fullmatch(r"coordinator listening on (\S+)\n", line)), f"{line!r}: {up.stderr()}"
        address = match.group(1)
        for name, port, metric in (("coordinator", metrics_base, "specd_requests_in_flight"),
                                   ("target", metrics_base + 1, "specd_active_sessions"),
                                   ("draft", metrics_base + 2, "specd_active_sessions")):
            url = f"http://127.0.0.1:{port}/metrics"
            assert f"the {name} (pid" in up.stderr() and f"metrics on {url}" in up.stderr()
            assert metric in urllib.request.urlopen(url, timeout=10).read().decode()
        pids = [up.pid_of(name) for name in ("target", "draft", "coordinator")]

        os.kill(up.pid_of("draft"), signal.SIGKILL)
        up.wait_for(r"the draft exited with code -9 \(SIGKILL\); restarting it in \d+ s")
        # Meanwhile the coordinator and the target serve, target-only.
        assert len(_generate(address).token_ids) == 8
        up.wait_for(r"the draft serves again")
        _generate_within(address, lambda r: r.stats.mode == pb.SPECULATION_MODE_SSD and not r.stats.fallback_reason)

        for name in ("target", "coordinator"):
            os.kill(up.pid_of(name), signal.SIGKILL)
            up.wait_for(rf"the {name} exited with code -9 \(SIGKILL\); restarting it in \d+ s")
            up.wait_for(rf"the {name} serves again")
            assert len(_generate_within(address, lambda r: True).token_ids) == 8
        pids += [up.pid_of(name) for name in ("target", "draft", "coordinator")]
        assert up.process.poll() is None
    finally:
        up.process.send_signal(signal.SIGTERM)
        up.process.wait(timeout=60)
    assert up.process.returncode == 0
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
    assert not list(tmp_path.glob("specd-up-*.json")), "the state file outlived specd up"


@pytest.mark.parametrize("which", ["--port", "--metrics-port", "--http-port"])
def test_up_refuses_a_taken_port_before_starting_anything(tmp_path, which):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    port_flags = ["--port", str(taken)] if which == "--port" else ["--port", "0", which, str(taken)]
    try:
        up = Up(tmp_path, "--target", str(tmp_path / "never-loaded"), *port_flags)
        up.process.wait(timeout=60)
    finally:
        holder.close()
    assert up.process.returncode != 0
    message = up.stderr().strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert f"port {taken} on 127.0.0.1" in message and "is taken" in message and which in message, message
    assert up.process.stdout.read() == ""
    assert not list(tmp_path.glob("specd-up-*.json")), "a refused specd up touched the state file"


def test_a_second_stack_leaves_generates_default_address_alone(tmp_path, monkeypatch):
    """`specd up --port 0` beside a live `specd up` does not retarget `specd generate`'s default."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        up_module.state_file().write_text(json.dumps({"address": "127.0.0.1:50051", "pid": holder.pid}))
        assert up_module.claim_state_file("127.0.0.1:40000") == "127.0.0.1:50051"
        assert json.loads(up_module.state_file().read_text())["address"] == "127.0.0.1:50051"
    finally:
        holder.kill()
        holder.wait()
    # Once the other stack is gone, the new one becomes the default.
    assert up_module.claim_state_file("127.0.0.1:40000") == "127.0.0.1:40000"
    assert json.loads(up_module.state_file().read_text()) == {"address": "127.0.0.1:40000", "pid": os.getpid()}
    up_module.release_state_file()
    assert not up_module.state_file().exists()


class _LowestFreePortSockets:
    """A system that hands out the lowest unbound port from 50000 for bind(0), as one may after
    a stack on that port stopped; a bound port is refused until its socket closes."""

    AF_INET, SOCK_STREAM, SOL_SOCKET, SO_REUSEADDR = socket.AF_INET, socket.SOCK_STREAM, socket.SOL_SOCKET, socket.SO_REUSEADDR

    def __init__(self, taken=()):
        self.bound: set[int] = set(taken)

    def socket(self, *_):
        system = self

        class Sock:
            port = None

            def setsockopt(self, *_):
                pass

            def bind(self, address):
                port = address[1] or min(p for p in range(50000, 60000) if p not in system.bound)
                if port in system.bound:
                    raise OSError("address in use")
                system.bound.add(port)
                self.port = port

            def getsockname(self):
                return ("127.0.0.1", self.port)

            def __enter__(self):
                return self

            def __exit__(self, *_):
                system.bound.discard(self.port)

        return Sock()


@pytest.mark.parametrize("metrics_port", [-1, 0, 51000])
def test_free_ports_are_never_the_ports_already_chosen(monkeypatch, metrics_port):
    system = _LowestFreePortSockets()
    monkeypatch.setattr(up_module, "socket", system)
    ports = up_module.choose_ports("127.0.0.1", 50000, metrics_port, 0)  # the port the system would hand out next
    assert ports["coordinator"] == 50000
    assert len(set(ports.values())) == len(ports) == (4 if metrics_port < 0 else 7), ports
    assert not system.bound  # every socket closed again
    if metrics_port > 0:
        assert [ports[f"metrics-{name}"] for name in ("coordinator", "target", "draft")] == [51000, 51001, 51002]
    system.bound.add(50000)  # something else holds it now
    with pytest.raises(up_module.PortTaken, match="port 50000 on 127.0.0.1 is taken"):
        up_module.choose_ports("127.0.0.1", 50000, -1)
    with pytest.raises(up_module.PortTaken, match="http port 50000 on 127.0.0.1 is taken; .*--http-port"):
        up_module.choose_ports("127.0.0.1", 0, -1, 50000)


def test_the_stack_starts_its_services_without_tls_settings():
    """`specd up` wires and health-checks its services in plaintext: a client's SPECD_TLS_CERT_FILE
    exported for `specd generate` (a server's setting by the same name) must not turn TLS on in them."""
    from specd.cli.supervise import service_environment

    environ = {"PATH": "/bin", "SPECD_TLS_CERT_FILE": "me.crt", "SPECD_TLS_KEY_FILE": "me.key",
               "SPECD_WORKER_TLS_CA_FILE": "ca.crt", "SPECD_THREADS": "1"}
    assert service_environment(environ) == {"PATH": "/bin", "SPECD_THREADS": "1", "SPECD_PARENT_PID": str(os.getpid())}


def _args(**changes):
    import argparse

    from specd.cli import up

    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    return parser.parse_args(["up", *[part for flag, value in changes.items() for part in (f"--{flag.replace('_', '-')}", value)]])


def test_a_gpu_host_pins_no_cpus_and_gives_the_draft_a_gpu_of_its_own(monkeypatch, tmp_path):
    from specd.cli import up

    ports = {"coordinator": 1, "target": 2, "draft": 3}
    monkeypatch.setattr(up, "visible_gpus", lambda: 2)
    services = {s.name: s.argv for s in up.build_services(_args(), ports, tmp_path)}
    assert "--cpus" not in services["target"] and "--cpus" not in services["draft"]
    assert services["target"][services["target"].index("--device") + 1] == "auto"
    assert services["draft"][services["draft"].index("--device") + 1] == "cuda:1"
    assert up.placement(_args()).say() == ["the draft runs on a GPU of its own: cuda:1"]
    assert "--gpu-memory-fraction" not in services["target"] + services["draft"]  # each has a GPU to itself
    # One GPU: the draft shares it, each worker keeping to its share of its memory; a
    # tensor-parallel target on both: the draft shares them too.
    monkeypatch.setattr(up, "visible_gpus", lambda: 1)
    assert up.placement(_args()).draft_device == "auto"
    shared = {s.name: s.argv for s in up.build_services(_args(), ports, tmp_path)}
    shares = [float(shared[name][shared[name].index("--gpu-memory-fraction") + 1]) for name in ("target", "draft")]
    assert shares[0] > shares[1] and sum(shares) <= 1.0
    monkeypatch.setattr(up, "visible_gpus", lambda: 2)
    assert up.placement(_args(target_tensor_parallel="2")).draft_device == "auto"


def test_a_cpu_host_keeps_its_pinning(monkeypatch, tmp_path):
    from specd.cli import up

    monkeypatch.setattr(up, "visible_gpus", lambda: 0)
    monkeypatch.setattr(up, "stack_layout", lambda threads, ranks: {"target": frozenset({0}), "draft": frozenset({1}), "coordinator": frozenset({1})})
    services = {s.name: s.argv for s in up.build_services(_args(), {"coordinator": 1, "target": 2, "draft": 3}, tmp_path)}
    assert services["target"][-2:] == ["--cpus", "0"] and services["draft"][-2:] == ["--cpus", "1"]
    assert services["draft"][services["draft"].index("--device") + 1] == "auto"


@pytest.mark.parametrize("visible, count", [("0,1", 2), ("1", 1), ("", 0), ("-1", 0), ("0,-1,1", 1), ("0,,1", 1),
                                            (" 2 , 3 ", 2), ("GPU-8a1b,GPU-77c2", 2), ("nvidia0", 0)])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(visible, count):
    from specd.cli import up

    assert up.cuda_visible_count(visible) == count


def test_visible_gpus_are_those_present_that_cuda_visible_devices_lets_through(monkeypatch):
    from specd.cli import up

    monkeypatch.setattr(up.os, "listdir", lambda path: ["0000:01:00.0", "0000:02:00.0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert up.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1")
    assert up.visible_gpus() == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert up.visible_gpus() == 2


def test_without_a_draft_no_cpu_is_pinned_for_one(monkeypatch, tmp_path):
    from specd.cli import up

    monkeypatch.setattr(up, "visible_gpus", lambda: 0)
    monkeypatch.setattr(up, "stack_layout", lambda threads, ranks: {"target": frozenset({0}), "draft": frozenset({1}), "coordinator": frozenset({1})})
    placed = up.placement(_args(draft=""))
    assert set(placed.cpus) == {"target", "coordinator"}
    assert placed.say() == ["target pinned to CPU 0, coordinator to CPU 1"]
    services = {s.name: s.argv for s in up.build_services(_args(draft=""), {"coordinator": 1, "target": 2, "draft": 3}, tmp_path)}
    assert set(services) == {"target", "coordinator"} and services["coordinator"][-2:] == ["--cpus", "1"]
    assert up.placement(_args()).say() == ["target pinned to CPU 0, draft and coordinator to CPU 1"]


@pytest.mark.parametrize("made_here, failed, kept", [(True, False, False), (True, True, True), (False, False, True)])
def test_the_log_folder_specd_up_made_goes_unless_a_service_failed(tmp_path, made_here, failed, kept):
    import io

    from specd.cli.supervise import Supervisor

    log_dir = tmp_path / "specd-up-x"
    log_dir.mkdir()
    (log_dir / "target.log").write_text("loading\n")
    err = io.StringIO()
    up_module.close_log_dir(Supervisor([], err=err), log_dir, made_here=made_here, failed=failed)
    assert log_dir.exists() == kept
    assert (f"its logs stay in {log_dir}" in err.getvalue()) == (made_here and failed), err.getvalue()

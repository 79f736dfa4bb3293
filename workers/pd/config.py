"""Bounds of every wait in the PD flow: no RPC, transfer or retry waits forever."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class PDConfig:
    rpc_timeout_s: float = 10.0  # deadline of AddNewRequests, Generations and the link calls
    first_generation_timeout_s: float = 60.0  # FirstGeneration, which includes a PULL
    transfer_timeout_s: float = 60.0  # waiting for a request's KV to be stored and checked
    link_timeout_s: float = 10.0  # opening the data path and its handshake
    reserve_timeout_s: float = 30.0  # total time a prefill retries 404s before failing a request
    backoff_initial_s: float = 0.02  # first wait after a 404, doubled up to backoff_max_s
    backoff_max_s: float = 1.0
    # A decode frees reserved blocks whose FirstGeneration has not come after this long.
    reservation_ttl_s: float = 120.0
    # A prefill asks each linked decode's gRPC health service this often, with this deadline; after
    # `health_failures` misses in a row the decode is unhealthy (hung: alive but not answering): no
    # new request goes there and its streams fail, until it answers again.
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    health_failures: int = 3
    # A handed-off stream that gets no token for this long fails (its decode dropped it unseen).
    stream_idle_timeout_s: float = 30.0
    max_message_bytes: int = 16 << 20  # a larger gRPC message is refused with RESOURCE_EXHAUSTED
    # A decode shares the prompt blocks its prefix cache holds, when its prefill can skip them.
    prefix_reuse: bool = True
    # Times one request's stream may move to another decode when its decode fails it (0: never).
    max_migrations: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool) and value <= 0 and f.name != "max_migrations":
                raise ValueError(f"PDConfig.{f.name} must be positive, got {value}")
        if self.max_migrations < 0:
            raise ValueError(f"PDConfig.max_migrations must be >= 0, got {self.max_migrations}")
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("PDConfig.backoff_initial_s must not exceed backoff_max_s")

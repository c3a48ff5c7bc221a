"""What is simulated: instances of lockstep attention ranks, and under PD disaggregation the KV
link between a prefill and a decode instance."""

from __future__ import annotations

from dataclasses import dataclass

from afd_engine.errors import ConfigError
from afd_engine.planner.hardware import Hardware
from afd_engine.planner.sim.front_end import FrontEnd
from afd_engine.planner.sim.speculative import SpecDecoding
from afd_engine.planner.sim.step_time import StepTimeModel

POLICIES = ("lpm", "fcfs")
ROUTERS = ("cache_aware", "shortest_queue", "round_robin")  # the engine's --load-balance-method


@dataclass(frozen=True)
class KVLink:
    """The KV transfer from a prefill rank to a decode rank: bytes per token of KV, the goodput of
    the link (the slower of the two GPUs' NIC shares) and a fixed latency per transfer."""

    bytes_per_token: float
    bandwidth_bps: float  # bytes per second
    latency_s: float

    @classmethod
    def between(cls, src: Hardware, dst: Hardware, kv_bytes_per_token: float) -> KVLink:
        """network.py's model of one link: line rate x goodput factor, plus the fixed latency."""
        bw = min(src.nic_gbs_per_gpu * src.efficiency.nic, dst.nic_gbs_per_gpu * dst.efficiency.nic) * 1e9
        return cls(kv_bytes_per_token, bw, src.efficiency.comm_latency_us * 1e-6)

    def seconds(self, tokens: int) -> float:
        """Time the link is occupied by `tokens` tokens of KV (the latency comes on top, once)."""
        return tokens * self.bytes_per_token / self.bandwidth_bps


@dataclass(frozen=True)
class InstanceConfig:
    """`replicas` identical instances of `ranks` lockstep attention ranks each."""

    ranks: int
    step_time: StepTimeModel
    kv_pages: int  # per rank
    gpus: int = 0  # per instance, attention and expert GPUs (0: `ranks`)
    replicas: int = 1
    page_tokens: int = 16
    max_batch_tokens: int = 2048
    max_running: int = 256
    policy: str = "lpm"
    prefix_cache: bool = True
    attention_topk: int = 0  # sparse attention (DeepSeek-V3.2's index_topk): positions a query attends to; 0: all
    speculative: SpecDecoding | None = None  # speculative decoding of its decodes (None: one token a step)

    def validate(self, where: str) -> None:
        if self.ranks < 1 or self.replicas < 1:
            raise ConfigError(f"{where}: ranks and replicas must be >= 1")
        if self.attention_topk < 0:
            raise ConfigError(f"{where}: attention top-k must be >= 0 (0: dense attention)")
        if self.kv_pages < 1 or self.page_tokens < 1:
            raise ConfigError(f"{where}: KV pages and page size must be >= 1 (got {self.kv_pages}, {self.page_tokens})")
        if self.max_batch_tokens < 1 or not 1 <= self.max_running <= self.max_batch_tokens:
            raise ConfigError(
                f"{where}: need 1 <= max running requests ({self.max_running}) <= max batched tokens "
                f"({self.max_batch_tokens}), so that every running request decodes in every step"
            )
        if self.speculative is not None:
            self.speculative.validate(where)
            per = self.speculative.drafts + 1
            rows = self.max_running * per
            if rows > self.max_batch_tokens:
                raise ConfigError(
                    f"{where}: {self.max_running} running requests x {per} verify rows ({rows}) "
                    f"exceed the {self.max_batch_tokens} batched tokens; lower the running requests or raise the "
                    "token budget"
                )
        if self.policy not in POLICIES:
            raise ConfigError(f"{where}: schedule policy {self.policy!r} must be one of {', '.join(POLICIES)}")

    @property
    def total_gpus(self) -> int:
        return (self.gpus or self.ranks) * self.replicas


@dataclass(frozen=True)
class ClusterConfig:
    """What is simulated: `serving` instances alone, or, with `decode` and `kv_link`, prefill
    instances (`serving`) and decode instances under PD disaggregation."""

    name: str
    serving: InstanceConfig
    decode: InstanceConfig | None = None
    kv_link: KVLink | None = None
    router: str = "cache_aware"
    # the API server takes requests one at a time (front_end.py): when each reaches its instance
    front_end: FrontEnd = FrontEnd()
    # from the end of the step that made a token to the client having it (the API server's
    # response path): adds to TTFT and end-to-end latency, not to TPOT
    response_s: float = 0.0

    def validate(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"{self.name}: router {self.router!r} must be one of {', '.join(ROUTERS)}")
        self.front_end.validate(self.name)
        if not self.response_s >= 0:
            raise ConfigError(f"{self.name}: the response time must be >= 0 (got {self.response_s!r})")
        self.serving.validate(f"{self.name}: prefill" if self.decode else self.name)
        if self.decode is not None:
            self.decode.validate(f"{self.name}: decode")
            if self.serving.speculative is not None:
                raise ConfigError(f"{self.name}: speculative decoding applies to the decode instances, not prefill")
            if self.kv_link is None:
                raise ConfigError(f"{self.name}: PD disaggregation needs a KV link")

    @property
    def gpus(self) -> int:
        return self.serving.total_gpus + (self.decode.total_gpus if self.decode else 0)

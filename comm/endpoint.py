"""What both sides of dispatch/combine share: settings, counted sends, routing-table helpers."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from comm.messages import CommError, CommTimeout, Message, MsgKey
from comm.stats import CommStats
from comm.topology import LOCAL, Topology
from comm.transport.base import Transport
from comm.wire import WireFormat, nbytes

MODES = ("two-stage", "direct")
_KEEP_CALL_STATS = 256
INTERRUPT_CHECK_S = 0.25  # how often a wait with an `interrupt` hook calls it


@dataclass(frozen=True)
class CommConfig:
    """mode: "two-stage" (AFD) or "direct" (one copy per (token, expert), the colocated baseline).
    timeout: seconds a receive waits before raising CommTimeout."""

    mode: str = "two-stage"
    wire: WireFormat = WireFormat()
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise CommError(f"dispatch mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.timeout <= 0:
            raise CommError("the receive timeout must be positive")


class Endpoint:
    """A transport plus traffic counters: cumulative, and per (phase, key) for recent calls."""

    def __init__(self, topo: Topology, endpoint: int, transport: Transport, config: CommConfig) -> None:
        self.topo, self.endpoint, self.transport, self.config = topo, endpoint, transport, config
        self.stats = CommStats()
        self.call_stats: OrderedDict[tuple[str, MsgKey], CommStats] = OrderedDict()
        self._links = {dst: topo.link(endpoint, dst) for dst in range(topo.num_endpoints)}
        # Fault tolerance: called every INTERRUPT_CHECK_S while a receive waits; it raises to give
        # the wait up (a peer was lost, or the step is abandoned). A wait with it lasts up to twice
        # the timeout, so that a lost peer is told from a slow one before the wait fails.
        self.interrupt: Callable[[], None] | None = None
        self._tables: dict[tuple[str, torch.device], torch.Tensor] = {}  # see on_device

    def on_device(self, name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`table` (a routing table this endpoint only reads, known by `name`) on `device`, copied
        there once: routing then indexes it where the ids are, without a round trip to the host."""
        copy = self._tables.get((name, device))
        if copy is None:
            copy = self._tables[(name, device)] = table.to(device)
        return copy

    def send(self, dst: int, phase: str, msg: Message, copies: int) -> None:
        self.transport.send(dst, msg)
        link = self._links[dst]
        if link == LOCAL:  # crosses no link: not counted (stats.py)
            return
        call = self.call_stats.get((phase, msg.key))
        if call is None:
            call = self.call_stats[(phase, msg.key)] = CommStats()
            if len(self.call_stats) > _KEEP_CALL_STATS:
                self.call_stats.popitem(last=False)
        size = nbytes(msg.tensors)
        self.stats.record(phase, link, copies, size)
        call.record(phase, link, copies, size)

    def recv(self, src: int, kind: str, key: MsgKey) -> Message:
        return self._wait(lambda t: self.transport.recv(src, kind, key, t), f"{kind} {key} from endpoint {src}")

    def recv_any(self, srcs: list[int], kind: str, key: MsgKey) -> Message:
        return self._wait(lambda t: self.transport.recv_any(srcs, kind, key, t), f"{kind} {key} from {srcs}")

    @property
    def wait_s(self) -> float:
        """The longest a receive waits."""
        return self.config.timeout * (1 if self.interrupt is None else 2)

    def _wait(self, receive: Callable[[float], Message], what: str) -> Message:
        if self.interrupt is None:
            return receive(self.config.timeout)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return receive(min(INTERRUPT_CHECK_S, max(deadline - time.monotonic(), 0.0)))
            except CommTimeout:
                self.interrupt()
                if time.monotonic() >= deadline:
                    raise CommTimeout(
                        f"endpoint {self.endpoint} waited {self.wait_s:.1f} s for {what} and nothing came, "
                        "while no peer was reported lost: is it at the same step?"
                    ) from None


def masked_rows(select: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """select [T, K] bool -> (rows [n] of tokens with any selected slot, ids [n, K] int32 with -1
    where unselected, weights [n, K] fp32 with 0 where unselected)."""
    rows = select.any(dim=1).nonzero().flatten()
    keep = select[rows]
    return rows, torch.where(keep, ids[rows], -1).to(torch.int32), torch.where(keep, weights[rows], 0.0).float()

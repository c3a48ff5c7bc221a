"""How a MoE layer reaches its routed experts: the expert executor and the expert server.

A MoE layer's operations never know where its experts run. Its `dispatch` operation hands the
micro-batch's tokens to an **expert executor** and its `combine` operation takes the routed
output back; between the two the mode may yield to other micro-batches:

    LocalExpertExecutor    single mode: dispatch computes the experts in place, combine returns it
    (remote executor)      colocated / AFD attention ranks: dispatch/combine through `comm/`
                           (afd_engine.ranks.remote_experts)

Ranks that hold experts for others (FFN ranks, and colocated ranks for their peers) run the
expert-side operations of `expert_operations` against an **expert server**: post the receive,
receive the token copies, compute them with the same `RoutedExperts` module single mode uses,
send the results back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from afd_engine.operations import Operation


class Experts(Protocol):
    """A layer's routed experts (models.routed_experts.RoutedExperts): local slot ids in, [M, H] out."""

    def __call__(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor: ...


class ExpertExecutor(ABC):
    """Runs the routed experts of one (layer, micro-batch): `dispatch` starts, `combine` finishes.
    With a `recorder` (eplb.recorder.ExpertLoadRecorder), dispatch counts the gate's choices."""

    recorder = None

    @abstractmethod
    def dispatch(
        self, layer_id: int, micro_batch: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Any:
        """hidden [T, H]; topk_ids [T, K] int64 global expert ids; topk_weights [T, K] fp32.
        Returns a handle for `combine`; must not wait for other ranks."""

    @abstractmethod
    def combine(self, handle: Any) -> torch.Tensor:
        """[T, H] in hidden's dtype: per token, the top-k-weighted sum of its experts' outputs."""


class LocalExpertExecutor(ExpertExecutor):
    """Every routed expert lives in this process (single mode): dispatch computes at once."""

    def __init__(self, experts: Mapping[int, Experts], recorder=None) -> None:
        self.experts = experts  # layer id -> that layer's experts
        self.recorder = recorder

    def dispatch(self, layer_id, micro_batch, hidden, topk_ids, topk_weights) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.record(layer_id, topk_ids)
        experts = self.experts[layer_id]
        return experts(hidden, experts.to_local(topk_ids), topk_weights)

    def combine(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


class ReceivedTokens(Protocol):
    """What an expert server delivers (comm.ExpertBatch): rows routed to this rank's experts."""

    hidden: torch.Tensor  # [M, H]
    local_ids: torch.Tensor  # [M, K] int64, -1 where another rank's expert
    weights: torch.Tensor  # [M, K] fp32


class ExpertServer(ABC):
    """The expert side of the data plane for one rank, step by step."""

    @abstractmethod
    def post(self, layer_id: int, micro_batch: int) -> None:
        """Starts receiving (layer, micro-batch) in the background; never blocks."""

    @abstractmethod
    def receive(self, layer_id: int, micro_batch: int) -> ReceivedTokens:
        """Blocks until every token copy routed to this rank for (layer, micro-batch) arrived."""

    @abstractmethod
    def send(self, tokens: ReceivedTokens, outputs: torch.Tensor) -> None:
        """outputs [M, H]: per received row, the weighted sum over this rank's experts; never blocks."""

    def compute(self, layer_id: int, experts: Experts, tokens: ReceivedTokens) -> torch.Tensor:
        """Layer `layer_id`'s experts on the received rows (a server may replay a graph of them)."""
        return experts(tokens.hidden, tokens.local_ids, tokens.weights)


def expert_operations(layer_id: int, experts: Experts, server: ExpertServer) -> tuple[Operation, ...]:
    """The expert side of one MoE layer, in order: post_dispatch, receive, experts, send_combine."""

    def post_dispatch(st) -> None:
        server.post(layer_id, st.micro_batch)

    def receive(st) -> None:
        st.set("received", server.receive(layer_id, st.micro_batch))

    def run_experts(st) -> None:
        tokens = st.get("received")
        if tokens.hidden.shape[0] == 0:  # nothing to serve (a colocated rank alone with tokens: every step)
            st.set("expert_out", tokens.hidden)
            return
        st.set("expert_out", server.compute(layer_id, experts, tokens))

    def send_combine(st) -> None:
        server.send(st.pop("received"), st.pop("expert_out"))

    return tuple(
        Operation(name, fn, layer_id)
        for name, fn in (
            ("post_dispatch", post_dispatch),
            ("receive", receive),
            ("experts", run_experts),
            ("send_combine", send_combine),
        )
    )

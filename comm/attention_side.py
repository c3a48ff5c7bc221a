"""The sender side of dispatch/combine: an attention rank sends its tokens out and gathers results.

two-stage: token t goes once to each F node that owns any of its experts, to the node's local
rank (sender mod R), carrying the node's share of its top-k; each node returns one already
weighted and reduced vector per token, and the sender adds the node results.
direct: one copy per (token, selected expert) to the owner rank; the owner returns the expert's
raw output per copy and the sender applies the top-k weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from comm.endpoint import CommConfig, Endpoint, masked_rows
from comm.messages import Message, MsgKey
from comm.stats import CommStats
from comm.topology import Topology
from comm.transport.base import Transport


@dataclass
class DispatchHandle:
    """What combine needs to put results back: per peer, which tokens (and weights) went there."""

    key: MsgKey
    num_tokens: int
    hidden_size: int
    dtype: torch.dtype
    routes: list[tuple[int, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (peer, rows, weights)
    dispatch_stats: CommStats = field(default_factory=CommStats)  # what this call sent


class AttentionEndpoint(Endpoint):
    """Sender `sender` of `topo`; one per attention rank."""

    def __init__(self, topo: Topology, sender: int, transport: Transport, config: CommConfig = CommConfig()) -> None:
        super().__init__(topo, topo.sender_endpoint(sender), transport, config)
        self.sender = sender

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 key: MsgKey) -> DispatchHandle:
        """Sends tokens to their experts without waiting for anyone.

        hidden [T, H] fp32/bf16; topk_ids [T, K] int64 logical experts; topk_weights [T, K] fp32.
        T may be 0: every peer still gets a (empty) message, so it never waits in vain.
        """
        handle = DispatchHandle(key, hidden.shape[0], hidden.shape[1], hidden.dtype)
        if self.config.mode == "two-stage":
            self._dispatch_two_stage(hidden, topk_ids, topk_weights, handle)
        else:
            self._dispatch_direct(hidden, topk_ids, topk_weights, handle)
        handle.dispatch_stats = self.call_stats.get(("dispatch", key), CommStats())
        return handle

    def _dispatch_two_stage(self, hidden, topk_ids, topk_weights, handle: DispatchHandle) -> None:
        node_of = self.topo.node_of_expert[topk_ids]  # [T, K]
        for node in range(self.topo.num_nodes):
            rows, ids, weights = masked_rows(node_of == node, topk_ids, topk_weights)
            parts = self.config.wire.encode(hidden[rows])
            peer = self.topo.owner_endpoint(self.topo.relay_rank(self.sender, node))
            msg = Message("dispatch", handle.key, self.endpoint, [*parts, ids, weights, rows.to(torch.int32)],
                          {"sender": self.sender, "dtype": str(hidden.dtype)})
            self.send(peer, "dispatch", msg, rows.numel())
            handle.routes.append((peer, rows, None))

    def _dispatch_direct(self, hidden, topk_ids, topk_weights, handle: DispatchHandle) -> None:
        owner = self.topo.owner_of[topk_ids]  # [T, K]
        for rank in range(self.topo.num_owners):
            rows, slot = (owner == rank).nonzero(as_tuple=True)  # one copy per (token, expert)
            parts = self.config.wire.encode(hidden[rows])
            peer = self.topo.owner_endpoint(rank)
            ids = topk_ids[rows, slot].to(torch.int32)
            msg = Message("dispatch_direct", handle.key, self.endpoint, [*parts, ids, rows.to(torch.int32)],
                          {"sender": self.sender, "dtype": str(hidden.dtype)})
            self.send(peer, "dispatch", msg, rows.numel())
            handle.routes.append((peer, rows, topk_weights[rows, slot].float()))

    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        """Waits for every peer's results and returns [T, H] in the dispatched dtype: per token,
        the top-k-weighted sum of its experts' outputs."""
        out = torch.zeros(handle.num_tokens, handle.hidden_size, dtype=torch.float32)
        kind = "combine" if self.config.mode == "two-stage" else "combine_direct"
        for peer, rows, weights in handle.routes:
            y = self.recv(peer, kind, handle.key).tensors[0].float()  # [n, H]
            out.index_add_(0, rows, y if weights is None else y * weights[:, None])
        return out.to(handle.dtype)

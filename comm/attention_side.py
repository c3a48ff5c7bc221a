"""The sender side of dispatch/combine: an attention rank sends its tokens out and gathers results.

One class per dispatch mode, behind the same API (`attention_endpoint` picks by `config.mode`):

two-stage: token t goes once to each FFN node that holds any of its experts, to the node's local
rank (sender mod R), carrying the node's share of its top-k; each node returns one already
weighted and reduced vector per token, and the sender adds the node results.
direct: one copy per (token, selected expert) to the FFN rank holding it; that rank returns the
expert's raw output per copy and the sender applies the top-k weights. A colocated sender may keep
its own rank's copies (`keep_own`): it then computes that share itself, without a message to itself,
and hands it to `combine` as `partial`.

Devices: the tensors given to `dispatch` may live on a GPU, as where the transport carries them
there (`Transport.payload_device`); `combine` returns on the device of the dispatched `hidden`
(moving results there where the transport delivers them elsewhere). Routing stays on the device,
but for these host reads (outside any graph; each waits for the device): two-stage with several
nodes, the number of rows per node (`masked_rows`' nonzero); direct, the routing tables
(`topk_ids` and `topk_weights` copied to the host once per dispatch, where numpy routes them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from comm.endpoint import CommConfig, Endpoint, masked_rows
from comm.messages import CommError, MsgKey
from comm.protocol import COMBINE, COMBINE_DIRECT, DISPATCH, DISPATCH_DIRECT, Layout, dtype_name
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
    # (peer, rows, weights) per peer, on `device`; rows None: the only route, every token in order
    routes: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    dispatch_stats: CommStats = field(default_factory=CommStats)  # what this call sent
    device: torch.device = torch.device("cpu")  # the dispatched hidden's: combine returns there


class AttentionEndpoint(Endpoint, ABC):
    """Sender `sender` of `topo`; one per attention rank."""

    combine_layout: Layout

    def __init__(self, topo: Topology, sender: int, transport: Transport, config: CommConfig = CommConfig()) -> None:
        super().__init__(topo, topo.sender_endpoint(sender), transport, config)
        self.sender = sender
        self._ranges: dict[tuple[int, torch.device], torch.Tensor] = {}  # see _rows
        # the FFN rank sharing this endpoint (colocated), or None
        self.own_rank = next((r for r in range(topo.num_ffn_ranks) if topo.ffn_endpoint(r) == self.endpoint), None)

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        key: MsgKey,
        expected: bool = True,
        keep_own: bool = False,
    ) -> DispatchHandle:
        """Sends tokens to their experts without waiting for anyone.

        hidden [T, H] fp32/bf16; topk_ids [T, K] int64 logical experts; topk_weights [T, K] fp32.
        T may be 0: every peer still gets a (empty) message, so it never waits in vain, unless
        not `expected`: the FFN side was told that this sender has no tokens for key (the
        `senders` of FfnEndpoint.recv_dispatch leave it out), and nothing is sent.
        `keep_own` (direct mode, colocated): nothing goes to this rank's own experts, and its own
        FFN endpoint must not wait for this sender; the caller computes that share itself and
        passes it to `combine`.
        """
        if keep_own and self.own_rank is None:
            raise CommError(f"sender {self.sender} holds no experts: it has no share to keep")
        handle = DispatchHandle(key, hidden.shape[0], hidden.shape[1], hidden.dtype, device=hidden.device)
        if not expected:
            if hidden.shape[0]:
                raise CommError(f"sender {self.sender}: {hidden.shape[0]} tokens for {key}, which no FFN rank expects")
            return handle  # no routes: combine gives [0, H] without waiting
        self._send_tokens(hidden, topk_ids, topk_weights, handle, keep_own)
        handle.dispatch_stats = self.call_stats.get(("dispatch", key), CommStats())
        return handle

    @abstractmethod
    def _send_tokens(self, hidden, topk_ids, topk_weights, handle: DispatchHandle, keep_own: bool) -> None:
        """Sends one message per peer (but this rank's own with `keep_own`) and records its route
        in `handle`."""

    def combine(self, handle: DispatchHandle, partial: torch.Tensor | None = None) -> torch.Tensor:
        """Waits for every peer's results and returns [T, H] in the dispatched dtype: per token,
        the top-k-weighted sum of its experts' outputs. `partial` [T, H]: the share of the experts
        kept by dispatch(keep_own=True), already weighted, which the peers' results are added to
        (in place where it is fp32)."""
        routes = handle.routes
        if partial is None and len(routes) == 1 and routes[0][1] is None:  # every token in order: no scatter
            return self._results(handle, routes[0][0], routes[0][2]).to(handle.dtype)
        if partial is None:
            out = torch.zeros(handle.num_tokens, handle.hidden_size, device=handle.device)
        else:
            out = partial.float()
        for peer, rows, weights in routes:
            out.index_add_(0, rows.to(out.device), self._results(handle, peer, weights).to(out.device))
        return out.to(handle.dtype)

    def _results(self, handle: DispatchHandle, peer: int, weights: torch.Tensor | None) -> torch.Tensor:
        """peer's combine message for handle, fp32 [n, H] on the handle's device, weighted per row
        where `weights` [n] is given."""
        y = self.combine_layout.unpack(self.recv(peer, self.combine_layout.kind, handle.key))["out"]
        y = y.to(handle.device, torch.float32)
        return y if weights is None else y * weights[:, None]

    def _rows(self, n: int, device: torch.device) -> torch.Tensor:
        """[n] int32 0..n-1 on device, one tensor per (n, device), made once (a range is read, never
        written)."""
        rows = self._ranges.get((n, device))
        if rows is None:
            rows = self._ranges[(n, device)] = torch.arange(n, dtype=torch.int32, device=device)
        return rows

    def _meta(self, hidden: torch.Tensor) -> dict:
        return {"sender": self.sender, "dtype": dtype_name(hidden.dtype)}


class TwoStageAttentionEndpoint(AttentionEndpoint):
    combine_layout = COMBINE

    def _send_tokens(self, hidden, topk_ids, topk_weights, handle: DispatchHandle, keep_own: bool) -> None:
        if keep_own:
            raise CommError("two-stage dispatch sends every token to its node's relay: it keeps no share")
        if self.topo.num_nodes == 1:  # the one node takes every token whole: nothing to select
            rows = self._rows(hidden.shape[0], hidden.device)
            self._send_node(0, hidden, rows, topk_ids.to(torch.int32), topk_weights.float(), handle, whole=True)
            return
        node_of = self.on_device("node_of_expert", self.topo.node_of_expert, topk_ids.device)[topk_ids]  # [T, K]
        for node in range(self.topo.num_nodes):
            if not self.topo.live_ranks(node):  # every rank of it lost: it holds no slot in use
                continue
            rows, ids, weights = masked_rows(node_of == node, topk_ids, topk_weights)
            self._send_node(node, hidden[rows], rows, ids, weights, handle, whole=False)

    def _send_node(self, node, hidden, rows, ids, weights, handle: DispatchHandle, whole: bool) -> None:
        """hidden [n, H]: the rows of the sender's tokens that go to `node`, with their node-local
        ids and weights [n, K]; `whole`: every token, in order (combine then needs no scatter)."""
        values, scales = self.config.wire.encode(hidden)
        peer = self.topo.ffn_endpoint(self.topo.relay_rank(self.sender, node))
        msg = DISPATCH.pack(
            handle.key,
            self.endpoint,
            self._meta(hidden),
            hidden=values,
            scales=scales,
            ids=ids,
            weights=weights,
            rows=rows.to(torch.int32),
        )
        self.send(peer, "dispatch", msg, rows.numel())
        handle.routes.append((peer, None if whole else rows, None))  # the node weighted and reduced already


class DirectAttentionEndpoint(AttentionEndpoint):
    combine_layout = COMBINE_DIRECT

    @cached_property
    def _send_order(self) -> list[int]:
        """FFN ranks in order, a colocated rank's own last: its peers start on their share sooner
        (the routes, and so the order in which combine adds the results, stay in rank order)."""
        live = [r for r in range(self.topo.num_ffn_ranks) if r not in self.topo.dead]
        return sorted(live, key=lambda r: self.topo.ffn_endpoint(r) == self.endpoint)

    @cached_property
    def _rank_of(self) -> np.ndarray:
        return self.topo.ffn_rank_of.numpy()

    def _send_tokens(self, hidden, topk_ids, topk_weights, handle: DispatchHandle, keep_own: bool) -> None:
        # The routing tables in numpy: its indexing of a few small arrays costs a third of torch's
        # (on a GPU, their copy to the host is this dispatch's one wait for the device).
        ids, weights = topk_ids.cpu().numpy(), topk_weights.float().cpu().numpy()
        ffn_rank = self._rank_of[ids]  # [T, K]
        routes = {}
        for rank in self._send_order[:-1] if keep_own else self._send_order:  # the own rank is last
            rows, slot = np.nonzero(ffn_rank == rank)  # one copy per (token, expert), in token order
            token_rows = torch.from_numpy(rows).to(hidden.device)
            values, scales = self.config.wire.encode(hidden.index_select(0, token_rows))
            peer = self.topo.ffn_endpoint(rank)
            msg = DISPATCH_DIRECT.pack(
                handle.key,
                self.endpoint,
                self._meta(hidden),
                hidden=values,
                scales=scales,
                ids=torch.from_numpy(ids[rows, slot].astype(np.int32)),
                rows=torch.from_numpy(rows.astype(np.int32)),
            )
            self.send(peer, "dispatch", msg, len(rows))
            routes[rank] = (peer, token_rows, torch.from_numpy(weights[rows, slot]).to(hidden.device))
        handle.routes.extend(routes[rank] for rank in sorted(routes))


def attention_endpoint(
    topo: Topology, sender: int, transport: Transport, config: CommConfig = CommConfig()
) -> AttentionEndpoint:
    """The sender endpoint of `config.mode`."""
    cls = TwoStageAttentionEndpoint if config.mode == "two-stage" else DirectAttentionEndpoint
    return cls(topo, sender, transport, config)

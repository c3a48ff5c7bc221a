"""The expert-owner side of dispatch/combine: an F rank receives tokens, and returns results.

In two-stage mode every F rank is also a relay for the senders i with i mod R == its local
rank. Relaying runs on two background threads (one per direction), so forwarding overlaps the
rank's own expert compute:

    sender --dispatch--> relay --forward--> owner ranks of the node (itself included)
    sender <--combine--- relay <--expert_out-- owner ranks   (relay sums the node's experts)

The relay forwards each sender's tokens as soon as that sender's message arrives (recv_any),
without waiting for the others. fp8 payloads are forwarded as they came, never re-quantized.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from comm.endpoint import DTYPES, CommConfig, Endpoint, masked_rows
from comm.messages import CommTimeout, Message, MsgKey
from comm.topology import Topology
from comm.transport.base import Transport


@dataclass
class ExpertBatch:
    """The token copies an F rank received for one (step, layer, micro-batch).

    hidden [M, H]: activations, dequantized to the senders' dtype.
    local_ids [M, K] int64: index among this rank's experts, -1 where the slot is another rank's.
    weights [M, K] fp32: the routing weights to apply (1.0 in direct mode: senders weight there).
    sources [M] int64: sending attention rank; slots [M] int64: token row at that sender.
    """

    key: MsgKey
    hidden: torch.Tensor
    local_ids: torch.Tensor
    weights: torch.Tensor
    sources: torch.Tensor
    slots: torch.Tensor
    _returns: list[tuple[int, int, int]]  # (peer endpoint, sender, rows) per received message, in order

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]

    def expert_rows(self, local_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows routed to one local expert and their weights: ([n] int64, [n] fp32)."""
        rows, slot = (self.local_ids == local_expert).nonzero(as_tuple=True)
        return rows, self.weights[rows, slot]


class FfnEndpoint(Endpoint):
    """Owner rank `rank` of `topo` (an F rank; in colocated mode also an attention rank)."""

    def __init__(self, topo: Topology, rank: int, transport: Transport, config: CommConfig = CommConfig()) -> None:
        super().__init__(topo, topo.owner_endpoint(rank), transport, config)
        self.rank, self.node = rank, topo.node_of_rank(rank)
        self.local_index = topo.local_index(rank)  # [E]
        self._relay_out = ThreadPoolExecutor(1, thread_name_prefix=f"relay-dispatch-{rank}")
        self._relay_back = ThreadPoolExecutor(1, thread_name_prefix=f"relay-combine-{rank}")
        self._forwarded: dict[MsgKey, Future] = {}
        self._returning: list[Future] = []

    # -- receive ---------------------------------------------------------------------------

    def post_dispatch(self, key: MsgKey) -> None:
        """Starts relaying `key` in the background (idempotent); call it early to overlap."""
        if self.config.mode == "two-stage" and key not in self._forwarded:
            self._forwarded[key] = self._relay_out.submit(self._relay_dispatch, key)

    def recv_dispatch(self, key: MsgKey) -> ExpertBatch:
        """Blocks until every token copy routed to this rank for `key` arrived."""
        self._check_background()
        self.post_dispatch(key)
        try:
            msgs = self._recv_forwards(key) if self.config.mode == "two-stage" else self._recv_direct(key)
        except CommTimeout:
            self._raise_relay_error(key)
            raise
        return self._batch(key, msgs)

    def _recv_forwards(self, key: MsgKey) -> list[Message]:
        msgs = []
        for relay in self.topo.node_ranks(self.node):
            for _ in self.topo.senders_of_relay(relay):
                msgs.append(self.recv(self.topo.owner_endpoint(relay), "forward", key))
        return msgs

    def _recv_direct(self, key: MsgKey) -> list[Message]:
        return [self.recv(self.topo.sender_endpoint(s), "dispatch_direct", key) for s in range(self.topo.num_senders)]

    def _batch(self, key: MsgKey, msgs: list[Message]) -> ExpertBatch:
        wire, parts = self.config.wire, self.config.wire.num_parts
        hidden, ids, weights, sources, slots = [], [], [], [], []
        for m in msgs:
            hidden.append(wire.decode(m.tensors[:parts], DTYPES[m.meta["dtype"]]))
            m_ids = m.tensors[parts].long()
            ids.append(m_ids[:, None] if m_ids.dim() == 1 else m_ids)  # direct: one expert per row
            weights.append(m.tensors[parts + 1] if self.config.mode == "two-stage" else torch.ones(ids[-1].shape))
            slots.append(m.tensors[-1].long())
            sources.append(torch.full((len(slots[-1]),), m.meta["sender"], dtype=torch.int64))
        ids = torch.cat(ids)
        local = torch.where(ids >= 0, self.local_index[ids.clamp(min=0)], -1)
        returns = [(m.src, m.meta["sender"], len(m.tensors[-1])) for m in msgs]
        return ExpertBatch(key, torch.cat(hidden), local, torch.cat(weights).float(), torch.cat(sources),
                           torch.cat(slots), returns)

    # -- return ----------------------------------------------------------------------------

    def send_combine(self, batch: ExpertBatch, outputs: torch.Tensor) -> None:
        """outputs [M, H]: per received row, the weighted sum over this rank's experts
        (in direct mode, the one expert's raw output). Sends without waiting."""
        dtype = self.config.wire.combine_dtype
        kind = "expert_out" if self.config.mode == "two-stage" else "combine_direct"
        for (peer, sender, n), y in zip(batch._returns, outputs.split([r[2] for r in batch._returns])):
            self.send(peer, "combine", Message(kind, batch.key, self.endpoint, [y.to(dtype).contiguous()],
                                               {"sender": sender}), n)
        if self.config.mode == "two-stage":
            self._check_background()
            self._returning.append(self._relay_back.submit(self._relay_combine, batch.key))

    # -- relay (background threads) --------------------------------------------------------

    def _relay_dispatch(self, key: MsgKey) -> list[tuple[int, int, dict[int, torch.Tensor]]]:
        """Forwards each of this relay's senders' tokens to the node's owners, first come first
        served. Returns per sender, in forwarding order: (sender, tokens, rows sent to each owner)."""
        waiting = {self.topo.sender_endpoint(s) for s in self.topo.senders_of_relay(self.rank)}
        done = []
        while waiting:
            msg = self.transport.recv_any(sorted(waiting), "dispatch", key, self.config.timeout)
            waiting.discard(msg.src)
            done.append((msg.meta["sender"], len(msg.tensors[-1]), self._forward(msg)))
        return done

    def _forward(self, msg: Message) -> dict[int, torch.Tensor]:
        parts = self.config.wire.num_parts
        *payload, ids, weights, slots = msg.tensors
        owner = torch.where(ids >= 0, self.topo.owner_of[ids.long().clamp(min=0)], -1)  # [n, K]
        sent = {}
        for rank in self.topo.node_ranks(self.node):
            rows, r_ids, r_weights = masked_rows(owner == rank, ids, weights)
            out = Message("forward", msg.key, self.endpoint, [p[rows] for p in payload[:parts]] +
                          [r_ids, r_weights, slots[rows]], dict(msg.meta))
            self.send(self.topo.owner_endpoint(rank), "dispatch", out, rows.numel())
            sent[rank] = rows
        return sent

    def _relay_combine(self, key: MsgKey) -> None:
        """Sums the node's expert outputs per token and returns one vector per token to each sender."""
        dtype = self.config.wire.combine_dtype
        for sender, n, sent in self._forwarded.pop(key).result(timeout=self.config.timeout):
            acc = None
            for rank, rows in sent.items():
                y = self.recv(self.topo.owner_endpoint(rank), "expert_out", key).tensors[0]
                acc = torch.zeros(n, y.shape[1]) if acc is None else acc
                acc.index_add_(0, rows.long(), y.float())
            msg = Message("combine", key, self.endpoint, [acc.to(dtype)], {"sender": sender})
            self.send(self.topo.sender_endpoint(sender), "combine", msg, n)

    def _check_background(self) -> None:
        """Re-raises, on the caller's thread, the first failure of a finished relay-combine job."""
        done = [f for f in self._returning if f.done()]
        self._returning = [f for f in self._returning if not f.done()]
        for f in done:
            if f.exception() is not None:
                raise f.exception()

    def _raise_relay_error(self, key: MsgKey) -> None:
        job = self._forwarded.get(key)
        if job is not None and job.done() and job.exception() is not None:
            raise job.exception()

    def close(self, drain: bool = True) -> None:
        """Stops the relay threads; with `drain`, first lets queued relay work finish (each job is
        bounded by the receive timeout), so results already computed still reach their senders."""
        self._relay_out.shutdown(wait=drain, cancel_futures=not drain)
        self._relay_back.shutdown(wait=drain, cancel_futures=not drain)

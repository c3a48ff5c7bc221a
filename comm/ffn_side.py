"""The FFN side of dispatch/combine: an FFN rank receives tokens for its experts and returns results.

One class per dispatch mode, behind the same API (`ffn_endpoint` picks by `config.mode`).

two-stage: every FFN rank is also a relay for the senders i with i mod R == its local rank.
Relaying runs on two background threads (one per direction), so forwarding overlaps the rank's
own expert compute:

    sender --dispatch--> relay --forward--> FFN ranks of the node (itself included)
    sender <--combine--- relay <--expert_out-- FFN ranks   (relay sums the node's experts)

The relay forwards each sender's tokens as soon as that sender's message arrives (recv_any),
without waiting for the others. fp8 payloads are forwarded as they came, never re-quantized.
The only FFN rank of its node relays to nobody but itself, so it takes its senders' dispatch
messages and answers with combine messages itself: the same bytes on every link, without the
relay threads' hand-overs.

direct: every sender sends its copies straight here; results go straight back, unweighted.

Devices: received tensors are where the transport delivers them (`Transport.payload_device`, a
GPU with the device medium), and the batch, the relay's forwarding and the results stay there.
Host reads (outside any graph; each waits for the device): the relay's rows per FFN rank of its
node (`masked_rows`' nonzero in `_forward`) and `ExpertBatch.expert_rows` (a nonzero per expert).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from comm.endpoint import CommConfig, Endpoint, masked_rows
from comm.messages import CommError, CommTimeout, Message, MsgKey
from comm.protocol import COMBINE, COMBINE_DIRECT, DISPATCH, DISPATCH_DIRECT, DTYPES, EXPERT_OUT, FORWARD, Layout
from comm.topology import Topology
from comm.transport.base import Transport


@dataclass
class ExpertBatch:
    """The token copies an FFN rank received for one (step, layer, micro-batch).

    hidden [M, H]: activations, dequantized to the senders' dtype.
    local_ids [M, K] int64: index among this rank's experts, -1 where the slot is another rank's.
    weights [M, K] fp32: the routing weights to apply (1.0 in direct mode: senders weight there).
    """

    key: MsgKey
    hidden: torch.Tensor
    local_ids: torch.Tensor
    weights: torch.Tensor
    _returns: list[tuple[int, int, int]]  # (peer endpoint, sender, rows) per received message, in order

    @classmethod
    def empty(cls, key: MsgKey, hidden_size: int, top_k: int, dtype: torch.dtype, device=None) -> ExpertBatch:
        """No tokens, and nothing to send back: a key for which no sender sends."""
        hidden = torch.empty(0, hidden_size, dtype=dtype, device=device)
        ids = torch.empty(0, top_k, dtype=torch.int64, device=device)
        return cls(key, hidden, ids, torch.empty(0, top_k, device=device), [])

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]

    def expert_rows(self, local_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows routed to one local expert and their weights: ([n] int64, [n] fp32)."""
        rows, slot = (self.local_ids == local_expert).nonzero(as_tuple=True)
        return rows, self.weights[rows, slot]


class FfnEndpoint(Endpoint, ABC):
    """FFN rank `rank` of `topo` (in colocated mode also an attention rank)."""

    dispatch_layout: Layout  # what this rank receives its token copies as
    return_layout: Layout  # what it sends its results back as

    def __init__(self, topo: Topology, rank: int, transport: Transport, config: CommConfig = CommConfig()) -> None:
        super().__init__(topo, topo.ffn_endpoint(rank), transport, config)
        self.rank, self.node = rank, topo.node_of_rank(rank)
        self.local_index = topo.local_index(rank)  # [E]
        self._local_table = torch.cat([self.local_index, torch.tensor([-1])])  # [E + 1]: id -1 -> -1
        self._local_np = self._local_table.numpy()
        # every expert here, in order (one FFN rank): a local index is the id itself, -1 included
        self._ids_are_local = bool(torch.equal(self.local_index, torch.arange(len(self.local_index))))

    def post_dispatch(self, key: MsgKey, senders: Collection[int] | None = None) -> None:
        """Starts receiving `key` in the background where the mode has background work (idempotent);
        call it early to overlap. `senders`: as for recv_dispatch."""

    def recv_dispatch(self, key: MsgKey, senders: Collection[int] | None = None) -> ExpertBatch:
        """Blocks until every token copy routed to this rank for `key` arrived. `senders`: the
        senders that send for `key` (None: all); the others have no tokens for it and send nothing
        (their `dispatch(..., expected=False)`). At least one must send."""
        if senders is not None and not senders:
            raise CommError(f"FFN rank {self.rank}: no sender sends for {key}; leave such a key out")
        return self._batch(key, self._recv_copies(key, senders))

    @abstractmethod
    def _recv_copies(self, key: MsgKey, senders: Collection[int] | None) -> list[Message]:
        """The messages holding this rank's token copies for `key`, in a fixed order."""

    def _senders(self, senders: Collection[int] | None, among: Iterable[int]) -> list[int]:
        """The senders of `among` that send, in order."""
        return [s for s in among if senders is None or s in senders]

    def _batch(self, key: MsgKey, msgs: list[Message]) -> ExpertBatch:
        hidden, ids, weights, returns = [], [], [], []
        for m in msgs:
            f = self.dispatch_layout.unpack(m)
            hidden.append(self.config.wire.decode(f["hidden"], f["scales"], DTYPES[m.meta["dtype"]]))
            m_ids = f["ids"]  # int32; to_local makes the local ids int64
            ids.append(m_ids[:, None] if m_ids.dim() == 1 else m_ids)  # direct: one expert per row
            weights.append(f["weights"] if "weights" in f else torch.ones(ids[-1].shape, device=m_ids.device))
            returns.append((m.src, m.meta["sender"], len(f["rows"])))
        cat = torch.cat if len(msgs) > 1 else lambda ts: ts[0]
        return ExpertBatch(key, cat(hidden), self.to_local(cat(ids)), cat(weights).float(), returns)

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical expert slots [..] (int32/int64, -1 allowed) -> int64 local slot indices of this
        rank, -1 where the slot is another rank's. On the CPU the lookup runs in numpy (its indexing
        of a small array costs a third of torch's); on a device, in torch there."""
        if self._ids_are_local:
            return ids.long()
        if ids.is_cpu:
            return torch.from_numpy(self._local_np[ids.numpy()])  # id -1 reads the last entry, -1
        table = self.on_device("local_table", self._local_table, ids.device)
        return table[ids.long() % len(table)]  # id -1 -> the last entry, -1

    def send_combine(self, batch: ExpertBatch, outputs: torch.Tensor) -> None:
        """outputs [M, H]: per received row, the weighted sum over this rank's experts
        (in direct mode, the one expert's raw output). Sends without waiting."""
        dtype, returns = self.config.wire.combine_dtype, batch._returns
        parts = outputs.split([r[2] for r in returns]) if len(returns) > 1 else (outputs,)
        for (peer, sender, n), y in zip(returns, parts):
            msg = self.return_layout.pack(batch.key, self.endpoint, {"sender": sender}, out=y.to(dtype).contiguous())
            self.send(peer, "combine", msg, n)

    def close(self, drain: bool = True) -> None:
        """Stops background work; with `drain`, first lets queued work finish."""


class DirectFfnEndpoint(FfnEndpoint):
    dispatch_layout, return_layout = DISPATCH_DIRECT, COMBINE_DIRECT

    def _recv_copies(self, key: MsgKey, senders: Collection[int] | None) -> list[Message]:
        kind = self.dispatch_layout.kind
        active = self._senders(senders, range(self.topo.num_senders))
        return [self.recv(self.topo.sender_endpoint(s), kind, key) for s in active]


class TwoStageFfnEndpoint(FfnEndpoint):
    dispatch_layout, return_layout = FORWARD, EXPERT_OUT

    def __init__(self, topo: Topology, rank: int, transport: Transport, config: CommConfig = CommConfig()) -> None:
        super().__init__(topo, rank, transport, config)
        self._alone = len(topo.live_ranks(self.node)) == 1
        if self._alone:  # the relay's messages are this rank's own
            self.dispatch_layout, self.return_layout = DISPATCH, COMBINE
        self._relay_out = ThreadPoolExecutor(1, thread_name_prefix=f"relay-dispatch-{rank}")
        self._relay_back = ThreadPoolExecutor(1, thread_name_prefix=f"relay-combine-{rank}")
        self._forwarded: dict[MsgKey, Future] = {}
        self._returning: list[Future] = []

    def post_dispatch(self, key: MsgKey, senders: Collection[int] | None = None) -> None:
        if not self._alone and key not in self._forwarded:
            active = self._senders(senders, self.topo.senders_of_relay(self.rank))
            self._forwarded[key] = self._relay_out.submit(self._relay_dispatch, key, active)

    def recv_dispatch(self, key: MsgKey, senders: Collection[int] | None = None) -> ExpertBatch:
        self._check_background()
        self.post_dispatch(key, senders)
        try:
            return super().recv_dispatch(key, senders)
        except CommTimeout:
            self._raise_relay_error(key)
            raise

    def _recv_copies(self, key: MsgKey, senders: Collection[int] | None) -> list[Message]:
        if self._alone:
            active = self._senders(senders, self.topo.senders_of_relay(self.rank))
            return [self.recv(self.topo.sender_endpoint(s), DISPATCH.kind, key) for s in active]
        msgs = []
        for relay in self.topo.live_ranks(self.node):
            for _ in self._senders(senders, self.topo.senders_of_relay(relay)):
                msgs.append(self.recv(self.topo.ffn_endpoint(relay), FORWARD.kind, key))
        return msgs

    def send_combine(self, batch: ExpertBatch, outputs: torch.Tensor) -> None:
        super().send_combine(batch, outputs)
        if self._alone:
            return
        self._check_background()
        self._returning.append(self._relay_back.submit(self._relay_combine, batch.key))

    # -- relay (background threads) --------------------------------------------------------

    def _relay_dispatch(self, key: MsgKey, senders: list[int]) -> list[tuple[int, int, dict[int, torch.Tensor]]]:
        """Forwards each of these senders' tokens (this relay's that send for key) to the node's FFN
        ranks, first come first served. Returns per sender, in forwarding order: (sender, tokens,
        rows sent to each rank)."""
        waiting = {self.topo.sender_endpoint(s) for s in senders}
        done = []
        while waiting:
            msg = self.recv_any(sorted(waiting), DISPATCH.kind, key)
            waiting.discard(msg.src)
            done.append((msg.meta["sender"], len(DISPATCH.unpack(msg)["rows"]), self._forward(msg)))
        return done

    def _forward(self, msg: Message) -> dict[int, torch.Tensor]:
        f = DISPATCH.unpack(msg)
        ids = f["ids"]
        rank_of = self.on_device("ffn_rank_of", self.topo.ffn_rank_of, ids.device)
        ffn_rank = torch.where(ids >= 0, rank_of[ids.long().clamp(min=0)], -1)  # [n, K]
        sent = {}
        for rank in self.topo.live_ranks(self.node):
            rows, r_ids, r_weights = masked_rows(ffn_rank == rank, ids, f["weights"])
            out = FORWARD.pack(
                msg.key,
                self.endpoint,
                msg.meta,
                hidden=f["hidden"][rows],
                scales=f["scales"][rows],
                ids=r_ids,
                weights=r_weights,
                rows=f["rows"][rows],
            )
            self.send(self.topo.ffn_endpoint(rank), "dispatch", out, rows.numel())
            sent[rank] = rows
        return sent

    def _relay_combine(self, key: MsgKey) -> None:
        """Sums the node's expert outputs per token and returns one vector per token to each sender."""
        dtype = self.config.wire.combine_dtype
        for sender, n, sent in self._forwarded.pop(key).result(timeout=self.wait_s):
            acc = None
            for rank, rows in sent.items():
                y = EXPERT_OUT.unpack(self.recv(self.topo.ffn_endpoint(rank), EXPERT_OUT.kind, key))["out"]
                acc = torch.zeros(n, y.shape[1], device=y.device) if acc is None else acc
                acc.index_add_(0, rows.long(), y.float())
            msg = COMBINE.pack(key, self.endpoint, {"sender": sender}, out=acc.to(dtype))
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
        if drain:  # a relay job that failed while draining: its senders never got their results
            self._check_background()


def ffn_endpoint(topo: Topology, rank: int, transport: Transport, config: CommConfig = CommConfig()) -> FfnEndpoint:
    """The FFN-rank endpoint of `config.mode`."""
    cls = TwoStageFfnEndpoint if config.mode == "two-stage" else DirectFfnEndpoint
    return cls(topo, rank, transport, config)

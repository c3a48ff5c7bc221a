"""The routed experts of a deployment, reached through the dispatch/combine library.

`RemoteExpertExecutor` is the attention side of a MoE layer in colocated and AFD modes: dispatch
sends the micro-batch's tokens to the ranks holding a copy of their experts, combine waits for the
results. A colocated rank that is the only one with tokens in a step keeps its own experts' share:
combine computes it in place, as single mode does, instead of the rank sending copies to itself
and receiving them back (its expert-serving operations then have nothing to serve). When other
ranks have tokens too, its copies join theirs, so that each expert runs once per layer.
`CommExpertServer` is the expert side (FFN ranks; colocated ranks for their peers). Both name
their messages (step, layer, micro-batch); the runner advances `step` before each step.

Where the data plane lives: with a transport that carries tensors on the rank's device
(`Transport.payload_device`, the shared-memory transport's device medium), tensors stay on the
device; otherwise (ZeroMQ, host shared memory) they cross to the host at dispatch and come back
to the rank's `device` at combine and receive.

Static decode (--static-decode, and wherever CUDA graphs replay; ranks/static_decode.py): a
micro-batch's compute runs on a bucket of `bs` rows of which the first B are real. Its dispatch
routes all `bs` rows through persistent tables (device compute that a graph holds) and returns a
`Deferred`; the stage runner sends the first B rows once the stage has run, and receives their
results into the micro-batch's persistent [bs, H] buffer (rows past B zero) that combine returns.
The expert server pads what it receives into persistent buffers of a received-token bucket
(padding rows route nowhere) and sends back the real rows' results.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from afd_engine.models.experts import ExpertExecutor, Experts, ExpertServer
from comm import DispatchHandle, ExpertBatch, MsgKey
from comm.attention_side import AttentionEndpoint
from comm.ffn_side import FfnEndpoint


@dataclass(eq=False)
class Deferred:
    """A static micro-batch's dispatch: routed on the device, its message not yet sent. The stage
    runner sends the first `real` rows after the stage (`send_deferred`) and receives the results
    into the micro-batch's persistent buffer (`receive_into`), before the stage that combines them
    or inside its combine."""

    layer_id: int
    micro_batch: int
    hidden: torch.Tensor  # [bs, H]
    slots: torch.Tensor  # [bs, K] physical slots (route)
    topk_ids: torch.Tensor  # [bs, K] logical experts (the load recorder counts them)
    weights: torch.Tensor  # [bs, K]
    comm: object = None  # the dispatch handle once sent
    received: bool = False


@dataclass
class _KeptShare:
    """A dispatch whose own share stayed here: what combine computes it from."""

    handle: DispatchHandle
    experts: Experts
    hidden: torch.Tensor  # [T, H]
    local_ids: torch.Tensor  # [T, K] this rank's slot indices, -1 where another rank's
    weights: torch.Tensor  # [T, K]


class RemoteExpertExecutor(ExpertExecutor):
    """Dispatches physical expert slots: `expert_map` (eplb.expert_map.ExpertMap, swapped by a
    rebalance between steps) picks one copy of each routed expert. `own_experts` and `to_local`
    (colocated): this rank's experts per MoE layer, and its FFN endpoint's map of physical slots
    to local ones (comm.FfnEndpoint.to_local)."""

    def __init__(
        self,
        endpoint: AttentionEndpoint,
        expert_map,
        device: torch.device | str = "cpu",
        recorder=None,
        own_experts: Mapping[int, Experts] | None = None,
        to_local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.endpoint, self.expert_map, self.device = endpoint, expert_map, torch.device(device)
        self.recorder = recorder
        self.own_experts, self.to_local = own_experts, to_local
        self.step = 0
        self.expected = True  # False: the FFN side knows this rank has no tokens this step (colocated)
        self.skip_empty = False  # True: the FFN side knows every micro-batch's token count (AFD descriptors)
        self.keep_own = False  # True (colocated, per step): compute this rank's own share here (module doc)
        self.wire = torch.device("cpu")  # where dispatched tensors travel: the host, or the device (module doc)
        # static decode (ranks/static_decode.py), set per step: each micro-batch's real row count
        # (None: it runs eagerly); per micro-batch slot its persistent [max_bs, H] combine buffer
        # and its route salt (a device scalar: a graph reads it); the persistent routing tables; the
        # dispatches routed while a stage ran, for the stage runner to send
        self.real_rows: list[int | None] = []
        self.combined: list[torch.Tensor] = []
        self.salts: list[torch.Tensor] = []
        self.route_tables = None
        self.produced: list[Deferred] = []

    def route(self, layer_id: int, micro_batch: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The physical slot of each (token, choice) [T, K]: device compute, no host read."""
        salt = self.step + micro_batch + self.endpoint.sender  # which copy takes a batch's odd pairs
        return self.expert_map.to_physical(layer_id, topk_ids, salt)

    def _static(self, micro_batch: int) -> bool:
        return micro_batch < len(self.real_rows) and self.real_rows[micro_batch] is not None

    def dispatch(
        self, layer_id: int, micro_batch: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle | _KeptShare | Deferred:
        if self._static(micro_batch):  # every row routed through the persistent tables; sent later
            slots = self.route_tables.route(layer_id, topk_ids, self.salts[micro_batch])
            deferred = Deferred(layer_id, micro_batch, hidden, slots, topk_ids, topk_weights)
            self.produced.append(deferred)
            return deferred
        slots = self.route(layer_id, micro_batch, topk_ids)
        handle = self._send(layer_id, micro_batch, hidden, slots, topk_weights)
        if self.recorder is not None:  # once the tokens are on their way: off the FFN side's critical path
            self.recorder.record(layer_id, topk_ids)
        return handle

    def send_deferred(self, d: Deferred) -> None:
        """Sends a static dispatch's real rows (after the stage that routed it)."""
        real = self.real_rows[d.micro_batch]
        d.comm = self._send(d.layer_id, d.micro_batch, d.hidden[:real], d.slots[:real], d.weights[:real])
        d.received = False
        if self.recorder is not None:
            self.recorder.record(d.layer_id, d.topk_ids[:real])

    def receive_into(self, d: Deferred) -> None:
        """Waits for a static dispatch's results; puts them in its micro-batch's persistent buffer,
        the padding rows zero."""
        real, bs = self.real_rows[d.micro_batch], d.hidden.shape[0]
        out = self.combined[d.micro_batch]
        out[:real].copy_(self._receive(d.comm))
        out[real:bs].zero_()
        d.received = True

    def _send(self, layer_id, micro_batch, hidden, slots, topk_weights) -> DispatchHandle | _KeptShare:
        key = MsgKey(self.step, layer_id, micro_batch)
        expected = self.expected and not (self.skip_empty and hidden.shape[0] == 0)
        wire = self.wire
        handle = self.endpoint.dispatch(
            hidden.to(wire), slots.to(wire), topk_weights.to(wire), key, expected, self.keep_own
        )
        if self.keep_own:
            local = self.to_local(slots.to(wire)).to(hidden.device)
            handle = _KeptShare(handle, self.own_experts[layer_id], hidden, local, topk_weights)
        return handle

    def combine(self, handle: DispatchHandle | _KeptShare | Deferred) -> torch.Tensor:
        if isinstance(handle, Deferred):  # received before the stage (AFD), or here (colocated)
            if not handle.received:
                self.receive_into(handle)
            return self.combined[handle.micro_batch][: handle.hidden.shape[0]]
        return self._receive(handle)

    def _receive(self, handle: DispatchHandle | _KeptShare) -> torch.Tensor:
        wire = self.wire
        if isinstance(handle, _KeptShare):
            kept, handle = handle, handle.handle
            partial = kept.experts(kept.hidden, kept.local_ids, kept.weights).to(wire) if handle.num_tokens else None
            return self.endpoint.combine(handle, partial).to(self.device)
        return self.endpoint.combine(handle).to(self.device)


class CommExpertServer(ExpertServer):
    """`senders`, set per step: per micro-batch, the senders with tokens in it (the others send
    nothing), or None (every sender sends, empty or not). A micro-batch without senders is served
    as an empty batch of `cfg`'s shape, without a message."""

    def __init__(
        self, endpoint: FfnEndpoint, cfg, device: torch.device | str = "cpu", dtype=torch.float32, static=None
    ) -> None:
        """`static` (ranks/static_decode.StaticReceived): the persistent buffers received tokens are
        padded into (static decode); None: the experts compute on what arrived, as it arrived."""
        self.endpoint, self.device = endpoint, torch.device(device)
        empty = ExpertBatch.empty(MsgKey(0, 0, 0), cfg.hidden_size, cfg.num_experts_per_tok, dtype)
        self._empty = (empty.hidden, empty.local_ids, empty.weights)  # no elements: shared by every empty batch
        self.step = 0
        self.senders: list[list[int]] | None = None
        self.static = static
        self.graphs = None  # ranks/static_decode.ExpertGraphs over `static`, set by the rank
        self._arrived: dict[int, ExpertBatch] = {}  # micro-batch -> what arrived, while its padded copy computes

    def _senders(self, micro_batch: int) -> list[int] | None:
        return None if self.senders is None else self.senders[micro_batch]

    def post(self, layer_id: int, micro_batch: int) -> None:
        senders = self._senders(micro_batch)
        if senders != []:
            self.endpoint.post_dispatch(MsgKey(self.step, layer_id, micro_batch), senders)

    def receive(self, layer_id: int, micro_batch: int) -> ExpertBatch:
        key, senders = MsgKey(self.step, layer_id, micro_batch), self._senders(micro_batch)
        batch = ExpertBatch(key, *self._empty, []) if senders == [] else self.endpoint.recv_dispatch(key, senders)
        if batch.hidden.device != self.device:
            batch.hidden, batch.local_ids = batch.hidden.to(self.device), batch.local_ids.to(self.device)
            batch.weights = batch.weights.to(self.device)
        if self.static is None or not self.static.fits(batch.hidden.shape[0]):
            return batch
        self._arrived[micro_batch] = batch
        return ExpertBatch(key, *self.static.load(batch.hidden, batch.local_ids, batch.weights), [])

    def compute(self, layer_id: int, experts, tokens: ExpertBatch) -> torch.Tensor:
        if self.graphs is None:
            return experts(tokens.hidden, tokens.local_ids, tokens.weights)
        return self.graphs.run(layer_id, tokens.hidden, tokens.local_ids, tokens.weights)

    def send(self, tokens: ExpertBatch, outputs: torch.Tensor) -> None:
        arrived = self._arrived.pop(tokens.key.micro_batch, None)
        if arrived is not None:  # a padded batch: the real rows' results go back
            tokens, outputs = arrived, outputs[: arrived.hidden.shape[0]]
            if self.graphs is not None and self.graphs.owned:  # a graph's output: reused by its next replay
                outputs = outputs.clone()
        if self._senders(tokens.key.micro_batch) != []:  # else nobody sent, and nobody waits for results
            self.endpoint.send_combine(tokens, outputs)

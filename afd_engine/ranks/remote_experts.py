"""The routed experts of a deployment, reached through the dispatch/combine library.

`RemoteExpertExecutor` is the attention side of a MoE layer in colocated and AFD modes: dispatch
sends the micro-batch's tokens to the ranks holding a copy of their experts, combine waits for the
results. A colocated rank that is the only one with tokens in a step keeps its own experts' share:
combine computes it in place, as single mode does, instead of the rank sending copies to itself
and receiving them back (its expert-serving operations then have nothing to serve). When other
ranks have tokens too, its copies join theirs, so that each expert runs once per layer.
`CommExpertServer` is the expert side (FFN ranks; colocated ranks for their peers). Both name
their messages (step, layer, micro-batch); the runner advances `step` before each step.

The data plane here is host memory (the ZeroMQ transport sends bytes from the CPU): tensors
cross to the host at dispatch and come back to the rank's `device` at combine and receive.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from afd_engine.models.experts import ExpertExecutor, Experts, ExpertServer
from comm import DispatchHandle, ExpertBatch, MsgKey
from comm.attention_side import AttentionEndpoint
from comm.ffn_side import FfnEndpoint


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

    def dispatch(
        self, layer_id: int, micro_batch: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle | _KeptShare:
        key = MsgKey(self.step, layer_id, micro_batch)
        salt = self.step + micro_batch + self.endpoint.sender  # which copy takes a batch's odd pairs
        slots = self.expert_map.to_physical(layer_id, topk_ids, salt)
        expected = self.expected and not (self.skip_empty and hidden.shape[0] == 0)
        handle = self.endpoint.dispatch(hidden.cpu(), slots.cpu(), topk_weights.cpu(), key, expected, self.keep_own)
        if self.keep_own:
            local = self.to_local(slots.cpu()).to(hidden.device)
            handle = _KeptShare(handle, self.own_experts[layer_id], hidden, local, topk_weights)
        if self.recorder is not None:  # once the tokens are on their way: off the FFN side's critical path
            self.recorder.record(layer_id, topk_ids)
        return handle

    def combine(self, handle: DispatchHandle | _KeptShare) -> torch.Tensor:
        if isinstance(handle, _KeptShare):
            kept, handle = handle, handle.handle
            partial = kept.experts(kept.hidden, kept.local_ids, kept.weights).cpu() if handle.num_tokens else None
            return self.endpoint.combine(handle, partial).to(self.device)
        return self.endpoint.combine(handle).to(self.device)


class CommExpertServer(ExpertServer):
    """`senders`, set per step: per micro-batch, the senders with tokens in it (the others send
    nothing), or None (every sender sends, empty or not). A micro-batch without senders is served
    as an empty batch of `cfg`'s shape, without a message."""

    def __init__(self, endpoint: FfnEndpoint, cfg, device: torch.device | str = "cpu", dtype=torch.float32) -> None:
        self.endpoint, self.device = endpoint, torch.device(device)
        empty = ExpertBatch.empty(MsgKey(0, 0, 0), cfg.hidden_size, cfg.num_experts_per_tok, dtype)
        self._empty = (empty.hidden, empty.local_ids, empty.weights)  # no elements: shared by every empty batch
        self.step = 0
        self.senders: list[list[int]] | None = None

    def _senders(self, micro_batch: int) -> list[int] | None:
        return None if self.senders is None else self.senders[micro_batch]

    def post(self, layer_id: int, micro_batch: int) -> None:
        senders = self._senders(micro_batch)
        if senders != []:
            self.endpoint.post_dispatch(MsgKey(self.step, layer_id, micro_batch), senders)

    def receive(self, layer_id: int, micro_batch: int) -> ExpertBatch:
        key, senders = MsgKey(self.step, layer_id, micro_batch), self._senders(micro_batch)
        batch = ExpertBatch(key, *self._empty, []) if senders == [] else self.endpoint.recv_dispatch(key, senders)
        if self.device.type != "cpu":
            batch.hidden, batch.local_ids = batch.hidden.to(self.device), batch.local_ids.to(self.device)
            batch.weights = batch.weights.to(self.device)
        return batch

    def send(self, tokens: ExpertBatch, outputs: torch.Tensor) -> None:
        if self._senders(tokens.key.micro_batch) != []:  # else nobody sent, and nobody waits for results
            self.endpoint.send_combine(tokens, outputs)

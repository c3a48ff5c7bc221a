"""Experts from a live copy: an expert rank that must load an expert another live rank holds gets its
weights from that rank over the data plane instead of reading the checkpoint.

Which channel: FFN ranks of one node already exchange tokens (two-stage dispatch forwards them
between the node's ranks), and a replacement of a lost rank is linked to the survivors of its
node when it is admitted; ranks of other nodes are never linked to one another. So a copy comes
from a live rank of the receiver's node, over the transport they share (shared memory on one
machine, or ZeroMQ), and where no rank of its node holds the expert, from the checkpoint.

Who sends what is decided by every rank alike from the placement served now (`current`) and the
one being staged (`new`): for each rank, layer and expert it must load, the live ranks of its node
that hold the expert (in `current`; a rank dead in it, a replacement, holds nothing) are the
sources, and one is picked by (expert + layer) mod their count, which spreads the copies over
them. The transfers run in one global order (layer, expert, receiver): each rank takes its own in
that order, the receiver asking ("expert_want") and the source answering ("expert_copy", the
slot's weight tensors), so that at most one copy is in flight per rank and no rank waits on
another that waits on it (the first transfer not done has both its ranks at it). Messages are
keyed (placement version, layer, expert); a staging given up leaves its messages below the next
version, dropped unread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from afd_engine.eplb.expert_map import ExpertMap
from comm.messages import CommError, CommTimeout, Message, MsgKey
from comm.transport.base import Transport

WANT, COPY = "expert_want", "expert_copy"
POLL_S = 0.1  # how often a wait checks whether its staging was given up


class StagingCancelled(Exception):
    """The staging was given up (a recovery voided its placement)."""


@dataclass(frozen=True)
class Transfer:
    """Expert `expert` of MoE layer `layer` copied from rank `src` to rank `dst`."""

    layer: int
    expert: int
    src: int
    dst: int


def held(current: ExpertMap, rank: int) -> dict[int, set[int]]:
    """The experts `rank` holds per layer while `current` is served: its slots' (none where it is
    dead in it: a replacement starts with nothing to give)."""
    if rank in current.dead:
        return {layer: set() for layer in current.placements}
    return {layer: set(slots) for layer, slots in current.rank_slots(rank).items()}


def plan_transfers(current: ExpertMap, new: ExpertMap, ranks_per_node: int) -> list[Transfer]:
    """Every copy between live ranks of one node that staging `new` takes (module doc), in the
    order every rank runs them."""
    ranks = range(new.layout.num_ranks)
    holdings = {r: held(current, r) for r in ranks}
    live = [r for r in ranks if r not in current.dead and r not in new.dead]
    out = []
    for layer in sorted(new.placements):
        for dst in (r for r in ranks if r not in new.dead):
            node = dst // ranks_per_node
            sources = [q for q in live if q != dst and q // ranks_per_node == node]
            for expert in sorted(set(new.rank_slots(dst)[layer]) - holdings[dst][layer]):
                having = [q for q in sources if expert in holdings[q][layer]]
                if having:
                    out.append(Transfer(layer, expert, having[(expert + layer) % len(having)], dst))
    return sorted(out, key=lambda t: (t.layer, t.expert, t.dst))


class PeerCopies:
    """An expert rank's side of the copies between the ranks of its node (module doc)."""

    def __init__(
        self, transport: Transport, rank: int, endpoint_of: Callable[[int], int], ranks_per_node: int, timeout: float
    ) -> None:
        """`endpoint_of(rank)`: an expert rank's transport endpoint. `timeout`: how long one copy
        may take to come (its source may first finish a step, or stage at low priority)."""
        self.transport, self.rank, self.endpoint_of = transport, rank, endpoint_of
        self.ranks_per_node, self.timeout = ranks_per_node, timeout

    def exchange(
        self, current: ExpertMap, new: ExpertMap, serving: dict, cancelled: threading.Event
    ) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Runs this rank's transfers of staging `new`: sends the slots peers want from `serving`
        (layer -> RoutedExperts, the modules it computes with), receives the ones it wants.
        Returns (layer, expert) -> the received weight tensors. StagingCancelled once `cancelled`
        is set; CommError when a peer sends nothing within the timeout."""
        version, me = new.version, self.endpoint_of(self.rank)
        self.transport.drop_stale({WANT: version, COPY: version})  # what a staging given up left
        received = {}
        for t in plan_transfers(current, new, self.ranks_per_node):
            key = MsgKey(version, t.layer, t.expert)
            if t.dst == self.rank:
                src = self.endpoint_of(t.src)
                self.transport.send(src, Message(WANT, key, me))
                received[t.layer, t.expert] = self._wait(src, COPY, key, cancelled).tensors
            elif t.src == self.rank:
                dst = self.endpoint_of(t.dst)
                self._wait(dst, WANT, key, cancelled)
                module = serving[t.layer]
                # cloned: the serving weights change at this rank's switch, which may come before
                # the peer has read what was queued for it
                tensors = [w.clone() for w in module.slot_tensors(module.slot_expert.index(t.expert))]
                self.transport.send(dst, Message(COPY, key, me, tensors))
        return received

    def _wait(self, src: int, kind: str, key: MsgKey, cancelled: threading.Event) -> Message:
        deadline = time.monotonic() + self.timeout
        while True:
            if cancelled.is_set():
                raise StagingCancelled
            try:
                return self.transport.recv(src, kind, key, POLL_S)
            except CommTimeout:
                if time.monotonic() > deadline:
                    raise CommError(
                        f"expert rank {self.rank} waited {self.timeout:g} s for {kind} {key} from endpoint {src}"
                    ) from None

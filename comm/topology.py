"""Who talks to whom: senders (attention ranks), FFN nodes of FFN rank, and the expert map.

Endpoint ids: in AFD, senders are endpoints 0..S-1 and FFN rank r is endpoint S + r; in a
colocated deployment every rank is both, so sender i and FFN rank i are endpoint i.

    senders (A ranks)        FFN node 0              FFN node 1
    a0 a1 a2 a3     --->   [f0 f1]  (R = 2)     [f2 f3]
    stage 1: a_i -> local rank (i mod R) of each FFN node its tokens need
    stage 2: inside the node, to the rank that owns the expert
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from comm.messages import CommError

INTER_NODE, INTRA_NODE, LOCAL = "inter_node", "intra_node", "local"


class TopologyError(CommError):
    pass


@dataclass(frozen=True)
class Topology:
    num_senders: int
    num_nodes: int
    ranks_per_node: int
    num_experts: int
    # logical expert -> physical expert slot; slot p lives on FFN rank p // experts_per_rank (or per rank_sizes)
    expert_map: tuple[int, ...] | None = None
    colocated: bool = False
    # FFN ranks lost and masked out (AFD fault tolerance): they relay nothing and hold no slot in use
    dead: frozenset[int] = frozenset()
    # slots per FFN rank, consecutive in rank order, where a recovery grew some ranks' storage
    # (None: num_experts / num_ffn_ranks each)
    rank_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, why: str) -> None:
            if not ok:
                raise TopologyError(f"invalid topology {self.describe()}: {why}")

        need(self.num_senders >= 1, "needs at least one sender (attention rank)")
        need(self.num_nodes >= 1 and self.ranks_per_node >= 1, "needs at least one FFN node with one rank")
        need(self.num_experts >= 1, "needs at least one expert")
        if self.rank_sizes is not None:
            need(
                len(self.rank_sizes) == self.num_ffn_ranks and sum(self.rank_sizes) == self.num_experts,
                f"rank_sizes {list(self.rank_sizes)} must give each of the {self.num_ffn_ranks} ranks its slots, "
                f"{self.num_experts} in all",
            )
        need(
            self.rank_sizes is not None or self.num_experts % self.num_ffn_ranks == 0,
            f"{self.num_experts} experts do not divide evenly over {self.num_ffn_ranks} ranks "
            f"({self.num_nodes} nodes x {self.ranks_per_node}); pick a rank count that divides {self.num_experts}",
        )
        need(
            not self.colocated or self.num_senders == self.num_ffn_ranks,
            f"a colocated deployment has one sender per rank: {self.num_senders} senders != {self.num_ffn_ranks} ranks",
        )
        if self.expert_map is not None:
            need(
                sorted(self.expert_map) == list(range(self.num_experts)),
                "expert_map must be a permutation of 0..num_experts-1 (one physical slot per logical expert)",
            )

    def describe(self) -> str:
        kind = "colocated" if self.colocated else "afd"
        return (
            f"({kind}: {self.num_senders} senders, {self.num_nodes} nodes x {self.ranks_per_node} ranks, "
            f"{self.num_experts} experts)"
        )

    @property
    def num_ffn_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        """Slots per FFN rank while every rank holds as many (rank_sizes None)."""
        return self.num_experts // self.num_ffn_ranks

    @cached_property
    def _first_slot(self) -> torch.Tensor:
        """[num_ffn_ranks] int64: each rank's first physical slot."""
        sizes = self.rank_sizes or (self.experts_per_rank,) * self.num_ffn_ranks
        return torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)

    @cached_property
    def physical_slot(self) -> torch.Tensor:
        """[E] int64: logical expert -> physical slot."""
        ids = range(self.num_experts) if self.expert_map is None else self.expert_map
        return torch.tensor(list(ids), dtype=torch.int64)

    @cached_property
    def ffn_rank_of(self) -> torch.Tensor:
        """[E] int64: logical expert -> FFN rank."""
        if self.rank_sizes is None:
            return self.physical_slot // self.experts_per_rank
        return torch.searchsorted(self._first_slot, self.physical_slot, right=True) - 1

    @cached_property
    def node_of_expert(self) -> torch.Tensor:
        """[E] int64: logical expert -> FFN node."""
        return self.ffn_rank_of // self.ranks_per_node

    def local_index(self, rank: int) -> torch.Tensor:
        """[E] int64: logical expert -> index among `rank`'s experts, or -1 if another rank owns it."""
        return torch.where(self.ffn_rank_of == rank, self.physical_slot - self._first_slot[rank], -1)

    def experts_of(self, rank: int) -> list[int]:
        """Logical experts owned by `rank`, in local-index order."""
        local = self.local_index(rank)
        return sorted((int(e) for e in (local >= 0).nonzero().flatten()), key=lambda e: int(local[e]))

    def node_of_rank(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def live_ranks(self, node: int) -> list[int]:
        """The node's FFN ranks that are not dead, in order."""
        return [r for r in self.node_ranks(node) if r not in self.dead]

    @cached_property
    def _relays(self) -> dict[tuple[int, int], int]:
        """(sender, node) -> its relay: the node's live rank (sender mod live ranks), which is the
        local rank sender mod R while no rank of the node is dead."""
        out = {}
        for node in range(self.num_nodes):
            live = self.live_ranks(node)
            for sender in range(self.num_senders) if live else ():
                out[(sender, node)] = live[sender % len(live)]
        return out

    def relay_rank(self, sender: int, node: int) -> int:
        """Stage-1 target of `sender` on `node`: the node's local rank (sender mod R), among its
        live ranks when some are dead."""
        relay = self._relays.get((sender, node))
        if relay is None:
            raise TopologyError(f"FFN node {node} has no live rank left to relay sender {sender}'s tokens")
        return relay

    def senders_of_relay(self, rank: int) -> list[int]:
        node = self.node_of_rank(rank)
        return [i for i in range(self.num_senders) if self._relays.get((i, node)) == rank]

    def sender_endpoint(self, sender: int) -> int:
        return sender

    def ffn_endpoint(self, rank: int) -> int:
        return rank if self.colocated else self.num_senders + rank

    @property
    def num_endpoints(self) -> int:
        return self.num_senders if self.colocated else self.num_senders + self.num_ffn_ranks

    def node_of_endpoint(self, endpoint: int) -> str:
        """A machine label: attention machines are apart from FFN nodes unless colocated."""
        if self.colocated:
            return f"n{self.node_of_rank(endpoint)}"
        if endpoint < self.num_senders:
            return f"a{endpoint}"  # each attention rank counts as its own machine: A -> F always crosses
        return f"n{self.node_of_rank(endpoint - self.num_senders)}"

    def link(self, src: int, dst: int) -> str:
        if src == dst:
            return LOCAL
        return INTRA_NODE if self.node_of_endpoint(src) == self.node_of_endpoint(dst) else INTER_NODE

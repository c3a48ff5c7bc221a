"""Expert placement for load balancing: which physical expert slots hold which logical experts.

Given each logical expert's load (tokens routed to it over a window), the number of physical
slots (every logical expert once, plus `num_redundant` copies of hot ones), and the ranks that
hold them (`num_nodes` x `ranks_per_node`, each rank the same number of slots), choose the copies
and their ranks so that the most loaded rank carries as little as possible. A token routed to an
expert with k copies is served by one of them, so each copy carries load / k.

The placement is hierarchical, after DeepSeek's published EPLB idea (our own code):

1. groups to nodes: with group-limited routing a token only reaches experts of a few groups, so
   every group stays on one node and the groups are packed onto nodes by load (equal counts per
   node). Two-stage dispatch then still crosses to a node once per token.
2. copies within a node: the node's slots beyond one per expert go, one at a time, to the expert
   whose per-copy load is highest.
3. copies to ranks: the node's copies are packed onto its ranks by load, heaviest first, each to
   the least loaded rank that still has a free slot.

Without groups (or when the groups do not divide over the nodes) the whole model is one group
spread over all ranks. Everything is deterministic: ties break by index.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """One MoE layer's placement. Rank r holds `sizes[r]` consecutive physical slots: the same
    number each (`slots_per_rank`, slot s on rank s // slots_per_rank) unless a recovery grew some
    ranks' storage (eplb/elastic.py); `sizes` is None while every rank holds `slots_per_rank`."""

    slot_expert: list[int]  # [num_slots]: the logical expert of each physical slot
    slots_per_rank: int  # what each rank starts with
    sizes: tuple[int, ...] | None = None  # slots per rank, where they differ from slots_per_rank

    def __post_init__(self) -> None:
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            if sum(sizes) != len(self.slot_expert):
                raise ValueError(f"ranks of {list(sizes)} slots hold {sum(sizes)} slots, not {len(self.slot_expert)}")
            uniform = all(n == self.slots_per_rank for n in sizes)
            object.__setattr__(self, "sizes", None if uniform else sizes)  # one spelling per placement

    @property
    def num_slots(self) -> int:
        return len(self.slot_expert)

    @property
    def rank_sizes(self) -> tuple[int, ...]:
        """How many slots each rank holds."""
        if self.sizes is not None:
            return self.sizes
        return (self.slots_per_rank,) * (self.num_slots // self.slots_per_rank)

    def rank_range(self, rank: int) -> range:
        """Rank `rank`'s physical slots."""
        sizes = self.rank_sizes
        start = sum(sizes[:rank])
        return range(start, start + sizes[rank])

    def slot_ranks(self) -> list[int]:
        """The rank of each physical slot."""
        return [r for r, n in enumerate(self.rank_sizes) for _ in range(n)]

    def replicas(self, num_experts: int) -> list[list[int]]:
        """Per logical expert, its physical slots in ascending order."""
        out: list[list[int]] = [[] for _ in range(num_experts)]
        for slot, expert in enumerate(self.slot_expert):
            out[expert].append(slot)
        return out

    def rank_loads(self, load: torch.Tensor, dead: frozenset[int] = frozenset()) -> torch.Tensor:
        """Load per rank when every expert's load is split evenly over its copies (those on the
        ranks not `dead`: lost ranks carry none)."""
        num_experts, slots = load.numel(), torch.tensor(self.slot_expert)
        owner = torch.tensor(self.slot_ranks())
        live = torch.tensor([r not in dead for r in self.slot_ranks()])
        copies = torch.bincount(slots[live], minlength=num_experts).to(torch.float64).clamp(min=1)
        per_slot = torch.where(live, load.to(torch.float64)[slots] / copies[slots], 0.0)
        out = torch.zeros(len(self.rank_sizes), dtype=torch.float64)
        return out.index_add_(0, owner, per_slot)


class RecoveryImpossible(ValueError):
    """The surviving expert ranks cannot hold every expert."""


def without_ranks(p: Placement, dead: set[int], num_experts: int) -> Placement:
    """`p` with ranks `dead` lost: every expert left without a live copy takes over a live slot of
    an expert that still has several (give_up_copies); RecoveryImpossible when the live slots hold
    no spare copy left to give up."""
    out, lost = give_up_copies(p, dead, num_experts)
    if lost:
        live = sum(n for r, n in enumerate(p.rank_sizes) if r not in dead)
        raise RecoveryImpossible(
            f"{len(lost)} experts lost their only copy and the {live} live slots hold no spare copy to "
            f"give up (every one of the {num_experts} experts needs a slot)"
        )
    return out


def give_up_copies(p: Placement, dead: set[int], num_experts: int) -> tuple[Placement, list[int]]:
    """`p` with ranks `dead` lost, as far as spare copies go: every expert left without a live copy
    takes over a live slot of an expert that still has several (the one with the most, ties to the
    highest slot); the dead ranks' slots keep their entries (nothing routes to them). Returns that
    placement and the experts still without a live slot once no spare copy is left, in order."""
    slot_expert = list(p.slot_expert)
    owner = p.slot_ranks()
    copies: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for s in range(p.num_slots):
        if owner[s] not in dead:
            copies[slot_expert[s]].append(s)
    lost = [e for e in range(num_experts) if not copies[e]]
    for i, expert in enumerate(lost):
        donor = max(range(num_experts), key=lambda e: (len(copies[e]), max(copies[e], default=-1)))
        if len(copies[donor]) < 2:
            return Placement(slot_expert, p.slots_per_rank, p.sizes), lost[i:]
        slot = copies[donor].pop()
        slot_expert[slot] = expert
        copies[expert].append(slot)
    return Placement(slot_expert, p.slots_per_rank, p.sizes), []


def imbalance(rank_loads: torch.Tensor) -> float:
    """Max over mean of the ranks' loads (1.0 is perfect balance)."""
    mean = float(rank_loads.mean())
    return float(rank_loads.max()) / mean if mean > 0 else 1.0


def place(
    load: torch.Tensor, num_redundant: int, num_nodes: int, ranks_per_node: int, num_groups: int = 1
) -> Placement:
    """The placement of one layer's `load` [num_experts] (see the module docstring)."""
    num_experts = load.numel()
    num_ranks = num_nodes * ranks_per_node
    num_slots = num_experts + num_redundant
    if num_slots % num_ranks:
        raise ValueError(
            f"{num_experts} experts + {num_redundant} redundant copies do not divide over {num_ranks} ranks"
        )
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not form {num_groups} equal groups")
    load = load.to(torch.float64)
    if num_groups == 1 or num_groups % num_nodes:  # one node holding everything: the same steps over all ranks
        num_groups, num_nodes, ranks_per_node = 1, 1, num_ranks
    group_size = num_experts // num_groups
    group_loads = [float(load[g * group_size : (g + 1) * group_size].sum()) for g in range(num_groups)]
    node_groups = _pack(group_loads, num_nodes, num_groups // num_nodes)
    slots_per_node, slots_per_rank = num_slots // num_nodes, num_slots // num_ranks
    slot_expert: list[int] = []
    for groups in node_groups:
        experts = [g * group_size + i for g in sorted(groups) for i in range(group_size)]
        copies = _replicate([float(load[e]) for e in experts], slots_per_node)
        pieces = [(float(load[e]) / copies[i], e) for i, e in enumerate(experts) for _ in range(copies[i])]
        ranks = _pack([p[0] for p in pieces], ranks_per_node, slots_per_rank, [p[1] for p in pieces])
        for members in ranks:
            slot_expert += sorted(pieces[i][1] for i in members)
    return Placement(slot_expert, slots_per_rank)


def _replicate(loads: list[float], num_slots: int) -> list[int]:
    """Copies per item: one each, then each spare slot to the item with the highest load per copy."""
    copies = [1] * len(loads)
    heap = [(-w, i) for i, w in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(loads)):
        _, i = heapq.heappop(heap)
        copies[i] += 1
        heapq.heappush(heap, (-loads[i] / copies[i], i))
    return copies


def _pack(weights: list[float], num_bins: int, per_bin: int, keys: list[int] | None = None) -> list[list[int]]:
    """Items into `num_bins` bins of exactly `per_bin` items: heaviest first, each into the lightest
    bin with room (ties: the lower bin), avoiding bins that already hold an item of the same key
    (two copies of an expert on one rank would waste a slot) while others have room. Returns
    each bin's item indices."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    held: list[set] = [set() for _ in range(num_bins)]
    totals = [0.0] * num_bins
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        key = keys[i] if keys is not None else i
        room = [b for b in range(num_bins) if len(bins[b]) < per_bin]
        b = min([b for b in room if key not in held[b]] or room, key=lambda b: (totals[b], b))
        bins[b].append(i)
        held[b].add(key)
        totals[b] += weights[i]
    return bins

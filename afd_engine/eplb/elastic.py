"""Elastic expert storage: a recovery may give surviving expert ranks more slots than they had.

When expert ranks are lost, every expert needs a live slot again. Spare copies give theirs up first
(placement.give_up_copies: no memory grows); the experts still without one go to new slots
appended to the survivors' storage, up to each survivor's cap (`caps`: the most slots it may hold,
from --ffn-expert-memory-mb). Only when the caps cannot hold every expert is the recovery refused.

Dispatch addresses slots through one table for every MoE layer (comm/topology.py), so a rank holds
the same number of slots in every layer. Every layer needs the same growth, too: once the spare
copies are given up, each live slot of a layer holds another expert, so E experts on S live slots
leave E - S of them without one, whatever the layer's placement. No expert gains a copy this way
(each lost one gets a single slot), so routing tables sized for the starting copies (static
decode's) still hold every placement.

Which survivors grow: one slot at a time, to the one holding the fewest (ties: the lowest rank) that
is under its cap, so that load and memory stay as even as they can. In each layer, the lost
experts take the new slots in turn over the growing ranks (a rank's first new slot, then the next
rank's, ...), so that each grown rank serves a share of them. Everything is deterministic: every
attention rank computes the same placement from the same inputs.
"""

from __future__ import annotations

from afd_engine.eplb.placement import Placement, RecoveryImpossible

CAP_FLAG = "--ffn-expert-memory-mb"


def grown_sizes(sizes: tuple[int, ...], dead: set[int], caps: dict[int, int], extra: int, layer: int) -> tuple:
    """`sizes` (slots per rank) with `extra` slots more over the live ranks, each within
    caps[rank] (a rank without a cap keeps its size). RecoveryImpossible, naming the cap flag,
    when the caps leave fewer than `extra` free slots (`layer`: the MoE layer that needs them)."""
    out = list(sizes)
    live = [r for r in range(len(sizes)) if r not in dead]
    room = sum(max(caps.get(r, sizes[r]) - sizes[r], 0) for r in live)
    if room < extra:
        raise RecoveryImpossible(
            f"MoE layer {layer} without expert ranks {sorted(dead)}: {extra} experts lost their only copy and no "
            f"spare copy is left; the survivors may grow by {room} slots within their {CAP_FLAG} caps "
            f"({', '.join(f'rank {r}: {caps.get(r, sizes[r])}' for r in live)} slots at most)"
        )
    for _ in range(extra):
        rank = min((r for r in live if out[r] < caps.get(r, sizes[r])), key=lambda r: (out[r], r))
        out[rank] += 1
    return tuple(out)


def grow(p: Placement, sizes: tuple[int, ...], lost: list[int]) -> Placement:
    """`p` with each rank's storage grown to sizes[rank] slots (appended after its own), the new
    slots taking the `lost` experts in turn over the growing ranks (module doc)."""
    old = p.rank_sizes
    turns = [(r, i) for i in range(max(n - o for n, o in zip(sizes, old))) for r in range(len(sizes))]
    new_slots = [(r, i) for r, i in turns if i < sizes[r] - old[r]]
    if len(new_slots) != len(lost):  # every layer needs as many: see the module doc
        raise ValueError(f"{len(new_slots)} new slots for {len(lost)} lost experts")
    per_rank = [[p.slot_expert[s] for s in p.rank_range(r)] + [-1] * (sizes[r] - old[r]) for r in range(len(old))]
    for (r, i), expert in zip(new_slots, lost):
        per_rank[r][old[r] + i] = expert
    return Placement([e for slots in per_rank for e in slots], p.slots_per_rank, sizes)

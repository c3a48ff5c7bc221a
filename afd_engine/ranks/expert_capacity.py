"""How many expert slots an FFN rank may hold (--ffn-expert-memory-mb): the cap of elastic storage.

A recovery may give a surviving FFN rank more slots than it started with (eplb/elastic.py), each
slot one expert's weights in every MoE layer, up to a cap on the bytes its routed experts take:

    --ffn-expert-memory-mb M   M MiB
    on a GPU, by default       what the device has free once the rank is loaded (experts, graphs),
                               less a headroom of a tenth of the device (at least HEADROOM_MIN_GIB):
                               a grown storage is staged beside the serving one before it replaces it
    on the CPU, by default     twice the rank's starting expert bytes

A cap below what the rank holds at start only means that it never grows. The rank tells the
attention ranks its cap in slots with its heartbeats; they plan recoveries within it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("afd.ffn")
HEADROOM_FRACTION = 0.1  # of the device's memory, kept free on a GPU by default
HEADROOM_MIN_GIB = 2.0


def slot_bytes(experts: dict) -> int:
    """The bytes one slot takes over every MoE layer (layer id -> RoutedExperts)."""
    return sum(sum(t.numel() * t.element_size() for t in m.state_dict().values()) // m.count for m in experts.values())


def cap_bytes(memory_mb: float | None, start_bytes: int, device: torch.device) -> int:
    """The cap on a rank's expert bytes (module doc); `start_bytes`: what it holds at start."""
    if memory_mb is not None:
        return int(memory_mb * 2**20)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - max(HEADROOM_MIN_GIB * 2**30, HEADROOM_FRACTION * total))
    return 2 * start_bytes


def expert_capacity(memory_mb: float | None, experts: dict, device: torch.device, rank: int) -> int:
    """The most slots per MoE layer the rank serving `experts` may hold (never fewer than it
    holds now)."""
    per_slot, start = slot_bytes(experts), next(iter(experts.values())).count if experts else 0
    if not per_slot:
        return start
    cap = cap_bytes(memory_mb, per_slot * start, torch.device(device))
    slots = max(start, cap // per_slot)
    log.info(
        "FFN rank %d: %d expert slots of %.2f MiB each; it may grow to %d (--ffn-expert-memory-mb%s)",
        rank,
        start,
        per_slot / 2**20,
        slots,
        "" if memory_mb is None else f" {memory_mb:g}",
    )
    return int(slots)

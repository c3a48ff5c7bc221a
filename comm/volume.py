"""Analytic traffic of dispatch/combine: exact counts for a given routing, expectations for random ones.

These are the numbers the counters must reproduce; benchmarks print them beside the measured ones.
"""

from __future__ import annotations

from math import comb

import torch

from comm.topology import INTER_NODE, INTRA_NODE, Topology
from comm.wire import WireFormat

SLOT_BYTES = 4  # int32 token row, sent with every dispatched copy
EXPERT_ID_BYTES = 4  # int32
WEIGHT_BYTES = 4  # fp32


def dispatch_copy_bytes(mode: str, hidden: int, topk: int, wire: WireFormat, dtype: torch.dtype) -> int:
    """Bytes of one dispatched token copy: activations, plus routing metadata (two-stage: the
    node's share of the top-k ids and weights; direct: the one expert id) and the token row."""
    meta = topk * (EXPERT_ID_BYTES + WEIGHT_BYTES) if mode == "two-stage" else EXPERT_ID_BYTES
    return wire.hidden_bytes(hidden, dtype) + meta + SLOT_BYTES


def copies(topo: Topology, topk_ids: list[torch.Tensor], mode: str) -> dict[str, int]:
    """Token copies per link class in dispatch (combine returns the same count on the same links),
    for per-sender routings topk_ids [T_i, K]."""
    counts = {INTER_NODE: 0, INTRA_NODE: 0}
    for sender, ids in enumerate(topk_ids):
        src = topo.sender_endpoint(sender)
        if mode == "direct":
            for ffn in topo.ffn_rank_of[ids].flatten().tolist():
                _count(counts, topo.link(src, topo.ffn_endpoint(ffn)))
            continue
        for row in ids:
            for node in set(topo.node_of_expert[row].tolist()):
                relay = topo.relay_rank(sender, node)
                _count(counts, topo.link(src, topo.ffn_endpoint(relay)))
                for ffn in set(topo.ffn_rank_of[row].tolist()) & set(topo.node_ranks(node)):
                    _count(counts, topo.link(topo.ffn_endpoint(relay), topo.ffn_endpoint(ffn)))
    return counts


def _count(counts: dict[str, int], link: str) -> None:
    if link in counts:
        counts[link] += 1


def expected_nodes_hit(num_experts: int, num_nodes: int, topk: int) -> float:
    """E[distinct FFN nodes] for top-k experts drawn uniformly without replacement (experts even over nodes)."""
    per_node = num_experts // num_nodes
    return num_nodes * (1 - comb(num_experts - per_node, topk) / comb(num_experts, topk))

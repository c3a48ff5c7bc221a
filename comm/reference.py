"""Pure-torch references of dispatch and combine, computed from a global view of every sender.

They define what the distributed implementation must produce, for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (logical expert, x [n, H]) -> [n, H]


def reference_combine(
    hidden: list[torch.Tensor], topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor], expert_fn: ExpertFn
) -> list[torch.Tensor]:
    """Per sender [T, H]: out[t] = sum_k topk_weights[t, k] * expert_fn(topk_ids[t, k], hidden[t])."""
    results = []
    for x, ids, w in zip(hidden, topk_ids, topk_weights):
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                out[t] += w[t, k] * expert_fn(int(ids[t, k]), x[t : t + 1].float())[0]
        results.append(out.to(x.dtype))
    return results


def run_experts(batch, experts: list[int], expert_fn: ExpertFn) -> torch.Tensor:
    """An FFN rank's compute for tests: [M, H], per row the weighted sum over its local experts."""
    out = torch.zeros(batch.hidden.shape, dtype=torch.float32)
    for local, e in enumerate(experts):
        rows, w = batch.expert_rows(local)
        out.index_add_(0, rows, w[:, None] * expert_fn(e, batch.hidden[rows].float()))
    return out

"""Expert load statistics: tokens routed to each logical expert of each MoE layer, over a sliding
window of steps, counted where the gate runs (the attention ranks).

The window is kept as a ring of `buckets` partial sums, each covering window / buckets steps, so
memory stays [buckets, layers, experts] however long the window: `window()` sums the last
`window_steps` steps to within one bucket.
"""

from __future__ import annotations

import torch


class ExpertLoadRecorder:
    def __init__(self, moe_layers, num_experts: int, window_steps: int = 1000, buckets: int = 8) -> None:
        self.layers = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.window_steps = max(1, window_steps)
        self.buckets = max(1, min(buckets, self.window_steps))
        self.bucket_steps = -(-self.window_steps // self.buckets)
        # ring[head] is the bucket being filled; the others are the last buckets - 1 full ones
        self._ring = torch.zeros(self.buckets, len(self.layers), num_experts, dtype=torch.int64)
        self._head, self._in_bucket = 0, 0
        # this step's counts: a tensor that never moves, so a CUDA graph's replays add into it
        self._step = torch.zeros(len(self.layers), num_experts, dtype=torch.int64)
        self.steps = 0  # steps recorded since start
        self.total_tokens = 0  # (token, expert) pairs in buckets already closed
        # [T] int64 weight of each row while a padded CUDA graph step is captured (1 real, 0 padding)
        self.rows_weight: torch.Tensor | None = None

    def to(self, device: torch.device) -> None:
        """Moves the counts to `device` (the gate's; done on the first record otherwise)."""
        self._ring, self._step = self._ring.to(device), self._step.to(device)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [T, K] logical expert ids routed by `layer`'s gate (a layer not watched, the MTP
        draft module's, is not counted)."""
        if topk_ids.numel() and layer in self.layers:
            if self._step.device != topk_ids.device:
                self.to(topk_ids.device)
            flat = topk_ids.flatten()  # index_add, not bincount: no device sync on a GPU
            if self.rows_weight is None:
                counts = torch.ones_like(flat)
            else:
                counts = self.rows_weight[:, None].expand(topk_ids.shape).reshape(-1)
            self._step[self.layers[layer]].index_add_(0, flat, counts)

    def end_step(self) -> None:
        self._ring[self._head] += self._step
        self._step.zero_()
        self.steps += 1
        self._in_bucket += 1
        if self._in_bucket >= self.bucket_steps:
            self.total_tokens += int(self._ring[self._head].sum())
            self._head = (self._head + 1) % self.buckets
            self._ring[self._head].zero_()
            self._in_bucket = 0

    def window(self) -> torch.Tensor:
        """[layers, experts] int64 on the host: tokens routed in the window (the bucket being
        filled included)."""
        return (self._ring.sum(dim=0) + self._step).cpu()

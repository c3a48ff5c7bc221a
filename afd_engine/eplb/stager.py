"""The expert side of a rebalance: load a new placement's experts in the background, then switch.

An expert rank (an FFN rank, or a colocated rank for its own share) stages the slots the new
placement gives it on a background thread, from the checkpoint, while it keeps serving the old
placement; `on_ready` fires when they are loaded. At the step boundary every rank agreed on,
`switch` hands the staged weights to the serving modules (a pointer swap, no copy and no load on
the step's critical path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from afd_engine.default_model import resolve_model_path
from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.models import Kernels, load_expert_shard

log = logging.getLogger("afd.eplb")


def load_shard(args, cfg, device, slots: dict[int, list[int]]) -> torch.nn.Module:
    """The experts of `slots` from the checkpoint of `args` (EngineArgs), as an ExpertShard."""
    kernels = Kernels.named(moe=args.moe_backend)
    return load_expert_shard(cfg, resolve_model_path(args.model_path), args.torch_dtype, slots, kernels, device)


class ExpertStager:
    def __init__(self, load_shard: Callable[[dict[int, list[int]]], torch.nn.Module], rank: int) -> None:
        """`load_shard(slots)` loads an ExpertShard holding `slots` (per layer, expert per slot)."""
        self.load_shard, self.rank = load_shard, rank
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"eplb-stage-{rank}")
        self._staged: tuple[int, Future] | None = None  # (version, future of the shard)

    def stage(self, new_map: ExpertMap, on_ready: Callable[[int], None] | None = None) -> None:
        """Starts loading this rank's slots of `new_map`; `on_ready(version)` runs on the loading
        thread once they are loaded (not if loading fails: `switch` raises that)."""
        slots, version = new_map.rank_slots(self.rank), new_map.version

        def load() -> torch.nn.Module:
            with torch.inference_mode():
                shard = self.load_shard(slots)
            log.info("expert rank %d staged placement %d", self.rank, version)
            if on_ready is not None:
                on_ready(version)
            return shard

        self._staged = (version, self._pool.submit(load))

    def ready(self, version: int) -> bool:
        return self._staged is not None and self._staged[0] == version and self._staged[1].done()

    def switch(self, version: int, serving: dict, timeout: float) -> None:
        """Serves placement `version` from now on: its staged experts replace `serving`'s
        (layer -> RoutedExperts) in place. Waits for the load only if it is still running."""
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"expert rank {self.rank} was told to switch to placement {version}, never staged")
        staged = self._staged[1].result(timeout=timeout).routed_experts()
        for layer, module in serving.items():
            module.adopt(staged[layer])
        self._staged = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

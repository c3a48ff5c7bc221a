"""The expert side of a rebalance: load a new placement's experts in the background, then switch.

An expert rank (an FFN rank, or a colocated rank for its own share) stages the slots the new
placement gives it on a background thread, from the checkpoint, while it keeps serving the old
placement; `on_ready` fires when they are loaded. At the step boundary every rank agreed on,
`switch` copies the staged weights into the serving modules' storage (one device copy per weight
tensor, no load on the step's critical path): the serving weights never move, so CUDA graphs
captured over them stay valid. Experts the rank already holds are copied, not re-read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from afd_engine.default_model import resolve_model_path
from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.models import Kernels, load_expert_shard

log = logging.getLogger("afd.eplb")


def load_shard(args, cfg, device, slots: dict[int, list[int]]) -> torch.nn.Module:
    """The experts of `slots` from the checkpoint of `args` (EngineArgs), as an ExpertShard held at
    --ffn-weight-dtype (as the full model of single mode holds them)."""
    kernels = Kernels.named(moe=args.moe_backend)
    path = resolve_model_path(args.model_path)
    return load_expert_shard(cfg, path, args.torch_dtype, slots, kernels, device, args.ffn_weight_dtype)


def _background_priority() -> None:
    """Staging yields the CPU to serving: the lowest scheduling priority for this thread (Linux
    gives threads their own nice value; elsewhere this does nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class ExpertStager:
    def __init__(self, load_shard: Callable[[dict[int, list[int]]], torch.nn.Module], rank: int, serving: dict) -> None:
        """`load_shard(slots)` loads an ExpertShard holding `slots` (per layer, expert per slot);
        `serving` (layer -> RoutedExperts) are the modules this rank computes with."""
        self.load_shard, self.rank, self.serving = load_shard, rank, serving
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"eplb-stage-{rank}", initializer=_background_priority)
        self._staged: tuple[int, Future] | None = None  # (version, future of {layer: new module})
        self.experts_read = 0  # (layer, expert) pairs the last staging read from the checkpoint

    def stage(self, new_map: ExpertMap, on_ready: Callable[[int], None] | None = None) -> None:
        """Starts staging this rank's slots of `new_map`: experts it holds already are copied,
        the others read from the checkpoint, layers whose slots stay the same are left alone.
        `on_ready(version)` runs on the staging thread once done (not if it fails: `switch`
        raises that)."""
        slots, version = new_map.rank_slots(self.rank), new_map.version
        changed = {layer: s for layer, s in slots.items() if s != self.serving[layer].slot_expert}

        def load() -> dict:
            start = time.perf_counter()
            with torch.inference_mode():
                missing = {layer: sorted(set(s) - set(self.serving[layer].slot_expert)) for layer, s in changed.items()}
                missing = {layer: e for layer, e in missing.items() if e}
                fresh = self.load_shard(missing).routed_experts() if missing else {}
                self.experts_read = sum(map(len, missing.values()))
                staged = {
                    layer: self.serving[layer].gather(
                        s, [self.serving[layer]] + ([fresh[layer]] if layer in fresh else [])
                    )
                    for layer, s in changed.items()
                }
            log.info(
                "expert rank %d staged placement %d in %.1f ms: %d layers change, %d experts read",
                self.rank,
                version,
                1000 * (time.perf_counter() - start),
                len(changed),
                sum(map(len, missing.values())),
            )
            if on_ready is not None:
                on_ready(version)
            return staged

        self._staged = (version, self._pool.submit(load))

    def cancel(self) -> None:
        """Forgets a staged placement that will never be switched to (a lost rank voided it)."""
        self._staged = None

    def ready(self, version: int) -> bool:
        return self._staged is not None and self._staged[0] == version and self._staged[1].done()

    def switch(self, version: int, timeout: float) -> None:
        """Serves placement `version` from now on: its staged experts are copied into the serving
        modules' weights (RoutedExperts.adopt; their addresses stay). Waits for the staging only if
        it is still running."""
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"expert rank {self.rank} was told to switch to placement {version}, never staged")
        for layer, module in self._staged[1].result(timeout=timeout).items():
            self.serving[layer].adopt(module)
        self._staged = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

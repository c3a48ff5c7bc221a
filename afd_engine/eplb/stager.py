"""The expert side of a rebalance or a recovery: load a new placement's experts in the background,
then switch.

An expert rank (an FFN rank, or a colocated rank for its own share) stages the slots the new
placement gives it on a background thread while it keeps serving the old placement; `on_ready`
fires when they are loaded. Experts it holds already are copied; experts a live rank of its node
holds come from that rank (`peers`, eplb/peer_copy.py); only the others are read from the
checkpoint. At the step boundary every rank agreed on, `switch` copies the staged weights into the
serving modules' storage (one device copy per weight tensor, no load on the step's critical path):
the serving weights never move, so CUDA graphs captured over them stay valid. A placement that
changes how many slots the rank holds (a recovery grew it, eplb/elastic.py; an admission shrinks it
back) cannot be copied into the old storage: the serving modules take the staged storage instead
(`switch` returns True, and the rank takes the new addresses: graphs, static-decode guard).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import torch

from afd_engine.default_model import resolve_model_path
from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.peer_copy import PeerCopies, held
from afd_engine.models import Kernels, load_expert_shard

log = logging.getLogger("afd.eplb")


def load_shard(args, cfg, device, slots: dict[int, list[int]], read: bool = True) -> torch.nn.Module:
    """The experts of `slots` from the checkpoint of `args` (EngineArgs), as an ExpertShard held at
    --ffn-weight-dtype (as the full model of single mode holds them); without `read`, its storage
    only (a replacement rank, which gets its experts when admitted)."""
    kernels = Kernels.named(moe=args.moe_backend)
    path = resolve_model_path(args.model_path)
    return load_expert_shard(cfg, path, args.torch_dtype, slots, kernels, device, args.ffn_weight_dtype, read)


def _background_priority() -> None:
    """Staging yields the CPU to serving: the lowest scheduling priority for this thread (Linux
    gives threads their own nice value; elsewhere this does nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class ExpertStager:
    def __init__(
        self,
        load_shard: Callable[[dict[int, list[int]]], torch.nn.Module],
        rank: int,
        serving: dict,
        current: ExpertMap | None = None,
        peers: PeerCopies | None = None,
        empty: bool = False,
    ) -> None:
        """`load_shard(slots)` loads an ExpertShard holding `slots` (per layer, expert per slot);
        `serving` (layer -> RoutedExperts) are the modules this rank computes with. `current`: the
        placement served (every rank's, so that `peers` knows who holds what; switches move it
        on). `empty`: the serving modules hold no weights yet (a replacement rank)."""
        self.load_shard, self.rank, self.serving = load_shard, rank, serving
        self.current, self.peers, self.empty = current, peers, empty
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"eplb-stage-{rank}", initializer=_background_priority)
        # (placement, future of {layer: new module}, its cancel flag)
        self._staged: tuple[ExpertMap, Future, threading.Event] | None = None
        self.loaded = {"peer": 0, "checkpoint": 0}  # (layer, expert) pairs the last staging loaded, by source

    @property
    def experts_read(self) -> int:
        """(layer, expert) pairs the last staging read from the checkpoint."""
        return self.loaded["checkpoint"]

    def stage(self, new_map: ExpertMap, on_ready: Callable[[int], None] | None = None) -> None:
        """Starts staging this rank's slots of `new_map` (module doc); layers whose slots stay the
        same are left alone. `on_ready(version)` runs on the staging thread once done (not if it
        fails: `switch` raises that)."""
        cancelled = threading.Event()
        self._staged = (new_map, self._pool.submit(self._load, new_map, on_ready, cancelled), cancelled)

    def _load(self, new_map: ExpertMap, on_ready, cancelled: threading.Event) -> dict:
        start, version = time.perf_counter(), new_map.version
        slots = new_map.rank_slots(self.rank)
        mine = {layer: [] if self.empty else self.serving[layer].slot_expert for layer in slots}
        changed = {layer: s for layer, s in slots.items() if s != mine[layer] or self.empty}
        with torch.inference_mode():
            received = {}
            if self.peers is not None and self.current is not None:
                if any(held(self.current, self.rank)[layer] != set(mine[layer]) for layer in slots):
                    raise RuntimeError(
                        f"expert rank {self.rank} does not hold its slots of placement {self.current.version}"
                    )
                received = self.peers.exchange(self.current, new_map, self.serving, cancelled)
            missing = {layer: sorted(set(s) - set(mine[layer])) for layer, s in changed.items()}
            missing = {layer: [e for e in es if (layer, e) not in received] for layer, es in missing.items()}
            missing = {layer: es for layer, es in missing.items() if es}
            fresh = self.load_shard(missing).routed_experts() if missing else {}
            staged = {}
            for layer, s in changed.items():
                sources = [] if self.empty else [self.serving[layer]]
                sources += [fresh[layer]] if layer in fresh else []
                sources += [_received(self.serving[layer], layer, received)]
                staged[layer] = self.serving[layer].gather(s, sources)
        self.loaded = {"peer": len(received), "checkpoint": sum(map(len, missing.values()))}
        log.info(
            "expert rank %d staged placement %d in %.1f ms: %d layers change, %d experts copied from peers, "
            "%d read from the checkpoint",
            self.rank,
            version,
            1000 * (time.perf_counter() - start),
            len(changed),
            self.loaded["peer"],
            self.loaded["checkpoint"],
        )
        if on_ready is not None:
            on_ready(version)
        return staged

    def cancel(self) -> None:
        """Forgets a staged placement that will never be switched to (a lost rank voided it); a
        staging still running gives up its waits for peers."""
        if self._staged is not None:
            self._staged[2].set()
        self._staged = None

    def ready(self, version: int) -> bool:
        return self._staged is not None and self._staged[0].version == version and self._staged[1].done()

    def switch(self, version: int, timeout: float) -> bool:
        """Serves placement `version` from now on: its staged experts are copied into the serving
        modules' weights (RoutedExperts.adopt; their addresses stay), or where the slot count
        changes, the modules take the staged storage (RoutedExperts.rebind). Waits for the staging
        only if it is still running. True when some weights moved."""
        if self._staged is None or self._staged[0].version != version:
            raise RuntimeError(f"expert rank {self.rank} was told to switch to placement {version}, never staged")
        moved = False
        for layer, module in self._staged[1].result(timeout=timeout).items():
            if module.count == self.serving[layer].count:
                self.serving[layer].adopt(module)
            else:
                self.serving[layer].rebind(module)
                moved = True
        self.current, self.empty, self._staged = self._staged[0], False, None
        return moved

    def close(self) -> None:
        if self._staged is not None:
            self._staged[2].set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _received(like, layer: int, received: dict) -> SimpleNamespace:
    """The experts of `layer` copied from peers, as a source for RoutedExperts.gather: their
    slots and stacked weights, named as `like`'s."""
    experts = [e for (lay, e) in received if lay == layer]
    source = SimpleNamespace(slot_expert=experts)
    for i, name in enumerate(like.weight_names()):
        tensors = [received[layer, e][i].to(getattr(like, name).device) for e in experts]
        setattr(source, name, torch.stack(tensors) if tensors else None)
    return source

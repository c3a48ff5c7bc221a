"""The attention side of live rebalancing (`--enable-eplb`), one per attention rank.

Every attention rank runs the same decisions from the same data, so no rank leads:

1. plan: in the agreement round at which `--eplb-rebalance-num-iterations` steps have passed since
   the last plan, every rank attaches its window of expert loads to its sync message; each sums
   them and computes the same new placement on a background thread (at DeepSeek-V3's size, 58
   layers of 256 experts, that takes ~150 ms of Python: too long for one step). In the first
   round in which every rank reports it computed, it becomes the pending placement v + 1.
2. stage: the expert ranks load their slots of the pending placement in the background, starting
   after the next step (FFN ranks learn it from that step's descriptor and answer `eplb_ready`
   when loaded, saying how many experts came from a live peer and how many from the checkpoint;
   a colocated rank stages its own share) while steps go on with placement v.
3. switch: in the first round in which every attention rank reports that all its expert ranks are
   ready, they agree to switch; the next step dispatches with placement v + 1 and its descriptor
   tells the FFN ranks to serve v + 1 from that step on.

No request waits for a reload, and none is dropped: the switch happens between two steps.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from afd_engine.eplb.expert_map import ExpertMap
from afd_engine.eplb.recorder import ExpertLoadRecorder
from afd_engine.eplb.stager import ExpertStager
from comm.messages import CommError, CommTimeout, MsgKey
from comm.protocol import EPLB_LAYER
from comm.transport.base import Transport

log = logging.getLogger("afd.eplb")


class Rebalancer:
    def __init__(
        self,
        initial: ExpertMap,
        recorder: ExpertLoadRecorder,
        every: int | None,
        transport: Transport,
        ffn_endpoints: list[int],
        stager: ExpertStager | None = None,
    ) -> None:
        """`every`: steps between plans (None: never rebalance). AFD: `ffn_endpoints` answer when
        staged. Colocated: `stager` stages this rank's own share."""
        self.map, self.recorder, self.every = initial, recorder, every
        self.transport, self.ffn, self.stager = transport, ffn_endpoints, stager
        self.pending: ExpertMap | None = None
        self._announce = False  # the pending placement still has to reach the FFN ranks
        self._switch = False  # the next step switches to the pending placement
        self._stage = False  # this rank's own share of the pending placement is still to be staged
        self._acked: set[int] = set()
        # (layer, expert) pairs the expert ranks loaded for rebalances and admissions, by source
        # (eplb/peer_copy.py): FFN ranks say it with `eplb_ready`, a colocated rank counts its own
        self.loaded = {"peer": 0, "checkpoint": 0}
        self.last_plan_step = 0
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="eplb-plan") if every is not None else None
        self._planning: Future | None = None  # the placements being computed

    # -- the agreement round ------------------------------------------------------------------

    def sync_out(self, step_id: int) -> tuple[dict, list[torch.Tensor]]:
        """This rank's part of the round's sync message: meta and tensors."""
        idle = self.pending is None and self._planning is None
        plan = self.every is not None and idle and step_id - self.last_plan_step >= self.every and not self.map.dead
        planned = self._planning is not None and self._planning.done()
        meta = {"eplb_plan": plan, "eplb_planned": planned, "eplb_ready": self._ready()}
        return meta, [self.recorder.window()] if plan else []

    def sync_in(self, step_id: int, metas: list[dict], loads: list[torch.Tensor]) -> None:
        """Every rank's meta (this one's included) and the loads attached to them."""
        plans = {m["eplb_plan"] for m in metas}
        if len(plans) > 1:
            raise CommError(f"step {step_id}: attention ranks disagree on whether to rebalance now")
        if plans == {True}:
            self.last_plan_step = step_id
            self._planning = self._planner.submit(self._placements, torch.stack(loads).sum(dim=0))
        elif self._planning is not None and all(m["eplb_planned"] for m in metas):
            self._install(step_id, self._planning.result())
        elif self.pending is not None and all(m["eplb_ready"] for m in metas):
            self._switch = True

    def _placements(self, load: torch.Tensor) -> ExpertMap | None:
        """The placement balancing `load` [MoE layers, experts] (on the planning thread); None when
        it is the current one."""
        layout, layers = self.map.layout, list(self.map.placements)
        placements = {layer: layout.place(load[i]) for i, layer in enumerate(layers)}
        return None if placements == self.map.placements else ExpertMap(layout, placements, self.map.version + 1)

    def _install(self, step_id: int, new: ExpertMap | None) -> None:
        """Every rank computed the placement: it becomes the pending one (if it changes anything)."""
        self._planning = None
        if new is None:
            log.info("step %d: the expert placement stays as it is", step_id)
            return
        self.pending = new
        self._announce = bool(self.ffn)
        self._stage = self.stager is not None  # after the next step, not competing with it
        self._acked.clear()
        log.info("step %d: planned expert placement %d", step_id, self.pending.version)

    def _ready(self) -> bool:
        """Whether every expert rank this rank knows of has staged the pending placement."""
        if self.pending is None:
            return False
        if self.stager is not None:
            return self.stager.ready(self.pending.version)
        key = MsgKey(self.pending.version, EPLB_LAYER, 0)
        for ep in self.ffn:
            if ep not in self._acked:
                with contextlib.suppress(CommTimeout):  # not staged yet
                    ready = self.transport.recv(ep, "eplb_ready", key, 0.0)
                    self._acked.add(ep)
                    for source, n in ready.meta.get("loaded", {}).items():
                        self.loaded[source] = self.loaded.get(source, 0) + n
        return len(self._acked) == len(self.ffn)

    def recovered(self, new: ExpertMap, ffn_endpoints: list[int]) -> None:
        """After a recovery: `new` (without the lost ranks) serves from the next step on, and a
        rebalance under way is void (its placement had them). No plan is made while ranks are
        missing (`sync_out`)."""
        self.map, self.ffn = new, ffn_endpoints
        self.pending, self._announce, self._switch, self._stage = None, False, False, False
        self._acked.clear()
        self._planning = None  # a placement being computed is dropped when it comes

    def admit(self, new: ExpertMap, ffn_endpoints: list[int]) -> None:
        """A placement that uses replacement ranks as well becomes the pending one: the live ranks
        learn it from the next descriptor, the replacements from their admission, and every one
        of `ffn_endpoints` answers `eplb_ready` once staged; the switch follows as for a rebalance."""
        self.pending, self.ffn = new, ffn_endpoints
        self._announce, self._switch, self._stage = True, False, False
        self._acked.clear()

    @property
    def idle(self) -> bool:
        """No rebalance under way: none planned, computing or staging."""
        return self.pending is None and self._planning is None

    @property
    def next_version(self) -> int:
        """A placement version no placement has had, pending or planned."""
        return max(self.map.version, self.pending.version if self.pending is not None else 0) + 1

    # -- the step ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)
        if self.stager is not None:
            self.stager.close()

    def end_step(self) -> None:
        """After a step: a colocated rank starts staging its share of a new placement."""
        if self._stage:
            self.stager.stage(self.pending)
            self._stage = False

    @property
    def switching(self) -> bool:
        """Whether the next step switches placements."""
        return self._switch

    @property
    def has_news(self) -> bool:
        """Whether the next step's descriptor tells the expert ranks something (a placement to
        stage, or the switch to it): an idle deployment then runs a step without tokens for it,
        so that an admission or a rebalance does not wait for traffic."""
        return self._switch or self._announce

    def begin_step(self, timeout: float) -> dict:
        """Called before a step runs: switches if agreed (a colocated rank also switches the
        experts it serves), and returns what the step descriptor carries."""
        meta = {}
        if self._switch:
            new, self.pending, self._switch = self.pending, None, False
            if self.stager is not None:
                self.stager.switch(new.version, timeout)
                for source, n in self.stager.loaded.items():
                    self.loaded[source] += n
            self.map = new
            meta["eplb_switch"] = new.version
            log.info("switched to expert placement %d", new.version)
        if self._announce:
            meta["eplb_plan"] = self.pending.describe()
            self._announce = False
        return meta

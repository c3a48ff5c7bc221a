"""The API server's side of the control plane: submit requests, stream their updates, abort.

A Router picks each request's attention rank. One background task reads the engine's messages
and routes each update to its request's queue; another checks the engine's health every second
and, when it has gone, wakes every waiting request with the news (a wait per token with its own
timeout cost the front end about 5 us a token).
A request whose consumer goes away (client disconnected, task cancelled) is aborted in the
engine, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from afd_engine.control import messages as msgs
from afd_engine.control.loop import HEARTBEAT_S, ControlAddrs, FrontEndSockets
from afd_engine.control.router import Router
from afd_engine.eplb.report import merge_reports
from afd_engine.errors import AFDError, InvalidRequestError
from afd_engine.runtime.request import TokenUpdate
from afd_engine.sampling_params import SamplingParams

DEAD_AFTER_S = 15.0  # no message for this long: a live engine process is considered hung (death is seen at once)
_ENGINE_LOST = object()  # what the health check puts into the queue of every waiting request


class EngineUnavailable(AFDError):
    """The engine process died or stopped answering."""


class RequestFailed(EngineUnavailable):
    """The engine ended this request with an error (a disaggregated request whose peer failed)."""


class EngineClient:
    def __init__(
        self,
        addrs: ControlAddrs,
        router: Router,
        alive: Callable[[], bool] = lambda: True,
        route_by_room: bool = False,
    ) -> None:
        """`router` spans the deployment's attention ranks. With `route_by_room` (a prefill
        instance) a disaggregated request goes to rank room mod ranks, where decode ranks look
        for it."""
        self.route_by_room = route_by_room
        ranks = range(router.num_ranks)
        self.router = router
        self.ctx = zmq.asyncio.Context()
        self.sockets = FrontEndSockets.bind(self.ctx, addrs, router.num_ranks)
        self.push, self.pub, self.pull = self.sockets.push, self.sockets.pub, self.sockets.pull
        self.alive = alive
        self.rank_stats = {r: msgs.EngineStats() for r in ranks}
        self.last_heard = dict.fromkeys(ranks, time.monotonic())  # from start() on: when ranks are up
        self.failures: dict[int, str] = {}  # rank -> why it stopped (its last words)
        self._queues: dict[str, asyncio.Queue] = {}
        self._load_reports: dict[str, tuple[dict[int, dict], asyncio.Future]] = {}
        self._load_ids = 0
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.last_heard = dict.fromkeys(self.last_heard, time.monotonic())
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._check_health())]

    @property
    def healthy(self) -> bool:
        return self.down_reason() is None

    def down_reason(self) -> str | None:
        """Why the engine is not running (None: it is): a rank process exited, or an attention
        rank has sent nothing (not even a heartbeat) for DEAD_AFTER_S."""
        if not self.alive():
            why = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
            return "a rank process exited" + (f" ({why})" if why else "")
        now = time.monotonic()
        silent = max(self.last_heard, key=lambda r: now - self.last_heard[r], default=None)
        if silent is not None and now - self.last_heard[silent] >= DEAD_AFTER_S:
            return f"attention rank {silent} has sent nothing for {now - self.last_heard[silent]:.0f} s"
        return None

    @property
    def stats(self) -> msgs.EngineStats:
        """The deployment's counters: the sum over attention ranks."""
        return msgs.EngineStats.total(self.rank_stats.values())

    async def _read(self) -> None:
        while True:
            msg = msgs.decode_output(await self.pull.recv())
            if isinstance(msg, msgs.StepOutput):
                self.last_heard[msg.rank] = time.monotonic()
                self.rank_stats[msg.rank] = msg.stats
                for update in msg.updates:
                    self._deliver(update.request_id, update)
            elif isinstance(msg, msgs.Rejected):
                self._deliver(msg.rid, msg)
            elif isinstance(msg, msgs.RankFailed):
                self.failures[msg.rank] = msg.message
            elif isinstance(msg, msgs.ExpertLoadReport) and msg.token in self._load_reports:
                reports, done = self._load_reports[msg.token]
                reports[msg.rank] = msg.report
                if len(reports) == self.router.num_ranks and not done.done():
                    done.set_result(merge_reports([reports[r] for r in sorted(reports)]))

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S * 2)
            if self._queues and not self.healthy:
                for queue in self._queues.values():
                    queue.put_nowait(_ENGINE_LOST)

    async def expert_load(self, timeout: float = 10.0) -> dict:
        """The deployment's expert load report: every attention rank answers, the loads are summed."""
        if (reason := self.down_reason()) is not None:
            raise EngineUnavailable(f"the engine is not running: {reason}")
        self._load_ids += 1
        token = f"load-{self._load_ids}"
        done = asyncio.get_running_loop().create_future()
        self._load_reports[token] = ({}, done)
        try:
            self._send_nowait(msgs.DumpExpertLoad(token))
            return await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"not every attention rank reported its expert load within {timeout:g} s") from None
        finally:
            del self._load_reports[token]

    def _deliver(self, rid: str, item) -> None:
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(item)

    async def generate(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, disaggregation: dict | None = None
    ) -> AsyncIterator[TokenUpdate]:
        """Yields the request's updates until it finishes; raises InvalidRequestError if the engine
        refused it and EngineUnavailable if the engine went away."""
        if (reason := self.down_reason()) is not None:
            raise EngineUnavailable(f"the engine is not running: {reason}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            if self.route_by_room and disaggregation is not None:
                rank = self.router.route_to(rid, disaggregation["room"] % self.router.num_ranks)
            else:
                rank = self.router.route(rid, prompt_ids)
            await self._submit(rank, msgs.AddRequest(rid, prompt_ids, params, disaggregation))
            while not finished:
                item = await queue.get()
                if item is _ENGINE_LOST:
                    raise EngineUnavailable("the engine process stopped answering")
                if isinstance(item, msgs.Rejected):
                    finished = True
                    raise InvalidRequestError(item.message, item.param)
                finished = item.finish_reason is not None
                if item.finish_reason == "error":
                    raise RequestFailed(item.error or "the engine failed this request")
                yield item
        finally:
            del self._queues[rid]
            self.router.finished(rid)  # finished, rejected or aborted: no longer the rank's load
            if not finished:  # the consumer left early: free the engine's resources
                self._send_nowait(msgs.AbortRequest(rid))

    async def _submit(self, rank: int, msg: msgs.AddRequest) -> None:
        """Sends at once to a connected rank; waits while the rank has not connected yet (a dead
        rank never will). The wait polls, which costs several times the send: a burst of requests
        once spent a fifth of the front end's time polling sockets that were ready."""
        data, sock = msgs.encode(msg), self.push[rank]
        while True:
            try:
                await sock.send(data, zmq.NOBLOCK)
                break
            except zmq.Again:  # no rank connected yet: nothing queued, wait for one
                if not await sock.poll(HEARTBEAT_S * 2000, zmq.POLLOUT) and not self.healthy:
                    raise EngineUnavailable("the engine process stopped answering") from None
        self.sockets.wake_ranks()

    def _send_nowait(self, msg) -> None:
        """Broadcast control messages; never blocks (ranks may be gone)."""
        try:
            self.pub.send(msgs.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    async def shutdown(self) -> None:
        self._send_nowait(msgs.Shutdown())
        for task in self._tasks:
            task.cancel()
        self.sockets.close()

"""The front end's side of the control plane: the one client of the attention ranks.

Both front ends drive this class: the HTTP server from its own event loop, and the offline API of
a multi-rank deployment (`offline_deployment.DistributedEngine`) from a private loop through
`BlockingClient`.
So routing, submission, hang detection and the reasons a rank gave for failing are written once.

A LoadBalancer picks each request's attention rank. One background task reads the ranks' messages and
routes each update to its request's queue; another checks health every second and, when the
deployment has gone (a rank process exited, or an attention rank sent nothing for `dead_after_s`),
wakes every waiting request with the news (a wait per token with its own timeout cost the front end
about 5 us a token). A request whose consumer goes away (client disconnected, task cancelled) is
aborted in the engine, which frees its KV pages. With `lost_ranks` (fault tolerance), a lost
attention rank's requests resume on the others (control/failover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from afd_engine.control import messages as msgs
from afd_engine.control.failover import Failover, without_lost_rank
from afd_engine.control.load_balance import LoadBalancer
from afd_engine.control.loop import HEARTBEAT_S, ControlAddrs, FrontEndSockets
from afd_engine.eplb.report import merge_reports
from afd_engine.errors import AFDError, InvalidRequestError
from afd_engine.runtime.request import TokenUpdate
from afd_engine.sampling_params import SamplingParams

FAILOVER_POLL_S = 0.2  # fault tolerance: how often the front end looks for lost attention ranks
DEAD_AFTER_S = 15.0  # no message for this long: a live engine process is considered hung (death is seen at once)
_ENGINE_LOST = object()  # what the health check puts into the queue of every waiting request
T = TypeVar("T")
log = logging.getLogger("afd.failover")


class EngineUnavailable(AFDError):
    """The engine process died or stopped answering."""


class RequestFailed(EngineUnavailable):
    """The engine ended this request with an error (a disaggregated request whose peer failed);
    `update` is its last update (tokens produced before the failure, the error)."""

    def __init__(self, message: str, update: TokenUpdate | None = None) -> None:
        super().__init__(message)
        self.update = update


class RequestStream:
    """One submitted request's updates, in order, until it finishes (`async for`).

    Raises InvalidRequestError if the engine refused the request, RequestFailed if the engine
    ended it with an error and EngineUnavailable if the deployment went away. `close()` aborts the
    request in the engine unless it finished."""

    def __init__(self, client: ControlClient, rid: str, queue: asyncio.Queue) -> None:
        self.client, self.rid, self._queue = client, rid, queue
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenUpdate:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _ENGINE_LOST:
            reason = self.client.down_reason() or "no message for too long"
            raise EngineUnavailable(f"the engine process stopped answering: {reason}")
        if isinstance(item, msgs.Rejected):
            self.finished = True
            raise InvalidRequestError(item.message, item.param)
        self.finished = item.finish_reason is not None
        if item.finish_reason == "error":
            raise RequestFailed(item.error or "the engine failed this request", item)
        return item

    def close(self) -> None:
        """Idempotent; the request is no longer the rank's load, and is aborted if unfinished."""
        if self._closed:
            return
        self._closed = True
        self.client._queues.pop(self.rid, None)
        self.client.router.finished(self.rid)
        if self.client.failover is not None:
            self.client.failover.forget(self.rid)
        if not self.finished:  # the consumer left early: free the engine's resources
            self.client._send_nowait(msgs.AbortRequest(self.rid))


class ControlClient:
    def __init__(
        self,
        addrs: ControlAddrs,
        router: LoadBalancer,
        alive: Callable[[], bool] = lambda: True,
        route_by_room: bool = False,
        dead_after_s: float | None = None,
        lost_ranks: Callable[[], set[int]] | None = None,
        replace: Callable[[int], dict] | None = None,
        record: str | None = None,
    ) -> None:
        """`router` spans the deployment's attention ranks; `alive()` says whether every rank
        process the deployment needs still runs. With `route_by_room` (a prefill instance) a
        disaggregated request goes to rank room mod ranks, where decode ranks look for it. An
        attention rank silent for `dead_after_s` (default DEAD_AFTER_S) counts as hung.
        `lost_ranks()` (fault tolerance): the attention ranks whose process exited, whose requests
        resume on the others; `replace(rank)` starts a replacement of one and returns its process
        (AdmitRank's fields), which the others then admit. `record`: a file that gets one JSON line
        per request handed to a rank (`--record-steps`: PATH.frontend.jsonl), the monotonic time
        `t` it left, its `rank` and `prompt_tokens`: when the front end delivered it, on the clock
        of the ranks' step records."""
        self.route_by_room = route_by_room
        self.record = open(record, "w", buffering=1) if record else None
        ranks = range(router.num_ranks)
        self.router = router
        self.dead_after_s = DEAD_AFTER_S if dead_after_s is None else dead_after_s
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
        self.failover = Failover(lost_ranks, router.num_ranks) if lost_ranks is not None else None
        self.replace = replace

    def start(self) -> None:
        """Called on the running loop once the ranks are up."""
        self.last_heard = dict.fromkeys(self.last_heard, time.monotonic())
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._check_health())]
        if self.failover is not None:
            self._tasks.append(loop.create_task(self._watch_ranks()))

    @property
    def healthy(self) -> bool:
        return self.down_reason() is None

    def down_reason(self) -> str | None:
        """Why the engine is not running (None: it is): a rank process exited, or an attention
        rank has sent nothing (not even a heartbeat) for `dead_after_s`."""
        if not self.alive():
            why = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
            return "a rank process exited" + (f" ({why})" if why else "")
        now = time.monotonic()
        silent = max(self.last_heard, key=lambda r: now - self.last_heard[r], default=None)
        if silent is not None and now - self.last_heard[silent] >= self.dead_after_s:
            return f"attention rank {silent} has sent nothing for {now - self.last_heard[silent]:.0f} s"
        return None

    def _check_up(self) -> None:
        if (reason := self.down_reason()) is not None:
            raise EngineUnavailable(f"the engine is not running: {reason}")

    @property
    def attention_ranks_alive(self) -> int:
        return len(self.failover.live) if self.failover is not None else self.router.num_ranks

    @property
    def resumed(self) -> int:
        """Requests of lost attention ranks resumed on the others, since start."""
        return self.failover.resumed if self.failover is not None else 0

    @property
    def stats(self) -> msgs.EngineStats:
        """The deployment's counters: the sum over attention ranks."""
        return msgs.EngineStats.total(self.rank_stats.values())

    async def _read(self) -> None:
        while True:
            self._absorb(msgs.decode_output(await self.pull.recv()))

    def _absorb(self, msg) -> None:
        if isinstance(msg, msgs.StepOutput):
            if self.failover is not None and msg.rank in self.failover.lost:
                if msg.rank not in self.failover.rejoining:
                    return  # sent before it died, read late: its requests resume elsewhere
                self._rejoined(msg.rank)  # its replacement's first report: admitted
            self.last_heard[msg.rank] = time.monotonic()
            self.rank_stats[msg.rank] = msg.stats
            for update in msg.updates:
                if self.failover is None or self.failover.accepts(msg.rank, update):
                    self._deliver(update.request_id, update)
        elif isinstance(msg, msgs.Rejected):
            self._deliver(msg.rid, msg)
        elif isinstance(msg, msgs.RankFailed):
            self.failures[msg.rank] = msg.message
        elif isinstance(msg, msgs.ExpertLoadReport) and msg.token in self._load_reports:
            reports, done = self._load_reports[msg.token]
            reports[msg.rank] = msg.report
            if len(reports) == len(self.last_heard) and not done.done():
                done.set_result(merge_reports([reports[r] for r in sorted(reports)]))

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S * 2)
            if self._queues and not self.healthy:
                for queue in self._queues.values():
                    queue.put_nowait(_ENGINE_LOST)

    async def _watch_ranks(self) -> None:
        """Fault tolerance: every FAILOVER_POLL_S, the attention ranks lost since the last look;
        their requests resume on the others."""
        while True:
            await asyncio.sleep(FAILOVER_POLL_S)
            lost = self.failover.newly_lost()
            if not lost or not self.failover.live:
                continue  # (with no rank left the deployment is down: the health check says so)
            for rank in lost:
                self.last_heard.pop(rank, None)
                self.rank_stats[rank] = without_lost_rank(self.rank_stats[rank])
            moves = self.failover.moves(lost)
            log.warning(
                "attention rank(s) %s lost: %d request(s) resume on attention rank(s) %s",
                lost,
                len(moves),
                self.failover.live,
            )
            if self.replace is not None:
                for rank in lost:
                    self._tasks.append(asyncio.get_running_loop().create_task(self._replace(rank)))
            for rid, req in moves:
                self.router.finished(rid)
                rank = self._live_rank(rid, req.prompt_ids)
                again = self.failover.resubmission(rid, req, rank)
                if isinstance(again, TokenUpdate):
                    self._deliver(rid, again)
                    continue
                try:
                    await self._submit(rank, again)
                except EngineUnavailable as exc:
                    self._deliver(rid, TokenUpdate(rid, [], None, "error", str(exc)))

    async def _replace(self, rank: int) -> None:
        """Starts a replacement of lost attention rank `rank` (off the loop: it loads the model),
        and tells the others to admit it; it takes requests from its first report on."""
        try:
            process = await asyncio.get_running_loop().run_in_executor(None, self.replace, rank)
        except AFDError as exc:
            log.error("attention rank %d is not replaced: %s", rank, exc)
            return
        self.failover.rejoining.add(rank)
        self._send_nowait(msgs.AdmitRank(rank, **process))
        log.warning("attention rank %d: replacement %d is up; the others admit it", rank, process["incarnation"])

    def _rejoined(self, rank: int) -> None:
        self.failover.lost.discard(rank)
        self.failover.rejoining.discard(rank)
        self.rank_stats[rank] = msgs.EngineStats()
        log.warning("attention rank %d serves again (a replacement)", rank)

    def _live_rank(self, rid: str, prompt_ids: list[int]) -> int:
        """The router's choice, or the least loaded live rank where it chose a lost one."""
        rank = self.router.route(rid, prompt_ids)
        if self.failover is not None and rank in self.failover.lost:
            live = self.failover.live
            rank = self.router.route_to(rid, min(live, key=self.router.load.__getitem__))
        return rank

    async def expert_load(self, timeout: float = 10.0) -> dict:
        """The deployment's expert load report: every attention rank answers, the loads are summed."""
        self._check_up()
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

    async def open(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, disaggregation: dict | None = None
    ) -> RequestStream:
        """Routes and submits one request; its updates come from the returned stream. Raises
        EngineUnavailable (and submits nothing) if the deployment is down."""
        self._check_up()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        stream = RequestStream(self, rid, queue)
        try:
            if self.route_by_room and disaggregation is not None:
                rank = self.router.route_to(rid, disaggregation["room"] % self.router.num_ranks)
            else:
                rank = self._live_rank(rid, prompt_ids)
            if self.failover is not None:
                params = self.failover.params_of(params)
                self.failover.track(rid, prompt_ids, params, disaggregation, rank)
            await self._submit(rank, msgs.AddRequest(rid, prompt_ids, params, disaggregation))
            if self.record is not None:
                handed = {"t": time.monotonic(), "rank": rank, "prompt_tokens": len(prompt_ids)}
                self.record.write(json.dumps(handed) + "\n")
        except BaseException:
            stream.finished = True  # never reached a rank: nothing to abort
            stream.close()
            raise
        return stream

    async def generate(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, disaggregation: dict | None = None
    ) -> AsyncIterator[TokenUpdate]:
        """Yields the request's updates until it finishes (see RequestStream for the errors)."""
        stream = await self.open(rid, prompt_ids, params, disaggregation)
        try:
            async for update in stream:
                yield update
        finally:
            stream.close()

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
                if await sock.poll(HEARTBEAT_S * 2000, zmq.POLLOUT):
                    continue
                if not self.healthy:
                    reason = self.down_reason()
                    raise EngineUnavailable(f"the engine process stopped answering: {reason}") from None
                if self.failover is not None and rank in self.failover.lost:
                    return  # routed to a rank lost meanwhile: the failover resubmits it to another
        self.sockets.wake_ranks()

    def _send_nowait(self, msg) -> None:
        """Broadcast control messages; never blocks (ranks may be gone) and never fails (after
        shutdown the socket is closed: a stream closed then has nothing left to abort)."""
        if self.pub.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            sent = self.pub.send(msgs.encode(msg), zmq.NOBLOCK)  # a future on an asyncio socket
            if isinstance(sent, asyncio.Future):  # its error, if any, is read here: nobody awaits it
                sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def abort(self, rid: str) -> None:
        self._send_nowait(msgs.AbortRequest(rid))

    async def shutdown(self) -> None:
        self._send_nowait(msgs.Shutdown())
        for task in self._tasks:
            task.cancel()
        self.sockets.close()
        if self.record is not None:
            self.record.close()


class BlockingClient:
    """A private event loop in a daemon thread, for synchronous callers of a ControlClient.

    `call(coro)` runs a coroutine there and waits for its result; the client and everything it
    touches live on that loop's thread only."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="control-client", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_all() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            self.call(cancel_all(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

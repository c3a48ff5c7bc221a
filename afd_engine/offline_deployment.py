"""`make_engine(mode="afd" | "colocated", ...)`: the offline API over a deployment of rank processes.

The same calls as the in-process engine (`generate`, `add_request`, `step`, `abort`), driving the
same control-plane client as the HTTP server (`control/client.py`) on a private event loop: routing
(`--load-balance-method`), submission, hang detection and the ranks' reasons for failing are the
server's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading

from afd_engine.control.client import BlockingClient, ControlClient, EngineUnavailable, RequestFailed, RequestStream
from afd_engine.control.load_balance import LoadBalancer
from afd_engine.engine_args import EngineArgs
from afd_engine.errors import InvalidRequestError
from afd_engine.offline import OfflineEngine
from afd_engine.processes.deployment import Deployment
from afd_engine.runtime.request import RequestOutput
from afd_engine.runtime.stop_checker import trim_text
from afd_engine.sampling_params import SamplingParams

POLL_S = 0.2  # how long `step()` waits for a finished request before it returns none
LAST_WORDS_S = 0.2  # a failing rank says why just before it exits: wait this long for it


class DeploymentDied(EngineUnavailable):
    """A rank of the deployment exited or stopped answering; the message says which and why."""


class DistributedEngine(OfflineEngine):
    def __init__(self, args: EngineArgs | None = None, **kwargs) -> None:
        from afd_engine.checkpoint_tokenizer import load_tokenizer

        args = args.replace(**kwargs) if args is not None else EngineArgs.from_kwargs(**kwargs)
        self.deployment = Deployment(args)
        ranks = self.deployment.num_attention_ranks
        self._loop = BlockingClient()
        router = LoadBalancer.of(args.load_balance_method, ranks, args.page_size)

        async def bind() -> ControlClient:  # the client's sockets belong to the loop's thread
            by_room = args.disaggregation_mode == "prefill"
            d = self.deployment
            lost = d.lost_attention_ranks if d.fault_tolerant else None
            replace = d.replace_attention_rank if d.replaces_attention_ranks else None
            return ControlClient(d.addrs, router, d.alive, route_by_room=by_room, lost_ranks=lost, replace=replace)

        self.client = self._loop.call(bind())
        self.router = router
        try:
            info = self.deployment.start()
        except BaseException:
            self._loop.call(self.client.shutdown())
            self._loop.close()
            raise
        self._loop.call(self._start_client())
        self.model_path, self.context_len = info["model_path"], info["context_len"]
        self.info = info
        self.tokenizer = load_tokenizer(self.model_path)
        # requests in flight: rid -> prompt, params and what has arrived (written on the loop's thread)
        self._pending: dict[str, dict] = {}
        self._finished: queue.SimpleQueue[RequestOutput | DeploymentDied] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._died: DeploymentDied | None = None
        self._lock = threading.Lock()  # the loop's thread finishes requests, the caller's aborts them
        self._collectors: dict[str, asyncio.Task] = {}  # rid -> its collector (on the loop's thread)

    async def _start_client(self) -> None:
        self.client.start()

    @property
    def rank_stats(self):
        return self.client.rank_stats

    @property
    def failures(self) -> dict[int, str]:
        """rank -> why it stopped (its last words)."""
        return self.client.failures

    @property
    def stats(self):
        """The deployment's counters (as the server's /metrics gives them), from the ranks' latest messages."""
        return self.client.stats

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        disaggregation: dict | None = None,
    ) -> str:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids", param="prompt")
        if self._died is not None:
            raise self._died
        ids = list(self.tokenizer.encode(prompt)) if prompt is not None else list(prompt_token_ids)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._pending:  # each rank knows only its own ids: a duplicate could land elsewhere
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        params = params or SamplingParams()
        self._pending[rid] = {"prompt": ids, "params": params, "tokens": [], "logprobs": []}
        try:
            stream = self._loop.call(self.client.open(rid, ids, params, disaggregation))
        except EngineUnavailable as exc:
            del self._pending[rid]
            raise self._death(str(exc)) from None
        self._loop.call(self._watch(stream))
        return rid

    async def _watch(self, stream: RequestStream) -> None:
        self._collectors[stream.rid] = asyncio.get_running_loop().create_task(self._collect(stream))

    async def _collect(self, stream: RequestStream) -> None:
        """Gathers one request's updates; hands its output (or the deployment's death) to `step`."""
        req = self._pending.get(stream.rid)
        try:
            async for u in stream:
                if req is None:
                    continue
                req["tokens"] += u.token_ids
                req["logprobs"] += u.logprobs or []
                if u.prompt_logprobs is not None:
                    req["prompt_logprobs"] = u.prompt_logprobs
                if u.finish_reason is not None:
                    self._finish(stream.rid, self._output(u, req))
        except InvalidRequestError as exc:  # the rank refused it
            self._finish(stream.rid, RequestOutput(stream.rid, req["prompt"], [], "", "error", str(exc)))
        except RequestFailed as exc:
            u = exc.update
            req["tokens"] += u.token_ids
            self._finish(stream.rid, self._output(u, req))
        except EngineUnavailable as exc:
            await asyncio.sleep(LAST_WORDS_S)
            reason = self.client.down_reason() or str(exc)
            self._finished.put(DeploymentDied(f"a rank of the deployment died or hung: {reason}"))
        finally:
            stream.close()
            self._collectors.pop(stream.rid, None)

    def _finish(self, rid: str, out: RequestOutput) -> None:
        with self._lock:  # `has_unfinished` never sees it neither pending nor queued
            if self._pending.pop(rid, None) is not None:
                self._finished.put(out)

    def has_unfinished(self) -> bool:
        """Requests in flight, or finished and not yet returned by `step`."""
        with self._lock:
            return bool(self._pending) or not self._finished.empty()

    def step(self) -> list[RequestOutput]:
        """Waits up to POLL_S for requests to finish; returns those that did. Raises DeploymentDied
        when a rank exited or stopped answering."""
        if self._died is not None:
            raise self._died
        done: list[RequestOutput] = []
        with contextlib.suppress(queue.Empty):  # empty: none finished (within POLL_S), or no more
            item = self._finished.get(timeout=POLL_S)
            while True:
                if isinstance(item, DeploymentDied):
                    self._died = item
                    raise item
                done.append(item)
                item = self._finished.get_nowait()
        return done

    def expert_load(self, timeout: float = 30.0) -> dict:
        """The deployment's expert load report (eplb/report.py): every attention rank's, summed."""
        try:
            return self._loop.call(self.client.expert_load(timeout))
        except EngineUnavailable as exc:
            raise self._death(str(exc)) from None

    def _death(self, message: str) -> EngineUnavailable:
        if not self.deployment.alive() or self.client.down_reason() is not None:
            return DeploymentDied(message)
        return EngineUnavailable(message)

    def _output(self, u, req: dict) -> RequestOutput:
        text = self.tokenizer.decode(req["tokens"], skip_special_tokens=req["params"].skip_special_tokens)
        return RequestOutput(
            u.request_id,
            req["prompt"],
            req["tokens"],
            trim_text(text, u.text_trim),
            u.finish_reason,
            u.error,
            req["logprobs"] if req["params"].logprobs is not None else None,
            u.num_cached_tokens,
            req.get("prompt_logprobs"),
        )

    def abort(self, request_id: str) -> None:
        """Stops the request; its output is dropped."""
        with self._lock:
            aborted = self._pending.pop(request_id, None) is not None
        if aborted:
            self._loop.call(self._abort(request_id))

    async def _abort(self, rid: str) -> None:
        task = self._collectors.get(rid)
        if task is not None:  # cancelled, its collector closes the stream, which aborts it in the engine
            task.cancel()

    def close(self) -> None:
        self._loop.call(self.client.shutdown())
        self.deployment.stop()
        self._loop.close()
        self.client.ctx.term()

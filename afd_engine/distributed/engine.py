"""`make_engine(mode="afd" | "colocated", ...)`: the offline API over a deployment of rank processes.

The same calls as the in-process engine (`generate`, `add_request`, `step`, `abort`), sent to the
attention ranks over the control plane that the HTTP server uses; a Router picks each request's
rank (`--load-balance-method`).
"""

from __future__ import annotations

import itertools
import time

import zmq

from afd_engine.control import messages as msgs
from afd_engine.control.loop import FrontEndSockets
from afd_engine.control.router import Router
from afd_engine.distributed.launcher import Deployment
from afd_engine.engine_args import EngineArgs
from afd_engine.eplb.report import merge_reports
from afd_engine.errors import AFDError, InvalidRequestError
from afd_engine.offline import OfflineEngine
from afd_engine.runtime.request import RequestOutput
from afd_engine.runtime.stop_checker import trim_text
from afd_engine.sampling_params import SamplingParams

POLL_MS = 200


class DeploymentDied(AFDError):
    pass


class DistributedEngine(OfflineEngine):
    def __init__(self, args: EngineArgs | None = None, **kwargs) -> None:
        from transformers import AutoTokenizer

        args = args.replace(**kwargs) if args is not None else EngineArgs.from_kwargs(**kwargs)
        self.deployment = Deployment(args)
        ranks = self.deployment.num_attention_ranks
        self.router = Router.of(args.load_balance_method, ranks, args.page_size)
        self.ctx = zmq.Context()
        self.sockets = FrontEndSockets.bind(self.ctx, self.deployment.addrs, ranks)
        self.push, self.pub, self.pull = self.sockets.push, self.sockets.pub, self.sockets.pull
        info = self.deployment.start()
        self.model_path, self.context_len = info["model_path"], info["context_len"]
        self.info = info
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._pending: dict[str, dict] = {}
        self._ids = itertools.count()
        self._backlog: list[RequestOutput] = []  # finished while waiting for something else
        self.rank_stats: dict[int, msgs.EngineStats] = {}  # each attention rank's latest counters
        self.failures: dict[int, str] = {}  # rank -> why it stopped (its last words)

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
        ids = list(self.tokenizer.encode(prompt)) if prompt is not None else list(prompt_token_ids)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._pending:  # each rank knows only its own ids: a duplicate could land elsewhere
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        params = params or SamplingParams()
        self._pending[rid] = {"prompt": ids, "params": params, "tokens": [], "logprobs": []}
        if disaggregation is not None and self.deployment.args.disaggregation_mode == "prefill":
            rank = self.router.route_to(rid, disaggregation["room"] % self.router.num_ranks)
        else:
            rank = self.router.route(rid, ids)
        self._submit(rank, msgs.AddRequest(rid, ids, params, disaggregation))
        return rid

    def _submit(self, rank: int, msg: msgs.AddRequest) -> None:
        """Waits while the rank has not connected yet; a dead rank never will."""
        while not self.push[rank].poll(POLL_MS, zmq.POLLOUT):
            if not self.deployment.alive():
                raise self._died()
        self.push[rank].send(msgs.encode(msg))
        self.sockets.wake_ranks()

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Waits for the ranks' next messages; returns the requests that finished."""
        done, self._backlog = self._backlog, []
        if not self.pull.poll(POLL_MS):
            if not self.deployment.alive():
                raise self._died()
            return done
        while True:
            try:
                msg = msgs.decode_output(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return done
            done += self._absorb(msg)

    def expert_load(self, timeout: float = 30.0) -> dict:
        """The deployment's expert load report (eplb/report.py): every attention rank's, summed."""
        token = f"load-{next(self._ids)}"
        self.pub.send(msgs.encode(msgs.DumpExpertLoad(token)))
        reports: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(reports) < self.deployment.num_attention_ranks:
            if time.monotonic() > deadline:
                raise DeploymentDied(f"attention ranks {sorted(reports)} answered within {timeout:g} s, not all")
            if not self.pull.poll(POLL_MS):
                if not self.deployment.alive():
                    raise self._died()
                continue
            msg = msgs.decode_output(self.pull.recv())
            if isinstance(msg, msgs.ExpertLoadReport):
                if msg.token == token:
                    reports[msg.rank] = msg.report
            else:
                self._backlog += self._absorb(msg)
        return merge_reports([reports[r] for r in sorted(reports)])

    def _died(self) -> DeploymentDied:
        """The error for a deployment that lost a rank, with the reasons ranks gave, if any."""
        # a failing rank says why just before it exits: read what has come
        while self.pull.poll(0):
            self._backlog += self._absorb(msgs.decode_output(self.pull.recv()))
        why = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        return DeploymentDied("a rank of the deployment died" + (f" ({why})" if why else ""))

    @property
    def stats(self) -> msgs.EngineStats:
        """The deployment's counters (as the server's /metrics gives them), from the ranks' latest messages."""
        return msgs.EngineStats.total(self.rank_stats.values())

    def _absorb(self, msg) -> list[RequestOutput]:
        if isinstance(msg, msgs.ExpertLoadReport):  # an answer nobody waits for any more
            return []
        if isinstance(msg, msgs.StepOutput):
            self.rank_stats[msg.rank] = msg.stats
        if isinstance(msg, msgs.RankFailed):
            self.failures[msg.rank] = msg.message
            return []
        if isinstance(msg, msgs.Rejected):
            self.router.finished(msg.rid)
            req = self._pending.pop(msg.rid, None)
            return [] if req is None else [RequestOutput(msg.rid, req["prompt"], [], "", "error", msg.message)]
        out = []
        for u in msg.updates:
            req = self._pending.get(u.request_id)
            if req is None:
                continue
            req["tokens"] += u.token_ids
            req["logprobs"] += u.logprobs or []
            if u.prompt_logprobs is not None:
                req["prompt_logprobs"] = u.prompt_logprobs
            if u.finish_reason is not None:
                del self._pending[u.request_id]
                self.router.finished(u.request_id)
                out.append(self._output(u, req))
        return out

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
        if self._pending.pop(request_id, None) is not None:
            self.router.finished(request_id)
            self.pub.send(msgs.encode(msgs.AbortRequest(request_id)))

    def close(self) -> None:
        self.pub.send(msgs.encode(msgs.Shutdown()))
        self.deployment.stop()
        self.sockets.close()
        self.ctx.term()

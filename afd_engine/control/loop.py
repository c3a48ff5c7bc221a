"""The engine process's loop, the control addresses, and the front end's sockets.

The loop steps whenever any request is in flight and otherwise waits on its sockets. Every step's
updates go out in one message with the engine's counters; when idle it still sends a heartbeat
twice a second so the front end knows it is alive. A lockstep engine (a rank of a deployment)
steps every round, with or without work, because its peers must agree on every step.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from afd_engine.control import messages as msgs
from afd_engine.engine import Engine
from afd_engine.engine_args import EngineArgs
from afd_engine.errors import InvalidRequestError

HEARTBEAT_S = 0.5
SPEC_LOG_S = 10.0  # speculative decoding: the acceptance log line's interval
# A lockstep rank with no work anywhere runs an agreement round this often. The front end wakes
# every rank when it sends a request (messages.Wake), so this only bounds how long a rank that
# started a round alone waits for the others; each idle round costs every rank some CPU.
LOCKSTEP_IDLE_MS = 50
# A rank whose only work is waiting on a disaggregation peer checks its timeouts this often (a
# message from the peer wakes it at once).
DISAGG_POLL_MS = 50
# A rank whose only work is requests waiting for their grammar looks for finished compiles this often.
GRAMMAR_POLL_MS = 2
log = logging.getLogger("afd.engine")
_WAKE = msgs.encode(msgs.Wake())


@dataclass(frozen=True)
class ControlAddrs:
    """Where the front end listens: requests (one address per attention rank, see
    `requests_of`), broadcasts (aborts, shutdown) and outputs (from every rank)."""

    requests: str
    broadcast: str
    outputs: str

    def requests_of(self, rank: int) -> str:
        return f"{self.requests}-{rank}"


@dataclass
class FrontEndSockets:
    push: list[zmq.Socket]  # requests out, one socket per rank: the router picks the rank
    pub: zmq.Socket  # aborts, wake-ups and shutdown, to every rank
    pull: zmq.Socket  # outputs of every rank

    @staticmethod
    def bind(ctx: zmq.Context, addrs: ControlAddrs, num_ranks: int) -> FrontEndSockets:
        """Binds the sockets; `ctx` may be a plain or an asyncio ZeroMQ context. A request sent
        to a rank that has not connected yet waits for it."""
        socks = FrontEndSockets(
            [ctx.socket(zmq.PUSH) for _ in range(num_ranks)], ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
        )
        for rank, sock in enumerate(socks.push):
            sock.bind(addrs.requests_of(rank))
        socks.pub.bind(addrs.broadcast)
        socks.pull.bind(addrs.outputs)
        return socks

    def wake_ranks(self) -> None:
        """Called after a request went to one rank: where there are several (lockstep ranks),
        every rank leaves its idle wait, so the request's first agreement round starts now."""
        if len(self.push) > 1:
            self.pub.send(_WAKE, zmq.NOBLOCK)  # a PUB socket drops what it cannot queue: never blocks

    def close(self) -> None:
        for sock in self.push:
            sock.close(linger=0)
        self.pub.close(linger=500)  # let a last Shutdown leave
        self.pull.close(linger=0)


class EngineLoop:
    def __init__(self, engine: Engine, addrs: ControlAddrs, rank: int = 0) -> None:
        self.engine, self.rank = engine, rank
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(addrs.requests_of(rank))  # this rank's requests only
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(addrs.broadcast)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(addrs.outputs)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self.sub, zmq.POLLIN)
        self.disagg = getattr(engine, "disagg", None)  # prefill-decode disaggregation, when on
        if self.disagg is not None:  # a peer's KV message wakes an idle rank (its step drains it)
            self.poller.register(self.disagg.inbox, zmq.POLLIN)
        self._last_sent = 0.0
        self._rank_load: tuple[float, ...] = ()
        self._rank_load_at = float("-inf")
        self._spec_logged = (time.monotonic(), 0, 0)  # (when, verifications, accepted drafts) at the last line

    def _log_speculation(self) -> None:
        """Every SPEC_LOG_S with verifications since the last line: their mean accepted length."""
        when, verifies, accepted = self._spec_logged
        now = time.monotonic()
        if now - when < SPEC_LOG_S:
            return
        v, _, a, _ = self.engine.spec_counters()
        if v > verifies:
            log.info(
                "speculative decoding: %d verifications, mean accepted length %.2f (%.2f since start)",
                v - verifies,
                1.0 + (a - accepted) / (v - verifies),
                1.0 + a / v,
            )
        self._spec_logged = (now, v, a)

    def run(self) -> None:
        engine = self.engine
        idle_ms = LOCKSTEP_IDLE_MS if engine.lockstep else int(HEARTBEAT_S * 1000)
        while not engine.stopped:
            if engine.peers_busy:
                timeout = 0
            elif not engine.has_unfinished():
                timeout = idle_ms
            elif engine.compiling and not engine.scheduler.has_work():
                timeout = GRAMMAR_POLL_MS
            elif self.disagg is not None and not engine.scheduler.has_work():
                timeout = DISAGG_POLL_MS  # only waiting on a disaggregation peer, whose messages wake us
            else:
                timeout = 0
            self._receive(timeout_ms=timeout)
            updates = engine.step_updates() if engine.lockstep or engine.has_unfinished() else []
            if updates or time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self._send(msgs.StepOutput(updates, self.stats(), self.rank))
            if self.engine.args.spec_steps:
                self._log_speculation()
        engine.close()
        self.close()

    def stats(self) -> msgs.EngineStats:
        s, pool, cache, pd = self.engine.scheduler, self.engine.pool, self.engine.cache, self.disagg
        return msgs.EngineStats(
            len(s.running),
            len(s.waiting),
            pool.used_pages,
            pool.num_pages,
            cache.num_pages,
            s.cache_hit_tokens,
            s.prompt_tokens,
            cache.evicted_pages,
            self._expert_rank_load(),
            getattr(pd, "reserved_pages", 0),
            pd.transfer_bytes if pd is not None else 0,
            pd.transfer_seconds if pd is not None else 0.0,
            *self.engine.ffn_fault_counters(),
            self.engine.static_decode_batches(),
            *self.engine.spec_counters(),
            *self.engine.experts_loaded(),
        )

    def _expert_rank_load(self) -> tuple[float, ...]:
        """The expert ranks' load from this rank's window, recomputed at most once per heartbeat."""
        if time.monotonic() - self._rank_load_at >= HEARTBEAT_S:
            self._rank_load = self.engine.expert_rank_load()
            self._rank_load_at = time.monotonic()
        return self._rank_load

    def _receive(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is not self.pull and sock is not self.sub:
                continue  # the disaggregation inbox: read by the engine's step
            while True:
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = msgs.decode(raw)
                except Exception:  # a malformed control message must not end the engine
                    log.exception("dropped an undecodable control message of %d bytes", len(raw))
                    continue
                self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, msgs.InvalidAddRequest):
            self._send(msgs.Rejected(msg.rid, msg.message, msg.param))
        elif isinstance(msg, msgs.AddRequest):
            try:
                self.engine.add_request(
                    prompt_token_ids=msg.prompt_ids,
                    params=msg.params,
                    request_id=msg.rid,
                    disaggregation=msg.disaggregation,
                )
            except InvalidRequestError as exc:
                self._send(msgs.Rejected(msg.rid, str(exc), exc.param))
            except Exception as exc:  # one request's content must fail that request only
                log.exception("request %s could not be added", msg.rid)
                self._send(msgs.Rejected(msg.rid, f"the engine could not take this request: {exc}"))
        elif isinstance(msg, msgs.AbortRequest):  # broadcast: only the owning rank knows the id
            self.engine.abort(msg.rid)
        elif isinstance(msg, msgs.DumpExpertLoad):
            self._send(msgs.ExpertLoadReport(msg.token, self.rank, self.engine.expert_load_report()))
        elif isinstance(msg, msgs.Shutdown):
            self.engine.request_stop()  # lockstep ranks all stop in the same agreement round
        elif isinstance(msg, msgs.AdmitRank):  # agreed on in a lockstep round, like a loss
            admit = getattr(self.engine.runner, "admit_peer", None)
            if admit is not None and msg.rank != self.rank:
                admit(msg.rank, {"incarnation": msg.incarnation, "address": msg.address, "host": msg.host})

    def _send(self, msg) -> None:
        self.push.send(msgs.encode_output(msg))
        self._last_sent = time.monotonic()

    def close(self) -> None:
        self.pull.close(linger=0)
        self.sub.close(linger=0)
        self.push.close(linger=1000)
        self.ctx.term()


def run_engine_process(
    args: EngineArgs, addrs: ControlAddrs, ready, rank: int = 0, build: Callable[[], Engine] | None = None
) -> None:
    """Process entry point of the single engine (or, with `build`, of an attention rank): builds the
    engine, reports readiness (or the error) through `ready`, then serves until shut down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from afd_engine.proctitle import engine_title, set_title

    set_title(engine_title(args.mode, rank, args.dp_size))
    try:
        engine = build() if build is not None else Engine(args)
    except Exception as exc:  # any failure to start is reported to the parent, which exits
        ready.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    ready.send(
        {
            "ok": True,
            "model_path": str(engine.model_path),
            "context_len": engine.context_len,
            "vocab_size": engine.config.vocab_size,
            "architecture": engine.config.architecture,
            "disagg_address": engine.disagg.address if engine.disagg is not None else None,
            "disagg_description": engine.disagg.description if engine.disagg is not None else None,
            "payload_device": _payload_device(engine),
        }
    )
    log.info(
        "rank %d ready: %s, %d KV pages of %d tokens",
        rank,
        engine.model_path,
        engine.pool.num_pages,
        engine.pool.page_size,
    )
    gc.freeze()  # what loading made lives as long as the process: later collections skip it
    try:
        EngineLoop(engine, addrs, rank).run()
    except BaseException as exc:
        # a rank that fails must die now: background threads (relays waiting on peers for up to
        # --comm-timeout) would otherwise keep the process, and the deployment's failure, pending
        log.exception("rank %d failed", rank)
        _last_words(addrs, rank, f"{type(exc).__name__}: {exc}")
        logging.shutdown()
        os._exit(1)


def _last_words(addrs: ControlAddrs, rank: int, message: str) -> None:
    """Tells the front end why this rank stops (best effort, at most a second)."""
    ctx = zmq.Context()
    with contextlib.suppress(zmq.ZMQError):  # the front end is gone: nobody to tell
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addrs.outputs)
        sock.send(msgs.encode_output(msgs.RankFailed(rank, message)), zmq.NOBLOCK)
        sock.close(linger=1000)
    ctx.term()


def _payload_device(engine: Engine) -> str | None:
    """Where the rank's transport delivers tensors between ranks ("cuda:0"), None: host memory."""
    device = getattr(getattr(engine.runner, "transport", None), "payload_device", None)
    return str(device) if device is not None else None

"""The prefill and the decode side of a disaggregated rank: what its Engine does besides stepping.

The rank's loop thread calls `before_step` and `after_step` around every step; the ZeroMQ inbox
is in the loop's poller, so a message from the peer wakes an idle rank at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from afd_engine.disagg import wire
from afd_engine.disagg.bootstrap import BootstrapError, BootstrapQuery
from afd_engine.disagg.transfer import TransferFailed, make_backend, send_frames
from afd_engine.runtime.kv_cache import pages_for
from afd_engine.runtime.request import Request, TokenLogprob
from comm.auth import cluster_keys, secure_socket, start_authenticator

log = logging.getLogger("afd.disagg")
BOOTSTRAP_TTL_S = 5.0  # a prefill instance's ranks are asked again after this long


class _Side:
    def __init__(self, engine) -> None:
        args = engine.args
        self.scheduler, self.pool, self.page_size = engine.scheduler, engine.pool, engine.pool.page_size
        self.timeout = args.disaggregation_timeout
        self.description = wire.instance_description(
            engine.config, engine.model_path, args.page_size, engine.pool.cache.dtype, engine.pool.cache.shape[0]
        )
        self.ctx = zmq.Context()
        # with a cluster secret (AFD_CLUSTER_SECRET), the inbox admits only ranks that hold it
        self.keys = cluster_keys(None)
        self._auth = start_authenticator(self.ctx, self.keys) if self.keys is not None else None
        self.inbox = self.ctx.socket(zmq.PULL)
        secure_socket(self.inbox, self.keys, server=True)
        self.inbox.bind(f"tcp://{args.disaggregation_host}:*")
        self.address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            self.backend = make_backend(
                args.disaggregation_transfer_backend,
                engine.pool.cache,
                self.page_size,
                args.disaggregation_host,
                args.disaggregation_ib_device,
            )
        except BaseException:  # (a context left with an open socket hangs whoever collects it)
            self.inbox.close(linger=0)
            self._stop_auth()
            self.ctx.term()
            raise
        self._peers: dict[str, zmq.Socket] = {}
        self.transfer_bytes = 0  # since start
        self.transfer_seconds = 0.0
        self.dropped = 0  # malformed messages dropped, since start

    def _peer(self, address: str) -> zmq.Socket:
        sock = self._peers.get(address)
        if sock is None:
            sock = self._peers[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            secure_socket(sock, self.keys, server=False)
            sock.connect(address)
        return sock

    def _tell(self, address: str, header: dict) -> None:
        """A control message to a peer rank; one that cannot be queued is dropped (the peer is gone)."""
        try:
            send_frames(self._peer(address), [wire.pack(header)])
        except TransferFailed:
            log.warning("could not tell %s about room %s: the peer is not taking messages", address, header.get("room"))

    def _messages(self):
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = wire.unpack(frames[0].buffer)
            except Exception:  # a stray or broken message must not end the rank
                header = None
            if not wire.well_formed(header) or len(frames) > 2:
                self.dropped += 1
                log.warning("dropped a malformed disaggregation message (%d so far)", self.dropped)
                continue
            yield header, (frames[1].buffer if len(frames) > 1 else None)

    @staticmethod
    def _fail(req: Request, message: str) -> None:
        if req.finish_reason is None:
            req.finish_reason, req.error = "error", message

    def close(self) -> None:
        self.backend.close()
        for sock in self._peers.values():
            sock.close(linger=0)
        self.inbox.close(linger=0)
        self._stop_auth()
        self.ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()


class PrefillSide(_Side):
    """Requests wait (not admitted) until their decode rank has reserved pages and said where they
    go; then they prefill like any other request, and each step's newly full pages are sent."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.waiting: dict[int, Request] = {}  # room -> request whose destination is not known yet
        self.early: dict[int, tuple[dict, float]] = {}  # room -> destination that came before its request
        self.active: dict[int, Request] = {}  # room -> admitted request, destination known
        self._step_began = 0.0

    def has_work(self) -> bool:
        return bool(self.waiting)

    def room_in_use(self, room: int) -> bool:
        return room in self.waiting or room in self.active

    def add(self, req: Request) -> None:
        """Waits for its destination (which may have come already: before_step pairs them)."""
        req.timeline = {"arrived": time.monotonic(), "transfer_s": 0.0, "transfer_bytes": 0}
        self.waiting[req.disagg_room] = req

    def drop(self, req: Request) -> None:
        """The request ends here before its transfer finished (aborted): the decode side is told."""
        self.waiting.pop(req.disagg_room, None)
        if self.active.pop(req.disagg_room, None) is not None:
            header = {"kind": wire.FAIL, "room": req.disagg_room, "error": "aborted on the prefill side"}
            self._tell(req.dest["reply"], header)

    def before_step(self) -> tuple[list[Request], list[Request]]:
        """(requests that got a token: none here, requests that failed)."""
        self._step_began = now = time.monotonic()
        failed = []
        for header, _ in self._messages():
            room = header.get("room")
            if header.get("kind") == wire.DEST:
                self.early[room] = (header, now)
            elif header.get("kind") == wire.FAIL:
                req = self.waiting.pop(room, None) or self.active.pop(room, None)
                self.early.pop(room, None)
                if req is not None:
                    self._fail(req, f"the decode instance failed this request: {header.get('error')}")
                    failed.append(req)
        for room in [r for r in self.waiting if r in self.early]:  # destinations meet their requests
            req, (dest, _) = self.waiting.pop(room), self.early.pop(room)
            if not self._start(req, dest):
                failed.append(req)
        for room, req in list(self.waiting.items()):
            if now - req.timeline["arrived"] > self.timeout:
                del self.waiting[room]
                self._fail(
                    req,
                    f"no decode instance reserved pages for this request within {self.timeout:g} s "
                    "(--disaggregation-timeout)",
                )
                failed.append(req)
        for room, (_, at) in list(self.early.items()):
            if now - at > self.timeout:
                del self.early[room]
        return [], failed

    def _start(self, req: Request, dest: dict) -> bool:
        """Admits the request towards `dest`; False (failed, the decode side told) on a mismatch."""
        req.dest = dest
        problem = wire.mismatch(self.description, dest.get("desc", {}))
        if problem is not None:
            self._fail(req, problem)
            self._tell(dest["reply"], {"kind": wire.FAIL, "room": req.disagg_room, "error": problem})
            return False
        req.sent_pages = dest["start"]
        req.timeline["dest"] = time.monotonic()
        self.active[req.disagg_room] = req
        self.scheduler.add(req)
        return True

    def after_step(self) -> list[Request]:
        """Sends what the step computed; returns the requests that are done here (transferred, or
        failed)."""
        done = []
        now = time.monotonic()
        for room, req in list(self.active.items()):
            t = req.timeline
            if "start" not in t and req.row is not None:
                t["start"] = max(self._step_began, t["dest"])
            n = len(req.prompt_ids) + req.num_resumed  # (a resumed request's tokens are prefilled too)
            try:
                if len(req.output_ids) > req.num_resumed:  # the prompt is done and its first token sampled
                    t.setdefault("first_token", now)
                    del self.active[room]
                    if req.finish_reason is None:  # else it ended with its first token: no pages needed
                        self._send(req, pages_for(n, self.page_size))
                        req.finish_reason = "transferred"
                        done.append(req)
                    self._send_done(req)
                elif req.finish_reason is not None:
                    del self.active[room]
                elif req.row is not None:
                    self._send(req, min(req.num_cached, n) // self.page_size)
            except TransferFailed as exc:
                self.active.pop(room, None)
                req.finish_reason = None
                self._fail(req, f"the KV transfer to the decode instance failed: {exc}")
                self._tell(req.dest["reply"], {"kind": wire.FAIL, "room": room, "error": str(exc)})
                if req not in done:
                    done.append(req)
        return done

    def _send(self, req: Request, upto: int) -> None:
        """Sends pages [sent, upto) of the request's row to their destination pages."""
        first = req.sent_pages
        if upto <= first:
            return
        began = time.monotonic()
        src = [self.pool.page_of(req.row, i) for i in range(first, upto)]
        dst = req.dest["pages"][first - req.dest["start"] : upto - req.dest["start"]]
        nbytes = self.backend.send(self._peer(req.dest["reply"]), req.disagg_room, req.dest, src, dst)
        req.sent_pages = upto
        took = time.monotonic() - began
        req.timeline["transfer_s"] += took
        req.timeline["transfer_bytes"] += nbytes
        self.transfer_bytes += nbytes
        self.transfer_seconds += took

    def _send_done(self, req: Request) -> None:
        t = req.timeline
        lp = req.logprobs[0] if req.logprobs else None
        header = {
            "kind": wire.DONE,
            "room": req.disagg_room,
            "token": req.output_ids[req.num_resumed],
            "finish_reason": None if req.finish_reason == "transferred" else req.finish_reason,
            "text_trim": req.text_trim,
            "seed": req.seed,
            "cached": req.num_cached_tokens,
            "logprob": None if lp is None else [lp.logprob, lp.top_ids, lp.top_logprobs],
            "prompt_logprobs": None
            if req.prompt_logprobs is None
            else [None if x is None else [x.logprob, x.top_ids, x.top_logprobs] for x in req.prompt_logprobs],
            "timeline": {
                "prefill_queue_s": t.get("start", t["first_token"]) - t.get("dest", t["arrived"]),
                "prefill_s": t["first_token"] - t.get("start", t["first_token"]),
                "transfer_s": t["transfer_s"],
                "transfer_bytes": t["transfer_bytes"],
            },
        }
        send_frames(self._peer(req.dest["reply"]), [wire.pack(header)])


class DecodeSide(_Side):
    """Requests wait (queued) until their pages fit, then hold them (reserved) until the prefill
    side has filled them and sent the first token; then they decode like any other request."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.queue: deque[Request] = deque()  # waiting for pages
        self.reserved: dict[int, Request] = {}  # room -> request holding pages, waiting for its KV
        self._prefill: dict[str, tuple[dict, float]] = {}  # bootstrap address -> (its answer, when)
        self._queries: dict[str, BootstrapQuery] = {}  # bootstrap address -> the query on its way
        self.cached_pages = 0  # since start

    def has_work(self) -> bool:
        return bool(self.queue or self.reserved)

    def close(self) -> None:
        for query in self._queries.values():
            query.close()
        super().close()

    def room_in_use(self, room: int) -> bool:
        return room in self.reserved or any(r.disagg_room == room for r in self.queue)

    @property
    def reserved_pages(self) -> int:
        return sum(self.pool.num_row_pages(r.row) for r in self.reserved.values())

    def add(self, req: Request) -> None:
        req.timeline = {"arrived": time.monotonic()}
        self.queue.append(req)

    def drop(self, req: Request) -> None:
        if req in self.queue:
            self.queue.remove(req)
        if self.reserved.pop(req.disagg_room, None) is not None:
            self._tell_prefill(req, {"kind": wire.FAIL, "room": req.disagg_room, "error": "aborted on the decode side"})

    def before_step(self) -> tuple[list[Request], list[Request]]:
        """(requests whose first token arrived, requests that failed or ended with their first token)."""
        now = time.monotonic()
        ready, ended = [], []
        for header, payload in self._messages():
            req = self.reserved.get(header.get("room"))
            if req is None:  # aborted or timed out meanwhile
                continue
            kind = header.get("kind")
            if kind == wire.PAGES:
                try:
                    self._receive(req, header, payload)
                except (TransferFailed, TypeError, ValueError, RuntimeError) as exc:
                    del self.reserved[req.disagg_room]
                    message = f"the prefill instance sent pages this rank cannot take: {exc}"
                    self._fail(req, message)
                    self._tell_prefill(req, {"kind": wire.FAIL, "room": req.disagg_room, "error": message})
                    ended.append(req)
            elif kind == wire.DONE:
                del self.reserved[req.disagg_room]
                try:
                    self._take_first_token(req, header, now)
                except (KeyError, TypeError, ValueError) as exc:
                    self._fail(req, f"the prefill instance's last message for this request is malformed ({exc!r})")
                    ended.append(req)
                    continue
                ready.append(req)
                if req.finish_reason is not None:
                    ended.append(req)
                else:
                    self.scheduler.activate(req)
            elif kind == wire.FAIL:
                del self.reserved[req.disagg_room]
                self._fail(req, header.get("error", "the prefill instance failed this request"))
                ended.append(req)
        for room, req in list(self.reserved.items()):
            if now - req.timeline["reserved"] > self.timeout:
                del self.reserved[room]
                message = f"the prefill instance sent no KV cache within {self.timeout:g} s (--disaggregation-timeout)"
                self._fail(req, message)
                self._tell_prefill(req, {"kind": wire.FAIL, "room": room, "error": message})
                ended.append(req)
        ended += self._reserve(now)
        return ready, ended

    def after_step(self) -> list[Request]:
        return []

    def _receive(self, req: Request, header: dict, payload) -> None:
        """A PAGES message: only into the pages this rank reserved for the request."""
        pages = header.get("pages")
        if not isinstance(pages, list) or not set(pages) <= req.kv_pages or payload is None:
            raise TransferFailed("pages outside the request's reservation")
        self.backend.receive(header, payload)

    def _reserve(self, now: float) -> list[Request]:
        """Reserves pages for queued requests in arrival order while they fit (a request whose
        prefill instance has not answered its bootstrap query yet waits, and the ones behind it
        go ahead); returns those that failed at the handshake."""
        failed, waiting = [], []
        while self.queue:
            req = self.queue.popleft()
            try:
                info = self._prefill_info(req.disagg_bootstrap)
            except BootstrapError as exc:
                self._fail(req, str(exc))
                failed.append(req)
                continue
            if info is None:
                waiting.append(req)
                continue
            problem = wire.mismatch(info["desc"], self.description)
            if problem is not None:
                self._fail(req, problem)
                failed.append(req)
                continue
            if not self.scheduler.reserve(req, len(self.reserved)):
                self.queue.appendleft(req)
                break
            req.timeline["reserved"] = now
            req.prefill_rank = info["ranks"][req.disagg_room % len(info["ranks"])]
            self.reserved[req.disagg_room] = req
            start = req.prefix.depth
            self.cached_pages += start  # pages this instance's prefix cache held: not transferred
            end = pages_for(req.known_len, self.page_size)  # (with a resumed request's tokens)
            pages = [self.pool.page_of(req.row, i) for i in range(start, end)]
            req.kv_pages = set(pages)
            self._tell_prefill(
                req,
                {
                    "kind": wire.DEST,
                    "room": req.disagg_room,
                    "reply": self.address,
                    "desc": self.description,
                    "start": start,
                    "pages": pages,
                    "backend": self.backend.describe(),
                },
            )
        self.queue.extendleft(reversed(waiting))
        return failed

    def _prefill_info(self, bootstrap: str) -> dict | None:
        """The prefill instance's ranks and description; None while its answer is on the way
        (the query never blocks the rank); BootstrapError when it did not come in time."""
        known = self._prefill.get(bootstrap)
        if known is not None and time.monotonic() - known[1] <= BOOTSTRAP_TTL_S:
            return known[0]
        query = self._queries.get(bootstrap)
        if query is None:
            query = self._queries[bootstrap] = BootstrapQuery(self.ctx, bootstrap, keys=self.keys)
        try:
            answer = query.answer()
        except BootstrapError:
            del self._queries[bootstrap]
            raise
        if answer is not None:
            del self._queries[bootstrap]
            self._prefill[bootstrap] = (answer, time.monotonic())
        return answer

    def _tell_prefill(self, req: Request, header: dict) -> None:
        self._tell(req.prefill_rank, header)

    def _take_first_token(self, req: Request, h: dict, now: float) -> None:
        req.seed = h["seed"]
        req.output_ids.append(h["token"])
        req.num_cached_tokens = h["cached"]
        if req.logprobs is not None and h["logprob"] is not None:
            req.logprobs.append(TokenLogprob(*h["logprob"]))
        if h["prompt_logprobs"] is not None:
            req.prompt_logprobs = [None if x is None else TokenLogprob(*x) for x in h["prompt_logprobs"]]
        if h["finish_reason"] is not None:
            req.finish_reason, req.text_trim = h["finish_reason"], h["text_trim"]
        t, p = req.timeline, h["timeline"]
        req.timeline = {
            "queue_s": (t["reserved"] - t["arrived"]) + p["prefill_queue_s"],
            "prefill_s": p["prefill_s"],
            "transfer_s": p["transfer_s"],
            "transfer_bytes": p["transfer_bytes"],
            "kv_wait_s": now - t["reserved"],
            "kv_at": now,
        }
        self.transfer_bytes += p["transfer_bytes"]
        self.transfer_seconds += p["transfer_s"]


def make_side(engine):
    mode = engine.args.disaggregation_mode
    if mode == "prefill":
        return PrefillSide(engine)
    if mode == "decode":
        return DecodeSide(engine)
    return None

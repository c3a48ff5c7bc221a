"""`afd router`'s failover: a prefill or a decode instance lost while requests are on it.

The router learns of a loss from its own health checks (every HEALTH_INTERVAL_S; LOST_AFTER
failed ones in a row) and from the requests themselves: a refused or broken connection, a 5xx,
or an error event, after which it asks the instance's /health at once. An instance that does not
answer 200 then (dead, hung, its engine gone, or draining) is out: no new request goes there, and
each request of this router on it moves (at most MAX_TRIES tries per request):

- Before the decode instance has its first token (the prefill instance lost, or the decode one
  before it streamed anything): the request is sent again to another prefill instance, paired
  with its decode instance under a new room; closing the old decode request frees the pages it
  had reserved for the lost transfer.
- A decode instance lost mid-stream: the request resumes on another decode instance, through a
  prefill instance, from the tokens the client has. The decode instance streams them beside the
  text (server/stream_ids.py); the resumed request carries them (`afd_resume`) to both instances,
  whose engines put them at the head of its output: it prefills the prompt and them, and goes on
  as a preempted request does (max_tokens, min_tokens, seeded draws at (seed, tokens so far),
  penalties, stop strings and grammars all count them). The resumed stream keeps the stream's id,
  sends no second role chunk or echo, and its usage counts the original prompt and all tokens.
  The client sees one stream, with no error, no token twice and none missing; a greedy or seeded
  request streams what it would have without the loss. An unseeded request samples on with a new
  seed.
- A JSON (non-stream) answer: nothing reached the client, so the request is sent again whole.

What cannot move fails as before, with an OpenAI error (or an error event): a stream with several
choices of which some finished and others not, and every request once MAX_TRIES tries are spent
or no instance of a role is left. Instances started apart (`afd router --prefill ... --decode
...`) fail over; `afd serve --pd`'s one instance of each has nowhere to go (it exits when one dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from dataclasses import dataclass, field

import httpx
from fastapi.responses import Response

from afd_engine.server.errors import error_body, openai_error
from afd_engine.server.stream_ids import RelayedStream

log = logging.getLogger("afd.router")
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 3.0
LOST_AFTER = 2  # failed periodic checks in a row (one, after a request on the instance failed)
MAX_TRIES = 4
ROOM_STRIDE = 1 << 16  # rooms room .. room + STRIDE - 1 name the request's choices (n x prompts)
UP, DRAINING, LOST = "up", "draining", "lost"


async def probe(client: httpx.AsyncClient, url: str) -> str:
    """UP, DRAINING (answers, but takes no new request) or LOST."""
    try:
        answer = await client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError:
        return LOST
    if answer.status_code == 200:
        return UP
    try:
        status = answer.json().get("status")
    except (ValueError, AttributeError):
        status = None
    return DRAINING if status == "draining" else LOST


@dataclass
class Job:
    """One client request, over however many tries it takes."""

    path: str
    endpoint: str
    body: dict
    headers: dict
    stream: bool
    choices: int | None  # engine requests it makes (n x prompts); None: unknown
    tries: int = 0


def num_choices(path: str, body: dict) -> int | None:
    """Choices of a request (what a resumed request must list tokens for); None if unclear."""
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if path == "/generate":
        return 1
    if path == "/v1/chat/completions":
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return n
    if isinstance(prompt, list) and prompt:
        return n * len(prompt)
    return None


@dataclass(eq=False)
class Attempt:
    """One try of a request: its prefill request (none where the decode instance prefills it
    itself) and its decode request, under one room. `lost` resolves when the router learns that
    an instance the try still depends on is lost (the prefill one only until the first token)."""

    router: object
    p: object | None
    d: object
    room: int
    prefill: asyncio.Future
    decode: asyncio.Future  # stream: the response once its headers are in; else the whole response
    lost: asyncio.Future
    response: httpx.Response | None = None
    kv_arrived: bool = False
    closed: bool = False
    parts: tuple = field(default=())

    @property
    def watches_prefill(self) -> bool:
        return self.p is not None and not self.kv_arrived and not self.prefill_ok()

    def prefill_ok(self) -> bool:
        f = self.prefill
        return f.done() and not f.cancelled() and f.exception() is None and f.result().status_code == 200

    def notice(self, inst) -> None:
        """`inst` is lost: this try fails if it still needs it."""
        if self.lost.done() or (inst is self.p and not self.watches_prefill):
            return
        self.lost.set_result(inst)

    def first_token(self) -> None:
        """The decode instance has the KV cache: the prefill instance no longer matters."""
        self.kv_arrived = True
        if self.p is not None:
            self.p.attempts.discard(self)

    async def wait(self, work: asyncio.Future) -> str | None:
        """Waits for `work`; None once it is done, unless first "lost" (an instance of this try is
        lost) or "prefill" (the prefill request failed)."""
        while not work.done():
            waiting = {work, self.lost}
            if self.watches_prefill:
                waiting.add(self.prefill)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                break
            if self.lost.done():
                return "lost"
            if self.prefill.done() and self.watches_prefill:
                return "prefill"
        return None

    def prefill_failure(self) -> Response:
        """The OpenAI error of the failed prefill request."""
        f = self.prefill
        exc = f.exception()
        if exc is not None:
            return openai_error(503, f"the prefill instance is unavailable: {exc!r}", type="server_error")
        resp: httpx.Response = f.result()
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:500]
        status = resp.status_code if resp.status_code < 500 else 503
        return openai_error(status, f"the prefill instance failed this request: {message}", type="server_error")

    async def close(self) -> None:
        """Ends both requests (an unfinished one is aborted on its instance) and the try's load."""
        if self.closed:
            return
        self.closed = True
        self.router.release(self)
        for f in (self.prefill, self.decode):
            if f.done() and not f.cancelled() and f.exception() is None and f is self.decode:
                await f.result().aclose()
            _settle(f)  # (cancelling closes the connection: the instance aborts the request)
        if self.response is not None:
            await self.response.aclose()


def start(router, job: Job, resume: dict | None, exclude: set, prefer=None) -> Attempt | Response:
    """A new try of `job`, on instances not in `exclude` (PDRouter.pick; `prefer`: this decode
    instance if it is up); an OpenAI 503 when a role has none left."""
    room = secrets.randbits(62) // ROOM_STRIDE * ROOM_STRIDE
    picked = router.pick(room, job.body, exclude, local=resume is None, prefer=prefer)
    if isinstance(picked, str):
        return openai_error(503, picked, type="server_error")
    p, d = picked
    body = job.body
    if job.stream and job.choices is not None and router.failover:
        body = {**body, "afd_token_ids": True}
    if resume is not None:
        body = {**body, "afd_resume": resume}
    loop = asyncio.get_running_loop()
    client, headers = router.client, job.headers
    if p is None:
        prefill, d_body = loop.create_future(), body
    else:
        p_body = {**body, "bootstrap_room": room, "stream": False}
        p_body.pop("stream_options", None)
        p_body.pop("afd_token_ids", None)
        d_body = {**body, "bootstrap_room": room, "bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port}
        prefill = asyncio.ensure_future(client.post(p.url + job.path, json=p_body, headers=headers))
    request = client.build_request("POST", d.url + job.path, json=d_body, headers=headers)
    decode = asyncio.ensure_future(client.send(request, stream=True) if job.stream else _whole(client, request))
    attempt = Attempt(router, p, d, room, prefill, decode, loop.create_future(), parts=(d,) if p is None else (p, d))
    router.hold(attempt)
    job.tries += 1
    return attempt


async def _whole(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    resp = await client.send(request, stream=True)
    try:
        await resp.aread()
    finally:
        await resp.aclose()
    return resp


async def open_request(router, job: Job, resume: dict | None = None, exclude=None, prefer=None) -> Attempt | Response:
    """A try whose decode instance answered 200 (a stream's headers, or the whole JSON answer),
    moving to other instances as long as the failures are losses; else the error to answer."""
    exclude = set() if exclude is None else exclude
    tries: list[Attempt] = []
    try:
        return await _open(router, job, resume, exclude, prefer, tries)
    except BaseException:  # the client went away, or the router failed: closing aborts both sides
        for attempt in tries:
            await attempt.close()
        raise


async def _open(router, job: Job, resume, exclude: set, prefer, tries: list) -> Attempt | Response:
    attempt = start(router, job, resume, exclude, prefer)
    while isinstance(attempt, Attempt):
        tries.append(attempt)
        failed = await attempt.wait(attempt.decode)
        answer = None
        if failed is None:
            exc = attempt.decode.exception()
            if exc is None:
                attempt.response = attempt.decode.result()
                if attempt.response.status_code == 200:
                    return attempt
                status = attempt.response.status_code
                answer = await _decode_answer(attempt.response)
                if status < 500 or not await router.lost(attempt, decode=True):
                    await attempt.close()
                    return answer
            else:
                message = f"the decode instance {attempt.d.url} is unavailable: {exc}"
                answer = openai_error(503, message, type="server_error")
                if not await router.lost(attempt, decode=True):
                    await attempt.close()
                    return answer
        elif failed == "prefill":
            answer = attempt.prefill_failure()
            if answer.status_code < 500 or not await router.lost(attempt, decode=False):
                await attempt.close()
                return answer
        await attempt.close()
        exclude |= {i for i in attempt.parts if i.state != UP}
        if job.tries >= MAX_TRIES:
            return answer or openai_error(503, "the request's instances were lost too many times", type="server_error")
        # (a prefill instance lost: its decode instance takes the request again, under a new room)
        again = start(router, job, resume, exclude, attempt.d if attempt.d.state == UP else prefer)
        if isinstance(again, Response):
            return answer or again
        router.failovers.labels("resend" if resume is None else "resume").inc()
        attempt = again
    return attempt


async def _decode_answer(resp: httpx.Response) -> Response:
    content = resp.content if resp.is_stream_consumed else await resp.aread()
    return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))


async def relay(router, job: Job, attempt: Attempt):
    """The decode instance's event stream to the client; on a loss, the rest of it from the
    request resumed elsewhere (the module's docstring). A failure of the router itself ends the
    stream with an error event and `[DONE]` (the traceback goes to the log), not a cut connection."""
    ended = False  # the client has [DONE]
    try:
        async with contextlib.aclosing(_relay(router, job, attempt)) as events:
            async for out in events:
                ended = out.endswith(DONE)
                yield out
    except Exception:
        log.exception("the router failed a stream of %s", job.path)
        if not ended:
            message = "the router failed while relaying this stream (its log has the cause)"
            yield _last_event(error_body(message, type="server_error"))


async def _relay(router, job: Job, attempt: Attempt):
    reader = RelayedStream()
    chunk = None
    try:
        while True:
            chunks = attempt.response.aiter_raw().__aiter__()
            while True:
                chunk = asyncio.ensure_future(chunks.__anext__())
                failed = await attempt.wait(chunk)
                if failed is not None:
                    _settle(chunk)
                    break
                try:
                    out = reader.feed(chunk.result())
                except StopAsyncIteration:
                    failed = None if reader.done else "ended"
                    break
                except httpx.HTTPError:
                    failed = "broken"
                    break
                if (reader.ids or reader.finished) and not attempt.kv_arrived:
                    attempt.first_token()
                if out:
                    yield out
                if reader.error is not None:
                    failed = "error"
                    break
            if failed is None or reader.done:  # (lost after its last event: nothing to move)
                return
            moved = await _move(router, job, attempt, reader, failed)
            if isinstance(moved, bytes):
                yield moved
                return
            attempt = moved
    finally:
        if chunk is not None:
            _settle(chunk)
        await attempt.close()


def _settle(f: asyncio.Future) -> None:
    """A future nobody will read: cancelled, or its exception seen (no "never retrieved" at exit)."""
    if not f.done():
        f.cancel()
    elif not f.cancelled():
        f.exception()


async def _move(router, job: Job, attempt: Attempt, reader: RelayedStream, failed: str) -> Attempt | bytes:
    """After a try's stream failed: the try that goes on with it, or the stream's last events."""
    if failed == "prefill":
        answer = attempt.prefill_failure()
        lost = answer.status_code >= 500 and await router.lost(attempt, decode=False)
        if not lost:
            return _last_event(json.loads(answer.body))
    elif failed != "lost" and not await router.lost(attempt, decode=True):
        if reader.error is not None:
            return reader.error + DONE
        return _last_event(error_body(f"the decode instance {attempt.d.url} failed ({failed})", type="server_error"))
    if job.choices is not None and len(reader.finished) == job.choices:  # only the end (usage) was left
        return DONE
    ids = reader.resume_ids(job.choices) if job.choices is not None and router.failover else None
    if (ids is None and reader.started) or job.tries >= MAX_TRIES:
        # (a replica has no room to resume a request under: only one that showed nothing moves)
        why = (
            "its instances were lost too many times"
            if ids is not None
            else "some of its choices had finished"
            if reader.finished
            else "the router resumes only prefill-decode requests whose choices it can count"
        )
        message = f"an instance of this request was lost and the stream cannot resume: {why}"
        return _last_event(error_body(message, type="server_error"))
    await attempt.close()
    resume = {"output_ids": ids, "id": reader.stream_id} if reader.started else None
    reader.restart()
    router.failovers.labels("resend" if resume is None else "resume").inc()
    exclude = {i for i in attempt.parts if i.state != UP}
    opened = await open_request(router, job, resume, exclude, attempt.d if attempt.d.state == UP else None)
    if isinstance(opened, Response):
        try:
            body = json.loads(opened.body)
        except ValueError:
            body = error_body(opened.body.decode(errors="replace")[:500], type="server_error")
        return _last_event(body)
    return opened


DONE = b"data: [DONE]\n\n"


def _last_event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode() + DONE

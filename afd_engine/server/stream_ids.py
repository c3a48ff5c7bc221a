"""The token ids of a streamed response, for `afd router`'s failover (server/pd_failover.py).

A router that loses a decode instance mid-stream resumes each of its requests elsewhere from the
tokens the client has, so it must know them exactly (text does not tokenize back to the same
ids). It asks for them with the request's internal field `afd_token_ids`; the decode instance then
puts, before the events of each engine update, an SSE comment line with the update's token ids:

    : afd-token-ids [[0,[412,9],null]]        (choice index, token ids, finish reason)
    data: {"id":"chatcmpl-...","choices":[{"index":0,"delta":{"content":" a b"}, ...}]}

An update's events and its ids line are one write (the renderers join an update's events), so the
router never holds the text of tokens whose ids it lacks, nor ids whose text it did not forward:
what the router forwarded is what it resumes from. A comment line is ignored by SSE clients; the
router removes it anyway. Ids of an update that shows no text yet (a character still incomplete,
a possible stop string) wait for the next event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from afd_engine.server import protocol as P

PREFIX = b": afd-token-ids "


async def with_token_ids(render: Callable[[AsyncIterator], AsyncIterator], stream: AsyncIterator) -> AsyncIterator:
    """The events `render` makes of `stream` (run_choices' (choice, delta, update) triples), each
    preceded by the ids line of the updates it is the first event after."""
    pending: list = []

    async def tapped():
        async for c, delta, update in stream:
            if update.token_ids or update.finish_reason is not None:
                pending.append([c.index, update.token_ids, update.finish_reason])
            yield c, delta, update

    events = render(tapped())
    try:
        async for event in events:
            text = event if isinstance(event, str) else P.sse_event(event)
            if pending:
                text = f"{PREFIX.decode()}{json.dumps(pending, separators=(',', ':'))}\n{text}"
                pending.clear()
            yield text
    finally:
        await events.aclose()


class RelayedStream:
    """The router's side: reads a decode instance's event stream as it is relayed, removes the ids
    lines, and keeps what a resumption needs: per choice the token ids forwarded and whether it
    finished, the stream's id, and whether the client got anything at all.

    `feed(data)` returns the bytes to forward now (whole events only); an error event the instance
    sent is held back in `error` (the router decides whether to forward it or resume), and nothing
    after it is forwarded."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.stream_id: str | None = None
        self.started = False  # the client got an event
        self.done = False  # the instance sent [DONE]
        self.error: bytes | None = None
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        if self.error is not None:
            return b""
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            kept = self._event(event)
            if self.error is not None:
                break
            if kept:
                out.append(kept + b"\n\n")
        if out:
            self.started = True
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        kept = []
        for line in lines:
            if line.startswith(PREFIX):
                for index, ids, finish in json.loads(line[len(PREFIX) :]):
                    self.ids.setdefault(index, []).extend(ids)
                    if finish is not None:
                        self.finished.add(index)
                continue
            if line.startswith(b"data: "):
                self._data(line[6:], event)
            kept.append(line)
        return b"\n".join(kept)

    def _data(self, payload: bytes, event: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
        elif payload.startswith(b'{"error"'):
            self.error = event + b"\n\n"
        elif self.stream_id is None and payload.startswith(b'{"id"'):
            self.stream_id = json.loads(payload).get("id")

    def restart(self) -> None:
        """The stream goes on from another decode instance: what was left of an event is dropped
        (the client never got it)."""
        self._buffer, self.error = b"", None

    def resume_ids(self, num_choices: int) -> list[list[int]] | None:
        """Per choice, the tokens a resumed request starts from; None when it cannot resume (a
        choice finished while others did not: the engine would generate more for it)."""
        if self.finished:
            return None
        return [list(self.ids.get(i, ())) for i in range(num_choices)]

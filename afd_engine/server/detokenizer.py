"""Incremental detokenization for streaming: turn token ids, as they arrive, into text deltas.

Two things make this harder than ``decode(new_ids)``:

* Byte-level BPE tokens can hold part of a UTF-8 character, and decoders that strip or insert
  spaces (SentencePiece's leading "▁") decode a token differently at the start of a sequence
  than after other tokens. The tokenizers library's ``DecodeStream`` solves this for a fast
  tokenizer: it decodes a window that starts at the tokens of the text it produced last, and
  returns the window's new text only once the window ends at a complete character. Two things
  are added here. When a token completes characters and starts another one (a merge across a
  character boundary), the complete ones are shown at once instead of with the next token; and
  ``finish`` shows what the stream still holds (an incomplete end: the full decode's U+FFFD).
* A stop string must never be streamed in part, since the engine may cut the text right
  before it. Any tail that could be the start of a stop string is held back until the next
  tokens rule it out, or until ``finish`` learns where the engine cut the text.

Every emitted delta is a prefix-stable piece of ``decode(all_ids)``: the concatenation of the
deltas equals ``tokenizer.decode(all_ids, skip_special_tokens=...)`` cut at ``trim``. (Decoding
never applies ``clean_up_tokenization_spaces``, which is not prefix-stable; it is off for the
byte-level BPE tokenizers we serve, whose decode is thus the same.)
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class _WindowStream:
    """``DecodeStream.step`` over a Python decode function: for a tokenizer without a Rust
    backend (a slow one), and for a fast one whose DecodeStream refused a window."""

    def __init__(self, decode, context: list[int]) -> None:
        self._decode = decode
        self._ids = list(context)  # the tokens of the last text produced, then those not read yet
        self._read = len(self._ids)
        self._prefix = decode(self._ids) if self._ids else ""  # the text of ids[:_read]

    def step(self, ids: list[int]) -> str | None:
        self._ids += ids
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix) or text.endswith(_REPLACEMENT):
            return None
        new = text[len(self._prefix) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix = self._decode(self._ids)
        return new


class IncrementalDetokenizer:
    """Streams the text of one output sequence.

    ``add(new_ids)`` returns the text that became safe to show; ``finish(trim)`` returns the
    rest, cut at character ``trim`` of the full output text when a stop string ended the
    request. Each call decodes O(window) tokens, never the whole output.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # Every proper prefix of every stop string: the tails that must be held back.
        self._stop_prefixes = {s[:k] for s in self.stop for k in range(1, len(s))}
        self._decode = self._pick_decoder(tokenizer, skip_special_tokens)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if isinstance(backend, Tokenizer) else None  # None: a slow tokenizer
        self._step = self._stream([])

        self._count = 0
        # The stream's window, mirrored: the tokens of the text it produced last (its left
        # context) and the tokens it holds since, which end inside a character.
        self._context: list[int] = []
        self._context_len: int | None = None  # len(decode(_context)), once needed
        self._held: list[int] = []
        self._early = 0  # characters of the held tokens' text produced before the stream did

        self._pending = ""  # produced text held back (a possible stop string start)
        self._chunks: list[str] = []  # emitted deltas; joined lazily by .text
        self._emitted_len = 0
        self._tail = ""  # the last _max_stop - 1 emitted characters, for stop matching
        self._finished = False

    @staticmethod
    def _pick_decoder(tokenizer, skip_special_tokens: bool):
        """The cheapest decode call with the semantics of ``tokenizer.decode``.

        A Hugging Face fast tokenizer's decode is its Rust backend's decode plus optional
        space clean-up (which we never want, see the module docstring); calling the backend
        directly saves several microseconds of Python per call.
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "decode"):
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return lambda ids: tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    # --- public API -----------------------------------------------------------------------

    @property
    def token_count(self) -> int:
        """Token ids received so far."""
        return self._count

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas). Joins the deltas
        on access: meant for the end of a request, not for every step."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, new_ids: list[int]) -> str:
        """Append generated token ids; returns the newly safe text (possibly "")."""
        if self._finished:
            raise RuntimeError("add() after finish()")
        if not new_ids:
            return ""
        self._count += len(new_ids)
        self._pending += self._produce(list(new_ids))
        return self._emit(self._safe_len())

    def finish(self, trim: int | None = None) -> str:
        """The remaining text. ``trim``, a character index into the full output text (what the
        engine reports when a stop string matched), cuts the text there."""
        if self._finished:
            return ""
        self._finished = True
        if self._held:
            self._pending += self._new_text(self._decode(self._context + self._held), final=True)
        if trim is None:
            return self._emit(len(self._pending))
        # trim falls at or after everything emitted, because a stop string (where the engine
        # cuts) is never emitted. Should the engine cut earlier anyway, nothing more is shown.
        return self._emit(max(0, min(len(self._pending), trim - self._emitted_len)))

    # --- decoding ---------------------------------------------------------------------------

    def _stream(self, context: list[int]):
        """The `step` of a new stream whose last text came from the tokens `context`."""
        if self._backend is None:
            return _WindowStream(self._decode, context).step
        stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        return functools.partial(stream.step, self._backend)

    def _produce(self, new_ids: list[int]) -> str:
        """The new text the tokens complete, including complete characters before an incomplete end."""
        try:
            chunk = self._step(new_ids)
        except Exception:  # DecodeStream refuses a window whose text rewrites its context's
            self._backend = None
            self._step = self._stream(self._context)
            chunk = self._step(self._held + new_ids)
        if chunk is not None:
            # The stream slid its window: these tokens are the left context of the next one.
            self._context, self._held, self._context_len = self._held + new_ids, [], None
            chunk, self._early = chunk[self._early :], 0
            return chunk
        self._held += new_ids
        window = self._decode(self._context + self._held)
        if not window.endswith(_REPLACEMENT):
            # No new text (skipped special tokens), yet a stream slides its window only past new
            # text: a long run of such tokens would grow the window. Start past them instead.
            self._held, self._early = [], 0
            self._step = self._stream(self._context)
            return ""
        return self._new_text(window, final=False)

    def _new_text(self, window: str, final: bool) -> str:
        """Text of the held tokens not produced yet, from the text of the window (context and
        held tokens): the complete characters before its incomplete end, or (``final``)
        everything, an incomplete end decoding to U+FFFD as in the full decode."""
        if self._context_len is None:
            self._context_len = len(self._decode(self._context)) if self._context else 0
        start = self._context_len + self._early
        end = len(window) if final else len(window.rstrip(_REPLACEMENT))
        if end <= start:
            return ""
        self._early = end - self._context_len
        return window[start:end]

    # --- stop-string hold-back --------------------------------------------------------------

    def _safe_len(self) -> int:
        """How many characters of _pending can be emitted without revealing part of a stop
        string: up to the first complete stop string, and short of any tail that could still
        grow into one."""
        pending = self._pending
        if not self.stop or not pending:
            return len(pending)
        # A stop string may begin in the emitted tail; search tail + pending and translate back.
        # The tail is never a stop-string prefix itself (it would have been held back), so a
        # match can only start inside the tail if it extends into pending.
        tail = self._tail
        hay = tail + pending
        first = len(hay)
        for s in self.stop:
            i = hay.find(s)
            if 0 <= i < first:
                first = i
        safe = min(len(pending), max(0, first - len(tail)))
        # Hold back the longest end of the text that is a proper prefix of some stop string.
        prefixes = self._stop_prefixes
        for k in range(min(self._max_stop - 1, len(hay)), 0, -1):
            if hay[-k:] in prefixes:
                safe = min(safe, max(0, len(hay) - k - len(tail)))
                break
        return safe

    def _emit(self, n: int) -> str:
        """Move the first n pending characters to the emitted text and return them."""
        if n <= 0:
            return ""
        delta, self._pending = self._pending[:n], self._pending[n:]
        self._chunks.append(delta)
        self._emitted_len += len(delta)
        if self._max_stop > 1:
            self._tail = (self._tail + delta)[-(self._max_stop - 1) :]
        return delta

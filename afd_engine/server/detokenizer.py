"""Incremental detokenization for streaming: turn token ids, as they arrive, into text deltas.

Two things make this harder than ``decode(new_ids)``:

* Byte-level BPE tokens can hold part of a UTF-8 character, and decoders that strip or insert
  spaces (SentencePiece's leading "▁") decode a token differently at the start of a sequence
  than after other tokens. So each step decodes a short window that starts a few tokens back,
  at a known character boundary, and only the part of the window's text beyond what the
  earlier tokens produced is new. A window whose text ends in U+FFFD ends inside an incomplete
  character; that character is held back until a later token completes it.
* A stop string must never be streamed in part, since the engine may cut the text right
  before it. Any tail that could be the start of a stop string is held back until the next
  tokens rule it out, or until ``finish`` learns where the engine cut the text.

Every emitted delta is a prefix-stable piece of ``decode(all_ids)``: the concatenation of the
deltas equals ``tokenizer.decode(all_ids, skip_special_tokens=...)`` cut at ``trim``. (Decoding
never applies ``clean_up_tokenization_spaces``, which is not prefix-stable; it is off for the
byte-level BPE tokenizers we serve, whose decode is thus the same.)
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


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

        self._ids: list[int] = []
        # The decode window is ids[_prefix_offset:]. Tokens before _read_offset have been turned
        # into text already; decoding them again gives the window its left context.
        # Both offsets always sit at character boundaries of the output.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_len = 0  # len(decode(ids[_prefix_offset:_read_offset]))
        # Characters of the window beyond _prefix_len already produced while its end was still
        # an incomplete character (see add()).
        self._partial = 0

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
        return len(self._ids)

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
        self._ids.extend(new_ids)
        self._pending += self._produce(final=False)
        return self._emit(self._safe_len())

    def finish(self, trim: int | None = None) -> str:
        """The remaining text. ``trim``, a character index into the full output text (what the
        engine reports when a stop string matched), cuts the text there."""
        if self._finished:
            return ""
        self._finished = True
        self._pending += self._produce(final=True)
        if trim is None:
            return self._emit(len(self._pending))
        # trim falls at or after everything emitted, because a stop string (where the engine
        # cuts) is never emitted. Should the engine cut earlier anyway, nothing more is shown.
        return self._emit(max(0, min(len(self._pending), trim - self._emitted_len)))

    # --- decoding ---------------------------------------------------------------------------

    def _produce(self, final: bool) -> str:
        """New text of the window ids[_prefix_offset:], excluding an incomplete last character
        unless ``final``."""
        text = self._decode(self._ids[self._prefix_offset :])
        start = self._prefix_len + self._partial
        if text.endswith(_REPLACEMENT) and not final:
            # The window ends inside a character (or, rarely, in invalid bytes, which are only
            # final once followed by more text). Produce what precedes the incomplete end but
            # keep the window anchored: its end is no character boundary to restart from.
            stable = len(text.rstrip(_REPLACEMENT))
            if stable <= start:
                return ""
            self._partial = stable - self._prefix_len
            return text[start:stable]
        delta = text[start:]
        # The window's end is a character boundary: slide it. The tokens just read become the
        # left context of the next window, which keeps every window a few tokens long.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        self._partial = 0
        return delta

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

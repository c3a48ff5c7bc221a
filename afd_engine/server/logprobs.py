"""Token log-probabilities in the chat and the legacy completions formats."""

from __future__ import annotations

import codecs
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from afd_engine.server.responses import ChatLogprobs, CompletionLogprobs

# --------------------------------------------------------------------------------------------
# Log-probabilities
# --------------------------------------------------------------------------------------------

# JSON has no -inf, and OpenAI clients require a number; OpenAI itself reports -9999.0 for
# tokens of (numerically) zero probability.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else (_MIN_LOGPROB if logprob < 0 or math.isnan(logprob) else 0.0)


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in GPT-2 style byte-level BPE, inverted.

    Bytes that are printable and not whitespace stand for themselves; the other 68 are mapped,
    in byte order, to the code points from 256 upwards. Inverting the map turns a token's
    vocabulary string back into its exact bytes, even when they are an incomplete UTF-8
    character (which decoding the single token would turn into U+FFFD).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


@dataclasses.dataclass(frozen=True)
class TokenText:
    """How one token id is shown in logprobs, and what it adds to the output text."""

    token: str  # display text; "bytes:\\xe4\\xbd" for an incomplete UTF-8 piece, as OpenAI does
    raw: bytes  # exact UTF-8 bytes of the token
    in_text: bool  # False for a special token that the output text skips


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class LogprobFormatter:
    """Builds chat and completions logprobs from token ids, their logprobs and top-k alternatives.

    One formatter per tokenizer (the server keeps one); each token's text is computed once and
    cached, so formatting costs O(tokens * k) dictionary look-ups.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._byte_level = _is_byte_level(tokenizer)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                self._special_ids.add(token_id)
        self._cache: dict[int, TokenText] = {}

    def token_text(self, token_id: int) -> TokenText:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._compute(token_id)
        return entry

    def _compute(self, token_id: int) -> TokenText:
        in_text = not (self.skip_special_tokens and token_id in self._special_ids)
        raw: bytes | None = None
        if self._byte_level and token_id not in self._special_ids:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
        if raw is None:
            # Special/added tokens (written literally in the vocabulary) and other tokenizer
            # kinds: the token decoded on its own.
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return TokenText(token=text, raw=text.encode("utf-8"), in_text=in_text)
        try:
            token = raw.decode("utf-8")
        except UnicodeDecodeError:
            token = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenText(token=token, raw=raw, in_text=in_text)

    def chat_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top: Sequence[tuple[Sequence[int], Sequence[float]]] | None = None,
    ) -> ChatLogprobs:
        """Chat format: per token {token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}.

        ``top[i]`` holds the ids and logprobs of the most likely tokens at position i; None
        (or empty) gives an empty ``top_logprobs``, as OpenAI does for ``top_logprobs: 0``.
        """
        # Plain dicts validated once at the end: pydantic's Rust validator builds the nested models
        # several times faster than one constructor call per entry would.
        content = []
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
            t = self.token_text(token_id)
            alternatives = []
            if top is not None and i < len(top):
                for alt_id, alt_lp in zip(*top[i]):
                    a = self.token_text(alt_id)
                    alternatives.append({"token": a.token, "logprob": _finite(alt_lp), "bytes": list(a.raw)})
            content.append(
                {"token": t.token, "logprob": _finite(lp), "bytes": list(t.raw), "top_logprobs": alternatives}
            )
        return ChatLogprobs.model_validate({"content": content})

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top: Sequence[tuple[Sequence[int], Sequence[float]]] | None = None,
        text_offset: int = 0,
    ) -> CompletionLogprobs:
        """Legacy completions format: parallel lists tokens / token_logprobs / top_logprobs /
        text_offset.

        As in OpenAI's API, each ``top_logprobs`` dict also contains the chosen token. Offsets
        are character positions in the output text, starting at ``text_offset`` (pass the
        length of the text streamed before this chunk). They are exact within one call; a
        character whose bytes straddle two calls is counted in the later one.
        """
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset = text_offset
        out = CompletionLogprobs(top_logprobs=[] if top is not None else None)
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
            t = self.token_text(token_id)
            out.tokens.append(t.token)
            out.token_logprobs.append(None if lp is None else _finite(lp))
            out.text_offset.append(offset)
            if t.in_text:
                offset += len(decoder.decode(t.raw))
            if lp is None:  # an echoed first prompt token: nothing predicts it
                if out.top_logprobs is not None:
                    out.top_logprobs.append(None)
                continue
            if out.top_logprobs is not None:
                alternatives = {}
                if i < len(top):
                    for alt_id, alt_lp in zip(*top[i]):
                        alternatives[self.token_text(alt_id).token] = _finite(alt_lp)
                alternatives.setdefault(t.token, _finite(lp))
                out.top_logprobs.append(alternatives)
        return out

    @staticmethod
    def unpack(entries: Sequence[Any]) -> tuple[list[float], list[tuple[list[int], list[float]]]]:
        """(logprobs, top) from the engine's per-token records (``.logprob``, ``.top_ids``,
        ``.top_logprobs``, as in ``afd_engine.runtime.request.TokenLogprob``); a None record (a
        first prompt token) stays None."""
        return [e and e.logprob for e in entries], [e and (e.top_ids, e.top_logprobs) for e in entries]

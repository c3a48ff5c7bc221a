"""Decides, after each new token, whether a request is finished and why ("stop" or "length").

Stop strings are matched on decoded text, so they are found even when they span several
tokens. Decoding the whole output every step would cost O(length) per token; instead each
step decodes only a short tail window of tokens, and the full output is decoded once, when
the window reports a hit, to place the cut exactly in the request's full text.
"""

from __future__ import annotations

from functools import lru_cache

from afd_engine.sampling_params import SamplingParams

# Extra tokens in the tail window beyond one per byte of the longest stop string: they give
# the decoder left context (leading-space and byte-merging rules) before the stop string.
_WINDOW_SLACK = 4


def trim_text(text: str, trim: int | None) -> str:
    """The output text as the user sees it: cut at ``trim`` when a stop string ended the request."""
    return text if trim is None else text[:trim]


@lru_cache(maxsize=1024)
def _window_tokens(stop: tuple[str, ...]) -> int:
    """Tokens to decode so the window surely covers any stop string plus the new token.

    Every non-special token decodes to at least one byte, so a stop string of n UTF-8 bytes
    spans at most n tokens.
    """
    return max(len(s.encode("utf-8")) for s in stop) + _WINDOW_SLACK


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def find_stop(prev_text: str, text: str, stop: tuple[str, ...], include: bool) -> int | None:
    """Cut index in ``text`` for the first stop string that ends in the part new since ``prev_text``.

    The "new part" starts where the two texts first differ, not at ``len(prev_text)``: a
    partial UTF-8 character decoded as U+FFFD in ``prev_text`` is rewritten once complete.
    Among several matches the one that completes first (smallest end, then longest) wins,
    because generation would have stopped there.
    """
    changed_from = _common_prefix_len(prev_text, text)
    best: tuple[int, int] | None = None  # (end, start) of the winning occurrence
    for s in stop:
        # Any earlier occurrence would have ended inside the old text and stopped us already.
        start = text.find(s, max(0, changed_from - len(s) + 1))
        if start >= 0 and (best is None or (start + len(s), start) < best):
            best = (start + len(s), start)
    if best is None:
        return None
    end, start = best
    return end if include else start


class StopChecker:
    """Checks EOS, stop token ids, stop strings and max_new_tokens for one request at a time."""

    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, output_ids: list[int], params: SamplingParams) -> tuple[str | None, int | None]:
        """After a new token was appended to output_ids: returns (finish_reason, trim).

        finish_reason is None (go on), "stop" (EOS unless ignore_eos, a stop token id, or a
        stop string) or "length" (max_new_tokens reached). ``trim`` is, for a stop string,
        the character index in the full decoded output text where the text must be cut
        (before the stop string, or after it with include_stop_str_in_output); else None.
        A stop on the same step as reaching max_new_tokens is reported as "stop". Before
        min_tokens tokens nothing stops it (EOS and stop token ids are also masked out then).
        """
        if len(output_ids) < params.min_tokens:
            return None, None
        last = output_ids[-1]
        if (last in self.eos_token_ids and not params.ignore_eos) or last in params.stop_token_ids:
            return "stop", None
        if params.stop:
            trim = self._stop_string_trim(output_ids, params)
            if trim is not None:
                return "stop", trim
        if len(output_ids) >= params.max_new_tokens:
            return "length", None
        return None, None

    def _stop_string_trim(self, output_ids: list[int], params: SamplingParams) -> int | None:
        """Cheap tail-window test first; on a hit, the exact cut index in the full output text."""
        window = output_ids[-_window_tokens(params.stop) :]
        if self._find(window, params) is None:
            return None
        # Rare (at most once per request): place the cut in the full text, which can differ
        # from the window's text at the window's left edge.
        return self._find(output_ids, params)

    def _find(self, ids: list[int], params: SamplingParams) -> int | None:
        """find_stop on the decoded ``ids``, the newest token being the new part."""
        skip = params.skip_special_tokens
        prev_text = self.tokenizer.decode(ids[:-1], skip_special_tokens=skip)
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        return find_stop(prev_text, text, params.stop, params.include_stop_str_in_output)

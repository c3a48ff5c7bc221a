"""Constrained decoding with xgrammar: guides checked, compiled off the engine loop, and matched.

A request's ``SamplingParams.guide`` is ``(kind, spec)``: a JSON schema, any JSON object, a regular
expression, an EBNF grammar or an xgrammar structural tag (tool calls). Three parts:

- :func:`check_guide` (the API server, before anything reaches the engine): builds the grammar
  without a tokenizer, so a schema xgrammar cannot handle or a regex that does not parse is a 400
  naming the request's field.
- :class:`GrammarCompiler` (the engine): compiles guides against the model's vocabulary on a
  worker thread, at most one compile per distinct guide (a cache keyed by the guide): a request
  waits for its grammar, the batch does not.
- :class:`Matcher` (the forward thread): one per constrained request; it fills the request's row
  of the step's token bitmask before sampling and accepts the sampled token after. It is created
  from the request's output so far, so a request that arrives with tokens (a decode instance)
  or is planned again after preemption (which keeps its output) resumes where it stood.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from afd_engine.errors import InvalidRequestError


def _xgr():
    """xgrammar, imported on first use (it takes a while to import; most processes never need it)."""
    import xgrammar

    return xgrammar


def build_grammar(kind: str, spec: str):
    """The tokenizer-free grammar of a guide; raises ValueError/RuntimeError from xgrammar."""
    xgr = _xgr()
    if kind == "json_object":  # any JSON object (OpenAI's json_object), laid out as json.dumps does
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec)
    raise ValueError(f"unknown guide kind {kind!r}")


def check_guide(kind: str, spec: str, param: str) -> None:
    """Raises InvalidRequestError naming `param` unless the guide builds into a grammar."""
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param}: the schema is not valid JSON ({exc})", param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object", param)
    try:
        build_grammar(kind, spec)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own errors
        what = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}.get(kind, kind)
        raise InvalidRequestError(f"{param}: invalid or unsupported {what}: {_first_line(exc)}", param) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


class GrammarCompiler:
    """Compiles guides against one model's vocabulary on a worker thread, each distinct guide once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._info = None
        self._tokenizer, self._stop = tokenizer, sorted(stop_token_ids)
        self._cache: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self.compiles = 0  # distinct guides compiled (cache misses)
        self.compile_seconds = 0.0

    def _compiler(self):
        if self._info is None:  # built on first use: engines that never see a guide pay nothing
            xgr = _xgr()
            self._info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop
            )
            self._xgr = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return self._xgr

    def submit(self, guide: tuple[str, str]) -> Future:
        """A future of the compiled grammar (done at once when the guide was compiled before)."""
        key = (guide[0], guide[1])
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                future = self._cache[key] = self._worker.submit(self._compile, key)
        return future

    def _compile(self, key: tuple[str, str]):
        start = time.perf_counter()
        compiler = self._compiler()
        kind, spec = key
        compiled = compiler.compile_grammar(build_grammar(kind, spec))
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """The grammar state of one constrained request (used by the forward thread only)."""

    __slots__ = ("_matcher", "ended")

    def __init__(self, compiled, output_ids: list[int]) -> None:
        self._matcher = _xgr().GrammarMatcher(compiled)
        self.ended = False
        for token in output_ids:  # resume: the tokens it already has
            self.accept(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.ended:  # a token computed after the end is dropped: any value will do
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def advance_drafts(self, drafts: list[int], bitmask: torch.Tensor, rows: list[int]) -> int:
        """Speculative decoding: advances past the drafts while the grammar takes them, filling
        bitmask row rows[j] with the next-token mask after drafts[: j + 1]; stops before a draft it
        refuses or one that would end the grammar. Returns how many it advanced past (`rollback`
        undoes them)."""
        taken = 0
        if self.ended:
            return 0
        for token, row in zip(drafts, rows):
            if not self._matcher.accept_token(token):
                break
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                break
            taken += 1
            self._matcher.fill_next_token_bitmask(bitmask, row)
        return taken

    def rollback(self, tokens: int) -> None:
        if tokens:
            self._matcher.rollback(tokens)

    def accept(self, token: int) -> bool:
        """Advances past `token`; True when the output is complete (a stop token ended the grammar)
        or the token was refused (which the bitmask rules out; the request then ends)."""
        if self.ended:
            return True
        if not self._matcher.accept_token(token) or self._matcher.is_terminated():
            self.ended = True
        return self.ended


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, every token the bitmask forbids in the given rows of `logits`."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)

"""Control-plane messages between the API server and the engine process (ZeroMQ frames).

front end -> engine (JSON, once per request): AddRequest, AbortRequest, Shutdown, Wake, DumpExpertLoad
engine -> front end (msgpack, every step): StepOutput (token updates of one step, and engine
stats), Rejected, ExpertLoadReport (one per attention rank, answering DumpExpertLoad)

Each message is a frozen dataclass; `encode`/`decode` (to the engine) and `encode_output` /
`decode_output` (from it) are the only ways on and off the wire. A step's updates travel as
positional arrays in one msgpack frame, with no per-update dict: the engine encodes 256 updates
in well under a millisecond (JSON with `dataclasses.asdict` took ~2 ms).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass, field

import msgpack

from afd_engine.errors import InvalidRequestError
from afd_engine.runtime.request import TokenLogprob, TokenUpdate
from afd_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    disaggregation: dict | None = None  # {"room": R[, "bootstrap": "HOST:PORT"]} on a prefill/decode instance


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Wake:
    """Broadcast after a request went to one rank of several: idle ranks join the next agreement
    round at once instead of at their next idle check."""


@dataclass(frozen=True)
class DumpExpertLoad:
    token: str  # echoed by every rank's report


@dataclass(frozen=True)
class ExpertLoadReport:
    token: str
    rank: int
    report: dict  # eplb.report.rank_report


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    cache_pages: int = 0  # pages held by the prefix cache (a part of kv_pages_used)
    cache_hit_tokens: int = 0  # since start: prompt tokens served from the prefix cache
    prompt_tokens: int = 0  # since start: prompt tokens of admitted requests
    cache_evicted_pages: int = 0  # since start
    expert_rank_load: tuple[float, ...] = ()  # tokens per expert rank over the load window
    kv_pages_reserved: int = 0  # decode instance: pages held for requests whose KV is on its way
    kv_transfer_bytes: int = 0  # since start: KV bytes sent (prefill) or received (decode)
    kv_transfer_seconds: float = 0.0  # since start: time the prefill side spent sending them
    ffn_ranks_alive: int = 0  # AFD: the FFN ranks serving (fewer after a recovery from a lost one)
    ffn_recoveries: int = 0  # AFD, since start: recoveries from lost FFN ranks
    ffn_experts_read: int = 0  # AFD, since start: experts those recoveries read from the checkpoint

    @staticmethod
    def total(stats) -> EngineStats:
        """Field by field sum (the deployment's counters over its attention ranks; per-rank
        lists element by element)."""
        stats = list(stats)
        out = {}
        for f in dataclasses.fields(EngineStats):
            values = [getattr(s, f.name) for s in stats]
            if f.name == "expert_rank_load":
                values = [v for v in values if v]
                out[f.name] = tuple(map(sum, zip(*values))) if values else ()
            elif f.name.startswith("ffn_"):  # the deployment's, which every attention rank knows
                out[f.name] = min(values, default=0) if f.name == "ffn_ranks_alive" else max(values, default=0)
            else:
                out[f.name] = sum(values)
        return EngineStats(**out)


@dataclass(frozen=True)
class StepOutput:
    updates: list[TokenUpdate] = field(default_factory=list)
    stats: EngineStats = EngineStats()
    rank: int = 0  # the attention rank that sent it


@dataclass(frozen=True)
class Rejected:
    rid: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class RankFailed:
    """A rank's last words: why it stops (the front end's errors repeat them)."""

    rank: int
    message: str


@dataclass(frozen=True)
class InvalidAddRequest:
    """What `decode` makes of an AddRequest whose parameters are invalid (never on the wire): the
    engine answers it with Rejected instead of failing on it."""

    rid: str
    message: str
    param: str | None = None


_TYPES = {t.__name__: t for t in (AddRequest, AbortRequest, Shutdown, Wake, DumpExpertLoad)}


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def encode(msg) -> bytes:
    """A message to the engine (JSON). An AddRequest's fields are read as they are: its sampling
    parameters hold plain values only, and `asdict`'s deep copy cost the front end about 0.3 ms
    a request."""
    if isinstance(msg, AddRequest):
        params = {name: getattr(msg.params, name) for name in _PARAM_FIELDS}
        body = {"rid": msg.rid, "prompt_ids": msg.prompt_ids, "params": params}
        if msg.disaggregation is not None:
            body["disaggregation"] = msg.disaggregation
    else:
        body = dataclasses.asdict(msg)
    return json.dumps({"type": type(msg).__name__, "body": body}).encode()


def decode(data: bytes):
    raw = json.loads(data)
    kind, body = raw["type"], raw["body"]
    if kind == "AddRequest":
        try:
            params = SamplingParams(**body["params"])
            return AddRequest(body["rid"], body["prompt_ids"], params, body.get("disaggregation"))
        except (InvalidRequestError, TypeError) as exc:  # TypeError: an unknown sampling field
            return InvalidAddRequest(body["rid"], str(exc), getattr(exc, "param", None))
    return _TYPES[kind](**body)


# -- engine -> front end: msgpack ------------------------------------------------------------

_UPDATE_FIELDS = tuple(f.name for f in dataclasses.fields(TokenUpdate))
_LOGPROBS, _PROMPT_LOGPROBS = _UPDATE_FIELDS.index("logprobs"), _UPDATE_FIELDS.index("prompt_logprobs")
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))
_UPDATE_ROW = operator.attrgetter(*_UPDATE_FIELDS)


def encode_output(msg) -> bytes:
    """StepOutput, Rejected, ExpertLoadReport or RankFailed as one msgpack frame."""
    if isinstance(msg, StepOutput):
        stats = [getattr(msg.stats, n) for n in _STATS_FIELDS]
        return msgpack.packb(["StepOutput", msg.rank, stats, [_update_row(u) for u in msg.updates]])
    if isinstance(msg, Rejected):
        return msgpack.packb(["Rejected", msg.rid, msg.message, msg.param])
    if isinstance(msg, ExpertLoadReport):
        return msgpack.packb(["ExpertLoadReport", msg.token, msg.rank, msg.report])
    if isinstance(msg, RankFailed):
        return msgpack.packb(["RankFailed", msg.rank, msg.message])
    raise TypeError(f"{type(msg).__name__} does not travel from the engine")


def decode_output(data: bytes):
    kind, *body = msgpack.unpackb(data)
    if kind == "StepOutput":
        rank, stats, rows = body
        stats = dict(zip(_STATS_FIELDS, stats))
        stats["expert_rank_load"] = tuple(stats["expert_rank_load"])
        return StepOutput([_update_of(row) for row in rows], EngineStats(**stats), rank)
    if kind == "Rejected":
        return Rejected(*body)
    if kind == "ExpertLoadReport":
        return ExpertLoadReport(*body)
    if kind == "RankFailed":
        return RankFailed(*body)
    raise ValueError(f"unknown engine output {kind!r}")


def _update_row(u: TokenUpdate) -> tuple | list:
    """A TokenUpdate as a sequence in field order; token logprobs as [logprob, top_ids, top_logprobs].
    (Most updates carry no logprobs: their fields are read in one C call, a quarter of the time of a
    getattr per field, which at hundreds of updates per step matters.)"""
    row = _UPDATE_ROW(u)
    if u.logprobs is None and u.prompt_logprobs is None:
        return row
    row = list(row)
    if u.logprobs is not None:
        row[_LOGPROBS] = [(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in u.logprobs]
    if u.prompt_logprobs is not None:
        row[_PROMPT_LOGPROBS] = [
            None if lp is None else (lp.logprob, lp.top_ids, lp.top_logprobs) for lp in u.prompt_logprobs
        ]
    return row


def _update_of(row: list) -> TokenUpdate:
    if row[_LOGPROBS] is not None:
        row[_LOGPROBS] = [TokenLogprob(*lp) for lp in row[_LOGPROBS]]
    if row[_PROMPT_LOGPROBS] is not None:
        row[_PROMPT_LOGPROBS] = [None if lp is None else TokenLogprob(*lp) for lp in row[_PROMPT_LOGPROBS]]
    return TokenUpdate(*row)

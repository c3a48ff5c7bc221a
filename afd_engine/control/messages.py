"""Control-plane messages between the API server and the engine process (ZeroMQ, JSON frames).

front end -> engine: AddRequest, AbortRequest, Shutdown, DumpExpertLoad
engine -> front end: StepOutput (token updates of one step, and engine stats), Rejected,
ExpertLoadReport (one per attention rank, answering DumpExpertLoad)
Each message is a frozen dataclass; `encode`/`decode` are the only way on and off the wire.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from afd_engine.errors import InvalidRequestError
from afd_engine.runtime.request import TokenLogprob, TokenUpdate
from afd_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class Shutdown:
    pass


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
class InvalidAddRequest:
    """What `decode` makes of an AddRequest whose parameters are invalid (never on the wire): the
    engine answers it with Rejected instead of failing on it."""

    rid: str
    message: str
    param: str | None = None


_TYPES = {
    t.__name__: t for t in (AddRequest, AbortRequest, Shutdown, StepOutput, Rejected, DumpExpertLoad, ExpertLoadReport)
}


def encode(msg) -> bytes:
    return json.dumps({"type": type(msg).__name__, "body": dataclasses.asdict(msg)}).encode()


def decode(data: bytes):
    raw = json.loads(data)
    kind, body = raw["type"], raw["body"]
    if kind == "AddRequest":
        try:
            return AddRequest(body["rid"], body["prompt_ids"], SamplingParams(**body["params"]))
        except (InvalidRequestError, TypeError) as exc:  # TypeError: an unknown sampling field
            return InvalidAddRequest(body["rid"], str(exc), getattr(exc, "param", None))
    if kind == "StepOutput":
        stats = EngineStats(**{**body["stats"], "expert_rank_load": tuple(body["stats"]["expert_rank_load"])})
        return StepOutput([_update(u) for u in body["updates"]], stats, body["rank"])
    return _TYPES[kind](**body)


def _update(u: dict) -> TokenUpdate:
    logprobs = None if u["logprobs"] is None else [TokenLogprob(**lp) for lp in u["logprobs"]]
    prompt = u.get("prompt_logprobs")
    prompt = None if prompt is None else [None if lp is None else TokenLogprob(**lp) for lp in prompt]
    return TokenUpdate(**{**u, "logprobs": logprobs, "prompt_logprobs": prompt})

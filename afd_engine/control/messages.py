"""Control-plane messages between the API server and the engine process (ZeroMQ frames).

front end -> engine (once per request): AddRequest, AbortRequest, Shutdown, Wake, DumpExpertLoad,
AdmitRank (fault tolerance: a replacement attention rank is up)
engine -> front end (every step): StepOutput (token updates of one step, and engine stats),
Rejected, ExpertLoadReport (one per attention rank, answering DumpExpertLoad), RankFailed

Each message is a frozen msgspec struct; `encode`/`decode` (to the engine) and `encode_output` /
`decode_output` (from it) are the only ways on and off the wire. Every frame is msgpack: the
struct as a positional array whose first element names its class, which is how the decoders pick
the type. A step's updates travel as positional arrays too, with no per-update map.
"""

from __future__ import annotations

import operator
from typing import Any

import msgspec

from afd_engine.errors import InvalidRequestError
from afd_engine.runtime.request import TokenLogprob, TokenUpdate
from afd_engine.sampling_params import SamplingParams


class _Message(msgspec.Struct, array_like=True, frozen=True, tag=True):
    """A message on the wire: ``[class name, field, field, ...]``."""


class AddRequest(_Message):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # travels as a map of its fields (see _AddRequestFrame)
    disaggregation: dict | None = None  # {"room": R[, "bootstrap": "HOST:PORT"]} on a prefill/decode instance


class AbortRequest(_Message):
    rid: str


class Shutdown(_Message):
    pass


class Wake(_Message):
    """Broadcast after a request went to one rank of several: idle ranks join the next agreement
    round at once instead of at their next idle check."""


class DumpExpertLoad(_Message):
    token: str  # echoed by every rank's report


class AdmitRank(_Message):
    """Broadcast once a replacement of a lost attention rank is up: the others admit it (its
    process: `incarnation`, reached at `address` / on `host` as the transports name them)."""

    rank: int
    incarnation: int
    address: str
    host: str


class ExpertLoadReport(_Message):
    token: str
    rank: int
    report: dict  # eplb.report.rank_report


class EngineStats(msgspec.Struct, array_like=True, frozen=True):
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
    static_decode_batches: int = 0  # since start: decode (micro-)batches run on graph buffers (Engine)
    # speculative decoding, since start: verifications of drafting requests, drafts they proposed and
    # accepted, and per accepted count (the index) how many verifications accepted it
    spec_verifies: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_accepted_histogram: tuple[int, ...] = ()
    # since start: experts (per layer) that expert ranks loaded for recoveries, admissions and
    # rebalances, copied from a live peer or read from the checkpoint (eplb/peer_copy.py)
    experts_loaded_peer: int = 0
    experts_loaded_checkpoint: int = 0

    @staticmethod
    def total(stats) -> EngineStats:
        """Field by field sum (the deployment's counters over its attention ranks; per-rank
        lists element by element)."""
        stats = list(stats)
        out = {}
        for name in EngineStats.__struct_fields__:
            values = [getattr(s, name) for s in stats]
            if name in ("expert_rank_load", "spec_accepted_histogram"):
                values = [v for v in values if v]
                out[name] = tuple(map(sum, zip(*values))) if values else ()
            elif name.startswith("ffn_"):  # the deployment's, which every attention rank knows
                out[name] = min(values, default=0) if name == "ffn_ranks_alive" else max(values, default=0)
            else:
                out[name] = sum(values)
        return EngineStats(**out)


class StepOutput(_Message):
    updates: list[TokenUpdate] = []  # travels as rows (see _StepFrame)
    stats: EngineStats = EngineStats()
    rank: int = 0  # the attention rank that sent it


class Rejected(_Message):
    rid: str
    message: str
    param: str | None = None


class RankFailed(_Message):
    """A rank's last words: why it stops (the front end's errors repeat them)."""

    rank: int
    message: str


class InvalidAddRequest(msgspec.Struct, frozen=True):
    """What `decode` makes of an AddRequest whose parameters are invalid (never on the wire): the
    engine answers it with Rejected instead of failing on it."""

    rid: str
    message: str
    param: str | None = None


# -- front end -> engine ---------------------------------------------------------------------


class _AddRequestFrame(_Message, tag="AddRequest"):
    """An AddRequest as the engine reads it. Its sampling parameters stay a plain map until
    SamplingParams has checked them, so that an invalid (or unknown) one rejects this request
    alone, by its id, rather than failing the frame."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    disaggregation: dict | None = None

    def checked(self) -> AddRequest | InvalidAddRequest:
        try:
            params = SamplingParams(**self.params)
        except (InvalidRequestError, TypeError) as exc:  # TypeError: an unknown sampling field
            return InvalidAddRequest(self.rid, str(exc), getattr(exc, "param", None))
        return AddRequest(self.rid, self.prompt_ids, params, self.disaggregation)


def _plain(obj):
    """Subclasses of int, float and str (numpy's float64 is one) as their plain value, which is
    how msgpack writes them; msgspec leaves them to this hook."""
    for kind in (int, float, str):
        if isinstance(obj, kind):
            return kind(obj)
    raise TypeError(f"{type(obj).__name__} cannot go on the control plane")


_TO_ENGINE = (AddRequest, AbortRequest, Shutdown, Wake, DumpExpertLoad, AdmitRank)
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)
_REQUEST_DECODER = msgspec.msgpack.Decoder(
    _AddRequestFrame | AbortRequest | Shutdown | Wake | DumpExpertLoad | AdmitRank
)


def encode(msg) -> bytes:
    """A message to the engine. An AddRequest's SamplingParams (a dataclass) goes as a map of its
    fields."""
    if not isinstance(msg, _TO_ENGINE):
        raise TypeError(f"{type(msg).__name__} does not travel to the engine")
    return _ENCODER.encode(msg)


def decode(data: bytes):
    """The message `encode` made; an AddRequest the engine cannot take (invalid sampling
    parameters, or fields of the wrong type) as InvalidAddRequest. Raises on any other frame."""
    try:
        msg = _REQUEST_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        return _malformed_add_request(data, exc)
    return msg.checked() if isinstance(msg, _AddRequestFrame) else msg


def _malformed_add_request(data: bytes, exc: msgspec.ValidationError) -> InvalidAddRequest:
    """A typed AddRequest frame with a field of the wrong type still names its request: answer it."""
    raw = msgspec.msgpack.decode(data)
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "AddRequest" and isinstance(raw[1], str):
        return InvalidAddRequest(raw[1], f"malformed request: {exc}")
    raise exc


# -- engine -> front end ---------------------------------------------------------------------


class _LogprobRow(msgspec.Struct, array_like=True, frozen=True):
    """TokenLogprob on the wire."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class _UpdateRow(msgspec.Struct, array_like=True):
    """TokenUpdate on the wire, its fields in TokenUpdate's order. (TokenUpdate is a dataclass,
    which msgspec would write as a map: a row is a fraction of its size and time.)"""

    request_id: str
    token_ids: list[int]
    logprobs: list[_LogprobRow] | None
    finish_reason: str | None
    error: str | None
    text_trim: int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[_LogprobRow | None] | None
    timeline: dict | None


class _StepFrame(_Message, tag="StepOutput"):
    """StepOutput on the wire. Encoding fills `updates` with plain tuples in _UpdateRow's layout,
    which msgpack writes exactly as it writes the struct."""

    rank: int
    stats: EngineStats
    updates: list[_UpdateRow]


_UPDATE_ROW = operator.attrgetter(*_UpdateRow.__struct_fields__)
_LOGPROBS = _UpdateRow.__struct_fields__.index("logprobs")
_PROMPT_LOGPROBS = _UpdateRow.__struct_fields__.index("prompt_logprobs")
_OUTPUT_DECODER = msgspec.msgpack.Decoder(_StepFrame | Rejected | ExpertLoadReport | RankFailed)


def encode_output(msg) -> bytes:
    """StepOutput, Rejected, ExpertLoadReport or RankFailed as one msgpack frame."""
    if isinstance(msg, StepOutput):
        return _ENCODER.encode(_StepFrame(msg.rank, msg.stats, [_update_row(u) for u in msg.updates]))
    if isinstance(msg, (Rejected, ExpertLoadReport, RankFailed)):
        return _ENCODER.encode(msg)
    raise TypeError(f"{type(msg).__name__} does not travel from the engine")


def decode_output(data: bytes):
    try:
        msg = _OUTPUT_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise ValueError(f"unknown engine output, or a malformed one: {exc}") from exc
    if isinstance(msg, _StepFrame):
        return StepOutput([_update_of(row) for row in msg.updates], msg.stats, msg.rank)
    return msg


def _update_row(u: TokenUpdate) -> tuple | list:
    """A TokenUpdate as a tuple in field order; token logprobs as (logprob, top_ids, top_logprobs).
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


def _update_of(row: _UpdateRow) -> TokenUpdate:
    update = TokenUpdate(*msgspec.structs.astuple(row))
    if row.logprobs is not None:
        update.logprobs = [TokenLogprob(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in row.logprobs]
    if row.prompt_logprobs is not None:
        update.prompt_logprobs = [
            None if lp is None else TokenLogprob(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in row.prompt_logprobs
        ]
    return update

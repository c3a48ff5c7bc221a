"""Request traces for the cluster simulator (`afd plan simulate`): a Mooncake-format file, or a
synthetic Poisson stream.

A trace is a list of `TraceRequest` records (arrival time, prompt and output lengths, the ids of the
prompt's prefix blocks) and the number of tokens one block id stands for. Two requests whose block
ids agree up to position i share the first i + 1 blocks of their prompts, so the KV of those blocks
can be reused (Mooncake's `hash_ids`: 512-token blocks, ids chained over the prefix).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from afd_engine.errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512

# ShareGPT-like lengths, an approximation: log-normal prompt and output lengths whose means are
# near the figures usually quoted for the ShareGPT conversations (about 161 prompt tokens and 338
# output tokens per request in the vLLM paper's workload table), with a spread (sigma of the
# underlying normal) chosen by hand to give long right tails. Not fitted to the data set itself.
SHAREGPT_MEAN_IN, SHAREGPT_SIGMA_IN = 161.0, 1.0
SHAREGPT_MEAN_OUT, SHAREGPT_SIGMA_OUT = 338.0, 0.9
SHAREGPT_MAX_IN, SHAREGPT_MAX_OUT = 4096, 2048


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: when it arrives, how long its prompt and answer are, and its prefix blocks."""

    arrival_s: float
    input_len: int
    output_len: int
    blocks: tuple[int, ...] = ()  # prefix block ids, one per `Trace.block_tokens` tokens of prompt


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order, the tokens each block id covers, and where they came from."""

    requests: list[TraceRequest]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    source: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ConfigError(f"trace block size must be >= 1 token (got {self.block_tokens})")
        arrivals = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in zip(arrivals, arrivals[1:])):
            raise ConfigError(f"trace {self.source or ''}: requests must be in arrival order")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        """Time from the first arrival to the last."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests per second (0 for fewer than two requests)."""
        span = self.span_s
        return (len(self.requests) - 1) / span if span > 0 else 0.0

    def scaled(self, rate_scale: float = 1.0) -> Trace:
        """The same requests arriving `rate_scale` times as fast (arrival times divided by it)."""
        check_scale(rate_scale, "--rate-scale")
        if rate_scale == 1.0:
            return self
        reqs = [replace(r, arrival_s=r.arrival_s / rate_scale) for r in self.requests]
        meta = {**self.meta, "rate_scale": self.meta.get("rate_scale", 1.0) * rate_scale}
        return Trace(reqs, self.block_tokens, self.source, meta)

    def summary(self) -> dict:
        """Counts and means, for reports."""
        n = len(self.requests)
        return {
            "source": self.source,
            "requests": n,
            "span_s": self.span_s,
            "rate_rps": self.rate,
            "mean_input": sum(r.input_len for r in self.requests) / n if n else 0.0,
            "mean_output": sum(r.output_len for r in self.requests) / n if n else 0.0,
            "block_tokens": self.block_tokens,
            **self.meta,
        }


def check_scale(value: float, flag: str) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a positive number (got {value!r})")
    return float(value)


def scale_length(n: int, length_scale: float) -> int:
    """A length multiplied by `length_scale`, rounded half up, and never below one token."""
    return max(1, math.floor(n * length_scale + 0.5))


def load_mooncake(
    path: str | Path,
    rate_scale: float = 1.0,
    length_scale: float = 1.0,
    limit: int | None = None,
    output_scale: float | None = None,
) -> Trace:
    """Reads a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    `hash_ids`). Arrival times are divided by `rate_scale` and measured from the first request;
    lengths are multiplied by `length_scale` (at least one token each), and so is the block size
    (at least one token), so block ids still cover the same share of each prompt. `output_scale`,
    when given, scales the output lengths instead (a replay that keeps more decode per prompt)."""
    check_scale(rate_scale, "--rate-scale")
    check_scale(length_scale, "--length-scale")
    out_scale = length_scale if output_scale is None else output_scale
    check_scale(out_scale, "--output-scale")
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--trace {path}: no such file") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--trace {path}: not a readable JSONL file ({exc})") from None
    reqs: list[TraceRequest] = []
    t0: float | None = None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(reqs) >= limit:
            break
        try:
            rec = json.loads(line)
            ts, n_in, n_out = float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"])
            blocks = tuple(int(h) for h in rec.get("hash_ids", ()))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"--trace {path}:{no}: expected JSON with timestamp, input_length, output_length (and hash_ids): {exc}"
            ) from None
        if n_in < 1 or n_out < 1 or ts < 0:
            raise ConfigError(f"--trace {path}:{no}: lengths must be >= 1 and the timestamp >= 0")
        t0 = ts if t0 is None else t0
        arrival = (ts - t0) / 1e3 / rate_scale
        reqs.append(TraceRequest(arrival, scale_length(n_in, length_scale), scale_length(n_out, out_scale), blocks))
    if not reqs:
        raise ConfigError(f"--trace {path}: no requests in the file")
    reqs.sort(key=lambda r: r.arrival_s)  # (stable: equal timestamps keep file order)
    meta = {"rate_scale": rate_scale, "length_scale": length_scale}
    if output_scale is not None:
        meta["output_scale"] = output_scale
    return Trace(reqs, scale_length(MOONCAKE_BLOCK_TOKENS, length_scale), str(path), meta)


def parse_lengths(spec: str) -> tuple[str, int, int]:
    """`fixed:IN,OUT` or `sharegpt` -> (kind, IN, OUT) (zeros for sharegpt)."""
    if spec == "sharegpt":
        return "sharegpt", 0, 0
    if spec.startswith("fixed:"):
        parts = spec[len("fixed:") :].split(",")
        try:
            n_in, n_out = (int(p) for p in parts)
        except ValueError:
            n_in = n_out = 0
        if len(parts) == 2 and n_in >= 1 and n_out >= 1:
            return "fixed", n_in, n_out
    raise ConfigError(f"--lengths {spec!r}: use fixed:IN,OUT (two positive integers) or sharegpt")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, cap: int) -> np.ndarray:
    """n log-normal integers with the given mean (before clipping to [1, cap])."""
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)


def poisson(
    rate: float,
    duration_s: float,
    seed: int = 0,
    lengths: str = "sharegpt",
    length_scale: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """A Poisson stream of `rate` requests per second over `duration_s` seconds. Lengths are
    `fixed:IN,OUT` or `sharegpt` (log-normal, see SHAREGPT_* above). No two requests share a
    prefix: every block id is unique."""
    check_scale(rate, "--poisson")
    check_scale(duration_s, "--duration")
    check_scale(length_scale, "--length-scale")
    kind, n_in, n_out = parse_lengths(lengths)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, int(rate * duration_s * 1.5) + 16)
    arrivals = np.cumsum(gaps)
    while arrivals[-1] < duration_s:  # (rare: draw more)
        arrivals = np.concatenate([arrivals, arrivals[-1] + np.cumsum(rng.exponential(1.0 / rate, len(gaps)))])
    arrivals = arrivals[arrivals < duration_s]
    n = len(arrivals)
    if kind == "fixed":
        ins, outs = np.full(n, n_in), np.full(n, n_out)
    else:
        ins = _lognormal(rng, SHAREGPT_MEAN_IN, SHAREGPT_SIGMA_IN, n, SHAREGPT_MAX_IN)
        outs = _lognormal(rng, SHAREGPT_MEAN_OUT, SHAREGPT_SIGMA_OUT, n, SHAREGPT_MAX_OUT)
    ins = np.maximum(1, np.floor(ins * length_scale + 0.5)).astype(np.int64)
    outs = np.maximum(1, np.floor(outs * length_scale + 0.5)).astype(np.int64)
    reqs, next_id = [], 0
    for t, a, b in zip(arrivals.tolist(), ins.tolist(), outs.tolist()):
        nb = -(-a // block_tokens)
        reqs.append(TraceRequest(t, a, b, tuple(range(next_id, next_id + nb))))
        next_id += nb
    meta = {"rate": rate, "duration_s": duration_s, "seed": seed, "lengths": lengths, "length_scale": length_scale}
    return Trace(reqs, block_tokens, f"poisson({rate:g}/s, {duration_s:g} s, {lengths})", meta)


def from_records(records: Sequence[tuple], block_tokens: int = MOONCAKE_BLOCK_TOKENS, source: str = "") -> Trace:
    """A trace from (arrival_s, input_len, output_len[, blocks]) tuples (tests, scripts)."""
    reqs = [TraceRequest(float(r[0]), int(r[1]), int(r[2]), tuple(r[3]) if len(r) > 3 else ()) for r in records]
    return Trace(reqs, block_tokens, source)

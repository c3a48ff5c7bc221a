"""The load of every scenario and what its streams show.

Clients stream greedy requests (native `/generate`, `ignore_eos`) from a fixed set of prompts; each
request is kept as a Result: (prompt index, start, token times, token ids, error or None). From
those: the longest gap between two tokens of a stream (a request's wait for its first token
counts), the failed requests (a non-200 answer, an error event, or a stream that ended short),
whether every request of a prompt produced the same tokens, and how long the streams in flight at
a fault took to get their next token.
"""

from __future__ import annotations

import bisect
import json
import random
import time
from collections.abc import Callable

import httpx

from benchmarks.bench_serving import sse_data

Result = tuple[int, float, list[float], list[int], str | None]


def make_prompts(n: int) -> list[list[int]]:
    """`n` prompts of 4 to 23 token ids, the same on every run."""
    rng = random.Random(0)
    return [[rng.randrange(10, 400) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


def http_client(base: str, **options) -> httpx.AsyncClient:
    """A client of `base` with no limit on connections (every stream holds one) and no proxy."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300), limits=limits, trust_env=False, **options)


async def metric(client: httpx.AsyncClient, name: str) -> float | None:
    """The sample of `name` (labels included, as the server writes them) on /metrics; None if absent."""
    for line in (await client.get("/metrics")).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return None


async def stream_one(
    client: httpx.AsyncClient, index: int, prompt: list[int], output_len: int, progress: list[int] | None = None
) -> Result:
    """One greedy stream of `output_len` tokens; `progress[index]` follows its token count."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }
    start, times, ids, error = time.perf_counter(), [], [], None
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for data in sse_data(r):
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"error event: {chunk['error']}"
                        break
                    new = chunk.get("output_ids") or []
                    times += [time.perf_counter()] * len(new)
                    ids += new
                    if progress is not None:
                        progress[index] = len(ids)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and len(ids) != output_len:
        error = f"ended after {len(ids)} of {output_len} tokens"
    return index, start, times, ids, error


async def stream_client(client, prompts, c: int, until: Callable[[], float], output_len: int, results: list) -> None:
    """Client `c`: requests of prompts drawn at random, back to back until the time `until()` says."""
    rng = random.Random(c)
    while time.perf_counter() < until():
        i = rng.randrange(len(prompts))
        results.append(await stream_one(client, i, prompts[i], output_len))


def gaps(results: list[Result]) -> list[tuple[float, float]]:
    """(gap, when it started) between consecutive tokens of each stream, and from each request's
    start to its first token: a request that starts while serving pauses waits too."""
    out = [(b - a, a) for _, _, times, _, _ in results for a, b in zip(times, times[1:])]
    return out + [(times[0] - start, start) for _, start, times, _, _ in results if times]


def failures(results: list[Result]) -> list[str]:
    return [error for *_, error in results if error is not None]


def consistent(results: list[Result]) -> bool:
    """Whether every request of a prompt that completed produced the same tokens (greedy: it must)."""
    outputs: dict[int, set] = {}
    for i, _, _, ids, error in results:
        if error is None:
            outputs.setdefault(i, set()).add(tuple(ids))
    return all(len(v) == 1 for v in outputs.values())


def rate(results: list[Result], a: float, b: float) -> float | None:
    """Output tokens per second of all streams together from `a` to `b`."""
    if b <= a:
        return None
    return round(sum(bisect.bisect_left(t, b) - bisect.bisect_left(t, a) for _, _, t, _, _ in results) / (b - a), 1)


def resumption(results: list[Result], fault: float) -> tuple[int, float | None]:
    """(streams in flight at `fault`, seconds from it until the last of them had its next token).
    In flight: started before it and not yet holding all its tokens. One that had no token after it
    (it failed) is left out of the time; None when none had one."""
    waits, in_flight = [], 0
    for _, start, times, _, error in results:
        done = error is None and times and times[-1] <= fault
        if start >= fault or done:
            continue
        in_flight += 1
        k = bisect.bisect_right(times, fault)
        if k < len(times):
            waits.append(times[k] - fault)
    return in_flight, round(max(waits), 3) if waits else None


def stream_figures(results: list[Result], fault: float, name: str) -> dict:
    """The figures every scenario reports about its streams, around the fault at `fault` (`name`:
    "kill" or "signal", in the keys)."""
    longest, at = max(gaps(results), default=(0.0, fault))
    failed = failures(results)
    in_flight, resume = resumption(results, fault)
    return {
        "requests": len(results),
        "requests_failed": len(failed),
        "failures": failed[:10],
        "longest_token_gap_s": round(longest, 3),
        f"longest_gap_starts_after_{name}_s": round(at - fault, 3),
        f"streams_in_flight_at_{name}": in_flight,
        "time_to_resume_s": resume,
        "greedy_outputs_consistent": consistent(results),
    }


def format_streams(r: dict, name: str, event: str) -> list[str]:
    """stream_figures' lines (`name` as given to it; `event` names the fault in the text)."""
    resume = r["time_to_resume_s"]
    return [
        f"requests: {r['requests']}, failed: {r['requests_failed']}" + "".join(f"\n  {f}" for f in r["failures"][:3]),
        f"longest gap between tokens: {r['longest_token_gap_s']:.2f} s "
        f"(starts {r[f'longest_gap_starts_after_{name}_s']:+.2f} s from {event})",
        f"time to resume: {resume:.2f} s from {event} until the last of the {r[f'streams_in_flight_at_{name}']} "
        "streams in flight had its next token"
        if resume is not None
        else f"time to resume: - (no stream in flight at {event} had a token after it)",
        f"greedy outputs consistent: {r['greedy_outputs_consistent']}",
    ]

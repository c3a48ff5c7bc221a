#!/usr/bin/env python
"""Online serving benchmark: a load generator for a running server's HTTP API.

It follows the conventions (flag and metric names) of SGLang's ``bench_serving`` so that numbers
can be compared side by side, but is written for this engine: every request streams, uses
temperature 0 and ``ignore_eos`` so the server generates exactly the requested number of tokens.

Backends:
  * ``chat``: ``POST /v1/chat/completions`` (one user message; the prefix datasets below send a
    system message and, for multi-turn, the conversation so far);
  * ``completions``: ``POST /v1/completions`` (text or a token-id list prompt);
  * ``native``: ``POST /generate`` with ``input_ids`` (or ``text``), streamed SSE.

Datasets (nothing is downloaded):
  * ``random-ids``: random token ids (never the special ids 0..4). Chat cannot send token ids
    without a tokenizer, so chat gets random words instead;
  * ``random``: random English words (lengths are in words; the server tokenizes them);
  * ``sharegpt``: the first human turn of each conversation of a local ShareGPT JSON file,
    with the following gpt reply's word count as output length (or ``--sharegpt-output-len``);
  * ``generated-shared-prefix``: ``--gsp-num-groups`` random system prompts, each followed by
    ``--gsp-prompts-per-group`` random questions of its own; token ids (chat: words, as a system
    and a user message), shuffled with the seed so that groups interleave;
  * ``multi-turn``: ``--mt-num-conversations`` conversations of ``--mt-num-turns`` turns. A turn's
    prompt is the previous turn's prompt, its output and a new user message (native: the exact
    output ids; chat: an assistant message with the returned text). Conversations run
    concurrently, the turns of one conversation one after another; ``--request-rate`` spaces the
    conversations' first turns. Native and chat only: completions could not resend the output.
  The last two ignore ``--num-prompts``. Their warm-up requests come from another seed, so that
  the warm-up puts none of the measured prefixes into the server's cache.

Per-request measurements (client side, ``time.perf_counter``):
  * TTFT: from sending the request to the first chunk carrying content (chat/completions: a
    non-empty text delta; native: non-empty ``output_ids``);
  * ITL: the gaps between successive content chunks;
  * E2E latency: from sending to the end of the stream;
  * TPOT: (latency - TTFT) / (output tokens - 1), for requests with more than one output token;
  * output tokens: ``usage.completion_tokens`` of the last streamed chunk (chat/completions,
    ``stream_options.include_usage``) or the number of ``output_ids`` received (native);
  * prompt tokens: ``usage.prompt_tokens`` (chat/completions) or ``meta_info.prompt_tokens``
    (native); when the server sends neither, ``len(input_ids)`` or, for a text prompt, the word
    count (flagged as ``input_tokens_estimated``);
  * cached prompt tokens: ``usage.prompt_tokens_details.cached_tokens`` (chat/completions) or
    ``meta_info.cached_tokens`` (native). ``cache_hit_rate`` is cached / prompt tokens over the
    requests that reported it (None when none did).

The ``--output-file`` record also holds ``start_monotonic``, the ``time.monotonic()`` of the
schedule's start (a trace request is due ``arrival_s`` after it), and with ``--output-details``
each request's ``sent_at`` on the same clock, which on one machine is the clock of the server's
``--record-steps`` files.

Run from the repository root against a running ``afd serve``:
``python -m benchmarks.bench_serving --backend completions --num-prompts 64``.
Other scripts can ``await run_benchmark(args)`` (args: a Namespace from ``parse_args`` or a dict
of overrides) and get the metrics dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from benchmarks.lib.datasets import (  # the workloads; re-exported for other scripts
    NUM_SPECIAL_IDS,
    WORDS,  # noqa: F401
    Conversation,
    Request,
    first_turn,
    is_token_ids,
    make_requests,  # noqa: F401
    make_workload,
    next_turn,
    warmup_requests,
)
from benchmarks.lib.results import append_jsonl

MAX_ERRORS_SHOWN = 5

DATASETS = ("random-ids", "random", "sharegpt", "generated-shared-prefix", "multi-turn", "trace")
GSP_FLAGS = ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len")
MT_FLAGS = ("mt_num_conversations", "mt_num_turns", "mt_system_prompt_len", "mt_turn_len", "mt_output_len")


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    p.add_argument("--backend", default="completions", choices=("chat", "completions", "native"))
    p.add_argument("--dataset-name", default="random-ids", choices=DATASETS)
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset-name sharegpt)")
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length of every ShareGPT request (default: the gpt reply's word count)",
    )
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL trace (for --dataset-name trace)")
    p.add_argument("--trace-rate-scale", type=float, default=1.0, help="trace: arrivals this many times as fast")
    p.add_argument("--trace-length-scale", type=float, default=1.0, help="trace: prompt and output lengths times this")
    p.add_argument(
        "--trace-output-scale",
        type=float,
        default=None,
        help="trace: output lengths times this instead of --trace-length-scale",
    )
    p.add_argument("--trace-start", type=float, default=0.0, help="trace: first second replayed (after scaling)")
    p.add_argument("--trace-duration", type=float, default=math.inf, help="trace: seconds replayed (after scaling)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths are uniform in [ratio*len, len]; 1.0 = fixed lengths",
    )
    p.add_argument(
        "--random-vocab-size",
        type=int,
        default=512,
        help="random-ids are drawn from [5, this); 512 is valid for the tiny model and any larger vocab",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s (default inf: all requests at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts and of the arrival times")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests sent before the benchmark")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--output-file", default=None, help="append one JSONL record (metrics and settings)")
    p.add_argument(
        "--output-details",
        action="store_true",
        help="also write per-request TTFTs, ITLs, latencies and errors to --output-file",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    p.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("generated-shared-prefix (groups x prompts per group requests; lengths are fixed)")
    g.add_argument("--gsp-num-groups", type=int, default=8, help="system prompts")
    g.add_argument("--gsp-prompts-per-group", type=int, default=8, help="questions per system prompt")
    g.add_argument("--gsp-system-prompt-len", type=int, default=128)
    g.add_argument("--gsp-question-len", type=int, default=32)
    g.add_argument("--gsp-output-len", type=int, default=32)
    m = p.add_argument_group("multi-turn (conversations x turns requests; lengths are fixed)")
    m.add_argument("--mt-num-conversations", type=int, default=8)
    m.add_argument("--mt-num-turns", type=int, default=4)
    m.add_argument("--mt-system-prompt-len", type=int, default=64, help="0: no system prompt")
    m.add_argument("--mt-turn-len", type=int, default=16, help="length of each new user message")
    m.add_argument("--mt-output-len", type=int, default=32, help="tokens generated per turn")
    return p


def validate_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_prompts", "random_input_len", "random_output_len", *GSP_FLAGS, *MT_FLAGS):
        least = 0 if name == "mt_system_prompt_len" else 1
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in [0, 1]")
    if args.random_vocab_size <= NUM_SPECIAL_IDS:
        p.error(f"--random-vocab-size must be more than {NUM_SPECIAL_IDS}")
    if not args.request_rate > 0:
        p.error("--request-rate must be positive (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.dataset_name == "trace" and not args.trace:
        p.error("--dataset-name trace needs --trace (a Mooncake-format JSONL file)")
    if args.dataset_name == "trace" and args.backend == "chat":
        p.error(
            "--dataset-name trace sends token ids (equal block ids, equal tokens): use --backend completions or native"
        )
    if not (args.trace_rate_scale > 0 and args.trace_length_scale > 0 and args.trace_duration > 0):
        p.error("--trace-rate-scale, --trace-length-scale and --trace-duration must be positive")
    if args.trace_output_scale is not None and not args.trace_output_scale > 0:
        p.error("--trace-output-scale must be positive")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path (a local file; nothing is downloaded)")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.dataset_name == "multi-turn" and args.backend == "completions":
        p.error(
            "--dataset-name multi-turn needs --backend native (resends the exact output ids) or chat "
            "(resends the reply as an assistant message); completions has no way to resend the output"
        )


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    validate_args(p, args)
    return args


def _as_namespace(args: argparse.Namespace | Mapping[str, Any]) -> argparse.Namespace:
    """Callers may pass a dict of overrides; everything else takes the command-line defaults."""
    if isinstance(args, argparse.Namespace):
        return args
    p = build_parser()
    ns = p.parse_args([])
    unknown = set(args) - set(vars(ns))
    if unknown:
        raise ValueError(f"unknown benchmark settings: {sorted(unknown)}")
    for key, value in args.items():
        setattr(ns, key, value)
    validate_args(p, ns)
    return ns


# ---------------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one request measured; times in seconds."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    prompt_tokens_exact: bool = False
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache
    cached_tokens_reported: bool = False
    output_ids: list[int] = field(default_factory=list)  # native
    output_text: str = ""  # chat and completions
    sent_at: float = 0.0  # time.monotonic() as it was sent (the clock of the server's --record-steps)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def build_payload(args: argparse.Namespace, model: str, req: Request) -> tuple[str, dict]:
    """The endpoint path and JSON body of one streamed request."""
    if args.backend == "native":
        key = "text" if isinstance(req.prompt, str) else "input_ids"
        return "/generate", {
            key: req.prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": args.temperature, "ignore_eos": True},
        }
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.backend == "chat":
        messages = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": req.prompt}]
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": req.prompt}


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The payloads of the ``data:`` lines of a server-sent event stream.

    Lines end at LF (and CRLF) only. httpx's ``aiter_lines`` also splits at U+2028, U+0085 and the
    like, which a model's text may hold and JSON carries unescaped: it would cut an event in two."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            if line.startswith("data:"):
                yield line[5:].removesuffix("\r").removeprefix(" ")


def chunk_content(backend: str, chunk: dict) -> str | list[int]:
    """The generated content a chunk carries: token ids (native) or text; empty when none."""
    if backend == "native":
        return list(chunk.get("output_ids") or ())
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if backend == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def record_usage(res: Result, chunk: dict) -> None:
    """Takes the token counts a chunk reports: ``usage`` (chat/completions, the last chunk) or
    ``meta_info`` (native, every event). Either may hold the cached prompt tokens."""
    if chunk.get("usage"):
        usage = chunk["usage"]
        res.output_tokens = usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    elif chunk.get("meta_info"):
        usage = chunk["meta_info"]
        cached = usage.get("cached_tokens")
    else:
        return
    if usage.get("prompt_tokens") is not None:
        res.prompt_tokens, res.prompt_tokens_exact = usage["prompt_tokens"], True
    if cached is not None:
        res.cached_tokens, res.cached_tokens_reported = cached, True


async def send_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, req: Request) -> Result:
    """Streams one request and times it; any failure is recorded in the result, never raised."""
    path, payload = build_payload(args, model, req)
    ids = is_token_ids(req.prompt)
    res = Result(prompt_tokens=len(req.prompt) if ids else req.prompt_len, prompt_tokens_exact=ids)
    res.sent_at = time.monotonic()
    start = time.perf_counter()
    last = None  # time of the previous content chunk
    done = False
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                res.error = f"HTTP {response.status_code}: {text[:500]}"
                return res
            async for data in sse_data(response):
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return res
                content = chunk_content(args.backend, chunk)
                if isinstance(content, list):
                    res.output_ids += content
                    res.output_tokens += len(content)
                else:
                    res.output_text += content
                record_usage(res, chunk)
                if content:
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not done:
        res.error = "the stream ended without [DONE]"
    elif last is None:
        # Every token decoded to nothing (e.g. special tokens): the first "token" the client could
        # see is the end of the stream.
        res.ttft = res.latency
        res.success = True
    else:
        res.success = True
    return res


# ---------------------------------------------------------------------------------------------
# The load
# ---------------------------------------------------------------------------------------------


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: exponential (a Poisson process) at `rate`, or none when inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(rng.exponential(1.0 / rate, size=n))


async def fetch_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_load(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, workload: list[Request] | list[Conversation]
) -> tuple[list[Result], float]:
    """Sends the workload on the arrival schedule, at most --max-concurrency requests at a time.

    A conversation's first turn arrives on the schedule; each later turn is sent as soon as the
    previous one has finished, and after a failed turn the rest count as failed, unsent. Returns
    the results (in workload order, a conversation's turns in order), the benchmark duration:
    from the first request being sent to the last one finishing, and the time.monotonic() of the
    schedule's start (a trace request is due arrival_s after it).
    """
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=sum(_num_requests(w) for w in workload), file=sys.stderr)

    async def one(req: Request) -> Result:
        # The arrival time is fixed by the schedule; the semaphore only delays the send, as a
        # client-side connection limit would.
        if sem is None:
            res = await send_request(client, args, model, req)
        else:
            async with sem:
                res = await send_request(client, args, model, req)
        if bar is not None:
            bar.update(1)
        return res

    async def converse(conv: Conversation) -> list[Result]:
        req = first_turn(conv)
        results = [await one(req)]
        for k, user in enumerate(conv.user_turns[1:], start=1):
            if not results[-1].success:
                error = f"not sent: turn {k - 1} of its conversation failed"
                return results + [Result(error=error) for _ in conv.user_turns[k:]]
            req = next_turn(req, results[-1], user)
            results.append(await one(req))
        return results

    async def item(w: Request | Conversation) -> list[Result]:
        return await converse(w) if isinstance(w, Conversation) else [await one(w)]

    started, start = time.monotonic(), time.perf_counter()
    tasks = []
    for w, delay in zip(workload, arrival_delays(len(workload), args.request_rate, args.seed)):
        if getattr(w, "arrival_s", None) is not None:  # a trace's request: at its own time
            delay = w.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(item(w)))
    results = [res for batch in await asyncio.gather(*tasks) for res in batch]
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, duration, started


def _num_requests(w: Request | Conversation) -> int:
    return len(w.user_turns) if isinstance(w, Conversation) else 1


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p90/p99 of `values_s` (seconds), in ms; zeros when there are none."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p90", "p99")}
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p90_{name}_ms": float(np.percentile(ms, 90)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def meets_slo(res: Result, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request within every SLO given (a 1-token request has no TPOT to violate)."""
    if not res.success:
        return False
    if slo_ttft_ms is not None and res.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = res.tpot
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms)


def compute_metrics(results: list[Result], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "input_tokens_estimated": any(not r.prompt_tokens_exact for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": n_in / duration,
        "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration,
        # Little's law: the average number of requests in flight.
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    m.update(cache_metrics(ok))
    m.update(_stats("ttft", [r.ttft for r in ok]))
    m.update(_stats("itl", [gap for r in ok for gap in r.itl]))
    m.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None]))
    m.update(_stats("e2e_latency", [r.latency for r in ok]))
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        good = sum(meets_slo(r, args.slo_ttft_ms, args.slo_tpot_ms) for r in results)
        m["goodput"] = good / duration
    else:
        m["goodput"] = None
    m["errors"] = [r.error for r in results if not r.success][:MAX_ERRORS_SHOWN]
    return m


def cache_metrics(ok: list[Result]) -> dict[str, Any]:
    """Cached prompt tokens and their share of the prompt tokens, over the successful requests
    whose server reported them (both None when none did)."""
    reported = [r for r in ok if r.cached_tokens_reported]
    if not reported:
        return {"total_cached_tokens": None, "cache_hit_rate": None}
    cached = sum(r.cached_tokens for r in reported)
    prompt = sum(r.prompt_tokens for r in reported)
    return {"total_cached_tokens": cached, "cache_hit_rate": cached / prompt if prompt else 0.0}


def format_table(m: dict[str, Any], args: argparse.Namespace) -> str:
    """SGLang-style result table."""
    rows: list[tuple[str, Any]] = [
        ("Backend", args.backend),
        ("Traffic request rate", args.request_rate),
        ("Max request concurrency", args.max_concurrency if args.max_concurrency else "not set"),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", m["duration"]),
        ("Total input tokens" + (" (estimated)" if m["input_tokens_estimated"] else ""), m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Total cached prompt tokens", _or_not_reported(m["total_cached_tokens"])),
        ("Cache hit rate (cached / prompt tokens)", _or_not_reported(m["cache_hit_rate"])),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Input token throughput (tok/s)", m["input_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_throughput"]),
        ("Concurrency", m["concurrency"]),
    ]
    if m["goodput"] is not None:
        rows.append(("Goodput (req/s)", m["goodput"]))
    sections = [
        ("Time to First Token", "ttft", "TTFT"),
        ("Inter-Token Latency", "itl", "ITL"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("End-to-End Latency", "e2e_latency", "E2E Latency"),
    ]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [_row(k, v) for k, v in rows]
    for title, key, label in sections:
        lines.append("{s:{c}^60}".format(s=title, c="-"))
        for stat, word in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(_row(f"{word} {label} (ms)", m[f"{stat}_{key}_ms"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def _or_not_reported(value: Any) -> Any:
    return "not reported" if value is None else value


def _row(name: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) and not math.isinf(value) else str(value)
    return f"{name:<44}{text:>16}"


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    s = {k: v for k, v in vars(args).items()}
    s["model"] = model
    # JSON has no infinity; keep the record parseable by strict readers.
    s["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    return s


async def run_benchmark(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """Runs one benchmark and returns its metrics (plus "settings"); also prints the table and
    appends the record to --output-file when set. Failed requests are counted, not raised."""
    args = _as_namespace(args)
    workload = make_workload(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment would sit in the timed path.
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=httpx.Timeout(args.request_timeout), limits=limits, trust_env=False
    ) as client:
        model = args.model or await fetch_model(client)
        for req in warmup_requests(args, workload):
            warm = await send_request(client, args, model, req)
            if not warm.success:
                raise RuntimeError(f"warmup request failed: {warm.error}")
        results, duration, started = await run_load(client, args, model, workload)
    metrics = compute_metrics(results, duration, args)
    metrics["settings"] = _settings(args, model)
    print(format_table(metrics, args), flush=True)
    for err in metrics["errors"]:
        print(f"error: {err}", file=sys.stderr)
    if args.output_file:
        record = dict(metrics, timestamp=time.time(), start_monotonic=started)
        if args.output_details:
            record.update(
                ttfts=[r.ttft for r in results],
                itls=[r.itl for r in results],
                latencies=[r.latency for r in results],
                output_lens=[r.output_tokens for r in results],
                input_lens=[r.prompt_tokens for r in results],
                cached_lens=[r.cached_tokens for r in results],
                all_errors=[r.error for r in results],
                sent_at=[r.sent_at for r in results],
            )
        append_jsonl(args.output_file, record)
    metrics["results"] = [asdict(r) for r in results]  # for callers; not in the JSONL record
    return metrics


def main(argv=None) -> int:
    """Exit code 0 when every request succeeded, 1 otherwise."""
    args = parse_args(argv)
    metrics = asyncio.run(run_benchmark(args))
    if metrics["failed"]:
        print(f"{metrics['failed']} of {len(metrics['results'])} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What constrained decoding costs, and whether its outputs hold, on the default model.

Three parts (--parts, all by default):

- overhead: decode step time with 32 running requests, all constrained by a JSON schema, against
  the same 32 requests unconstrained, in one process and one run (rounds alternate). A step is
  timed only while all 32 decode (after their prefill, before the first one ends). The schema
  (benchmarks.lib.structured_schemas.LONG_SCHEMA) keeps every constrained request going for the whole window.
- compile: xgrammar's tokenizer preparation once, then each of the 20 schemas and the 5 tools'
  required-call guides compiled cold (a fresh guide) and again (from the engine's cache).
- validity: through `afd serve` and the official client, in single and AFD modes, 200 requests
  with `response_format: json_schema` over the 20 schemas (greedy and sampled alternately) and
  50 with `tool_choice: "required"` over the 5 tools (one call each); every reply is parsed and
  checked against its schema with `jsonschema`.

    python -m benchmarks.bench_structured [--json out.json] [--quick] [--parts overhead compile validity]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from afd_engine import Engine, SamplingParams
from afd_engine.default_model import resolve_model_path
from afd_engine.runtime.grammar import GrammarCompiler
from afd_engine.server.tool_calls import tool_call_guide
from benchmarks.lib.results import write_json
from benchmarks.lib.server import afd_server
from benchmarks.lib.structured_schemas import LONG_SCHEMA, PROMPTS, SCHEMAS, TOOLS, ask_schema, ask_tool_call

RUNNING = 32


# -- overhead ----------------------------------------------------------------------------------


def _decode_step_times(engine: Engine, params: SamplingParams, steps: int) -> list[float]:
    """Per-step seconds of `steps` steps in which all RUNNING requests decode."""
    tok = engine.tokenizer
    for i in range(RUNNING):
        engine.add_request(prompt_token_ids=tok.encode(PROMPTS[i % len(PROMPTS)] + f" {i}"), params=params)
    while any(not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting or engine.compiling:
        engine.step()  # prefill (and grammars compiled)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        done = engine.step()
        times.append(time.perf_counter() - start)
        assert not done and len(engine.scheduler.running) == RUNNING, "a request ended inside the window"
    while engine.has_unfinished():
        for rid in list(engine._requests):
            engine.abort(rid)
        engine.step()
    return times


def overhead(rounds: int, steps: int) -> dict:
    constrained = SamplingParams(max_new_tokens=400, temperature=0.0, guide=("json_schema", json.dumps(LONG_SCHEMA)))
    plain = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {"constrained": [], "plain": []}
    with Engine(context_length=512) as engine:
        _decode_step_times(engine, plain, 4)  # warm up
        _decode_step_times(engine, constrained, 4)
        for _ in tqdm(range(rounds), desc="overhead rounds", file=sys.stderr):
            times["plain"] += _decode_step_times(engine, plain, steps)
            times["constrained"] += _decode_step_times(engine, constrained, steps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "running": RUNNING,
        "steps_timed": len(times["plain"]),
        "plain_step_ms": med["plain"],
        "constrained_step_ms": med["constrained"],
        "ratio": med["constrained"] / med["plain"],
        "target_ratio": 1.15,
    }


# -- compile -----------------------------------------------------------------------------------


def compile_times(limit: int | None) -> dict:
    path = resolve_model_path(None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    start = time.perf_counter()
    import xgrammar  # noqa: F401  (once per process, on the first constrained request)

    imported = time.perf_counter() - start
    start = time.perf_counter()
    compiler._compiler()  # xgrammar's tokenizer info, once per engine
    prepare = time.perf_counter() - start
    guides = [("json_schema", json.dumps(s)) for s in SCHEMAS]
    guides += [("structural_tag", tool_call_guide("deepseekv3", TOOLS, "required", False))]
    guides = guides[:limit] if limit else guides
    cold, cached = [], []
    for guide in tqdm(guides, desc="compiles", file=sys.stderr):
        start = time.perf_counter()
        compiler.submit(guide).result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.submit(guide).result()
        cached.append(time.perf_counter() - start)
    compiler.close()
    return {
        "vocab_size": len(tokenizer),
        "xgrammar_import_ms": imported * 1e3,  # 0 when an earlier part imported it
        "tokenizer_prepare_ms": prepare * 1e3,
        "guides": len(guides),
        "cold_ms_median": statistics.median(cold) * 1e3,
        "cold_ms_max": max(cold) * 1e3,
        "cached_us_median": statistics.median(cached) * 1e6,
    }


# -- validity ----------------------------------------------------------------------------------


def _schema_ok(client, i: int) -> bool:
    import jsonschema

    schema, out = ask_schema(client, i)
    try:
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _tool_ok(client, i: int) -> bool:
    import jsonschema

    out = ask_tool_call(client, i)
    calls = out.choices[0].message.tool_calls or []
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    try:
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return bool(calls) and out.choices[0].finish_reason == "tool_calls"


def validity(modes: list[str], n_schema: int, n_tools: int) -> dict:
    import openai

    flags = {
        "single": [],
        "afd": "--mode afd --dp-size 2 --ffn-nodes 1 --ffn-ranks-per-node 2 --micro-batches 2".split(),
    }
    # the tests' server settings: the model served as "tiny" (the name ask_schema uses), one thread
    serve = ["serve", "--model-path", str(resolve_model_path(None)), "--served-model-name", "tiny"]
    serve += ["--num-threads", "1", "--kv-cache-memory-mb", "16"]
    out = {}
    for mode in modes:
        with afd_server(*serve, *flags[mode], timeout=120) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            start = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                schemas = list(
                    tqdm(
                        pool.map(_schema_ok, [client] * n_schema, range(n_schema)),
                        total=n_schema,
                        desc=f"{mode} json_schema",
                        file=sys.stderr,
                    )
                )
                tools = list(
                    tqdm(
                        pool.map(_tool_ok, [client] * n_tools, range(n_tools)),
                        total=n_tools,
                        desc=f"{mode} tool calls",
                        file=sys.stderr,
                    )
                )
            out[mode] = {
                "json_schema_requests": n_schema,
                "json_schema_valid": sum(schemas),
                "tool_requests": n_tools,
                "tool_calls_valid": sum(tools),
                "seconds": time.perf_counter() - start,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a small run (tests): fewer rounds, guides and requests")
    p.add_argument(
        "--parts", nargs="+", default=["overhead", "compile", "validity"], choices=["overhead", "compile", "validity"]
    )
    p.add_argument("--modes", nargs="+", default=["single", "afd"], choices=["single", "afd"])
    args = p.parse_args(argv)
    result: dict = {"python": platform.python_version(), "model": "default (tiny-deepseek-v3-pydoc)"}
    if "overhead" in args.parts:
        result["overhead"] = overhead(rounds=1 if args.quick else 5, steps=8 if args.quick else 40)
        o = result["overhead"]
        print(
            f"decode step, {RUNNING} running: plain {o['plain_step_ms']:.2f} ms, all constrained "
            f"{o['constrained_step_ms']:.2f} ms: {o['ratio']:.3f}x (target <= {o['target_ratio']})"
        )
    if "compile" in args.parts:
        result["compile"] = c = compile_times(3 if args.quick else None)
        print(
            f"grammar compile: tokenizer {c['tokenizer_prepare_ms']:.0f} ms once; per guide cold median "
            f"{c['cold_ms_median']:.1f} ms (max {c['cold_ms_max']:.1f}), cached {c['cached_us_median']:.1f} us"
        )
    if "validity" in args.parts:
        n_schema, n_tools = (20, 5) if args.quick else (200, 50)
        result["validity"] = v = validity(args.modes, n_schema, n_tools)
        for mode, r in v.items():
            print(
                f"{mode}: json_schema {r['json_schema_valid']}/{r['json_schema_requests']} valid, "
                f"required tool calls {r['tool_calls_valid']}/{r['tool_requests']} valid ({r['seconds']:.1f} s)"
            )
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end test of benchmarks/bench_serving.py against a real `afd serve` subprocess.

One server (the tiny DeepSeek-V3, served as "tiny", prefix cache on, 16-token pages) is shared by
the module; the script runs as a subprocess, exactly as a user would run it. Timings are not
checked, only that they are there and that the counts are exact (ignore_eos makes every request
generate exactly the requested number of tokens). Every run that reads cache hits uses a seed of
its own, so that no run finds another's prompts in the shared server's cache.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib.server import Server, afd_server
from tests.process_helpers import ENV, ROOT, load_bench

SCRIPT = [sys.executable, "-m", "benchmarks.bench_serving"]
QUICK = ["--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]


@pytest.fixture(scope="module")
def server(tiny_v3):
    flags = ["--model-path", tiny_v3, "--num-threads", "1", "--kv-cache-memory-mb", "16", "--served-model-name", "tiny"]
    with afd_server("serve", *flags, timeout=120, env=ENV) as srv:
        yield srv


def run_bench(server: Server, tmp_path: Path, *extra: str) -> dict:
    """Runs the script; returns its (single) JSONL record after checking the exit code and table."""
    out = tmp_path / "tmp.jsonl"
    proc = subprocess.run(
        [*SCRIPT, "--base-url", server.url, *QUICK, "--output-file", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for name in (
        "Successful requests",
        "Benchmark duration (s)",
        "Total generated tokens",
        "Request throughput (req/s)",
        "Output token throughput (tok/s)",
        "Mean TTFT (ms)",
        "P99 ITL (ms)",
        "Median TPOT (ms)",
        "Mean E2E Latency (ms)",
        "Cache hit rate (cached / prompt tokens)",
    ):
        assert name in proc.stdout, name
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def check_quick_record(rec: dict) -> None:
    assert rec["completed"] == 8 and rec["failed"] == 0 and rec["errors"] == []
    assert rec["total_output_tokens"] == 32  # 8 requests x 4 tokens, exactly (ignore_eos)
    assert rec["total_input_tokens"] > 0 and not rec["input_tokens_estimated"]
    assert rec["duration"] > 0 and rec["request_throughput"] > 0 and rec["output_throughput"] > 0
    assert math.isclose(rec["output_throughput"], 32 / rec["duration"])
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms"):
        assert rec[key] > 0, key
    assert rec["mean_e2e_latency_ms"] >= rec["mean_ttft_ms"]
    assert rec["settings"]["model"] == "tiny"
    # The warm-up request is the first request: its cached page (chat prompts pass 16 tokens) may count.
    assert rec["total_cached_tokens"] is not None and 0 <= rec["cache_hit_rate"] < 0.5


@pytest.mark.parametrize("backend", ["chat", "completions", "native"])
def test_backend_quick(server, tmp_path, backend):
    rec = run_bench(server, tmp_path, "--backend", backend)
    check_quick_record(rec)
    assert rec["settings"]["backend"] == backend
    assert rec["goodput"] is None  # no SLO given
    if backend != "chat":  # random-ids: the prompt is exactly 8 token ids
        assert rec["total_input_tokens"] == 64


def test_rate_concurrency_goodput(server, tmp_path):
    rec = run_bench(
        server,
        tmp_path,
        "--request-rate",
        "20",
        "--max-concurrency",
        "2",
        "--slo-tpot-ms",
        "10000",
        "--slo-ttft-ms",
        "10000",
    )
    check_quick_record(rec)
    assert rec["settings"]["request_rate"] == 20 and rec["settings"]["max_concurrency"] == 2
    assert rec["goodput"] == pytest.approx(rec["request_throughput"])
    assert rec["concurrency"] <= 2 + 1e-6  # never more than 2 in flight


# -- pure helpers (no server) -------------------------------------------------------------------


def _module():
    return load_bench("bench_serving.py")


def test_lengths_and_arrivals():
    b = _module()
    args = b.parse_args(["--num-prompts", "50", "--random-input-len", "10", "--random-range-ratio", "0.5"])
    reqs = b.make_requests(args)
    assert len(reqs) == 50 and all(5 <= len(r.prompt) <= 10 for r in reqs)
    assert all(min(r.prompt) >= b.NUM_SPECIAL_IDS for r in reqs)
    assert b.arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = b.arrival_delays(2000, 100.0, 0)
    assert 0.008 < sum(gaps) / len(gaps) < 0.012  # mean gap 1/rate


def test_slo():
    b = _module()
    r = b.Result(success=True, ttft=0.1, latency=0.5, output_tokens=5)  # TPOT = 100 ms
    assert b.meets_slo(r, 100.0, 100.0) and not b.meets_slo(r, 99.0, None) and not b.meets_slo(r, None, 99.0)
    assert not b.meets_slo(b.Result(success=False), None, None)


# -- prefix datasets against the server -----------------------------------------------------------

GSP = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4"]
GSP += ["--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "4"]


@pytest.mark.parametrize(("backend", "seed"), [("completions", "11"), ("native", "12")])
def test_shared_prefix_hits_the_cache(server, tmp_path, backend, seed):
    """One request at a time: the first request of each group finds nothing cached (the warm-up
    comes from another seed); each later one finds exactly the 64-token system prompt (4 pages;
    its question differs from the first token on)."""
    flags = [*GSP, "--backend", backend, "--seed", seed, "--max-concurrency", "1", "--output-details"]
    rec = run_bench(server, tmp_path, *flags)
    assert rec["completed"] == 8 and rec["failed"] == 0 and rec["total_output_tokens"] == 32
    assert rec["input_lens"] == [72] * 8 and rec["total_input_tokens"] == 576
    firsts, expected = set(), []
    for req in _module().make_requests(_module().parse_args([*GSP, "--seed", seed])):
        system = tuple(req.prompt[:64])
        expected.append(0 if system not in firsts else 64)
        firsts.add(system)
    assert rec["cached_lens"] == expected and rec["total_cached_tokens"] == 6 * 64
    assert rec["cache_hit_rate"] == pytest.approx(384 / 576)


MT = ["--mt-num-conversations", "2", "--mt-num-turns", "3", "--mt-system-prompt-len", "32"]
MT += ["--mt-turn-len", "8", "--mt-output-len", "4", "--max-concurrency", "2", "--output-details"]


def test_multi_turn_native_resends_the_output(server, tmp_path):
    """Turn k+1's prompt is turn k's prompt + its 4 output ids + 8 new ids, as the server counted it;
    each later turn finds at least the full pages of the previous turn's prompt cached."""
    rec = run_bench(server, tmp_path, "--dataset-name", "multi-turn", "--backend", "native", "--seed", "13", *MT)
    assert rec["completed"] == 6 and rec["failed"] == 0 and rec["output_lens"] == [4] * 6
    assert rec["input_lens"] == [40, 52, 64] * 2  # conversation by conversation, turns in order
    for conv in (rec["cached_lens"][:3], rec["cached_lens"][3:]):
        assert conv[0] == 0
        assert 32 <= conv[1] <= 40 + 4 and 48 <= conv[2] <= 52 + 4  # 40 -> 2 pages, 52 -> 3 pages
    assert rec["cache_hit_rate"] == pytest.approx(sum(rec["cached_lens"]) / 312)


def test_multi_turn_chat_sends_the_conversation(server, tmp_path):
    rec = run_bench(server, tmp_path, "--dataset-name", "multi-turn", "--backend", "chat", "--seed", "14", *MT)
    assert rec["completed"] == 6 and rec["failed"] == 0 and rec["output_lens"] == [4] * 6
    for lens, cached in (
        (rec["input_lens"][:3], rec["cached_lens"][:3]),
        (rec["input_lens"][3:], rec["cached_lens"][3:]),
    ):
        assert lens[0] < lens[1] < lens[2]  # each turn adds an assistant and a user message
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    assert 0 < rec["cache_hit_rate"] < 1


def test_multi_turn_refuses_completions(tmp_path):
    proc = subprocess.run(
        [*SCRIPT, "--dataset-name", "multi-turn", "--backend", "completions"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--dataset-name multi-turn needs --backend native" in proc.stderr


# -- prefix datasets and cache figures, pure ----------------------------------------------------


def test_shared_prefix_shapes():
    b = _module()
    flags = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4"]
    flags += ["--gsp-system-prompt-len", "20", "--gsp-question-len", "5", "--gsp-output-len", "7"]
    reqs = b.make_requests(b.parse_args(flags))
    assert len(reqs) == 12
    assert all(len(r.prompt) == 25 and r.prompt_len == 25 and r.output_len == 7 for r in reqs)
    assert all(b.NUM_SPECIAL_IDS <= t < 512 for r in reqs for t in r.prompt)
    groups: dict[tuple, list] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt[:20]), []).append(tuple(r.prompt[20:]))
    assert len(groups) == 3 and all(len(qs) == 4 for qs in groups.values())
    assert len({q for qs in groups.values() for q in qs}) == 12  # every question its own
    order = [list(groups).index(tuple(r.prompt[:20])) for r in reqs]
    assert order != sorted(order)  # groups interleave
    assert [r.prompt for r in b.make_requests(b.parse_args(flags))] == [r.prompt for r in reqs]  # same seed
    assert [r.prompt for r in b.make_requests(b.parse_args([*flags, "--seed", "2"]))] != [r.prompt for r in reqs]

    chat = b.make_requests(b.parse_args([*flags, "--backend", "chat"]))
    assert all([m["role"] for m in r.prompt] == ["system", "user"] for r in chat)
    assert all(len(r.prompt[0]["content"].split()) == 20 and len(r.prompt[1]["content"].split()) == 5 for r in chat)
    assert len({r.prompt[0]["content"] for r in chat}) == 3


def test_warmup_shares_no_prefix_with_the_workload():
    b = _module()
    args = b.parse_args(["--dataset-name", "generated-shared-prefix", "--warmup-requests", "2"])
    workload = b.make_workload(args)
    warm = b.warmup_requests(args, workload)
    assert len(warm) == 2 and all(len(w.prompt) == len(workload[0].prompt) for w in warm)
    assert not {tuple(w.prompt[:16]) for w in warm} & {tuple(r.prompt[:16]) for r in workload}
    plain = b.parse_args(["--warmup-requests", "3", "--num-prompts", "2"])
    reqs = b.make_workload(plain)
    assert b.warmup_requests(plain, reqs) == [reqs[0], reqs[1], reqs[0]]


def test_multi_turn_prompts_grow_by_output_and_turn():
    b = _module()
    flags = ["--dataset-name", "multi-turn", "--mt-num-conversations", "3", "--mt-num-turns", "2"]
    flags += ["--mt-system-prompt-len", "10", "--mt-turn-len", "6", "--mt-output-len", "5"]
    convs = b.make_workload(b.parse_args([*flags, "--backend", "native"]))
    assert len(convs) == 3 and len({tuple(c.system) for c in convs}) == 3
    conv = convs[0]
    assert len(conv.system) == 10 and [len(t) for t in conv.user_turns] == [6, 6] and conv.output_len == 5
    first = b.first_turn(conv)
    assert first.prompt == conv.system + conv.user_turns[0] and first.prompt_len == 16
    second = b.next_turn(first, b.Result(output_ids=[7, 8, 9, 10, 11]), conv.user_turns[1])
    assert second.prompt == first.prompt + [7, 8, 9, 10, 11] + conv.user_turns[1]
    assert second.prompt_len == len(second.prompt) == 16 + 5 + 6 and second.output_len == 5

    chat = b.make_workload(b.parse_args([*flags, "--backend", "chat"]))[0]
    first = b.first_turn(chat)
    assert first.prompt == [{"role": "system", "content": chat.system}, {"role": "user", "content": chat.user_turns[0]}]
    second = b.next_turn(first, b.Result(output_text="a reply"), chat.user_turns[1])
    assert second.prompt == first.prompt + [
        {"role": "assistant", "content": "a reply"},
        {"role": "user", "content": chat.user_turns[1]},
    ]
    assert second.prompt_len == 16 + 2 + 6
    no_system = b.make_workload(b.parse_args([*flags, "--backend", "chat", "--mt-system-prompt-len", "0"]))[0]
    assert [m["role"] for m in b.first_turn(no_system).prompt] == ["user"]


def test_cached_tokens_and_hit_rate():
    b = _module()
    usage = {"prompt_tokens": 40, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 32}}
    chat = b.Result(success=True)
    b.record_usage(chat, {"choices": [], "usage": usage})
    assert (chat.prompt_tokens, chat.output_tokens, chat.cached_tokens, chat.cached_tokens_reported) == (
        40,
        4,
        32,
        True,
    )
    native = b.Result(success=True, prompt_tokens=3)
    b.record_usage(native, {"output_ids": [9], "meta_info": {"prompt_tokens": 60, "cached_tokens": 16}})
    assert (native.prompt_tokens, native.prompt_tokens_exact, native.cached_tokens) == (60, True, 16)
    other = b.Result(success=True, prompt_tokens=100)  # a server that reports no cache figures
    b.record_usage(other, {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 4}})
    assert not other.cached_tokens_reported

    args = b.parse_args([])
    m = b.compute_metrics([chat, native, other, b.Result(error="x", cached_tokens=99)], 2.0, args)
    assert m["total_cached_tokens"] == 48 and m["cache_hit_rate"] == pytest.approx(48 / 100)
    none = b.compute_metrics([other], 1.0, args)
    assert none["total_cached_tokens"] is None and none["cache_hit_rate"] is None
    assert "not reported" in b.format_table(none, args)


def write_trace(path: Path) -> Path:
    """Four requests of the Mooncake format: the second shares the first's first block, the fourth
    both of its blocks; at 1/32 of the lengths a block is 16 tokens (one page of the server)."""
    rows = [
        (0, 1024, 128, [0, 1]),
        (100, 1024, 128, [0, 2]),
        (200, 512, 128, [3]),
        (300, 1500, 128, [0, 1, 4]),
    ]
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
            for t, n, o, h in rows
        )
    )
    return path


def test_trace_prompts_share_what_their_block_ids_share(tmp_path):
    b = _module()
    trace = write_trace(tmp_path / "trace.jsonl")
    args = b.parse_args(["--dataset-name", "trace", "--trace", str(trace), "--trace-length-scale", "0.03125"])
    reqs = b.make_workload(args)
    assert [r.prompt_len for r in reqs] == [32, 32, 16, 47] and [r.output_len for r in reqs] == [4] * 4
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    first, second, third, fourth = (r.prompt for r in reqs)
    assert second[:16] == first[:16] and second[16:] != first[16:]
    assert fourth[:32] == first and third != first[:16]
    assert b.make_workload(args)[3].prompt == fourth  # the same prompts every time
    # a slice, at twice the rate: arrivals measured from the slice's start
    fast = ["--trace-rate-scale", "2", "--trace-start", "0.05", "--trace-duration", "0.09"]
    sliced = b.make_workload(b.parse_args(["--dataset-name", "trace", "--trace", str(trace), *fast]))
    assert [r.arrival_s for r in sliced] == pytest.approx([0.0, 0.05])
    warm = b.warmup_requests(args, reqs)
    assert len(warm[0].prompt) == 32 and warm[0].prompt[:16] != first[:16]
    with pytest.raises(SystemExit):
        b.parse_args(["--dataset-name", "trace"])  # no --trace
    with pytest.raises(SystemExit):
        b.parse_args(["--dataset-name", "trace", "--trace", str(trace), "--backend", "chat"])


def test_trace_replay_hits_the_cache_where_the_trace_reuses_blocks(server, tmp_path):
    """Sent at the trace's times, one at a time: the second request finds its first block (16
    tokens) cached, the fourth the first request's two blocks (32), the others nothing."""
    trace = write_trace(tmp_path / "trace.jsonl")
    flags = ["--dataset-name", "trace", "--trace", str(trace), "--trace-length-scale", "0.03125"]
    flags += ["--backend", "native", "--max-concurrency", "1", "--output-details", "--seed", "14"]
    rec = run_bench(server, tmp_path, *flags)
    assert rec["completed"] == 4 and rec["failed"] == 0 and rec["output_lens"] == [4] * 4
    assert rec["input_lens"] == [32, 32, 16, 47]
    assert rec["cached_lens"] == [0, 16, 0, 32]
    assert rec["duration"] >= 0.3  # the last request left at 0.3 s
    assert rec["p90_ttft_ms"] > 0

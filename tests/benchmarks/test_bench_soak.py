"""bench_soak: a short soak per mode serves every kind of request, refuses every malformed one with
OpenAI's error JSON, and ends with no KV page in use and every process alive."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.process_helpers import bench_run, load_bench

# every kind of malformed request the soak must send (stated here, not read from the bench)
MALFORMED = (
    "invalid_json surrogate_prompt surrogate_stop surrogate_message tools oversized_stop wrong_type unknown_model"
).split()


@pytest.mark.parametrize("mode", ["single", "afd"])
def test_quick_soak_is_clean(tmp_path, tiny_v3, mode):
    out = tmp_path / "soak.json"
    # 12 seconds say nothing about memory growth; the RSS figures are checked for presence only.
    flags = ["--quick", "--mode", mode, "--model-path", tiny_v3, "--max-rss-growth-pct", "1000", "--json", str(out)]
    res = bench_run("bench_soak.py", *flags)
    report = json.loads(out.read_text())
    assert report["passed"] and report["reasons"] == []
    assert "PASS" in res.stdout

    requests = report["requests"]
    normal = ["chat", "chat_stream", "completions", "completions_stream"]
    assert list(requests) == [*normal, "abort_stream", "abort_cancel", *(f"malformed:{m}" for m in MALFORMED)]
    for kind, counts in requests.items():
        assert counts.get("ok", 0) > 0 and counts["ok"] == counts["sent"], (kind, counts)
    for kind in MALFORMED:
        counts = requests[f"malformed:{kind}"]
        assert counts["4xx_openai_error"] == counts["sent"], (kind, counts)
        assert all(err.split()[0] in ("400", "404") for err in report["errors"][f"malformed:{kind}"]), kind
    assert report["errors"]["malformed:unknown_model"] == {
        "404 invalid_request_error": requests["malformed:unknown_model"]["sent"]
    }
    # Every stream the client closed, and every request it cancelled, really was cut short at least once.
    assert report["errors"]["abort_stream"].get("closed by the client", 0) > 0
    assert report["errors"]["abort_cancel"].get("cancelled by the client", 0) > 0
    for kind in normal:
        assert kind not in report["errors"], report["errors"][kind]

    assert report["failures"] == 0, report["failure_examples"]
    kv = report["kv"]
    assert kv["leaked_pages"] == 0 and kv["afd_kv_pages_used"] == kv["afd_prefix_cache_pages"]
    assert report["crashed_processes"] == 0
    ranks = [p for p in report["processes"] if p["name"].startswith("rank process")]
    assert len(ranks) == (1 if mode == "single" else 2)
    assert all(p["alive"] for p in report["processes"])
    assert all(m["rss_after_warmup_kb"] and m["rss_last_kb"] for m in report["memory"])
    assert report["latency"]["first_n"] > 0 and report["latency"]["last_n"] > 0


def _load_bench():
    return load_bench("bench_soak.py")


def test_sse_reader_keeps_unicode_line_separators_inside_an_event():
    """Model text may hold U+2028 or U+0085, which JSON leaves unescaped; httpx's aiter_lines splits
    there, which cut one chat_stream event in two in a 10-minute soak. Events end at LF only."""
    bench = _load_bench()
    raw = 'data: {"t": "a\u2028b\x85c"}\r\n\ndata: [DONE]\n\n'.encode()

    async def body():  # two network reads, the first ending inside the event
        yield raw[:9]
        yield raw[9:]

    async def collect():
        response = httpx.Response(200, content=body(), request=httpx.Request("GET", "http://x"))
        return [d async for d in bench.sse_data(response)]

    assert asyncio.run(collect()) == ['{"t": "a\u2028b\x85c"}', "[DONE]"]

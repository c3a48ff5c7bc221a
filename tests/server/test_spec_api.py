"""Speculative decoding behind the HTTP API (`afd serve --speculative-algorithm NEXTN`), driven by
the official `openai` client: a stream carries several tokens in one chunk where drafts were
accepted together, its text equals the non-streamed answer, and /metrics reports the acceptance."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Server
from tests.spec_helpers import PROMPTS, make_copy_drafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = Server(
        make_copy_drafter(tmp_path_factory.mktemp("copy-mtp")),
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--dtype", "float32",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_streamed_chunks_carry_accepted_runs_and_metrics_count_them(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(chunks) == whole.choices[0].text and whole.usage.completion_tokens == 24
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", spec_server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert len(events) < 24  # several tokens per event where a run of drafts was accepted
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(spec_server.url + "/metrics").text)}
    assert families["afd_spec_mean_accepted_length"].samples[0].value > 1.0
    buckets = {s.labels["le"]: s.value for s in families["afd_spec_accepted_drafts"].samples if "le" in s.labels}
    assert set(buckets) == {"0.0", "1.0", "2.0", "3.0", "+Inf"} and buckets["3.0"] == buckets["+Inf"] > 0
    verifies = families["afd_spec_verify_steps"].samples[0].value
    assert buckets["+Inf"] == verifies and buckets["0.0"] < verifies

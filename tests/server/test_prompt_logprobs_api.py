"""Prompt logprobs over HTTP, as evaluators ask for them: the official `openai` client's legacy
completions with echo + logprobs (max_tokens 0 to score only), and SGLang's return_logprob on
/generate. Values equal transformers' log-softmax."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.hf_reference import hf_logits

MODEL = "tiny"
PROMPT = [23, 57, 101, 9, 66, 302, 17, 45, 88, 12, 250, 31, 7, 199, 64, 140, 33, 76]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_v3):
    logp = torch.log_softmax(hf_logits(tiny_v3, PROMPT), dim=-1)
    return [None] + [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], logp


def test_echo_with_max_tokens_0_scores_the_prompt(client, reference, tiny_v3):
    from transformers import AutoTokenizer

    want, logp = reference
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    assert resp.usage.completion_tokens == 0 and choice.finish_reason == "length"
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(PROMPT)
    assert max(abs(a - b) for a, b in zip(got[1:], want[1:])) <= 1e-4
    assert choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.top_logprobs[5]) in (2, 3)  # the top 2, and the prompt token itself
    assert max(choice.logprobs.top_logprobs[5].values()) == pytest.approx(logp[4].max().item(), abs=1e-4)
    assert choice.text == AutoTokenizer.from_pretrained(tiny_v3).decode(PROMPT, skip_special_tokens=True)
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice.text)


def test_echo_then_generated_tokens_in_one_list(client, reference):
    want, _ = reference
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0, echo=True)
    full = client.completions.create(**kwargs).choices[0]
    plain = client.completions.create(**{**kwargs, "echo": False}).choices[0]
    assert full.logprobs.token_logprobs[: len(PROMPT)][1:] == pytest.approx(want[1:], abs=1e-4)
    assert full.logprobs.token_logprobs[len(PROMPT) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert full.text.endswith(plain.text) and len(full.text) > len(plain.text)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    streamed = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-5) and streamed[0] is None
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == full.logprobs.text_offset


def test_max_tokens_0_without_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="needs echo true and logprobs set"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1)


def test_generate_return_logprob(server, reference):
    want, logp = reference
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 4,
        "top_logprobs_num": 2,
    }
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT[4:]
    assert [lp for lp, _, _ in meta["input_token_logprobs"]] == pytest.approx(want[4:], abs=1e-4)
    assert [i for _, i, _ in meta["input_top_logprobs"][0]] == logp[3].topk(2).indices.tolist()
    assert len(meta["output_token_logprobs"]) == 2 and len(meta["output_top_logprobs"][1]) == 2
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["input_token_logprobs"][0] == [None, PROMPT[0], None]

"""A Qwen3-MoE checkpoint behind the HTTP API: the chat template comes from the checkpoint (ChatML)."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from afd_engine import Engine, SamplingParams
from tests.server.conftest import Server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def qwen_server(tiny_model_factory):
    path = tiny_model_factory("qwen3-gqa4")
    srv = Server(path)
    yield path, srv
    srv.stop()


def test_chat_uses_the_checkpoints_chatml_template(qwen_server):
    path, srv = qwen_server
    tokenizer = AutoTokenizer.from_pretrained(path)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nBe brief.<|im_end|>" in rendered
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with Engine(model_path=path, num_threads=1) as eng:
        expected = eng.generate(
            prompt_token_ids=[ids], sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        )[0].text
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.content == expected

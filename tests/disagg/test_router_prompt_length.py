"""`afd router --local-prefill-max-tokens`: how the router counts a prompt's tokens, and what it
refuses."""

from __future__ import annotations

import pytest

from afd_engine.errors import ConfigError
from afd_engine.server.pd_router import PDRouter, PromptLength


def test_prompt_length_counts_tokens_of_every_request_shape(tiny_v3):
    length = PromptLength(tiny_v3)
    hello = length.text("Hello disaggregation")
    assert hello == 12 and length.text("hi") == 2
    # chat: the messages' text (string contents and text parts), without the template's tokens
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]
    chat = {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": parts}]}
    assert length(chat) == 4
    assert length({"prompt": "Hello disaggregation"}) == hello
    assert length({"prompt": ["hi", "Hello disaggregation"]}) == hello  # several prompts: the longest
    assert length({"prompt": [[1, 2, 3], [4, 5]]}) == 3
    assert length({"input_ids": [7, 8]}) == 2
    assert length({"text": ["hi"]}) == 2
    assert length({"model": "m"}) == 0  # nothing to count: the instance answers with the error


def test_router_refuses_a_threshold_it_cannot_apply(tmp_path):
    with pytest.raises(ConfigError, match="give --tokenizer"):
        PDRouter(["http://p"], ["http://d"], local_prefill_max_tokens=16)
    with pytest.raises(ConfigError, match="must be at least 0, not -1"):
        PDRouter(["http://p"], ["http://d"], local_prefill_max_tokens=-1, tokenizer=str(tmp_path))
    with pytest.raises(ConfigError, match=f"--tokenizer {tmp_path}: no tokenizer.json there"):
        PDRouter(["http://p"], ["http://d"], local_prefill_max_tokens=16, tokenizer=str(tmp_path))

"""The shipped default model: it loads, matches transformers token for token, and writes readable text."""

from __future__ import annotations

import json
import re

import pytest

from afd_engine import Engine, SamplingParams
from afd_engine.default_model import DEFAULT_MODEL_NAME, default_model_path, resolve_model_path
from afd_engine.tiny_tokenizer import SPECIAL_TOKENS
from tests.hf_reference import assert_greedy_matches, hf_greedy

PROMPTS = ("The for statement", "A list is", "def f(x):\n    return")
CHAT_QUESTIONS = ("What is a dictionary?", "Hello")


@pytest.fixture(scope="module")
def engine():
    with Engine(dtype="float32", num_threads=1) as eng:  # no model_path: the embedded default
        yield eng


def test_default_is_the_shipped_trained_checkpoint(engine):
    path = default_model_path()
    assert resolve_model_path(None) == path and engine.model_path == path
    assert path.name == DEFAULT_MODEL_NAME == "tiny-deepseek-v3-pydoc"  # the server reports the dir name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["topk_method"] == "noaux_tc"
    assert sum(f.stat().st_size for f in path.iterdir()) < 20 * 2**20
    assert engine.tokenizer.convert_ids_to_tokens(list(range(5))) == list(SPECIAL_TOKENS)
    readme = (path / "README.md").read_text()
    assert "PSF License" in readme and "2026-11-23" in readme


def test_greedy_tokens_match_transformers(engine):
    path = str(default_model_path())
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    )
    for prompt, prompt_ids, out in zip(PROMPTS, ids, outs):
        ref, gaps = hf_greedy(path, prompt_ids, 16)
        assert assert_greedy_matches(out.token_ids, ref, gaps, what=repr(prompt)) >= 8


@pytest.mark.parametrize("question", CHAT_QUESTIONS)
def test_chat_answer_is_english_like_text(engine, question):
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    out = engine.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_new_tokens=48, temperature=0.0))
    text = out[0].text
    assert "\ufffd" not in text, repr(text)  # no broken UTF-8 from byte-level pieces
    assert all(c.isprintable() or c in "\n\t" for c in text), repr(text)
    letters_and_spaces = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters_and_spaces >= 0.7 * len(text), repr(text)
    assert len(re.findall(r"\b[A-Za-z]{2,}\b", text)) >= 5, repr(text)

"""Tests of the stop checker: EOS, stop token ids, stop strings across tokens, length, trim."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from afd_engine.runtime.stop_checker import StopChecker, find_stop, trim_text
from afd_engine.sampling_params import SamplingParams

CORPUS = ["hello world, the end is near.", "stop here please", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained in memory (nothing downloaded)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def checker(tokenizer) -> StopChecker:
    return StopChecker(tokenizer, {tokenizer.eos_token_id})


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


def generate(checker: StopChecker, ids: list[int], params: SamplingParams):
    """Feed ids one by one as a decode loop would -> (tokens kept, finish_reason, trim)."""
    for n in range(1, len(ids) + 1):
        reason, trim = checker.check(ids[:n], params)
        if reason is not None:
            return n, reason, trim
    return len(ids), None, None


# ---- token-level stops -----------------------------------------------------------------------


def test_eos_stops_unless_ignored(checker, tokenizer):
    ids = encode(tokenizer, "hello") + [tokenizer.eos_token_id]
    assert checker.check(ids, SamplingParams()) == ("stop", None)
    assert checker.check(ids, SamplingParams(ignore_eos=True)) == (None, None)
    assert checker.check(ids[:-1], SamplingParams()) == (None, None)


def test_stop_token_ids(checker, tokenizer):
    ids = encode(tokenizer, "the quick brown fox")
    params = SamplingParams(stop_token_ids=(ids[2],))
    assert generate(checker, ids, params) == (3, "stop", None)
    # A stop token id works even with ignore_eos, and even when it is the EOS id.
    eos_as_stop = SamplingParams(ignore_eos=True, stop_token_ids=(tokenizer.eos_token_id,))
    assert checker.check(ids + [tokenizer.eos_token_id], eos_as_stop) == ("stop", None)


def test_length(checker, tokenizer):
    ids = encode(tokenizer, "the quick brown fox jumps")
    assert generate(checker, ids, SamplingParams(max_new_tokens=4)) == (4, "length", None)
    assert checker.check(ids[:1], SamplingParams(max_new_tokens=1)) == ("length", None)


def test_stop_beats_length_on_the_same_step(checker, tokenizer):
    ids = encode(tokenizer, "hello") + [tokenizer.eos_token_id]
    n = len(ids)
    assert checker.check(ids, SamplingParams(max_new_tokens=n)) == ("stop", None)
    assert checker.check(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)) == ("length", None)
    assert checker.check(ids, SamplingParams(max_new_tokens=n, stop_token_ids=(ids[-1],), ignore_eos=True)) == (
        "stop",
        None,
    )
    text_ids = encode(tokenizer, "hello world")
    hit = checker.check(text_ids, SamplingParams(max_new_tokens=len(text_ids), stop=("world",)))
    assert hit == ("stop", len("hello "))


# ---- stop strings ----------------------------------------------------------------------------


def test_stop_string_spanning_several_tokens(checker, tokenizer):
    text = "hello world. STOP here please"
    ids = encode(tokenizer, text)
    stop_tokens = len(encode(tokenizer, "hello world. STOP"))
    assert len(encode(tokenizer, " STOP")) >= 3  # the stop string really spans several tokens
    n, reason, trim = generate(checker, ids, SamplingParams(stop=("STOP",)))
    assert (n, reason, trim) == (stop_tokens, "stop", len("hello world. "))
    full = tokenizer.decode(ids[:n])
    assert trim_text(full, trim) == "hello world. "
    n, reason, trim = generate(checker, ids, SamplingParams(stop=("STOP",), include_stop_str_in_output=True))
    assert (n, reason, trim) == (stop_tokens, "stop", len("hello world. STOP"))
    assert trim_text(tokenizer.decode(ids[:n]), trim) == "hello world. STOP"


def test_stop_string_ending_inside_a_token(checker, tokenizer):
    ids = encode(tokenizer, "hello world")  # 'he' 'll' 'o' ' wor' 'ld'
    n, reason, trim = generate(checker, ids, SamplingParams(stop=("lo w",)))
    assert reason == "stop" and tokenizer.decode(ids[:n]) == "hello wor"
    assert trim_text("hello wor", trim) == "hel"
    _, _, trim = generate(checker, ids, SamplingParams(stop=("lo w",), include_stop_str_in_output=True))
    assert trim_text("hello wor", trim) == "hello w"


def test_trim_is_relative_to_the_full_text_not_the_window(checker, tokenizer):
    prefix = "the quick brown fox jumps over the lazy dog. " * 12
    ids = encode(tokenizer, prefix + "the end is near. stop here")
    assert len(ids) > 100  # far longer than the tail window
    n, reason, trim = generate(checker, ids, SamplingParams(stop=("end is",), max_new_tokens=1000))
    assert reason == "stop" and trim == len(prefix) + len("the ")
    assert trim_text(tokenizer.decode(ids[:n]), trim) == prefix + "the "


def test_multibyte_stop_string(checker, tokenizer):
    ids = encode(tokenizer, "here é€ and more")  # é and € are split into byte tokens
    n, reason, trim = generate(checker, ids, SamplingParams(stop=("é€",), include_stop_str_in_output=True))
    assert reason == "stop" and tokenizer.decode(ids[:n]) == "here é€"
    assert trim == len("here é€")
    _, _, trim = generate(checker, ids, SamplingParams(stop=("€",)))
    assert trim == len("here é")


def test_first_completed_stop_string_wins(checker, tokenizer):
    ids = encode(tokenizer, "the quick brown fox")
    _, reason, trim = generate(checker, ids, SamplingParams(stop=("brown", "quick")))
    assert (reason, trim) == ("stop", len("the "))


def test_trim_follows_skip_special_tokens(checker, tokenizer):
    ids = encode(tokenizer, "hello") + [tokenizer.eos_token_id] + encode(tokenizer, " world")
    base = dict(stop=("world",), ignore_eos=True)
    _, reason, trim = generate(checker, ids, SamplingParams(**base))
    assert (reason, trim) == ("stop", len("hello "))
    _, reason, trim = generate(checker, ids, SamplingParams(**base, skip_special_tokens=False))
    assert (reason, trim) == ("stop", len("hello<eos> "))


def test_no_stop_string_no_stop(checker, tokenizer):
    ids = encode(tokenizer, "the quick brown fox")
    assert generate(checker, ids, SamplingParams(stop=("lazy", "dog"))) == (len(ids), None, None)


# ---- helpers ---------------------------------------------------------------------------------


def test_find_stop_only_matches_in_the_new_text():
    assert find_stop("xx ab", "xx ab c", ("ab",), False) is None  # "ab" ended in the old text
    assert find_stop("xx ab", "xx ab ab", ("ab",), False) == 6  # a second, new occurrence
    assert find_stop("xx a", "xx abcd", ("cd", "b"), False) == 4  # "b" completes first
    assert find_stop("xx a", "xx abc", ("bc", "abc"), False) == 3  # same end: the longer one
    assert find_stop("xx a", "xx abc", ("bc", "abc"), True) == 6
    assert find_stop("xx \ufffd", "xx €", ("€",), False) == 3  # a completed partial character


def test_trim_text():
    assert trim_text("hello world", None) == "hello world"
    assert trim_text("hello world", 5) == "hello"
    assert trim_text("hello", 0) == ""

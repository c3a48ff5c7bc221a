"""IncrementalDetokenizer: deltas concatenate to the decoded text, never split a character, never
show part of a stop string, and decode only a short window per call."""

from __future__ import annotations

import random

import pytest

from afd_engine.server.detokenizer import IncrementalDetokenizer

MIXED = "Hello 世界! The price of 😀🎉 wheat, 中文测试 and 👩‍👩‍👧 emoji. STOP here."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The project's tiny byte-level BPE: every Chinese or emoji character spans 3-4 tokens."""
    from transformers import AutoTokenizer

    from afd_engine.tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def zh_tok():
    """A byte-level BPE trained on Chinese, whose merges cross character boundaries: one token
    can end with the first byte of a character and the next start with its remaining bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "中文测试很好用，我们今天去北京吃烤鸭😀🎉。",
        "你好世界！今天天气很好，我们去公园散步🌸🌸。",
        "深度学习模型的推理服务需要流式输出文本😀。",
    ] * 5
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        min_frequency=2,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None, trim=None) -> list[str]:
    """Feed ids in chunks (one token at a time by default), then finish; all deltas."""
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.finish(trim))
    return deltas


def decode(tokenizer, ids, skip=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip)


def test_mixed_text_one_token_at_a_time(tok):
    ids = tok.encode(MIXED, add_special_tokens=False)
    # The tiny tokenizer has no Chinese merges, so single tokens are partial characters.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == decode(tok, ids) == MIXED
    assert not any("\ufffd" in d for d in deltas)
    assert detok.text == MIXED and detok.token_count == len(ids)
    # Characters come out as soon as they are complete, not in one piece at the end.
    assert deltas[-1] == "" and sum(1 for d in deltas if d) > 30


def test_tokens_that_cross_character_boundaries(zh_tok):
    text = "今天我们去北京吃烤鸭😀🎉，你好世界！深度学习🌸 ok"
    ids = zh_tok.encode(text)
    pieces = [zh_tok.decode([i]) for i in ids]
    # Some token holds whole characters plus the first byte(s) of the next one.
    assert any(p.endswith("\ufffd") and p.rstrip("\ufffd") for p in pieces)
    for sizes in (None, [2] * 50, [3, 1, 4, 1, 5] * 10):
        deltas = stream(IncrementalDetokenizer(zh_tok), ids, sizes)
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    # The complete characters before a split one are not held back with it.
    detok = IncrementalDetokenizer(zh_tok)
    out = ""
    for i in ids:
        out += detok.add([i])
        assert text.startswith(out)
        assert len(out) >= len(decode(zh_tok, ids[: detok.token_count]).rstrip("\ufffd"))


def test_special_tokens(tok):
    ids = (
        tok.encode("Hi 世", add_special_tokens=False)
        + [tok.eos_token_id]
        + tok.encode(" there", add_special_tokens=False)
    )
    for skip in (True, False):
        deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert "".join(deltas) == decode(tok, ids, skip)
    assert tok.eos_token not in "".join(stream(IncrementalDetokenizer(tok), ids))


def test_genuine_replacement_characters_pass_through(tok):
    # Invalid UTF-8 from the model (a lone continuation byte) stays U+FFFD, as in the full decode.
    lone = tok.convert_tokens_to_ids("Ģ")  # byte 0x82 in the byte-level alphabet
    ids = tok.encode("a", add_special_tokens=False) + [lone] + tok.encode("b 世", add_special_tokens=False) + [lone]
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == decode(tok, ids) == "a\ufffdb 世\ufffd"


def engine_trim(tokenizer, ids, stop, include=False):
    """What the engine does: after each token, look for a stop string in the decoded output;
    the first hit ends the request. Returns (ids generated up to the stop, trim)."""
    for n in range(1, len(ids) + 1):
        text = decode(tokenizer, ids[:n])
        hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
        if hits:
            end, start = min(hits)
            return ids[:n], (end if include else start)
    return ids, None


@pytest.mark.parametrize("stop", [("STOP here",), (" 中文",), ("😀🎉",), ("price", "xyz"), ("!!!", "The p")])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_never_streams_partially(tok, stop, include):
    ids = tok.encode(MIXED, add_special_tokens=False)
    cut_ids, trim = engine_trim(tok, ids, stop, include)
    assert trim is not None
    full = decode(tok, cut_ids)
    first_stop = min(full.find(s) for s in stop if s in full)
    detok = IncrementalDetokenizer(tok, stop=stop)
    out = ""
    for i in cut_ids:
        out += detok.add([i])
        # Nothing at or past the start of the stop string is shown before finish().
        assert len(out) <= first_stop
    # Up to the stop string, the text was not held back more than needed.
    assert out == full[:first_stop]
    out += detok.finish(trim)
    assert out == full[:trim] == detok.text
    matched = full[first_stop:].startswith(stop[0]) and stop[0] or stop[1]
    assert out.endswith(matched) if include else not any(s in out for s in stop)


def test_stop_string_spanning_three_tokens(tok):
    text = "The train left at seven."
    stop = "left at"
    ids = tok.encode(text, add_special_tokens=False)
    start = text.index(stop)
    # The stop string overlaps three tokens: " le", "ft", " at".
    pieces, pos, covering = [tok.decode([i]) for i in ids], 0, 0
    for piece in pieces:
        covering += pos < start + len(stop) and pos + len(piece) > start
        pos += len(piece)
    assert covering == 3
    for include, trim_at in ((False, start), (True, start + len(stop))):
        cut_ids, trim = engine_trim(tok, ids, (stop,), include)
        assert trim == trim_at and len(cut_ids) == 7  # the engine stops on " at"
        detok = IncrementalDetokenizer(tok, stop=(stop,))
        out = ""
        for i in cut_ids:
            out += detok.add([i])
            assert len(out) <= start  # neither "le" nor "left" is ever shown
        assert out == "The train "
        assert out + detok.finish(trim) == text[:trim]


def test_held_back_prefix_is_released_when_it_does_not_match(tok):
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    out = detok.add(tok.encode("one ST", add_special_tokens=False))
    assert out == "one "  # "ST" could start "STOP"
    out += detok.add(tok.encode("ILL two", add_special_tokens=False))
    assert out == "one STILL two"
    out += detok.add(tok.encode(" S", add_special_tokens=False))
    assert out == "one STILL two "
    out += detok.finish()  # no stop matched: everything comes out
    assert out == "one STILL two S"


def test_finish_is_final(tok):
    detok = IncrementalDetokenizer(tok)
    detok.add(tok.encode("abc", add_special_tokens=False))
    assert detok.finish() == "" and detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add([5])
    assert IncrementalDetokenizer(tok).finish() == ""


class _CountingBackend:
    """Wraps a tokenizers.Tokenizer, recording the length of every decode call."""

    def __init__(self, backend, lengths):
        self.backend, self.lengths = backend, lengths

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _CountingTokenizer:
    def __init__(self, tokenizer):
        self.lengths: list[int] = []
        self.backend_tokenizer = _CountingBackend(tokenizer.backend_tokenizer, self.lengths)


def test_decode_window_stays_small(tok):
    counting = _CountingTokenizer(tok)
    ids = tok.encode(MIXED * 40, add_special_tokens=False) + [tok.eos_token_id] * 200
    detok = IncrementalDetokenizer(counting, stop=("never appears",))
    text = "".join(stream(detok, ids))
    assert text == decode(tok, ids)
    assert len(ids) > 2000 and max(counting.lengths) <= 8  # O(window), not O(output)


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    given = None


if given is not None:
    ALPHABET = list("ab 世界😀,") + ["\u00e9"]

    @settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(
        text=st.text(alphabet=ALPHABET, min_size=1, max_size=30),
        stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=2),
        include=st.booleans(),
        seed=st.integers(0, 1000),
    )
    def test_random_streams(zh_tok, text, stop, include, seed):
        ids = zh_tok.encode(text)
        cut_ids, trim = engine_trim(zh_tok, ids, tuple(stop), include)
        full = decode(zh_tok, cut_ids)
        rng = random.Random(seed)
        detok = IncrementalDetokenizer(zh_tok, stop=tuple(stop))
        out, i = "", 0
        while i < len(cut_ids):
            n = rng.randint(1, 3)
            out += detok.add(cut_ids[i : i + n])
            i += n
            assert full.startswith(out)
            if trim is not None:
                assert len(out) <= min(full.find(s) for s in stop if s in full)
        out += detok.finish(trim)
        assert out == (full if trim is None else full[:trim])
        assert "\ufffd" not in out


class _SlowTokenizer:
    """A tokenizer with a Python decode only (no Rust backend): the fallback stream."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=clean_up_tokenization_spaces
        )


@pytest.mark.parametrize("sizes", [None, [2] * 80, [3, 1, 4, 1, 5] * 20])
def test_a_slow_tokenizer_streams_the_same_deltas(tok, zh_tok, sizes):
    for tokenizer, text in ((tok, MIXED), (zh_tok, "今天我们去北京吃烤鸭😀🎉，你好世界！深度学习🌸 ok")):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        for skip in (True, False):
            fast = stream(IncrementalDetokenizer(tokenizer, skip, stop=("好世",)), ids, sizes)
            slow = stream(IncrementalDetokenizer(_SlowTokenizer(tokenizer), skip, stop=("好世",)), ids, sizes)
            assert fast == slow and "".join(fast) == decode(tokenizer, ids, skip)


def test_a_window_the_stream_refuses_is_decoded_in_python(zh_tok):
    text = "今天我们去北京吃烤鸭😀🎉，你好世界！"
    ids = zh_tok.encode(text)
    detok = IncrementalDetokenizer(zh_tok)
    out = "".join(detok.add([i]) for i in ids[:5])

    def refuse(_ids):
        raise Exception("DecodeStream: invalid prefix")

    detok._step = refuse  # what tokenizers' DecodeStream does when a window rewrites earlier text
    out += "".join(detok.add([i]) for i in ids[5:]) + detok.finish()
    assert out == text

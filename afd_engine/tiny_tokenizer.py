"""A small byte-level BPE tokenizer in the DeepSeek style, for tiny test checkpoints.

The tokenizer is trained with the `tokenizers` library on a short built-in English text, so it
needs no download and takes well under a second to build. It is byte-level: every Unicode string
(Chinese, emoji, control characters) encodes and decodes back unchanged, because the 256 byte
symbols are always part of the vocabulary. The special tokens use the exact spellings of the real
DeepSeek-V3 tokenizer and come first, so `<｜begin▁of▁sentence｜>` is id 0 and
`<｜end▁of▁sentence｜>` is id 1, as in DeepSeek-V3.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜pad｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"

# Order fixes the ids: bos 0, eos 1, pad 2, User 3, Assistant 4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

# Total vocabulary, special tokens and the 256 byte symbols included.
TINY_VOCAB_SIZE = 512

MODEL_MAX_LENGTH = 512

# A simplified DeepSeek-V3 chat template: system prompts are concatenated first, then each turn is
# prefixed by its role token, and every finished assistant turn ends with the eos token.
CHAT_TEMPLATE = (
    "{% if add_generation_prompt is not defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if ns.system_prompt %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' %}{% endif %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% endif %}"
    "{% endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% elif message['role'] != 'system' %}"
    "{{ raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# Training text. It only has to be varied enough to yield ~250 merges of common English pieces;
# its content does not matter otherwise. Changing it changes every tiny checkpoint's token ids.
_CORPUS = """\
The morning train left the station at seven, and most of the passengers were still half asleep.
A woman by the window read a newspaper about the harvest; the price of wheat had fallen again.
Her son counted the bridges as they crossed the river: one, two, three, four, five.

Mixture-of-experts models route every token to a few experts out of many. A small gate scores
the experts, the best ones are chosen, and their outputs are added together with the weights
from the gate. Shared experts see every token, while routed experts only see the tokens sent to
them. This keeps the amount of computation per token small, even when the model is very large.

"Where are you going?" asked the old man. "To the market," she answered, "to buy bread, cheese,
apples and a little honey." He smiled and said that the bakery on the corner had the best bread
in the whole city, though it was always closed on Sundays and on holidays.

In the year 1969, people watched on television as the first astronauts walked on the Moon.
The mission had taken years of planning, thousands of engineers, and a great deal of courage.
Today, students learn about orbits, rockets and gravity in their science classes at school.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2 * i))

Attention lets each position look at the positions before it. The queries, keys and values are
computed from the hidden states; the scores are scaled, masked, normalized with a softmax, and
used to mix the values. A cache of keys and values makes generation of the next token fast.

It rained all through the night. In the garden the roses bent under the weight of the water,
and the path turned into a small brown stream. By noon the sun came out, the birds began to sing,
and the children ran outside to play in the puddles with their boots and their yellow coats.

Questions? Answers! Numbers like 3.14, 2.718 and 42 appear everywhere; so do dates such as
2024-05-17 and times such as 12:30. Good software is tested, documented, and easy to change.
Please write clearly, think carefully, and check your work before you share it with others.

The library on the hill opened its doors at nine. Inside, there were long tables, green lamps,
and shelves that reached the ceiling. Readers came for history, poetry, travel, cooking and
mathematics; some of them came only for the quiet, and some came to meet their friends.

User: Can you explain what a prime number is?
Assistant: A prime number is a whole number greater than one that has exactly two divisors,
one and itself. The first few primes are 2, 3, 5, 7, 11 and 13. Every other whole number greater
than one can be written as a product of primes, and that product is unique up to the order.

The weather report said there would be strong winds along the coast, with heavy snow in the
mountains and light rain in the valleys. Drivers were asked to stay at home if they could,
and the ferries between the islands were cancelled until the storm had passed.

Cooking a good soup takes patience. Start with onions, carrots and celery in a little oil, add
garlic and herbs, then pour in water or stock and let everything simmer slowly for an hour.
Season with salt and pepper at the end, and serve it hot with fresh bread and butter.
"""


@dataclass(frozen=True)
class TokenizerInfo:
    """Ids of the special tokens and the size of a built tiny tokenizer."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Train the deterministic byte-level BPE tokenizer on the built-in corpus.

    The result adds the bos token in front of every encoded text (like DeepSeek's tokenizer) and
    decodes byte-level pieces back to the original Unicode text.
    """
    return build_bpe_tokenizer(_CORPUS.split("\n\n"), vocab_size)


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts`, with the DeepSeek special tokens as ids 0..4.

    Deterministic for the same texts and size; encoding prepends the bos token.
    """
    tokenizer = Tokenizer(models.BPE())
    # GPT-2 style splitting into words/numbers/punctuation before BPE, at the byte level.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so that any text is representable even if unseen in the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)

    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prompts start with bos, as with DeepSeek checkpoints; the chat template writes its own bos.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


# Qwen's ChatML layout (its markers are plain text to the tiny tokenizer, byte by byte); user, system,
# assistant and tool messages alike
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict:
    """tokenizer_config.json contents; class and flags as transformers expects for DeepSeek."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template,
    }


def write_tiny_tokenizer(out_dir: str | pathlib.Path, chat_template: str = CHAT_TEMPLATE) -> TokenizerInfo:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`.

    Returns the vocabulary size and special token ids, which the model's config.json must match.
    The files are byte-identical across calls.
    """
    return write_tokenizer_files(out_dir, build_tiny_tokenizer(), chat_template)


def write_tokenizer_files(
    out_dir: str | pathlib.Path, tokenizer: Tokenizer, chat_template: str = CHAT_TEMPLATE
) -> TokenizerInfo:
    """Write `tokenizer` with the DeepSeek tokenizer_config.json and special_tokens_map.json."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(chat_template))
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    return TokenizerInfo(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
    )


def _write_json(path: pathlib.Path, obj: dict) -> None:
    # ensure_ascii=False keeps the special tokens readable; indent/sort give stable bytes.
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")

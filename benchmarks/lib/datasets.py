"""The workloads of bench_serving.py: random ids or words, ShareGPT, generated shared prefixes,
multi-turn conversations and request traces. Nothing is downloaded; every draw comes from a seeded
random.Random."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any

NUM_SPECIAL_IDS = 5  # ids 0..4 are bos, eos, pad, User, Assistant in the tiny tokenizer (and rarely text elsewhere)

# Common English words: prompts that tokenize like ordinary text, without needing a tokenizer here.
_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her which this be are or an had not "
    "but have were they one all their there been has more when who will would can if no time out up "
    "about into only other new some could these two may first then do any like my now over such our "
    "man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three house water number city"
)
WORDS = _WORDS_TEXT.split()


Prompt = str | list[int] | list[dict[str, str]]  # text, token ids, or chat messages (chat backend)


@dataclass
class Request:
    """One benchmark request: a prompt and the number of tokens to generate."""

    prompt: Prompt
    prompt_len: int  # exact for token ids; the word count for text and messages
    output_len: int
    arrival_s: float | None = None  # a trace's request: when it is sent, from the run's start


@dataclass
class Conversation:
    """A multi-turn conversation: a system prompt, then one new user message per turn."""

    system: str | list[int]  # empty: none
    user_turns: list[str | list[int]]
    output_len: int  # tokens generated per turn


def is_token_ids(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def _size(part: str | list[int]) -> int:
    """Tokens of an id list, words of a text."""
    return len(part) if isinstance(part, list) else len(part.split())


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    low = max(1, int(length * ratio))
    return [rng.randint(low, length) for _ in range(n)]


def _random_prompt(rng: random.Random, n: int, as_ids: bool, vocab_size: int) -> str | list[int]:
    """`n` random token ids (never a special id) or `n` random words."""
    if as_ids:
        return [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(n)]
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_requests(args: argparse.Namespace, as_ids: bool, rng: random.Random) -> list[Request]:
    in_lens = _lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    out_lens = _lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    return [
        Request(_random_prompt(rng, n_in, as_ids, args.random_vocab_size), n_in, n_out)
        for n_in, n_out in zip(in_lens, out_lens)
    ]


def sharegpt_requests(args: argparse.Namespace) -> list[Request]:
    """The first (human, gpt) pair of each conversation, shuffled with the seed."""
    with open(args.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(args.seed).shuffle(pairs)
    if len(pairs) < args.num_prompts:
        raise ValueError(f"{args.dataset_path} has {len(pairs)} usable conversations, fewer than --num-prompts")
    reqs = []
    for question, answer in pairs[: args.num_prompts]:
        out_len = args.sharegpt_output_len or max(1, len(answer.split()))
        reqs.append(Request(question, len(question.split()), out_len))
    return reqs


def _with_system(system: str | list[int], user: str | list[int]) -> Prompt:
    """The prompt of a system prompt and a user message: concatenated ids, or chat messages."""
    if isinstance(user, list):
        return system + user
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def shared_prefix_requests(args: argparse.Namespace, as_ids: bool, rng: random.Random) -> list[Request]:
    """Every group's system prompt followed by each of its questions, all groups shuffled together."""
    reqs = []
    for _ in range(args.gsp_num_groups):
        system = _random_prompt(rng, args.gsp_system_prompt_len, as_ids, args.random_vocab_size)
        for _ in range(args.gsp_prompts_per_group):
            question = _random_prompt(rng, args.gsp_question_len, as_ids, args.random_vocab_size)
            prompt_len = args.gsp_system_prompt_len + args.gsp_question_len
            reqs.append(Request(_with_system(system, question), prompt_len, args.gsp_output_len))
    rng.shuffle(reqs)
    return reqs


def conversations(args: argparse.Namespace, as_ids: bool, rng: random.Random) -> list[Conversation]:
    def draw(n: int) -> str | list[int]:
        return _random_prompt(rng, n, as_ids, args.random_vocab_size)

    return [
        Conversation(
            draw(args.mt_system_prompt_len),
            [draw(args.mt_turn_len) for _ in range(args.mt_num_turns)],
            args.mt_output_len,
        )
        for _ in range(args.mt_num_conversations)
    ]


def first_turn(conv: Conversation) -> Request:
    user = conv.user_turns[0]
    return Request(_with_system(conv.system, user), _size(conv.system) + _size(user), conv.output_len)


def next_turn(prev: Request, answer: Any, user: str | list[int]) -> Request:
    """The request after `prev`: its prompt, its `answer` (the output ids, or the reply's text as an
    assistant message), then the new `user` message."""
    if is_token_ids(prev.prompt):
        output: str | list[int] = answer.output_ids
        prompt: Prompt = prev.prompt + output + user
    else:
        output = answer.output_text
        prompt = prev.prompt + [{"role": "assistant", "content": output}, {"role": "user", "content": user}]
    return Request(prompt, prev.prompt_len + _size(output) + _size(user), prev.output_len)


def trace_requests(args: argparse.Namespace) -> list[Request]:
    """A Mooncake-format trace's requests (afd_engine/planner/traces.py reads it: arrival times
    divided by --trace-rate-scale, lengths times --trace-length-scale, outputs times
    --trace-output-scale where given), those arriving in
    [--trace-start, --trace-start + --trace-duration) seconds, each sent at its arrival time. A
    prompt is its block ids' token blocks, one fixed random block per id, cut to its length (and
    filled with its own random tokens where its ids do not cover it): requests that share block ids
    share those prompt tokens, so the prefix cache sees the trace's reuse."""
    from afd_engine.planner.traces import load_mooncake

    output_scale = getattr(args, "trace_output_scale", None)
    trace = load_mooncake(args.trace, args.trace_rate_scale, args.trace_length_scale, output_scale=output_scale)
    end = args.trace_start + args.trace_duration
    picked = [r for r in trace.requests if args.trace_start <= r.arrival_s < end]
    if not picked:
        raise ValueError(f"--trace {args.trace}: no request arrives in [{args.trace_start:g}, {end:g}) s")
    blocks: dict[int, list[int]] = {}

    def block(block_id: int) -> list[int]:
        if block_id not in blocks:
            rng = random.Random(f"trace block {block_id}")
            blocks[block_id] = [
                rng.randrange(NUM_SPECIAL_IDS, args.random_vocab_size) for _ in range(trace.block_tokens)
            ]
        return blocks[block_id]

    out = []
    for i, r in enumerate(picked):
        ids = [t for b in r.blocks for t in block(b)][: r.input_len]
        if len(ids) < r.input_len:
            rng = random.Random(f"trace request {i}")
            ids += [rng.randrange(NUM_SPECIAL_IDS, args.random_vocab_size) for _ in range(r.input_len - len(ids))]
        out.append(Request(ids, len(ids), r.output_len, arrival_s=r.arrival_s - args.trace_start))
    return out


def make_workload(args: argparse.Namespace, seed: int | str | None = None) -> list[Request] | list[Conversation]:
    """The requests (or, for multi-turn, the conversations) of a run; `seed` defaults to --seed."""
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args)
    if args.dataset_name == "trace":
        return trace_requests(args)
    rng = random.Random(args.seed if seed is None else seed)
    # Chat has no way to send token ids, so the id datasets fall back to random words there.
    as_ids = args.dataset_name != "random" and args.backend != "chat"
    if args.dataset_name == "generated-shared-prefix":
        return shared_prefix_requests(args, as_ids, rng)
    if args.dataset_name == "multi-turn":
        return conversations(args, as_ids, rng)
    return random_requests(args, as_ids, rng)


def make_requests(args: argparse.Namespace) -> list[Request]:
    """The requests of a single-turn dataset (every dataset but multi-turn)."""
    if args.dataset_name == "multi-turn":
        raise ValueError("multi-turn requests depend on the server's answers; use make_workload")
    return make_workload(args)


def warmup_requests(args: argparse.Namespace, workload: list[Request] | list[Conversation]) -> list[Request]:
    """--warmup-requests untimed requests: the workload's first ones, or, for the prefix datasets,
    requests of the same shape from another seed (so that no measured prefix gets cached)."""
    if args.dataset_name in ("generated-shared-prefix", "multi-turn"):
        workload = make_workload(args, seed=f"warmup {args.seed}")
    if args.dataset_name == "trace":  # the same lengths, none of the trace's blocks, sent at once
        rng = random.Random(f"warmup {args.seed}")
        workload = [
            Request(_random_prompt(rng, r.prompt_len, True, args.random_vocab_size), r.prompt_len, r.output_len)
            for r in workload
        ]
    pool = [first_turn(w) if isinstance(w, Conversation) else w for w in workload]
    return [pool[i % len(pool)] for i in range(args.warmup_requests)]

"""Greedy agreement of bench_vs_vllm: the same prompts (token ids) sent greedily to each server,
the generated token ids kept, and where the outputs of the two engines first differ."""

from __future__ import annotations

import random

import httpx

from benchmarks.lib.peer_servers import SERVED_NAME

# Greedy agreement prompts come from their own seed, so that they are not the load's prompts.
AGREEMENT_SEED = "greedy agreement"
# bench_serving's random-ids never uses ids 0..4 (special tokens of the tiny tokenizer).
FIRST_PLAIN_ID = 5


def agreement_prompts(n: int, length: int, vocab_size: int = 512) -> list[list[int]]:
    """`n` prompts of `length` random plain token ids, the same on every run."""
    rng = random.Random(AGREEMENT_SEED)
    return [[rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)] for _ in range(n)]


def greedy_request(engine: str, prompt: list[int], max_tokens: int) -> tuple[str, dict]:
    """Path and body of a greedy request whose answer carries the generated token ids: afd's
    native /generate; vLLM's completions with return_token_ids."""
    if engine == "afd":
        params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        return "/generate", {"input_ids": prompt, "sampling_params": params}
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return "/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True}


def greedy_ids(engine: str, response: dict) -> list[int]:
    if engine == "afd":
        return list(response["output_ids"])
    return list(response["choices"][0]["token_ids"])


def run_greedy(engine: str, base_url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = []
    with httpx.Client(base_url=base_url, timeout=600, trust_env=False) as client:
        for prompt in prompts:
            path, body = greedy_request(engine, prompt, max_tokens)
            response = client.post(path, json=body)
            response.raise_for_status()
            outputs.append(greedy_ids(engine, response.json()))
    return outputs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the sequences differ (or one ends); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(a: list[list[int]], b: list[list[int]]) -> dict:
    positions = [first_divergence(x, y) for x, y in zip(a, b)]
    return {
        "prompts": len(positions),
        "identical": sum(p is None for p in positions),
        "first_divergence": positions,
        "matching_tokens": sum(len(x) if p is None else p for x, p in zip(a, positions)),
        "tokens": sum(len(x) for x in a),
    }

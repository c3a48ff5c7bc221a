"""The oracle: Hugging Face transformers' own DeepSeek implementation, fp32 on the CPU."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM

TIE_GAP = 1e-4  # below this top-2 logit gap a reference step is a near-tie


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """All-position logits [len(ids), V] of one prompt."""
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens (EOS not special) and each step's top-2 logit gap, with HF's own KV cache."""
    model = hf_model(path)
    out = model(torch.tensor([ids]), use_cache=True)
    tokens, gaps = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top2 = logits.topk(2).values
        tokens.append(int(logits.argmax()))
        gaps.append(float(top2[0] - top2[1]))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, gaps


def assert_greedy_matches(ours: list[int], ref: list[int], gaps: list[float], what: str = "") -> int:
    """Token-for-token equality; a divergence is accepted only at a reference near-tie, after
    which the sequences legitimately differ. Returns the number of tokens compared."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens, reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < TIE_GAP, (
                f"{what}: token {i} is {a}, reference {b} (reference top-2 gap {gaps[i]:.2e}); "
                f"ours {ours}, reference {ref}"
            )
            return i
    return len(ref)

"""The engine on a device, and transformers' distributions on the same device to judge its tokens
by: the helpers of the engine tests in tests/gpu (and of the decode step timings of
benchmarks.kernels.gpu_check)."""

from __future__ import annotations

from typing import NamedTuple

import torch

PROMPT_LENGTHS = (1, 7, 23, 50)
TINY_PROMPT_LENGTHS = (1, 23, 50)  # under the interpreter: fewer prompts


class Run(NamedTuple):
    """One greedy generation: tokens and their logprobs per prompt, and the decode steps replayed
    from CUDA graphs (0: eager, e.g. the torch MoE backend, which reads the host)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    graph_replays: int


def fixed_prompts(tiny: bool = False, count: int | None = None, length: int | None = None) -> list[list[int]]:
    """Fixed random prompts of token ids: PROMPT_LENGTHS (TINY_PROMPT_LENGTHS), or `count` of
    `length` tokens."""
    from afd_engine.tiny_tokenizer import TINY_VOCAB_SIZE

    g = torch.Generator().manual_seed(3)
    lengths = (TINY_PROMPT_LENGTHS if tiny else PROMPT_LENGTHS) if count is None else [length] * count
    return [torch.randint(5, TINY_VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def make_engine(model_path: str, device, dtype: str, backend: str, settings: dict | None = None, **deployment):
    """The single-process engine (no ZeroMQ import), or with `deployment` a multi-process one;
    `settings`: more EngineArgs fields (--disable-cuda-graph)."""
    kwargs = dict(model_path=model_path, device=torch.device(device).type, dtype=dtype, kv_cache_memory_mb=64)
    kwargs.update(attention_backend=backend, moe_backend=backend, **(settings or {}))
    if not deployment:
        from afd_engine.engine import Engine
        from afd_engine.engine_args import EngineArgs

        return Engine(EngineArgs(**kwargs))
    from afd_engine.factory import make_engine as make_deployment  # imports zmq

    return make_deployment(**kwargs, **deployment)


def greedy(model_path: str, device, prompts, dtype: str, backend: str, tiny: bool, **deployment) -> Run:
    """Greedy tokens (3 a prompt when `tiny`, else 16, EOS ignored) with their logprobs."""
    from afd_engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=3 if tiny else 16, temperature=0.0, ignore_eos=True, logprobs=0)
    with make_engine(model_path, device, dtype, backend, **deployment) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        graphs = getattr(getattr(engine, "runner", None), "graphs", None)
        replays = graphs.replays if graphs is not None else 0
    errors = [o.error for o in outs if o.error]
    assert not errors, f"engine request failed: {errors[0]}"
    return Run([o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], replays)


@torch.inference_mode()
def reference_logprobs(model_path: str, device, dtype: str, prompts, tokens) -> list[torch.Tensor]:
    """transformers' log-distribution [n, V] of each engine token given the prompt and the engine's
    tokens before it (one forward per prompt): its argmax is transformers' greedy choice there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    for prompt, toks in zip(prompts, tokens):
        ids = torch.tensor([prompt + toks[:-1]], device=device)
        out.append(model(ids).logits[0, len(prompt) - 1 :].float().log_softmax(-1).cpu())
    return out


def prompt_agreement(logp: torch.Tensor, toks: list[int], lps: list[float]) -> dict:
    """One prompt's engine tokens against transformers' distributions: tokens before the first that
    is not transformers' argmax, argmax hits in all, the largest logprob difference, and the first
    difference with transformers' top-2 gap there (a near-tie explains a difference)."""
    t = torch.tensor(toks)
    hits = (logp.argmax(-1) == t).tolist()
    prefix = hits.index(False) if False in hits else len(hits)
    diff = float((logp[torch.arange(len(toks)), t] - torch.tensor(lps)).abs().max())
    out = {"tokens": len(toks), "matched": prefix, "argmax_agree": sum(hits), "max_logprob_diff": diff}
    if prefix < len(toks):
        top2 = logp[prefix].topk(2)
        out["first_difference"] = {"position": prefix, "engine": toks[prefix], "transformers": int(top2.indices[0])}
        out["first_difference"]["top2_gap"] = float(top2.values[0] - top2.values[1])
    return out


def agreement(ref: list[torch.Tensor], tokens: list[list[int]], logprobs: list[list[float]]) -> dict:
    """`prompt_agreement` of every prompt, and their totals."""
    prompts = [prompt_agreement(*one) for one in zip(ref, tokens, logprobs)]
    total = {key: sum(p[key] for p in prompts) for key in ("tokens", "matched", "argmax_agree")}
    return {**total, "max_logprob_diff": max(p["max_logprob_diff"] for p in prompts), "prompts": prompts}

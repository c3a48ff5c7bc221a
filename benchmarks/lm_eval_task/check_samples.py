"""Recompute the loglikelihoods in an lm-eval `--log_samples` file with transformers (fp32) and print
the largest difference and transformers' own accuracy: a check that the server's echoed prompt
logprobs reach lm-eval aligned with its tokens.

    python -m benchmarks.lm_eval_task.check_samples OUTPUT_PATH [--model-path DIR] [--no-bos]

OUTPUT_PATH is lm_eval's --output_path; the newest samples_*.jsonl under it is read. Contexts are
encoded as lm-eval encodes them (the whole string, then the context's tokens split off), with bos
unless --no-bos (match lm-eval's add_bos_token).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from afd_engine.default_model import default_model_path


@torch.inference_mode()
def continuation_logprob(model, tokenizer, context: str, continuation: str, bos: bool) -> float:
    ctx = tokenizer(context, add_special_tokens=bos)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=bos)["input_ids"]
    logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)  # [T, V]
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output_path")
    p.add_argument("--model-path", default=str(default_model_path()))
    p.add_argument("--no-bos", action="store_true")
    args = p.parse_args()
    samples = sorted(Path(args.output_path).rglob("samples_*.jsonl"))[-1]
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
    worst, correct, docs = 0.0, 0, 0
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        ours = []
        for req, resp in zip(s["arguments"].values(), s["resps"]):
            ll = continuation_logprob(model, tokenizer, req["arg_0"], req["arg_1"], not args.no_bos)
            worst = max(worst, abs(ll - float(resp[0][0])))
            ours.append(ll)
        correct += max(range(len(ours)), key=ours.__getitem__) == s["doc"]["label"]
        docs += 1
    print(f"{samples}: {docs} docs, max |loglikelihood - transformers| {worst:.2e}, transformers acc {correct / docs}")


if __name__ == "__main__":
    main()

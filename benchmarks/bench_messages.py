"""Encode and decode time of the control-plane messages, one message at a time.

The messages are the ones the front end and the attention ranks exchange (``afd_engine.control.messages``):
an AddRequest with a 256-token prompt (once per request, front end to rank) and StepOutputs of 32
and 256 token updates (every step, rank to front end), plain and with top-5 logprobs. Each figure
is the best of ``--repeat`` timing rounds of ``--number`` calls, per call, in microseconds; the
frame's size is in bytes.

    python -m benchmarks.bench_messages [--number 2000] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import timeit

from afd_engine.control import messages as msgs
from afd_engine.runtime.request import TokenLogprob, TokenUpdate
from afd_engine.sampling_params import SamplingParams
from benchmarks.lib.results import write_json


def add_request(prompt_len: int) -> msgs.AddRequest:
    params = SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.9, seed=3, stop=("\n\n",))
    return msgs.AddRequest("cmpl-5f0c2d6e9a1b4c3d", [(7 * i) % 32000 for i in range(prompt_len)], params)


def step_output(n: int, top: int) -> msgs.StepOutput:
    """A decode step of `n` requests, one token each (with `top` alternatives' logprobs if top > 0)."""

    def logprobs(i: int) -> list[TokenLogprob] | None:
        if top == 0:
            return None
        return [TokenLogprob(-0.5, [i + k for k in range(top)], [-0.5 - k for k in range(top)])]

    updates = [
        TokenUpdate(f"cmpl-{i:08x}", [1000 + i], logprobs(i), None, num_prompt_tokens=200, num_output_tokens=40)
        for i in range(n)
    ]
    stats = msgs.EngineStats(n, 3, 900, 4096, 120, 51200, 90000, 12, (810.0, 790.0, 805.0, 795.0))
    return msgs.StepOutput(updates, stats, rank=1)


def cases() -> dict:
    """name -> (message, encode, decode)."""
    return {
        "AddRequest, 256-token prompt": (add_request(256), msgs.encode, msgs.decode),
        "StepOutput, 32 updates": (step_output(32, 0), msgs.encode_output, msgs.decode_output),
        "StepOutput, 32 updates, top-5 logprobs": (step_output(32, 5), msgs.encode_output, msgs.decode_output),
        "StepOutput, 256 updates": (step_output(256, 0), msgs.encode_output, msgs.decode_output),
    }


def per_call_us(fn, number: int, repeat: int) -> float:
    return 1e6 * min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def measure(number: int, repeat: int) -> list[dict]:
    rows = []
    for name, (msg, encode, decode) in cases().items():
        frame = encode(msg)
        assert decode(frame) == msg, f"{name} does not round-trip"
        rows.append(
            {
                "message": name,
                "bytes": len(frame),
                "encode_us": per_call_us(functools.partial(encode, msg), number, repeat),
                "decode_us": per_call_us(functools.partial(decode, frame), number, repeat),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=2000, help="calls per timing round")
    p.add_argument("--repeat", type=int, default=7, help="timing rounds (the best one counts)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    rows = measure(args.number, args.repeat)
    print(f"{'message':<40} {'bytes':>7} {'encode us':>10} {'decode us':>10}")
    for r in rows:
        print(f"{r['message']:<40} {r['bytes']:>7} {r['encode_us']:>10.2f} {r['decode_us']:>10.2f}")
    if args.json:
        write_json(args.json, {"number": args.number, "repeat": args.repeat, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

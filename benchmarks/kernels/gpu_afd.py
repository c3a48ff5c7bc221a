"""The AFD parts of the GPU check (benchmarks.kernels.gpu_check) that one device can prove: both
ranks of AFD 1A+1F on the one GPU over shared memory (--gpu-id-step 0), their tokens against single
mode with CUDA graphs (static decode) on and off, their time per output token, FP8 experts served
both ways, and an NCCL world of one rank whose traffic a CUDA graph replays.

Each part takes the check's Context and returns its record; a case that fails is recorded and the
part's other cases still run (part_runner.run_cases). The dry run runs every part on the CPU at tiny
shapes: there "graphs on" is the static decode path without capture (the ranks' padded persistent
buffers), NCCL is gloo, and what cannot run there is named in the record with the reason.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import NamedTuple

import torch

from benchmarks.part_runner import run_cases
from tests.gpu.engines import fixed_prompts, make_engine

AFD_1A1F = dict(mode="afd", dp_size=1, ffn_nodes=1, ffn_ranks_per_node=1, gpu_id_step=0, transport="shm")
# bf16: a sanity bound on the first token's logprob, AFD against single mode (bf16 logits of ~10 are
# 1/16 apart; a broken rank is off by nats); tests/gpu/test_engine_single.py bounds transformers alike
BF16_MAX_FIRST_LOGPROB_DIFF = 0.5
TPOT_TARGET = 1.5  # the target: AFD 1A+1F TPOT at most this times single mode's, graphs on, batch 8
TPOT_BATCHES = (1, 8, 64)
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # -> the name of the case
# a tiny checkpoint whose routed experts fill whole 128x128 FP8 blocks (RoutedExperts keeps them FP8)
FP8_OVERRIDES = {"moe_intermediate_size": 128}


def graph_settings(on: bool) -> dict:
    """EngineArgs fields of graphs on (captured where the device can, and every decode step of every
    role on the padded persistent buffers they replay) or off (every decode step eager)."""
    return {"disable_cuda_graph": not on, "static_decode": on}


def backend_of(ctx, timed: bool = False) -> str:
    """The kernels: triton on a GPU; on the CPU triton under the interpreter for the correctness
    parts (the kernels the GPU runs) and the torch reference for the timed one (the interpreter
    would make batch 64 slow, and CPU times mean nothing anyway)."""
    return "torch" if ctx.dry_run and timed else "triton"


class Greedy(NamedTuple):
    """One greedy generation: tokens and their logprobs per prompt, and what the engine reported."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    info: dict


def static_batches(engine) -> int | None:
    """Decode batches run on the persistent buffers CUDA graphs replay (the single engine's graph
    replays or static steps; a deployment's attention ranks' micro-batches), None where not reported."""
    count = getattr(engine, "static_decode_batches", None)
    if callable(count):
        return count()
    return getattr(getattr(engine, "stats", None), "static_decode_batches", None)


def device_payloads(engine) -> dict:
    """Whether the deployment's ranks exchanged payloads in device memory (the shared-memory
    transport's payload areas in GPU memory), as the ranks report it when they start."""
    reported = getattr(engine, "info", {}).get("payload_device")
    return {"device_payloads": str(reported).startswith("cuda"), "payload_device": reported}


def routed_experts_fp8(engine) -> bool | None:
    """Whether the single engine holds its routed experts as FP8 (RoutedExperts.fp8); None elsewhere."""
    model = getattr(engine, "model", None)
    experts = model.routed_experts() if model is not None and hasattr(model, "routed_experts") else {}
    return all(e.fp8 for e in experts.values()) if experts else None


def greedy(path: str, ctx, dtype: str, backend: str, settings: dict, new_tokens: int, **deployment) -> Greedy:
    """Greedy tokens of the fixed prompts (EOS ignored) with their logprobs, from the single engine
    or, with `deployment`, a deployment of rank processes on the same device."""
    from afd_engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    with make_engine(path, ctx.device, dtype, backend, settings, **deployment) as engine:
        outs = engine.generate(prompt_token_ids=fixed_prompts(ctx.dry_run), sampling_params=params)
        info = {"static_decode_batches": static_batches(engine)}
        info.update(device_payloads(engine) if deployment else {"experts_fp8": routed_experts_fp8(engine)})
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{'AFD' if deployment else 'single'} engine request failed: {errors[0]}")
    return Greedy([o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], info)


def agreement(ref: Greedy, run: Greedy) -> dict:
    """`run`'s tokens against `ref`'s: per prompt the tokens up to the first that differs, their
    fraction of all, and the largest difference of the first token's logprob (both runs' greedy
    choice from the same prompt: the one position where neither has drifted)."""
    matched = [
        next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))
        for r, t in zip(ref.tokens, run.tokens)
    ]
    total = sum(len(r) for r in ref.tokens)
    first = max(abs(a[0] - b[0]) for a, b in zip(ref.logprobs, run.logprobs))
    out = {"tokens": total, "matched": sum(matched), "agreement": sum(matched) / max(total, 1)}
    return out | {"equal": run.tokens == ref.tokens, "max_first_logprob_diff": first}


def headline(found: str, failures: list[str], cases: int) -> str:
    """A part's headline: how many of its cases failed and the first one's error, then what it found."""
    return (f"{len(failures)} of {cases} cases failed ({failures[0][:100]}); " if failures else "") + found


def static_check(graphs: bool, who: str, info: dict) -> str | None:
    """Why the run did not take the decode path asked for (None: it did)."""
    count = info.get("static_decode_batches")
    if count is None:
        return f"{who}: the engine does not report static_decode_batches"
    if graphs and count == 0:
        return f"{who}: graphs/static decode asked for, and no decode batch ran on the persistent buffers"
    if not graphs and count:
        return f"{who}: graphs and static decode off, and {count} decode batches ran on the persistent buffers"
    return None


# -- afd_one_gpu ---------------------------------------------------------------------------------


def afd_case(ctx, dtype: str, graphs: bool) -> dict:
    """AFD 1A+1F against single mode, both with the same graph settings and kernels."""
    path, backend, n = ctx.checkpoint("deepseek_v3"), backend_of(ctx), 3 if ctx.dry_run else 16
    single = greedy(path, ctx, dtype, backend, graph_settings(graphs), n)
    afd = greedy(path, ctx, dtype, backend, graph_settings(graphs), n, **AFD_1A1F)
    record = {"dtype": dtype, "graphs": graphs, "cuda_graphs": graphs and ctx.device.type == "cuda"}
    record.update(agreement(single, afd), single=single.info, afd=afd.info)
    problems = [static_check(graphs, "single", single.info), static_check(graphs, "AFD", afd.info)]
    if dtype == "float32" and not record["equal"]:
        problems.append(f"fp32 tokens differ from single mode: {record['matched']} of {record['tokens']} matched")
    if dtype != "float32" and not record["max_first_logprob_diff"] <= BF16_MAX_FIRST_LOGPROB_DIFF:
        problems.append(f"first-token logprob {record['max_first_logprob_diff']:.3g} from single mode's")
    problems = [p for p in problems if p]
    if problems:
        record.update(ok=False, error={"type": "Mismatch", "message": "; ".join(problems), "traceback": []})
    return record


def afd_one_gpu(ctx) -> dict:
    """AFD 1A+1F, both ranks on the one device over shared memory, against single mode: fp32
    token-exact, bf16 within BF16_MAX_FIRST_LOGPROB_DIFF of the first token's logprob (its agreement
    recorded), each with graphs on (static decode) and off."""
    cases = {
        f"{DTYPES[dtype]}_graphs_{'on' if graphs else 'off'}": (lambda d=dtype, g=graphs: afd_case(ctx, d, g))
        for dtype in DTYPES
        for graphs in (True, False)
    }
    records, failures = run_cases(cases)
    done = {k: r for k, r in records.items() if "tokens" in r}
    payloads = {r["afd"].get("device_payloads") for r in done.values()}
    out = {"cases": records, "failures": failures, "device_payloads": payloads.pop() if len(payloads) == 1 else None}
    matched = ", ".join(f"{k.replace('_graphs_', ' ')} {r['matched']}/{r['tokens']}" for k, r in done.items())
    out["headline"] = headline(f"AFD vs single tokens: {matched}", failures, len(cases))
    return out


# -- afd_tpot ------------------------------------------------------------------------------------


def generate_seconds(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall seconds of greedy generation of `new_tokens` for every prompt at once."""
    from afd_engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    bad = [o.error or f"{len(o.token_ids)} tokens" for o in outs if o.error or len(o.token_ids) != new_tokens]
    if bad:
        raise RuntimeError(f"a timed request did not give {new_tokens} tokens: {bad[0]}")
    return seconds


def tpot_seconds(engine, prompts: list[list[int]], short: int, long: int, reps: int) -> float:
    """Steady decode time per output token: (median time of `long` tokens - median of `short`) /
    (long - short), which leaves out prefill, admission and the first decode steps. One `long`
    generation first warms up (kernels, graph buckets, the prompts' cached prefixes)."""
    generate_seconds(engine, prompts, long)
    shorts, longs = [], []
    for _ in range(reps):
        shorts.append(generate_seconds(engine, prompts, short))
        longs.append(generate_seconds(engine, prompts, long))
    return (statistics.median(longs) - statistics.median(shorts)) / (long - short)


def tpot_rows(ctx, mode: str, graphs: bool) -> dict:
    """TPOT at each batch of TPOT_BATCHES of one engine (single mode, or AFD 1A+1F)."""
    short, long, reps = (2, 6, 3) if ctx.dry_run else (4, 20, 2 if ctx.quick else 3)
    dtype = "float32" if ctx.dry_run else "bfloat16"
    deployment = AFD_1A1F if mode == "afd" else {}
    path, backend = ctx.checkpoint("deepseek_v3"), backend_of(ctx, timed=True)
    rows = []
    with make_engine(path, ctx.device, dtype, backend, graph_settings(graphs), **deployment) as engine:
        for batch in TPOT_BATCHES:
            seconds = tpot_seconds(engine, fixed_prompts(count=batch, length=16), short, long, reps)
            rows.append({"mode": mode, "graphs": graphs, "batch": batch, "tpot_ms": seconds * 1e3})
        static = static_batches(engine)
    return {"rows": rows, "static_decode_batches": static, "tokens": [short, long], "reps": reps}


def afd_tpot(ctx) -> dict:
    """TPOT of AFD 1A+1F and of single mode at batch 1, 8 and 64, graphs on (static decode) and
    off, and their ratio AFD / single; `target_met`: at most TPOT_TARGET with graphs at batch 8."""
    cases = {
        f"{mode}_graphs_{'on' if graphs else 'off'}": (lambda m=mode, g=graphs: tpot_rows(ctx, m, g))
        for graphs in (True, False)
        for mode in ("single", "afd")
    }
    records, failures = run_cases(cases)
    ms = {(r["mode"], r["graphs"], r["batch"]): r["tpot_ms"] for c in records.values() for r in c.get("rows", [])}
    ratio = {
        f"graphs_{'on' if g else 'off'}": {b: ms[("afd", g, b)] / ms[("single", g, b)] for b in TPOT_BATCHES}
        for g in (True, False)
        if all(("afd", g, b) in ms and ("single", g, b) in ms for b in TPOT_BATCHES)
    }
    at_target = ratio.get("graphs_on", {}).get(8)
    out = {"cases": records, "failures": failures, "afd_over_single": ratio, "target": TPOT_TARGET}
    out["target_met"] = None if at_target is None else bool(0 < at_target <= TPOT_TARGET)
    on = ratio.get("graphs_on")
    found = "AFD/single TPOT, graphs on: " + ", ".join(f"B{b} {x:.2f}x" for b, x in on.items()) if on else ""
    out["headline"] = headline(found or "no AFD/single ratio with graphs on", failures, len(cases))
    return out


# -- fp8_checkpoint ------------------------------------------------------------------------------


def fp8_case(ctx, path: str, settings: dict) -> dict:
    """The single engine and AFD 1A+1F on the same FP8 experts: fp32 activations, so that their
    tokens must be equal; the single engine must hold its experts as FP8 where its MoE kernels
    compute on FP8 (the triton backend: fused_moe_fp8)."""
    from kernels.registry import moe_backend

    backend, n = backend_of(ctx), 3 if ctx.dry_run else 16
    single = greedy(path, ctx, "float32", backend, settings, n)
    afd = greedy(path, ctx, "float32", backend, settings, n, **AFD_1A1F)
    record = agreement(single, afd) | {"backend": backend, "single": single.info, "afd": afd.info}
    problems = [] if record["equal"] else [f"{record['matched']} of {record['tokens']} tokens equal"]
    if hasattr(moe_backend(backend), "fused_moe_fp8") and single.info["experts_fp8"] is not True:
        given = f"--ffn-weight-dtype {settings['ffn_weight_dtype']}" if settings else "an FP8 checkpoint"
        problems.append(
            f"{given} left the single engine's routed experts unquantized (RoutedExperts.fp8 is "
            f"{single.info['experts_fp8']}) although the {backend} MoE backend computes on FP8 weights"
        )
    if problems:
        record.update(ok=False, error={"type": "Mismatch", "message": "; ".join(problems), "traceback": []})
    return record


def fp8_checkpoint(ctx) -> dict:
    """A tiny DeepSeek-V3 FP8 checkpoint (block-quantized, weight_scale_inv per 128x128 block)
    served by the single engine (Triton fp8 MoE) and by AFD 1A+1F: equal tokens; and a bf16
    checkpoint with --ffn-weight-dtype fp8: single and AFD equal tokens."""
    from afd_engine.tiny_model import make_tiny_model

    fp8 = str(make_tiny_model(ctx.workdir / "fp8_ckpt", fp8=True, overrides=FP8_OVERRIDES))
    bf16 = str(make_tiny_model(ctx.workdir / "bf16_ckpt", dtype="bfloat16", overrides=FP8_OVERRIDES))
    cases = {
        "fp8_checkpoint": lambda: fp8_case(ctx, fp8, {}),
        "bf16_ffn_weight_dtype_fp8": lambda: fp8_case(ctx, bf16, {"ffn_weight_dtype": "fp8"}),
    }
    records, failures = run_cases(cases)
    matched = ", ".join(f"{k} {r['matched']}/{r['tokens']}" for k, r in records.items() if "tokens" in r)
    return {"cases": records, "failures": failures, "headline": headline(f"AFD vs single: {matched}", failures, 2)}


# -- nccl_self -----------------------------------------------------------------------------------


def nccl_self(ctx) -> dict:
    """torch.distributed as a world of one rank (NCCL on a GPU, gloo on the CPU; file:// init): a
    send/recv pair to itself, else (where the backend refuses one) an all_gather of a static
    buffer, captured in a CUDA graph and replayed with new values each time, every result checked.
    The CPU runs the same ops eagerly and records the capture as skipped."""
    import torch.distributed as dist

    cuda = ctx.device.type == "cuda"
    backend, reps = ("nccl", 5) if cuda else ("gloo", 3)
    device = torch.device("cuda", ctx.device.index or 0) if cuda else ctx.device
    if cuda:
        torch.cuda.set_device(device.index)  # NCCL's communicator takes the current device
    init = f"file://{ctx.workdir / 'nccl_self.rendezvous'}"
    dist.init_process_group(backend, init_method=init, world_size=1, rank=0, timeout=datetime.timedelta(seconds=30))
    try:
        out = {"backend": backend, "world_size": dist.get_world_size()}
        out.update(self_traffic(device, reps, cuda))
    finally:
        dist.destroy_process_group()
    if not cuda:
        out["skipped"] = {"graph_capture": "CUDA graphs need a GPU: gloo on the CPU runs the ops eagerly"}
    out["headline"] = (
        f"{backend}: {out['op']} {'captured and replayed' if out['graph'] else 'eager'} {reps}x, values ok"
    )
    return out


def self_traffic(device: torch.device, reps: int, capture: bool) -> dict:
    """Tries send/recv to self, then all_gather: each run once eagerly (which also sets up the
    communicator, never inside a capture), then, where `capture`, captured once and replayed
    `reps` times; every run's output checked against its input."""
    src = torch.zeros(4096, device=device)
    unusable = {}  # op -> why it could not be used (its eager run or its capture raised or gave wrong values)
    for op in ("send_recv", "all_gather"):
        dst = torch.zeros_like(src)
        run, stage = make_op(op, src, dst), "eager"
        try:
            print(f"nccl_self: {op}, eager", flush=True)  # a hang in C code leaves the log's last line
            checked(run, src, dst, 0.0)
            if capture:
                stage, graph = "capture", torch.cuda.CUDAGraph()
                print(f"nccl_self: {op}, capture", flush=True)
                # thread_local: the NCCL watchdog thread's event queries must not void the capture
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    run()
                run = graph.replay
        except Exception as exc:
            unusable[op] = f"{stage}: {type(exc).__name__}: {exc}"[:500]
            continue
        for i in range(1, reps + 1):  # a wrong value here is a failure, not a refusal
            checked(run, src, dst, float(i))
        return {"op": op, "graph": capture, "replays": reps, "unusable": unusable}
    raise RuntimeError(f"neither send/recv to self nor all_gather could be used: {unusable}")


def make_op(op: str, src: torch.Tensor, dst: torch.Tensor):
    """A call that moves src into dst through the process group: a send/recv pair to rank 0 (self),
    or an all_gather of a world of one."""
    import torch.distributed as dist

    if op == "send_recv":

        def run():
            ops = [dist.P2POp(dist.isend, src, 0), dist.P2POp(dist.irecv, dst, 0)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return run
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda: gather(dst, src)


def checked(run, src: torch.Tensor, dst: torch.Tensor, value: float) -> None:
    """Fills src with a pattern of `value`, clears dst, runs, and checks that dst holds the pattern."""
    pattern = torch.arange(src.numel(), device=src.device, dtype=src.dtype) + value * 1e4
    src.copy_(pattern)
    dst.fill_(-1.0)
    run()
    if src.is_cuda:
        torch.cuda.synchronize(src.device)
    if not torch.equal(dst, pattern):
        wrong = int((dst != pattern).sum())
        raise RuntimeError(f"{wrong} of {dst.numel()} values wrong after the run with value {value}")

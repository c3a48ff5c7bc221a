#!/usr/bin/env python3
"""The first check of the engine on a GPU: one command, a few minutes, every finding in one JSON file.

Each part runs on its own, under a time limit: its failure is recorded (error type, message, the
end of its traceback and of its cause's) and the next part runs. On a GPU each part runs in a
process of its own (--isolate), so a kernel that breaks the CUDA context, a crash in a compiler or
a hang ends with that part. The JSON file is rewritten after every part, so a run cut short still
leaves all it measured: {"header": {device, driver, versions, SMs, memory...}, "parts": {name:
{"ok", "seconds", "headline", results..., "error"?}}, "ok", "finished"}.

    ceilings            device-to-device copy GB/s and bf16 8192^3 matmul TFLOP/s (CUDA events, median)
    gpu_tests           `python -m pytest -m gpu tests/gpu`: every Triton kernel against the torch
                        reference at DeepSeek-V3 and Qwen3-30B-A3B shapes, the single engine against
                        transformers on the device (fp32 token-exact, bf16 near), AFD 1A+1F equal to
                        single mode, CUDA graph decode steps equal to eager ones; each test's outcome
                        and what it recorded (relative errors, tokens matched) from its JUnit XML
    afd_one_gpu         AFD 1A+1F with both ranks on the one GPU over shared memory (--gpu-id-step 0)
                        against single mode, graphs (static decode) on and off: fp32 tokens equal,
                        bf16 first-token logprobs near (agreement recorded); device payloads or not
    fp8_checkpoint      a block-quantized FP8 tiny checkpoint served by the single engine (Triton fp8
                        MoE) and by AFD 1A+1F, and a bf16 one with --ffn-weight-dtype fp8: equal tokens
    kernels_timing      bench_kernels' rows at DeepSeek-V3 shapes, MLA decode over batch x context,
                        fused MoE (bf16, fp8) over tokens per expert: time, GB/s, TFLOP/s, peak fractions
    sparse_mla          DeepSeek-V3.2's sparse MLA kernel checked, timed against dense MLA decode and the indexer
    decode_step_time    the single engine's decode step at batch 1, 8, 64: torch backend eager, triton
                        with CUDA graphs off and on (runtime/cuda_graph.py), and their ratio
    afd_tpot            time per output token of AFD 1A+1F and single mode at batch 1, 8, 64, graphs on
                        and off, the ratio AFD / single and whether it meets the target (1.5x, batch 8)
    moe_layer_staging   one MoE layer's payloads at DeepSeek-V3's width (8, 64, 512 tokens, top-8):
                        through the host (.cpu(), .to(device): the data path now) against device copies
    nccl_self           NCCL as a world of one rank: send/recv to itself (else all_gather) captured in a
                        CUDA graph and replayed, values checked (a hang there costs only spec_tpot)
    spec_tpot           speculative decoding with the embedded model's MTP head, single mode, at
                        concurrency 1: TPOT with 0, 1 and 3 draft steps, accepted length, outputs equal

The timed parts are in gpu_timings.py, the AFD ones in gpu_afd.py, speculation in gpu_spec.py,
sparse MLA in gpu_sparse.py; correctness first, so that should the time run out, what is left undone
is speed. The limits add up to 7 minutes 40 s, the default --deadline-s (the dry run's are three
times theirs: the CPU's cores are few and slower).

    python -m benchmarks.kernels.gpu_check --json gpu_check.json          # on a GPU (no venv needed; from the root)
    python -m benchmarks.kernels.gpu_check --json check.json --dry-run    # the same on the CPU, tiny shapes
    python -m benchmarks.kernels.gpu_check --json check.json --parts ceilings,gpu_tests --quick
    python -m benchmarks.kernels.gpu_check --json afd.json --parts afd_one_gpu,afd_tpot   # the AFD parts alone

Exit status 0 when every part passed, 1 otherwise. The AFD test and parts need pyzmq (gpu_wheels.sh here).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.kernels import gpu_afd, gpu_sparse, gpu_spec, gpu_timings
from benchmarks.part_runner import PartTimeout, died, error_record, run_parts, summary, time_limit, write_json

ROOT = Path(__file__).resolve().parents[2]
# part -> time limit in seconds (also capped by what --deadline-s leaves); they add up to the default
# deadline. The expected times on an H200 are well under these: most of a part's first seconds are
# Triton compiling its kernels, and each AFD deployment starts two rank processes
PART_LIMITS_S = {
    "ceilings": 10,
    "gpu_tests": 125,
    "afd_one_gpu": 80,
    "fp8_checkpoint": 55,
    "kernels_timing": 30,
    "sparse_mla": 40,
    "decode_step_time": 20,
    "afd_tpot": 55,
    "moe_layer_staging": 10,
    "nccl_self": 15,
    "spec_tpot": 20,
}
# the dry run: the Triton interpreter and every rank process share the few cores of a CPU machine
DRY_RUN_SLACK = 3


def part_limits(dry_run: bool) -> dict:
    """PART_LIMITS_S, DRY_RUN_SLACK times over on the dry run."""
    return {name: limit * (DRY_RUN_SLACK if dry_run else 1) for name, limit in PART_LIMITS_S.items()}


@dataclass
class Context:
    """What the parts share: where they run, how big, and what earlier parts found."""

    device: torch.device
    dry_run: bool
    quick: bool
    workdir: Path
    report: dict
    checkpoints: dict = field(default_factory=dict)  # arch -> path
    earlier: dict = field(default_factory=dict)  # part -> record, of the run this process is one part of

    def part(self, name: str) -> dict:
        """The record of part `name` if it ran already, in this process or an earlier one; else {}."""
        return self.report["parts"].get(name) or self.earlier.get(name, {})

    def checkpoint(self, arch: str) -> str:
        """A tiny random checkpoint of `arch` (afd_engine.tiny_model), written once."""
        from afd_engine.tiny_model import make_tiny_model

        if arch not in self.checkpoints:
            self.checkpoints[arch] = str(make_tiny_model(self.workdir / arch, arch=arch))
        return self.checkpoints[arch]


# -- running parts -------------------------------------------------------------------------------


def run_part(name: str, fn, limit_s: float, *, ctx: Context, fail_part: str | None) -> dict:
    """One part in this process under its time limit: {"ok", "seconds", "headline", its results or
    "error"}. `fail_part` NAME makes part NAME raise; NAME:exit makes this process exit (a crash)."""
    start, record = time.perf_counter(), {"ok": False, "headline": ""}
    try:
        with time_limit(limit_s):
            if fail_part in (name, f"{name}:exit"):
                if fail_part.endswith(":exit"):
                    os._exit(70)
                raise RuntimeError(f"injected failure (--fail-part {name})")
            if ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ctx.device)
            result = fn(ctx)
        record.update(result, ok=not result.get("failures"))
    except (Exception, PartTimeout) as exc:
        record["error"] = error_record(exc)
        record["headline"] = f"{type(exc).__name__}: {exc}"[:100]
    record["seconds"] = round(time.perf_counter() - start, 3)
    gc.collect()
    return record | gpu_memory(ctx.device)


def gpu_memory(device: torch.device) -> dict:
    """The part's peak GPU memory, its cache released; or the CUDA error that every call now raises
    (after an illegal address, say: the reason parts run in processes of their own on a GPU)."""
    if device.type != "cuda":
        return {}
    try:
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        return {"peak_gpu_memory_gb": round(peak, 2)}
    except Exception as exc:
        return {"cuda_error_after": f"{type(exc).__name__}: {exc}"[:2000]}


def run_isolated(name: str, fn, limit_s: float, *, ns: argparse.Namespace, workdir: Path) -> dict:
    """One part in a process of its own (this script with --parts NAME), in a new session: a crash,
    a hang in C code or a broken CUDA context ends with it. Killed, with its rank processes, 30 s
    past its limit; its output goes to a log whose end the record keeps when the part failed."""
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.kernels.gpu_check",
        "--json",
        str(out),
        "--parts",
        name,
        "--isolate",
        "off",
    ]
    cmd += ["--deadline-s", str(limit_s), "--context", str(ns.json), *passed_flags(ns)]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit_s + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
    record = json.loads(out.read_text())["parts"].get(name) if out.exists() else None
    record = record or died(returncode, time.perf_counter() - start, limit_s + 30)
    record["process"] = {"returncode": returncode, "wall_s": round(time.perf_counter() - start, 3)}
    if not record["ok"]:
        record["log_tail"] = log.read_text(errors="replace").splitlines()[-40:]
        print(f"--- {name} failed; its log ends:", *record["log_tail"][-15:], sep="\n", file=sys.stderr)
    return record


def passed_flags(ns: argparse.Namespace) -> list[str]:
    """The flags a part's own process takes over from this run."""
    flags = ["--dry-run"] * ns.dry_run + ["--quick"] * ns.quick
    return flags + (["--fail-part", ns.fail_part] if ns.fail_part else [])


# -- header --------------------------------------------------------------------------------------


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def header(device: torch.device) -> dict:
    h = {
        "device": "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version_of("triton"),
        "transformers": version_of("transformers"),
        "pyzmq": version_of("pyzmq"),
        "cpus": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "dev_shm_free_gb": round(shutil.disk_usage("/dev/shm").free / 2**30, 2) if os.path.isdir("/dev/shm") else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "fp32_matmul_allows_tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        h.update(device=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count)
        h.update(gpu_memory_gb=round(p.total_memory / 2**30, 1), driver=nvidia_driver())
        h["cuda_driver_api"] = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
    return h


def cuda_unavailable_reason() -> str:
    try:
        torch.cuda.init()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "torch.cuda.is_available() is False"


# -- the GPU tests -------------------------------------------------------------------------------


def gpu_tests(ctx: Context) -> dict:
    """`python -m pytest -m gpu tests/gpu` in a process group of its own (killed with the part's
    time limit), its results read from its JUnit XML. The dry run runs the tests on the CPU
    (AFD_GPU_TESTS_ON_CPU=1, tiny shapes). Passes when pytest passes with at least one test run."""
    xml, log = ctx.workdir / "gpu_tests.xml", ctx.workdir / "gpu_tests.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={xml}", "-o", "junit_family=xunit1"]  # xunit1 keeps the recorded properties
    env = {**os.environ, "AFD_GPU_TESTS_ON_CPU": "1" if ctx.device.type != "cuda" else "0"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait()
        finally:
            if proc.poll() is None:  # the part's time limit interrupted the wait
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    tests = junit_results(xml) if xml.exists() else {}
    counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failed", "error", "skipped")}
    failures = [
        f"{name}: {t.get('message', '')[:300]}" for name, t in tests.items() if t["outcome"] in ("failed", "error")
    ]
    if returncode != 0 and not failures:
        failures.append(f"pytest exited with status {returncode}")
    if not counts["passed"]:
        failures.append("no test ran")
    record = {"returncode": returncode, "counts": counts, "tests": tests, "failures": failures}
    record["headline"] = ", ".join(f"{n} {k}" for k, n in counts.items() if n) + worst_kernel(tests)
    if failures:
        record["log_tail"] = log.read_text(errors="replace").splitlines()[-40:]
    return record


def junit_results(path: Path) -> dict:
    """test id -> {"outcome", "seconds", its recorded properties, "message" when it did not pass}."""
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        entry = {"outcome": "passed", "seconds": float(case.get("time") or 0)}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                entry.update(outcome=outcome, message=found.get("message") or "")
        for prop in case.iter("property"):
            entry[prop.get("name")] = number_or_text(prop.get("value"))
        tests[f"{case.get('classname')}::{case.get('name')}"] = entry
    return tests


def number_or_text(value: str | None):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def worst_kernel(tests: dict) -> str:
    """'; worst KERNEL at X of its tolerance' over the kernel tests that recorded their error."""
    ratios = [
        (t["rel_err"] / max(t["tolerance"], 1e-30), name.rsplit("[", 1)[-1].rstrip("]"))
        for name, t in tests.items()
        if isinstance(t.get("rel_err"), float) and isinstance(t.get("tolerance"), float)
    ]
    return f"; worst kernel {max(ratios)[1]} at {max(ratios)[0]:.2g}x" if ratios else ""


PARTS = {
    "ceilings": gpu_timings.ceilings,
    "gpu_tests": gpu_tests,
    "afd_one_gpu": gpu_afd.afd_one_gpu,
    "fp8_checkpoint": gpu_afd.fp8_checkpoint,
    "kernels_timing": gpu_timings.kernels_timing,
    "sparse_mla": gpu_sparse.sparse_mla,
    "decode_step_time": gpu_timings.decode_step_time,
    "afd_tpot": gpu_afd.afd_tpot,
    "moe_layer_staging": gpu_timings.moe_layer_staging,
    "nccl_self": gpu_afd.nccl_self,
    "spec_tpot": gpu_spec.spec_tpot,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, type=Path, help="write the report here (after every part)")
    parser.add_argument("--dry-run", action="store_true", help="everything on the CPU at tiny shapes")
    parser.add_argument("--quick", action="store_true", help="fewer timed repetitions, no timing sweeps")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of: {', '.join(PARTS)}")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="parts not started by then are not run (default: the sum of the part limits, 7 min 40 s on a GPU)",
    )
    parser.add_argument(
        "--isolate",
        default="auto",
        choices=("auto", "on", "off"),
        help="each part in a process of its own (auto: on a GPU, where a kernel can break the CUDA context)",
    )
    parser.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)  # the whole run's report
    parser.add_argument("--fail-part", default=None, help=argparse.SUPPRESS)  # tests: NAME raises, NAME:exit exits
    ns = parser.parse_args(argv)
    unknown = sorted(set(ns.parts.split(",")) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    if ns.deadline_s is None:
        ns.deadline_s = sum(part_limits(ns.dry_run).values())
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.dry_run or not torch.cuda.is_available():  # before the first Triton kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    torch.manual_seed(0)
    device = torch.device("cpu" if ns.dry_run else "cuda")
    report = {"header": header(device if torch.cuda.is_available() else torch.device("cpu"))}
    report.update(args={k: str(v) for k, v in vars(ns).items()}, parts={}, finished=False)
    if device.type == "cuda" and not torch.cuda.is_available():
        report["error"] = f"no usable GPU ({cuda_unavailable_reason()}); --dry-run runs the checks on the CPU"
        write_json(ns.json, report)
        print(report["error"], file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        parts = {p: PARTS[p] for p in ns.parts.split(",")}
        limits = part_limits(ns.dry_run)
        ok = run_parts(parts, report, ns.json, ns.deadline_s, runner(ns, report, workdir), limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"device: {report['header']['device']}; report: {ns.json}\n{summary(report)}")
    return 0 if ok else 1


def runner(ns: argparse.Namespace, report: dict, workdir: Path):
    """How each part runs: in a process of its own (--isolate), or in this one."""
    if ns.isolate == "on" or (ns.isolate == "auto" and not ns.dry_run):
        return functools.partial(run_isolated, ns=ns, workdir=workdir)
    earlier = json.loads(ns.context.read_text())["parts"] if ns.context and ns.context.exists() else {}
    device = torch.device("cpu" if ns.dry_run else "cuda")
    ctx = Context(device, ns.dry_run, ns.quick, workdir, report, earlier=earlier)
    return functools.partial(run_part, ctx=ctx, fail_part=ns.fail_part)


if __name__ == "__main__":
    sys.exit(main())

"""gpu_check (benchmarks/kernels): the dry run checks every part on the CPU (the GPU tests of
tests/gpu too, at tiny shapes, and the AFD parts with both ranks on the one device), a failing part
is recorded and the rest still run (a crashing one too, when parts run in processes of their own),
the report is on disk after every part, a part over its time limit is stopped, and the limits fit
the run in 7 minutes 40 s."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from afd_engine.engine_args import EngineArgs
from afd_engine.errors import ConfigError
from benchmarks.kernels import gpu_afd, gpu_check, gpu_sparse

PARTS = list(gpu_check.PARTS)
GPU_TESTS_AT_LEAST = 26  # marked gpu: 15 kernels, 8 single engine, 2 AFD, 1 CUDA graphs, and more since


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.gpu_check", *args], capture_output=True, text=True, timeout=timeout
    )


def gpu_tests_collected() -> int:
    """How many tests of tests/gpu pytest selects with -m gpu (each one the dry run must pass)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return sum(line.startswith("tests/gpu/") and "::" in line for line in res.stdout.splitlines())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every part, with the first part made to raise: (process, report). Under
    xdist the first worker runs it and the others read its files (a dry run takes a minute)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    out, saved = root / "gpu_check.json", root / "gpu_check.run.json"
    with open(root / "gpu_check.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            res = run_script("--dry-run", "--json", str(out), "--fail-part", "ceilings", timeout=540)
            saved.write_text(json.dumps({"returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr}))
    run = json.loads(saved.read_text())
    res = subprocess.CompletedProcess(["gpu_check.py"], run["returncode"], run["stdout"], run["stderr"])
    return res, json.loads(out.read_text())


def test_header_says_what_ran_where(dry_run):
    header = dry_run[1]["header"]
    assert header["device"] == "cpu" and header["torch"] == torch.__version__
    assert header["triton_interpret"] is True and header["triton"] and header["transformers"]


def test_every_part_but_the_failed_one_passes_on_the_cpu(dry_run):
    res, report = dry_run
    assert list(report["parts"]) == PARTS and report["finished"] is True
    for name in PARTS[1:]:
        part = report["parts"][name]
        assert part["ok"], (name, part.get("error"), part.get("failures"))
        assert part["seconds"] > 0 and part["headline"], name
        assert f"{name:<20} ok" in res.stdout


def test_a_failing_part_is_recorded_and_fails_the_run(dry_run):
    res, report = dry_run
    failed = report["parts"]["ceilings"]
    assert failed["ok"] is False and report["ok"] is False and res.returncode == 1
    assert failed["error"]["type"] == "RuntimeError"
    assert failed["error"]["message"] == "injected failure (--fail-part ceilings)"
    assert any("injected failure" in line for line in failed["error"]["traceback"])
    assert f"{'ceilings':<20} FAIL" in res.stdout


def test_the_gpu_tests_run_on_the_cpu_and_pass(dry_run):
    part = dry_run[1]["parts"]["gpu_tests"]
    collected = gpu_tests_collected()
    assert collected >= GPU_TESTS_AT_LEAST
    assert part["counts"] == {"passed": collected, "failed": 0, "error": 0, "skipped": 0}, part.get("log_tail")
    assert part["headline"].startswith(f"{collected} passed; worst kernel ")
    tests = {name.split("::", 1)[1]: t for name, t in part["tests"].items()}
    assert all(t["outcome"] == "passed" and t["seconds"] >= 0 for t in tests.values())
    kernels = {k.split("[")[1].rstrip("]"): t for k, t in tests.items() if k.startswith("test_kernel_agrees")}
    assert {"mla_bf16_page1", "gqa_fp32_page16", "moe_fp8_bf16_activations", "fp8_quantize_bf16"} <= set(kernels)
    for name, case in kernels.items():
        assert 0 <= case["rel_err"] <= case["tolerance"], (name, case)
    assert kernels["fp8_quantize_bf16"]["rel_err"] == 0 and kernels["mla_fp32_page64"]["rel_err"] < 1e-5
    single = {k: t for k, t in tests.items() if k.startswith("test_fp32_greedy")}
    assert len(single) == 6 and all(t["matched"] == t["tokens"] == 3 * 3 for t in single.values())  # 3 archs x 2
    assert all(t["max_logprob_diff"] < 1e-4 for t in single.values())
    afd = [k for k in tests if k.startswith("test_afd_1a1f")]
    assert any("[shm" in k for k in afd) and "test_afd_1a1f_gives_the_single_engine_tokens[torch]" in afd  # gloo: NCCL
    for arch in ("deepseek_v3", "deepseek_v32"):
        assert tests[f"test_graph_decode_steps_give_the_eager_tokens[{arch}]"]["graph_replays"] > 0


def test_kernel_timings_cover_bench_kernels_and_the_sweeps(dry_run):
    sections = dry_run[1]["parts"]["kernels_timing"]["sections"]
    assert set(sections) == {"bench_kernels", "mla_grid", "moe_sweep", "moe_fp8_sweep"}
    rows = [r for s in sections.values() for r in s["rows"]]
    assert len(sections["mla_grid"]["rows"]) == 4 and all(r["us"] > 0 and r["gb_s"] > 0 for r in rows)
    assert all(r["hbm_fraction"] is None for r in rows)  # no catalog peak for a CPU


def test_sparse_mla_is_checked_then_timed_against_dense_mla_and_the_indexer(dry_run):
    part = dry_run[1]["parts"]["sparse_mla"]
    assert part["ok"] and part["failures"] == [], part.get("failures")
    assert part["shapes"] == gpu_sparse.TINY._asdict() | {"dtype": "bfloat16", "reps": 1}
    check = part["correctness"]
    assert check["ok"] and check["tolerance"] == {"atol": 1e-2, "rtol": 1e-2}
    assert check["shape"]["cache_row_stride"] == 32 + 8 + 16  # the MLA share of rows that hold the index key
    assert [(name, p["splits"], p["within"]) for name, p in check["paths"].items()] == [
        ("direct", 1, True),
        ("split", 3, True),
    ]
    assert 0 < check["max_abs_err"] <= 1e-2 and check["torch_max_abs_err_fp32_ref"] < 1e-2  # bf16 rounding
    cases = part["cases"]
    shapes = {name: (c["kernel"], c["tokens"], c.get("attended", c.get("context"))) for name, c in cases.items()}
    assert shapes == {
        "sparse_decode": ("sparse_mla", 4, 16),
        "sparse_single": ("sparse_mla", 1, 16),
        "sparse_prefill": ("sparse_mla", 8, 16),
        "dense_2k": ("mla_decode", 4, 16),
        "dense_32k": ("mla_decode", 4, 64),
        "indexer": ("indexer", 4, 64),
    }
    assert all(c["us"] > 0 and c["gb_s"] > 0 and c["tflop_s"] > 0 for c in cases.values())
    assert all(c["hbm_fraction"] is None for c in cases.values())  # no catalog peak for a CPU
    assert cases["indexer"]["slots_in_own_sequence"] is True
    us = {name: c["us"] for name, c in cases.items()}
    assert part["ratios"] == {
        "dense_32k_over_sparse_2k": us["dense_32k"] / us["sparse_decode"],
        "sparse_over_dense_2k": us["sparse_decode"] / us["dense_2k"],
        "indexer_share": us["indexer"] / (us["indexer"] + us["sparse_decode"]),
    }
    assert part["headline"].startswith(f"sparse 4x16 {us['sparse_decode']:.0f} us, dense 64/sparse ")


def test_sparse_mla_check_fails_a_kernel_that_reads_unused_slots(monkeypatch):
    """The correctness check on the CPU against a kernel that treats -1 entries as slot 0."""
    from kernels.triton import sparse_mla

    kernel = sparse_mla.sparse_mla_core_triton

    def reads_unused(q_latent, q_pe, cache, indices, scale, num_splits=None):
        return kernel(q_latent, q_pe, cache, indices.clamp(min=0), scale, num_splits)

    assert gpu_sparse.check_kernel(gpu_sparse.TINY, torch.device("cpu"))["ok"] is True
    monkeypatch.setattr(sparse_mla, "sparse_mla_core_triton", reads_unused)
    check = gpu_sparse.check_kernel(gpu_sparse.TINY, torch.device("cpu"))
    assert check["ok"] is False and check["max_abs_err"] > 0.1
    assert [p["within"] for p in check["paths"].values()] == [False, False]


def test_decode_step_times_per_batch(dry_run):
    part = dry_run[1]["parts"]["decode_step_time"]
    assert [r["batch"] for r in part["rows"]] == [1, 8, 64] and all(r["step_ms"] > 0 for r in part["rows"])
    assert not any(r["cuda_graphs"] or r["graph_replays"] for r in part["rows"])  # the CPU runs eagerly
    assert "eager: CUDA graphs need a GPU" in part["headline"]


def test_afd_on_one_device_gives_single_mode_tokens_with_graphs_on_and_off(dry_run):
    part = dry_run[1]["parts"]["afd_one_gpu"]
    cases = part["cases"]
    assert list(cases) == [f"{d}_graphs_{g}" for d in ("fp32", "bf16") for g in ("on", "off")]
    for name, case in cases.items():
        assert case["tokens"] == 3 * 3 and case["cuda_graphs"] is False, name  # the CPU: static decode only
        for role in ("single", "afd"):  # static decode ran exactly where asked for
            assert (case[role]["static_decode_batches"] > 0) == case["graphs"], (name, role, case[role])
        assert case["afd"]["device_payloads"] is False and case["afd"]["payload_device"] is None, case["afd"]  # a CPU
    for case in cases.values():
        if case["dtype"] == "float32":
            assert case["equal"] and case["matched"] == case["tokens"] and case["agreement"] == 1.0
        else:
            assert case["max_first_logprob_diff"] <= gpu_afd.BF16_MAX_FIRST_LOGPROB_DIFF
            assert 0 < case["agreement"] <= 1
    assert part["headline"].startswith("AFD vs single tokens: fp32 on 9/9, fp32 off 9/9, bf16 on ")


def test_fp8_experts_give_equal_tokens_in_single_mode_and_afd(dry_run):
    cases = dry_run[1]["parts"]["fp8_checkpoint"]["cases"]
    assert list(cases) == ["fp8_checkpoint", "bf16_ffn_weight_dtype_fp8"]
    for name, case in cases.items():
        assert case["equal"] and case["matched"] == case["tokens"] == 3 * 3, (name, case.get("error"))
        assert case["backend"] == "triton" and case["single"]["experts_fp8"] is True, name  # fused_moe_fp8


def test_afd_tpot_against_single_mode_at_batch_1_8_64(dry_run):
    part = dry_run[1]["parts"]["afd_tpot"]
    assert list(part["cases"]) == ["single_graphs_on", "afd_graphs_on", "single_graphs_off", "afd_graphs_off"]
    rows = [r for case in part["cases"].values() for r in case["rows"]]
    combos = [(m, g, b) for g in (True, False) for m in ("single", "afd") for b in (1, 8, 64)]
    assert [(r["mode"], r["graphs"], r["batch"]) for r in rows] == combos
    assert all(isinstance(r["tpot_ms"], float) for r in rows)  # CPU times: any sign, meaning nothing
    for name, case in part["cases"].items():
        assert (case["static_decode_batches"] > 0) == ("graphs_on" in name), (name, case["static_decode_batches"])
        assert case["tokens"] == [2, 6] and case["reps"] == 3
    on, off = part["afd_over_single"]["graphs_on"], part["afd_over_single"]["graphs_off"]
    assert list(on) == list(off) == ["1", "8", "64"]
    assert part["target"] == 1.5 and part["target_met"] == (0 < on["8"] <= 1.5)
    assert part["headline"].startswith("AFD/single TPOT, graphs on: B1 ")


def test_moe_layer_staging_times_host_and_device_payloads(dry_run):
    part = dry_run[1]["parts"]["moe_layer_staging"]
    assert [r["tokens"] for r in part["rows"]] == [8, 64, 512] and all(r["host_over_device"] > 0 for r in part["rows"])


def test_nccl_self_stands_in_with_gloo_and_says_what_it_skipped(dry_run):
    part = dry_run[1]["parts"]["nccl_self"]
    assert (part["backend"], part["op"], part["graph"]) == ("gloo", "all_gather", False)
    assert part["skipped"] == {"graph_capture": "CUDA graphs need a GPU: gloo on the CPU runs the ops eagerly"}
    assert part["unusable"]["send_recv"].startswith("eager: ")  # gloo pairs no rank with itself


def test_spec_tpot_times_speculation_against_none_with_equal_outputs(dry_run):
    part = dry_run[1]["parts"]["spec_tpot"]
    assert part["ok"] and part["all_exact"] is True and part["target"] == 0.7
    assert [(r["mode"], r["steps"], r["concurrency"]) for r in part["rows"]] == [("single", 0, 1), ("single", 1, 1)]
    assert part["rows"][0]["accepted_length"] is None and 1.0 <= part["rows"][1]["accepted_length"] <= 2.0
    assert part["headline"] == f"spec TPOT / off at concurrency 1: 1 drafts {part['rows'][1]['tpot_vs_off']:.2f}x"


def test_part_limits_fit_the_default_deadline_of_7_minutes_40():
    assert list(gpu_check.PART_LIMITS_S) == PARTS
    assert gpu_check.PART_LIMITS_S["sparse_mla"] == 40
    assert gpu_check.parse_args(["--json", "x.json"]).deadline_s == sum(gpu_check.PART_LIMITS_S.values()) <= 7 * 60 + 40
    dry = gpu_check.part_limits(dry_run=True)  # the CPU's slack
    assert dry == {name: 3 * limit for name, limit in gpu_check.PART_LIMITS_S.items()}
    assert gpu_check.parse_args(["--json", "x.json", "--dry-run"]).deadline_s == sum(dry.values())
    assert gpu_check.parse_args(["--json", "x.json", "--deadline-s", "60"]).deadline_s == 60


def test_a_subset_of_parts_that_passes_exits_0(tmp_path):
    out = tmp_path / "ceilings.json"
    res = run_script("--dry-run", "--json", str(out), "--parts", "ceilings", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    part = json.loads(out.read_text())["parts"]
    assert list(part) == ["ceilings"] and part["ceilings"]["copy_gb_s"] > 0


def test_a_part_whose_process_dies_is_recorded_and_the_next_runs(tmp_path):
    out = tmp_path / "isolated.json"
    args = ["--parts", "gpu_tests,ceilings", "--fail-part", "gpu_tests:exit"]
    res = run_script("--dry-run", "--isolate", "on", "--json", str(out), *args, timeout=120)
    parts = json.loads(out.read_text())["parts"]
    assert res.returncode == 1 and list(parts) == ["gpu_tests", "ceilings"]
    died = parts["gpu_tests"]
    assert died["error"]["type"] == "PartProcessDied" and "exited with status 70" in died["error"]["message"]
    assert died["process"]["returncode"] == 70 and isinstance(died["log_tail"], list)
    assert parts["ceilings"]["ok"] and parts["ceilings"]["process"]["returncode"] == 0


def test_unknown_parts_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--json", "x.json", "--parts", "ceilings,kernels"])
    assert exit_info.value.code == 2 and "unknown part(s) kernels" in capsys.readouterr().err


def in_process(tmp_path):
    """(report, run_one) of parts run in this process on the CPU."""
    report = {"parts": {}}
    ctx = gpu_check.Context(torch.device("cpu"), True, False, tmp_path, report)
    return report, functools.partial(gpu_check.run_part, ctx=ctx, fail_part=None)


def test_report_is_on_disk_after_each_part_and_limits_stop_a_part(tmp_path):
    path = tmp_path / "report.json"
    report, run_one = in_process(tmp_path)

    def first(ctx):
        return {"headline": "first", "value": 1}

    def second(ctx):  # sees the first part's record in the file
        return {"headline": "second", "seen": json.loads(path.read_text())["parts"]["first"]["value"]}

    def slow(ctx):
        time.sleep(5)
        return {}

    def broken(ctx):
        raise ValueError("bad shape")

    parts = {"first": first, "second": second, "slow": slow, "broken": broken, "after": first}
    ok = gpu_check.run_parts(parts, report, path, 60, run_one, limits={"slow": 0.2})
    report = json.loads(path.read_text())
    assert not ok and report["finished"] and list(report["parts"]) == list(parts)
    assert report["parts"]["second"]["seen"] == 1
    assert report["parts"]["slow"]["error"]["type"] == "PartTimeout" and report["parts"]["slow"]["seconds"] < 2
    assert report["parts"]["broken"]["error"]["message"] == "bad shape"
    assert [p["ok"] for p in report["parts"].values()] == [True, True, False, False, True]


def test_parts_past_the_deadline_are_not_run(tmp_path):
    report, run_one = in_process(tmp_path)
    ran = []
    gpu_check.run_parts({"a": lambda c: ran.append("a") or {}}, report, tmp_path / "r.json", 4, run_one, {})
    assert ran == [] and report["parts"]["a"]["headline"] == "not run: --deadline-s spent"


def test_ranks_share_one_gpu_with_gpu_id_step_0(monkeypatch):
    """What tests/gpu/test_engine_afd.py relies on to put both ranks on one GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"rank 1 needs GPU 1 \(--base-gpu-id=0 \+ rank x --gpu-id-step=1\)"):
        EngineArgs(device="cuda").device_for(1)
    assert EngineArgs(device="cuda", gpu_id_step=0).device_for(1) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="--device=cuda but torch sees no CUDA GPU"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        EngineArgs(device="cuda", gpu_id_step=0).device_for(1)

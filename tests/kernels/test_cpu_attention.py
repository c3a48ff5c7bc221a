"""CpuMLA and CpuGQA (kernels/cpu_attention.py, the C decode core of kernels/csrc/paged_decode.c)
against the torch references, and how the C library is built, cached and done without.

The inputs scramble the page order and fill every cache row no sequence owns (and the page table's
padding entries' pages) with NaN: a kernel that ignores the page table or reads past kv_lens
returns NaN or another sequence's tokens. The kernel gets no slot table or bias.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.cpu_attention import CpuGQA, CpuMLA, heads_per_task
from kernels.gqa import TorchGQA
from kernels.mla import TorchMLA
from tests.kernels.paged import make_gqa_case, make_mla_case

V3 = {"C": 512, "R": 64, "Dn": 128, "Dv": 128}  # DeepSeek-V3's head dims
SMALL = {"C": 24, "R": 8, "Dn": 16, "Dv": 12}  # sizes no vector width divides


def decode_both(kv_lens, page_size, heads, dims, dtype=torch.float32, seed=0, slot_tables=False):
    """(CpuMLA output, TorchMLA output) of one decode step on CPU tensors; CpuMLA gets the page table
    only, or with `slot_tables` the reference's slot table and bias too (what its fallback reads)."""
    q_nope, q_pe, cache, kv, w_kv_b, scale = (
        t.cpu() if isinstance(t, torch.Tensor) else t
        for t in make_mla_case(kv_lens, page_size, heads, **dims, dtype=dtype, seed=seed)
    )
    kv = kv._replace(**{k: getattr(kv, k).cpu() for k in ("slots", "bias", "pages", "kv_lens")})
    cpu = CpuMLA()
    w_uk, w_uv = cpu.absorb(w_kv_b, heads, dims["Dn"], dims["Dv"])
    ref = TorchMLA().decode(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)
    out = cpu.decode(q_nope, q_pe, cache, kv if slot_tables else kv._replace(slots=None, bias=None), w_uk, w_uv, scale)
    return out, ref


def test_the_kernel_is_built_where_a_c_compiler_is():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine: CpuMLA runs the torch reference (tested below)")
    assert CpuMLA().native and CpuGQA().native


@pytest.mark.parametrize(
    "kv_lens,page_size,heads",
    [
        ([1, 5, 17, 100], 1, 4),  # one token per page
        ([1, 5, 17, 100], 16, 6),  # heads not a multiple of four
        ([31, 32, 33, 64, 65], 16, 4),  # around the kernel's 32-token blocks
        ([40, 200], 64, 3),  # pages longer than a block
        ([130], 16, 16),  # one sequence: its heads are split over the threads
    ],
)
def test_decode_matches_the_reference_with_deepseek_v3_dims(kv_lens, page_size, heads):
    out, ref = decode_both(kv_lens, page_size, heads, V3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_decode_matches_the_reference_at_odd_sizes():
    out, ref = decode_both([3, 9, 1, 27, 50, 7, 2, 11, 64], 4, 5, SMALL, seed=1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_heads_per_task_fills_the_threads():
    assert heads_per_task(tasks=32, heads=4, threads=2) == 4  # one task per sequence
    assert heads_per_task(tasks=1, heads=4, threads=2) == 1  # four tasks for two threads
    assert heads_per_task(tasks=1, heads=128, threads=8) == 8  # 16 tasks
    assert heads_per_task(tasks=64, heads=256, threads=2) == 128  # at most the kernel's limit
    assert heads_per_task(tasks=3, heads=1, threads=16) == 1


def gqa_both(kv_lens, page_size, heads, kv_heads, D, seed=0):
    """(CpuGQA output, TorchGQA output) of one decode step on CPU tensors (CpuGQA: no slot table)."""
    q, cache, kv, scale = make_gqa_case(kv_lens, page_size, heads, kv_heads, D, torch.float32, seed)
    q, cache = q.cpu(), cache.cpu()
    kv = kv._replace(**{k: getattr(kv, k).cpu() for k in ("slots", "bias", "pages", "kv_lens")})
    ref = TorchGQA().decode(q, cache, kv, kv_heads, scale)
    return CpuGQA().decode(q, cache, kv._replace(slots=None, bias=None), kv_heads, scale), ref


@pytest.mark.parametrize(
    "kv_lens,page_size,heads,kv_heads,D",
    [
        ([1, 5, 17, 100], 16, 8, 2, 16),  # four query heads per key/value head
        ([31, 32, 33, 64, 65], 4, 6, 3, 12),  # two per head, a head size no vector width divides
        ([130], 16, 32, 4, 128),  # Qwen3-MoE's head size, one sequence
        ([9, 40], 64, 4, 4, 32),  # as many key/value heads as query heads
    ],
)
def test_gqa_decode_matches_the_reference(kv_lens, page_size, heads, kv_heads, D):
    out, ref = gqa_both(kv_lens, page_size, heads, kv_heads, D)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_other_dtypes_run_the_reference():
    out, ref = decode_both([5, 17], 16, 4, V3, dtype=torch.bfloat16, slot_tables=True)
    assert torch.equal(out, ref)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """No library loaded in this process, and an empty cache directory."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("AFD_KERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_without_a_compiler_decode_runs_the_reference(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        cpu = CpuMLA()
    assert not cpu.native
    assert "no C compiler" in caplog.text and "paged_decode" in caplog.text
    out, ref = decode_both([5, 17], 16, 4, V3, slot_tables=True)  # the reference's own result
    assert torch.equal(out, ref)


def test_native_kernels_can_be_switched_off(fresh_build, monkeypatch):
    monkeypatch.setenv("AFD_NATIVE_KERNELS", "0")
    assert not CpuMLA().native


def test_a_failed_build_runs_the_reference(fresh_build, monkeypatch, tmp_path, caplog):
    bad = tmp_path / "src"
    bad.mkdir()
    (bad / "paged_decode.c").write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCES", bad)
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        assert native.library("paged_decode") is None
    assert "could not be built" in caplog.text and "Error building extension" in caplog.text


NO_COMPILER = native.compiler() is None


@pytest.mark.skipif(NO_COMPILER, reason="no C compiler")
def test_the_library_is_built_once_and_reused(fresh_build):
    """A new process finds the library in its build directory and loads it as it is, without
    importing the builder (torch.utils.cpp_extension, which imports setuptools)."""
    assert native.library("paged_decode") is not None
    (built,) = fresh_build.glob("paged_decode-*/afd_paged_decode*.so")
    stamp = built.stat().st_mtime_ns
    code = (
        "import sys\nfrom kernels import native\n"
        "print(native.library('paged_decode') is not None, 'torch.utils.cpp_extension' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    if built.name == "afd_paged_decode.so":  # (a second build in this process is named _v1 by torch)
        assert res.stdout.split() == ["True", "False"], res.stderr
    assert built.stat().st_mtime_ns == stamp


@pytest.mark.skipif(NO_COMPILER, reason="no C compiler")
def test_an_unwritable_cache_directory_builds_in_the_temporary_one(fresh_build, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AFD_KERNEL_CACHE", str(blocker / "kernels"))  # cannot be made
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert native.library("paged_decode") is not None
    assert list((tmp_path / "tmp").glob("afd-engine-kernels-*/paged_decode-*/afd_paged_decode*.so"))


@pytest.mark.skipif(NO_COMPILER, reason="no C compiler")
@pytest.mark.timeout(120)  # without the clearing, the build waits for the lock forever
def test_a_lock_left_by_a_killed_build_is_cleared(fresh_build, monkeypatch):
    """cpp_extension's lock file outlives a build killed halfway; past COMPILE_TIMEOUT_S it is removed
    (a fresh one is a build under way, and is waited for)."""
    source = native.SOURCES / "rms_norm.c"
    lock = native._build_dir(source, native.compiler()) / "lock"
    lock.touch()
    os.utime(lock, (0, 0))
    assert native.library("rms_norm") is not None and not lock.exists()

"""The C kernels as torch operators (torch.ops.afd.*, registered by kernels/native.py's `cpu_op`):
each passes torch.library.opcheck, and each backend's kernel path compiles with fullgraph=True to
a graph holding its operator, with eager's result bit for bit. Without the C library the operators
still exist and the same paths trace to the backends' torch code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from afd_engine.model_config import RopeConfig
from afd_engine.models.norm import RMSNorm
from afd_engine.models.rope import RotaryEmbedding
from kernels import cpu_norm, cpu_rope, native
from kernels.cpu_attention import CpuGQA, CpuMLA
from kernels.cpu_moe import CpuMoE
from tests.kernels.paged import make_gqa_case, make_mla_case
from tests.kernels.test_cpu_moe import case as moe_case

OPS = ("fused_moe_f32", "paged_decode_f32", "rms_norm_f32", "rope_f32")
PATHS = ("rms_norm", "rope", "fused_moe", "gqa_decode", "mla_decode")  # backends' calls of them
MLA = {"C": 32, "R": 8, "Dn": 16, "Dv": 12}


@pytest.fixture
def kernels_built():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine: the backends run torch (see the last tests)")


def gqa_inputs():
    """CpuGQA.decode's arguments: 3 sequences, 4 query heads on 2 key/value heads of 8."""
    q, cache, kv, scale = make_gqa_case([3, 9, 17], 4, 4, 2, 8, torch.float32)
    return q, cache, kv, 2, scale


def mla_inputs():
    """CpuMLA.decode's arguments: 2 sequences, 4 heads."""
    q_nope, q_pe, cache, kv, w_kv_b, scale = make_mla_case([5, 17], 16, 4, **MLA, dtype=torch.float32)
    w_uk, w_uv = CpuMLA().absorb(w_kv_b, 4, MLA["Dn"], MLA["Dv"])
    return q_nope, q_pe, cache, kv, w_uk, w_uv, scale


def op_inputs(name):
    """Representative fp32 CPU arguments of torch.ops.afd.<name>."""
    if name == "fused_moe_f32":
        return moe_case(5, 8, 16, 8, 2)
    if name == "paged_decode_f32":
        q, cache, kv, kv_heads, scale = gqa_inputs()
        # no NaN in the unread rows: opcheck compares the inputs before and after the call
        return (q * scale, cache.nan_to_num(7.0), kv.pages, kv.kv_lens, kv_heads, 8, kv_heads * 8, kv.page_size)
    if name == "rms_norm_f32":
        return torch.randn(5, 40)[:, :32], torch.randn(32), 1e-6  # rows of a wider tensor, read in place
    x = torch.randn(6, 4, 24)[..., 8:]  # heads 24 apart, as MLA's rope part of the query
    return x, torch.rand(6, 8), torch.rand(6, 8), True


@pytest.mark.parametrize("name", OPS)
def test_each_operator_passes_opcheck(kernels_built, name):
    op = getattr(torch.ops.afd, name).default
    args = op_inputs(name)
    torch.library.opcheck(op, args)  # schema, fake implementation, AOT dispatch with dynamic shapes
    # an input that requires grad: not differentiable, the operator records nothing for autograd
    grad_args = (args[0].clone().requires_grad_(), *args[1:])
    torch.library.opcheck(op, grad_args, test_utils="test_autograd_registration")
    assert not op(*grad_args).requires_grad


def traced(fn, *args, fullgraph=True):
    """fn compiled (with fullgraph, a graph break raises), run once: (its result, the targets of the
    call_function nodes of its graphs)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()  # a graph cached by an earlier test would not reach this backend
    with torch.inference_mode():  # as the engine's forward runs
        return torch.compile(fn, fullgraph=fullgraph, backend=backend)(*args), targets


def backend_path(path):
    """(the operator, a backend's function that calls it, the function's arguments)."""
    rope = RotaryEmbedding(RopeConfig(interleave=True), 8)
    q_pe = torch.randn(6, 4, 24)[..., 16:]  # the rope slice of a query, read in place
    return {
        "rms_norm": lambda: ("rms_norm_f32", RMSNorm(32, 1e-6), (torch.randn(5, 32),)),
        "rope": lambda: ("rope_f32", rope.apply, (q_pe, *rope.cos_sin(torch.arange(6), torch.float32))),
        "fused_moe": lambda: ("fused_moe_f32", CpuMoE().fused_moe, moe_case(7, 8, 16, 8, 2)),
        "gqa_decode": lambda: ("paged_decode_f32", CpuGQA().decode, gqa_inputs()),
        "mla_decode": lambda: ("paged_decode_f32", CpuMLA().decode, mla_inputs()),
    }[path]()


@pytest.mark.parametrize("path", PATHS)
def test_each_kernel_path_compiles_to_one_graph_holding_its_operator(kernels_built, path):
    name, fn, args = backend_path(path)
    out, targets = traced(fn, *args)
    assert getattr(torch.ops.afd, name).default in targets
    with torch.inference_mode():
        assert torch.equal(out, fn(*args))


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """A process in which the C library cannot be built (AFD_NATIVE_KERNELS=0)."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(cpu_norm, "_fn", None)
    monkeypatch.setattr(cpu_rope, "_fn", None)
    monkeypatch.setenv("AFD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AFD_NATIVE_KERNELS", "0")
    yield
    torch._dynamo.reset()  # the graphs traced without the library must not serve later tests


@pytest.mark.parametrize("path", PATHS)
def test_without_the_library_the_same_paths_compile_to_torch_code(no_library, path):
    name, fn, args = backend_path(path)
    # the torch MoE reference sizes its blocks by host reads (kernels/moe.py): graphs, not one
    out, targets = traced(fn, *args, fullgraph=path != "fused_moe")
    assert not [t for t in targets if str(t).startswith("afd.")]
    assert targets  # the torch code, traced
    with torch.inference_mode():
        assert torch.equal(out, fn(*args))


def test_the_operators_are_registered_at_import_without_building_anything():
    code = (
        "import torch, kernels.cpu_attention, kernels.cpu_moe, kernels.cpu_norm, kernels.cpu_rope\n"
        "from kernels import native\n"
        f"print(native._loaded, *(hasattr(torch.ops.afd, name) for name in {OPS}))\n"
    )
    env = {**os.environ, "AFD_NATIVE_KERNELS": "0"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["{}"] + ["True"] * len(OPS)

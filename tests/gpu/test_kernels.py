"""Every Triton kernel the engine launches (MLA and GQA decode, fused MoE bf16/fp32 and fp8, fp8
quantize/dequantize) at DeepSeek-V3 and Qwen3-30B-A3B shapes on the GPU, against the torch
reference on the same random inputs (tests/gpu/kernel_cases.py): within fp32 1e-3, bf16 2e-2, fp8
MoE 5e-2 of the reference's norm, and fp8 quantization bit-exact to comm/wire.py."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import kernel_cases

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", kernel_cases.NAMES)
def test_kernel_agrees_with_the_torch_reference(name, device, tiny, record_property):
    fn, tolerance = kernel_cases.cases(tiny, device)[name]
    torch.manual_seed(0)
    error = fn()
    record_property("rel_err", error)
    record_property("tolerance", tolerance)
    assert 0 <= error <= tolerance
    if tiny and name == "mla_fp32_page64":  # fp32 under the interpreter: the reference's products
        assert error < 1e-5

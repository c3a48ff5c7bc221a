"""The Triton kernels against the torch reference on the same random inputs, as relative norm
errors ||out - ref|| / ||ref||: MLA and GQA decode over ragged sequences in scrambled, NaN-padded
pages (tests/kernels/paged.py), fused MoE in bf16/fp32 and with fp8 weights, and the fp8
quantization of activations against comm/wire.py's bit for bit."""

from __future__ import annotations

import functools

import torch

from benchmarks.kernels import bench_kernels as bk
from kernels.registry import attention_backend, moe_backend

# fp8 MoE: the kernel re-quantizes the SwiGLU output to fp8, which the reference does not (about
# 2% of the norm on the CPU tests); fp8 quantization: bit-exact to comm/wire.py
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, "fp8_moe": 5e-2, "fp8_bits": 0.0}
V3_MLA = {"heads": 128, "C": 512, "R": 64, "Dn": 128, "Dv": 128}
TINY_MLA = {"heads": 4, "C": 32, "R": 8, "Dn": 16, "Dv": 16}


def rel_norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def on_device(case: tuple, device: torch.device) -> list:
    """A tests/kernels/paged.py case (made on its DEVICE) moved to `device`; PagedKV field by field."""
    from kernels.mla import PagedKV

    def move(t):
        if isinstance(t, PagedKV):
            return PagedKV(*(x.to(device) for x in t[:4]), t.page_size)
        return t.to(device) if isinstance(t, torch.Tensor) else t

    return [move(t) for t in case]


def mla_error(kv_lens, page_size, dims, dtype, *, device) -> float:
    """TritonMLA decode against TorchMLA on ragged sequences in scrambled, NaN-padded pages."""
    from tests.kernels.paged import make_mla_case

    q_nope, q_pe, cache, kv, w_kv_b, scale = on_device(make_mla_case(kv_lens, page_size, **dims, dtype=dtype), device)
    ref_mla, mla = attention_backend("torch", "mla"), attention_backend("triton", "mla")
    w_uk, w_uv = ref_mla.absorb(w_kv_b, dims["heads"], dims["Dn"], dims["Dv"])
    ref = ref_mla.decode(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)
    return rel_norm_err(mla.decode(q_nope, q_pe, cache, kv._replace(slots=None, bias=None), w_uk, w_uv, scale), ref)


def gqa_error(kv_lens, page_size, heads, kv_heads, head_dim, dtype, *, device) -> float:
    """TritonGQA decode against TorchGQA, pages as in mla_error."""
    from tests.kernels.paged import make_gqa_case

    q, cache, kv, scale = on_device(make_gqa_case(kv_lens, page_size, heads, kv_heads, head_dim, dtype), device)
    ref = attention_backend("torch", "gqa").decode(q, cache, kv, kv_heads, scale)
    out = attention_backend("triton", "gqa").decode(q, cache, kv._replace(slots=None, bias=None), kv_heads, scale)
    return rel_norm_err(out, ref)


def moe_error(shape, dtype, remote: float = 0.0, *, device) -> float:
    """Triton fused MoE against the torch reference; `remote`: fraction of slots on other ranks (-1)."""
    (x, w13, w2, ids, weights), _, _ = bk.moe_case(shape, dtype, device)
    ids = ids.masked_fill(torch.rand(ids.shape, device=device) < remote, -1)
    ref = moe_backend("torch").fused_moe(x, w13, w2, ids, weights)
    return rel_norm_err(moe_backend("triton").fused_moe(x, w13, w2, ids, weights), ref)


def fp8_moe_reference(x, w13, s13, w2, s2, ids, weights) -> torch.Tensor:
    """fp8-quantized activations through the torch reference with dequantized weights, one expert at
    a time (every expert dequantized at once would take 45 GB at DeepSeek-V3's size)."""
    from afd_engine.models.loader import dequantize_fp8
    from comm import wire

    xq = wire.dequantize_fp8(*wire.quantize_fp8(x), torch.float32)
    out = torch.zeros_like(xq)
    for e in ids.unique().tolist():
        w13_e, w2_e = dequantize_fp8(w13[e], s13[e], (128, 128)), dequantize_fp8(w2[e], s2[e], (128, 128))
        out += moe_backend("torch").fused_moe(xq, w13_e[None], w2_e[None], torch.where(ids == e, 0, -1), weights)
    return out


def moe_fp8_error(shape, dtype, *, device) -> float:
    T, E, H, I, K = shape
    experts, (x, ids, weights) = bk.fp8_experts(E, H, I, device), bk.routed_tokens(T, E, H, K, dtype, device)
    out = moe_backend("triton").fused_moe_fp8(x, *experts, ids, weights)
    return rel_norm_err(out, fp8_moe_reference(x, *experts, ids, weights))


def fp8_bits_error(T: int, H: int, dtype, *, device) -> float:
    """Fraction of fp8 bytes, scales and dequantized values of the Triton kernels that differ from
    comm/wire.py's (magnitudes over six decades, so some groups reach e4m3 subnormals)."""
    from comm import wire
    from kernels.triton.fp8 import dequantize_fp8, quantize_fp8

    x = (torch.randn(T, H, device=device) * torch.logspace(-3, 3, H, device=device)).to(dtype)
    (q, s), (q_ref, s_ref) = quantize_fp8(x), wire.quantize_fp8(x)
    back, back_ref = dequantize_fp8(q_ref, s_ref, dtype), wire.dequantize_fp8(q_ref, s_ref, dtype)
    wrong = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum() + (s != s_ref).sum() + (back != back_ref).sum()
    return float(wrong) / (2 * q.numel() + s.numel())


def cases(tiny: bool, device) -> dict:
    """name -> (fn() -> relative error, tolerance): DeepSeek-V3 and Qwen3-30B-A3B shapes, or tiny
    ones (the interpreter). The names are the same either way."""
    f32, bf16, fp8 = torch.float32, torch.bfloat16, "fp8_moe"
    mla, lens, long_lens = (TINY_MLA, [1, 5, 17, 100], [300, 3]) if tiny else (V3_MLA, [1, 77, 600, 1500], [4000, 5])
    gqa = (8, 2, 16) if tiny else (32, 4, 128)  # Qwen3-30B-A3B: 32 heads over 4 kv heads of 128
    moe = (8, 16, 64, 32, 4) if tiny else (64, 256, 7168, 2048, 8)  # (tokens, E, H, I, top-k)
    moe_fp32 = moe if tiny else (32, 16, 7168, 2048, 8)  # fp32 weights of 256 experts: 45 GB
    fp8_moe, fp8_x = ((4, 8, 256, 128, 2), (3, 300)) if tiny else (moe, (64, 7168))
    table = {}  # name -> (fn, args, tolerance key)
    for name, dtype, page in (("fp32", f32, 64), ("bf16", bf16, 64), ("bf16", bf16, 1), ("bf16", bf16, 16)):
        table[f"mla_{name}_page{page}"] = (mla_error, (lens, page, mla, dtype), dtype)
    table["mla_fp32_page16"] = (mla_error, (lens, 16, mla, f32), f32)
    table["mla_bf16_page64_many_splits"] = (mla_error, (long_lens, 64, mla, bf16), bf16)
    for name, dtype, page in (("fp32", f32, 16), ("bf16", bf16, 64), ("bf16", bf16, 16)):
        table[f"gqa_{name}_page{page}"] = (gqa_error, ([1, 50, 700], page, *gqa, dtype), dtype)
    table["moe_bf16"] = (moe_error, (moe, bf16), bf16)
    table["moe_bf16_other_rank_slots"] = (moe_error, (moe, bf16, 0.25), bf16)
    table["moe_fp32"] = (moe_error, (moe_fp32, f32), f32)
    table["moe_fp8_bf16_activations"] = (moe_fp8_error, (fp8_moe, bf16), fp8)
    table["fp8_quantize_fp32"] = (fp8_bits_error, (*fp8_x, f32), "fp8_bits")
    table["fp8_quantize_bf16"] = (fp8_bits_error, (*fp8_x, bf16), "fp8_bits")
    return {
        name: (functools.partial(fn, *args, device=device), TOLERANCE[tol]) for name, (fn, args, tol) in table.items()
    }


NAMES = list(cases(True, "cpu"))

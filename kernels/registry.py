"""Kernel backends by name: `attention_backend("torch")`, `moe_backend("torch")`.

A backend is a small object bundling the kernels one kind of layer needs. The table maps a name
to "module:factory" and imports the module only when that backend is chosen, so a GPU backend's
imports (triton, CUDA extensions) never run on a machine that does not ask for it.

    name      attention (MLA)              MoE
    cpu       kernels.cpu_attention.CpuMLA kernels.cpu_moe.CpuMoE          C decode core (MLA, GQA) and C
                                                                         decode-batch MoE for fp32 CPU
                                                                         tensors, else the reference
    torch     kernels.mla.TorchMLA         kernels.moe.TorchMoE          reference, any device
    triton    kernels.triton.mla.TritonMLA kernels.triton.moe.TritonMoE  CUDA GPUs; on the CPU only
                                                                         under TRITON_INTERPRET=1 (tests)

A new backend adds one line to each table it implements; `EngineArgs` refuses names not listed.
"""

from __future__ import annotations

import importlib
import os

# attention backends hold one implementation per attention kind: "mla" (DeepSeek), "gqa" (Qwen3-MoE)
ATTENTION_BACKENDS = {
    "cpu": {"mla": "kernels.cpu_attention:CpuMLA", "gqa": "kernels.cpu_attention:CpuGQA"},
    "torch": {"mla": "kernels.mla:TorchMLA", "gqa": "kernels.gqa:TorchGQA"},
    "triton": {"mla": "kernels.triton.mla:TritonMLA", "gqa": "kernels.triton.gqa:TritonGQA"},
}
MOE_BACKENDS = {
    "cpu": "kernels.cpu_moe:CpuMoE",
    "torch": "kernels.moe:TorchMoE",
    "triton": "kernels.triton.moe:TritonMoE",
}
_NEEDS_TRITON = {"triton"}


class UnknownBackendError(ValueError):
    """A backend name that no table lists."""


class BackendUnavailableError(RuntimeError):
    """A listed backend that cannot run here (its package is missing, or it needs a GPU)."""


def attention_backend(name: str, kind: str = "mla"):
    """The attention kernels of backend `name` for attention `kind` ("mla": see kernels.mla.TorchMLA
    for the interface; "gqa": kernels.gqa.TorchGQA)."""
    check_backend(ATTENTION_BACKENDS, "attention", name)
    return _make(ATTENTION_BACKENDS[name], f"{kind.upper()} attention", kind, backend=name)


def moe_backend(name: str):
    """The routed-expert kernels of backend `name` (see kernels.moe.TorchMoE for the interface)."""
    return _make(MOE_BACKENDS, "MoE", name)


def check_backend(table: dict[str, str], kind: str, name: str) -> None:
    if name not in table:
        raise UnknownBackendError(f"unknown {kind} backend {name!r}; known: {', '.join(sorted(table))}")


def _make(table: dict[str, str], kind: str, name: str, backend: str | None = None):
    check_backend(table, kind, name)
    backend = backend or name
    if backend in _NEEDS_TRITON:
        _require_triton(kind, backend)
    module, factory = table[name].split(":")
    return getattr(importlib.import_module(module), factory)()


def _require_triton(kind: str, name: str) -> None:
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None:
        raise BackendUnavailableError(f"the {name} {kind} backend needs the triton package: pip install triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailableError(
            f"the {name} {kind} backend needs a CUDA GPU; on a CPU it runs only under "
            "Triton's interpreter (TRITON_INTERPRET=1, slow: for tests)"
        )

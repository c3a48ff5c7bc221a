"""Kernel backends by name: `attention_backend("torch")`, `moe_backend("torch")`.

A backend is a small object bundling the kernels one kind of layer needs. The table maps a name
to "module:factory" and imports the module only when that backend is chosen, so a GPU backend's
imports (triton, CUDA extensions) never run on a machine that does not ask for it.

    name      attention (MLA)              MoE
    torch     kernels.mla.TorchMLA         kernels.moe.TorchMoE     reference, any device

A new backend adds one line to each table it implements; `EngineArgs` refuses names not listed.
"""

from __future__ import annotations

import importlib

ATTENTION_BACKENDS = {"torch": "kernels.mla:TorchMLA"}
MOE_BACKENDS = {"torch": "kernels.moe:TorchMoE"}


class UnknownBackendError(ValueError):
    """A backend name that no table lists."""


def attention_backend(name: str):
    """The MLA kernels of backend `name` (see kernels.mla.TorchMLA for the interface)."""
    return _make(ATTENTION_BACKENDS, "attention", name)


def moe_backend(name: str):
    """The routed-expert kernels of backend `name` (see kernels.moe.TorchMoE for the interface)."""
    return _make(MOE_BACKENDS, "MoE", name)


def check_backend(table: dict[str, str], kind: str, name: str) -> None:
    if name not in table:
        raise UnknownBackendError(f"unknown {kind} backend {name!r}; known: {', '.join(sorted(table))}")


def _make(table: dict[str, str], kind: str, name: str):
    check_backend(table, kind, name)
    module, factory = table[name].split(":")
    return getattr(importlib.import_module(module), factory)()

"""Modules built as shapes only, before their weights are loaded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "constant_",
    "zeros_",
    "ones_",
)
_lock = threading.Lock()


def _unchanged(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextmanager
def on_meta() -> Iterator[None]:
    """Builds modules on the meta device with their weight initializers skipped.

    The checkpoint overwrites every weight, so the random init is wasted; and on meta tensors
    torch runs it through its reference implementations, whose first use imports dynamo: 1.2 s
    at the start of every rank process, which never compiles anything.
    """
    with _lock:
        saved = {name: getattr(torch.nn.init, name) for name in _INITS}
        for name in _INITS:
            setattr(torch.nn.init, name, _unchanged)
        try:
            with torch.device("meta"):
                yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)

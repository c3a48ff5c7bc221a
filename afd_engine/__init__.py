"""AFD engine: Attention-FFN disaggregated serving for Mixture-of-Experts LLMs.

The public names load on first use, so tools that need no model (`afd plan`) start without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "afd_engine.engine",
    "EngineArgs": "afd_engine.engine_args",
    "make_engine": "afd_engine.factory",
    "RequestOutput": "afd_engine.runtime.request",
    "SamplingParams": "afd_engine.sampling_params",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'afd_engine' has no attribute {name!r}")

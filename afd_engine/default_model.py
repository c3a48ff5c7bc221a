"""The embedded default model: a tiny random DeepSeek-V3 checkpoint made on first use."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-deepseek-v3-random"


def cache_dir() -> Path:
    root = os.environ.get("AFD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "afd-engine")
    return Path(root)


def default_model_path() -> Path:
    """Makes the default checkpoint into the cache directory once (atomically) and returns it."""
    from afd_engine.tiny_model import make_tiny_model

    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".making-"))
    try:
        make_tiny_model(tmp, arch="deepseek_v3", seed=0)
        os.replace(tmp, target)  # another process may have won the race: then keep theirs
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model_path: str | None) -> Path:
    return Path(model_path) if model_path else default_model_path()

"""The embedded default model: a small DeepSeek-V3-shaped checkpoint trained on Python's documentation.

It ships inside the package (``afd_engine/assets/``), so serving it needs no download and no
cache. ``afd train-tiny OUT_DIR`` retrains it; its README.md records the run. Tests that want
random weights of a chosen shape use ``afd_engine.tiny_model.make_tiny_model`` instead.
"""

from __future__ import annotations

from pathlib import Path

# Also the checkpoint directory's name, which the server reports as the model's name.
DEFAULT_MODEL_NAME = "tiny-deepseek-v3-pydoc"


def default_model_path() -> Path:
    """The shipped checkpoint directory."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_NAME


def resolve_model_path(model_path: str | None) -> Path:
    return Path(model_path) if model_path else default_model_path()

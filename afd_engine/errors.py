"""Errors that reach users. Each carries a message that names the cause and the fix."""

from __future__ import annotations


class AFDError(Exception):
    """Base class of the engine's user-facing errors."""


class ConfigError(AFDError):
    """A flag, a deployment setting or a checkpoint that the engine cannot run with."""


class ModelLoadError(AFDError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class InvalidRequestError(AFDError):
    """One request is invalid; other requests are unaffected."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

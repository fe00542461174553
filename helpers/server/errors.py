"""The engine's own errors, never HTTP statuses: ``app.py`` maps each kind to one. (Lesson 07.)"""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine will not or cannot serve; ``message`` is safe to show a client (no
    traceback, no path on the server's disk)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    """The request itself is wrong (too long, an impossible schema, a bad adapter name)."""


class TooLarge(InvalidRequest):
    """The request is larger than the server accepts (a prompt, a schema)."""


class NotFound(EngineError):
    """The request names something the server does not have (an adapter, a model)."""


class Overloaded(EngineError):
    """Too many requests are waiting; retrying later may work."""


class Unavailable(EngineError):
    """The engine is not running (stopping, or its scheduler failed)."""


class GenerationFailed(EngineError):
    """The engine accepted the request but could not finish it (the operator's problem)."""

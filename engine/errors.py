"""The errors the engine raises to its callers, by whose fault they are: the request's, one request's
failure inside a step, or the engine's."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request cannot be served as given (bad prompt, too long, ...); the message says why."""


class RequestFailedError(RuntimeError):
    """One request failed inside a step (its output could not be produced); the engine serves on."""


class EngineDeadError(RuntimeError):
    """The engine's step loop failed, hung past its watchdog or stopped; no request can be served any more."""

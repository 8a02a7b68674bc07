"""Errors a user of backplane can meet, each saying what was wrong and what to do."""

from __future__ import annotations

from typing import Any


class BackplaneError(Exception):
    """Base class of every error backplane raises on purpose."""


class PluginError(BackplaneError):
    """A plugin could not be registered or provided conflicting backends."""


class UnknownBackendError(BackplaneError):
    """The configuration names a backend that no installed plugin provides."""


class BackendUnavailableError(BackplaneError):
    """The configured backend is installed but cannot run here.

    :param message: why, and what to select instead.
    :param family: the op family of the backend, when the error is about one
        backend (selection replaces an ``auto`` choice only then).
    :param backend: that backend's name.
    """

    def __init__(self, message: str, *, family: str | None = None, backend: str | None = None):
        super().__init__(message)
        self.family = family
        self.backend = backend

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword arguments are not in ``args``: rebuild with them (pickle, copy).
        return (_rebuild, (type(self), self.args, self.family, self.backend))


class UnsupportedLayerError(BackendUnavailableError, ValueError):
    """A backend is installed and available but cannot run one layer's shape or dtype.

    Under ``auto`` selection the engine then falls back to the next backend of
    the family (:mod:`backplane.engine.selection`); with a backend named in the
    configuration it is an error.

    :param message: what the layer needs and what to select instead.
    :param family: the op family (required: selection finds the backend to
        replace by it, never by the message).
    :param backend: the backend's name.
    """

    family: str
    backend: str

    def __init__(self, message: str, *, family: str, backend: str):
        super().__init__(message, family=family, backend=backend)


def _rebuild(
    cls: type[BackendUnavailableError],
    args: tuple[Any, ...],
    family: str | None,
    backend: str | None,
) -> BackendUnavailableError:
    return cls(*args, family=family, backend=backend)


class ConfigError(BackplaneError):
    """The configuration (file, flags or keyword arguments) is invalid."""


class RequestError(BackplaneError, ValueError):
    """A request was rejected (empty prompt, bad token ids, too long)."""


class InvalidFieldError(RequestError):
    """One field of a request has a wrong type or a value out of range.

    :param message: what was wrong and what to pass instead.
    :param field: the field's name (``"top_k"``, ``"prompt_token_ids"``, ``"request_id"``...).
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        # the keyword argument is not in ``args``: rebuild with it (pickle, copy)
        return (_rebuild_field_error, (type(self), self.args, self.field))


def _rebuild_field_error(
    cls: type[InvalidFieldError], args: tuple[Any, ...], field: str
) -> InvalidFieldError:
    return cls(*args, field=field)


class OutOfKVMemoryError(BackplaneError):
    """The KV cache cannot hold even a single request of the given size."""


class EngineClosedError(BackplaneError):
    """The engine was shut down: its memory is released and it takes no more work."""


class EngineFailedError(BackplaneError):
    """The engine can run no more steps (a worker process died or failed); start a new one."""

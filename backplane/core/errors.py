"""Errors a user of backplane can meet, each saying what was wrong and what to do."""

from __future__ import annotations


class BackplaneError(Exception):
    """Base class of every error backplane raises on purpose."""


class PluginError(BackplaneError):
    """A plugin could not be registered or provided conflicting backends."""


class UnknownBackendError(BackplaneError):
    """The configuration names a backend that no installed plugin provides."""


class BackendUnavailableError(BackplaneError):
    """The configured backend is installed but cannot run here."""


class UnsupportedLayerError(BackendUnavailableError, ValueError):
    """A backend is installed and available but cannot run one layer's shape or dtype.

    Under ``auto`` selection the engine then falls back to the next backend of
    the family; with a backend named in the configuration it is an error.

    :param message: what the layer needs and what to select instead.
    :param family: the op family.
    :param backend: the backend's name.
    """

    def __init__(self, message: str, *, family: str | None = None, backend: str | None = None):
        super().__init__(message)
        self.family = family
        self.backend = backend


class ConfigError(BackplaneError):
    """The configuration (file, flags or keyword arguments) is invalid."""


class RequestError(BackplaneError, ValueError):
    """A request was rejected (empty prompt, bad token ids, too long)."""


class OutOfKVMemoryError(BackplaneError):
    """The KV cache cannot hold even a single request of the given size."""

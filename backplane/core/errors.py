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


class ConfigError(BackplaneError):
    """The configuration (file, flags or keyword arguments) is invalid."""


class RequestError(BackplaneError, ValueError):
    """A request was rejected (empty prompt, bad token ids, too long)."""


class OutOfKVMemoryError(BackplaneError):
    """The KV cache cannot hold even a single request of the given size."""

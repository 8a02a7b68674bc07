"""The descriptor a plugin returns for each backend it provides."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any


def _always_available() -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class BackendSpec:
    """Describes one backend of one op family, without loading it.

    :param family: the op family, one of ``attention``, ``ssm``, ``mla``, ``delta``.
    :param name: the backend's name within its family, as used in configuration
        (``backends: {attention: NAME}``).
    :param load: either a ``"module:attr"`` import path or a zero-argument
        callable; it is resolved only when the backend is selected and must
        produce the backend object (an instance, or a class / factory that is
        called with no arguments to make one).
    :param is_available: a callable returning ``(available, reason)``; the
        reason says why a backend cannot run here (a missing package, no CUDA).
    :param priority: higher wins when the configuration says ``auto``.
    :param capabilities: free-form feature tags (``"sliding_window"``,
        ``"cuda_graph"``, ``"cpu"``...) that tests and selection can gate on.
    :param description: one line shown by ``backplane backends``.
    :param plugin: the name of the plugin that registered the spec; filled in
        by the plugin manager, never by the plugin.
    """

    family: str
    name: str
    load: str | Callable[[], Any]
    is_available: Callable[[], tuple[bool, str]] = _always_available
    priority: int = 0
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    plugin: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.capabilities, frozenset):
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))

    def availability(self) -> tuple[bool, str]:
        """Return ``(available, reason)``, turning an exception into a reason.

        :return: the backend's own answer, or ``(False, "<error>")`` when its
            check raised.
        """
        try:
            ok, reason = self.is_available()
        except Exception as exc:  # a broken check must not break the listing
            return False, f"availability check raised {type(exc).__name__}: {exc}"
        return bool(ok), str(reason or "")

    def resolve(self) -> Any:
        """Import (or call) ``load`` and return the backend object.

        :return: an instance of the family's backend class.
        """
        target: Any
        if isinstance(self.load, str):
            module_name, _, attr = self.load.partition(":")
            if not attr:
                raise ValueError(
                    f"backend {self.family}/{self.name}: load={self.load!r} must be 'module:attr'"
                )
            target = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        else:
            target = self.load
        if isinstance(target, type) or callable(target) and not hasattr(target, "family"):
            target = target()
        return target

    def with_plugin(self, plugin: str) -> BackendSpec:
        """Return a copy of this spec recording the plugin that provided it."""
        return replace(self, plugin=plugin)

    @property
    def key(self) -> tuple[str, str]:
        """``(family, name)``, unique across all installed plugins."""
        return (self.family, self.name)

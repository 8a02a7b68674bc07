"""The descriptor a plugin returns for each backend it provides."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

#: The kinds of step a backend's measured speed is given for: ``prefill`` (prompt
#: tokens, chunked prefill and extend) and ``decode`` (one new token per sequence).
STEP_KINDS: tuple[str, ...] = ("prefill", "decode")

#: Capability of a recurrent backend (``ssm``, ``delta``) whose class sets
#: ``chains_rows``: it runs the chunks of speculative verification in captured
#: verify graphs. Under speculation ``auto`` prefers the backends that declare it.
CHAINED_ROWS = "chained_rows"


def _always_available() -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Speed:
    """What one backend measured on one device class: throughput per step kind.

    Figures are throughputs, higher is faster, in tokens per second of the
    reference workload that ``source`` names. ``auto`` compares them only with
    the figures of other backends of the same family on the same device class,
    so a plugin measures its backends against the others on one workload.

    :param prefill: tokens per second of prefill steps; ``None`` when not measured.
    :param decode: tokens per second of decode steps; ``None`` when not measured.
    :param source: the benchmark the figures come from (command, shape, device,
        where the results are written up), shown when ``auto`` uses them.
    """

    prefill: float | None = None
    decode: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for kind in STEP_KINDS:
            value = getattr(self, kind)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Speed.{kind} must be a number of tokens/s, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"Speed.{kind} must be a positive number, got {value!r}")
            object.__setattr__(self, kind, float(value))

    def figure(self, kind: str) -> float | None:
        """Return the figure of one step kind.

        :param kind: ``"prefill"`` or ``"decode"``.
        :return: tokens per second, or ``None`` when that kind was not measured.
        """
        if kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {kind!r}; the kinds are: {', '.join(STEP_KINDS)}")
        return getattr(self, kind)


def _speed_table(value: Any) -> dict[str, Speed]:
    """Normalise ``BackendSpec.speed``: ``{device class: Speed or mapping}`` to ``Speed``s."""
    if not isinstance(value, Mapping):
        raise TypeError(f"speed must map a device class to its figures, got {value!r}")
    table: dict[str, Speed] = {}
    for device_class, figures in value.items():
        if not isinstance(device_class, str) or not device_class:
            raise TypeError(
                f"speed: a device class must be a name like 'sm90', got {device_class!r}"
            )
        if isinstance(figures, Mapping):
            unknown = set(figures) - {*STEP_KINDS, "source"}
            if unknown:
                raise ValueError(
                    f"speed[{device_class!r}]: unknown keys {sorted(unknown)}; "
                    f"use {', '.join(STEP_KINDS)} and source"
                )
            figures = Speed(**figures)
        elif not isinstance(figures, Speed):
            raise TypeError(
                f"speed[{device_class!r}] must be a Speed or a mapping, got {figures!r}"
            )
        table[device_class] = figures
    return table


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
        ``"cuda_graph"``, ``"cpu"``, :data:`CHAINED_ROWS`...) that tests and
        selection can gate on.
    :param description: one line shown by ``backplane backends``.
    :param speed: measured figures per device class (``"sm90"`` for compute
        capability 9.0, ``"sm80"``, ``"cpu"``): a :class:`Speed`, or a mapping with
        ``prefill``, ``decode`` and ``source``. Under ``auto`` they rank the
        backends that can run, before ``priority``; a device class without
        figures leaves the choice to ``priority``.
    :param plugin: the name of the plugin that registered the spec; filled in
        by the plugin manager, never by the plugin.
    """

    family: str
    name: str
    load: str | Callable[[], object]
    is_available: Callable[[], tuple[bool, str]] = _always_available
    priority: int = 0
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    plugin: str | None = None
    # not hashed: a dict is not hashable, and specs are hashed (cached loads)
    speed: Mapping[str, Speed] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.capabilities, frozenset):
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        object.__setattr__(self, "speed", _speed_table(self.speed))

    def figure(self, device_class: str | None, kind: str) -> float | None:
        """Return the measured throughput of one step kind on one device class.

        :param device_class: ``"sm90"``, ``"cpu"``...; ``None`` (unknown) has no figures.
        :param kind: ``"prefill"`` or ``"decode"``.
        :return: tokens per second, or ``None`` when not measured there.
        """
        speed = self.speed.get(device_class) if device_class is not None else None
        return speed.figure(kind) if speed is not None else None

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

    def resolve(self) -> object:
        """Import (or call) ``load`` and return the backend object.

        :return: what ``load`` made, meant to be an instance of the family's
            backend class; :func:`backplane.engine.selection.load_backend`
            checks that it is before anyone uses it.
        """
        # Any: a chain of getattr over an imported module, whose type is only known at the end
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

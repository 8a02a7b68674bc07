"""Choosing the backend of each op family: the one home of backend selection.

* :func:`select_backend` turns one configured value into a spec: a backend
  name must be installed and able to run on the device; ``auto`` takes the
  highest-priority backend that can, and logs why each other one lost.
* :func:`select_backends` does that for the families a model uses, from an
  :class:`~backplane.engine.config.EngineConfig` (errors name the file and
  key, or the flag, the value came from).
* :func:`load_backend` makes the backend object of a spec, and hands a backend
  that ``needs_fallback`` the backend that runs what it does not, chosen like
  ``auto`` among the other backends of its family.
* :class:`BackendSelection` holds the backends of one engine and replaces a
  backend chosen by ``auto`` that cannot run one of the model's layers (it
  raised :class:`~backplane.core.errors.UnsupportedLayerError`) with the next
  one ``auto`` would choose. A backend named in the configuration is never
  replaced.

Every function takes the plugin registry to choose from; ``None`` means the
process-wide one (:func:`backplane.core.registry.get_registry`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from backplane.core.backend_spec import BackendSpec
from backplane.core.errors import (
    BackendUnavailableError,
    BackplaneError,
    ConfigError,
    PluginError,
)
from backplane.core.hookspecs import FAMILIES
from backplane.core.registry import BackendRegistry, get_registry

if TYPE_CHECKING:
    from backplane.core.families import Backend
    from backplane.engine.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICE_TAGS",
    "BackendSelection",
    "load_backend",
    "runs_on",
    "select_backend",
    "select_backends",
]

#: Capability tags that name a device type. A backend that declares any of them
#: runs only on the device types it declares; one that declares none is assumed
#: to run wherever its availability check says it can.
DEVICE_TAGS: frozenset[str] = frozenset({"cpu", "cuda", "rocm", "mps", "xpu"})


def runs_on(spec: BackendSpec, device: str | None) -> tuple[bool, str]:
    """Say whether the backend of ``spec`` can run here, on ``device``.

    :param spec: the backend's spec.
    :param device: the device the engine runs on (``"cpu"``, ``"cuda"``,
        ``"cuda:1"``); a backend whose capabilities name device types (see
        :data:`DEVICE_TAGS`) must name this one. ``None`` skips that check.
    :return: ``(ok, reason)``: the reason says why not (the device, or the
        backend's own availability check).
    """
    if device is not None:
        device_type = device.split(":", 1)[0]
        declared = spec.capabilities & DEVICE_TAGS
        if declared and device_type not in declared:
            return False, (
                f"it does not run on {device_type} (it supports: {', '.join(sorted(declared))})"
            )
    return spec.availability()


def _registry(registry: BackendRegistry | None) -> BackendRegistry:
    return registry if registry is not None else get_registry()


def _auto(
    registry: BackendRegistry, family: str, device: str | None, exclude: Collection[str] = ()
) -> tuple[list[BackendSpec], list[str]]:
    """Rank the backends of ``family`` the way ``auto`` does.

    :return: the backends that can run here, best first, and for every other
        backend (``exclude`` left out), in registry order, why the first one
        beat it.
    """
    ranked = [spec for spec in registry.backends(family) if spec.name not in exclude]
    verdicts = [(spec, *runs_on(spec, device)) for spec in ranked]
    usable = [spec for spec, ok, _ in verdicts if ok]
    lost: list[str] = []
    for spec, ok, reason in verdicts:
        if not ok:
            lost.append(f"{spec.name} (unavailable: {reason})")
        elif spec is usable[0]:
            continue
        elif spec.priority == usable[0].priority:
            lost.append(f"{spec.name} (same priority {spec.priority}; ties go by name)")
        else:
            lost.append(f"{spec.name} (priority {spec.priority} < {usable[0].priority})")
    return usable, lost


def select_backend(
    family: str,
    name: str = "auto",
    *,
    registry: BackendRegistry | None = None,
    device: str | None = None,
) -> BackendSpec:
    """Choose the backend of ``family`` from one configured value.

    :param family: the op family.
    :param name: a backend name, or ``"auto"`` for the highest-priority one
        that can run here (the reasons the others lost are logged at INFO).
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :param device: the device the engine runs on; see :func:`runs_on`.
    :return: the chosen spec.
    :raises UnknownBackendError: the family, or the named backend, is unknown;
        the message lists the installed backends and the plugins that failed.
    :raises BackendUnavailableError: the backend (or, for ``auto``, every
        backend) cannot run here; the message carries the reasons.
    """
    registry = _registry(registry)
    if name != "auto":
        spec = registry.get(family, name)
        ok, reason = runs_on(spec, device)
        if not ok:
            raise BackendUnavailableError(
                f"{family} backend {name!r} (plugin {spec.plugin}) is unavailable: {reason}",
                family=family,
                backend=name,
            )
        return spec
    usable, lost = _auto(registry, family, device)
    if not usable:
        raise BackendUnavailableError(
            f"no available {family} backend: "
            + ("; ".join(lost) if lost else registry.installed_hint(family)),
            family=family,
        )
    chosen = usable[0]
    logger.info(
        "%s backend: auto chose %s (plugin %s, priority %d)%s",
        family,
        chosen.name,
        chosen.plugin,
        chosen.priority,
        "; others: " + ", ".join(lost) if lost else "",
    )
    return chosen


def _naming_the_source(exc: BackplaneError, prefix: str) -> BackplaneError:
    """The same error with ``prefix`` (where the value came from) before its message."""
    message = f"{prefix}: {exc}"
    if isinstance(exc, BackendUnavailableError):
        return type(exc)(message, family=exc.family, backend=exc.backend)
    return type(exc)(message)


def select_backends(
    config: EngineConfig,
    families: Iterable[str] | None = None,
    *,
    registry: BackendRegistry | None = None,
) -> dict[str, BackendSpec]:
    """Check the configured backends against the registry and choose one per family.

    Every family whose backend is named in the configuration is checked for an
    installed backend of that name (a typo is an error even for a family the
    model does not use); the families in ``families`` are selected with
    :func:`select_backend` on the configuration's device.

    :param config: the engine configuration (its ``backends`` and ``device``).
    :param families: the op families the model uses; ``None`` = all.
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :return: ``{family: BackendSpec}`` for ``families``.
    :raises ConfigError: ``families`` names an unknown op family.
    :raises UnknownBackendError: naming the key, the installed backends and the
        plugins that failed to load.
    :raises BackendUnavailableError: with the reason the backend cannot run.
    """
    registry = _registry(registry)
    wanted = list(FAMILIES if families is None else families)
    for family in wanted:
        if family not in FAMILIES:
            raise ConfigError(
                f"unknown op family {family!r}; the families are: {', '.join(FAMILIES)}"
            )
    device = config.device_type
    chosen: dict[str, BackendSpec] = {}
    for family in FAMILIES:
        name = config.backends.get(family, "auto")
        if family not in wanted and name == "auto":
            continue
        try:
            if family in wanted:
                spec = select_backend(family, name, registry=registry, device=device)
                chosen[family] = spec
                if name != "auto":
                    logger.info("%s backend: %s (configured)", family, spec.name)
            else:
                registry.get(family, name)
        except BackplaneError as exc:
            key = f"backends.{family}"
            where = config.origin(key)
            if where.kind == "default":  # "auto" by default: the key was never written
                raise
            raise _naming_the_source(exc, where.where(key)) from None
    return chosen


def load_backend(
    spec: BackendSpec,
    *,
    registry: BackendRegistry | None = None,
    device: str | None = None,
) -> Backend:
    """Make the backend object of ``spec``, with its fallback when it needs one.

    A backend whose ``needs_fallback`` is true receives, through
    ``set_fallback``, the backend ``auto`` would choose among the other
    backends of its family that can run on ``device``.

    :param spec: a selected spec (see :func:`select_backend`).
    :param registry: the registry to choose a fallback from (the process-wide
        one if ``None``).
    :param device: the device the engine runs on; see :func:`runs_on`.
    :return: an instance of the family's base class in :mod:`backplane.core.families`.
    :raises BackendUnavailableError: ``load`` failed, or the backend needs a
        fallback and no other backend of the family can run here.
    :raises PluginError: ``load`` produced an object of the wrong family.
    """
    return _load(spec, _registry(registry), device, taken=set())


def _load(
    spec: BackendSpec, registry: BackendRegistry, device: str | None, taken: set[str]
) -> Backend:
    """:func:`load_backend`, never choosing a fallback among ``taken`` (those already in use)."""
    from backplane.core.families import FAMILY_BASES

    family = spec.family
    load = spec.load if isinstance(spec.load, str) else repr(spec.load)
    try:
        backend = spec.resolve()
    except BackplaneError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"{family} backend {spec.name!r} (plugin {spec.plugin}) failed to load "
            f"from {load}: {type(exc).__name__}: {exc}",
            family=family,
            backend=spec.name,
        ) from exc
    base = FAMILY_BASES[family]
    if not isinstance(backend, base):
        raise PluginError(
            f"{family} backend {spec.name!r} (plugin {spec.plugin}): {load} produced "
            f"{type(backend).__name__}, which is not a "
            f"backplane.core.families.{base.__name__}"
        )
    if backend.needs_fallback:
        backend.set_fallback(_fallback_for(spec, registry, device, {*taken, spec.name}))
    return backend


def _fallback_for(
    spec: BackendSpec, registry: BackendRegistry, device: str | None, taken: set[str]
) -> Backend:
    """Load the backend that runs what ``spec``'s backend does not (``auto`` among the others)."""
    family = spec.family
    usable, lost = _auto(registry, family, device, exclude=taken)
    if not usable:
        raise BackendUnavailableError(
            f"{family} backend {spec.name!r} (plugin {spec.plugin}) runs part of its work on "
            f"another {family} backend, and none can run here: "
            + ("; ".join(lost) if lost else registry.installed_hint(family))
            + f"; install one, or select another backends.{family}",
            family=family,
            backend=spec.name,
        )
    chosen = usable[0]
    logger.info(
        "%s backend %s delegates what it does not run to %s (plugin %s, priority %d)%s",
        family,
        spec.name,
        chosen.name,
        chosen.plugin,
        chosen.priority,
        "; others: " + ", ".join(lost) if lost else "",
    )
    return _load(chosen, registry, device, taken)


class BackendSelection:
    """The backends of one engine: chosen from its configuration, replaced when one cannot run.

    :param config: the engine configuration (its ``backends`` and ``device``).
    :param families: the op families to select; ``None`` = all.
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :raises BackplaneError: as :func:`select_backends` and :func:`load_backend`.
    """

    def __init__(
        self,
        config: EngineConfig,
        families: Iterable[str] | None = None,
        *,
        registry: BackendRegistry | None = None,
    ) -> None:
        self.config = config
        self.registry = _registry(registry)
        self.device = config.device_type
        #: The spec of each selected family's backend.
        self.specs: dict[str, BackendSpec] = select_backends(
            config, families, registry=self.registry
        )
        #: ``{family: backend object}``, updated by :meth:`replace`.
        self.backends: dict[str, Any] = {
            family: load_backend(spec, registry=self.registry, device=self.device)
            for family, spec in self.specs.items()
        }
        self._tried = {family: {spec.name} for family, spec in self.specs.items()}

    def replace(self, exc: BackendUnavailableError) -> bool:
        """Replace the backend ``exc`` is about with the next one ``auto`` would choose.

        :param exc: what the backend raised while the model was built or its
            caches described; its ``family`` says which backend it is about.
        :return: ``True`` when the backend was replaced (with a warning); ``False``
            when ``exc`` names no selected family, the family's backend is named
            in the configuration, or no other backend of the family can run
            here. The caller then re-raises ``exc``.
        """
        family = exc.family
        if family not in self.backends or self.config.backends.get(family, "auto") != "auto":
            return False
        usable, _ = _auto(self.registry, family, self.device, exclude=self._tried[family])
        if not usable:
            return False
        spec = usable[0]
        self._tried[family].add(spec.name)
        logger.warning(
            "%s backend %r cannot run this model (%s); auto falls back to %r",
            family,
            self.specs[family].name,
            # the text, not the exception: a kept log record would pin its traceback's
            # frames (the engine being built, its caches) for as long as it lives
            str(exc),
            spec.name,
        )
        self.backends[family] = load_backend(spec, registry=self.registry, device=self.device)
        self.specs[family] = spec
        return True

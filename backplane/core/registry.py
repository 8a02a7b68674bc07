"""Plugin discovery and backend selection.

Built-in and third-party plugins are found the same way: the entry-point group
``backplane.plugins``. When the package metadata is absent (running from a
source tree), the built-in plugins are registered by import instead. A plugin
that fails to import or register is recorded with its error; the rest keep
working.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import pluggy

from backplane.core import hookspecs
from backplane.core.backend_spec import BackendSpec
from backplane.core.errors import BackendUnavailableError, PluginError, UnknownBackendError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "backplane.plugins"
DISABLE_ENV = "BACKPLANE_DISABLE_PLUGINS"
BUILTIN_PLUGINS: dict[str, str] = {
    "torch": "backplane.plugins.torch",
    "triton": "backplane.plugins.triton",
    "flashinfer": "backplane.plugins.flashinfer",
}


@dataclass
class PluginInfo:
    """What the manager knows about one plugin.

    :param name: the entry-point name (or built-in name).
    :param module: the import path the plugin was loaded from.
    :param distribution: the distribution that declared the entry point, if any.
    :param version: that distribution's version, if known.
    :param hooks: the hook names the plugin implements.
    :param error: the load or registration error, ``None`` when it loaded.
    :param disabled: ``True`` when blocked by ``BACKPLANE_DISABLE_PLUGINS``.
    """

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    hooks: list[str] = field(default_factory=list)
    error: str | None = None
    disabled: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable view for ``backplane plugins --json``."""
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "hooks": list(self.hooks),
            "error": self.error,
            "disabled": self.disabled,
        }


def _disabled_names() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def _entry_points() -> list[importlib_metadata.EntryPoint]:
    return list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))


class BackendRegistry:
    """The plugin manager and the backends its plugins provide.

    :param load_entry_points: discover plugins through the ``backplane.plugins``
        entry points (and built-ins by import when their metadata is missing).
        Pass ``False`` to start empty, e.g. to register plugin objects by hand
        in tests with :meth:`register`.
    """

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._specs: dict[str, list[BackendSpec]] | None = None
        if load_entry_points:
            self._discover()

    # -- discovery -------------------------------------------------------
    def _discover(self) -> None:
        disabled = _disabled_names()
        seen: set[str] = set()
        for ep in _entry_points():
            if ep.name in seen:
                continue
            seen.add(ep.name)
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                module=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
            self._load_one(info, ep.load, disabled)
        for name, module in BUILTIN_PLUGINS.items():
            if name in seen:
                continue
            info = PluginInfo(name=name, module=module, distribution="backplane")
            self._load_one(info, lambda m=module: importlib.import_module(m), disabled)

    def _load_one(self, info: PluginInfo, loader: Any, disabled: set[str]) -> None:
        self.plugins[info.name] = info
        if info.name in disabled:
            info.disabled = True
            info.error = f"disabled by {DISABLE_ENV}"
            logger.info("plugin %s disabled by %s", info.name, DISABLE_ENV)
            return
        try:
            plugin = loader()
        except Exception as exc:
            info.error = f"{type(exc).__name__}: {exc}"
            logger.warning("plugin %s failed to load: %s", info.name, info.error)
            logger.debug("%s", traceback.format_exc())
            return
        self._register_loaded(info, plugin)

    def _register_loaded(self, info: PluginInfo, plugin: Any) -> None:
        try:
            self.pm.register(plugin, name=info.name)
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            info.error = f"{type(exc).__name__}: {exc}"
            logger.warning("plugin %s failed to register: %s", info.name, info.error)
            return
        info.hooks = sorted(
            caller.name for caller in self.pm.get_hookcallers(plugin) or []
        )
        self._specs = None

    def register(self, plugin: Any, name: str, module: str | None = None) -> PluginInfo:
        """Register a plugin object directly (tests, embedding applications).

        :param plugin: a module or object with ``@hookimpl`` functions.
        :param name: the plugin's name in listings and error messages.
        :param module: where it came from, for listings.
        :return: the recorded :class:`PluginInfo` (check its ``error``).
        """
        info = PluginInfo(name=name, module=module or getattr(plugin, "__name__", repr(plugin)))
        self.plugins[name] = info
        self._register_loaded(info, plugin)
        return info

    # -- backends --------------------------------------------------------
    def _collect(self) -> dict[str, list[BackendSpec]]:
        specs: dict[str, list[BackendSpec]] = {f: [] for f in hookspecs.FAMILIES}
        owners: dict[tuple[str, str], str] = {}
        for family, hook_name in hookspecs.FAMILY_HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                plugin_name = impl.plugin_name
                try:
                    result = impl.function()
                except Exception as exc:
                    info = self.plugins.get(plugin_name)
                    if info is not None:
                        info.error = f"{hook_name} raised {type(exc).__name__}: {exc}"
                    logger.warning("plugin %s: %s raised %s", plugin_name, hook_name, exc)
                    continue
                for spec in result or []:
                    if not isinstance(spec, BackendSpec):
                        raise PluginError(
                            f"plugin {plugin_name!r}: {hook_name} returned {type(spec).__name__}, "
                            "expected BackendSpec"
                        )
                    if spec.family != family:
                        raise PluginError(
                            f"plugin {plugin_name!r}: {hook_name} returned a spec of family "
                            f"{spec.family!r}; it belongs in the {family!r} hook"
                        )
                    if spec.key in owners:
                        raise PluginError(
                            f"backend {family}/{spec.name} is provided by two plugins: "
                            f"{owners[spec.key]!r} and {plugin_name!r}; disable one with "
                            f"{DISABLE_ENV}={plugin_name}"
                        )
                    owners[spec.key] = plugin_name
                    specs[family].append(spec.with_plugin(plugin_name))
        for family in specs:
            specs[family].sort(key=lambda s: (-s.priority, s.name))
        return specs

    def backends(self, family: str | None = None) -> list[BackendSpec]:
        """Return the registered backends, best priority first.

        :param family: restrict to one family; ``None`` lists all, family by family.
        :return: the specs with ``plugin`` filled in.
        """
        if self._specs is None:
            self._specs = self._collect()
        if family is None:
            return [s for f in hookspecs.FAMILIES for s in self._specs[f]]
        self._check_family(family)
        return list(self._specs[family])

    def failed_plugins(self) -> dict[str, str]:
        """Return ``{plugin name: error}`` for plugins that did not load."""
        return {n: i.error for n, i in self.plugins.items() if i.error and not i.disabled}

    def _check_family(self, family: str) -> None:
        if family not in hookspecs.FAMILIES:
            raise UnknownBackendError(
                f"unknown op family {family!r}; the families are: {', '.join(hookspecs.FAMILIES)}"
            )

    def _installed_hint(self, family: str) -> str:
        names = [s.name for s in self.backends(family)]
        hint = f"installed {family} backends: {', '.join(names) if names else '(none)'}"
        failed = self.failed_plugins()
        if failed:
            hint += "; plugins that failed to load: " + "; ".join(
                f"{n} ({e})" for n, e in sorted(failed.items())
            )
        return hint

    def get(self, family: str, name: str) -> BackendSpec:
        """Return the spec of ``family``/``name``.

        :raises UnknownBackendError: listing the installed backends of that family.
        """
        for spec in self.backends(family):
            if spec.name == name:
                return spec
        raise UnknownBackendError(
            f"unknown {family} backend {name!r}; {self._installed_hint(family)}"
        )

    def select(self, family: str, name: str = "auto") -> BackendSpec:
        """Choose the backend for ``family`` from a configured name.

        :param family: the op family.
        :param name: a backend name, or ``"auto"`` for the highest-priority
            available one (the reasons the others lost are logged).
        :return: the chosen, available spec.
        :raises UnknownBackendError: the name is not installed.
        :raises BackendUnavailableError: the backend (or, for ``auto``, every
            backend) cannot run here; the message carries the reasons.
        """
        if name != "auto":
            spec = self.get(family, name)
            ok, reason = spec.availability()
            if not ok:
                raise BackendUnavailableError(
                    f"{family} backend {name!r} (plugin {spec.plugin}) is unavailable: {reason}"
                )
            return spec
        chosen: BackendSpec | None = None
        lost: list[str] = []
        for spec in self.backends(family):
            ok, reason = spec.availability()
            if chosen is None and ok:
                chosen = spec
            elif not ok:
                lost.append(f"{spec.name} (unavailable: {reason})")
            else:
                lost.append(f"{spec.name} (priority {spec.priority} < {chosen.priority})")
        if chosen is None:
            raise BackendUnavailableError(
                f"no available {family} backend; "
                + ("; ".join(lost) if lost else self._installed_hint(family))
            )
        logger.info(
            "%s backend: auto chose %s (priority %d)%s",
            family,
            chosen.name,
            chosen.priority,
            "; others: " + ", ".join(lost) if lost else "",
        )
        return chosen

    def matrix(self, family: str | None = None) -> list[dict[str, Any]]:
        """Return the backend matrix as rows for ``backplane backends``.

        :return: dicts with ``family``, ``name``, ``plugin``, ``available``,
            ``reason``, ``priority``, ``capabilities``, ``description``.
        """
        rows = []
        for spec in self.backends(family):
            ok, reason = spec.availability()
            rows.append(
                {
                    "family": spec.family,
                    "name": spec.name,
                    "plugin": spec.plugin,
                    "available": ok,
                    "reason": reason,
                    "priority": spec.priority,
                    "capabilities": sorted(spec.capabilities),
                    "description": spec.description,
                }
            )
        return rows


_default: BackendRegistry | None = None


def get_registry(refresh: bool = False) -> BackendRegistry:
    """Return the process-wide registry, discovering plugins on first use.

    :param refresh: rediscover (after installing a plugin or changing
        ``BACKPLANE_DISABLE_PLUGINS``).
    """
    global _default
    if _default is None or refresh:
        _default = BackendRegistry()
    return _default

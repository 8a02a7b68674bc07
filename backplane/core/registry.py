"""The plugin manager: discovery of plugins and listing of the backends they provide.

Built-in and third-party plugins are found the same way: the entry-point group
``backplane.plugins``. When the package metadata is absent (running from a
source tree), the built-in plugins are registered by import instead. A plugin
that fails to import or register is recorded with its error; the rest keep
working.

Choosing a backend from the configuration (a name or ``auto``) is not done
here but in :mod:`backplane.engine.selection`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as importlib_metadata
import inspect
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import pluggy

from backplane.core import hookspecs
from backplane.core.backend_spec import BackendSpec
from backplane.core.errors import PluginError, UnknownBackendError

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

    # Any: a JSON object's values (str, bool, None)
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
        try:
            entry_points = _entry_points()
        except Exception as exc:  # corrupt metadata of some distribution
            logger.warning("cannot read %s entry points: %s", ENTRY_POINT_GROUP, exc)
            entry_points = []
        for ep in entry_points:
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                module=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
            if ep.name in seen:
                first = self.plugins[ep.name]
                if (first.distribution, first.module) != (info.distribution, info.module):
                    # Two distributions claim one plugin name: keep the first, and make
                    # the second visible instead of silently dropping it.
                    key = f"{ep.name} ({info.distribution or info.module})"
                    info.name = key
                    info.error = (
                        f"plugin name {ep.name!r} is already used by "
                        f"{first.distribution or first.module!r}; rename the entry point "
                        f"in the {ENTRY_POINT_GROUP!r} group"
                    )
                    self.plugins[key] = info
                    logger.warning("plugin %s not loaded: %s", key, info.error)
                continue
            seen.add(ep.name)
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

    def _hook_problems(self, plugin: Any) -> list[str]:
        """Name the functions of ``plugin`` that look like hooks but are not valid ones."""
        problems = []
        known = list(hookspecs.FAMILY_HOOKS.values())
        for attr in sorted(dir(plugin)):
            if not attr.startswith(f"{hookspecs.PROJECT_NAME}_"):
                continue
            try:
                value = getattr(plugin, attr)
            except Exception:
                continue
            if not callable(value) or isinstance(value, type):
                continue
            opts = self.pm.parse_hookimpl_opts(plugin, attr)
            marked = opts is not None
            hook_name = (opts or {}).get("specname") or attr
            if hook_name not in known:
                if not marked and not inspect.isfunction(value):
                    continue
                close = difflib.get_close_matches(attr, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"unknown hook {attr!r}{hint}; the hooks are: {', '.join(known)}")
            elif not marked:
                problems.append(
                    f"function {attr!r} is not marked with @backplane.hookimpl, "
                    "so it would never be called"
                )
        return problems

    def _register_loaded(self, info: PluginInfo, plugin: Any) -> None:
        problems = self._hook_problems(plugin)
        if problems:
            info.error = "PluginError: " + "; ".join(problems)
            logger.warning("plugin %s failed to register: %s", info.name, info.error)
            return
        try:
            self.pm.register(plugin, name=info.name)
            # Backstop for anything the check above does not see (e.g. hookimpls
            # added under another name through ``specname``).
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            info.error = f"{type(exc).__name__}: {exc}"
            logger.warning("plugin %s failed to register: %s", info.name, info.error)
            return
        info.hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])
        self._specs = None

    def register(self, plugin: object, name: str, module: str | None = None) -> PluginInfo:
        """Register a plugin object directly (tests, embedding applications).

        :param plugin: a module or object with ``@hookimpl`` functions.
        :param name: the plugin's name in listings and error messages.
        :param module: where it came from, for listings.
        :return: the recorded :class:`PluginInfo` (check its ``error``).
        """
        if name in self.plugins:
            raise PluginError(
                f"a plugin named {name!r} is already registered "
                f"(from {self.plugins[name].module}); choose another name"
            )
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
            # get_hookimpls() is in registration order, so a duplicate error names
            # the plugin that was registered first first.
            for impl in hook.get_hookimpls():
                plugin_name = impl.plugin_name
                try:
                    result = list(impl.function() or [])
                except Exception as exc:
                    self._record_error(
                        plugin_name, f"{hook_name}() raised {type(exc).__name__}: {exc}"
                    )
                    continue
                for spec in result:
                    problem = None
                    if not isinstance(spec, BackendSpec):
                        problem = (
                            f"{hook_name}() returned a {type(spec).__name__}, "
                            "expected a BackendSpec"
                        )
                    elif spec.family != family:
                        problem = (
                            f"{hook_name}() returned backend {spec.name!r} of family "
                            f"{spec.family!r}; return it from "
                            f"{hookspecs.FAMILY_HOOKS.get(spec.family, 'the matching hook')}()"
                        )
                    if problem is not None:
                        self._record_error(plugin_name, problem)
                        continue
                    owner = owners.get(spec.key)
                    if owner == plugin_name:
                        raise PluginError(
                            f"plugin {plugin_name!r} provides backend {family}/{spec.name} "
                            "twice; give each backend of a family its own name"
                        )
                    if owner is not None:
                        raise PluginError(
                            f"backend {family}/{spec.name} is provided by two plugins: "
                            f"{owner!r} and {plugin_name!r}; uninstall one, or disable "
                            f"one with {DISABLE_ENV}={plugin_name}"
                        )
                    owners[spec.key] = plugin_name
                    specs[family].append(spec.with_plugin(plugin_name))
        for family in specs:
            specs[family].sort(key=lambda s: (-s.priority, s.name))
        return specs

    def _record_error(self, plugin_name: str, error: str) -> None:
        """Record a problem of a registered plugin without stopping the others."""
        info = self.plugins.get(plugin_name)
        if info is not None:
            info.error = f"{info.error}; {error}" if info.error else error
        logger.warning("plugin %s: %s", plugin_name, error)

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

    def disabled_plugins(self) -> list[str]:
        """Return the names of plugins blocked by ``BACKPLANE_DISABLE_PLUGINS``."""
        return sorted(n for n, i in self.plugins.items() if i.disabled)

    def _check_family(self, family: str) -> None:
        if family not in hookspecs.FAMILIES:
            raise UnknownBackendError(
                f"unknown op family {family!r}; the families are: {', '.join(hookspecs.FAMILIES)}"
            )

    def installed_hint(self, family: str) -> str:
        """Say what is installed for ``family``, for error messages.

        :param family: the op family.
        :return: ``"installed <family> backends: ..."`` followed by the plugins
            that failed to load and those disabled, when there are any.
        """
        names = [s.name for s in self.backends(family)]
        hint = f"installed {family} backends: {', '.join(names) if names else '(none)'}"
        failed = self.failed_plugins()
        if failed:
            hint += "; plugins that failed to load: " + "; ".join(
                f"{n} ({e})" for n, e in sorted(failed.items())
            )
        disabled = self.disabled_plugins()
        if disabled:
            hint += f"; disabled by {DISABLE_ENV}: {', '.join(disabled)}"
        return hint

    def get(self, family: str, name: str) -> BackendSpec:
        """Return the spec of ``family``/``name``.

        :raises UnknownBackendError: listing the installed backends of that
            family and the plugins that failed to load.
        """
        specs = self.backends(family)
        for spec in specs:
            if spec.name == name:
                return spec
        close = difflib.get_close_matches(name, [s.name for s in specs], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownBackendError(
            f"unknown {family} backend {name!r}{hint}; {self.installed_hint(family)}"
        )

    # Any: JSON rows whose values are strings, numbers, booleans and lists
    def matrix(self, family: str | None = None) -> list[dict[str, Any]]:
        """Return the backend matrix as rows for ``backplane backends``.

        :param family: restrict to one family; ``None`` lists all.
        :return: dicts with ``family``, ``name``, ``plugin``, ``available``,
            ``reason``, ``priority``, ``capabilities``, ``description``, ``load``
            and ``speed`` (``{device class: {"prefill", "decode", "source"}}``, the
            measured figures ``auto`` ranks by; ``{}`` when none were declared).
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
                    "load": spec.load if isinstance(spec.load, str) else repr(spec.load),
                    "speed": {
                        device_class: {
                            "prefill": figures.prefill,
                            "decode": figures.decode,
                            "source": figures.source,
                        }
                        for device_class, figures in spec.speed.items()
                    },
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

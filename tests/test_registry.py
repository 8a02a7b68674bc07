"""The plugin manager: discovery, failure isolation, duplicates, hook checks, listing.

Choosing a backend from the configuration is tested in ``test_selection.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap
import types
import uuid

import pytest

from backplane import BackendSpec, hookimpl
from backplane.core import registry as registry_mod
from backplane.core.errors import PluginError, UnknownBackendError
from backplane.core.hookspecs import FAMILIES
from backplane.core.registry import BackendRegistry, get_registry

HOOKS = "backplane_attention_backends, backplane_ssm_backends, backplane_mla_backends, backplane_delta_backends"


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def _plugin_source(family: str, *names: str, priority: int = 0) -> str:
    specs = ", ".join(
        f"BackendSpec(family={family!r}, name={n!r}, load='x:y', priority={priority})"
        for n in names
    )
    return textwrap.dedent(
        f"""
        from backplane import BackendSpec, hookimpl

        @hookimpl
        def backplane_{family}_backends():
            return [{specs}]
        """
    )


def _only(monkeypatch, root) -> None:
    """Discover only the distributions under ``root`` (no built-ins): exact listings."""
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(registry_mod, "BUILTIN_PLUGINS", {})

    def entry_points():
        return [
            ep
            for dist in importlib.metadata.distributions(path=[str(root)])
            for ep in dist.entry_points.select(group=registry_mod.ENTRY_POINT_GROUP)
        ]

    monkeypatch.setattr(registry_mod, "_entry_points", entry_points)


def _spec_plugin(*specs: BackendSpec, family: str = "attention") -> types.SimpleNamespace:
    """A plugin object whose ``family`` hook returns ``specs``."""

    def hook():
        return list(specs)

    ns = types.SimpleNamespace()
    setattr(ns, f"backplane_{family}_backends", hookimpl(hook))
    return ns


def _registry_with(**plugins) -> BackendRegistry:
    reg = BackendRegistry(load_entry_points=False)
    for name, plugin in plugins.items():
        info = reg.register(plugin, name=name)
        assert info.error is None, info.error
    return reg


# -- discovery --------------------------------------------------------------------------------


def test_builtin_torch_plugin_comes_through_the_entry_point_group():
    reg = BackendRegistry()
    info = reg.plugins["torch"]
    assert info.error is None
    assert info.distribution == "backplane"
    assert info.module == "backplane.plugins.torch"
    assert info.hooks == sorted(f"backplane_{f}_backends" for f in FAMILIES)
    declared = {ep.name for ep in importlib.metadata.entry_points(group="backplane.plugins")}
    assert {"torch", "triton", "flashinfer"} <= declared
    for family in FAMILIES:
        torch_specs = [s for s in reg.backends(family) if s.name == "torch"]
        assert len(torch_specs) == 1 and torch_specs[0].plugin == "torch"


def test_builtins_are_registered_by_import_without_package_metadata(monkeypatch):
    monkeypatch.setattr(registry_mod, "_entry_points", lambda: [])
    reg = BackendRegistry()
    assert set(reg.plugins) == {"torch", "triton", "flashinfer"}
    info = reg.plugins["torch"]
    assert (info.error, info.distribution, info.module) == (
        None,
        "backplane",
        "backplane.plugins.torch",
    )
    assert [s.name for s in reg.backends("ssm") if s.plugin == "torch"] == ["torch"]


def test_third_party_entry_point_is_discovered_with_distribution_and_version(
    monkeypatch, make_plugin_dist
):
    mod = _unique("bp_good")
    root = make_plugin_dist(
        "good-dist", {"good": mod}, {mod: _plugin_source("ssm", "fastscan")}, version="2.3"
    )
    _only(monkeypatch, root)
    reg = BackendRegistry()
    info = reg.plugins["good"]
    assert (info.distribution, info.version, info.module, info.error) == (
        "good-dist",
        "2.3",
        mod,
        None,
    )
    assert info.hooks == ["backplane_ssm_backends"]
    assert [(s.name, s.plugin) for s in reg.backends("ssm")] == [("fastscan", "good")]
    assert reg.backends("attention") == []


def test_plugin_that_raises_at_import_is_recorded_and_others_keep_working(
    monkeypatch, make_plugin_dist
):
    good, bad = _unique("bp_good"), _unique("bp_bad")
    root = make_plugin_dist(
        "two-plugins",
        {"good": good, "broken": bad},
        {good: _plugin_source("attention", "fast"), bad: "raise RuntimeError('boom')\n"},
    )
    _only(monkeypatch, root)
    reg = BackendRegistry()
    assert reg.plugins["broken"].error == "RuntimeError: boom"
    assert reg.plugins["broken"].hooks == []
    assert reg.failed_plugins() == {"broken": "RuntimeError: boom"}
    assert [s.name for s in reg.backends("attention")] == ["fast"]
    with pytest.raises(UnknownBackendError) as err:
        reg.get("attention", "flash")
    assert str(err.value) == (
        "unknown attention backend 'flash' (did you mean 'fast'?); installed attention "
        "backends: fast; plugins that failed to load: broken (RuntimeError: boom)"
    )


def test_disable_env_blocks_plugins_by_name_without_importing_them(monkeypatch, make_plugin_dist):
    good, other = _unique("bp_good"), _unique("bp_other")
    root = make_plugin_dist(
        "dist",
        {"good": good, "other": other},
        {good: _plugin_source("attention", "fast"), other: _plugin_source("mla", "lat")},
    )
    _only(monkeypatch, root)
    monkeypatch.setenv("BACKPLANE_DISABLE_PLUGINS", " good ,unknown-name,")
    reg = BackendRegistry()
    assert good not in sys.modules
    assert reg.plugins["good"].disabled
    assert reg.plugins["good"].error == "disabled by BACKPLANE_DISABLE_PLUGINS"
    assert reg.failed_plugins() == {}
    assert reg.disabled_plugins() == ["good"]
    assert reg.backends("attention") == []
    assert [s.name for s in reg.backends("mla")] == ["lat"]
    with pytest.raises(UnknownBackendError) as err:
        reg.get("attention", "fast")
    assert str(err.value) == (
        "unknown attention backend 'fast'; installed attention backends: (none); "
        "disabled by BACKPLANE_DISABLE_PLUGINS: good"
    )


def test_disable_env_blocks_a_builtin(monkeypatch):
    monkeypatch.setenv("BACKPLANE_DISABLE_PLUGINS", "torch")
    reg = BackendRegistry()
    assert reg.plugins["torch"].disabled
    assert all(s.plugin != "torch" for s in reg.backends())


def test_duplicate_backend_names_both_plugins(monkeypatch, make_plugin_dist):
    a, b = _unique("bp_alpha"), _unique("bp_beta")
    root = make_plugin_dist(
        "dups",
        {"alpha": a, "beta": b},
        {a: _plugin_source("attention", "fast"), b: _plugin_source("attention", "fast")},
    )
    _only(monkeypatch, root)
    reg = BackendRegistry()
    with pytest.raises(PluginError) as err:
        reg.backends()
    assert str(err.value) == (
        "backend attention/fast is provided by two plugins: 'alpha' and 'beta'; "
        "uninstall one, or disable one with BACKPLANE_DISABLE_PLUGINS=beta"
    )
    # The advice works.
    monkeypatch.setenv("BACKPLANE_DISABLE_PLUGINS", "beta")
    assert [s.plugin for s in BackendRegistry().backends("attention")] == ["alpha"]


def test_same_plugin_providing_a_name_twice_is_an_error():
    spec = BackendSpec(family="delta", name="d", load="x:y")
    reg = _registry_with(twice=_spec_plugin(spec, spec, family="delta"))
    with pytest.raises(PluginError) as err:
        reg.backends("delta")
    assert str(err.value) == (
        "plugin 'twice' provides backend delta/d twice; give each backend of a family its own name"
    )


def test_plugin_name_clash_between_distributions_is_reported(monkeypatch, make_plugin_dist):
    a, b = _unique("bp_a"), _unique("bp_b")
    make_plugin_dist("first-dist", {"same": a}, {a: _plugin_source("ssm", "s1")})
    root = make_plugin_dist("second-dist", {"same": b}, {b: _plugin_source("ssm", "s2")})
    _only(monkeypatch, root)
    reg = BackendRegistry()
    clashing = [i for i in reg.plugins.values() if i.name != "same"]
    assert len(clashing) == 1
    first, second = reg.plugins["same"], clashing[0]
    assert second.name == f"same ({second.distribution})"
    assert second.error == (
        f"plugin name 'same' is already used by {first.distribution!r}; rename the entry "
        "point in the 'backplane.plugins' group"
    )
    assert [s.plugin for s in reg.backends("ssm")] == ["same"]


# -- hook validation --------------------------------------------------------------------------


def test_misspelled_hook_fails_loudly_and_is_not_registered():
    @hookimpl
    def backplane_attention_backend():
        return []

    plugin = types.SimpleNamespace(backplane_attention_backend=backplane_attention_backend)
    reg = BackendRegistry(load_entry_points=False)
    info = reg.register(plugin, name="typo")
    assert info.error == (
        "PluginError: unknown hook 'backplane_attention_backend' (did you mean "
        f"'backplane_attention_backends'?); the hooks are: {HOOKS}"
    )
    assert not reg.pm.is_registered(plugin)
    assert reg.failed_plugins() == {"typo": info.error}


def test_misspelled_hook_in_a_discovered_module(monkeypatch, make_plugin_dist):
    mod = _unique("bp_typo")
    source = (
        "from backplane import hookimpl\n\n@hookimpl\ndef backplane_sm_backends():\n    return []\n"
    )
    _only(monkeypatch, make_plugin_dist("typo-dist", {"typo": mod}, {mod: source}))
    reg = BackendRegistry()
    assert reg.plugins["typo"].error == (
        "PluginError: unknown hook 'backplane_sm_backends' (did you mean "
        f"'backplane_ssm_backends'?); the hooks are: {HOOKS}"
    )


def test_hook_without_marker_fails_loudly():
    def backplane_ssm_backends():
        return []

    reg = BackendRegistry(load_entry_points=False)
    info = reg.register(
        types.SimpleNamespace(backplane_ssm_backends=backplane_ssm_backends), name="nomark"
    )
    assert info.error == (
        "PluginError: function 'backplane_ssm_backends' is not marked with "
        "@backplane.hookimpl, so it would never be called"
    )


def test_hookimpl_with_unknown_argument_is_rejected_by_pluggy():
    @hookimpl
    def backplane_mla_backends(config):
        return []

    reg = BackendRegistry(load_entry_points=False)
    info = reg.register(
        types.SimpleNamespace(backplane_mla_backends=backplane_mla_backends), name="args"
    )
    assert info.error.startswith("PluginValidationError: ")
    assert "config" in info.error
    assert reg.backends("mla") == []


def test_check_pending_is_the_backstop(monkeypatch):
    # Bypass the friendly check: pluggy's check_pending must still refuse the plugin.
    monkeypatch.setattr(BackendRegistry, "_hook_problems", lambda self, plugin: [])

    @hookimpl
    def backplane_attention_backend():
        return []

    reg = BackendRegistry(load_entry_points=False)
    plugin = types.SimpleNamespace(backplane_attention_backend=backplane_attention_backend)
    info = reg.register(plugin, name="typo")
    assert info.error.startswith(
        "PluginValidationError: unknown hook 'backplane_attention_backend' in plugin"
    )
    assert not reg.pm.is_registered(plugin)


def test_registering_a_name_twice_is_refused():
    reg = _registry_with(one=_spec_plugin(BackendSpec(family="attention", name="a", load="x:y")))
    with pytest.raises(PluginError) as err:
        reg.register(types.SimpleNamespace(), name="one")
    assert str(err.value) == (
        f"a plugin named 'one' is already registered (from {reg.plugins['one'].module}); "
        "choose another name"
    )
    assert reg.plugins["one"].error is None


def test_hook_that_raises_or_returns_garbage_is_recorded_per_plugin():
    def raising():
        raise ValueError("no GPU table")

    bad_hook = types.SimpleNamespace(backplane_ssm_backends=hookimpl(raising))
    good = BackendSpec(family="attention", name="ok", load="x:y")
    wrong_family = BackendSpec(family="mla", name="m", load="x:y")
    garbage = _spec_plugin("not a spec", wrong_family, good)
    reg = _registry_with(bad_hook=bad_hook, garbage=garbage)
    assert [s.name for s in reg.backends("attention")] == ["ok"]
    assert reg.backends("ssm") == [] and reg.backends("mla") == []
    assert reg.failed_plugins() == {
        "bad_hook": "backplane_ssm_backends() raised ValueError: no GPU table",
        "garbage": (
            "backplane_attention_backends() returned a str, expected a BackendSpec; "
            "backplane_attention_backends() returned backend 'm' of family 'mla'; "
            "return it from backplane_mla_backends()"
        ),
    }


# -- listing ----------------------------------------------------------------------------------


def _selection_registry() -> BackendRegistry:
    specs = [
        BackendSpec(
            family="attention",
            name="high",
            load="x:y",
            priority=10,
            is_available=lambda: (False, "needs a GPU"),
        ),
        BackendSpec(family="attention", name="mid", load="x:y", priority=5),
        BackendSpec(family="attention", name="low", load="x:y", priority=1),
        BackendSpec(family="attention", name="also_mid", load="x:y", priority=5),
        BackendSpec(
            family="attention",
            name="gpu_only",
            load="x:y",
            priority=7,
            capabilities={"cuda", "bfloat16"},
        ),
    ]
    return _registry_with(p=_spec_plugin(*specs))


def test_backends_are_listed_best_priority_first_ties_by_name():
    reg = _selection_registry()
    assert [s.name for s in reg.backends("attention")] == [
        "high",
        "gpu_only",
        "also_mid",
        "mid",
        "low",
    ]
    assert all(s.plugin == "p" for s in reg.backends("attention"))


def test_matrix_rows_and_a_raising_availability_check():
    def broken() -> tuple[bool, str]:
        raise OSError("driver missing")

    specs = [
        BackendSpec(
            family="attention",
            name="b",
            load="pkg.mod:Cls",
            is_available=broken,
            priority=3,
            capabilities={"cuda", "fp8"},
            description="broken check",
            speed={"sm90": {"decode": 120, "source": "bench x"}},
        ),
        BackendSpec(family="attention", name="a", load="pkg.mod:Other"),
    ]
    reg = _registry_with(p=_spec_plugin(*specs))
    rows = reg.matrix("attention")
    assert rows == [
        {
            "family": "attention",
            "name": "b",
            "plugin": "p",
            "available": False,
            "reason": "availability check raised OSError: driver missing",
            "priority": 3,
            "capabilities": ["cuda", "fp8"],
            "description": "broken check",
            "load": "pkg.mod:Cls",
            "speed": {"sm90": {"prefill": None, "decode": 120.0, "source": "bench x"}},
        },
        {
            "family": "attention",
            "name": "a",
            "plugin": "p",
            "available": True,
            "reason": "",
            "priority": 0,
            "capabilities": [],
            "description": "",
            "load": "pkg.mod:Other",
            "speed": {},
        },
    ]
    json.dumps(rows)  # serialisable for --json


def test_speed_figures_are_checked_and_normalised():
    """``speed`` takes ``Speed``s or mappings; the spec stays hashable and comparable."""
    from backplane.core.backend_spec import Speed

    spec = BackendSpec(
        family="attention",
        name="s",
        load="x:y",
        speed={"sm90": {"prefill": 7899, "decode": 713.5, "source": "bench y"}},
    )
    assert spec.speed == {"sm90": Speed(prefill=7899.0, decode=713.5, source="bench y")}
    assert (spec.figure("sm90", "prefill"), spec.figure("sm90", "decode")) == (7899.0, 713.5)
    assert spec.figure("sm80", "decode") is None and spec.figure(None, "decode") is None
    same = BackendSpec(
        family="attention", name="s", load="x:y", speed={"sm90": Speed(7899, 713.5, "bench y")}
    )
    assert same == spec and hash(same) == hash(spec)
    assert spec.with_plugin("p").speed == spec.speed
    with pytest.raises(ValueError, match="unknown keys \\['latency'\\]"):
        BackendSpec(family="attention", name="s", load="x:y", speed={"sm90": {"latency": 1.0}})
    with pytest.raises(ValueError, match="positive"):
        Speed(decode=-3.0)
    with pytest.raises(TypeError, match="tokens/s"):
        Speed(prefill="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device class"):
        BackendSpec(family="attention", name="s", load="x:y", speed={90: Speed(decode=1.0)})
    with pytest.raises(ValueError, match="unknown step kind"):
        Speed(decode=1.0).figure("verify")


def test_get_registry_is_cached_until_refresh(monkeypatch):
    monkeypatch.setattr(registry_mod, "_default", None)
    first = get_registry()
    assert get_registry() is first
    refreshed = get_registry(refresh=True)
    assert refreshed is not first and get_registry() is refreshed


def test_discovery_imports_no_kernel_library():
    """Building the registry and listing specs must not import torch/triton/flashinfer."""
    code = textwrap.dedent(
        """
        import sys
        from backplane.core.registry import BackendRegistry
        reg = BackendRegistry()
        reg.backends()
        heavy = sorted(m for m in ("torch", "triton", "flashinfer") if m in sys.modules)
        loaded = sorted(n for n, i in reg.plugins.items() if not i.error)
        print(json.dumps({"heavy": heavy, "loaded": loaded}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"imported during plugin discovery: {result['heavy']}"
    assert "torch" in result["loaded"]


def test_unreadable_entry_points_still_register_builtins(monkeypatch):
    def broken():
        raise ValueError("malformed entry_points.txt")

    monkeypatch.setattr(registry_mod, "_entry_points", broken)
    reg = BackendRegistry()
    assert reg.plugins["torch"].error is None

"""Backend selection: a configured name or ``auto``, fallbacks, replacement of an ``auto`` choice."""

from __future__ import annotations

import logging
import pickle
import types

import pytest

from backplane import BackendSpec, hookimpl
from backplane.cli.options import add_engine_arguments, config_from_args
from backplane.core.errors import (
    BackendUnavailableError,
    ConfigError,
    PluginError,
    UnknownBackendError,
    UnsupportedLayerError,
)
from backplane.core.families import AttentionBackend, SSMBackend
from backplane.core.registry import BackendRegistry
from backplane.engine.config import EngineConfig
from backplane.engine.selection import (
    BackendSelection,
    load_backend,
    select_backend,
    select_backends,
)


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


def _write(tmp_path, text: str, name: str = "engine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


# -- one family, one configured value ---------------------------------------------------------


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


def test_select_by_name():
    reg = _selection_registry()
    assert select_backend("attention", "low", registry=reg).name == "low"
    with pytest.raises(BackendUnavailableError) as err:
        select_backend("attention", "high", registry=reg)
    assert str(err.value) == "attention backend 'high' (plugin p) is unavailable: needs a GPU"
    with pytest.raises(UnknownBackendError) as err:
        select_backend("attention", "hihg", registry=reg)
    assert str(err.value) == (
        "unknown attention backend 'hihg' (did you mean 'high'?); installed attention backends: "
        "high, gpu_only, also_mid, mid, low"
    )


def test_auto_picks_highest_priority_available_and_says_why_others_lost(caplog):
    reg = _selection_registry()
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        chosen = select_backend("attention", "auto", registry=reg)
    assert chosen.name == "gpu_only"
    assert caplog.messages[-1] == (
        "attention backend: auto chose gpu_only (plugin p, priority 7); others: high "
        "(unavailable: needs a GPU), also_mid (priority 5 < 7), mid (priority 5 < 7), "
        "low (priority 1 < 7)"
    )


def test_auto_respects_the_device_and_explains_ties(caplog):
    reg = _selection_registry()
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        chosen = select_backend("attention", "auto", device="cpu", registry=reg)
    assert chosen.name == "also_mid"
    assert caplog.messages[-1] == (
        "attention backend: auto chose also_mid (plugin p, priority 5); others: high "
        "(unavailable: needs a GPU), gpu_only (unavailable: it does not run on cpu (it "
        "supports: cuda)), mid (same priority 5; ties go by name), low (priority 1 < 5)"
    )
    assert select_backend("attention", "auto", device="cuda:1", registry=reg).name == "gpu_only"
    with pytest.raises(BackendUnavailableError) as err:
        select_backend("attention", "gpu_only", device="cpu", registry=reg)
    assert str(err.value) == (
        "attention backend 'gpu_only' (plugin p) is unavailable: it does not run on cpu "
        "(it supports: cuda)"
    )


def test_auto_with_nothing_available():
    spec = BackendSpec(
        family="ssm", name="only", load="x:y", is_available=lambda: (False, "no mamba_ssm")
    )
    reg = _registry_with(p=_spec_plugin(spec, family="ssm"))
    with pytest.raises(BackendUnavailableError) as err:
        select_backend("ssm", registry=reg)
    assert str(err.value) == "no available ssm backend: only (unavailable: no mamba_ssm)"
    with pytest.raises(BackendUnavailableError) as err:
        select_backend("delta", registry=reg)
    assert str(err.value) == "no available delta backend: installed delta backends: (none)"


def test_unknown_family():
    reg = BackendRegistry(load_entry_points=False)
    with pytest.raises(UnknownBackendError) as err:
        select_backend("conv", "auto", registry=reg)
    assert str(err.value) == (
        "unknown op family 'conv'; the families are: attention, ssm, mla, delta"
    )


# -- from the configuration ------------------------------------------------------------------


class _Attn(AttentionBackend):
    """A minimal attention backend for selection tests (never run)."""

    name = "fake"

    def forward(self, q, k, v, kv_cache, layer, out=None):  # pragma: no cover - not called
        raise AssertionError("selection tests never run a backend")


def _registry(*specs: BackendSpec, failing: str | None = None) -> BackendRegistry:
    reg = BackendRegistry(load_entry_points=False)
    by_family: dict[str, list[BackendSpec]] = {}
    for spec in specs:
        by_family.setdefault(spec.family, []).append(spec)
    plugin = types.SimpleNamespace()
    for family, family_specs in by_family.items():

        def hook(family_specs=family_specs):
            return list(family_specs)

        setattr(plugin, f"backplane_{family}_backends", hookimpl(hook))
    assert reg.register(plugin, name="p").error is None
    if failing:
        bad = types.SimpleNamespace(backplane_attention_backend=hookimpl(lambda: []))
        reg.register(bad, name=failing)
    return reg


ATTN = BackendSpec(family="attention", name="fast", load=_Attn, priority=5)
ATTN_SLOW = BackendSpec(family="attention", name="slow", load=lambda: _Attn(), priority=1)
ATTN_GPU = BackendSpec(
    family="attention",
    name="gpu",
    load=_Attn,
    priority=9,
    is_available=lambda: (False, "no CUDA device is available"),
)


def test_auto_loads_backend_objects_for_the_used_families(caplog):
    reg = _registry(ATTN, ATTN_SLOW, ATTN_GPU)
    cfg = EngineConfig(device="cpu")
    with caplog.at_level(logging.INFO):
        backends = BackendSelection(cfg, ["attention"], registry=reg).backends
    assert list(backends) == ["attention"] and isinstance(backends["attention"], _Attn)
    assert (
        "attention backend: auto chose fast (plugin p, priority 5); others: gpu (unavailable: "
        "no CUDA device is available), slow (priority 1 < 5)"
    ) in caplog.messages


def test_configured_backend_is_used():
    reg = _registry(ATTN, ATTN_SLOW)
    cfg = EngineConfig(backends={"attention": "slow"})
    specs = select_backends(cfg, ["attention"], registry=reg)
    assert specs["attention"].name == "slow"


def test_unknown_backend_from_file_names_file_key_installed_and_failed(tmp_path):
    reg = _registry(ATTN, ATTN_SLOW, failing="broken")
    path = _write(tmp_path, "backends:\n  attention: fsat\n")
    cfg = EngineConfig.from_yaml(path)
    with pytest.raises(UnknownBackendError) as err:
        select_backends(cfg, ["attention"], registry=reg)
    assert str(err.value) == (
        f"config file {path!r}, key 'backends.attention': unknown attention backend 'fsat' "
        "(did you mean 'fast'?); installed attention backends: fast, slow; plugins that failed "
        "to load: broken (PluginError: unknown hook 'backplane_attention_backend' (did you mean "
        "'backplane_attention_backends'?); the hooks are: backplane_attention_backends, "
        "backplane_ssm_backends, backplane_mla_backends, backplane_delta_backends)"
    )


def test_unknown_backend_of_an_unused_family_is_still_an_error():
    reg = _registry(ATTN)
    cfg = EngineConfig(backends={"mla": "flashmla"})
    with pytest.raises(UnknownBackendError) as err:
        select_backends(cfg, ["attention"], registry=reg)
    assert str(err.value) == (
        "EngineConfig argument 'backends.mla': unknown mla backend 'flashmla'; installed mla "
        "backends: (none)"
    )


def test_unavailable_backend_gives_the_reason():
    reg = _registry(ATTN, ATTN_GPU)
    args = _parser().parse_args(["--backend", "attention=gpu"])
    with pytest.raises(BackendUnavailableError) as err:
        BackendSelection(config_from_args(args), ["attention"], registry=reg)
    assert str(err.value) == (
        "option --backend attention=...: attention backend 'gpu' (plugin p) is unavailable: "
        "no CUDA device is available"
    )


def test_auto_with_nothing_installed_for_a_used_family():
    reg = _registry(ATTN)
    with pytest.raises(BackendUnavailableError) as err:
        BackendSelection(EngineConfig(), ["attention", "ssm"], registry=reg)
    assert str(err.value) == "no available ssm backend: installed ssm backends: (none)"


def test_backend_that_fails_to_load_or_has_the_wrong_family():
    missing = BackendSpec(family="attention", name="missing", load="no_such_module_xyz:Backend")
    wrong = BackendSpec(family="attention", name="wrong", load=lambda: object())
    reg = _registry(missing, wrong)
    with pytest.raises(BackendUnavailableError) as err:
        BackendSelection(
            EngineConfig(backends={"attention": "missing"}), ["attention"], registry=reg
        )
    assert str(err.value) == (
        "attention backend 'missing' (plugin p) failed to load from no_such_module_xyz:Backend: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    with pytest.raises(PluginError) as err:
        BackendSelection(EngineConfig(backends={"attention": "wrong"}), ["attention"], registry=reg)
    assert str(err.value).startswith("attention backend 'wrong' (plugin p): <function")
    assert str(err.value).endswith(
        "produced object, which is not a backplane.core.families.AttentionBackend"
    )


def test_device_limits_auto(monkeypatch):
    gpu_tagged = BackendSpec(
        family="attention", name="cudaonly", load=_Attn, priority=50, capabilities={"cuda"}
    )
    reg = _registry(ATTN, gpu_tagged)
    on_cpu = select_backends(EngineConfig(device="cpu"), ["attention"], registry=reg)
    assert on_cpu["attention"].name == "fast"
    on_cuda = select_backends(EngineConfig(device="cuda"), ["attention"], registry=reg)
    assert on_cuda["attention"].name == "cudaonly"


def test_unknown_family_requested_by_a_model():
    with pytest.raises(ConfigError) as err:
        select_backends(EngineConfig(), ["conv"], registry=_registry(ATTN))
    assert (
        str(err.value) == "unknown op family 'conv'; the families are: attention, ssm, mla, delta"
    )


def test_builtin_torch_backends_are_selectable():
    """Against the real registry: auto on CPU picks an available backend of each family."""
    from backplane.core.registry import get_registry

    specs = select_backends(EngineConfig(device="cpu"), None, registry=get_registry())
    assert set(specs) == {"attention", "ssm", "mla", "delta"}
    assert all(spec.availability()[0] for spec in specs.values())


# -- a backend that runs part of its work on another one --------------------------------------


class _Scan(SSMBackend):
    """A minimal SSM backend for selection tests (never run)."""

    name = "scan"

    def conv(self, x, weight, bias, conv_state, layer, out=None):  # pragma: no cover
        raise AssertionError("selection tests never run a backend")

    def scan(self, x, dt, A, B, C, D, dt_bias, z, ssm_state, layer, out=None):  # pragma: no cover
        raise AssertionError("selection tests never run a backend")


class _Partial(_Scan):
    """Runs decode itself and hands the rest to its fallback, as the FlashInfer SSM backend does."""

    name = "partial"
    needs_fallback = True

    def __init__(self) -> None:
        self.fallback = None

    def set_fallback(self, backend):
        self.fallback = backend


def _ssm(name: str, priority: int, load=_Scan, **kw) -> BackendSpec:
    return BackendSpec(family="ssm", name=name, load=load, priority=priority, **kw)


def test_a_backend_that_needs_a_fallback_gets_the_one_auto_would_choose(caplog):
    reg = _registry(
        _ssm("partial", 10, load=_Partial),
        _ssm("gpu_helper", 8, capabilities={"cuda"}),
        _ssm("helper", 5),
        _ssm("plain", 1),
    )
    spec = select_backend("ssm", "partial", registry=reg, device="cpu")
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        backend = load_backend(spec, registry=reg, device="cpu")
    assert isinstance(backend, _Partial) and isinstance(backend.fallback, _Scan)
    assert caplog.messages[-1] == (
        "ssm backend partial delegates what it does not run to helper (plugin p, priority 5); "
        "others: gpu_helper (unavailable: it does not run on cpu (it supports: cuda)), plain "
        "(priority 1 < 5)"
    )
    on_cuda = BackendSelection(EngineConfig(device="cuda"), ["ssm"], registry=reg)
    assert isinstance(on_cuda.backends["ssm"], _Partial)
    assert on_cuda.backends["ssm"].fallback is not None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        load_backend(spec, registry=reg, device="cuda")
    assert "delegates what it does not run to gpu_helper" in caplog.messages[-1]


def test_a_backend_that_needs_a_fallback_and_has_none_names_family_and_backend():
    reg = _registry(
        _ssm("partial", 10, load=_Partial), _ssm("gpu_helper", 8, capabilities={"cuda"})
    )
    spec = select_backend("ssm", "partial", registry=reg)
    with pytest.raises(BackendUnavailableError) as err:
        load_backend(spec, registry=reg, device="cpu")
    assert str(err.value) == (
        "ssm backend 'partial' (plugin p) runs part of its work on another ssm backend, and none "
        "can run here: gpu_helper (unavailable: it does not run on cpu (it supports: cuda)); "
        "install one, or select another backends.ssm"
    )
    assert (err.value.family, err.value.backend) == ("ssm", "partial")


def test_a_backend_without_fallbacks_refuses_one():
    with pytest.raises(TypeError, match="takes no fallback"):
        _Scan().set_fallback(_Scan())


def test_the_flashinfer_ssm_backend_takes_its_fallback_from_selection():
    """No backend module asks the registry for its fallback: selection hands it over."""
    from backplane.backends.flashinfer.ssm import FlashInferSSMBackend
    from backplane.backends.torch.ssm import TorchSSMBackend

    reg = _registry(
        _ssm("flashinfer", 30, load=FlashInferSSMBackend), _ssm("torch", 0, load=TorchSSMBackend)
    )
    backend = load_backend(select_backend("ssm", "flashinfer", registry=reg), registry=reg)
    assert FlashInferSSMBackend.needs_fallback
    assert isinstance(backend.fallback, TorchSSMBackend) and backend.fallback_name == "torch"
    with pytest.raises(BackendUnavailableError, match="load_backend"):
        _ = FlashInferSSMBackend().fallback


# -- replacing an auto choice that cannot run a layer -----------------------------------------


def test_replace_takes_the_next_auto_choice_only_for_an_auto_family(caplog):
    reg = _registry(ATTN_GPU, ATTN, ATTN_SLOW)
    selection = BackendSelection(EngineConfig(device="cpu"), ["attention"], registry=reg)
    assert selection.specs["attention"].name == "fast"
    # an error about no family in particular is never taken for one
    assert not selection.replace(BackendUnavailableError("no CUDA device"))
    assert not selection.replace(UnsupportedLayerError("x", family="ssm", backend="torch"))
    exc = UnsupportedLayerError("head_dim 8 is too small", family="attention", backend="fast")
    with caplog.at_level(logging.WARNING, logger="backplane.engine.selection"):
        assert selection.replace(exc)
    assert selection.specs["attention"].name == "slow"
    assert isinstance(selection.backends["attention"], _Attn)
    assert caplog.messages == [
        "attention backend 'fast' cannot run this model (head_dim 8 is too small); auto falls "
        "back to 'slow'"
    ]
    # every other backend was tried (the unavailable one is never a candidate)
    assert not selection.replace(exc)
    configured = BackendSelection(
        EngineConfig(backends={"attention": "fast"}), ["attention"], registry=reg
    )
    assert not configured.replace(exc)
    assert configured.specs["attention"].name == "fast"


# -- errors and the family list ---------------------------------------------------------------


def test_unsupported_layer_error_always_names_family_and_backend():
    with pytest.raises(TypeError):
        UnsupportedLayerError("head_dim 8 is too small")  # type: ignore[call-arg]
    exc = UnsupportedLayerError("head_dim 8 is too small", family="attention", backend="fast")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is UnsupportedLayerError and str(again) == "head_dim 8 is too small"
    assert (again.family, again.backend) == ("attention", "fast")
    assert isinstance(again, BackendUnavailableError) and isinstance(again, ValueError)


def test_the_families_are_listed_once():
    from backplane.core import hookspecs
    from backplane.core.families import FAMILY_BASES

    assert hookspecs.FAMILIES == ("attention", "ssm", "mla", "delta")
    assert tuple(hookspecs.FAMILY_HOOKS) == hookspecs.FAMILIES
    assert tuple(FAMILY_BASES) == hookspecs.FAMILIES
    assert all(FAMILY_BASES[f].family == f for f in hookspecs.FAMILIES)
    assert tuple(EngineConfig().backends) == hookspecs.FAMILIES

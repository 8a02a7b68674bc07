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
    select_backends_for,
    select_fused_ops,
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


# -- measured speed per device class ----------------------------------------------------------

SRC = "bench latency, shape s, device d"


def _timed(name: str, priority: int, family: str = "attention", load=_Attn, **figures):
    """A spec with ``sm90`` figures (``decode=``, ``prefill=``), none elsewhere."""
    speed = {"sm90": {**figures, "source": SRC}} if figures else {}
    return BackendSpec(family=family, name=name, load=load, priority=priority, speed=speed)


def _speed_registry() -> BackendRegistry:
    return _registry(
        _timed("vendor", 60, decode=700.0, prefill=7900.0),
        _timed("ours", 50, decode=950.0, prefill=3300.0),
        _timed("plain", 0),
        BackendSpec(
            family="attention",
            name="fastest_but_absent",
            load=_Attn,
            priority=70,
            is_available=lambda: (False, "not installed"),
            speed={"sm90": {"decode": 5000.0}},
        ),
    )


def test_auto_ranks_by_the_decode_figure_of_the_device_class_and_says_why(caplog):
    reg = _speed_registry()
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        chosen = select_backend("attention", "auto", registry=reg, device_class="sm90")
    assert chosen.name == "ours"
    assert caplog.messages[-1] == (
        "attention backend: auto chose ours (plugin p, priority 50; decode 950 vs vendor 700 "
        f"tok/s on sm90, from {SRC}); others: fastest_but_absent (unavailable: not installed), "
        "vendor (decode 700 < 950 tok/s on sm90), plain (no decode figure on sm90)"
    )


def test_a_device_class_without_figures_leaves_auto_to_priority(caplog):
    reg = _speed_registry()
    for device_class in ("sm80", "cpu", None):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
            chosen = select_backend("attention", "auto", registry=reg, device_class=device_class)
        assert chosen.name == "vendor", device_class
        assert caplog.messages[-1] == (
            "attention backend: auto chose vendor (plugin p, priority 60); others: "
            "fastest_but_absent (unavailable: not installed), ours (priority 50 < 60), "
            "plain (priority 0 < 60)"
        )


def test_equal_figures_go_by_priority_and_a_lone_figure_beats_priority(caplog):
    reg = _registry(
        _timed("low", 1, decode=800.0), _timed("high", 9, decode=800.0), _timed("top", 99)
    )
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        assert select_backend("attention", registry=reg, device_class="sm90").name == "high"
    assert caplog.messages[-1] == (
        "attention backend: auto chose high (plugin p, priority 9; decode 800 vs low 800 tok/s "
        f"on sm90, a tie broken by priority, from {SRC}); others: top (no decode figure on "
        "sm90), low (priority 1 < 9)"
    )
    lone = _registry(_timed("measured", 1, decode=12.5), _timed("top", 99))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        assert select_backend("attention", registry=lone, device_class="sm90").name == "measured"
    assert caplog.messages[-1] == (
        "attention backend: auto chose measured (plugin p, priority 1; decode 12.5 tok/s on "
        f"sm90, the only decode figure there, from {SRC}); others: top (no decode figure on sm90)"
    )


def test_an_explicit_choice_wins_over_the_figures(caplog):
    reg = _speed_registry()
    assert select_backend("attention", "vendor", registry=reg, device_class="sm90").name == "vendor"
    # from a configuration: the engine's device class comes from its device
    cpu_timed = [
        BackendSpec(
            family="attention",
            name=name,
            load=_Attn,
            priority=priority,
            speed={"cpu": {"decode": decode, "source": SRC}},
        )
        for name, priority, decode in (("slow", 9, 10.0), ("quick", 1, 20.0))
    ]
    reg = _registry(*cpu_timed)
    assert (
        BackendSelection(EngineConfig(device="cpu"), ["attention"], registry=reg)
        .specs["attention"]
        .name
        == "quick"
    )
    configured = BackendSelection(
        EngineConfig(device="cpu", backends={"attention": "slow"}), ["attention"], registry=reg
    )
    assert configured.specs["attention"].name == "slow"
    # and a configured backend is never replaced by a faster one
    exc = UnsupportedLayerError("head_dim 8 is too small", family="attention", backend="slow")
    assert not configured.replace(exc)


def test_replacing_an_auto_choice_follows_the_figures():
    reg = _registry(
        *[
            BackendSpec(
                family="attention",
                name=name,
                load=_Attn,
                priority=priority,
                speed={"cpu": {"decode": decode}} if decode else {},
            )
            for name, priority, decode in (("a", 1, 30.0), ("b", 2, 20.0), ("c", 3, None))
        ]
    )
    selection = BackendSelection(EngineConfig(device="cpu"), ["attention"], registry=reg)
    assert selection.device_class == "cpu" and selection.specs["attention"].name == "a"
    assert selection.replace(UnsupportedLayerError("no", family="attention", backend="a"))
    assert selection.specs["attention"].name == "b"
    assert selection.replace(UnsupportedLayerError("no", family="attention", backend="b"))
    assert selection.specs["attention"].name == "c"


class _NamedScan(_Scan):
    """An SSM backend that carries the name of the spec it was loaded from."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_the_fallback_is_ranked_by_its_prefill_figure(caplog):
    reg = _registry(
        _timed("partial", 90, family="ssm", load=_Partial, decode=900.0, prefill=10.0),
        # the best decoder prefills slowest: the fallback runs prefill, so it loses
        _timed(
            "decoder",
            50,
            family="ssm",
            load=lambda: _NamedScan("decoder"),
            decode=800.0,
            prefill=100.0,
        ),
        _timed(
            "prefiller",
            5,
            family="ssm",
            load=lambda: _NamedScan("prefiller"),
            decode=80.0,
            prefill=3000.0,
        ),
        _timed("plain", 60, family="ssm", load=lambda: _NamedScan("plain")),
    )
    spec = select_backend("ssm", "auto", registry=reg, device_class="sm90")
    assert spec.name == "partial"
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        backend = load_backend(spec, registry=reg, device="cpu", device_class="sm90")
    assert isinstance(backend, _Partial) and backend.fallback.name == "prefiller"
    assert caplog.messages[-1] == (
        "ssm backend partial delegates what it does not run to prefiller (plugin p, priority 5; "
        f"prefill 3000 vs decoder 100 tok/s on sm90, from {SRC}); others: plain (no prefill "
        "figure on sm90), decoder (prefill 100 < 3000 tok/s on sm90)"
    )
    # without figures for the device class, the fallback goes by priority as before
    assert load_backend(spec, registry=reg, device="cpu").fallback.name == "plain"


def test_device_class_of(monkeypatch):
    import torch

    from backplane.engine.selection import device_class_of

    assert (device_class_of("cpu"), device_class_of(None)) == ("cpu", None)
    asked = []

    def capability(index=None):
        asked.append(index)
        return (9, 0) if index in (None, 0) else (8, 6)

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert [device_class_of(d) for d in ("cuda", "cuda:0", "cuda:1")] == ["sm90", "sm90", "sm86"]
    assert asked == [None, 0, 1]
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert device_class_of("cuda") == "cuda"  # ROCm: no sm class
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_class_of("cuda:1") == "cuda"


def _fake_gpu(monkeypatch, capability: tuple[int, int]) -> BackendRegistry:
    """The real plugins, with triton, flashinfer and a CUDA device of ``capability`` faked."""
    import torch

    from backplane.plugins import flashinfer as fi_plugin
    from backplane.plugins import triton as triton_plugin

    for plugin in (fi_plugin, triton_plugin):
        monkeypatch.setattr(plugin, "module_missing", lambda name: None)
        monkeypatch.setattr(plugin, "cuda_reason", lambda: None)
    monkeypatch.setattr(fi_plugin, "_capability", lambda: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    # compiled kernels, as on a real GPU: under the interpreter auto would pass Triton over
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return BackendRegistry()


def test_auto_passes_over_an_interpreted_backend_unless_nothing_else_runs(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reg = BackendRegistry()
    triton = next(s for s in reg.backends("attention") if s.name == "triton")
    if not triton.availability()[0]:
        pytest.skip(f"triton is not installed here: {triton.availability()[1]}")
    assert "interpret" in triton.capabilities
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        specs = select_backends(EngineConfig(device="cpu"), ["attention"], registry=reg)
    assert specs["attention"].name == "torch"
    assert "triton (runs in an interpreter here; name it to use it)" in caplog.text
    named = select_backends(
        EngineConfig(device="cpu", backends={"attention": "triton"}), ["attention"], registry=reg
    )
    assert named["attention"].name == "triton"


def test_real_plugins_on_sm90_auto_chooses_triton_attention(monkeypatch, caplog):
    """The shipped figures: on sm90 Triton decodes faster than FlashInfer, so auto takes it."""
    reg = _fake_gpu(monkeypatch, (9, 0))
    names = {s.name for s in reg.backends("attention") if s.availability()[0]}
    assert {"triton", "flashinfer"} <= names
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        specs = select_backends(EngineConfig(device="cuda"), ["attention", "mla"], registry=reg)
    assert specs["attention"].name == "triton"
    line = next(m for m in caplog.messages if m.startswith("attention backend: auto chose"))
    assert "decode 953 vs flashinfer 713 tok/s on sm90, from H200, llama-1b shape" in line
    # MLA: FlashInfer's measured decode (355k tok/s of one layer's op) beats Triton's (151k)
    assert specs["mla"].name == "flashinfer"
    line = next(m for m in caplog.messages if m.startswith("mla backend: auto chose"))
    assert "decode 355161 vs triton 150837 tok/s on sm90" in line
    named = select_backends(
        EngineConfig(device="cuda", backends={"attention": "flashinfer"}),
        ["attention"],
        registry=reg,
    )
    assert named["attention"].name == "flashinfer"


def test_real_plugins_without_figures_for_the_device_class_keep_priority(monkeypatch):
    reg = _fake_gpu(monkeypatch, (8, 0))
    specs = select_backends(EngineConfig(device="cuda"), ["attention"], registry=reg)
    assert specs["attention"].name == "flashinfer"


# -- explicit choices without an engine configuration (the kernel warm-up) --------------------


class _OtherAttn(_Attn):
    """A second attention backend class, to tell which spec was loaded."""

    name = "other"


def test_select_backends_for_prefers_then_auto_and_leaves_out_what_cannot_run(caplog):
    reg = _registry(
        ATTN,
        BackendSpec(family="attention", name="other", load=_OtherAttn, priority=1),
        ATTN_GPU,
        _ssm("gpu_helper", 8, capabilities={"cuda"}),
    )
    preferred = select_backends_for({}, prefer="other", device="cpu", registry=reg)
    assert list(preferred) == ["attention"] and type(preferred["attention"]) is _OtherAttn
    # the preferred backend cannot run here: auto decides (highest available priority)
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        fallback = select_backends_for({}, prefer="gpu", device="cpu", registry=reg)
    assert list(fallback) == ["attention"] and type(fallback["attention"]) is _Attn
    assert any(m.startswith("no ssm backend: no available ssm backend") for m in caplog.messages)
    named = select_backends_for(
        {"attention": "other"}, ["attention"], prefer="fast", device="cpu", registry=reg
    )
    assert type(named["attention"]) is _OtherAttn


def test_select_backends_for_raises_for_what_was_named():
    reg = _registry(ATTN, _ssm("gpu_helper", 8, capabilities={"cuda"}))
    with pytest.raises(UnknownBackendError, match="'nope'"):
        select_backends_for({"attention": "nope"}, registry=reg)
    with pytest.raises(BackendUnavailableError, match="it does not run on cpu"):
        select_backends_for({"ssm": "gpu_helper"}, device="cpu", registry=reg)
    with pytest.raises(ConfigError, match="unknown op family 'conv'"):
        select_backends_for({"conv": "fast"}, registry=reg)


# -- the models' fused elementwise work --------------------------------------------------------


def test_select_fused_ops_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_fused_ops("torch", "cpu") == "torch"
    assert select_fused_ops("auto", "cpu") == "torch"
    with pytest.raises(ConfigError) as err:
        select_fused_ops("triton", "cpu")
    assert str(err.value).startswith("fused_ops=triton cannot run on device 'cpu': ")
    assert str(err.value).endswith("; set fused_ops to auto or torch")
    with pytest.raises(ConfigError) as err:
        select_fused_ops("cuda", "cpu")
    assert str(err.value) == "fused_ops: expected one of auto, torch, triton, got 'cuda'"


def test_select_fused_ops_auto_on_cuda_takes_triton_only_where_it_imports(monkeypatch, caplog):
    from backplane.models import fused

    kernels_module = types.ModuleType("kernels")
    monkeypatch.setattr(fused, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(fused, "load_kernels", lambda: kernels_module)
    assert select_fused_ops("auto", "cuda") == "triton"

    monkeypatch.setattr(fused, "triton_unavailable_reason", lambda device: "no CUDA here")
    assert select_fused_ops("auto", "cuda") == "torch"

    def broken():
        raise ImportError("libcuda.so: cannot open")

    monkeypatch.setattr(fused, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(fused, "load_kernels", broken)
    with caplog.at_level(logging.WARNING, logger="backplane.engine.selection"):
        assert select_fused_ops("auto", "cuda") == "torch"
    assert caplog.messages == [
        "fused_ops=auto: the Triton kernels do not import (libcuda.so: cannot open); using torch"
    ]

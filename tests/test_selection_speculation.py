"""``auto`` under speculative decoding: recurrent families prefer backends that chain rows."""

from __future__ import annotations

import importlib
import logging
import types

import pytest

from backplane import BackendSpec, hookimpl
from backplane.core.backend_spec import CHAINED_ROWS
from backplane.core.errors import BackendUnavailableError
from backplane.core.families import RecurrentBackend
from backplane.core.registry import BackendRegistry, get_registry
from backplane.engine.config import EngineConfig
from backplane.engine.selection import (
    RECURRENT_FAMILIES,
    BackendSelection,
    select_backend,
    select_backends,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def _plugin(*specs: BackendSpec) -> types.SimpleNamespace:
    """A plugin object whose family hooks return ``specs``, grouped by family."""
    ns = types.SimpleNamespace()
    for family in {spec.family for spec in specs}:
        mine = [spec for spec in specs if spec.family == family]
        setattr(ns, f"backplane_{family}_backends", hookimpl(lambda mine=mine: list(mine)))
    return ns


def _registry(*specs: BackendSpec) -> BackendRegistry:
    reg = BackendRegistry(load_entry_points=False)
    info = reg.register(_plugin(*specs), name="fake")
    assert info.error is None, info.error
    return reg


def _pair(family: str, *, chaining_usable: bool = True) -> list[BackendSpec]:
    """A fast non-chaining backend and a lower-priority chaining one of ``family``."""
    return [
        BackendSpec(family=family, name="fast", load="x:y", priority=55),
        BackendSpec(
            family=family,
            name="chains",
            load="x:y",
            priority=50,
            capabilities={CHAINED_ROWS},
            is_available=lambda: (chaining_usable, "" if chaining_usable else "needs a GPU"),
        ),
        BackendSpec(family=family, name="reference", load="x:y", priority=0),
    ]


def _highest_priority(reg: BackendRegistry, family: str) -> str:
    """The name plain priority ranks first among the usable backends: the reference."""
    usable = [spec for spec in reg.backends(family) if spec.availability()[0]]
    return max(usable, key=lambda spec: spec.priority).name


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_without_speculation_auto_keeps_priority(family):
    reg = _registry(*_pair(family))
    chosen = select_backends(EngineConfig(device="cpu"), [family], registry=reg)
    assert chosen[family].name == _highest_priority(reg, family) == "fast"


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_speculation_prefers_a_backend_that_chains_rows(family, caplog):
    reg = _registry(*_pair(family))
    config = EngineConfig(device="cpu", speculative_config=NGRAM)
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        chosen = select_backends(config, [family], registry=reg)
    spec = chosen[family]
    assert CHAINED_ROWS in spec.capabilities
    assert spec.name == "chains"
    line = next(r.getMessage() for r in caplog.records if "auto chose" in r.getMessage())
    assert "preferred over fast" in line
    assert "verify graphs" in line
    # the reference backend ranks below the choice anyway: it was not passed over
    assert "preferred over fast, reference" not in line


def test_speculation_keeps_a_named_backend():
    reg = _registry(*_pair("delta"))
    config = EngineConfig(device="cpu", speculative_config=NGRAM, backends={"delta": "fast"})
    assert select_backends(config, ["delta"], registry=reg)["delta"].name == "fast"


def test_speculation_without_a_usable_chaining_backend_keeps_priority(caplog):
    reg = _registry(*_pair("delta", chaining_usable=False))
    config = EngineConfig(device="cpu", speculative_config=NGRAM)
    with caplog.at_level(logging.INFO, logger="backplane.engine.selection"):
        chosen = select_backends(config, ["delta"], registry=reg)
    assert chosen["delta"].name == _highest_priority(reg, "delta") == "fast"
    assert not any("preferred over" in r.getMessage() for r in caplog.records)


def test_speculation_leaves_attention_alone():
    reg = _registry(*_pair("attention"))
    config = EngineConfig(device="cpu", speculative_config=NGRAM)
    chosen = select_backends(config, ["attention"], registry=reg)
    assert chosen["attention"].name == _highest_priority(reg, "attention") == "fast"


def test_the_preference_ranks_among_chaining_backends_by_priority():
    specs = [
        *_pair("ssm"),
        BackendSpec(
            family="ssm", name="chains_low", load="x:y", priority=10, capabilities={CHAINED_ROWS}
        ),
    ]
    reg = _registry(*specs)
    chaining = [spec for spec in reg.backends("ssm") if CHAINED_ROWS in spec.capabilities]
    want = max(chaining, key=lambda spec: spec.priority).name
    assert select_backend("ssm", registry=reg, prefer=CHAINED_ROWS).name == want == "chains"


def test_replacement_under_speculation_prefers_chaining_backends():
    from backplane.backends.torch.delta import TorchDeltaBackend

    specs = [
        BackendSpec(family="delta", name=name, load=TorchDeltaBackend, priority=priority, **kw)
        for name, priority, kw in [
            ("top", 60, {}),
            ("chains", 50, {"capabilities": {CHAINED_ROWS}}),
            ("chains_too", 40, {"capabilities": {CHAINED_ROWS}}),
        ]
    ]
    reg = _registry(*specs)
    config = EngineConfig(device="cpu", speculative_config=NGRAM)
    selection = BackendSelection(config, ["delta"], registry=reg)
    assert selection.specs["delta"].name == "chains"
    exc = BackendUnavailableError("cannot run this layer", family="delta", backend="chains")
    assert selection.replace(exc)
    # plain priority would take "top" next; the preference holds for the replacement too
    assert selection.specs["delta"].name == "chains_too"
    assert selection.replace(exc)
    assert selection.specs["delta"].name == "top"


# -- the in-tree specs declare what their classes do --------------------------------------------


def _class_of(spec: BackendSpec) -> type:
    assert isinstance(spec.load, str), spec.load
    module_name, _, attr = spec.load.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        pytest.skip(f"{spec.family}/{spec.name} does not import here: {exc}")
    for part in attr.split("."):
        target = getattr(target, part)
    assert isinstance(target, type), target
    return target


def _recurrent_specs() -> list[BackendSpec]:
    return [
        spec for family in sorted(RECURRENT_FAMILIES) for spec in get_registry().backends(family)
    ]


@pytest.mark.parametrize("spec", _recurrent_specs(), ids=lambda spec: f"{spec.family}-{spec.name}")
def test_capability_matches_chains_rows(spec):
    cls = _class_of(spec)
    assert issubclass(cls, RecurrentBackend)
    assert (CHAINED_ROWS in spec.capabilities) == cls.chains_rows


def test_flashinfer_recurrent_specs_do_not_declare_chained_rows():
    flashinfer = [spec for spec in _recurrent_specs() if spec.name == "flashinfer"]
    assert {spec.family for spec in flashinfer} == set(RECURRENT_FAMILIES)
    assert all(CHAINED_ROWS not in spec.capabilities for spec in flashinfer)


def test_torch_and_triton_recurrent_specs_declare_chained_rows():
    specs = {spec.key: spec for spec in _recurrent_specs()}
    for family in RECURRENT_FAMILIES:
        for name in ("torch", "triton"):
            assert CHAINED_ROWS in specs[(family, name)].capabilities, (family, name)


def _loadable(family: str, name: str, priority: int, *caps: str) -> BackendSpec:
    """A backend spec that loads the torch backend of ``family`` under another name."""
    from backplane.backends.torch.attention import TorchAttentionBackend
    from backplane.backends.torch.delta import TorchDeltaBackend

    base = {"attention": TorchAttentionBackend, "delta": TorchDeltaBackend}[family]
    cls = type(f"_{name.title()}", (base,), {"name": name})
    return BackendSpec(family=family, name=name, load=cls, priority=priority, capabilities=caps)


@pytest.mark.parametrize("speculation", [False, True])
def test_the_kernel_warm_up_takes_flashinfer_where_the_engine_would_run_it(
    speculation, monkeypatch
):
    import backplane.engine.selection as selection
    from backplane.cli.warmup import _select_backends

    # a FlashInfer stand-in that does not chain rows, beside a backend that does
    reg = _registry(
        _loadable("delta", "flashinfer", 55),
        _loadable("delta", "chains", 50, CHAINED_ROWS),
        _loadable("attention", "flashinfer", 55),
        _loadable("attention", "plain", 50),
    )
    monkeypatch.setattr(selection, "_registry", lambda registry: reg)
    config = EngineConfig(device="cpu", speculative_config=NGRAM if speculation else None)
    chosen = _select_backends(config)
    # attention prefers no capability: FlashInfer, whose JIT cache the warm-up fills;
    # the delta family gets it only where the engine's auto would choose it
    assert chosen["attention"].name == "flashinfer"
    assert chosen["delta"].name == ("chains" if speculation else "flashinfer")

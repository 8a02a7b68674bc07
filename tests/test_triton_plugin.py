"""The Triton plugin's descriptors: cheap import, per-family availability reasons, capabilities."""

from __future__ import annotations

import subprocess
import sys

import pytest

import backplane.plugins.triton as plugin

HOOKS = {
    "attention": plugin.backplane_attention_backends,
    "mla": plugin.backplane_mla_backends,
    "ssm": plugin.backplane_ssm_backends,
    "delta": plugin.backplane_delta_backends,
}


def _spec(family: str):
    (spec,) = HOOKS[family]()
    assert spec.family == family and spec.name == "triton"
    return spec


@pytest.fixture
def environment(monkeypatch):
    """Control which packages look installed, whether CUDA is there, and the interpreter flag."""
    state = {"missing": set(), "cuda": True, "interpret": False}

    def module_missing(name: str) -> str | None:
        return f"python package '{name}' is not installed" if name in state["missing"] else None

    monkeypatch.setattr(plugin, "module_missing", module_missing)
    monkeypatch.setattr(
        plugin, "cuda_reason", lambda: None if state["cuda"] else "no CUDA device is available"
    )
    monkeypatch.setattr(plugin, "triton_interpret", lambda: state["interpret"])
    return state


def test_plugin_import_does_not_import_torch_or_triton():
    """Discovery stays cheap: the plugin module pulls in neither torch nor triton."""
    code = (
        "import sys, backplane.plugins.triton as p\n"
        "p.backplane_attention_backends(); p.backplane_delta_backends()\n"
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("family", list(HOOKS))
def test_available_with_everything_present(environment, family):
    """With triton, CUDA, mamba-ssm, einops and fla present every family is available."""
    assert _spec(family).availability() == (True, "")


@pytest.mark.parametrize("family", list(HOOKS))
def test_triton_missing_is_reported_for_every_family(environment, family):
    """A missing triton names the package and how to install it."""
    environment["missing"] = {"triton"}
    ok, reason = _spec(family).availability()
    assert not ok
    assert "'triton'" in reason and "backplane[triton]" in reason


@pytest.mark.parametrize("family", list(HOOKS))
def test_no_cuda_unless_interpreting(environment, family):
    """Without CUDA the backends are unavailable, and say that TRITON_INTERPRET=1 is the way out."""
    environment["cuda"] = False
    ok, reason = _spec(family).availability()
    assert not ok
    assert "CUDA" in reason and "TRITON_INTERPRET=1" in reason
    environment["interpret"] = True
    assert _spec(family).availability() == (True, "")


@pytest.mark.parametrize(
    ("family", "package", "hint"),
    [
        ("ssm", "mamba_ssm", "mamba-ssm"),
        ("ssm", "einops", "einops"),
        ("delta", "fla", "fla-core"),
    ],
)
def test_library_missing_is_reported_for_its_family_only(environment, family, package, hint):
    """mamba-ssm / einops missing makes only ``ssm`` unavailable, fla only ``delta``."""
    environment["missing"] = {package}
    ok, reason = _spec(family).availability()
    assert not ok
    assert f"'{package}'" in reason and hint in reason
    for other in set(HOOKS) - {family}:
        assert _spec(other).availability() == (True, ""), other


def test_priority_above_torch_and_lazy_load_paths():
    """Triton beats the torch reference in ``auto``; kernels load from backplane.backends.triton."""
    import backplane.plugins.torch as torch_plugin

    torch_priority = torch_plugin.backplane_attention_backends()[0].priority
    for family in HOOKS:
        spec = _spec(family)
        assert spec.priority > torch_priority
        assert isinstance(spec.load, str)
        assert spec.load.startswith(f"backplane.backends.triton.{family}:")


@pytest.mark.parametrize("family", list(HOOKS))
def test_capabilities_under_the_interpreter(environment, family):
    """Under TRITON_INTERPRET=1: no bfloat16; ``cpu`` for all but delta (fla's chunk kernels)."""
    caps = _spec(family).capabilities
    assert {"cuda", "bfloat16", "float32"} <= caps and "cpu" not in caps
    environment["interpret"] = True
    caps = _spec(family).capabilities
    assert "bfloat16" not in caps and "float32" in caps
    assert ("cpu" in caps) == (family != "delta")


def test_attention_declares_gqa_and_sliding_window():
    """The attention kernels support GQA and sliding windows (the kit gates tests on these)."""
    assert {"gqa", "sliding_window"} <= _spec("attention").capabilities


def test_decode_arrival_counters_outlive_growth():
    # A decode graph captured with the small buffer replays into it after the
    # buffer has grown: it must stay allocated (not be handed to other tensors).
    import torch

    tri = pytest.importorskip("backplane.backends.triton.attention_launch")
    dev = torch.device("cpu")
    saved = tri._ARRIVALS.pop(dev, None)
    try:
        small = tri._arrivals(dev, 10)
        assert tri._arrivals(dev, 1000) is small
        big = tri._arrivals(dev, 5000)
        assert big.numel() >= 5000 and not big.any()
        assert any(b is small for b in tri._ARRIVALS[dev])
    finally:
        tri._ARRIVALS.pop(dev, None)
        if saved is not None:
            tri._ARRIVALS[dev] = saved

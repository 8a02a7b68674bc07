"""FlashInfer modules built in the background at start-up: the first use waits for the build,
and a failed build is logged and left to the first use to build.

Neither FlashInfer nor CUDA is needed: the builds here are stand-ins.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from backplane.backends.flashinfer import _prebuild
from backplane.backends.flashinfer import ssm as fi_ssm
from backplane.core import compile_ahead
from backplane.core.families import SSMLayerSpec


@pytest.fixture(autouse=True)
def no_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_prebuild, "_builds", {})


def test_the_first_use_waits_for_the_build() -> None:
    release = threading.Event()
    built = []

    def build() -> None:
        release.wait(5)
        built.append(True)

    job = _prebuild.start("m", "module m", build)
    assert not job.done()
    threading.Timer(0.05, release.set).start()
    assert _prebuild.wait("m") is True
    assert built == [True] and job.done() and job.error is None


def test_a_failed_build_is_logged_once_and_left_to_the_use(caplog) -> None:  # noqa: ANN001
    def build() -> None:
        raise RuntimeError("nvcc failed")

    _prebuild.start("m", "module m", build)
    with caplog.at_level(logging.WARNING):
        assert _prebuild.wait("m") is False
        assert _prebuild.wait("m") is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "module m" in warnings[0].message and "RuntimeError: nvcc failed" in warnings[0].message
    assert "built on first use" in warnings[0].message


def test_a_module_is_built_once_and_an_unknown_one_is_not_waited_for() -> None:
    calls = []
    first = _prebuild.start("m", "module m", lambda: calls.append(1))
    assert _prebuild.start("m", "module m", lambda: calls.append(2)) is first
    assert _prebuild.wait("m") and calls == [1]
    assert _prebuild.wait("never started") is True


LAYER = SSMLayerSpec(0, 8, 64, 128, 2)


def test_describing_a_layer_starts_the_decode_module_build(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(fi_ssm, "_can_prebuild", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fi_ssm, "_build_state_update", lambda dev, mod: built.append((dev, mod)))
    backend = fi_ssm.FlashInferSSMBackend()
    for _ in range(3):
        backend.cache_spec(LAYER, num_slots=4, dtype=torch.bfloat16)
    # the module a bf16 decode asks for: float32 state and A, int32 state slots, one token a row
    f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
    expected = (f32, bf16, bf16, f32, i32, 64, 128, 1)
    assert _prebuild.wait(expected)
    assert built == [(torch.device("cuda", 0), expected)]
    assert fi_ssm.state_update_module(f32, bf16, bf16, i32, 64, 128) == expected


def test_only_a_starting_engine_on_cuda_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_ssm, "_build_state_update", lambda dev, mod: pytest.fail("built"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = fi_ssm.FlashInferSSMBackend()
    # a test or a tool describing caches is not a start-up
    assert backend.prebuild(LAYER, torch.bfloat16) is None
    backend.cache_spec(LAYER, num_slots=4, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with compile_ahead.startup_window():
        assert backend.prebuild(LAYER, torch.bfloat16) is None
    assert not _prebuild._builds


def test_the_module_arguments_match_flashinfer() -> None:
    """The key's fields are, in order, the arguments FlashInfer builds the module from."""
    module = pytest.importorskip("flashinfer.mamba.selective_state_update")
    import inspect

    params = list(inspect.signature(module.get_selective_state_update_module).parameters)
    assert params == [
        "device",
        "state_dtype",
        "input_dtype",
        "weight_dtype",
        "matrixA_dtype",
        "stateIndex_dtype",
        "dim",
        "dstate",
        "ntokens_mtp",
    ]

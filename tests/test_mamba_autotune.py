"""mamba-ssm's autotuners at start-up: compiled ahead (each configuration once), timed briefly,
and tuned under keys without sequence lengths (so a warm start-up times nothing).

No GPU here: the kernel an autotuner wraps is a stand-in that records what it is asked
to compile; the last tests read mamba-ssm's own autotuners where its sources are at hand.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton")

from triton.runtime.autotuner import Autotuner, Config  # noqa: E402

from backplane.backends.triton import _autotune  # noqa: E402
from backplane.core import compile_ahead  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _kernel(x_ptr, n, seqlen, BLOCK):  # noqa: ANN001, N803 - a kernel's signature
    """The Python function behind the stand-in kernel."""


class RecordingKernel:
    """Stands in for a ``triton.jit`` function under an autotuner: records each ``run``."""

    def __init__(self, arg_names: list[str]) -> None:
        self.fn = _kernel
        self.arg_names = arg_names
        self.runs: list[dict] = []

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.runs.append({"args": args, "grid": grid, "warmup": warmup, **kwargs})


CONFIGS = [Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 2), (32, 4), (64, 4))]


def _tuner(configs: list[Config] = CONFIGS) -> _autotune.AheadAutotuner:
    names = ["x_ptr", "n", "seqlen", "BLOCK"]
    tuner = Autotuner(RecordingKernel(names), names, list(configs), ["n"], None, None)
    return _autotune.adapt(tuner)


def _asked(tuner: Autotuner) -> list[int]:
    return [r["BLOCK"] for r in tuner.fn.runs if r["warmup"]]


def test_adapt_keeps_the_object_and_times_briefly() -> None:
    tuner = Autotuner(RecordingKernel(["x_ptr", "n"]), ["x_ptr", "n"], CONFIGS, ["n"], None, None)
    assert _autotune.adapt(tuner) is tuner
    assert type(tuner) is _autotune.AheadAutotuner
    assert tuner._do_bench.keywords == {
        "warmup": _autotune.TUNING_WARMUP_MS,
        "rep": _autotune.TUNING_REP_MS,
    }


def test_every_configuration_is_asked_for_once(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = _tuner()
    monkeypatch.setattr(tuner, "cache_results", False)
    asked = tuner.compile_ahead("x", 128, 8192, grid=(4,), warmup=False)
    assert asked == CONFIGS
    assert _asked(tuner) == [16, 32, 64]
    for run, config in zip(tuner.fn.runs, CONFIGS, strict=True):
        # the real launch's arguments and options, so the real launch finds them compiled
        assert run["args"] == ("x", 128, 8192) and run["grid"] == (4,)
        assert run["num_warps"] == config.num_warps
    assert tuner.nargs is None


def test_a_tuned_key_asks_for_its_choice_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = _tuner()
    monkeypatch.setattr(tuner, "cache_results", False)
    tuner.cache[tuner.tuning_key(("x", 128, 8192), {})] = CONFIGS[1]
    # a sequence length is not part of the key: another one is tuned already too
    assert tuner.compile_ahead("x", 128, 16, grid=(1,), warmup=False) == [CONFIGS[1]]
    assert tuner.compile_ahead("x", 256, 16, grid=(1,), warmup=False) == CONFIGS
    assert _asked(tuner) == [32, 16, 32, 64]


def test_a_choice_kept_on_disk_is_loaded_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = _tuner()
    monkeypatch.setattr(tuner, "cache_results", True)

    def on_disk(key, configs, bench_fn):  # noqa: ANN001, ANN202
        tuner.cache[key] = configs[2]
        return True

    monkeypatch.setattr(tuner, "check_disk_cache", on_disk)
    assert tuner.compile_ahead("x", 128, 8192, grid=(1,), warmup=False) == [CONFIGS[2]]

    def not_on_disk(key, configs, bench_fn):  # noqa: ANN001, ANN202
        bench_fn()  # Triton times here; the adapter stops it
        pytest.fail("timing was not stopped")

    other = _tuner()
    monkeypatch.setattr(other, "cache_results", True)
    monkeypatch.setattr(other, "check_disk_cache", not_on_disk)
    assert other.compile_ahead("x", 128, 8192, grid=(1,), warmup=False) == CONFIGS
    assert not other.cache


def test_a_single_configuration_is_asked_for_as_it_is() -> None:
    tuner = _tuner(CONFIGS[:1])
    assert tuner.compile_ahead("x", 1, 1, grid=(1,), warmup=False) == CONFIGS[:1]


def test_inside_compile_only_a_launch_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = _tuner()
    monkeypatch.setattr(tuner, "cache_results", False)
    monkeypatch.setattr(compile_ahead, "compiling_only", lambda: True)
    assert tuner.run("x", 128, 8192, grid=(1,), warmup=False) is None
    assert [r["warmup"] for r in tuner.fn.runs] == [True, True, True]


def test_timing_goes_to_the_start_up_details(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, config, **k: [1.0, 1.0, 1.0])
    tuner = _tuner()
    with compile_ahead.startup_window() as details:
        assert tuner._bench("x", 128, 8192, config=CONFIGS[0], grid=(1,)) == [1.0, 1.0, 1.0]
    assert details[_autotune.TUNING_DETAIL] >= 0.0


# -- mamba-ssm's own autotuners ------------------------------------------------------------


@pytest.fixture(scope="module")
def mamba():
    """mamba-ssm's Triton modules (installed, or unpacked from its source archive)."""
    if importlib.util.find_spec("einops") is None:
        pytest.skip("einops is not installed (mamba-ssm's modules import it)")
    if importlib.util.find_spec("mamba_ssm") is None:
        dirs = [ROOT / ".wheels", ROOT / ".gpu" / "wheels"]
        sdist = sorted(p for d in dirs for p in d.glob("mamba_ssm-*.tar.gz"))
        if not sdist:
            pytest.skip("mamba-ssm is not importable and its source archive is not at hand")
        dest = Path(tempfile.gettempdir()) / "backplane-triton-test-site" / "mamba"
        if not dest.exists():
            with tarfile.open(sdist[0]) as tf:
                tf.extractall(dest, filter="data")
        sys.path.insert(0, str(next(dest.glob("mamba_ssm-*"))))
    from backplane.backends.triton import _mamba_import

    return _mamba_import.load()


#: arguments that grow with the batch: a tuning key holding one would time again per length
SEQUENCE_ARGS = {"seqlen", "total_seqlen", "batch", "nchunks"}


def test_the_prefill_kernels_tune_per_model_not_per_length(mamba) -> None:  # noqa: ANN001
    tuners = mamba.prefill_autotuners
    from backplane.backends.triton._mamba_import import PREFILL_KERNELS

    assert set(tuners) == set(PREFILL_KERNELS)
    for name, tuner in tuners.items():
        assert not SEQUENCE_ARGS & set(tuner.keys), name
        # Triton keeps no choice on disk for a configuration with a pre_hook
        assert not any(c.pre_hook for c in tuner.configs), name
    # (the interpreter keeps one configuration each)
    if all(len(t.configs) > 1 for t in tuners.values()):
        assert sum(len(t.configs) for t in tuners.values()) == 51


def test_each_mamba_configuration_is_asked_for_once(mamba) -> None:  # noqa: ANN001
    for name, real in mamba.prefill_autotuners.items():
        tuner = copy.copy(real)  # the loaded kernels stay as they are
        tuner.__class__ = _autotune.AheadAutotuner
        tuner.fn = RecordingKernel(real.arg_names)
        tuner.cache = {}
        tuner.cache_results = False
        params = inspect.signature(real.base_fn).parameters
        args = tuple(16 for p in params if p not in {k for c in real.configs for k in c.kwargs})
        asked = tuner.compile_ahead(*args, grid=(1,), warmup=False)
        assert asked == real.configs, name
        runs = [r for r in tuner.fn.runs if r["warmup"]]
        assert len(runs) == len(real.configs), name
        assert [{k: r[k] for k in c.kwargs} for r, c in zip(runs, real.configs, strict=True)] == [
            c.kwargs for c in real.configs
        ], name


@pytest.mark.parametrize(("dtype", "precision"), [("float32", "ieee"), ("bfloat16", None)])
def test_float32_dots_stay_exact_until_the_compiles_end(
    dtype: str, precision: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton reads TRITON_F32_DEFAULT while it compiles, after the compile-only pass returned."""
    import os

    import torch

    from backplane.backends.triton import ssm

    seen = {}

    class Mode:
        def __init__(self, executor, *, ignore_errors=False):  # noqa: ANN001
            pass

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            # where Triton's AsyncCompileMode waits for the compiles
            seen["exit"] = os.environ.get("TRITON_F32_DEFAULT")

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    monkeypatch.setattr(compile_ahead, "_async_compile_mode", lambda: Mode)
    monkeypatch.setattr(ssm, "packed_prefill", lambda *a: seen.setdefault("pass", a[2].dtype))
    x = torch.zeros(4, 2, 2, dtype=getattr(torch, dtype))
    ssm.compile_prefill_ahead((None, None, x))
    assert seen == {"pass": x.dtype, "exit": precision}
    assert "TRITON_F32_DEFAULT" not in os.environ

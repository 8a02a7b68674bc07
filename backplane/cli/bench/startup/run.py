"""One start-up run: the weights of each shape, then one fresh process per cache state.

Each start-up is measured in a process of its own
(:mod:`backplane.cli.bench.startup.child`), so the import is paid as a
serving process pays it and nothing this process compiled or cached in memory
helps. The warm run keeps the kernel caches as they are; the cold run points
every on-disk compile cache (Triton, Inductor, FlashInfer's JIT, the CUDA
driver's) at a new empty temporary directory, in the child's environment only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backplane.cli.bench.latency.weights import weights_workdir
from backplane.cli.bench.startup.child import RESULT_MARKER
from backplane.core.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_STATES",
    "StartupSettings",
    "cold_cache_env",
    "engine_overrides",
    "measure_startup",
    "prepare_model",
    "run_startup_benchmark",
]

#: the cache states a run measures, in order
CACHE_STATES = ("warm", "cold")


@dataclass
class StartupSettings:
    """What one ``bench startup`` run measures.

    :param shapes: shape names, presets, model directories or GGUF files.
    :param device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    :param dtype: ``auto`` or a dtype name.
    :param attention: the attention backend (``auto`` lets selection choose).
    :param cuda_graphs: ``on`` (the engine's default mode) or ``off``.
    :param backends: ``{family: backend}`` of the other op families.
    :param cold: also measure with empty compile caches.
    :param weights_dir: where random weights are kept (``None``: a temporary folder).
    :param max_model_len: the engine's limit (``None``: the model's own).
    :param max_num_seqs: the engine's limit (``None``: its default).
    :param max_num_tokens: the engine's limit (``None``: its default).
    :param timeout: seconds one start-up may take before it counts as failed.
    :param log_level: the child processes' logging level.
    """

    shapes: list[str]
    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    cuda_graphs: str = "on"
    backends: dict[str, str] = field(default_factory=dict)
    cold: bool = False
    weights_dir: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    timeout: float = 1800.0
    log_level: str = "warning"


def cold_cache_env(root: str | os.PathLike[str]) -> dict[str, str]:
    """Environment variables that give every compile cache an empty directory under ``root``.

    :param root: a new, empty directory.
    :return: ``{variable: directory}`` for backplane's cache root, Triton,
        Inductor, FlashInfer's JIT workspace and the CUDA driver's cache.
    """
    base = Path(root)
    return {
        "BACKPLANE_CACHE_DIR": str(base / "backplane"),
        "TRITON_CACHE_DIR": str(base / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
        # FlashInfer keeps its JIT builds under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer
        "FLASHINFER_WORKSPACE_BASE": str(base / "flashinfer"),
        "CUDA_CACHE_PATH": str(base / "cuda"),
    }


def engine_overrides(settings: StartupSettings, device: str, dtype: str) -> dict[str, Any]:
    """The engine settings of every measured start-up.

    :param settings: the run's settings.
    :param device: the resolved device.
    :param dtype: the resolved dtype's name.
    :return: keyword arguments of ``LLM``.
    """
    overrides: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "cuda_graphs": None if settings.cuda_graphs == "on" else "off",
        "backends": {**settings.backends, "attention": settings.attention},
    }
    for name in ("max_model_len", "max_num_seqs", "max_num_tokens"):
        value = getattr(settings, name)
        if value is not None:
            overrides[name] = value
    return overrides


def prepare_model(name: str, workdir: str, dtype: Any, dtype_name: str) -> str:
    """What the engine loads for shape ``name``: a checkpoint as it is, else saved random weights.

    :param name: a shape, preset, model directory, GGUF file or installed model.
    :param workdir: where random weights are saved (a folder saved before is reused).
    :param dtype: the ``torch.dtype`` of saved weights.
    :param dtype_name: its name.
    :return: the path the engine loads.
    :raises ConfigError: an unknown shape.
    """
    from backplane.cli.bench.latency.checkpoint import checkpoint_file
    from backplane.cli.bench.latency.shapes import is_model_dir, shape_config
    from backplane.cli.bench.latency.weights import save_random_weights

    gguf = checkpoint_file(name)
    if gguf is not None:
        return str(gguf)
    if is_model_dir(name):
        return name
    config = shape_config(name)
    folder = os.path.join(workdir, f"{name}-{dtype_name}")
    logger.info("%s: random %s weights in %s", name, dtype_name, folder)
    save_random_weights(name, config, folder, dtype)
    return folder


def _child_env(cache_root: str | None) -> dict[str, str]:
    import backplane

    env = dict(os.environ)
    # the child imports this same backplane, installed or not
    source = str(Path(backplane.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    if cache_root is not None:
        env.update(cold_cache_env(cache_root))
    return env


def measure_startup(
    model: str,
    overrides: Mapping[str, Any],
    *,
    cold: bool,
    timeout: float,
    log_level: str = "warning",
) -> dict[str, Any]:
    """Start one engine in a fresh process and return its start-up phases.

    :param model: what the engine loads.
    :param overrides: the engine's settings.
    :param cold: give the process empty compile caches (a temporary directory,
        removed afterwards) instead of the ones in use.
    :param timeout: seconds before the process is stopped and the run failed.
    :param log_level: the process's logging level (its log goes to stderr).
    :return: ``status`` ``"ok"`` with ``phases``, ``details``, ``total``,
        ``backends`` and ``graph_mode`` (see
        :func:`~backplane.cli.bench.startup.child.startup_result`), or
        ``status`` ``"failed"`` with ``error``.
    """
    caches = "cold" if cold else "warm"
    with contextlib.ExitStack() as stack:
        root = (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-startup-cold-"))
            if cold
            else None
        )
        env = _child_env(root)
        spec = {"model": model, "overrides": dict(overrides), "log_level": log_level}
        spec["spawned"] = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "backplane.cli.bench.startup.child", json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {
                "status": "failed",
                "caches": caches,
                "error": f"not ready within {timeout:.0f} s (raise --timeout)",
            }
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER) :])
            return {"status": "ok", "caches": caches, **result}
    return {
        "status": "failed",
        "caches": caches,
        "error": f"the engine process exited with status {proc.returncode} without a result "
        "(its log is above; --log-level info shows more)",
    }


def run_startup_benchmark(settings: StartupSettings) -> dict[str, Any]:
    """Measure the start-up of every shape, warm and (with ``cold``) cold.

    :param settings: what to measure.
    :return: ``machine``, ``settings`` and one entry per shape: ``shape``,
        ``model`` (the path loaded), ``engine_settings`` and ``runs`` (one per
        cache state, see :func:`measure_startup`).
    :raises ConfigError: invalid settings or an unknown shape (nothing is run).
    """
    from backplane.cli.bench.latency.settings import resolve_device_dtype
    from backplane.cli.bench.machine import machine_info

    if settings.cuda_graphs not in ("on", "off"):
        raise ConfigError(f"--cuda-graphs {settings.cuda_graphs!r}: use on or off")
    if settings.timeout <= 0:
        raise ConfigError(f"--timeout {settings.timeout}: give a positive number of seconds")
    # bench latency's resolution reads only the device and dtype, which these settings share
    device, dtype, dtype_name = resolve_device_dtype(settings)
    overrides = engine_overrides(settings, str(device), dtype_name)
    states = CACHE_STATES if settings.cold else CACHE_STATES[:1]
    shapes = []
    with contextlib.ExitStack() as stack:
        workdir = weights_workdir(stack, settings.weights_dir, "bench-startup-")
        for name in settings.shapes:
            model = prepare_model(name, workdir, dtype, dtype_name)
            runs = {}
            for state in states:
                logger.info("%s: %s start-up", name, state)
                runs[state] = measure_startup(
                    model,
                    overrides,
                    cold=state == "cold",
                    timeout=settings.timeout,
                    log_level=settings.log_level,
                )
            shapes.append(
                {"shape": name, "model": model, "engine_settings": overrides, "runs": runs}
            )
    return {"machine": machine_info(device), "settings": asdict(settings), "shapes": shapes}

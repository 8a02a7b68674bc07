"""What one ``backplane bench latency`` run measures: its settings, checked and resolved.

Holds :class:`Settings` with the choices it offers (attention backends, graph
modes, transformers modes), the engine constants shared by the weights and the
engines (op families, KV page size), the validation run before anything is
measured, and the resolution of ``auto`` device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backplane.cli.bench.latency.shapes import shape_config
from backplane.cli.bench.latency.speculation import (
    WORKLOADS,
    check_shape_speculation,
    check_speculative_config,
)
from backplane.core.errors import ConfigError

DEFAULT_SHAPES: tuple[str, ...] = ("llama-1b", "nemotron-h-0.85b")
ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "triton", "flashinfer")
GRAPH_MODES: tuple[str, ...] = ("on", "off")
TRANSFORMERS_MODES: tuple[str, ...] = ("eager", "compile")

FAMILIES: tuple[str, ...] = ("attention", "ssm", "mla", "delta")
"""The op families an engine picks a backend for."""

PAGE_SIZE = 16
"""Tokens per KV page, for the engines and for the KV bytes per token of the floor."""


@dataclass
class Settings:
    """What one benchmark run measures.

    :param shapes: shape names (:data:`~backplane.cli.bench.latency.shapes.SHAPES` or built-in presets).
    :param batch_sizes: batch sizes, ascending.
    :param prompt_len: prompt tokens per sequence.
    :param new_tokens: generated tokens per sequence (at least 2).
    :param device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    :param dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``bfloat16``,
        ``float16`` or ``float32``.
    :param attention_backends: backplane attention backends to measure.
    :param cuda_graphs: ``on`` (the engine's default graph mode) and/or ``off``.
    :param transformers_modes: ``eager`` and/or ``compile``; empty: no transformers rows.
    :param backends: backends of the other op families (``{"ssm": "triton"}``), else auto.
    :param repeats: timed runs per configuration and batch size (the median is reported).
    :param warmup: untimed runs before them.
    :param seed: seed of the prompts.
    :param compile_on_cpu: also compile transformers on a CPU (slow; off by default).
    :param weights_dir: keep the saved weights here (default: a temporary folder).
    :param tensor_parallel_size: ranks each backplane engine is split over (1).
    :param speculative_config: measure each backplane configuration again with this
        speculative decoding (the mapping ``LLM`` takes); ``None``: without only.
    :param workload: the prompts: ``random`` tokens, or ``rewrite`` (a paragraph to
        rewrite for a trained checkpoint, a repeated random document otherwise, see
        :mod:`~backplane.cli.bench.latency.speculation`).
    """

    shapes: list[str] = field(default_factory=lambda: list(DEFAULT_SHAPES))
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_len: int = 512
    new_tokens: int = 128
    device: str = "auto"
    dtype: str = "auto"
    attention_backends: list[str] = field(default_factory=lambda: list(ATTENTION_BACKENDS))
    cuda_graphs: list[str] = field(default_factory=lambda: list(GRAPH_MODES))
    transformers_modes: list[str] = field(default_factory=lambda: list(TRANSFORMERS_MODES))
    backends: dict[str, str] = field(default_factory=dict)
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    compile_on_cpu: bool = False
    weights_dir: str | None = None
    tensor_parallel_size: int = 1
    speculative_config: dict[str, Any] | None = None
    workload: str = "random"


def resolve_device_dtype(settings: Settings) -> tuple[Any, Any, str]:
    """Turn the settings' device and dtype (``auto`` included) into torch objects.

    :param settings: the run's settings.
    :return: the ``torch.device``, the ``torch.dtype`` and the dtype's name.
    :raises ConfigError: a CUDA device without CUDA, or an unknown dtype.
    """
    import torch

    dev = settings.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {settings.device} but CUDA is not available; use --device cpu")
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    name = settings.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    if name not in names:
        raise ConfigError(f"--dtype {settings.dtype!r}: use auto, {', '.join(names)}")
    return device, names[name], name


def check_settings(settings: Settings) -> None:
    """Refuse settings that cannot be measured, before minutes are spent on the others.

    :param settings: the run's settings.
    :raises ConfigError: naming the flag at fault and what it accepts.
    """
    if settings.new_tokens < 2:
        raise ConfigError(
            f"--new-tokens {settings.new_tokens}: at least 2 are needed (the time per token "
            "is measured between the first and the last)"
        )
    if settings.prompt_len < 1:
        raise ConfigError(f"--prompt-len {settings.prompt_len}: must be at least 1")
    if not settings.batch_sizes or min(settings.batch_sizes) < 1:
        raise ConfigError(f"--batch-sizes {settings.batch_sizes}: give positive integers")
    if settings.repeats < 1 or settings.warmup < 0:
        raise ConfigError("--repeats must be at least 1 and --warmup at least 0")
    for name in settings.attention_backends:
        if not name:
            raise ConfigError("--attention: empty backend name")
    for mode in settings.cuda_graphs:
        if mode not in GRAPH_MODES:
            raise ConfigError(f"--cuda-graphs {mode!r}: use on, off or on,off")
    for mode in settings.transformers_modes:
        if mode not in TRANSFORMERS_MODES:
            raise ConfigError(
                f"--transformers {mode!r}: use eager, compile, both (eager,compile) or none"
            )
    for family in settings.backends:
        if family not in FAMILIES or family == "attention":
            raise ConfigError(
                f"--backend {family}=...: the families are ssm, mla, delta "
                "(attention backends are chosen with --attention)"
            )
    if settings.workload not in WORKLOADS:
        raise ConfigError(f"--workload {settings.workload!r}: use {' or '.join(WORKLOADS)}")
    if settings.speculative_config is not None:
        check_speculative_config(settings.speculative_config)
    for shape in settings.shapes:
        cfg = shape_config(shape)
        if settings.speculative_config is not None:
            check_shape_speculation(shape, cfg, settings.speculative_config)
        limit = int(cfg.get("max_position_embeddings", 4096))
        if settings.prompt_len + settings.new_tokens > limit:
            raise ConfigError(
                f"shape {shape!r} holds {limit} positions, fewer than --prompt-len "
                f"{settings.prompt_len} + --new-tokens {settings.new_tokens}"
            )

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
QUANTIZATIONS: tuple[str, ...] = ("none", "fp8")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
WEIGHTS_FORMATS: tuple[str, ...] = ("safetensors", "gguf-q4_k")

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
    :param custom_all_reduce: the engines' ``custom_all_reduce`` (with more than one rank);
        ``None``: the engine's default (on).
    :param speculative_config: measure each backplane configuration again with this
        speculative decoding (the mapping ``LLM`` takes); ``None``: without only.
    :param workload: the prompts: ``random`` tokens, or ``rewrite`` (a paragraph to
        rewrite for a trained checkpoint, a repeated random document otherwise, see
        :mod:`~backplane.cli.bench.latency.speculation`).
    :param quantization: ``"fp8"``: the engines quantise the saved projections to FP8
        on load (the floor counts their e4m3 bytes); ``None``: as saved.
    :param kv_cache_dtype: the engines' KV cache: ``auto`` (the run's dtype) or ``fp8``.
    :param weights_format: how a random-weight shape is saved: ``safetensors`` (an HF
        folder) or ``gguf-q4_k`` (a GGUF file with Q4_K projections, llama-family shapes).
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
    custom_all_reduce: bool | None = None
    speculative_config: dict[str, Any] | None = None
    workload: str = "random"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    weights_format: str = "safetensors"


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
    check_storage(settings)
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


def check_storage(settings: Settings) -> None:
    """Refuse quantisation, KV-cache and weight-format choices the engines cannot run.

    :param settings: the run's settings.
    :raises ConfigError: naming the flag at fault and what to use instead.
    """
    from backplane.cli.bench.latency.checkpoint import checkpoint_file
    from backplane.cli.bench.latency.random_gguf import check_gguf_shape
    from backplane.cli.bench.latency.shapes import is_model_dir

    if settings.quantization not in (None, "fp8"):
        raise ConfigError(f"--quantization {settings.quantization!r}: use none or fp8")
    if settings.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {settings.kv_cache_dtype!r}: use auto or fp8")
    if settings.weights_format not in WEIGHTS_FORMATS:
        raise ConfigError(
            f"--weights-format {settings.weights_format!r}: use {' or '.join(WEIGHTS_FORMATS)}"
        )
    gguf = settings.weights_format != "safetensors"
    if settings.custom_all_reduce is not None and settings.tensor_parallel_size < 2:
        raise ConfigError(
            "--[no-]custom-all-reduce changes how tensor-parallel ranks sum their outputs; "
            "use it with --tensor-parallel-size 2 or more"
        )
    if settings.quantization is not None:
        if gguf:
            raise ConfigError(
                f"--quantization fp8 quantises full-precision weights on load; "
                f"--weights-format {settings.weights_format} stores them quantised already: "
                "give one of the two"
            )
        for shape in settings.shapes:
            if checkpoint_file(shape) is not None:
                raise ConfigError(
                    f"--quantization fp8: shape {shape!r} is a GGUF file, which keeps its own "
                    "quantisation; drop --quantization or measure a safetensors shape"
                )
    if gguf:
        if settings.tensor_parallel_size > 1:
            raise ConfigError(
                f"--weights-format {settings.weights_format}: a tensor-parallel engine "
                "dequantises GGUF projections at load; use --tensor-parallel-size 1"
            )
        for shape in settings.shapes:
            if checkpoint_file(shape) is not None or is_model_dir(shape):
                raise ConfigError(
                    f"--weights-format {settings.weights_format} writes random weights of a "
                    f"named shape; {shape!r} is a checkpoint, measured as it is (drop the flag)"
                )
            check_gguf_shape(shape, shape_config(shape))

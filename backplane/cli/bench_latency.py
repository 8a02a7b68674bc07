"""``backplane bench latency``: decode latency against the memory floor and transformers.

For each model shape and batch size, in one process and one run:

1. **the memory floor**: the device's read bandwidth, measured (a reduction
   over a large tensor timed with CUDA events, best of several), and the bytes
   one decode step must read: every weight once (the embedding only for the
   rows looked up, experts only as many as the batch can route to, the LM head
   in full), the KV cache at the mean context length of the decode steps, and
   the recurrent state of hybrid layers (read and written back); floor
   ``ms = bytes / bandwidth``;
2. **backplane** end to end through ``LLM.generate``, for each attention
   backend (``torch``, ``triton``, ``flashinfer``; an unavailable one is
   skipped with the registry's reason), with CUDA graphs on (the default mode)
   and off; engines are built one after another and freed in between;
3. **transformers** on the same weights: eager with its default dynamic cache,
   and a static cache with the decode step compiled (``torch.compile``,
   ``mode="reduce-overhead"``, through ``generate``'s ``compile_config``).

Both sides decode greedily from the same random prompts and produce the same
number of tokens. The weights are random: each shape is built once with
backplane's fixed-seed initialisation, saved as a Hugging Face folder
(``config.json`` + safetensors) and loaded from there by both sides.

The figure reported is **ms per output token** of one sequence, i.e. per decode
step of the batch: ``(time of the last token - time of the first token) /
(new tokens - 1)``; the time to first token (prompt processing) is reported
apart. The table shows it per configuration and batch size, with its ratio to
the floor and to transformers static + compile.

Shapes: ``llama-1b`` (1.1B Llama: hidden 2048, 16 layers, 32/8 heads of 64,
MLP 8192, vocabulary 32000) and ``nemotron-h-0.85b`` (a 24-layer Nemotron-H
hybrid of the same width: 10 Mamba2 layers of 64 heads x 64 with state 128,
2 attention layers, 12 ReLU^2 MLP layers of 8192); any built-in preset name
(``tiny-llama``, ``tiny-nemotron-h`` ...) runs that tiny model, for CPU checks.

Examples::

    backplane bench latency --json latency.json --plot latency.png
    backplane bench latency --shapes llama-1b --batch-sizes 1,4,16 --attention triton
    backplane bench latency --shapes tiny-llama --prompt-len 32 --new-tokens 8   # CPU
    backplane bench latency --plot-from latency.json --plot latency.png

A default run takes several minutes on one GPU (weight initialisation, CUDA
graph capture per engine, transformers compilation per batch size); one shape
per run keeps each command shorter, and ``--plot-from`` merges their JSON::

    backplane bench latency --shapes llama-1b --json llama.json
    backplane bench latency --shapes nemotron-h-0.85b --json hybrid.json
    backplane bench latency --plot-from llama.json hybrid.json --plot latency.png
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backplane.core.errors import (
    BackendUnavailableError,
    BackplaneError,
    ConfigError,
    UnknownBackendError,
)

logger = logging.getLogger(__name__)

LLAMA_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The ~1.1B Llama shape (the one ``benchmarks/bench_graphs.py`` measures)."""

NEMOTRON_H_085B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 32000,
    "hidden_size": 2048,
    # 10 Mamba2 (M), 2 attention (*) and 12 MLP (-) layers
    "hybrid_override_pattern": "M-M-M-M-*-M-M-M-*-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""A ~0.85B Nemotron-H-shaped hybrid (24 layers: 10 Mamba2 + 2 attention + 12 MLP)."""

SHAPES: dict[str, dict[str, Any]] = {"llama-1b": LLAMA_1B, "nemotron-h-0.85b": NEMOTRON_H_085B}
"""The model shapes by name, as HF ``config.json`` dicts."""

DEFAULT_SHAPES: tuple[str, ...] = ("llama-1b", "nemotron-h-0.85b")
ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "triton", "flashinfer")
GRAPH_MODES: tuple[str, ...] = ("on", "off")
TRANSFORMERS_MODES: tuple[str, ...] = ("eager", "compile")

_FAMILIES = ("attention", "ssm", "mla", "delta")
_PAGE_SIZE = 16


@dataclass
class Settings:
    """What one benchmark run measures.

    :param shapes: shape names (:data:`SHAPES` or built-in presets).
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


# -- shapes, machine, bandwidth ---------------------------------------------------------------


def shape_config(name: str) -> dict[str, Any]:
    """Return the HF config dict of shape ``name`` (a copy).

    :param name: a key of :data:`SHAPES` or a built-in preset name.
    :raises ConfigError: unknown name, listing the known ones.
    """
    from backplane.models import presets

    if name in SHAPES:
        return json.loads(json.dumps(SHAPES[name]))
    if name in presets.PRESETS:
        return json.loads(json.dumps(presets.PRESETS[name]))
    known = [*SHAPES, *sorted(presets.PRESETS)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown shape {name!r}{hint}; the shapes are: {', '.join(known)}")


def _package_version(dist: str, module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def machine_info(device: Any) -> dict[str, Any]:
    """Describe the machine and the software versions that the figures depend on.

    :param device: the ``torch.device`` measured.
    :return: GPU name and memory (``None`` on CPU), CPU, versions of python,
        torch (and its CUDA), triton, flashinfer, transformers and backplane.
    """
    import torch

    from backplane import __version__

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "device": str(device),
        "gpu": None,
        "gpu_memory_gib": None,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton", "triton"),
        "flashinfer": _package_version("flashinfer-python", "flashinfer"),
        "transformers": _package_version("transformers", "transformers"),
        "backplane": __version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


def measure_bandwidth(device: Any, *, nbytes: int | None = None, repeats: int = 10) -> dict:
    """Measure the device's memory read bandwidth with a large reduction.

    A float32 sum over a tensor much larger than the caches reads every byte
    once and writes one number, so its rate is the read bandwidth a decode step
    can hope for. On CUDA it is timed with events (after a warm-up), on a CPU
    with ``time.perf_counter``; the best of ``repeats`` is kept.

    :param device: a ``torch.device``.
    :param nbytes: tensor size (default: 1 GiB on CUDA, or a quarter of the free
        memory if less; 256 MiB on a CPU).
    :param repeats: timed reductions.
    :return: ``{"bytes_per_s", "tensor_bytes", "method"}``.
    """
    import torch

    if nbytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = min(1 << 30, free // 4)
        else:
            nbytes = 256 << 20
    n = max(nbytes // 4, 1)
    x = torch.ones(n, dtype=torch.float32, device=device)
    best = math.inf
    if device.type == "cuda":
        per_timing = 4
        for _ in range(3):
            x.sum()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            for _ in range(per_timing):
                x.sum()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / per_timing)
        method = f"float32 sum over {n * 4 / 2**30:.2f} GiB, CUDA events, best of {repeats}"
    else:
        x.sum()
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        method = f"float32 sum over {n * 4 / 2**20:.0f} MiB, wall clock, best of {repeats}"
    del x
    return {"bytes_per_s": n * 4 / best, "tensor_bytes": n * 4, "method": method}


# -- weights ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _registered_preset(name: str, config: dict[str, Any]) -> Iterator[str]:
    """Make ``config`` buildable as a preset (random weights) for the duration."""
    from backplane.models import presets

    key = name if name in presets.PRESETS else f"bench-{name}"
    saved = presets.PRESETS.get(key)
    presets.PRESETS[key] = config
    try:
        yield key
    finally:
        if saved is None:
            presets.PRESETS.pop(key, None)
        else:
            presets.PRESETS[key] = saved


@dataclass
class WeightsInfo:
    """What the memory floor needs to know about one saved model.

    :param folder: the HF folder (``config.json`` + ``model.safetensors``).
    :param params: parameters (experts included).
    :param weight_bytes: bytes of all weights as saved.
    :param embedding_bytes: bytes of the input embedding.
    :param embedding_row_bytes: bytes of one embedding row.
    :param lm_head_bytes: bytes of the LM head (the embedding if tied).
    :param tied: whether the LM head is the embedding.
    :param expert_bytes: bytes of all routed experts.
    :param num_experts: routed experts per MoE layer (0 without MoE).
    :param experts_per_token: experts each token is routed to.
    :param kv_bytes_per_token: paged KV bytes per token over all layers.
    :param state_bytes_per_seq: recurrent state bytes per sequence over all layers.
    """

    folder: str
    params: int
    weight_bytes: int
    embedding_bytes: int
    embedding_row_bytes: int
    lm_head_bytes: int
    tied: bool
    expert_bytes: int
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: float
    state_bytes_per_seq: int


def _specs_bytes(specs: dict[str, dict[str, Any]]) -> int:
    return sum(spec.nbytes for layer in specs.values() for spec in layer.values())


def save_random_weights(
    name: str, config: dict[str, Any], folder: str | os.PathLike[str], dtype: Any
) -> WeightsInfo:
    """Build shape ``name`` with backplane's fixed-seed random weights and save it as an HF folder.

    The model is built on the CPU in ``dtype`` by a minimal engine (torch
    backends, two KV pages); its tensors are written under their checkpoint
    names, one tensor per routed expert, which is what both backplane's loader
    and ``transformers`` read.

    :param name: the shape's name (for the temporary preset).
    :param config: its HF config dict.
    :param folder: where to write ``config.json`` and ``model.safetensors``.
    :param dtype: the ``torch.dtype`` of the saved weights.
    :return: sizes the memory floor needs.
    """
    import torch
    from safetensors.torch import save_file

    from backplane import LLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _registered_preset(name, config) as key:
        llm = LLM(
            key,
            device="cpu",
            dtype=str(dtype).replace("torch.", ""),
            max_num_seqs=1,
            max_num_tokens=1,
            num_kv_pages=2,
            enable_prefix_caching=False,
            backends=dict.fromkeys(_FAMILIES, "torch"),
        )
    model = llm.engine.model
    del llm
    prefixes = list(getattr(model, "checkpoint_prefixes", ()))
    embedding = model.embed_tokens.weight
    tied = bool(model.tie_word_embeddings)
    head = embedding if tied else model.lm_head.weight

    tensors: dict[str, torch.Tensor] = {}
    expert_bytes = 0
    num_experts = 0
    for target, (tensor, index) in model.weight_targets().items():
        ckpt = target
        for ckpt_prefix, module_prefix in prefixes:
            if target.startswith(module_prefix):
                ckpt = ckpt_prefix + target[len(module_prefix) :]
                break
        part = tensor if index is None else tensor[index]
        # clone: safetensors refuses tensors sharing storage (the stacked experts)
        tensors[ckpt] = part.detach().contiguous().clone()
        if index is not None:
            expert_bytes += part.numel() * part.element_size()
            num_experts = max(num_experts, int(tensor.shape[0]))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    saved_config = dict(config)
    saved_config["dtype"] = str(dtype).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(saved_config, indent=1))

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    kw = {"page_size": _PAGE_SIZE, "dtype": dtype}
    two = _specs_bytes(model.cache_specs(num_pages=2, num_slots=1, **kw))
    three = _specs_bytes(model.cache_specs(num_pages=3, num_slots=1, **kw))
    two_slots = _specs_bytes(model.cache_specs(num_pages=2, num_slots=2, **kw))
    info = WeightsInfo(
        folder=str(folder),
        params=sum(t.numel() for t in tensors.values()),
        weight_bytes=sum(nbytes(t) for t in tensors.values()),
        embedding_bytes=nbytes(embedding),
        embedding_row_bytes=embedding.shape[1] * embedding.element_size(),
        lm_head_bytes=nbytes(head),
        tied=tied,
        expert_bytes=expert_bytes,
        num_experts=num_experts,
        experts_per_token=int(config.get("num_experts_per_tok") or 0),
        kv_bytes_per_token=(three - two) / _PAGE_SIZE,
        state_bytes_per_seq=two_slots - two,
    )
    del model, tensors
    gc.collect()
    return info


def floor_bytes(info: WeightsInfo, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Bytes one decode step of ``batch`` sequences must move to and from memory.

    Weights: everything once, except the embedding (only ``batch`` rows are
    looked up; the LM head is read in full) and routed experts (at most
    ``batch * experts_per_token`` of each layer's experts are used). KV: each
    sequence reads its cache at the mean context length of the timed steps
    (steps 2..N see ``prompt_len + 1`` .. ``prompt_len + N - 1`` tokens) and
    writes one token. Recurrent state: read and written back once per step.

    :return: the parts and their ``total``.
    """
    rows = min(batch, info.embedding_bytes // max(info.embedding_row_bytes, 1))
    embedding_read = rows * info.embedding_row_bytes
    experts_read = info.expert_bytes
    if info.num_experts and info.experts_per_token:
        used = min(info.num_experts, batch * info.experts_per_token)
        experts_read = info.expert_bytes * used / info.num_experts
    other = info.weight_bytes - info.expert_bytes - info.embedding_bytes
    if not info.tied:
        other -= info.lm_head_bytes
    weights = other + info.lm_head_bytes + embedding_read + experts_read
    mean_context = prompt_len + new_tokens / 2
    kv = batch * info.kv_bytes_per_token * (mean_context + 1)
    state = 2 * batch * info.state_bytes_per_seq
    return {
        "weights": int(weights),
        "kv_cache": int(kv),
        "recurrent_state": int(state),
        "mean_context": mean_context,
        "total": int(weights + kv + state),
    }


# -- measuring ---------------------------------------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_memory(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def make_prompts(seed: int, batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Random prompts, the same for every configuration of one batch size.

    :return: ``batch`` lists of ``prompt_len`` token ids below ``vocab_size``.
    """
    import numpy as np

    rng = np.random.default_rng([seed, batch])
    return rng.integers(0, vocab_size, size=(batch, prompt_len)).tolist()


def _timing_row(
    batch: int,
    runs: list[tuple[float, float]],
    tokens: list[list[int]],
    new_tokens: int,
) -> dict[str, Any]:
    """Summarise timed runs: each is ``(ttft seconds, seconds per token)``."""
    ms = [r[1] * 1e3 for r in runs]
    ttft = [r[0] * 1e3 for r in runs]
    counts = [len(t) for t in tokens]
    row: dict[str, Any] = {
        "batch": batch,
        "status": "ok",
        "ms_per_token": statistics.median(ms),
        "ttft_ms": statistics.median(ttft),
        "runs_ms_per_token": ms,
        "runs_ttft_ms": ttft,
        "tokens_per_request": counts,
    }
    if any(c != new_tokens for c in counts):
        row["status"] = "failed"
        row["reason"] = f"produced {counts} tokens per request instead of {new_tokens} each"
    return row


@contextlib.contextmanager
def _quiet_missing_tokenizer() -> Iterator[None]:
    """The benchmark's folders carry no tokenizer on purpose (no detokenizing in the loop)."""
    log = logging.getLogger("backplane.models.loader")

    def drop(record: logging.LogRecord) -> bool:
        return "tokenizer.json" not in record.getMessage()

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _generate_backplane(
    llm: Any, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, list[list[int]]]:
    """One timed ``LLM.generate``: ``(ttft s, s per token after the first, tokens)``."""
    from backplane import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    device = llm.engine.device
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_end = time.perf_counter()
    firsts, lasts = [], []
    for out in outs:
        m = out.metrics
        if m is None or m.time_to_first_token is None:
            firsts.append(t_end)
            lasts.append(t_end)
            continue
        first = m.arrival_time + m.time_to_first_token
        firsts.append(first)
        lasts.append(first + sum(m.inter_token_latencies))
    first, last = max(firsts), max(lasts)
    per_token = (last - first) / max(new_tokens - 1, 1)
    return first - t0, per_token, [list(o.token_ids) for o in outs]


def run_backplane(
    folder: str,
    settings: Settings,
    *,
    attention: str,
    graphs: str,
    prompts: dict[int, list[list[int]]],
    device: Any,
    dtype_name: str,
    tokens_out: dict[int, list[list[int]]],
) -> dict[str, Any]:
    """Measure one backplane configuration at every batch size with one engine.

    The engine is sized for the largest batch: ``max_num_seqs`` = that batch,
    a token budget that takes all its prompts in one step, ``max_model_len`` =
    prompt + new tokens, and exactly enough KV pages (plus a margin) so that
    engines built one after another fit; prefix caching is off so repeated
    prompts are recomputed.

    :param folder: the saved HF folder.
    :param settings: the run's settings.
    :param attention: the attention backend.
    :param graphs: ``on`` (the default CUDA-graph mode) or ``off``.
    :param prompts: ``{batch: prompts}``.
    :param device: the ``torch.device``.
    :param dtype_name: the dtype's name.
    :param tokens_out: filled with the first timed run's tokens per batch.
    :return: the configuration's entry (``status``, ``backends``, ``batches``).
    """
    from backplane import LLM

    p, n = settings.prompt_len, settings.new_tokens
    max_batch = max(settings.batch_sizes)
    pages_per_seq = -(-(p + n) // _PAGE_SIZE)
    overrides = {
        "device": str(device),
        "dtype": dtype_name,
        "max_num_seqs": max_batch,
        "max_num_tokens": max(max_batch * p, max_batch),
        "max_model_len": p + n,
        "page_size": _PAGE_SIZE,
        "num_kv_pages": max_batch * (pages_per_seq + 1) + 2,
        "enable_prefix_caching": False,
        "cuda_graphs": None if graphs == "on" else "off",
        "seed": settings.seed,
        "backends": {**settings.backends, "attention": attention},
    }
    entry: dict[str, Any] = {"engine_settings": dict(overrides), "batches": []}
    t0 = time.perf_counter()
    with _quiet_missing_tokenizer():
        llm = LLM(folder, **overrides)
    entry["startup_s"] = time.perf_counter() - t0
    entry["backends"] = {
        f: getattr(b, "name", type(b).__name__) for f, b in llm.engine.backends.items()
    }
    try:
        for batch in settings.batch_sizes:
            try:
                for _ in range(settings.warmup):
                    _generate_backplane(llm, prompts[batch], n)
                runs, tokens = [], []
                for r in range(settings.repeats):
                    ttft, per_token, toks = _generate_backplane(llm, prompts[batch], n)
                    runs.append((ttft, per_token))
                    if r == 0:
                        tokens = toks
                tokens_out[batch] = tokens
                entry["batches"].append(_timing_row(batch, runs, tokens, n))
            except Exception as exc:  # one batch size failing (memory...) keeps the others
                logger.debug("backplane %s batch %d failed", attention, batch, exc_info=True)
                entry["batches"].append(
                    {"batch": batch, "status": "failed", "reason": _one_line(exc)}
                )
    finally:
        del llm
        _free_device_memory(device)
    return entry


class _TokenClock:
    """A ``generate`` streamer that notes when each batch of tokens reaches the host.

    ``generate`` hands the prompt first, then each step's tokens after copying
    them to the host (a synchronisation), so the times are the device's.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        """Note the time (the first call carries the prompt)."""
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush."""


@contextlib.contextmanager
def _transformers_notes(notes: list[str]) -> Iterator[None]:
    """Collect transformers' warnings that explain its speed (e.g. a kernel fallback)."""

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "falling back" in msg or "fallback" in msg or "compil" in msg.lower():
                line = msg.splitlines()[0].split(". ")[0] if msg else msg
                if line not in notes:
                    notes.append(line)

    handler = _Collect(level=logging.WARNING)
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _generate_transformers(
    model: Any, input_ids: Any, new_tokens: int, extra: dict[str, Any]
) -> tuple[float, float, list[list[int]]]:
    """One timed ``generate``: ``(ttft s, s per token after the first, new tokens)``."""
    import torch

    clock = _TokenClock()
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    _sync(input_ids.device)
    t0 = time.perf_counter()
    # as users call it (generate runs without autograd by itself)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        streamer=clock,
        **extra,
    )
    _sync(input_ids.device)
    t_end = time.perf_counter()
    times = clock.times[1:] or [t_end]  # times[0]: the prompt
    per_token = (times[-1] - times[0]) / max(new_tokens - 1, 1)
    tokens = out[:, input_ids.shape[1] :].tolist()
    return times[0] - t0, per_token, tokens


def _dynamo_graphs() -> int:
    """Graphs compiled by dynamo so far (``-1`` when the counter is not available)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def run_transformers(
    folder: str,
    settings: Settings,
    *,
    prompts: dict[int, list[list[int]]],
    device: Any,
    dtype: Any,
    tokens_out: dict[tuple[str, int], list[list[int]]],
) -> dict[str, dict[str, Any]]:
    """Measure ``transformers`` on the saved weights: eager and/or static cache + compile.

    Eager uses ``generate``'s default (dynamic) cache. ``compile`` passes
    ``cache_implementation="static"`` and a ``CompileConfig(fullgraph=True,
    mode="reduce-overhead")``, with which ``generate`` compiles the decode step
    (prefill stays eager), warmed up twice per batch size (compilation, then
    graph recording); when the full graph cannot be captured it retries with
    graph breaks allowed and says so. On a CPU the compiled mode is skipped
    unless ``settings.compile_on_cpu``.

    :return: ``{mode: entry}`` for each requested mode.
    """
    import torch

    entries: dict[str, dict[str, Any]] = {}
    modes = [m for m in TRANSFORMERS_MODES if m in settings.transformers_modes]
    if not modes:
        return entries
    try:
        import transformers
    except ImportError as exc:
        for mode in modes:
            entries[mode] = _skipped(
                f"transformers is not installed ({exc}); pip install transformers"
            )
        return entries
    notes: list[str] = []
    try:
        with _transformers_notes(notes):
            transformers.utils.logging.disable_progress_bar()
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            model.to(device).eval()
    except Exception as exc:
        logger.debug("transformers failed to load %s", folder, exc_info=True)
        for mode in modes:
            entries[mode] = _skipped(f"transformers cannot load the model: {_one_line(exc)}")
        return entries
    attn_impl = getattr(model.config, "_attn_implementation", None)
    n = settings.new_tokens
    try:
        for mode in modes:
            entry: dict[str, Any] = {"attn_implementation": attn_impl, "batches": []}
            extra: dict[str, Any] = {}
            warmup = settings.warmup
            if mode == "compile":
                if device.type != "cuda" and not settings.compile_on_cpu:
                    entries[mode] = _skipped(
                        "transformers compiles the decode step on CUDA only; "
                        "pass --compile-on-cpu to force it here"
                    )
                    continue
                try:
                    config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
                except Exception as exc:
                    entries[mode] = _skipped(f"no transformers.CompileConfig: {_one_line(exc)}")
                    continue
                if device.type != "cuda":
                    config._compile_all_devices = True
                extra = {"cache_implementation": "static", "compile_config": config}
                entry["compile_config"] = {"fullgraph": True, "mode": "reduce-overhead"}
                warmup = max(warmup, 2)  # the first compiles, the second records graphs
            graphs_before = _dynamo_graphs()
            recompiled = False  # a reset makes the graph counter useless as a check
            for batch in settings.batch_sizes:
                input_ids = torch.tensor(prompts[batch], dtype=torch.long, device=device)
                try:
                    with _transformers_notes(notes):
                        try:
                            for _ in range(warmup):
                                _generate_transformers(model, input_ids, n, extra)
                        except Exception as exc:
                            if mode != "compile" or not extra["compile_config"].fullgraph:
                                raise
                            logger.info(
                                "full-graph compile failed (%s); retrying with graph breaks",
                                _one_line(exc),
                            )
                            torch.compiler.reset()
                            recompiled = True
                            config = transformers.CompileConfig(
                                fullgraph=False, mode="reduce-overhead"
                            )
                            if device.type != "cuda":
                                config._compile_all_devices = True
                            extra["compile_config"] = config
                            entry["compile_config"]["fullgraph"] = False
                            entry.setdefault("notes", []).append(
                                f"fullgraph=True failed: {_one_line(exc)}"
                            )
                            for _ in range(warmup):
                                _generate_transformers(model, input_ids, n, extra)
                        runs, tokens = [], []
                        for r in range(settings.repeats):
                            ttft, per_token, toks = _generate_transformers(
                                model, input_ids, n, extra
                            )
                            runs.append((ttft, per_token))
                            if r == 0:
                                tokens = toks
                    tokens_out[(mode, batch)] = tokens
                    entry["batches"].append(_timing_row(batch, runs, tokens, n))
                except Exception as exc:
                    logger.debug("transformers %s batch %d failed", mode, batch, exc_info=True)
                    entry["batches"].append(
                        {"batch": batch, "status": "failed", "reason": _one_line(exc)}
                    )
                finally:
                    del input_ids
            uncompiled = graphs_before >= 0 and _dynamo_graphs() == graphs_before
            if mode == "compile" and not recompiled and uncompiled:
                for row in entry["batches"]:
                    if row["status"] == "ok":
                        row["status"] = "failed"
                        row["reason"] = "transformers ran the decode step without compiling it"
            entry["status"] = (
                "ok" if any(b["status"] == "ok" for b in entry["batches"]) else "failed"
            )
            if entry["status"] == "failed":
                entry["reason"] = next(
                    (b["reason"] for b in entry["batches"] if b.get("reason")), "failed"
                )
            entries[mode] = entry
    finally:
        del model
        with contextlib.suppress(Exception):
            torch.compiler.reset()
        _free_device_memory(device)
    for entry in entries.values():
        if notes and entry.get("status") != "skipped":
            entry.setdefault("notes", []).extend(notes)
    return entries


def _skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, "batches": []}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How far each request's tokens match the reference's (greedy decoding, same weights)."""
    prefixes = []
    for a, b in zip(tokens, reference, strict=False):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
    return {
        "identical_requests": sum(1 for a, b in zip(tokens, reference, strict=False) if a == b),
        "first_token_equal": sum(
            1 for a, b in zip(tokens, reference, strict=False) if a[:1] == b[:1]
        ),
        "requests": len(reference),
        "mean_common_prefix": statistics.fmean(prefixes) if prefixes else 0.0,
    }


# -- the run ------------------------------------------------------------------------------------


def _resolve_device_dtype(settings: Settings) -> tuple[Any, Any, str]:
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


def _check_settings(settings: Settings) -> None:
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
        if family not in _FAMILIES or family == "attention":
            raise ConfigError(
                f"--backend {family}=...: the families are ssm, mla, delta "
                "(attention backends are chosen with --attention)"
            )
    for shape in settings.shapes:
        cfg = shape_config(shape)
        limit = int(cfg.get("max_position_embeddings", 4096))
        if settings.prompt_len + settings.new_tokens > limit:
            raise ConfigError(
                f"shape {shape!r} holds {limit} positions, fewer than --prompt-len "
                f"{settings.prompt_len} + --new-tokens {settings.new_tokens}"
            )


def _label(kind: str, **kw: str) -> str:
    if kind == "backplane":
        graphs = "graphs" if kw["graphs"] == "on" else "eager"
        return f"backplane {kw['attention']}, {graphs}"
    return "transformers static+compile" if kw["mode"] == "compile" else "transformers eager"


def run_shape(
    name: str,
    settings: Settings,
    *,
    device: Any,
    dtype: Any,
    dtype_name: str,
    bandwidth: float,
    workdir: str,
    progress: Any = None,
) -> dict[str, Any]:
    """Measure every configuration of one shape.

    :return: the shape's results: its config and sizes, and one entry per
        configuration (floor first) with a row per batch size.
    """
    config = shape_config(name)
    folder = os.path.join(workdir, f"{name}-{dtype_name}")
    t0 = time.perf_counter()
    logger.info("%s: building random %s weights in %s", name, dtype_name, folder)
    info = save_random_weights(name, config, folder, dtype)
    logger.info(
        "%s: %s parameters, %s, saved in %.1fs",
        name,
        _si(info.params, ""),
        _si(info.weight_bytes, "B"),
        time.perf_counter() - t0,
    )
    vocab = int(config["vocab_size"])
    prompts = {
        b: make_prompts(settings.seed, b, settings.prompt_len, vocab) for b in settings.batch_sizes
    }
    floor_label = "HBM floor" if device.type == "cuda" else "memory floor"
    floor_rows = []
    for b in settings.batch_sizes:
        parts = floor_bytes(info, b, settings.prompt_len, settings.new_tokens)
        floor_rows.append(
            {
                "batch": b,
                "status": "ok",
                "ms_per_token": parts["total"] / bandwidth * 1e3,
                "bytes_per_step": parts,
            }
        )
    configs: list[dict[str, Any]] = [
        {"label": floor_label, "kind": "floor", "status": "ok", "batches": floor_rows}
    ]
    tokens: dict[tuple[str, int], list[list[int]]] = {}

    unavailable: dict[str, str] = {}
    allocated_before = 0
    if device.type == "cuda":
        import torch

        allocated_before = torch.cuda.memory_allocated(device)
    for attention in settings.attention_backends:
        for graphs in settings.cuda_graphs:
            label = _label("backplane", attention=attention, graphs=graphs)
            entry: dict[str, Any] = {
                "label": label,
                "kind": "backplane",
                "attention": attention,
                "cuda_graphs": graphs,
            }
            why = unavailable.get(attention)
            if why is None and graphs == "on" and device.type != "cuda":
                why = f"CUDA graphs need a CUDA device (this run is on {device.type})"
            if why is not None:
                entry.update(_skipped(why))
                configs.append(entry)
                _advance(progress, len(settings.batch_sizes), f"{name}: {label} skipped")
                continue
            logger.info("%s: %s", name, label)
            per_batch: dict[int, list[list[int]]] = {}
            try:
                entry.update(
                    run_backplane(
                        info.folder,
                        settings,
                        attention=attention,
                        graphs=graphs,
                        prompts=prompts,
                        device=device,
                        dtype_name=dtype_name,
                        tokens_out=per_batch,
                    )
                )
                ok = any(b["status"] == "ok" for b in entry["batches"])
                entry["status"] = "ok" if ok else "failed"
                if not ok:
                    entry["reason"] = next(
                        (b["reason"] for b in entry["batches"] if b.get("reason")), "failed"
                    )
            except (BackendUnavailableError, UnknownBackendError) as exc:
                # the engine checks its backends before reading any weight
                unavailable[attention] = str(exc)
                entry.update(_skipped(str(exc)))
                _free_device_memory(device)
            except Exception as exc:
                logger.debug("%s: %s failed", name, label, exc_info=True)
                entry.update({"status": "failed", "reason": _one_line(exc), "batches": []})
                _free_device_memory(device)
            if device.type == "cuda":
                import torch

                left = torch.cuda.memory_allocated(device) - allocated_before
                entry["allocated_after_free_mib"] = left / 2**20
                if left > 256 << 20:
                    logger.warning(
                        "%s: %.0f MiB still allocated after freeing the engine of %s; "
                        "later engines have less memory",
                        name,
                        left / 2**20,
                        label,
                    )
            for b, toks in per_batch.items():
                tokens[(label, b)] = toks
            configs.append(entry)
            _advance(progress, len(settings.batch_sizes), f"{name}: {label}")

    hf_tokens: dict[tuple[str, int], list[list[int]]] = {}
    if settings.transformers_modes:
        logger.info("%s: transformers %s", name, ",".join(settings.transformers_modes))
        hf = run_transformers(
            info.folder,
            settings,
            prompts=prompts,
            device=device,
            dtype=dtype,
            tokens_out=hf_tokens,
        )
        for mode, entry in hf.items():
            label = _label("transformers", mode=mode)
            configs.append({"label": label, "kind": "transformers", "mode": mode, **entry})
            for (m, b), toks in hf_tokens.items():
                if m == mode:
                    tokens[(label, b)] = toks
            _advance(progress, len(settings.batch_sizes), f"{name}: {label}")

    reference = "transformers eager"
    for entry in configs:
        if entry["kind"] == "floor" or entry["label"] == reference:
            continue
        for row in entry.get("batches", []):
            ref = tokens.get((reference, row["batch"]))
            mine = tokens.get((entry["label"], row["batch"]))
            if ref is not None and mine is not None:
                row["agreement"] = {"reference": reference, **_agreement(mine, ref)}

    return {
        "name": name,
        "config": config,
        "architecture": (config.get("architectures") or ["?"])[0],
        "params": info.params,
        "weight_bytes": info.weight_bytes,
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "state_bytes_per_seq": info.state_bytes_per_seq,
        "run": {
            "batch_sizes": list(settings.batch_sizes),
            "prompt_len": settings.prompt_len,
            "new_tokens": settings.new_tokens,
            "dtype": dtype_name,
            "repeats": settings.repeats,
        },
        "configs": configs,
    }


def _advance(progress: Any, n: int, what: str) -> None:
    if progress is not None:
        progress.set_postfix_str(what, refresh=False)
        progress.update(n)


def run_benchmark(settings: Settings) -> dict[str, Any]:
    """Run every shape, configuration and batch size of ``settings`` in this process.

    :return: the JSON-serialisable result: ``machine``, ``settings``,
        ``bandwidth`` and one entry per shape (see :func:`run_shape`).
    :raises ConfigError: invalid settings (nothing is run).
    """
    from tqdm.auto import tqdm

    _check_settings(settings)
    settings.batch_sizes = sorted(set(settings.batch_sizes))
    device, dtype, dtype_name = _resolve_device_dtype(settings)
    machine = machine_info(device)
    bandwidth = measure_bandwidth(device)
    logger.info(
        "read bandwidth %.1f GB/s (%s)", bandwidth["bytes_per_s"] / 1e9, bandwidth["method"]
    )
    per_shape = len(settings.attention_backends) * len(settings.cuda_graphs) + len(
        settings.transformers_modes
    )
    total = len(settings.shapes) * per_shape * len(settings.batch_sizes)
    shapes = []
    with contextlib.ExitStack() as stack:
        if settings.weights_dir:
            workdir = settings.weights_dir
            os.makedirs(workdir, exist_ok=True)
        else:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-latency-"))
        progress = stack.enter_context(
            tqdm(total=total, desc="bench latency", unit="run", disable=None)
        )
        for name in settings.shapes:
            shapes.append(
                run_shape(
                    name,
                    settings,
                    device=device,
                    dtype=dtype,
                    dtype_name=dtype_name,
                    bandwidth=bandwidth["bytes_per_s"],
                    workdir=workdir,
                    progress=progress,
                )
            )
    data = asdict(settings)
    data["dtype_resolved"] = dtype_name
    return {"machine": machine, "settings": data, "bandwidth": bandwidth, "shapes": shapes}


# -- reporting ----------------------------------------------------------------------------------


def _fmt_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """First column left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _si(value: float, unit: str) -> str:
    """``1.104e9, "B"`` -> ``"1.10 GB"``; parameter counts use ``unit=""``."""
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}".rstrip()
    return f"{value:.0f} {unit}".rstrip()


def _row_by_batch(entry: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(r["batch"]): r for r in entry.get("batches", [])}


def _shape_run(result: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    """The batch sizes, lengths and dtype a shape was measured with."""
    if "run" in shape:
        return shape["run"]
    s = result["settings"]
    return {
        "batch_sizes": s["batch_sizes"],
        "prompt_len": s["prompt_len"],
        "new_tokens": s["new_tokens"],
        "dtype": s.get("dtype_resolved", s["dtype"]),
        "repeats": s["repeats"],
    }


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Put the shapes of several results (e.g. one run per shape) into one.

    The machine, settings and bandwidth of the first are kept; each shape keeps
    the batch sizes and lengths it was measured with.

    :param results: results of :func:`run_benchmark` or their JSON, reloaded.
    :return: the merged result.
    """
    merged = dict(results[0])
    merged["shapes"] = []
    for res in results:
        if res["machine"].get("gpu") != results[0]["machine"].get("gpu"):
            logger.warning(
                "merging results of different devices (%s and %s); the report names the first",
                results[0]["machine"].get("gpu"),
                res["machine"].get("gpu"),
            )
        merged["shapes"].extend(_shape_with_run(res, shape) for shape in res["shapes"])
    return merged


def _shape_with_run(result: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    return {**shape, "run": _shape_run(result, shape)}


def format_report(result: dict[str, Any]) -> str:
    """Render the result as text: per shape, ms per token and time to first token tables.

    :param result: what :func:`run_benchmark` returned (or its JSON, reloaded).
    :return: the report (ends with a newline).
    """
    m = result["machine"]
    bw = result["bandwidth"]
    out = []
    where = m.get("gpu") or f"{m.get('cpu')} ({m.get('cores')} cores)"
    out.append(
        f"device: {where}; torch {m.get('torch')}, triton {m.get('triton')}, flashinfer "
        f"{m.get('flashinfer')}, transformers {m.get('transformers')}"
    )
    out.append(f"read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['method']})")
    for shape in result["shapes"]:
        run = _shape_run(result, shape)
        batches = [int(b) for b in run["batch_sizes"]]
        configs = shape["configs"]
        floor = next((c for c in configs if c["kind"] == "floor"), None)
        hf = next(
            (c for c in configs if c["kind"] == "transformers" and c.get("mode") == "compile"),
            None,
        )
        floor_rows = _row_by_batch(floor) if floor else {}
        hf_rows = _row_by_batch(hf) if hf and hf.get("status") == "ok" else {}
        out.append("")
        out.append(
            f"{shape['name']}: {shape['architecture']}, {_si(shape['params'], '')} params "
            f"({_si(shape['weight_bytes'], 'B')} in {run['dtype']}), "
            f"prompt {run['prompt_len']} + {run['new_tokens']} new tokens"
        )
        out.append(
            "ms per output token (median of "
            f"{run['repeats']}); x floor = / {floor['label'] if floor else 'floor'}, "
            "x hf = / transformers static+compile"
        )
        headers = ["configuration"]
        for b in batches:
            headers += [f"b={b} ms", "x floor", "x hf"]
        rows = []
        ttft_rows = []
        skipped = []
        for c in configs:
            by_batch = _row_by_batch(c)
            if c.get("status") == "skipped":
                skipped.append(f"  {c['label']}: {c.get('reason', '')}")
                continue
            row = [c["label"]]
            trow = [c["label"]]
            for b in batches:
                r = by_batch.get(b)
                if r is None or r.get("status") != "ok":
                    row += ["-", "", ""]
                    trow.append("-")
                    if r is not None and r.get("reason"):
                        skipped.append(f"  {c['label']} (b={b}): {r['reason']}")
                    continue
                ms = r["ms_per_token"]
                fl = floor_rows.get(b, {}).get("ms_per_token")
                ref = hf_rows.get(b, {}).get("ms_per_token")
                row += [
                    f"{ms:.3f}",
                    f"{ms / fl:.2f}x" if fl else "",
                    f"{ms / ref:.2f}x" if ref else "",
                ]
                trow.append(f"{r['ttft_ms']:.2f}" if "ttft_ms" in r else "")
            rows.append(row)
            if c["kind"] != "floor":
                ttft_rows.append(trow)
            if c.get("status") == "failed" and not c.get("batches") and c.get("reason"):
                skipped.append(f"  {c['label']}: {c['reason']}")
        out.append(_fmt_table(headers, rows))
        if ttft_rows:
            out.append("")
            out.append("time to first token, ms (median):")
            out.append(_fmt_table(["configuration", *(f"b={b}" for b in batches)], ttft_rows))
        if skipped:
            out.append("")
            out.append("not measured:")
            out.extend(skipped)
        notes = [
            (c["label"], n) for c in configs for n in c.get("notes", []) if c["kind"] != "floor"
        ]
        if notes:
            out.append("")
            out.append("notes:")
            out.extend(f"  {label}: {n}" for label, n in notes)
    return "\n".join(out) + "\n"


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Plot ms per output token against batch size, one panel per shape, to a PNG.

    :param result: what :func:`run_benchmark` returned (or its JSON, reloaded).
    :param path: the PNG to write.
    :raises BackplaneError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackplaneError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'backplane[bench]'); the JSON can be plotted elsewhere with "
            "--plot-from"
        ) from None
    shapes = result["shapes"]
    m = result["machine"]
    fig, axes = plt.subplots(
        1, max(len(shapes), 1), figsize=(6.5 * max(len(shapes), 1), 4.8), squeeze=False
    )
    for ax, shape in zip(axes[0], shapes, strict=False):
        all_batches: set[int] = set()
        for c in shape["configs"]:
            pts = [
                (int(r["batch"]), r["ms_per_token"])
                for r in c.get("batches", [])
                if r.get("status") == "ok"
            ]
            if not pts:
                continue
            xs, ys = zip(*sorted(pts), strict=True)
            all_batches.update(xs)
            if c["kind"] == "floor":
                ax.plot(xs, ys, "k--", label=c["label"], linewidth=1.5)
            else:
                style = "-o" if c["kind"] == "backplane" else ":s"
                ax.plot(xs, ys, style, label=c["label"], markersize=4)
        if len(all_batches) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(all_batches))
        ax.set_xticklabels([str(b) for b in sorted(all_batches)])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per output token")
        run = _shape_run(result, shape)
        ax.set_title(
            f"{shape['name']} ({_si(shape['params'], '')} params, "
            f"{run['dtype']}), prompt {run['prompt_len']}, {run['new_tokens']} new"
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode latency on {m.get('gpu') or m.get('cpu')}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)


def load_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a result written with ``--json``.

    :raises BackplaneError: unreadable, not JSON, or not such a result.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise BackplaneError(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise BackplaneError(f"{os.fspath(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not {"machine", "settings", "bandwidth", "shapes"} <= set(
        data
    ):
        raise BackplaneError(
            f"{os.fspath(path)!r} is not a result of `backplane bench latency --json` "
            "(it lacks machine/settings/bandwidth/shapes)"
        )
    return data


# -- command line -------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1,8, got {value!r}"
        ) from None


def _modes(value: str) -> list[str]:
    return [] if value.strip().lower() == "none" else _csv(value)


def _family_backend(value: str) -> tuple[str, str]:
    family, sep, name = value.partition("=")
    if not sep or not family or not name:
        raise argparse.ArgumentTypeError(f"expected FAMILY=NAME such as ssm=triton, got {value!r}")
    return family.strip(), name.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``backplane bench latency`` to ``parser``.

    :param parser: the sub-command's parser.
    """
    parser.add_argument(
        "--shapes",
        type=_csv,
        default=list(DEFAULT_SHAPES),
        metavar="NAME,...",
        help=f"model shapes: {', '.join(SHAPES)} or a preset such as tiny-llama "
        f"(default: {','.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument(
        "--batch-sizes", type=_ints, default=[1, 8], metavar="B,...", help="(default: 1,8)"
    )
    parser.add_argument("--prompt-len", type=int, default=512, metavar="N", help="(default: 512)")
    parser.add_argument(
        "--new-tokens", type=int, default=128, metavar="N", help="tokens generated (default: 128)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--attention",
        type=_modes,
        default=list(ATTENTION_BACKENDS),
        metavar="NAME,...",
        help="backplane attention backends to measure, or none (default: torch,triton,flashinfer)",
    )
    parser.add_argument(
        "--cuda-graphs",
        type=_csv,
        default=list(GRAPH_MODES),
        metavar="on,off",
        help="backplane with CUDA graphs on (the default mode) and/or off (default: on,off)",
    )
    parser.add_argument(
        "--transformers",
        type=_modes,
        default=list(TRANSFORMERS_MODES),
        metavar="MODES",
        help="transformers runs: eager, compile (static cache + torch.compile), both "
        "(default: eager,compile) or none",
    )
    parser.add_argument(
        "--backend",
        type=_family_backend,
        action="append",
        default=[],
        metavar="FAMILY=NAME",
        help="backplane backend of another op family, e.g. ssm=triton (default: auto)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per point; the median is shown (3)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before them (1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (0)")
    parser.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="also measure transformers static+compile on a CPU (slow to compile)",
    )
    parser.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="keep the saved random-weight HF folders here (default: a temporary folder)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure and the machine here")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG of ms/token against batch size (matplotlib)"
    )
    parser.add_argument(
        "--plot-from",
        nargs="+",
        metavar="JSON",
        help="measure nothing: print the report of saved --json results (several are "
        "merged, e.g. one per shape) and plot them (to --plot, default: the first JSON's "
        "name with .png)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build :class:`Settings` from parsed ``bench latency`` flags."""
    return Settings(
        shapes=list(args.shapes),
        batch_sizes=list(args.batch_sizes),
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        device=args.device,
        dtype=args.dtype,
        attention_backends=list(args.attention),
        cuda_graphs=list(args.cuda_graphs),
        transformers_modes=list(args.transformers),
        backends=dict(args.backend),
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        compile_on_cpu=args.compile_on_cpu,
        weights_dir=args.weights_dir,
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run ``backplane bench latency``: print the report, write ``--json`` / ``--plot``.

    :return: the exit code (0).
    """
    if args.plot_from:
        result = merge_results([load_result(p) for p in args.plot_from])
        print(format_report(result), end="")
        plot = args.plot or str(Path(args.plot_from[0]).with_suffix(".png"))
        write_plot(result, plot)
        logger.info("wrote %s", plot)
        return 0
    if args.plot:
        # fail before measuring for minutes, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BackplaneError(
                "--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(or pip install 'backplane[bench]'), or drop --plot and use --plot-from "
                "on the --json file elsewhere"
            ) from None
    result = run_benchmark(settings_from_args(args))
    print(format_report(result), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        logger.info("wrote %s", args.json)
    if args.plot:
        write_plot(result, args.plot)
        logger.info("wrote %s", args.plot)
    return 0

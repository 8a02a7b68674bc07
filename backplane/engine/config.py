"""Engine configuration: one validated object built from YAML, CLI flags or keyword arguments.

Precedence, lowest first: the defaults below, a YAML file (``--config``), then
command-line flags (:mod:`backplane.cli.options`) or keyword arguments. Every
value is checked when the configuration is built; an error names where the bad
value came from (the file and key, the flag, or the keyword argument) and what
is accepted.

Backend names are checked against the plugin registry at engine start-up
(:mod:`backplane.engine.selection`), not at parse time, so that a configuration
can be written on a machine that lacks a plugin.

Example YAML::

    model: tiny-llama
    dtype: auto            # float32 | bfloat16 | float16 | auto
    quantization: fp8      # quantise a full-precision checkpoint's projections on load
    kv_cache_dtype: fp8    # auto (the model's dtype) | fp8 (e4m3; see docs/models.md)
    device: auto           # cpu | cuda | cuda:N | auto
    threads: auto          # torch CPU threads; auto = the cores this process may use
    max_num_seqs: 16
    max_num_tokens: 1024
    kv_memory: 256MiB      # bytes, or a size with a unit; omit for auto
    fused_ops: auto        # auto | torch | triton (the models' elementwise kernels)
    async_scheduling: true # prepare step N+1 while the device runs step N
    backends:
      attention: auto      # a backend name, or auto
      ssm: torch
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backplane.core.errors import ConfigError
from backplane.core.hookspecs import FAMILIES
from backplane.engine.sizes import parse_size
from backplane.engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DTYPES: dict[str, str] = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
"""Accepted ``dtype`` spellings and the canonical name each one means."""

CUDA_GRAPH_MODES: tuple[str, ...] = ("off", "decode", "piecewise", "full_and_piecewise")
"""``off``: eager; ``decode``: monolithic graphs for decode-only batches;
``piecewise``: piecewise graphs for every batch; ``full_and_piecewise``: both."""

DISTRIBUTED_EXECUTOR_BACKENDS: tuple[str, ...] = ("mp", "ray")
"""How the workers of a tensor-parallel engine are started: ``mp`` one process
per rank on this machine (:mod:`backplane.engine.distributed`), ``ray`` one Ray
actor per rank on a Ray cluster (:mod:`backplane.engine.distributed.ray_executor`)."""

FUSED_OPS_MODES: tuple[str, ...] = ("auto", "torch", "triton")
"""Who runs the models' fused elementwise work (RMS norms with the residual add,
gated activations, rotary): ``torch`` the reference functions of plain torch ops,
``triton`` one Triton kernel per function (needs CUDA and triton), ``auto``
Triton on CUDA when triton imports, else torch."""

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
"""Accepted ``kv_cache_dtype`` values: the model's dtype, or FP8 (e4m3)."""

# -- where a value came from ------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigSource:
    """Where configuration values came from, for error messages.

    :param kind: ``"file"``, ``"cli"`` (command-line flags), ``"kwargs"``
        (keyword arguments) or ``"default"``.
    :param path: the file, for ``kind="file"``.
    """

    kind: str
    path: str = ""

    def where(self, key: str) -> str:
        """Say where the value of ``key`` (or ``backends.FAMILY``) came from.

        :param key: a configuration key.
        :return: e.g. ``"config file 'e.yaml', key 'page_size'"`` or ``"option --page-size"``.
        """
        if self.kind == "file":
            return f"config file {self.path!r}, key {key!r}"
        if self.kind == "cli":
            flag = "--" + key.split(".", 1)[0].replace("_", "-")
            if key.startswith("backends."):
                return f"option --backend {key.split('.', 1)[1]}=..."
            return f"option {flag}"
        if self.kind == "default":
            return f"default {key!r}"
        return f"EngineConfig argument {key!r}"


_KWARGS = ConfigSource("kwargs")
_DEFAULT = ConfigSource("default")

#: the scheduling limits an engine gets when none is set, by device kind; a GPU of
#: at least ``_LARGE_GPU_BYTES`` (an 80 GB H100, an H200) gets the larger pair
_CUDA_MAX_NUM_SEQS, _CUDA_MAX_NUM_TOKENS = 256, 8192
_LARGE_CUDA_MAX_NUM_SEQS, _LARGE_CUDA_MAX_NUM_TOKENS = 1024, 8192
_LARGE_GPU_BYTES = 70 * 2**30
#: most sequences by default of a model with recurrent state (Mamba2, gated delta rule),
#: whatever the GPU: each running sequence holds a whole state
RECURRENT_MAX_NUM_SEQS = 256
_CPU_MAX_NUM_SEQS, _CPU_MAX_NUM_TOKENS = 32, 2048
_building_from: contextvars.ContextVar[ConfigSource] = contextvars.ContextVar(
    "backplane_config_source", default=_KWARGS
)


def _default_backends() -> dict[str, str]:
    return {family: "auto" for family in FAMILIES}


def _field_defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(EngineConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, validated on construction.

    Build it with keyword arguments (``EngineConfig(model="tiny-llama",
    page_size=32)``), from a YAML file (:meth:`from_yaml`) or a mapping
    (:meth:`from_dict`), and derive variants with :meth:`merge`; command-line
    flags are read by :func:`backplane.cli.options.config_from_args`.
    ``"auto"`` values stay as written; :attr:`device_resolved`,
    :attr:`dtype_resolved`, :attr:`cuda_graphs_resolved` (or :meth:`resolved`)
    turn them into concrete ones.

    :param model: a local model directory or a preset name (``tiny-llama``...).
    :param dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``,
        ``bfloat16`` or ``float16`` (also ``fp32``, ``bf16``, ``fp16``, ``half``).
    :param device: ``auto`` (``cuda`` when available, else ``cpu``), ``cpu``,
        ``cuda`` or ``cuda:N``.
    :param quantization: ``None`` (the weights as stored; an FP8 checkpoint
        stays FP8) or ``"fp8"``: quantise a full-precision checkpoint's
        projections to FP8 (e4m3) on load.
    :param kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`: ``auto`` keeps the
        KV cache in the model's dtype, ``fp8`` stores it as e4m3 (attention:
        the torch, Triton and FlashInfer backends; MLA: torch and Triton).
    :param max_num_seqs: most sequences in one step; ``None`` = 1,024 on a GPU of
        70 GiB or more (256 for a model with recurrent state), 256 on a smaller
        GPU, 32 on a CPU.
    :param max_num_tokens: most tokens in one step (the chunked-prefill budget);
        at least ``max_num_seqs``, since every running sequence decodes one token;
        ``None`` = 8,192 on CUDA, 2,048 on a CPU.
    :param max_model_len: longest prompt + output; ``None`` = the model's limit.
    :param max_stop_strings: most stop strings one request may give (more is
        refused with a clear error).
    :param max_stop_string_length: most characters of one stop string.
    :param page_size: tokens per KV-cache page.
    :param kv_memory: device memory for the KV cache and recurrent states, bytes
        or a size string (``"256MiB"``); ``None`` = sized automatically (on CUDA
        from ``gpu_memory_utilization``).
    :param gpu_memory_utilization: the fraction of the device's total memory the
        engine may use in all -- weights, the activation peak of a full step
        (measured by a profiling forward at start), CUDA graphs and the KV cache,
        which gets what is left; vLLM's name and meaning. Ignored when
        ``kv_memory`` or ``num_kv_pages`` is given, and on the CPU.
    :param num_kv_pages: exact number of KV pages (overrides ``kv_memory``).
    :param host_kv_memory: pinned host memory for the offload tier of reusable
        KV blocks; ``0`` turns the tier off.
    :param enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
    :param cuda_graphs: one of :data:`CUDA_GRAPH_MODES`; ``None`` =
        ``full_and_piecewise`` on CUDA, ``off`` on CPU.
    :param cuda_graph_buckets: token counts to capture graphs for (sorted,
        unique); ``None`` = powers of two up to ``max_num_tokens``.
    :param fused_ops: one of :data:`FUSED_OPS_MODES`: the models' fused
        elementwise work (norms, activations, rotary) as Triton kernels or as
        plain torch; checked against the device when the engine builds the model.
    :param async_scheduling: schedule and prepare the next step while the
        device runs the current one (its sampled tokens feed the next step on the
        device); a request that stops costs one wasted token slot, and no token
        after a stop reaches the user.
    :param threads: torch's CPU thread count, set when the engine starts
        (:func:`backplane.engine.threads.apply_threads`); ``None`` (or
        ``"auto"``) = the cores this process may use (its CPU affinity). On a
        CPU device the projections run on it; fewer threads than cores keep a
        core free for other processes.
    :param tensor_parallel_size: ranks the model is split over, one worker
        process per device (``cuda:0`` .. ``cuda:N-1``, or N CPU processes with
        gloo); ``1`` runs one worker in the engine's process.
    :param distributed_executor_backend: one of
        :data:`DISTRIBUTED_EXECUTOR_BACKENDS`: how the worker processes of
        ``tensor_parallel_size > 1`` are started.
    :param custom_all_reduce: on CUDA ranks whose GPUs reach each other
        directly, sum the tensor-parallel all-reduces of up to 128K elements
        (decode rows, short prefills) with a one-shot kernel that reads the
        peers' buffers (:mod:`backplane.engine.distributed.one_shot`) instead
        of NCCL (on by default; ranks that cannot use it fall back to NCCL
        together, with a warning; ``False`` keeps every sum on NCCL).
    :param data_parallel_size: engine replicas behind one ``AsyncLLM`` (and
        server), each a whole engine on its own devices, requests balanced by
        load (:mod:`backplane.api.data_parallel`); an ``LLM`` runs one.
    :param speculative_config: speculative decoding, ``None`` (off) or a mapping as
        vLLM spells it: ``{"method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_min": 1, "prompt_lookup_max": 4}``, ``{"method": "draft_model",
        "model": ..., "num_speculative_tokens": k}`` or ``{"method": "mtp", ...}`` (a JSON
        string of one too); kept as a
        :class:`~backplane.engine.spec_decode.config.SpeculativeConfig`.
    :param seed: seed of the sampling RNG.
    :param debug: extra checks and logging (slower).
    :param backends: backend name or ``auto`` per op family; families left out
        are ``auto``.
    """

    model: str = "tiny-llama"
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    max_model_len: int | None = None
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    page_size: int = 16
    kv_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_pages: int | None = None
    host_kv_memory: int = 0
    enable_prefix_caching: bool = True
    cuda_graphs: str | None = None
    cuda_graph_buckets: tuple[int, ...] | None = None
    fused_ops: str = "auto"
    async_scheduling: bool = True
    threads: int | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    custom_all_reduce: bool = True
    data_parallel_size: int = 1
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    debug: bool = False
    backends: Mapping[str, str] = field(default_factory=_default_backends)

    def __post_init__(self) -> None:
        source = _building_from.get()
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        checked = _validate(values, source)
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        defaults = _field_defaults()
        origins = {name: source if values[name] != defaults[name] else _DEFAULT for name in values}
        object.__setattr__(self, "_origins", origins)
        if source is not _DEFAULT:
            self._check_cross_fields()

    def __hash__(self) -> int:
        data = self.to_dict()
        data["backends"] = tuple(sorted(data["backends"].items()))
        data["speculative_config"] = self.speculative_config
        if data["cuda_graph_buckets"] is not None:
            data["cuda_graph_buckets"] = tuple(data["cuda_graph_buckets"])
        return hash(tuple(data.items()))

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        """Return the configuration keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    # Any: raw values as a YAML file, a dict or the command line give them; validated here
    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        source: str | ConfigSource = "",
        base: EngineConfig | None = None,
    ) -> EngineConfig:
        """Build a configuration from a mapping (a parsed YAML document, parsed flags).

        :param data: keys of :class:`EngineConfig`; ``backends`` may name only
            some families.
        :param source: the file the mapping came from, or a :class:`ConfigSource`,
            for error messages (empty: the values are treated as keyword arguments).
        :param base: the configuration the values override (defaults if ``None``).
        :raises ConfigError: an unknown key or a bad value, naming its source and key.
        """
        if isinstance(source, ConfigSource):
            src = source
        else:
            src = ConfigSource("file", source) if source else _KWARGS
        return (base or cls())._with(dict(data), src)

    # Any: raw values as a YAML file, a dict or the command line give them; validated here
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **overrides: Any) -> EngineConfig:
        """Load a YAML file, then apply keyword ``overrides``.

        :param path: the YAML file; its top level is a mapping of configuration keys.
        :raises ConfigError: the file is missing, is not valid YAML, is not a
            mapping, or has an unknown key or a bad value (naming the file and key).
        """
        # only a configuration file needs the YAML parser: an engine built from keywords skips it
        import yaml

        path_str = os.fspath(path)
        try:
            with open(path_str, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file {path_str!r}: {exc.strerror or exc}"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = ""
            mark = getattr(exc, "problem_mark", None)
            if mark is not None:
                where = f" at line {mark.line + 1}, column {mark.column + 1}"
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"config file {path_str!r} is not valid YAML{where}: {problem}"
            ) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {path_str!r} must hold a mapping of configuration keys "
                f"(key: value lines), not a {type(data).__name__}"
            )
        config = cls.from_dict(data, source=path_str)
        return config.merge(**overrides) if overrides else config

    # Any: raw values as a YAML file, a dict or the command line give them; validated here
    def merge(self, **overrides: Any) -> EngineConfig:
        """Return a copy with ``overrides`` applied (validated like keyword arguments).

        ``backends`` is merged per family: ``merge(backends={"ssm": "torch"})``
        keeps the other families' choices.
        """
        return self._with(overrides, _KWARGS)

    def _with(self, values: dict[str, Any], source: ConfigSource) -> EngineConfig:
        values = dict(values)
        if "backends" in values:
            backends = values["backends"]
            if backends is None:
                backends = {}
            if isinstance(backends, Mapping):
                values["backends"] = {**self.backends, **_check_backends_keys(backends, source)}
        checked = _validate(values, source)
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        current.update(checked)
        token = _building_from.set(_DEFAULT)
        try:
            new = type(self)(**current)
        finally:
            _building_from.reset(token)
        origins = dict(self._origins)  # type: ignore[attr-defined]
        for name in checked:
            origins[name] = source
        for family in values.get("backends") or {}:
            origins[f"backends.{family}"] = source
        object.__setattr__(new, "_origins", origins)
        new._check_cross_fields(checked)
        return new

    def _check_cross_fields(self, changed: Iterable[str] = ()) -> None:
        if self.max_num_tokens is None:
            return  # a budget left to the device covers the sequence limit
        if self.max_num_tokens < self.max_num_seqs_resolved:
            # Blame the key that was just set; when both (or neither) were, the token budget.
            changed = set(changed)
            only_seqs = "max_num_seqs" in changed and "max_num_tokens" not in changed
            key = "max_num_seqs" if only_seqs else "max_num_tokens"
            raise ConfigError(
                f"{self.origin(key).where(key)}: max_num_tokens ({self.max_num_tokens}) "
                f"must be at least max_num_seqs ({self.max_num_seqs_resolved}), since every running "
                "sequence decodes one token per step"
            )

    def origin(self, key: str) -> ConfigSource:
        """Return where the value of ``key`` (or ``backends.FAMILY``) came from."""
        origins = self._origins  # type: ignore[attr-defined]
        return origins.get(key) or origins[key.split(".", 1)[0]]

    # -- resolution of "auto" ---------------------------------------------------------------

    @property
    def device_resolved(self) -> str:
        """The device: ``device`` as written, or for ``auto`` ``cuda`` if available else ``cpu``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"`` (the resolved device without an index)."""
        return self.device_resolved.split(":", 1)[0]

    @property
    def dtype_resolved(self) -> str:
        """The dtype name: as written, or for ``auto`` bfloat16 on CUDA, float32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device_type == "cuda" else "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The resolved dtype as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.dtype_resolved)

    @property
    def torch_device(self) -> torch.device:
        """The resolved device as a ``torch.device``."""
        import torch

        return torch.device(self.device_resolved)

    @property
    def cuda_graphs_resolved(self) -> str:
        """The CUDA-graph mode: ``full_and_piecewise`` on CUDA and ``off`` on CPU unless set;
        a mode set for a CPU run is turned ``off`` (with a warning), as graphs need CUDA."""
        on_cuda = self.device_type == "cuda"
        if self.cuda_graphs is None:
            return "full_and_piecewise" if on_cuda else "off"
        if not on_cuda and self.cuda_graphs != "off":
            logger.warning(
                "cuda_graphs=%s ignored: device %s is not CUDA; running eagerly",
                self.cuda_graphs,
                self.device_resolved,
            )
            return "off"
        return self.cuda_graphs

    def _default_limits(self) -> tuple[int, int]:
        """``(max_num_seqs, max_num_tokens)`` for limits left unset, by device."""
        if self.device_type != "cuda":
            return _CPU_MAX_NUM_SEQS, _CPU_MAX_NUM_TOKENS
        memory = _device_memory(self.device_resolved)
        if memory is not None and memory >= _LARGE_GPU_BYTES:
            return _LARGE_CUDA_MAX_NUM_SEQS, _LARGE_CUDA_MAX_NUM_TOKENS
        return _CUDA_MAX_NUM_SEQS, _CUDA_MAX_NUM_TOKENS

    @property
    def max_num_seqs_resolved(self) -> int:
        """Most sequences per step: as set, else 1,024 on a GPU of 70 GiB or more,
        256 on a smaller one and 32 on a CPU.

        Admitting many sequences at once matters when many requests arrive
        together: on the ShareGPT-like mix of an 8B model (one H100, 1,000
        requests at once) 1,024 gave 14% more output tokens per second than 256,
        since the long outputs start early and the tail of few running sequences is
        shorter (vLLM picks 1,024 on such GPUs too). A smaller GPU has too little
        room for the activations and KV cache of that many; a CPU decodes few
        sequences at a time. A model with recurrent state gets at most
        :data:`RECURRENT_MAX_NUM_SEQS` when the limit is left unset (the worker
        applies it once the model is known).
        """
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return self._default_limits()[0]

    @property
    def max_num_tokens_resolved(self) -> int:
        """Most tokens per step (the chunked-prefill budget): as set, else 8,192 on CUDA
        and 2,048 on a CPU, and never fewer than :attr:`max_num_seqs_resolved`.

        On the mix above 16,384 was no faster than 8,192 (the prefill steps are
        compute-bound either way) and doubles how long a prefill step holds up the
        running sequences' next token."""
        if self.max_num_tokens is not None:
            return self.max_num_tokens
        return max(self._default_limits()[1], self.max_num_seqs_resolved)

    def resolved(self) -> EngineConfig:
        """Return a copy with ``device``, ``dtype`` and ``cuda_graphs`` made concrete."""
        return self._with(
            {
                "device": self.device_resolved,
                "dtype": self.dtype_resolved,
                "cuda_graphs": self.cuda_graphs_resolved,
                "max_num_seqs": self.max_num_seqs_resolved,
                "max_num_tokens": self.max_num_tokens_resolved,
            },
            _DEFAULT,
        )

    # Any: each key keeps its own type (str, int, float, bool, tuple, dict)
    def to_dict(self) -> dict[str, Any]:
        """Return the configuration as plain data (YAML/JSON-serialisable)."""
        data = {name: getattr(self, name) for name in self.field_names()}
        data["backends"] = dict(self.backends)
        if self.cuda_graph_buckets is not None:
            data["cuda_graph_buckets"] = list(self.cuda_graph_buckets)
        if self.speculative_config is not None:
            data["speculative_config"] = self.speculative_config.to_dict()
        return data


# -- validation -------------------------------------------------------------------------------


def _check_backends_keys(backends: Mapping[Any, Any], source: ConfigSource) -> dict[str, Any]:
    for family in backends:
        if family not in FAMILIES:
            close = difflib.get_close_matches(str(family), FAMILIES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source.where(f'backends.{family}')}: unknown op family{hint}; "
                f"the families are: {', '.join(FAMILIES)}"
            )
    return dict(backends)


def _int(value: Any, *, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"expected an integer >= {minimum}{' or null' if allow_none else ''}, got {value!r}"
        )
    if value < minimum:
        raise ValueError(f"expected an integer >= {minimum}, got {value}")
    return value


def _fraction(value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"expected a number in (0, 1], e.g. 0.9, got {value!r}")
    return float(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _choice(value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def _device(value: Any) -> str:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
            return text
    raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")


def _dtype(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in DTYPES:
        return DTYPES[value.strip().lower()]
    raise ValueError(f"expected one of auto, float32, bfloat16, float16, got {value!r}")


def _buckets(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p for p in value.replace(" ", "").split(",") if p]
        value = parts
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"expected a non-empty list of positive integers, got {value!r}")
    out = []
    for item in value:
        try:
            out.append(_int(item, minimum=1))
        except ValueError:
            raise ValueError(
                f"expected a non-empty list of positive integers, got {value!r}"
            ) from None
    return tuple(sorted(set(out)))  # type: ignore[arg-type]


def _backends(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(
            "expected a mapping of op family to backend name, e.g. {attention: torch}, "
            f"got {value!r}"
        )
    out = _default_backends()
    for family, name in value.items():
        if not isinstance(name, str) or not name.strip():
            raise _KeyedError(
                f"backends.{family}", f"expected a backend name or auto, got {name!r}"
            )
        out[family] = name.strip()
    return out


class _KeyedError(ValueError):
    """A bad value inside a nested key (``backends.ssm``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


_VALIDATORS: dict[str, Any] = {
    "model": lambda v: v if isinstance(v, str) and v.strip() else _raise_model(v),
    "dtype": _dtype,
    "device": _device,
    "quantization": lambda v: _quantization(v),
    "kv_cache_dtype": lambda v: _choice(
        v.strip().lower() if isinstance(v, str) else v, KV_CACHE_DTYPES
    ),
    "max_num_seqs": lambda v: _int(v, minimum=1, allow_none=True),
    "max_num_tokens": lambda v: _int(v, minimum=1, allow_none=True),
    "max_model_len": lambda v: _int(v, minimum=1, allow_none=True),
    "max_stop_strings": lambda v: _int(v, minimum=0),
    "max_stop_string_length": lambda v: _int(v, minimum=1),
    "page_size": lambda v: _int(v, minimum=1),
    "kv_memory": lambda v: None if v is None or v == "auto" else _positive_size(v),
    "gpu_memory_utilization": lambda v: _fraction(v),
    "num_kv_pages": lambda v: _int(v, minimum=2, allow_none=True),
    "host_kv_memory": parse_size,
    "enable_prefix_caching": _bool,
    "cuda_graphs": lambda v: None if v is None else _choice(v, CUDA_GRAPH_MODES),
    "cuda_graph_buckets": _buckets,
    "fused_ops": lambda v: _choice(v.strip().lower() if isinstance(v, str) else v, FUSED_OPS_MODES),
    "async_scheduling": _bool,
    "threads": lambda v: _threads(v),
    "tensor_parallel_size": lambda v: _int(v, minimum=1),
    "distributed_executor_backend": lambda v: _choice(
        v.strip().lower() if isinstance(v, str) else v, DISTRIBUTED_EXECUTOR_BACKENDS
    ),
    "custom_all_reduce": _bool,
    "data_parallel_size": lambda v: _int(v, minimum=1),
    "speculative_config": lambda v: _speculative(v),
    "seed": lambda v: _int(v, minimum=0),
    "debug": _bool,
    "backends": _backends,
}


def _speculative(value: Any) -> SpeculativeConfig | None:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(
                "expected a JSON object such as "
                + json.dumps({"method": "ngram", "num_speculative_tokens": 3})
                + f", got {value!r} ({exc.msg})"
            ) from None
    try:
        return SpeculativeConfig.from_value(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _quantization(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, str) and value.strip().lower() == "fp8":
        return "fp8"
    raise ValueError(
        f"quantization {value!r} is not supported; use fp8 (quantise a full-precision "
        "checkpoint on load) or leave it unset (FP8 checkpoints load as they are; AWQ, GPTQ "
        "and bitsandbytes are not supported)"
    )


def _raise_model(value: Any) -> str:
    raise ValueError(f"expected a model directory or preset name, got {value!r}")


def _threads(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return _int(value, minimum=1)
    except ValueError:
        raise ValueError(
            f"expected a positive number of threads or auto (the cores this process may use), "
            f"got {value!r}"
        ) from None


def _positive_size(value: Any) -> int:
    size = parse_size(value)
    if size == 0:
        raise ValueError("expected a size above zero (omit the key for automatic sizing)")
    return size


def _validate(values: Mapping[str, Any], source: ConfigSource) -> dict[str, Any]:
    """Check and normalise ``values``; raise :class:`ConfigError` naming source and key."""
    known = list(_VALIDATORS)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in _VALIDATORS:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source.where(str(key))}: unknown key{hint}; the keys are: {', '.join(known)}"
            )
        if key == "backends" and isinstance(value, Mapping):
            _check_backends_keys(value, source)
        try:
            out[key] = _VALIDATORS[key](value)
        except _KeyedError as exc:
            raise ConfigError(f"{source.where(exc.key)}: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{source.where(key)}: {exc}") from None
    return out


@functools.cache
def _device_memory(device: str) -> int | None:
    """Total memory of CUDA device ``device`` in bytes, or ``None`` where none can be read."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    except (RuntimeError, AssertionError, ValueError):
        return None

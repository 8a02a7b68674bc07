"""Load a model from a local directory or GGUF file (or build a preset).

A model directory holds ``config.json`` and the weights as ``*.safetensors``,
either one file or shards listed in ``model.safetensors.index.json``; its
tokenizer files are read by :func:`~backplane.models.tokenizer.load_hf_tokenizer`
and ``generation_config.json`` contributes end-of-sequence ids and sampling
defaults. A ``.gguf`` file (or a directory holding exactly one, and no
``config.json``) is read by :mod:`backplane.models.gguf`: config, tokenizer,
chat template and weights all come from the one file, dequantised on the
target device. Model names are presets (random tiny models) or installed
checkpoints such as ``smollm2`` (:mod:`backplane.models.presets`).
Safetensors tensors are read through ``safetensors.safe_open`` (memory-mapped,
one tensor at a time) on the CPU, and onto a CUDA device by several threads
through pinned buffers (:mod:`backplane.models.safetensors_reader`); either way
they are copied into a model built directly in the requested dtype on the
requested device. Weight mapping is strict: a missing or unexpected tensor is
an error that names it, and a mis-shaped one names its file too. Projections
the model merges (q/k/v, gate/up, ...) load from the checkpoint's separate
tensors, each into its row slice of the merged parameter. There is no network
access: a hub id is an error asking for a local path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from backplane.core.errors import ConfigError
from backplane.models import presets
from backplane.models.base import (
    CausalLM,
    MissingConfigKeyError,
    ModelConfig,
    WeightLoadError,
    build_model,
)
from backplane.models.loaded import LoadedModel
from backplane.models.mtp import attach_mtp
from backplane.models.parallel import ShardSlice
from backplane.models.quant.loading import (
    checkpoint_keys,
    convert_for_checkpoint,
    fp8_checkpoint_tensors,
    quantize_model,
)
from backplane.models.quant.scheme import SUPPORTED, Fp8Scheme, scheme_from_config
from backplane.models.registry import model_class
from backplane.models.safetensors_reader import UnreadableTensorError, read_tensors
from backplane.models.tokenizer import TextTokenizer, load_hf_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``"auto"``/``None`` -> CUDA when available, else CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: torch.dtype | str | None, config: ModelConfig | None, device: torch.device
) -> torch.dtype:
    """Turn a dtype request into a torch dtype.

    ``"auto"``/``None``: the checkpoint's dtype on CUDA, float32 on CPU (where
    half-precision matmuls are slow).

    :raises ConfigError: for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        name = (config or {}).get("torch_dtype") or (config or {}).get("dtype") or "bfloat16"
        return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)
    try:
        return _DTYPES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}"
        ) from None


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` of a model directory.

    :raises ConfigError: when it is missing, not valid JSON, or declares a
        ``quantization_config`` backplane cannot load (see :func:`check_quantization`).
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        config = ModelConfig(json.loads(f.read_text()))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{f} is not valid JSON: {exc}") from None
    except (TypeError, ValueError):
        raise ConfigError(f"{f} must hold a JSON object") from None
    check_quantization(config, f)
    return config


def check_quantization(config: ModelConfig, origin: str | os.PathLike) -> Fp8Scheme | None:
    """Read the quantisation a checkpoint declares, refusing what backplane cannot load.

    A ``quantization_config`` (top level, or in a nested ``text_config``)
    means the tensors are stored quantised. FP8 checkpoints load (see
    :func:`~backplane.models.quant.scheme.scheme_from_config`); GPTQ, AWQ,
    bitsandbytes and every other method are refused.

    :param config: the ``config.json`` as read.
    :param origin: the file, for messages.
    :return: the FP8 scheme, or ``None`` for a full-precision checkpoint.
    :raises ConfigError: naming the file, the method and what is supported.
    """
    for where, cfg in (("", config), ("text_config.", config.get("text_config") or {})):
        quant = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if quant:
            return scheme_from_config(quant, f"{origin}: {where}quantization_config")
    return None


def weight_files(path: str | os.PathLike) -> list[Path]:
    """Return the safetensors files of a model directory.

    Uses ``model.safetensors.index.json`` when present (every listed shard
    must exist), else every ``*.safetensors`` file.

    :raises ConfigError: no weights, or shards listed but missing.
    """
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ConfigError(f"{index} lists shards that are not in {root}: {', '.join(missing)}")
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in root.glob("*.bin")) + sorted(
            p.name for p in root.glob("*.pt")
        )
        hint = f" (found {', '.join(bins[:3])}: convert them to safetensors first)" if bins else ""
        raise ConfigError(f"{root} has no *.safetensors weights{hint}")
    return files


def iter_safetensors(
    files: list[Path],
    *,
    progress: bool = True,
    origins: dict[str, Path] | None = None,
    shard_of: Callable[[str], ShardSlice | None] | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every file, with a progress bar.

    On the CPU (and with ``device=None``) the tensors are memory-mapped views
    of the files, read one at a time as the caller copies them. For a CUDA
    ``device`` the tensors the rank loads whole are read by several threads
    through pinned buffers and yielded on the device
    (:func:`~backplane.models.safetensors_reader.read_tensors`), then the
    sliced ones memory-mapped.

    :param files: safetensors files.
    :param progress: show a tqdm bar (on a terminal).
    :param origins: when given, filled with ``{tensor name: file}`` as the files are opened.
    :param shard_of: the slice of a tensor a tensor-parallel rank loads, by
        name (``None``: all of it); only that slice is read from the file.
    :param device: where the model's weights are (``None``: read on the CPU).
    :raises ConfigError: a header or a tensor cannot be read, naming the file.
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    handles = []
    total = 0
    for f in files:
        try:
            h = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError and OSError: the header cannot be read
            raise _unreadable(f, exc) from None
        handles.append((f, h))
        total += len(h.keys())
        if origins is not None:
            origins.update(dict.fromkeys(h.keys(), f))
    staged = device is not None and torch.device(device).type == "cuda"
    sliced = frozenset(
        name
        for _, h in handles
        for name in h.keys()
        if shard_of is not None and shard_of(name) is not None
    )
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress or None)
    try:
        if staged:
            # the whole tensors first, at the pinned buffers' speed; the slices are read below
            try:
                with contextlib.closing(read_tensors(files, device, skip=sliced)) as whole:
                    for _, name, tensor in whole:
                        yield name, tensor
                        bar.update(1)
            except UnreadableTensorError as exc:
                raise _unreadable(exc.path, exc, tensor=exc.tensor) from None
        for f, h in handles:
            for name in h.keys():
                if staged and name not in sliced:
                    continue
                try:
                    tensor = _read(h, name, shard_of)
                except Exception as exc:  # the data of this tensor lies past the end of the file
                    raise _unreadable(f, exc, tensor=name) from None
                yield name, tensor
                bar.update(1)
    finally:
        bar.close()


def _read(handle: Any, name: str, shard_of: Callable[[str], ShardSlice | None] | None) -> Any:
    """Tensor ``name`` of an open safetensors file, or only the slice ``shard_of`` names."""
    shard = None if shard_of is None else shard_of(name)
    if shard is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    shape = view.get_shape()
    if len(shape) <= shard.dim or shape[shard.dim] != shard.part.total:
        # Mis-shaped: read it whole, so that loading names its true shape.
        return handle.get_tensor(name)
    return view[shard.index(len(shape))]


def _unreadable(f: Path, exc: Exception, tensor: str | None = None) -> ConfigError:
    what = f"tensor {tensor!r}" if tensor else "its header"
    reason = " ".join(str(exc).split())
    return ConfigError(
        f"{f}: cannot read {what} ({type(exc).__name__}: {reason}); the file may be "
        "truncated or damaged: download it again"
    )


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer | None:
    """Load the tokenizer of a model directory (see
    :func:`~backplane.models.tokenizer.load_hf_tokenizer`), or return ``None``."""
    return load_hf_tokenizer(path)


#: generation_config.json keys -> SamplingParams fields (read when it samples)
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}

#: generation_config.json keys that change the logits greedy or not (read either way, as
#: transformers applies ``repetition_penalty`` in greedy decoding too and vLLM reads them)
_PENALTY_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def read_generation_config(path: str | os.PathLike) -> tuple[list[int], dict[str, Any]]:
    """Read ``generation_config.json`` of a model directory.

    :param path: the model directory.
    :return: its end-of-sequence ids and its sampling defaults as
        ``SamplingParams`` field names (``temperature=0`` when it does not
        sample, as transformers then decodes greedily; ``repetition_penalty``,
        ``presence_penalty`` and ``frequency_penalty`` whether it samples or
        not); empty without the file.
    :raises ConfigError: the file is not valid JSON, naming it.
    """
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return [], {}
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{f} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{f} must hold a JSON object")
    value = data.get("eos_token_id")
    eos = (
        []
        if value is None
        else [int(v) for v in value]
        if isinstance(value, list)
        else [int(value)]
    )
    defaults: dict[str, Any] = {}
    if not data.get("do_sample", False):
        defaults["temperature"] = 0.0
    else:
        for key, name in _SAMPLING_KEYS.items():
            if data.get(key) is not None and key != "max_new_tokens":
                defaults[name] = data[key]
    if data.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(data["max_new_tokens"])
    for key in _PENALTY_KEYS:
        if data.get(key) is not None:
            defaults[key] = data[key]
    return eos, defaults


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def gguf_file_of(path: Path) -> Path | None:
    """The GGUF file ``path`` stands for: itself, or the one ``.gguf`` of a directory
    without ``config.json``; ``None`` for a Hugging Face directory.

    :raises ConfigError: a directory holding several GGUF files (listing them).
    """
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(
            f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:5])}); "
            "pass the one to load as the model"
        )
    return found[0] if found else None


def _resolve(name: str) -> Path:
    """The local path a model argument names.

    :raises ConfigError: a hub id, or neither a file, a directory nor a known name.
    """
    if name in presets.INSTALLED_MODELS:
        return presets.installed_model_path(name)
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    if path.is_file():
        raise ConfigError(
            f"model {name!r} is a file but not a .gguf file; pass a GGUF file or a Hugging Face "
            "model directory (config.json + safetensors)"
        )
    if _looks_like_hub_id(name):
        raise ConfigError(
            f"{name!r} is not a local directory. backplane does not download models: "
            f"download it first (e.g. `huggingface-cli download {name} --local-dir DIR`) "
            "and pass the local path"
        )
    raise ConfigError(
        f"model {name!r} is neither a local directory, a .gguf file nor a known name; "
        f"names: {', '.join(sorted(presets.PRESETS) + sorted(presets.INSTALLED_MODELS))}"
    )


def _model_class(config: ModelConfig, origin: Path) -> type[CausalLM]:
    """The class of ``config``'s architecture; an unsupported one is named with ``origin``."""
    try:
        return model_class(config.get("architectures"))
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def _build(
    cls: type[CausalLM],
    config: ModelConfig,
    origin: Path,
    dtype: torch.dtype | str,
    dev: torch.device,
    backends: dict[str, Any],
) -> tuple[CausalLM, ModelConfig]:
    """Build the empty model; config errors name ``origin``."""
    try:
        config = cls.normalize_config(config)
        torch_dtype = resolve_dtype(dtype, config, dev)
        logger.info("building %s from %s as %s on %s", cls.__name__, origin, torch_dtype, dev)
        lm = build_model(cls, config, backends, dtype=torch_dtype, device=dev)
    except MissingConfigKeyError as exc:
        raise ConfigError(f"{origin}: lacks the field {exc.key!r}, which the model needs") from None
    except ConfigError as exc:
        if str(origin) in str(exc):
            raise
        raise ConfigError(f"{origin}: {exc}") from None
    return lm, config


def _load(
    lm: CausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    origin_of: Any,
    origin: Path,
) -> None:
    """Load ``tensors`` strictly; a faulty tensor is named with the file it came from
    (``origin_of(tensor name)``), other mismatches with ``origin``."""
    try:
        report = lm.load_weights(tensors, strict=True)
    except WeightLoadError as exc:
        where = origin_of(exc.tensor) if exc.tensor is not None else None
        raise WeightLoadError(f"{where or origin}: {exc}", tensor=exc.tensor) from None
    finally:
        # a load that stops early stops the reading threads (and frees their buffers) now
        close = getattr(tensors, "close", None)
        if close is not None:
            close()
    if report["ignored"]:
        logger.info(
            "ignored %d checkpoint tensors (e.g. %s)", len(report["ignored"]), report["ignored"][0]
        )


def load_model(
    model: str | os.PathLike,
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "auto",
    backends: dict[str, Any],
    progress: bool = True,
    mtp: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a model directory or GGUF file, or build a preset.

    :param model: a local directory (``config.json`` + safetensors, or one
        ``.gguf`` file), a ``.gguf`` file, a preset name (see
        :data:`backplane.models.presets.PRESETS`) or an installed checkpoint's
        name (:data:`backplane.models.presets.INSTALLED_MODELS`, e.g. ``smollm2``).
    :param dtype: torch dtype or name; ``"auto"`` = checkpoint dtype on CUDA, float32 on CPU.
    :param device: where the weights go (``"auto"``: CUDA when available).
    :param backends: ``{family: backend object}`` for the families the model uses.
    :param progress: show a progress bar while reading weights.
    :param mtp: also load the checkpoint's multi-token-prediction layers (as
        ``model.mtp``, see :func:`backplane.models.mtp.attach_mtp`) for speculative decoding.
    :param quantization: ``"fp8"`` quantises a full-precision checkpoint's (or
        preset's) projections to FP8 on load (see
        :func:`~backplane.models.quant.loading.quantize_model`); ``None`` loads
        the weights as stored (an FP8 checkpoint stays FP8 either way).
    :return: the model, its tokenizer and config.
    :raises ConfigError: unknown path / name, hub id, unsupported architecture
        or quantisation, unreadable files, or weights that do not match the
        config; each names the file and the field or tensor.
    """
    name = os.fspath(model)
    dev = resolve_device(device)
    quantize = _quantization(quantization)
    if name in presets.PRESETS:
        loaded = presets.build_preset(
            name, dtype=resolve_dtype(dtype, None, dev), device=dev, backends=backends, mtp=mtp
        )
        if quantize:
            quantize_model(loaded.model)
        return loaded
    path = _resolve(name)
    gguf_path = gguf_file_of(path)
    if gguf_path is not None and quantize:
        raise ConfigError(
            f"{gguf_path}: quantization='fp8' applies to safetensors checkpoints and presets; "
            "a GGUF file keeps its own quantisation (drop the quantization option)"
        )
    if gguf_path is not None:
        return _load_gguf(gguf_path, dtype=dtype, device=dev, backends=backends, progress=progress)
    config_file = path / "config.json"
    config = read_config(path)
    scheme = check_quantization(config, config_file)
    cls = _model_class(config, config_file)
    files = weight_files(path)
    lm, config = _build(cls, config, config_file, dtype, dev, backends)
    if mtp:
        attach_mtp(lm)
    logger.info("loading %d weight file(s) from %s", len(files), path)
    origins: dict[str, Path] = {}
    shard_of = lm.checkpoint_shard if lm.tp.enabled else None
    tensors = iter_safetensors(
        files, progress=progress, origins=origins, shard_of=shard_of, device=dev
    )
    if scheme is not None:
        convert_for_checkpoint(lm, checkpoint_keys(files), scheme)
        tensors = fp8_checkpoint_tensors(lm, tensors, scheme)
    _load(lm, tensors, origins.get, path)
    if quantize and scheme is None:
        quantize_model(lm)
    eos_ids, defaults = read_generation_config(path)
    for eos in eos_ids:
        if eos not in lm.eos_token_ids:
            lm.eos_token_ids.append(eos)
    lm.generation_defaults = defaults
    return LoadedModel(model=lm, tokenizer=load_tokenizer(path), config=config)


def _quantization(value: str | None) -> bool:
    """Whether ``quantization`` asks for FP8 on load.

    :raises ConfigError: a method other than ``fp8``, naming what is supported.
    """
    if value is None or str(value).lower() in ("", "none"):
        return False
    if str(value).lower() == "fp8":
        return True
    raise ConfigError(f"quantization={value!r} is not supported; supported: {SUPPORTED}")


def _load_gguf(
    path: Path,
    *,
    dtype: torch.dtype | str,
    device: torch.device,
    backends: dict[str, Any],
    progress: bool,
) -> LoadedModel:
    """Load a GGUF file: config, tokenizer and weights (on ``device``; Q8_0 and k-quant
    projections kept quantised, see :mod:`backplane.models.gguf.qlinear`)."""
    from backplane.models.gguf import open_gguf_checkpoint

    ckpt = open_gguf_checkpoint(path)
    cls = _model_class(ckpt.config, path)
    lm, config = _build(cls, ckpt.config, path, dtype, device, backends)
    # Q8_0 / Q4_K / Q5_K / Q6_K projections stay quantised, as in vLLM (no switch).
    ckpt.keep_quantized(lm)

    def origin_of(tensor: str) -> str:
        return f"{path}: tensor {ckpt.gguf_name(tensor)!r}"

    _load(lm, ckpt.weights(device=device, progress=progress), origin_of, path)
    return LoadedModel(model=lm, tokenizer=ckpt.tokenizer, config=config)

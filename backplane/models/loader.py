"""Load a model from a local directory (or build a preset).

A model directory holds ``config.json`` and the weights as ``*.safetensors``,
either one file or shards listed in ``model.safetensors.index.json``; a
``tokenizer.json`` is loaded with the ``tokenizers`` library when present and
``generation_config.json`` contributes end-of-sequence ids. Tensors are read
through ``safetensors.safe_open`` (memory-mapped, one tensor at a time) and
copied into a model built directly in the requested dtype on the requested
device. Weight mapping is strict: a missing or unexpected tensor is an error
that names it, and a mis-shaped one names its file too. Projections the model
merges (q/k/v, gate/up, ...) load from the checkpoint's separate tensors, each
into its row slice of the merged parameter. There is no network access: a hub
id is an error asking for a local path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backplane.core.errors import ConfigError
from backplane.models.base import CausalLM, ModelConfig, WeightLoadError, build_model
from backplane.models.registry import model_class

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


@dataclass
class LoadedModel:
    """What :func:`load_model` returns.

    :param model: the :class:`~backplane.models.base.CausalLM`, in eval mode.
    :param tokenizer: a ``tokenizers.Tokenizer`` (``encode(text).ids``,
        ``decode(ids)``), or ``None`` when the directory has no ``tokenizer.json``.
    :param config: the model's HF config.
    """

    model: CausalLM
    tokenizer: Any
    config: ModelConfig


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

    :raises ConfigError: when it is missing or not valid JSON.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        return ModelConfig(json.loads(f.read_text()))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{f} is not valid JSON: {exc}") from None


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
    files: list[Path], *, progress: bool = True, origins: dict[str, Path] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every file, memory-mapped, with a progress bar.

    :param files: safetensors files.
    :param progress: show a tqdm bar (on a terminal).
    :param origins: when given, filled with ``{tensor name: file}`` as the files are opened.
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    handles = []
    total = 0
    for f in files:
        h = safe_open(str(f), framework="pt", device="cpu")
        handles.append(h)
        total += len(h.keys())
        if origins is not None:
            origins.update(dict.fromkeys(h.keys(), f))
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress or None)
    try:
        for h in handles:
            for name in h.keys():
                yield name, h.get_tensor(name)
                bar.update(1)
    finally:
        bar.close()


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Load ``tokenizer.json`` with the ``tokenizers`` library, or return ``None``."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        logger.warning("%s has no tokenizer.json; prompts must be given as token ids", path)
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(f))


def _generation_eos(path: Path) -> list[int]:
    f = path / "generation_config.json"
    if not f.is_file():
        return []
    try:
        value = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return []
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def load_model(
    model: str | os.PathLike,
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "auto",
    backends: dict[str, Any],
    progress: bool = True,
) -> LoadedModel:
    """Load a model directory or build a preset.

    :param model: a local directory (``config.json`` + safetensors) or a preset
        name (see :data:`backplane.models.presets.PRESETS`).
    :param dtype: torch dtype or name; ``"auto"`` = checkpoint dtype on CUDA, float32 on CPU.
    :param device: where the weights go (``"auto"``: CUDA when available).
    :param backends: ``{family: backend object}`` for the families the model uses.
    :param progress: show a progress bar while reading weights.
    :return: the model, its tokenizer and config.
    :raises ConfigError: unknown path / preset, hub id, unsupported architecture,
        or weights that do not match the config.
    """
    from backplane.models import presets

    name = os.fspath(model)
    dev = resolve_device(device)
    if name in presets.PRESETS:
        return presets.build_preset(
            name, dtype=resolve_dtype(dtype, None, dev), device=dev, backends=backends
        )
    path = Path(name).expanduser()
    if not path.is_dir():
        if _looks_like_hub_id(name):
            raise ConfigError(
                f"{name!r} is not a local directory. backplane does not download models: "
                f"download it first (e.g. `huggingface-cli download {name} --local-dir DIR`) "
                "and pass the local path"
            )
        raise ConfigError(
            f"model {name!r} is neither a local directory nor a preset; presets: "
            f"{', '.join(sorted(presets.PRESETS))}"
        )
    config = read_config(path)
    cls = model_class(config.get("architectures"))
    config = cls.normalize_config(config)
    files = weight_files(path)
    torch_dtype = resolve_dtype(dtype, config, dev)
    logger.info(
        "loading %s (%s) from %d file(s) as %s on %s",
        path,
        cls.__name__,
        len(files),
        torch_dtype,
        dev,
    )
    lm = build_model(cls, config, backends, dtype=torch_dtype, device=dev)
    origins: dict[str, Path] = {}
    try:
        report = lm.load_weights(
            iter_safetensors(files, progress=progress, origins=origins), strict=True
        )
    except WeightLoadError as exc:
        if exc.tensor not in origins:
            raise
        raise WeightLoadError(f"{origins[exc.tensor]}: {exc}", tensor=exc.tensor) from None
    if report["ignored"]:
        logger.info(
            "ignored %d checkpoint tensors (e.g. %s)", len(report["ignored"]), report["ignored"][0]
        )
    for eos in _generation_eos(path):
        if eos not in lm.eos_token_ids:
            lm.eos_token_ids.append(eos)
    return LoadedModel(model=lm, tokenizer=load_tokenizer(path), config=config)

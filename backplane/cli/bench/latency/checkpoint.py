"""Trained checkpoints measured as they are: a ``.gguf`` file or an installed model.

``--shapes`` takes, beside the named shapes and model directories, a path to
a ``.gguf`` file or the name of an installed model (``smollm2``); its config
comes from the GGUF metadata (its sizes: see
:func:`~backplane.cli.bench.latency.weights.gguf_weights_info`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["checkpoint_config", "checkpoint_file", "checkpoint_tokenizer"]


def checkpoint_file(name: str) -> Path | None:
    """The GGUF file shape ``name`` stands for, if it is one.

    :param name: what ``--shapes`` said.
    :return: the file of an installed model's name or of a path ending in
        ``.gguf``; ``None`` for anything else (a named shape, a preset, a directory).
    :raises ConfigError: an installed model whose package is missing (the
        message gives the command that installs it).
    """
    from backplane.models import presets

    if name in presets.INSTALLED_MODELS:
        return presets.installed_model_path(name)
    path = Path(name)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    return None


def checkpoint_config(path: Path) -> dict[str, Any]:
    """The HF config dict a GGUF file describes, as its architecture reads it.

    :param path: the ``.gguf`` file.
    :return: a plain, JSON-serialisable dict.
    :raises ConfigError: an unreadable file or an unsupported architecture.
    """
    import json

    from backplane.models.gguf import open_gguf_checkpoint
    from backplane.models.registry import model_class

    config = open_gguf_checkpoint(path).config
    config = model_class(config.get("architectures")).normalize_config(config)
    return json.loads(json.dumps(dict(config)))


def checkpoint_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer of a trained checkpoint, to write its chat prompts with.

    :param path: a ``.gguf`` file or a model directory.
    :return: its tokenizer, or ``None`` for a checkpoint without one.
    """
    gguf = Path(path)
    if gguf.suffix.lower() == ".gguf" and gguf.is_file():
        from backplane.models.gguf import open_gguf_checkpoint

        return open_gguf_checkpoint(gguf).tokenizer
    from backplane.models.loader import load_tokenizer

    return load_tokenizer(path)

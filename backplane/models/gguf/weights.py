"""The tensors of a GGUF file under Hugging Face names, dequantised in torch on the target device.

llama.cpp renames tensors (``blk.3.attn_q.weight`` is
``model.layers.3.self_attn.q_proj.weight``) and, for Llama-family models,
permutes the rows of the query and key projections so that rotary pairs are
adjacent; both are undone here, so the model loads the tensors exactly as it
loads a safetensors checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from backplane.core.errors import ConfigError
from backplane.models.base import ModelConfig
from backplane.models.gguf.config import ROPE_FREQS_TENSOR, GGUFArchitecture
from backplane.models.gguf.dequant import GGML_TYPES, dequantize, supported_types
from backplane.models.gguf.reader import GGUFFile

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_NAME = re.compile(r"^(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<kind>weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor ``gguf_name``; unknown names come back unchanged
    (so the model reports them as unexpected tensors)."""
    m = _NAME.match(gguf_name)
    if m is None:
        return gguf_name
    layer, base, kind = m.group("layer"), m.group("base"), m.group("kind")
    if layer is None:
        target = _TOP_LEVEL.get(base)
        return gguf_name if target is None else f"{target}.{kind}"
    target = _PER_LAYER.get(base)
    return gguf_name if target is None else f"model.layers.{layer}.{target}.{kind}"


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from HF's layout (first
    half of the rotary pairs, then the second half) to interleaved pairs:
    ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``. This is its inverse.

    :param w: a q or k projection weight ``[n_head * d, in]`` (or bias ``[n_head * d]``).
    :param n_head: heads of that projection (key/value heads for k).
    :return: the rows in HF order.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def raw_rows(data: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a quantised matrix as rows of blocks, without dequantising them.

    :param data: the tensor's bytes, 1-D ``uint8``.
    :param ggml_type: its ggml type id.
    :param shape: its shape in torch order, ``(rows, values per row)``.
    :return: ``data`` viewed as ``[rows, bytes per row]``.
    :raises ConfigError: not a matrix of whole blocks per row, or a byte count that
        does not fit the shape.
    """
    layout = GGML_TYPES[int(ggml_type)]
    if len(shape) != 2 or shape[1] % layout.block_size:
        raise ConfigError(
            f"{layout.name} tensor of shape {tuple(shape)} is not a matrix of whole "
            f"{layout.block_size}-value blocks per row"
        )
    row = shape[1] // layout.block_size * layout.type_size
    if data.numel() != shape[0] * row:
        raise ConfigError(
            f"{layout.name} data of {data.numel()} bytes does not hold a tensor of shape "
            f"{tuple(shape)}; the file is damaged"
        )
    return data.reshape(shape[0], row)


def check_tensor_types(file: GGUFFile) -> None:
    """Refuse a file with a tensor type backplane cannot dequantise, before loading anything.

    :raises ConfigError: naming the file, the tensor and its type.
    """
    for t in file.tensors:
        if t.ggml_type not in GGML_TYPES:
            import_name = _type_name(t.ggml_type)
            raise ConfigError(
                f"{file.path}: tensor {t.name!r} is stored as {import_name}, which backplane does "
                f"not dequantise (it reads {', '.join(supported_types())}); use a file "
                "quantised to one of those"
            )


def _type_name(ggml_type: int) -> str:
    from backplane.models.gguf.reader import import_gguf

    try:
        return import_gguf().GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def iter_gguf_weights(
    file: GGUFFile,
    arch: GGUFArchitecture,
    config: ModelConfig,
    *,
    device: torch.device | str,
    progress: bool = True,
    raw: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, tensor)`` for every tensor of ``file``, dequantised on ``device``.

    :param file: the opened GGUF file.
    :param arch: its architecture's recipe (whether q/k rows are permuted).
    :param config: the config built from the file (head counts).
    :param device: where the bytes are copied and dequantised.
    :param progress: show a tqdm bar (on a terminal).
    :param raw: GGUF names of 2-D tensors to yield as their raw blocks, ``uint8``
        ``[rows, bytes per row]`` (for projections that stay quantised, see
        :mod:`~backplane.models.gguf.qlinear`); their q/k rows are unpermuted too.
    :raises ConfigError: a tensor whose bytes do not fit its shape, naming the file and tensor.
    """
    from tqdm.auto import tqdm

    heads = {
        "attn_q": int(config["num_attention_heads"]),
        "attn_k": int(config["num_key_value_heads"]),
    }
    for t in tqdm(
        file.tensors, desc="loading weights", unit="tensor", disable=not progress or None
    ):
        if t.name == ROPE_FREQS_TENSOR:
            continue  # read into the config's rope parameters, not a weight
        try:
            if t.name in raw:
                value = raw_rows(t.raw(device), t.ggml_type, t.shape)
            else:
                value = dequantize(t.raw(device), t.ggml_type, t.shape)
        except ConfigError as exc:
            raise ConfigError(f"{file.path}: tensor {t.name!r}: {exc}") from None
        if arch.permuted_qk:
            base = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
            if base in heads:
                value = unpermute_rows(value, heads[base])
        yield hf_name(t.name), value

"""The random weights both sides of a latency run load, and their sizes.

Each shape is built once with backplane's fixed-seed initialisation and saved
as a Hugging Face folder (``config.json`` + safetensors), which backplane's
loader and ``transformers`` both read; :class:`WeightsInfo` keeps the sizes
the memory floor is computed from. A model directory given as a shape is used
as it is, its sizes read from its safetensors headers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backplane.cli.bench.latency.settings import FAMILIES, PAGE_SIZE


@contextlib.contextmanager
def _registered_preset(name: str, config: dict[str, Any]) -> Iterator[str]:
    """Make ``config`` buildable as a preset (random weights) for the duration.

    :param name: the shape's name; a preset of that name is replaced, then restored.
    :param config: its HF config dict.
    :return: (yields) the preset name to build.
    """
    from backplane.models import presets

    key = name if name in presets.PRESETS else f"bench-{name}"
    saved = presets.PRESETS.get(key)
    presets.PRESETS[key] = config
    try:
        yield key
    finally:
        if saved is None:
            presets.PRESETS.pop(key, None)
        else:
            presets.PRESETS[key] = saved


@dataclass
class WeightsInfo:
    """What the memory floor needs to know about one saved model.

    :param folder: the HF folder (``config.json`` + ``model.safetensors``).
    :param params: parameters (experts included).
    :param weight_bytes: bytes of all weights as saved.
    :param embedding_bytes: bytes of the input embedding.
    :param embedding_row_bytes: bytes of one embedding row.
    :param lm_head_bytes: bytes of the LM head (the embedding if tied).
    :param tied: whether the LM head is the embedding.
    :param expert_bytes: bytes of all routed experts.
    :param num_experts: routed experts per MoE layer (0 without MoE).
    :param experts_per_token: experts each token is routed to.
    :param kv_bytes_per_token: paged KV bytes per token over all layers.
    :param state_bytes_per_seq: recurrent state bytes per sequence over all layers.
    """

    folder: str
    params: int
    weight_bytes: int
    embedding_bytes: int
    embedding_row_bytes: int
    lm_head_bytes: int
    tied: bool
    expert_bytes: int
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: float
    state_bytes_per_seq: int


def weights_workdir(stack: contextlib.ExitStack, weights_dir: str | None, prefix: str) -> str:
    """The folder random weights are saved to: ``weights_dir`` (made if missing, kept),
    or a temporary one removed when ``stack`` closes.

    :param stack: the caller's exit stack.
    :param weights_dir: ``--weights-dir``, or ``None``.
    :param prefix: the temporary folder's name prefix (the command's).
    :return: the folder's path.
    """
    if weights_dir:
        os.makedirs(weights_dir, exist_ok=True)
        return weights_dir
    return stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))


def _specs_bytes(specs: dict[str, dict[str, Any]]) -> int:
    """Bytes of every cache tensor in a model's ``cache_specs`` (layer -> name -> spec)."""
    return sum(spec.nbytes for layer in specs.values() for spec in layer.values())


def cache_sizes(model: Any, dtype: Any) -> tuple[float, int]:
    """KV bytes per token and recurrent-state bytes per sequence of ``model``, over all layers.

    :param model: a built ``CausalLM`` (its parameters may be on the ``meta`` device).
    :param dtype: the KV / conv cache ``torch.dtype``.
    :return: ``(kv_bytes_per_token, state_bytes_per_seq)``.
    """
    # as differences: one page more gives the KV bytes of PAGE_SIZE tokens,
    # one slot more the recurrent state of one sequence
    kw = {"page_size": PAGE_SIZE, "dtype": dtype}
    two = _specs_bytes(model.cache_specs(num_pages=2, num_slots=1, **kw))
    three = _specs_bytes(model.cache_specs(num_pages=3, num_slots=1, **kw))
    two_slots = _specs_bytes(model.cache_specs(num_pages=2, num_slots=2, **kw))
    return (three - two) / PAGE_SIZE, two_slots - two


_EXPERT = re.compile(r"\.experts\.(\d+)\.")
"""A routed expert's tensor in a checkpoint (``mlp.experts.3.up_proj.weight``); not shared experts."""


def folder_weights_info(folder: str | os.PathLike[str], dtype: Any) -> WeightsInfo:
    """The sizes the memory floor needs, for a Hugging Face folder backplane did not save.

    Tensor sizes come from the safetensors headers (no weight is read), counted
    in ``dtype`` because the engine holds them so; tensors the model ignores
    (e.g. multi-token-prediction layers) and a tied ``lm_head.weight`` are left
    out. Cache sizes come from the model built on the ``meta`` device.

    :param folder: a directory with ``config.json`` and safetensors files.
    :param dtype: the ``torch.dtype`` the benchmark runs in.
    :return: the sizes.
    :raises ConfigError: an unsupported architecture, or no readable safetensors.
    """
    import torch
    from safetensors import safe_open

    from backplane.engine.selection import select_backends_for
    from backplane.models.base import build_model
    from backplane.models.loader import read_config, weight_files
    from backplane.models.registry import model_class

    path = Path(folder)
    config = read_config(path)
    cls = model_class(config.get("architectures"))
    config = cls.normalize_config(config)
    backends = select_backends_for(dict.fromkeys(FAMILIES, "torch"), device="cpu")
    model = build_model(cls, config, backends, dtype=dtype, device="meta")
    element = torch.empty((), dtype=dtype).element_size()
    tied = bool(model.tie_word_embeddings)

    numels: dict[str, int] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                if model.checkpoint_to_module_name(key) is None:
                    continue
                if tied and key.endswith("lm_head.weight"):
                    continue
                numels[key] = math.prod(fh.get_slice(key).get_shape())
    experts = [(key, int(m.group(1))) for key in numels if (m := _EXPERT.search(key))]
    embedding = model.embed_tokens.weight
    head = embedding if tied else model.lm_head.weight
    kv_bytes_per_token, state_bytes_per_seq = cache_sizes(model, dtype)
    return WeightsInfo(
        folder=str(path),
        params=sum(numels.values()),
        weight_bytes=sum(numels.values()) * element,
        embedding_bytes=embedding.numel() * element,
        embedding_row_bytes=embedding.shape[1] * element,
        lm_head_bytes=head.numel() * element,
        tied=tied,
        expert_bytes=sum(numels[key] for key, _ in experts) * element,
        num_experts=max((i for _, i in experts), default=-1) + 1,
        experts_per_token=int(config.get("num_experts_per_tok") or 0),
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes_per_seq=state_bytes_per_seq,
    )


def gguf_weights_info(path: str | os.PathLike[str], dtype: Any) -> WeightsInfo:
    """The sizes the memory floor needs, for a GGUF file.

    Each tensor is counted as the engine holds it: the model is built on the
    ``meta`` device and given the quantised projections the loader keeps (read
    at their block size), every other tensor dequantised to ``dtype``. A tied
    LM head is the embedding and is not counted twice; routed experts, if any,
    are counted as dense weights (every one read each step).

    :param path: the ``.gguf`` file.
    :param dtype: the ``torch.dtype`` the benchmark runs in.
    :return: the sizes (``folder`` is the file, which ``LLM`` loads).
    :raises ConfigError: an unreadable file or an unsupported architecture.
    """
    import torch

    from backplane.engine.selection import select_backends_for
    from backplane.models.base import build_model
    from backplane.models.gguf import open_gguf_checkpoint
    from backplane.models.gguf.config import ROPE_FREQS_TENSOR
    from backplane.models.gguf.weights import hf_name
    from backplane.models.registry import model_class

    path = Path(path)
    ckpt = open_gguf_checkpoint(path)
    cls = model_class(ckpt.config.get("architectures"))
    config = cls.normalize_config(ckpt.config)
    backends = select_backends_for(dict.fromkeys(FAMILIES, "torch"), device="cpu")
    model = build_model(cls, config, backends, dtype=dtype, device="meta")
    ckpt.keep_quantized(model)
    element = torch.empty((), dtype=dtype).element_size()
    tied = bool(model.tie_word_embeddings)

    params = weight_bytes = 0
    for t in ckpt.file.tensors:
        if t.name == ROPE_FREQS_TENSOR:
            # read into the config's rope scaling once; no step reads it
            continue
        key = hf_name(t.name)
        if model.checkpoint_to_module_name(key) is None:
            continue
        if tied and key.endswith("lm_head.weight"):
            continue
        numel = math.prod(t.shape)
        params += numel
        weight_bytes += t.data.nbytes if t.name in ckpt.raw_tensors else numel * element
    embedding = model.embed_tokens.weight
    head = embedding if tied else model.lm_head.weight
    kv_bytes_per_token, state_bytes_per_seq = cache_sizes(model, dtype)
    return WeightsInfo(
        folder=str(path),
        params=params,
        weight_bytes=weight_bytes,
        embedding_bytes=embedding.numel() * element,
        embedding_row_bytes=embedding.shape[1] * element,
        lm_head_bytes=head.numel() * element,
        tied=tied,
        expert_bytes=0,
        num_experts=0,
        experts_per_token=int(config.get("num_experts_per_tok") or 0),
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes_per_seq=state_bytes_per_seq,
    )


def mtp_checkpoint_name(model: Any, target: str) -> str:
    """The checkpoint name of an MTP tensor, the inverse of the loader's mapping.

    DeepSeek-V3 stores MTP layer ``i`` as ``model.layers.{num_hidden_layers + i}``
    (its decoder block's tensors without ``block.``); Qwen3-Next keeps ``mtp.*``.

    :param model: the model, its MTP layers attached.
    :param target: the tensor's module path, ``mtp.…``.
    :return: the name the loader maps back to ``target``.
    :raises ValueError: when no known layout maps back to it.
    """
    from backplane.models.mtp import MTP_MODULE

    candidates = []
    m = re.match(rf"^{MTP_MODULE}\.layers\.(\d+)\.(?:block\.)?(.*)$", target)
    if m is not None:
        layer = int(model.config["num_hidden_layers"]) + int(m.group(1))
        candidates.append(f"model.layers.{layer}.{m.group(2)}")
    # last: names outside a layout's own are taken as they are by the loader
    candidates.append(target)
    for name in candidates:
        if model.checkpoint_to_module_name(name) == target:
            return name
    raise ValueError(f"no checkpoint name of MTP tensor {target!r} maps back to it")


def _saved_before(folder: Path, config: dict[str, Any]) -> bool:
    """Whether ``folder`` already holds these random weights (its config.json equals ``config``)."""
    try:
        return (folder / "model.safetensors").is_file() and json.loads(
            (folder / "config.json").read_text()
        ) == config
    except (OSError, ValueError):
        return False


def save_random_weights(
    name: str, config: dict[str, Any], folder: str | os.PathLike[str], dtype: Any
) -> WeightsInfo:
    """Build shape ``name`` with backplane's fixed-seed random weights and save it as an HF folder.

    The model is built on the CPU in ``dtype`` by a minimal engine (torch
    backends, two KV pages); its tensors are written under their checkpoint
    names, one tensor per routed expert, which is what both backplane's loader
    and ``transformers`` read.

    :param name: the shape's name (for the temporary preset).
    :param config: its HF config dict.
    :param folder: where to write ``config.json`` and ``model.safetensors``.
    :param dtype: the ``torch.dtype`` of the saved weights.
    :return: sizes the memory floor needs.
    """
    import torch
    from safetensors.torch import save_file

    from backplane import LLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).replace("torch.", "")
    saved_config = dict(config)
    saved_config["dtype"] = dtype_name
    if _saved_before(folder, saved_config):
        # the same shape, seed and dtype give the same weights: a kept folder is reused
        return folder_weights_info(folder, dtype)
    from backplane.models.mtp import MTP_MODULE, num_mtp_layers

    # a shape that declares MTP layers is saved with them, for speculative method mtp;
    # the target's own weights are the same either way (the presets draw them apart)
    with_mtp = num_mtp_layers(config) > 0
    with _registered_preset(name, config) as key:
        llm = LLM(
            key,
            device="cpu",
            dtype=dtype_name,
            max_num_seqs=1,
            max_num_tokens=1,
            num_kv_pages=2,
            enable_prefix_caching=False,
            backends=dict.fromkeys(FAMILIES, "torch"),
            speculative_config=(
                {"method": "mtp", "num_speculative_tokens": 1} if with_mtp else None
            ),
        )
    model = llm.engine.model
    del llm
    prefixes = list(getattr(model, "checkpoint_prefixes", ()))
    embedding = model.embed_tokens.weight
    tied = bool(model.tie_word_embeddings)
    head = embedding if tied else model.lm_head.weight

    tensors: dict[str, torch.Tensor] = {}
    mtp_tensors: dict[str, torch.Tensor] = {}
    expert_bytes = 0
    num_experts = 0
    for target, (tensor, index) in model.weight_targets().items():
        if target.startswith(f"{MTP_MODULE}."):
            part = tensor if index is None else tensor[index]
            mtp_tensors[mtp_checkpoint_name(model, target)] = part.detach().contiguous().clone()
            continue
        ckpt = target
        for ckpt_prefix, module_prefix in prefixes:
            if target.startswith(module_prefix):
                ckpt = ckpt_prefix + target[len(module_prefix) :]
                break
        part = tensor if index is None else tensor[index]
        # clone: safetensors refuses tensors sharing storage (the stacked experts)
        tensors[ckpt] = part.detach().contiguous().clone()
        if index is not None:
            expert_bytes += part.numel() * part.element_size()
            num_experts = max(num_experts, int(tensor.shape[0]))
    # the config last: a folder whose config.json matches holds its whole safetensors file
    (folder / "config.json").unlink(missing_ok=True)
    # the MTP layers are not part of the sizes: the floor is the target's decode step
    save_file(
        {**tensors, **mtp_tensors}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps(saved_config, indent=1))

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    kv_bytes_per_token, state_bytes_per_seq = cache_sizes(model, dtype)
    info = WeightsInfo(
        folder=str(folder),
        params=sum(t.numel() for t in tensors.values()),
        weight_bytes=sum(nbytes(t) for t in tensors.values()),
        embedding_bytes=nbytes(embedding),
        embedding_row_bytes=embedding.shape[1] * embedding.element_size(),
        lm_head_bytes=nbytes(head),
        tied=tied,
        expert_bytes=expert_bytes,
        num_experts=num_experts,
        experts_per_token=int(config.get("num_experts_per_tok") or 0),
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes_per_seq=state_bytes_per_seq,
    )
    del model, tensors, mtp_tensors
    gc.collect()
    return info

"""The causal-LM base class every architecture derives from.

A model is built from its HF ``config.json`` (as a :class:`ModelConfig`) and
the backends of the op families it uses. It computes on the flat ragged token
layout: ``forward(input_ids [T], positions [T]) -> hidden [T, H]`` inside a
:func:`~backplane.core.forward_context.forward_context`, and the caller gathers
the rows it needs before :meth:`CausalLM.compute_logits`.

Weights are created uninitialised (usually on the ``meta`` device, then given
storage by :func:`~backplane.models.meta_init.materialize`) and filled by the
loader through :meth:`CausalLM.weight_targets` / :meth:`CausalLM.load_weights`,
or with random values by :meth:`CausalLM.init_random_weights_`. Projections that read the same
input are merged into one parameter
(:class:`~backplane.models.linear.MergedLinear`, the stacked MoE experts); the
checkpoint's separate tensors load into their row slices.

Decoder layers pass ``(hidden, residual)`` along: each layer adds its input to
the residual stream inside its first norm
(:meth:`~backplane.models.norm.RMSNorm.add_and_norm`), and rotary ``cos``/``sin``
are gathered once per forward and handed to every layer.

The elementwise work of the layers (norms, activations, rotary) runs as plain
torch ops or as Triton kernels (:mod:`backplane.models.fused`); a model starts
with torch and :meth:`CausalLM.set_fused_ops` switches every layer at once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.layouts import TensorSpec
from backplane.core.parallel import tensor_parallel
from backplane.models.fused import check_fused_ops
from backplane.models.linear import Linear, MergedLinear, can_pack, dense, pack_weight
from backplane.models.meta_init import materialize, skip_meta_init
from backplane.models.mixers import AttentionMixer, CachedMixer
from backplane.models.moe import MoE
from backplane.models.norm import RMSNorm
from backplane.models.parallel import (
    ParamShard,
    ShardSlice,
    lm_head,
    module_shards,
    vocab_parallel_embedding,
)
from backplane.models.rotary import RopeCosSin, RotaryEmbedding, rope_parameters

logger = logging.getLogger(__name__)


def attention_head_dim(config: ModelConfig) -> int:
    """``head_dim`` from the config, or ``hidden_size // num_attention_heads``.

    :param config: the HF config.
    """
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


class ModelConfig(dict):
    """An HF ``config.json`` as a dict with defaults and a readable error for missing keys."""

    def get(self, key: str, default: Any = None) -> Any:  # noqa: D102 - dict.get semantics
        value = super().get(key, default)
        return default if value is None else value

    def require(self, key: str) -> Any:
        """Return ``self[key]``.

        :raises MissingConfigKeyError: naming the key and the model type when it is missing.
        """
        value = super().get(key)
        if value is None:
            raise MissingConfigKeyError(self, key)
        return value

    def __missing__(self, key: str) -> Any:
        # ``config["x"]`` in model code: a missing key is a user's config error, not a KeyError.
        raise MissingConfigKeyError(self, key)

    @property
    def architecture(self) -> str:
        """The first entry of ``architectures`` (empty string when absent)."""
        archs = self.get("architectures") or []
        return archs[0] if archs else ""


class MissingConfigKeyError(ConfigError, KeyError):
    """A key the model needs is missing from its config.

    Also a ``KeyError``, so code that probes ``config[key]`` keeps working.

    :param config: the config that lacks it.
    :param key: the missing key (the loader adds the file it read).
    """

    def __init__(self, config: ModelConfig, key: str) -> None:
        super().__init__(f"config of {config.get('model_type', 'this model')!r} lacks {key!r}")
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])


class WeightLoadError(ConfigError):
    """The checkpoint does not match the model (missing, unexpected or mis-shaped tensors).

    :param message: what is wrong.
    :param tensor: the checkpoint tensor at fault, when there is one (the loader
        adds the file it came from to the message).
    """

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class CachedModule(nn.Module):
    """A module whose :class:`CachedMixer` layers hold caches: it describes, binds and allocates them.

    The base of :class:`CausalLM` and of the next-token-prediction layers
    (:class:`~backplane.models.mtp.MultiTokenPredictor`), whose caches are described
    and allocated alike.
    """

    def cached_layers(self) -> Iterator[tuple[str, CachedMixer]]:
        """Yield ``(layer name, mixer)`` for every layer that owns caches."""
        for name, m in self.named_modules():
            if isinstance(m, CachedMixer):
                yield name, m

    def cache_specs(
        self, *, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype
    ) -> dict[str, dict[str, TensorSpec]]:
        """Describe every cache tensor the model needs.

        :param num_pages: KV pages per layer (page 0 included, reserved).
        :param page_size: tokens per page.
        :param num_slots: recurrent-state slots (slot 0 included, reserved).
        :param dtype: the KV / conv cache dtype (SSM and delta states are float32).
        :return: ``{layer name: {cache name: spec}}``.
        """
        return {
            name: m.cache_specs(
                num_pages=num_pages, page_size=page_size, num_slots=num_slots, dtype=dtype
            )
            for name, m in self.cached_layers()
        }

    def bind_caches(self, caches: dict[str, dict[str, torch.Tensor]]) -> None:
        """Hand the allocated caches to the layers.

        :param caches: ``{layer name: {cache name: tensor}}`` shaped as :meth:`cache_specs` said.
        :raises ConfigError: when a layer's caches are missing.
        """
        for name, m in self.cached_layers():
            if name not in caches:
                raise ConfigError(f"bind_caches: no caches for layer {name!r}")
            m.bind_caches(caches[name])

    def allocate_caches(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Allocate (zeroed) and bind every cache; convenient for tests and tools.

        :return: the allocated caches, as passed to :meth:`bind_caches`.
        """
        specs = self.cache_specs(
            num_pages=num_pages, page_size=page_size, num_slots=num_slots, dtype=dtype
        )
        caches = {
            layer: {n: s.allocate(device) for n, s in layer_specs.items()}
            for layer, layer_specs in specs.items()
        }
        self.bind_caches(caches)
        return caches


class CausalLM(CachedModule):
    """Base of all backplane causal language models.

    Subclasses build ``self.embed_tokens``, ``self.lm_head`` (or tie it), the
    layers and ``self.final_norm``, set :attr:`families`, and implement
    :meth:`forward`. Checkpoint names are the module paths, except where
    :attr:`checkpoint_prefixes` rewrites prefixes and :class:`MoE` stacks
    per-expert tensors.

    :param config: the HF config.
    :param backends: ``{family: backend object}`` for every family in :attr:`families`.
    """

    #: op families the architecture may use (the instance narrows it to what its layers use)
    families: set[str]
    #: names of checkpoint tensors that are expected and ignored (regexes), e.g. MTP heads
    ignored_checkpoint_patterns: ClassVar[tuple[str, ...]] = ()
    #: ``(checkpoint prefix, module prefix)`` rewrites applied to checkpoint names
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: who runs the layers' fused elementwise work (set by :meth:`set_fused_ops`)
    fused_ops: str = "torch"
    #: the tied LM head (the embedding matrix) packed by :meth:`pack_weights_for_cpu`
    packed_tied_head: torch.Tensor | None = None

    def __init__(self, config: ModelConfig, backends: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.backends = dict(backends)
        self.vocab_size = int(config.require("vocab_size"))
        self.max_model_len = int(config.get("max_position_embeddings", 4096))
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.eos_token_ids = _eos_ids(config.get("eos_token_id"))
        #: the tensor-parallel group the layers are split over (one rank by default)
        self.tp = tensor_parallel()
        #: sampling defaults of the checkpoint (``generation_config.json``), filled by the loader
        self.generation_defaults: dict[str, Any] = {}

    # -- construction helpers ------------------------------------------------
    @classmethod
    def normalize_config(cls, config: ModelConfig) -> ModelConfig:
        """Return the config the implementation reads (e.g. a nested ``text_config`` lifted).

        :param config: the ``config.json`` as read.
        """
        return config

    def backend(self, family: str) -> Any:
        """Return the backend of ``family``.

        :raises ConfigError: when none was given.
        """
        try:
            return self.backends[family]
        except KeyError:
            raise ConfigError(
                f"{type(self).__name__} needs a {family!r} backend; got backends for "
                f"{sorted(self.backends) or 'no family'}"
            ) from None

    def _finish_init(self, hidden_size: int) -> None:
        """Build ``lm_head`` (unless tied) and derive :attr:`families` and :attr:`has_recurrent_state`.

        Called by subclasses once their layers are built.

        :param hidden_size: the width of the final hidden states ``lm_head`` reads.
        """
        if not self.tie_word_embeddings:
            self.lm_head = lm_head(hidden_size, self.vocab_size, tp=self.tp)
        fams: set[str] = set()
        for m in self.modules():
            if isinstance(m, CachedMixer):
                fams.update(m.families)
        self.families = fams
        self.has_recurrent_state = bool(fams & {"ssm", "delta"})

    def set_fused_ops(self, impl: str) -> str:
        """Set who runs the fused elementwise work of every layer (norms, activations, rotary).

        Every module with a ``fused_ops`` attribute (the model's own included)
        gets ``impl``, and then its ``prepare_fused_ops()`` runs where it has
        one (GGUF projections repack their weights for the Triton kernels);
        call it before any CUDA graph is captured. With Triton, the projections
        (:class:`~backplane.models.linear.Linear`) also run their one-row
        products on CUDA with the split-K GEMV where it is faster than cuBLAS.

        :param impl: ``"torch"`` or ``"triton"``, as chosen by
            :func:`backplane.engine.selection.select_fused_ops` (which resolves
            ``"auto"``) for the device the model's parameters are on.
        :return: the implementation now in use.
        :raises ConfigError: for ``"triton"`` where the Triton kernels cannot
            run, or a value other than the two (see
            :func:`~backplane.models.fused.check_fused_ops`).
        """
        device = next(self.parameters()).device
        check_fused_ops(impl, device)
        for m in self.modules():
            if isinstance(getattr(type(m), "fused_ops", None), str):
                m.fused_ops = impl
                prepare = getattr(m, "prepare_fused_ops", None)
                if prepare is not None:
                    prepare()
        logger.info("fused elementwise ops: %s (device %s)", impl, device)
        return impl

    def pack_weights_for_cpu(self, rows: int) -> int:
        """Pack every projection and the LM head for oneDNN (CPU float32 inference only).

        Each :class:`~backplane.models.linear.Linear` keeps its weight in
        oneDNN's blocked layout, which its decode-sized products read about
        twice as fast; the plain copy is freed unless another parameter shares
        its memory. A tied LM head packs a copy of the embedding matrix (the
        lookup still reads the plain one). Call it once the weights are loaded
        and final; afterwards the model is for inference only.

        :param rows: the typical number of rows per product (the decode batch size).
        :return: how many weights were packed (0 off CPU, in other dtypes, or
            without oneDNN).
        """
        params = [p for _, p in self.named_parameters(remove_duplicate=False)]
        if not params or not can_pack(next(p for p in params if p.dim() == 2)):
            return 0
        users: dict[int, int] = {}
        for p in params:
            users[p.data_ptr()] = users.get(p.data_ptr(), 0) + 1
        packed = 0
        for m in self.modules():
            if isinstance(m, Linear):
                packed += m.pack(rows, release=users[m.weight.data_ptr()] == 1)
        if self.tie_word_embeddings and can_pack(self.embed_tokens.weight):
            self.packed_tied_head = pack_weight(self.embed_tokens.weight, rows)
            packed += 1
        logger.info(
            "packed %d weights into oneDNN's blocked layout for %d-row products", packed, rows
        )
        return packed

    # -- the step --------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the model over the flat token batch of the active forward context.

        :param input_ids: ``[T]`` int64 token ids (padded rows included).
        :param positions: ``[T]`` int64 positions.
        :return: final-normalised hidden states ``[T, hidden]``.
        """
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states (already gathered, e.g. last token per sequence) to logits.

        :param hidden: ``[N, hidden]``.
        :return: ``[N, vocab_size]`` logits in float32 (of the full vocabulary
            on every tensor-parallel rank).
        """
        if self.tie_word_embeddings:
            logits = dense(hidden, self.embed_tokens.weight, packed=self.packed_tied_head)
            # A split embedding holds this rank's vocabulary rows: its logits are a slice.
            return self.tp.all_gather(logits, dim=-1).float()
        return self.lm_head(hidden).float()

    # -- caches ------------------------------------------------------------------
    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """After a speculative verification step, keep each sequence's state at its accepted token.

        Every layer with per-slot recurrent state (conv, SSM, delta) copies the
        states of ``src_slots`` into ``dst_slots``; attention layers have
        nothing to copy. Call it once the accepted counts are known and before
        the next step runs (the copies are queued on the device in order).

        :param src_slots: ``[V]`` slots holding the states to keep, from
            :meth:`~backplane.core.metadata.VerifyStates.keep_slots`.
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        # walking the module tree costs ~1 ms a step: the layers are listed once
        layers = self.__dict__.get("_cached_mixers")
        if layers is None:
            layers = [m for _, m in self.cached_layers()]
            object.__setattr__(self, "_cached_mixers", layers)
        for mixer in layers:
            mixer.keep_verified_states(src_slots, dst_slots)

    # -- weights -------------------------------------------------------------------
    def checkpoint_to_module_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to a module path (``None``: ignored tensor)."""
        for pattern in self.ignored_checkpoint_patterns:
            if re.match(pattern, name):
                return None
        for ckpt, mod in self.checkpoint_prefixes:
            if name.startswith(ckpt):
                return mod + name[len(ckpt) :]
        return name

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Return every tensor the checkpoint must provide and where it goes.

        :return: ``{checkpoint-side module name: (target tensor, expert index or None)}``;
            the checkpoint tensor is copied into ``target`` (or ``target[index]``).
            A target may be a view: a row slice of a merged projection
            (``self_attn.k_proj.weight`` -> rows of ``self_attn.qkv_proj.weight``)
            or of stacked experts (``mlp.experts.3.up_proj.weight`` -> expert 3
            of ``mlp.experts_gate_up[:, I:]``).
        """
        targets: dict[str, tuple[torch.Tensor, int | None]] = {}
        tied = {"lm_head.weight"} if self.tie_word_embeddings else set()
        for name, p in self.named_parameters():
            if name in tied:
                continue
            targets[name] = (p, None)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                targets[name] = (b, None)
        for mod_name, m in self.named_modules():
            if isinstance(m, MergedLinear):
                parent = mod_name.rpartition(".")[0]
                prefix = f"{parent}." if parent else ""
                for leaf, _ in m.named_parameters(recurse=False):
                    targets.pop(f"{mod_name}.{leaf}", None)
                for name, view in m.checkpoint_slices():
                    targets[prefix + name] = (view, None)
            elif isinstance(m, MoE):
                for name, stacked, view, e in m.expert_slices():
                    targets.pop(f"{mod_name}.{stacked}", None)
                    targets[f"{mod_name}.{name}"] = (view, e)
        return targets

    def param_shards(self) -> dict[str, ParamShard]:
        """Say how each tensor-parallel parameter is cut from the full one.

        :return: ``{parameter name: shard}`` for the parameters this rank holds
            a slice of (empty with one rank).
        """
        return {
            f"{mod_name}.{leaf}" if mod_name else leaf: shard
            for mod_name, m in self.named_modules()
            for leaf, shard in module_shards(m).items()
        }

    def weight_shards(self) -> dict[str, ShardSlice | ParamShard]:
        """Say which slice of each checkpoint tensor this rank holds.

        :return: ``{name as in weight_targets: slice of the checkpoint tensor}``
            for every target this rank holds only part of (empty with one rank).
        """
        shards: dict[str, ShardSlice | ParamShard] = {}
        if not self.tp.enabled:
            return shards
        for mod_name, m in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            if isinstance(m, MergedLinear):
                parent = mod_name.rpartition(".")[0]
                sibling = f"{parent}." if parent else ""
                for leaf, layout in module_shards(m).items():
                    for name, (_, _, part) in zip(m.part_names, layout.part_slices(), strict=True):
                        if part.part.size != part.part.total:
                            shards[f"{sibling}{name}.{leaf}"] = part
            elif isinstance(m, MoE):
                shards.update({prefix + k: v for k, v in m.expert_shards().items()})
            else:
                for leaf, layout in module_shards(m).items():
                    if layout.sharded and len(layout.parts) == 1:
                        shards[prefix + leaf] = ShardSlice(layout.dim, layout.parts[0])
                    elif layout.sharded:
                        # Slices of several parts of one tensor (Mamba2's in_proj): cut whole.
                        shards[prefix + leaf] = layout
        return shards

    def checkpoint_shard(self, ckpt_name: str) -> ShardSlice | None:
        """The slice of checkpoint tensor ``ckpt_name`` this rank loads (for reading only that).

        :param ckpt_name: a tensor name as the checkpoint spells it.
        :return: its slice, or ``None`` where the rank loads all of it (or ignores it).
        """
        shards = self.__dict__.get("_checkpoint_shards")
        if shards is None:
            shards = self.__dict__["_checkpoint_shards"] = self.weight_shards()
        name = self.checkpoint_to_module_name(ckpt_name)
        shard = None if name is None else shards.get(name)
        # A shard of several slices is read whole and cut by load_weights.
        return shard if isinstance(shard, ShardSlice) else None

    def load_weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
    ) -> dict[str, list[str]]:
        """Copy checkpoint tensors into the model.

        :param tensors: ``(checkpoint name, tensor)`` pairs (any dtype/device; cast on copy).
            On a tensor-parallel rank a tensor may be whole (this rank's slice
            is taken, see :meth:`weight_shards`) or already the slice.
        :param strict: raise when tensors are missing or unexpected.
        :return: ``{"missing": [...], "unexpected": [...], "ignored": [...]}``.
        :raises WeightLoadError: on a shape mismatch, or (strict) missing/unexpected names.
        """
        targets = self.weight_targets()
        shards = self.weight_shards()
        seen: set[str] = set()
        unexpected: list[str] = []
        ignored: list[str] = []
        tied_head = self.tie_word_embeddings
        with torch.no_grad():
            for ckpt_name, tensor in tensors:
                name = self.checkpoint_to_module_name(ckpt_name)
                if name is None or (tied_head and name == "lm_head.weight"):
                    ignored.append(ckpt_name)
                    continue
                target = targets.get(name)
                if target is None:
                    unexpected.append(ckpt_name)
                    continue
                dest, index = target
                if index is not None:
                    dest = dest[index]
                shard = shards.get(name)
                expected = tuple(dest.shape) if shard is None else shard.full_shape(dest.shape)
                if shard is not None and tuple(tensor.shape) == expected:
                    tensor = shard.take(tensor)
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise WeightLoadError(
                        f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the model "
                        f"expects {expected} for {name!r}; config.json and the weights disagree",
                        tensor=ckpt_name,
                    )
                dest.copy_(tensor)
                seen.add(name)
        missing = sorted(set(targets) - seen)
        report = {"missing": missing, "unexpected": sorted(unexpected), "ignored": sorted(ignored)}
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing tensors ({len(missing)}): {', '.join(_abbrev(missing))}")
            if unexpected:
                parts.append(
                    f"unexpected tensors ({len(unexpected)}): {', '.join(_abbrev(sorted(unexpected)))}"
                )
            raise WeightLoadError(
                f"weights do not match {type(self).__name__}: "
                + "; ".join(parts)
                + ". Check that config.json belongs to these safetensors files."
            )
        self.finalize_weights()
        return report

    def finalize_weights(self) -> None:
        """Recompute derived buffers after the weights changed (rotary tables, MLA splits)."""
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.reset_buffers_()
            fin = getattr(m, "finalize_weights", None)
            if fin is not None and m is not self:
                fin()

    def init_random_weights_(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every weight with reproducible random values (presets, tests).

        Linear/embedding weights ~ N(0, std); norm weights at identity scale;
        Mamba/delta parameters in their usual ranges; router biases small.
        A tensor-parallel rank draws each full tensor and keeps its slice, so
        the ranks together hold the weights one rank would.

        :param seed: the generator seed.
        :param std: standard deviation of matrix weights.
        """
        g = torch.Generator().manual_seed(seed)
        shards = self.param_shards()
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                shard = shards.get(name)
                shape = p.shape if shard is None else shard.full_shape(p.shape)
                if leaf == "A_log":
                    vals = torch.log(torch.rand(shape, generator=g) * 15 + 1)
                elif leaf == "dt_bias":
                    vals = torch.rand(shape, generator=g) * 0.5 + 0.5
                elif leaf == "D":
                    vals = torch.ones(shape)
                elif p.dim() == 1 and ("norm" in name or "layernorm" in name):
                    zc = _is_zero_centered(self, name)
                    vals = torch.zeros(shape) if zc else torch.ones(shape)
                elif leaf == "bias":
                    vals = torch.zeros(shape)
                else:
                    vals = torch.randn(shape, generator=g) * std
                if shard is not None:
                    vals = shard.take(vals)
                p.copy_(vals.to(p.dtype))
            for name, b in self.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_((torch.rand(b.shape, generator=g) * 0.01).to(b.dtype))
        self.finalize_weights()


def _is_zero_centered(model: nn.Module, param_name: str) -> bool:
    mod_name = param_name.rsplit(".", 1)[0]
    mod = model.get_submodule(mod_name)
    return bool(getattr(mod, "zero_centered", False))


def _abbrev(names: list[str], limit: int = 20) -> list[str]:
    if len(names) <= limit:
        return names
    return names[:limit] + [f"... and {len(names) - limit} more"]


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def build_model(
    cls: type[CausalLM],
    config: ModelConfig,
    backends: dict[str, Any],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> CausalLM:
    """Construct ``cls`` without initialising weights, directly in ``dtype`` on ``device``.

    Parameters are created on the ``meta`` device and given uninitialised storage
    (:func:`~backplane.models.meta_init.materialize`, as ``to_empty`` does), so no
    memory or time is spent on values the loader overwrites.
    Float32-only buffers (router correction biases) stay float32.
    """
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"), skip_meta_init():
            model = cls(config, backends)
    finally:
        torch.set_default_dtype(prev)
    model = materialize(model, device)
    model.eval()
    model.requires_grad_(False)
    return model


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``.

    The residual additions are fused into the norms: the layer takes the
    previous layer's output and the residual stream, and returns its own
    output (the MLP's, not yet added) and the residual stream.

    :param mixer_name: attribute (and checkpoint) name of the mixer
        (``self_attn`` or ``linear_attn``).
    :param mixer: the token mixer, called as ``mixer(positions, x, rope)``.
    :param mlp: the feed-forward block (dense or MoE).
    :param hidden_size: model width.
    :param eps: norm epsilon.
    :param zero_centered: norms store ``w - 1`` (Qwen3-Next, Qwen3.5).
    """

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        zero_centered: bool = False,
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, zero_centered=zero_centered)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, zero_centered=zero_centered)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeCosSin | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the layer.

        :param positions: ``[T]`` token positions.
        :param x: ``[T, hidden]``: the previous layer's output, or the embeddings
            for the first layer.
        :param residual: the residual stream ``[T, hidden]``; ``None`` for the
            first layer (the stream starts at ``x``).
        :param rope: the forward's rotary ``cos``/``sin``, or ``None``.
        :return: ``(output, residual)``; the layer's full result is their sum.
        """
        mixer = getattr(self, self.mixer_name)
        fused = self.input_layernorm.project_input(x, residual, mixer, rope)
        if fused is None:
            h, residual = self.input_layernorm.norm_input(x, residual)
            h = mixer(positions, h, rope)
        else:
            projected, residual = fused
            h = mixer(positions, None, rope, projected=projected)
        fused = self.post_attention_layernorm.project_input(h, residual, self.mlp)
        if fused is None:
            h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
            return self.mlp(h), residual
        projected, residual = fused
        return self.mlp(None, projected=projected), residual


class DecoderOnlyLM(CausalLM):
    """A ``model.embed_tokens -> model.layers -> model.norm -> lm_head`` language model.

    Subclasses implement :meth:`build_layer` (setting ``self.rotary`` when
    layers use one); :attr:`zero_centered_norms` selects the ``1 + w`` RMS norm.
    """

    zero_centered_norms: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, backends: dict[str, Any]) -> None:
        super().__init__(config, backends)
        hidden = int(config.require("hidden_size"))
        self.hidden_size = hidden
        self.norm_eps = float(config.get("rms_norm_eps", 1e-6))
        self.num_layers = int(config.require("num_hidden_layers"))
        self.model = nn.Module()
        self.model.embed_tokens = vocab_parallel_embedding(self.vocab_size, hidden, tp=self.tp)
        self.model.layers = nn.ModuleList([self.build_layer(i) for i in range(self.num_layers)])
        self.model.norm = RMSNorm(hidden, self.norm_eps, zero_centered=self.zero_centered_norms)
        self._finish_init(hidden)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The input embedding."""
        return self.model.embed_tokens

    def build_layer(self, layer_id: int) -> nn.Module:
        """Build decoder layer ``layer_id``."""
        raise NotImplementedError

    def attention_mixer(self, layer_id: int, **options: Any) -> AttentionMixer:
        """Build layer ``layer_id``'s GQA attention from the config's standard fields.

        Heads, KV heads, head dimension and ``attention_bias`` come from the
        config; every attention layer shares one rotary embedding (``self.rotary``,
        built by the first), of the head dimension scaled by the config's
        ``partial_rotary_factor``.

        :param layer_id: index of the layer.
        :param options: further :class:`AttentionMixer` keywords (``qk_norm``,
            ``output_gate``, ``sliding_window``).
        :return: the mixer.
        """
        cfg = self.config
        head_dim = attention_head_dim(cfg)
        if not hasattr(self, "rotary"):
            params = rope_parameters(cfg)
            rot = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
            self.rotary = RotaryEmbedding(rot, params, self.max_model_len)
        return AttentionMixer(
            layer_id,
            self.backend("attention"),
            self.hidden_size,
            int(cfg["num_attention_heads"]),
            int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
            head_dim,
            bias=bool(cfg.get("attention_bias", False)),
            norm_eps=self.norm_eps,
            rotary=self.rotary,
            **options,
        )

    def checkpoint_to_module_name(self, name: str) -> str | None:
        """Ignore multi-token-prediction layers stored past the last decoder layer."""
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m is not None and int(m.group(1)) >= self.num_layers:
            return None
        return super().checkpoint_to_module_name(name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embed, gather the rotary ``cos``/``sin`` once, run every layer, apply the final norm."""
        x = self.model.embed_tokens(input_ids)
        rotary = getattr(self, "rotary", None)
        rope = rotary.cos_sin(positions, x.dtype) if rotary is not None else None
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, rope)
        if residual is None:
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

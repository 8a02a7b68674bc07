"""Multi-token-prediction (MTP) layers: a model's own draft heads for speculative decoding.

An MTP layer takes the target's hidden state ``h_i`` at position ``i`` and the
embedding of the token at ``i + 1`` and predicts the token at ``i + 2``: both
inputs are RMS-normalised, concatenated (embedding first), projected back to
the hidden width and run through one full decoder block; the result goes
through a norm and an LM head. For more than one draft token the layer is
applied again to its own output and the embedding of its own prediction,
cycling through the layers when there are several (as vLLM does).

Two checkpoint layouts:

- DeepSeek-V3 (``num_nextn_predict_layers``): layer ``i`` is stored as
  ``model.layers.{num_hidden_layers + i}.*`` with ``enorm``, ``hnorm``,
  ``eh_proj``, ``embed_tokens``, ``shared_head.norm``, ``shared_head.head`` and
  the decoder block's own tensors (``self_attn``, ``mlp``, its two norms).
  The layer returns the hidden state before ``shared_head.norm``.
- Qwen3-Next / Qwen3.5 (``mtp_num_hidden_layers``): ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.{i}``
  (full-attention decoder blocks) and ``mtp.norm``; the target's embedding and
  LM head are shared. The layer returns the hidden state after ``mtp.norm``.

The layers are built only when speculation asks for them (:func:`attach_mtp`);
they become the target's ``mtp`` submodule, so the loader, random
initialisation and dtype/device moves treat them as model weights. Their
attention layers own caches of their own: :meth:`MultiTokenPredictor.cache_specs`
describes them, and the target's :meth:`~backplane.models.base.CausalLM.cached_layers`
leaves them out (the MTP proposer allocates and fills them, not the engine).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.models.base import CachedModule, CausalLM, DecoderLayer, ModelConfig, build_model
from backplane.models.linear import Linear
from backplane.models.mixers import CachedMixer
from backplane.models.norm import RMSNorm

__all__ = [
    "DeepseekMTP",
    "MTPHost",
    "MultiTokenPredictor",
    "Qwen3NextMTP",
    "attach_mtp",
    "num_mtp_layers",
]

#: the module name of the MTP layers inside the target model
MTP_MODULE = "mtp"


def num_mtp_layers(config: ModelConfig) -> int:
    """How many MTP layers a checkpoint's config declares.

    :param config: the HF config.
    :return: ``num_nextn_predict_layers`` (DeepSeek-V3) or ``mtp_num_hidden_layers``
        (Qwen3-Next, Qwen3.5); 0 when neither is set.
    """
    return int(config.get("num_nextn_predict_layers", 0) or config.get("mtp_num_hidden_layers", 0))


class MultiTokenPredictor(CachedModule):
    """The MTP layers of one target model (base of the per-architecture layouts).

    :param target: the model the layers draft for (its config, rotary table and
        layer builders are reused; it is not stored as a submodule).
    :param num_layers: how many MTP layers to build.
    """

    def __init__(self, target: CausalLM, num_layers: int) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.hidden_size = int(target.config.require("hidden_size"))
        self.vocab_size = target.vocab_size
        # A plain attribute, not a submodule: the target holds this module, not the reverse.
        self.__dict__["target"] = target

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor of the MTP layers to its path under the target.

        :param name: the tensor name as the checkpoint spells it.
        :return: the module path (``mtp.…``), or ``None`` when the tensor is not an MTP one.
        """
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """Run MTP layer ``step % num_layers`` over a flat token batch of the active forward context.

        :param input_ids: ``[T]`` int64: the token after each hidden state's position.
        :param positions: ``[T]`` int64 positions (of the hidden states).
        :param hidden: ``[T, hidden]``: the target's hidden states (step 0) or
            this module's previous output.
        :param step: the draft step (0 for the first draft token).
        :return: ``[T, hidden]`` hidden states to feed :meth:`compute_logits` and the next step.
        """
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Project the output of :meth:`forward` to float32 logits ``[N, vocab]``.

        :param hidden: ``[N, hidden]`` rows of :meth:`forward`'s output.
        :param step: the draft step that produced them.
        :return: the logits.
        """
        raise NotImplementedError

    def _block(self, i: int) -> DecoderLayer:
        raise NotImplementedError

    def _run_block(
        self, i: int, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.__dict__["target"]
        rotary = getattr(target, "rotary", None)
        rope = rotary.cos_sin(positions, x.dtype) if rotary is not None else None
        return self._block(i)(positions, x, None, rope)


class _DeepseekMTPLayer(nn.Module):
    """One DeepSeek-V3 MTP layer: norms, the input projection, a decoder block and its head."""

    def __init__(self, target: Any, layer_id: int) -> None:
        super().__init__()
        hidden, vocab, eps = target.hidden_size, target.vocab_size, target.norm_eps
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.block = target.build_layer(layer_id)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)
        self.shared_head.head = Linear(hidden, vocab, bias=False)


class DeepseekMTP(MultiTokenPredictor):
    """DeepSeek-V3's ``num_nextn_predict_layers`` MTP layers (MLA + MoE blocks).

    :param target: the DeepSeek-V3 model.
    :param num_layers: how many layers to build.
    """

    _OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")

    def __init__(self, target: CausalLM, num_layers: int) -> None:
        super().__init__(target, num_layers)
        self.first_layer = int(target.config.require("num_hidden_layers"))
        self.layers = nn.ModuleList(
            [_DeepseekMTPLayer(target, self.first_layer + i) for i in range(num_layers)]
        )

    def checkpoint_name(self, name: str) -> str | None:
        """``model.layers.{N + i}.X`` -> ``mtp.layers.{i}.X`` (the block's tensors under ``block.``)."""
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
        if m is None:
            return None
        i = int(m.group(1)) - self.first_layer
        if not 0 <= i < self.num_layers:
            return None
        rest = m.group(2)
        if not rest.startswith(self._OWN):
            rest = "block." + rest
        return f"{MTP_MODULE}.layers.{i}.{rest}"

    def _block(self, i: int) -> DecoderLayer:
        return self.layers[i].block

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:  # noqa: D102 - documented on the base class
        i = step % self.num_layers
        layer = self.layers[i]
        emb = layer.embed_tokens(input_ids)
        # Position 0 has no earlier token whose hidden state could have predicted it;
        # DeepSeek's MTP training masks its embedding, so inference does too.
        emb = emb.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1))
        out, residual = self._run_block(i, positions, x)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # noqa: D102
        head = self.layers[step % self.num_layers].shared_head
        return head.head(head.norm(hidden)).float()


class Qwen3NextMTP(MultiTokenPredictor):
    """Qwen3-Next / Qwen3.5 ``mtp.*`` layers (gated full attention blocks), sharing the target's
    embedding and LM head.

    :param target: the Qwen3-Next or Qwen3.5 model.
    :param num_layers: how many layers to build.
    """

    def __init__(self, target: CausalLM, num_layers: int) -> None:
        super().__init__(target, num_layers)
        t: Any = target
        hidden, eps = t.hidden_size, t.norm_eps
        first = int(target.config.require("num_hidden_layers"))
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(
                    "self_attn",
                    t.attention_mixer(first + i, qk_norm="rms_zero_centered", output_gate=True),
                    # The MoE / dense choice reads the index within the MTP layers, as vLLM's does.
                    t.build_mlp(i),
                    hidden,
                    eps,
                    True,
                )
                for i in range(num_layers)
            ]
        )
        self.norm = RMSNorm(hidden, eps, zero_centered=True)

    def checkpoint_name(self, name: str) -> str | None:
        """``mtp.X`` stays ``mtp.X``; other tensors are not MTP ones."""
        return name if name.startswith(f"{MTP_MODULE}.") else None

    def _block(self, i: int) -> DecoderLayer:
        return self.layers[i]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:  # noqa: D102 - documented on the base class
        i = step % self.num_layers
        emb = self.__dict__["target"].embed_tokens(input_ids)
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1)
        )
        out, residual = self._run_block(i, positions, x)
        return self.norm.add_and_norm(out, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # noqa: D102
        return self.__dict__["target"].compute_logits(hidden)


class MTPHost:
    """Mixin of architectures that may carry MTP layers (``mtp_class``).

    Without :func:`attach_mtp` the checkpoint's MTP tensors are ignored; with it
    they load into ``self.mtp``. The MTP layers' caches are never among the
    target's own (:meth:`cached_layers`): the MTP proposer owns them.
    """

    #: the layout of this architecture's MTP layers
    mtp_class: type[MultiTokenPredictor]

    def checkpoint_to_module_name(self, name: str) -> str | None:
        """Route MTP tensors to ``self.mtp`` when it is attached, else as the base class does."""
        mtp = getattr(self, MTP_MODULE, None)
        if isinstance(mtp, MultiTokenPredictor):
            mapped = mtp.checkpoint_name(name)
            if mapped is not None:
                return mapped
        return super().checkpoint_to_module_name(name)  # type: ignore[misc]

    def cached_layers(self) -> Iterator[tuple[str, CachedMixer]]:
        """The target's own cached layers, without the MTP layers'."""
        for name, m in super().cached_layers():  # type: ignore[misc]
            if not name.startswith(f"{MTP_MODULE}."):
                yield name, m


def attach_mtp(model: CausalLM) -> MultiTokenPredictor:
    """Build the MTP layers the model's config declares and make them ``model.mtp``.

    Call it after the model is built and before its weights are loaded (or
    randomly initialised); the layers are created in the model's dtype on its
    device, uninitialised.

    :param model: the target model.
    :return: the MTP layers (also ``model.mtp``).
    :raises ConfigError: when the architecture has no MTP layers or its config declares none.
    """
    existing = getattr(model, MTP_MODULE, None)
    if isinstance(existing, MultiTokenPredictor):
        return existing
    cls = getattr(type(model), "mtp_class", None)
    n = num_mtp_layers(model.config)
    if cls is None or n <= 0:
        raise ConfigError(
            f"speculative method 'mtp' needs multi-token-prediction layers, but "
            f"{type(model).__name__} "
            + (
                "has none in backplane"
                if cls is None
                else "declares none (config.json has no num_nextn_predict_layers / "
                "mtp_num_hidden_layers)"
            )
            + "; use method 'ngram' or 'draft_model' instead"
        )
    param = next(model.parameters())
    holder = _Builder(cls, model, n)
    built = build_model(holder.build, model.config, {}, dtype=param.dtype, device=param.device)
    mtp = built.mtp
    model.add_module(MTP_MODULE, mtp)
    return mtp


class _Builder:
    """Adapts an MTP class to :func:`build_model` (which calls ``cls(config, backends)``)."""

    def __init__(self, cls: type[MultiTokenPredictor], target: CausalLM, n: int) -> None:
        self.cls, self.target, self.n = cls, target, n

    def build(self, config: ModelConfig, backends: dict[str, Any]) -> nn.Module:
        wrapper = nn.Module()
        wrapper.mtp = self.cls(self.target, self.n)
        return wrapper

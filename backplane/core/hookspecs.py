"""Hook specifications of the ``backplane`` pluggy project.

A plugin is a module (or object) carrying functions marked with
:data:`backplane.hookimpl` whose names match the specs below. Each spec asks a
plugin for the backends it provides for one op family; the plugin manager
collects the answers of every plugin, fills in ``BackendSpec.plugin`` and the
engine selects one backend per family from the configuration.

Plugin modules must stay cheap to import: they describe backends with
:class:`~backplane.core.backend_spec.BackendSpec` and point at the kernels by
import path, so that torch, triton or flashinfer are imported only when a
backend is actually selected.
"""

from __future__ import annotations

import pluggy

from backplane.core.backend_spec import BackendSpec

PROJECT_NAME = "backplane"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def backplane_attention_backends() -> list[BackendSpec]:
    """Return the attention backends this plugin provides.

    Attention backends implement causal (optionally sliding-window) attention
    over a paged KV cache for a ragged batch, GQA/MQA included; see
    :class:`backplane.core.families.AttentionBackend` for the object a
    backend's ``load`` must produce.

    :return: a list of :class:`BackendSpec` with ``family="attention"``; an
        empty list when the plugin provides none.

    Called once when the registry is built; the result is cached.
    """


@hookspec
def backplane_ssm_backends() -> list[BackendSpec]:
    """Return the Mamba2 SSM backends this plugin provides.

    SSM backends implement the causal depthwise convolution with conv state
    and the selective scan (chunked for prefill, state update for decode);
    see :class:`backplane.core.families.SSMBackend`.

    :return: a list of :class:`BackendSpec` with ``family="ssm"``.
    """


@hookspec
def backplane_mla_backends() -> list[BackendSpec]:
    """Return the multi-head latent attention (MLA) backends this plugin provides.

    MLA backends cache the compressed latent plus the rotary part of the key
    in pages and compute DeepSeek-style attention over it; see
    :class:`backplane.core.families.MLABackend`.

    :return: a list of :class:`BackendSpec` with ``family="mla"``.
    """


@hookspec
def backplane_delta_backends() -> list[BackendSpec]:
    """Return the gated delta rule backends this plugin provides.

    Delta backends implement the gated delta rule recurrence (Qwen3-Next,
    Qwen3.5) with one float32 state per sequence slot; see
    :class:`backplane.core.families.DeltaBackend`.

    :return: a list of :class:`BackendSpec` with ``family="delta"``.
    """


FAMILIES: tuple[str, ...] = ("attention", "ssm", "mla", "delta")
"""The op families, in the order they are listed to users: the one list every
part of backplane (registry, configuration, selection, command line, kit) uses."""

#: Hook name for each op family: ``backplane_<family>_backends``.
FAMILY_HOOKS: dict[str, str] = {family: f"{PROJECT_NAME}_{family}_backends" for family in FAMILIES}

_missing = [hook for hook in FAMILY_HOOKS.values() if hook not in globals()]
if _missing:  # a family added to FAMILIES needs its hook spec above
    raise ImportError(f"hook specs missing for {', '.join(_missing)}")

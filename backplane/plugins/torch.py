"""The torch plugin: reference backends for all four families, CPU and CUDA."""

from __future__ import annotations

from backplane.core.backend_spec import BackendSpec
from backplane.core.hookspecs import hookimpl
from backplane.plugins._availability import module_missing

_CAPS = frozenset({"cpu", "cuda", "float32", "bfloat16", "float16", "cuda_graph"})


def _available() -> tuple[bool, str]:
    reason = module_missing("torch")
    return (reason is None, reason or "")


@hookimpl
def backplane_attention_backends() -> list[BackendSpec]:
    """The torch reference attention backend."""
    return [
        BackendSpec(
            family="attention",
            name="torch",
            load="backplane.backends.torch.attention:TorchAttentionBackend",
            is_available=_available,
            priority=0,
            capabilities=_CAPS | {"sliding_window", "gqa"},
            description="reference paged attention in plain torch (any device)",
        )
    ]


@hookimpl
def backplane_ssm_backends() -> list[BackendSpec]:
    """The torch reference Mamba2 backend."""
    return [
        BackendSpec(
            family="ssm",
            name="torch",
            load="backplane.backends.torch.ssm:TorchSSMBackend",
            is_available=_available,
            priority=0,
            capabilities=_CAPS | {"z_gate", "n_groups"},
            description="reference causal conv + selective scan in plain torch",
        )
    ]


@hookimpl
def backplane_mla_backends() -> list[BackendSpec]:
    """The torch reference MLA backend."""
    return [
        BackendSpec(
            family="mla",
            name="torch",
            load="backplane.backends.torch.mla:TorchMLABackend",
            is_available=_available,
            priority=0,
            capabilities=_CAPS,
            description="reference MLA in plain torch (absorbed decode, expanded prefill)",
        )
    ]


@hookimpl
def backplane_delta_backends() -> list[BackendSpec]:
    """The torch reference gated delta rule backend."""
    return [
        BackendSpec(
            family="delta",
            name="torch",
            load="backplane.backends.torch.delta:TorchDeltaBackend",
            is_available=_available,
            priority=0,
            capabilities=_CAPS | {"qk_l2norm", "grouped_v_heads"},
            description="reference gated delta rule in plain torch",
        )
    ]

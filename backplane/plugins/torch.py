"""The torch plugin: reference backends for all four families, CPU and CUDA."""

from __future__ import annotations

from backplane.core.backend_spec import CHAINED_ROWS, BackendSpec
from backplane.core.hookspecs import hookimpl
from backplane.plugins._availability import module_missing

_CAPS = frozenset({"cpu", "cuda", "float32", "bfloat16", "float16", "cuda_graph"})


def _available() -> tuple[bool, str]:
    reason = module_missing("torch")
    return (reason is None, reason or "")


def _spec(family: str, cls: str, extra: frozenset[str], description: str) -> list[BackendSpec]:
    # every torch backend: same name, priority and availability; they differ in what they run
    return [
        BackendSpec(
            family=family,
            name="torch",
            load=f"backplane.backends.torch.{family}:{cls}",
            is_available=_available,
            priority=0,
            capabilities=_CAPS | extra,
            description=description,
        )
    ]


@hookimpl
def backplane_attention_backends() -> list[BackendSpec]:
    """The torch reference attention backend."""
    return _spec(
        "attention",
        "TorchAttentionBackend",
        frozenset({"sliding_window", "gqa"}),
        "reference paged attention in plain torch (any device)",
    )


@hookimpl
def backplane_ssm_backends() -> list[BackendSpec]:
    """The torch reference Mamba2 backend."""
    return _spec(
        "ssm",
        "TorchSSMBackend",
        frozenset({"z_gate", "n_groups", CHAINED_ROWS}),
        "reference causal conv + selective scan in plain torch",
    )


@hookimpl
def backplane_mla_backends() -> list[BackendSpec]:
    """The torch reference MLA backend."""
    return _spec(
        "mla",
        "TorchMLABackend",
        frozenset(),
        "reference MLA in plain torch (absorbed decode, expanded prefill)",
    )


@hookimpl
def backplane_delta_backends() -> list[BackendSpec]:
    """The torch reference gated delta rule backend."""
    return _spec(
        "delta",
        "TorchDeltaBackend",
        frozenset({"qk_l2norm", "grouped_v_heads", CHAINED_ROWS}),
        "reference gated delta rule in plain torch",
    )

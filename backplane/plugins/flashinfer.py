"""The FlashInfer plugin: attention, MLA, Mamba2 decode and GDN prefill on FlashInfer kernels.

FlashInfer is GPU-only and compiles its kernels with nvcc on first use (see
``docs/flashinfer.md``). Every backend here is unavailable, with the reason,
when ``flashinfer`` is not installed, when no CUDA device is usable or when the
device's compute capability is below what the kernel needs. Per-layer shape
limits (MLA latent 512 + rope 64, GDN head dim 128, attention head dims) are
checked by each backend's ``supports(layer, dtype)`` because a spec cannot see
the model; an unsupported layer fails at load with that reason.

This module imports neither torch nor flashinfer at import time: the checks run
only when availability is asked for.
"""

from __future__ import annotations

from collections.abc import Callable

from backplane.core.backend_spec import BackendSpec, Speed
from backplane.core.hookspecs import hookimpl
from backplane.plugins._availability import cuda_reason, module_missing
from backplane.plugins._measured import LLAMA_1B_SOURCE, op_speed

#: Priority of the FlashInfer backends: above the Triton backends (50) and the
#: torch references (0), so where no measured figures decide (see below),
#: ``auto`` picks FlashInfer's attention, MLA and SSM-decode kernels wherever
#: they can run (see docs/benchmarks/flashinfer.md).
PRIORITY = 60

# -- measured speed, per device class (tokens/s; auto ranks the backends by them) --------------
# Keep these next to the Triton plugin's (backplane/plugins/triton.py): auto compares
# the figures of one family on one device class, so both come from the runs that
# backplane/plugins/_measured.py describes.

#: Attention on Hopper (H100/H200). Decode: ``backplane bench latency --shapes llama-1b``, H200,
#: CUDA graphs, batch 1: 1.403 ms per token (1.618 at batch 8, 2.671 at batch 64), slower than
#: Triton's decode, so ``auto`` chooses Triton attention there. Prefill: ``backplane bench
#: throughput --model llama-1b``, 32 prompts x 512 tokens + 128, all at once, output tokens/s.
ATTENTION_SPEED: dict[str, Speed] = {
    "sm90": Speed(
        prefill=14075.0,
        decode=1000 / 1.403,
        source=LLAMA_1B_SOURCE,
    )
}

#: MLA on Hopper, DeepSeek-V3 layer at 16 heads: decode 180.2 us, prefill 617.2 us.
MLA_SPEED: dict[str, Speed] = {"sm90": op_speed(prefill_us=617.2, decode_us=180.2)}

#: Mamba2 on Hopper, Nemotron-H layer: decode 216.6 us; its prefill is the Triton
#: backend's (delegated), measured 900.2 us through this backend.
SSM_SPEED: dict[str, Speed] = {"sm90": op_speed(prefill_us=900.2, decode_us=216.6)}

#: The delta backend replaces only the prefill kernel (and only on Hopper); it
#: ranks just above the Triton (fla) backend, whose decode kernel it shares.
DELTA_PRIORITY = 55

_CAPS = frozenset({"cuda", "cuda_graph", "bfloat16", "float16", "jit"})


def _capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability()


def availability(
    min_capability: tuple[int, int] = (8, 0), *, exact_major: int | None = None
) -> tuple[bool, str]:
    """Return ``(available, reason)`` for a FlashInfer kernel on this machine.

    :param min_capability: the lowest CUDA compute capability the kernel runs on.
    :param exact_major: when set, the kernel runs only on devices of this major
        capability (FlashInfer's GDN prefill is built for sm90a only).
    :return: ``(True, "")`` or ``(False, reason)``; the reason says what to do.
    """
    missing = module_missing("flashinfer")
    if missing:
        return False, f"{missing} (pip install 'backplane[flashinfer]')"
    no_cuda = cuda_reason()
    if no_cuda:
        return False, f"FlashInfer runs only on CUDA GPUs: {no_cuda}"
    major, minor = _capability()
    if exact_major is not None and major != exact_major:
        return False, (
            f"the FlashInfer kernel is built for compute capability {exact_major}.x only "
            f"(Hopper); this GPU is {major}.{minor}"
        )
    if (major, minor) < min_capability:
        want = f"{min_capability[0]}.{min_capability[1]}"
        return False, f"FlashInfer needs compute capability >= {want}; this GPU is {major}.{minor}"
    return True, ""


def _check(
    min_capability: tuple[int, int] = (8, 0), exact_major: int | None = None
) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        return availability(min_capability, exact_major=exact_major)

    return check


@hookimpl
def backplane_attention_backends() -> list[BackendSpec]:
    """FlashInfer paged attention (prefill/extend + decode wrappers, CUDA-graph decode)."""
    return [
        BackendSpec(
            family="attention",
            name="flashinfer",
            load="backplane.backends.flashinfer.attention:FlashInferAttentionBackend",
            is_available=_check((8, 0)),
            priority=PRIORITY,
            capabilities=_CAPS | {"sliding_window", "gqa", "head_dim_64_128_256"},
            description=(
                "FlashInfer BatchPrefill/BatchDecode paged-KV wrappers + append_paged_kv_cache; "
                "planned once per step, CUDA-graph decode wrappers per bucket"
            ),
            speed=ATTENTION_SPEED,
        )
    ]


@hookimpl
def backplane_mla_backends() -> list[BackendSpec]:
    """FlashInfer MLA (absorbed, paged latent cache)."""
    return [
        BackendSpec(
            family="mla",
            name="flashinfer",
            load="backplane.backends.flashinfer.mla:FlashInferMLABackend",
            is_available=_check((8, 0)),
            priority=PRIORITY,
            capabilities=_CAPS | {"latent_512_rope_64"},
            description=(
                "FlashInfer BatchMLAPagedAttentionWrapper (weights absorbed, prefill and decode) + "
                "append_paged_mla_kv_cache; kv_lora_rank 512 and rope 64 only"
            ),
            speed=MLA_SPEED,
        )
    ]


@hookimpl
def backplane_ssm_backends() -> list[BackendSpec]:
    """FlashInfer Mamba2 decode; prefill and conv on the Triton or torch path."""
    return [
        BackendSpec(
            family="ssm",
            name="flashinfer",
            load="backplane.backends.flashinfer.ssm:FlashInferSSMBackend",
            is_available=_check((8, 0)),
            priority=PRIORITY,
            capabilities=_CAPS | {"z_gate", "n_groups"},
            description=(
                "decode: flashinfer.mamba.selective_state_update (tied Mamba2 layout); "
                "prefill scan and causal conv: the Triton backend when available, else torch"
            ),
            speed=SSM_SPEED,
        )
    ]


@hookimpl
def backplane_delta_backends() -> list[BackendSpec]:
    """FlashInfer GDN prefill (Hopper, head dim 128); decode through fla or torch."""
    return [
        BackendSpec(
            family="delta",
            name="flashinfer",
            load="backplane.backends.flashinfer.delta:FlashInferDeltaBackend",
            is_available=_check((9, 0), exact_major=9),
            priority=DELTA_PRIORITY,
            capabilities=_CAPS | {"qk_l2norm", "grouped_v_heads", "head_dim_128"},
            description=(
                "prefill: flashinfer chunk_gated_delta_rule (sm90, k/v head dim 128); "
                "decode: fla fused_recurrent_gated_delta_rule when installed, else torch"
            ),
        )
    ]

"""The Triton plugin: our own paged attention and MLA kernels, mamba-ssm's and fla's kernels.

Importing this module is cheap (no torch, no triton); the kernels load from
:mod:`backplane.backends.triton` only when a Triton backend is selected.

Availability, per family:

* every family needs the ``triton`` package and a CUDA device, unless
  ``TRITON_INTERPRET=1`` (the CPU interpreter, for tests at small float32 shapes);
* ``ssm`` also needs ``mamba-ssm`` (only its Triton modules are loaded, see
  :mod:`backplane.backends.triton._mamba_import`) and ``einops``, which those modules import;
* ``delta`` also needs ``fla-core`` (the ``fla`` package).
"""

from __future__ import annotations

from backplane.core.backend_spec import CHAINED_ROWS, BackendSpec, Speed
from backplane.core.hookspecs import hookimpl
from backplane.plugins._availability import cuda_reason, module_missing, triton_interpret
from backplane.plugins._measured import LLAMA_1B_SOURCE, op_speed

#: Above the torch reference backends (0), below vendor libraries that may claim more.
PRIORITY = 50

# -- measured speed, per device class (tokens/s; auto ranks the backends by them) --------------
# Keep these next to the FlashInfer plugin's (backplane/plugins/flashinfer.py): auto compares
# the figures of one family on one device class, so both come from the runs that
# backplane/plugins/_measured.py describes.

#: Attention on Hopper (H100/H200). Decode: ``backplane bench latency --shapes llama-1b``, H200,
#: CUDA graphs, batch 1: 1.049 ms per token (1.238 at batch 8, 1.770 at batch 64).
#: Prefill: ``backplane bench throughput --model llama-1b``, 32 prompts x 512 tokens + 128,
#: all at once, output tokens/s (docs/benchmarks/throughput.md).
ATTENTION_SPEED: dict[str, Speed] = {
    "sm90": Speed(
        prefill=16537.0,
        decode=1000 / 1.049,
        source=LLAMA_1B_SOURCE,
    )
}

#: MLA on Hopper, DeepSeek-V3 layer at 16 heads: decode 424.3 us, prefill 3357.0 us.
MLA_SPEED: dict[str, Speed] = {"sm90": op_speed(prefill_us=3357.0, decode_us=424.3)}

#: Mamba2 on Hopper, Nemotron-H layer: decode 293.0 us, prefill 850.4 us.
SSM_SPEED: dict[str, Speed] = {"sm90": op_speed(prefill_us=850.4, decode_us=293.0)}

# The delta family ships no figures: the FlashInfer delta backend decodes with the same
# kernel family (decode measured 340.7 us here against 344.2 us there, a tie within the
# noise), so priority decides, and it prefers FlashInfer's faster prefill.

_BASE_CAPS = frozenset({"cuda", "float32", "bfloat16", "float16", "cuda_graph"})


def _caps(*extra: str, interpreter_cpu: bool = True) -> frozenset[str]:
    """Capability tags; under ``TRITON_INTERPRET=1`` add ``cpu`` (when the family runs there)."""
    caps = _BASE_CAPS | set(extra)
    if triton_interpret():
        # Under the CPU interpreter only float32/float16 are emulated.
        caps = (caps - {"bfloat16"}) | {"interpret"}
        if interpreter_cpu:
            caps |= {"cpu"}
    return frozenset(caps)


def _needs(*packages: tuple[str, str]) -> tuple[bool, str]:
    """Availability: triton, a CUDA device (or the interpreter), then ``(package, why)`` pairs."""
    missing = module_missing("triton")
    if missing:
        return False, f"{missing} (pip install 'backplane[triton]')"
    if not triton_interpret():
        reason = cuda_reason()
        if reason:
            return (
                False,
                f"{reason}; Triton kernels need CUDA (or TRITON_INTERPRET=1 for CPU tests)",
            )
    for package, why in packages:
        missing = module_missing(package)
        if missing:
            return False, f"{missing}; {why}"
    return True, ""


def _attention_available() -> tuple[bool, str]:
    return _needs()


def _mla_available() -> tuple[bool, str]:
    return _needs()


def _ssm_available() -> tuple[bool, str]:
    return _needs(
        ("mamba_ssm", "the Triton SSM backend runs mamba-ssm's kernels (pip install mamba-ssm)"),
        ("einops", "mamba-ssm's Triton modules import it (pip install einops)"),
    )


def _delta_available() -> tuple[bool, str]:
    return _needs(("fla", "the Triton delta backend runs fla's kernels (pip install fla-core)"))


@hookimpl
def backplane_attention_backends() -> list[BackendSpec]:
    """Paged attention in Triton (prefill/extend, split-KV decode, KV append)."""
    return [
        BackendSpec(
            family="attention",
            name="triton",
            load="backplane.backends.triton.attention:TritonAttentionBackend",
            is_available=_attention_available,
            priority=PRIORITY,
            capabilities=_caps("gqa", "sliding_window"),
            description="Triton paged attention: ragged prefill/extend, split-KV decode",
            speed=ATTENTION_SPEED,
        )
    ]


@hookimpl
def backplane_mla_backends() -> list[BackendSpec]:
    """Weight-absorbed MLA over the latent cache in Triton."""
    return [
        BackendSpec(
            family="mla",
            name="triton",
            load="backplane.backends.triton.mla:TritonMLABackend",
            is_available=_mla_available,
            priority=PRIORITY,
            capabilities=_caps(),
            description="Triton MLA: weight-absorbed prefill and split-KV decode on the latent cache",
            speed=MLA_SPEED,
        )
    ]


@hookimpl
def backplane_ssm_backends() -> list[BackendSpec]:
    """Mamba2 on mamba-ssm's Triton kernels plus our causal-conv kernel."""
    return [
        BackendSpec(
            family="ssm",
            name="triton",
            load="backplane.backends.triton.ssm:TritonSSMBackend",
            is_available=_ssm_available,
            priority=PRIORITY,
            capabilities=_caps("z_gate", "n_groups", CHAINED_ROWS),
            description="mamba-ssm packed chunk scan / state update + Triton conv, epilogue",
            speed=SSM_SPEED,
        )
    ]


@hookimpl
def backplane_delta_backends() -> list[BackendSpec]:
    """Gated delta rule: fla's chunked Triton kernel for prefill, our in-place decode kernel."""
    return [
        BackendSpec(
            family="delta",
            name="triton",
            load="backplane.backends.triton.delta:TritonDeltaBackend",
            is_available=_delta_available,
            priority=PRIORITY,
            # fla's chunked prefill kernels need a GPU driver even in the interpreter
            # (autotuning); only our decode kernel runs on CPU, so "cpu" is not claimed.
            capabilities=_caps("qk_l2norm", "grouped_v_heads", CHAINED_ROWS, interpreter_cpu=False),
            description="fla chunk_gated_delta_rule + Triton in-place decode",
        )
    ]

"""Where the in-tree plugins' measured figures come from, shared so ``auto`` compares like with like.

``auto`` ranks the backends of one family on one device class by their
``BackendSpec.speed`` figures, so the Triton and the FlashInfer plugins take
theirs from the same runs: these are the descriptions of those runs, and the
conversion of a per-op timing into tokens per second.
"""

from __future__ import annotations

from backplane.core.backend_spec import Speed

#: The model-level attention figures: decode from ``backplane bench latency``, prefill
#: from ``backplane bench throughput`` (both on the ~1.1B Llama shape).
LLAMA_1B_SOURCE = (
    "H200, llama-1b shape: bench latency at batch 1 with CUDA graphs for decode "
    "(docs/benchmarks/latency.md), bench throughput of 32 prompts x 512 tokens for "
    "prefill (docs/benchmarks/throughput.md)"
)

#: The per-op figures of MLA and SSM (tokens per second of one layer's op).
OP_SOURCE = (
    "benchmarks/bench_ops_flashinfer.py, H200, bfloat16, one layer's op through the family "
    "contract: decode batch 64 (MLA at 4096 tokens of context), prefill of one 4096-token "
    "prompt (docs/benchmarks/flashinfer.md)"
)

#: the decode batch and the prompt length of the per-op figures
OP_DECODE_BATCH = 64
OP_PREFILL_TOKENS = 4096


def op_speed(*, prefill_us: float, decode_us: float) -> Speed:
    """The figures of one backend's op timed by :data:`OP_SOURCE`'s benchmark.

    :param prefill_us: microseconds of the op on one prompt of :data:`OP_PREFILL_TOKENS` tokens.
    :param decode_us: microseconds of the op on a decode batch of :data:`OP_DECODE_BATCH`.
    :return: tokens per second of each step kind, with the source.
    """
    return Speed(
        prefill=OP_PREFILL_TOKENS / (prefill_us * 1e-6),
        decode=OP_DECODE_BATCH / (decode_us * 1e-6),
        source=OP_SOURCE,
    )

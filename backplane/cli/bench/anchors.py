"""Published figures of other engines that ``bench latency`` and ``bench throughput`` print beside their own.

An :class:`Anchor` is one published measurement: a model shape, a workload
and a GPU kind, the figure and its unit, what produced it and where it was
published. A benchmark result is compared with an anchor only when all three
match: the shape by name, the workload by its conditions (batch 1 decode in
bfloat16 for latency; about 1000 ShareGPT-like requests all at once on one GPU
for throughput) and the GPU kind read from ``torch.cuda.get_device_name``.
The comparison is ``ours / anchor``, with whether lower or higher is better.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ANCHORS",
    "DECODE_BATCH1",
    "SHAREGPT_OFFLINE",
    "Anchor",
    "compare",
    "find_anchors",
    "format_comparison",
    "gpu_kind",
    "latency_comparisons",
    "throughput_comparisons",
]

DECODE_BATCH1 = "decode-b1"
"""Workload: ms per output token of one sequence (batch 1), bfloat16 weights."""

SHAREGPT_OFFLINE = "sharegpt-1000-inf"
"""Workload: output tokens/s of ~1000 ShareGPT-like requests sent at once, bfloat16, one GPU."""

_MEGAKERNELS = (
    "msaroufim/megakernels-vs-cuda-graphs, llama/docs/RESULTS.md "
    "(batch 1, 32 prompt tokens, 128 new, mean per decode step)"
)
_MEGAKERNELS_URL = (
    "https://github.com/msaroufim/megakernels-vs-cuda-graphs/blob/main/llama/docs/RESULTS.md"
)
_AIMULTIPLE = (
    "AIMultiple, 'LLM inference engines' benchmark (1,000 ShareGPT prompts, "
    "Llama 3.1 8B-Instruct bf16, H100 80GB, offline batch, output tok/s)"
)
_AIMULTIPLE_URL = "https://research.aimultiple.com/inference-engines"


@dataclass(frozen=True)
class Anchor:
    """One published figure a benchmark result can be set against.

    :param shape: the benchmark's shape name (``llama-3.2-1b`` ...).
    :param workload: :data:`DECODE_BATCH1` or :data:`SHAREGPT_OFFLINE`.
    :param gpu: the GPU kind (``H100``, ``H200``), as :func:`gpu_kind` names it.
    :param figure: the published number.
    :param unit: its unit (``ms/token``, ``output tok/s``).
    :param system: what produced it (an engine, a technique).
    :param source: the citation: who published it, where, and under what conditions.
    :param url: where to read it.
    :param lower_is_better: ``True`` for times, ``False`` for rates.
    """

    shape: str
    workload: str
    gpu: str
    figure: float
    unit: str
    system: str
    source: str
    url: str
    lower_is_better: bool


ANCHORS: tuple[Anchor, ...] = (
    Anchor(
        "llama-3.2-1b",
        DECODE_BATCH1,
        "H200",
        0.79474,
        "ms/token",
        "CUDA graphs + PDL + fused projections",
        _MEGAKERNELS,
        _MEGAKERNELS_URL,
        True,
    ),
    Anchor(
        "llama-3.2-1b",
        DECODE_BATCH1,
        "H200",
        0.75983,
        "ms/token",
        "HazyResearch megakernel",
        _MEGAKERNELS,
        _MEGAKERNELS_URL,
        True,
    ),
    Anchor(
        "llama-3.2-1b",
        DECODE_BATCH1,
        "H100",
        0.97951,
        "ms/token",
        "CUDA graphs + PDL + fused projections",
        _MEGAKERNELS,
        _MEGAKERNELS_URL,
        True,
    ),
    Anchor(
        "llama-3.2-1b",
        DECODE_BATCH1,
        "H100",
        0.97278,
        "ms/token",
        "HazyResearch megakernel",
        _MEGAKERNELS,
        _MEGAKERNELS_URL,
        True,
    ),
    Anchor(
        "llama-3.1-8b",
        SHAREGPT_OFFLINE,
        "H100",
        16215.0,
        "output tok/s",
        "SGLang",
        _AIMULTIPLE,
        _AIMULTIPLE_URL,
        False,
    ),
    Anchor(
        "llama-3.1-8b",
        SHAREGPT_OFFLINE,
        "H100",
        16132.0,
        "output tok/s",
        "LMDeploy",
        _AIMULTIPLE,
        _AIMULTIPLE_URL,
        False,
    ),
    Anchor(
        "llama-3.1-8b",
        SHAREGPT_OFFLINE,
        "H100",
        12553.0,
        "output tok/s",
        "vLLM (FlashInfer)",
        _AIMULTIPLE,
        _AIMULTIPLE_URL,
        False,
    ),
)
"""The published figures, per (shape, workload, GPU kind)."""

SHAREGPT_PROMPTS = (900, 1100)
"""Request counts taken as "about 1000 prompts" (inclusive), the anchors' workload size."""

# The anchors ran on SXM boards; PCIe and NVL boards of the same name have
# other clocks and memory bandwidth, so they are no match.
_GPU_KIND = re.compile(r"\b(H100|H200)\b", re.IGNORECASE)
_OTHER_BOARD = re.compile(r"\b(PCIE|NVL)\b", re.IGNORECASE)


def gpu_kind(name: str | None) -> str | None:
    """The GPU kind the anchors are keyed by, from a device name.

    :param name: ``torch.cuda.get_device_name()`` (``"NVIDIA H100 80GB HBM3"``),
        or ``None`` on a CPU.
    :return: ``"H100"`` or ``"H200"``; ``None`` for any other device, for PCIe
        and NVL boards, and for Grace Hopper (``GH200``) modules.
    """
    if not name or _OTHER_BOARD.search(name):
        return None
    found = _GPU_KIND.search(name)
    return found.group(1).upper() if found else None


def find_anchors(shape: str, workload: str, gpu: str | None) -> list[Anchor]:
    """The anchors of one shape, workload and GPU kind.

    :param shape: the shape's name.
    :param workload: :data:`DECODE_BATCH1` or :data:`SHAREGPT_OFFLINE`.
    :param gpu: a kind from :func:`gpu_kind` (``None``: no anchor).
    :return: the matching anchors, in table order (empty if none).
    """
    if gpu is None:
        return []
    return [a for a in ANCHORS if (a.shape, a.workload, a.gpu) == (shape, workload, gpu)]


def compare(anchor: Anchor, value: float, measured: str) -> dict[str, Any]:
    """A result set against one anchor, as the JSON and the report carry it.

    :param anchor: the published figure.
    :param value: backplane's figure, in the anchor's unit.
    :param measured: which backplane configuration gave it.
    :return: the anchor's fields, ``backplane`` (the value), ``measured`` and
        ``ratio`` (``backplane / anchor``).
    """
    return {
        **asdict(anchor),
        "backplane": value,
        "measured": measured,
        "ratio": value / anchor.figure,
    }


def format_comparison(row: dict[str, Any]) -> str:
    """One report line for a comparison made by :func:`compare`.

    :param row: the comparison.
    :return: e.g. ``"published 0.795 ms/token (CUDA graphs + ..., H200): backplane 0.860
        = 1.08x, lower is better; source: ..."``.
    """
    better = "lower" if row["lower_is_better"] else "higher"
    figure = row["figure"]
    shown = f"{figure:,.0f}" if figure >= 100 else f"{figure:.3f}"
    mine = row["backplane"]
    ours = f"{mine:,.0f}" if mine >= 100 else f"{mine:.3f}"
    return (
        f"published {shown} {row['unit']} ({row['system']}, {row['gpu']}): backplane {ours} "
        f"({row['measured']}) = {row['ratio']:.2f}x, {better} is better; "
        f"source: {row['source']} <{row['url']}>"
    )


def latency_comparisons(shape: dict[str, Any], gpu_name: str | None) -> list[dict[str, Any]]:
    """Set one shape of a ``bench latency`` result against its batch-1 anchors.

    The best backplane configuration measured at batch 1 (lowest ms per
    token) stands for backplane; the run must be in bfloat16, as the anchors are.

    :param shape: one entry of the result's ``shapes``.
    :param gpu_name: the result's ``machine["gpu"]``.
    :return: one comparison per matching anchor (empty when none applies).
    """
    anchors = find_anchors(shape["name"], DECODE_BATCH1, gpu_kind(gpu_name))
    run = shape.get("run") or {}
    if not anchors or run.get("dtype") != "bfloat16":
        return []
    best: tuple[float, str] | None = None
    for config in shape.get("configs", []):
        if config.get("kind") != "backplane":
            continue
        for row in config.get("batches", []):
            ms = row.get("ms_per_token")
            if int(row.get("batch", 0)) == 1 and row.get("status") == "ok" and ms:
                if best is None or ms < best[0]:
                    best = (float(ms), str(config["label"]))
    if best is None:
        return []
    return [compare(a, best[0], f"{best[1]}, batch 1") for a in anchors]


def throughput_comparisons(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Set a ``bench throughput`` result against the offline ShareGPT anchors.

    They apply to the ``inf`` rate of the ShareGPT-like mix with about 1000
    requests (:data:`SHAREGPT_PROMPTS`), in bfloat16, on one GPU (no tensor or
    data parallelism), for the shape the anchors name.

    :param result: what ``run_throughput`` returned (or its JSON).
    :return: one comparison per matching anchor (empty when none applies).
    """
    workload = result.get("workload") or {}
    config = (result.get("engine") or {}).get("config") or {}
    name = (result.get("model") or {}).get("name", "")
    anchors = find_anchors(name, SHAREGPT_OFFLINE, gpu_kind(result["machine"].get("gpu")))
    lo, hi = SHAREGPT_PROMPTS
    if (
        not anchors
        or workload.get("mix") != "sharegpt-like"
        or not lo <= int(workload.get("num_prompts", 0)) <= hi
        or config.get("dtype") != "bfloat16"
        or int(config.get("tensor_parallel_size") or 1) != 1
        or int(config.get("data_parallel_size") or 1) != 1
    ):
        return []
    row = next((r for r in result.get("rates", []) if r.get("rate") == "inf"), None)
    if row is None or row.get("failed", 0) != 0:
        return []
    value = float(row["output_token_throughput"])
    if not math.isfinite(value) or value <= 0:
        return []
    measured = f"{workload['num_prompts']} requests at rate inf"
    return [compare(a, value, measured) for a in anchors]

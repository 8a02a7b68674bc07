"""Draw the published-shape figures of ``bench latency`` and ``bench throughput`` against the anchors.

One PNG of two panels: batch-1 milliseconds per token per shape (and weight
format) beside its memory floor and the published figures for that shape, and
the output tokens per second of the 1,000-request mix beside the published
ones (see :mod:`backplane.cli.bench.anchors`; each bar names its GPU kind, and
published figures of another GPU kind are drawn hatched: they are context,
not a comparison). The figures come from the commands' ``--json`` files::

    python benchmarks/plot_shapes.py --latency b1_*.json --throughput mix_*.json \\
        --out docs/benchmarks/shapes_h200.png
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from backplane.cli.bench.anchors import ANCHORS, DECODE_BATCH1, SHAREGPT_OFFLINE, gpu_kind

logger = logging.getLogger("plot_shapes")


def latency_bars(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch-1 bars of one ``bench latency --json`` document: per shape, the graphs
    run, its floor and the shape's published batch-1 figures.

    :param doc: the parsed document.
    :return: one dict per bar (``group``, ``label``, ``value``, ``kind``, ``gpu``).
    """
    gpu = gpu_kind(doc["machine"].get("gpu")) or "?"
    run = doc["settings"]
    fmt = run.get("quantization") or (
        "gguf-q4_k" if run.get("weights_format") == "gguf-q4_k" else "bf16"
    )
    bars = []
    for shape in doc["shapes"]:
        group = f"{shape['name']}\n{fmt}, prompt {shape['run']['prompt_len']}"
        floor = next(c for c in shape["configs"] if c["kind"] == "floor")
        ours = next(
            (c for c in shape["configs"] if c["kind"] == "backplane" and c["cuda_graphs"] == "on"),
            None,
        )
        if ours is None:
            continue
        value = _batch1(ours)
        if value is None:
            continue
        bars.append(
            {
                "group": group,
                "label": f"backplane ({gpu})",
                "value": value,
                "kind": "ours",
                "gpu": gpu,
            }
        )
        bars.append(
            {
                "group": group,
                "label": f"floor ({gpu})",
                "value": _batch1(floor),
                "kind": "floor",
                "gpu": gpu,
            }
        )
        if fmt == "bf16":
            for a in ANCHORS:
                if a.shape == shape["name"] and a.workload == DECODE_BATCH1:
                    bars.append(
                        {"group": group, "label": f"{a.system} ({a.gpu})", "value": a.figure,
                         "kind": "anchor", "gpu": a.gpu}
                    )  # fmt: skip
    return bars


def _batch1(config: dict[str, Any]) -> float | None:
    for b in config.get("batches", []):
        if b["batch"] == 1 and b.get("status") == "ok":
            return float(b["ms_per_token"])
    return None


def throughput_bars(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The bars of one ``bench throughput --json`` document: the all-at-once rate's output
    tokens per second and the published figures of the same mix.

    :param doc: the parsed document.
    :return: one dict per bar, as :func:`latency_bars`.
    """
    gpu = gpu_kind(doc["machine"].get("gpu")) or "?"
    name = doc["model"]["name"]
    fmt = doc["engine"]["config"].get("quantization") or "bf16"
    bars = []
    for r in doc["rates"]:
        if r["rate"] == "inf":
            bars.append(
                {"group": name, "label": f"backplane {fmt} ({gpu})",
                 "value": r["output_token_throughput"], "kind": "ours", "gpu": gpu}
            )  # fmt: skip
    return bars


def anchor_bars(shape: str) -> list[dict[str, Any]]:
    """The published figures of the 1,000-request mix for ``shape``."""
    return [
        {"group": shape, "label": f"{a.system} ({a.gpu})", "value": a.figure, "kind": "anchor", "gpu": a.gpu}
        for a in ANCHORS
        if a.shape == shape and a.workload == SHAREGPT_OFFLINE
    ]  # fmt: skip


def draw(left: list[dict[str, Any]], right: list[dict[str, Any]], out: str) -> None:
    """Write the two panels to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#1f77b4", "floor": "#999999", "anchor": "#ff7f0e"}
    ours_gpu = {b["gpu"] for b in left + right if b["kind"] == "ours"}
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [3, 1.4]})
    for ax, bars, unit in ((axes[0], left, "ms per token, batch 1 (lower is better)"),
                           (axes[1], right, "output tok/s, 1,000 requests at once")):  # fmt: skip
        y = 0.0
        ticks, names = [], []
        for b in bars:
            hatch = "//" if b["kind"] == "anchor" and b["gpu"] not in ours_gpu else None
            ax.barh(y, b["value"], color=colors[b["kind"]], hatch=hatch, edgecolor="black")
            ax.text(b["value"], y, f" {b['value']:.3f}" if b["value"] < 100 else f" {b['value']:,.0f}",
                    va="center", fontsize=8)  # fmt: skip
            ticks.append(y)
            names.append(f"{b['group'].replace(chr(10), ' ')}: {b['label']}")
            y += 1.0
        ax.set_yticks(ticks, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.margins(x=0.2)
    fig.suptitle(
        "Published model shapes, random weights (hatched: published figure on another GPU kind)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Read the JSON files and write the PNG.

    :param argv: command-line arguments (default ``sys.argv[1:]``).
    :return: the exit status.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--latency", nargs="*", default=[], help="bench latency --json files")
    p.add_argument("--throughput", nargs="*", default=[], help="bench throughput --json files")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    left = [b for path in args.latency for b in latency_bars(_load(path))]
    right = [b for path in args.throughput for b in throughput_bars(_load(path))]
    for shape in dict.fromkeys(b["group"] for b in right):
        right += anchor_bars(shape)
    if not left and not right:
        logger.error("no figures in the files given")
        return 1
    draw(left, right, args.out)
    logger.info("wrote %s (%d + %d bars)", args.out, len(left), len(right))
    return 0


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())

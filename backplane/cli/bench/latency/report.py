"""Reporting a latency run: text tables, saved JSON read back and merged, and the plot."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from backplane.cli.bench.anchors import format_comparison, latency_comparisons
from backplane.core.errors import BackplaneError

logger = logging.getLogger(__name__)


def _fmt_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """First column left-aligned, the others right-aligned.

    :param headers: the column titles.
    :param rows: the cells, as many per row as there are headers.
    :return: the table's lines, joined.
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def si(value: float, unit: str) -> str:
    """``1.104e9, "B"`` -> ``"1.10 GB"``; parameter counts use ``unit=""``.

    :param value: the number.
    :param unit: its unit, after the prefix.
    :return: the number with two decimals and a G, M or k prefix.
    """
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}".rstrip()
    return f"{value:.0f} {unit}".rstrip()


def _row_by_batch(entry: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A configuration's rows by batch size."""
    return {int(r["batch"]): r for r in entry.get("batches", [])}


def _held_as(run: dict[str, Any]) -> str:
    """How a shape's weights are held: the dtype, or the quantisation or file format beside it.

    :param run: the shape's ``run`` settings.
    :return: e.g. ``"bfloat16"`` or ``"fp8, bfloat16 activations"``.
    """
    storage = run.get("quantization")
    if run.get("weights_format") not in (None, "safetensors"):
        storage = run["weights_format"]
    if storage is None:
        return str(run["dtype"])
    return f"{storage}, {run['dtype']} activations"


def _shape_run(result: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    """The batch sizes, lengths and dtype a shape was measured with.

    :param result: the result the shape belongs to (older results keep them there only).
    :param shape: the shape's entry.
    :return: ``batch_sizes``, ``prompt_len``, ``new_tokens``, ``dtype`` and ``repeats``.
    """
    if "run" in shape:
        return shape["run"]
    s = result["settings"]
    return {
        "batch_sizes": s["batch_sizes"],
        "prompt_len": s["prompt_len"],
        "new_tokens": s["new_tokens"],
        "dtype": s.get("dtype_resolved", s["dtype"]),
        "repeats": s["repeats"],
    }


def _speculation_table(configs: Sequence[dict[str, Any]], batches: Sequence[int]) -> list[str]:
    """The speculative configurations beside their runs without speculation.

    :param configs: a shape's configurations.
    :param batches: its batch sizes.
    :return: the table's lines (a title first), or none without speculative rows.
    """
    spec = [c for c in configs if c.get("speculative_config") and c.get("status") == "ok"]
    if not spec:
        return []
    headers = ["configuration"]
    for b in batches:
        headers += [f"b={b} ms", "x floor", "speedup", "accept", "mean len"]
    rows = []
    for c in spec:
        by_batch = _row_by_batch(c)
        row = [c["label"]]
        for b in batches:
            r = by_batch.get(b)
            if r is None or r.get("status") != "ok":
                row += ["-", "", "", "", ""]
                continue
            figures = r.get("speculation", {})
            rate, length = figures.get("acceptance_rate"), figures.get("mean_accepted_length")
            row += [
                f"{r['ms_per_token']:.3f}",
                f"{r['x_floor']:.2f}x" if r.get("x_floor") else "",
                f"{r['speedup']:.2f}x" if r.get("speedup") else "",
                f"{rate:.1%}" if rate is not None else "no drafts",
                f"{length:.2f}" if length is not None else "",
            ]
        rows.append(row)
    return [
        "speculative decoding: effective ms per generated token (decode wall time / tokens "
        "generated), speedup = / the same configuration without speculation, accept = "
        "accepted / drafted tokens, mean len = tokens per verifying step",
        _fmt_table(headers, rows),
    ]


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Put the shapes of several results (e.g. one run per shape) into one.

    The machine, settings and bandwidth of the first are kept; each shape keeps
    the batch sizes and lengths it was measured with.

    :param results: results of :func:`~backplane.cli.bench.latency.run.run_benchmark`
        or their JSON, reloaded.
    :return: the merged result.
    """
    merged = dict(results[0])
    merged["shapes"] = []
    for res in results:
        if res["machine"].get("gpu") != results[0]["machine"].get("gpu"):
            logger.warning(
                "merging results of different devices (%s and %s); the report names the first",
                results[0]["machine"].get("gpu"),
                res["machine"].get("gpu"),
            )
        merged["shapes"].extend({**shape, "run": _shape_run(res, shape)} for shape in res["shapes"])
    return merged


def format_report(result: dict[str, Any]) -> str:
    """Render the result as text: per shape, ms per token and time to first token tables.

    :param result: what :func:`~backplane.cli.bench.latency.run.run_benchmark` returned
        (or its JSON, reloaded).
    :return: the report (ends with a newline).
    """
    m = result["machine"]
    bw = result["bandwidth"]
    out = []
    where = m.get("gpu") or f"{m.get('cpu')} ({m.get('cores')} cores)"
    out.append(
        f"device: {where}; torch {m.get('torch')}, triton {m.get('triton')}, flashinfer "
        f"{m.get('flashinfer')}, transformers {m.get('transformers')}"
    )
    out.append(f"read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['method']})")
    for shape in result["shapes"]:
        run = _shape_run(result, shape)
        batches = [int(b) for b in run["batch_sizes"]]
        configs = shape["configs"]
        floor = next((c for c in configs if c["kind"] == "floor"), None)
        hf = next(
            (c for c in configs if c["kind"] == "transformers" and c.get("mode") == "compile"),
            None,
        )
        floor_rows = _row_by_batch(floor) if floor else {}
        hf_rows = _row_by_batch(hf) if hf and hf.get("status") == "ok" else {}
        out.append("")
        out.append(
            f"{shape['name']}: {shape['architecture']}, {si(shape['params'], '')} params "
            f"({si(shape['weight_bytes'], 'B')} in {_held_as(run)}), "
            f"prompt {run['prompt_len']} + {run['new_tokens']} new tokens"
        )
        out.append(
            "ms per output token (median of "
            f"{run['repeats']}); x floor = / {floor['label'] if floor else 'floor'}, "
            "x hf = / transformers static+compile"
        )
        headers = ["configuration"]
        for b in batches:
            headers += [f"b={b} ms", "x floor", "x hf"]
        rows = []
        ttft_rows = []
        skipped = []
        for c in configs:
            by_batch = _row_by_batch(c)
            if c.get("status") == "skipped":
                skipped.append(f"  {c['label']}: {c.get('reason', '')}")
                continue
            row = [c["label"]]
            trow = [c["label"]]
            for b in batches:
                r = by_batch.get(b)
                if r is None or r.get("status") != "ok":
                    row += ["-", "", ""]
                    trow.append("-")
                    if r is not None and r.get("reason"):
                        skipped.append(f"  {c['label']} (b={b}): {r['reason']}")
                    continue
                ms = r["ms_per_token"]
                fl = floor_rows.get(b, {}).get("ms_per_token")
                ref = hf_rows.get(b, {}).get("ms_per_token")
                row += [
                    f"{ms:.3f}",
                    f"{ms / fl:.2f}x" if fl else "",
                    f"{ms / ref:.2f}x" if ref else "",
                ]
                trow.append(f"{r['ttft_ms']:.2f}" if "ttft_ms" in r else "")
            rows.append(row)
            if c["kind"] != "floor":
                ttft_rows.append(trow)
            if c.get("status") == "failed" and not c.get("batches") and c.get("reason"):
                skipped.append(f"  {c['label']}: {c['reason']}")
        out.append(_fmt_table(headers, rows))
        spec_lines = _speculation_table(configs, batches)
        if spec_lines:
            out.append("")
            out.extend(spec_lines)
        if ttft_rows:
            out.append("")
            out.append("time to first token, ms (median):")
            out.append(_fmt_table(["configuration", *(f"b={b}" for b in batches)], ttft_rows))
        if skipped:
            out.append("")
            out.append("not measured:")
            out.extend(skipped)
        # results saved before anchors existed are compared when read back
        anchors = shape.get("anchors")
        if anchors is None:
            anchors = latency_comparisons({**shape, "run": run}, m.get("gpu"))
        if anchors:
            out.append("")
            out.append("against published figures:")
            out.extend(f"  {format_comparison(row)}" for row in anchors)
        notes = [
            (c["label"], n) for c in configs for n in c.get("notes", []) if c["kind"] != "floor"
        ]
        if notes:
            out.append("")
            out.append("notes:")
            out.extend(f"  {label}: {n}" for label, n in notes)
    return "\n".join(out) + "\n"


def matplotlib_missing(advice: str) -> BackplaneError:
    """The error of a ``--plot`` without matplotlib, saying how to install it.

    :param advice: what else to do, appended (it differs before and after measuring).
    :return: the error, to raise.
    """
    return BackplaneError(
        "--plot needs matplotlib, which is not installed: pip install matplotlib "
        f"(or pip install 'backplane[bench]'){advice}"
    )


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Plot ms per output token against batch size, one panel per shape, to a PNG.

    :param result: what :func:`~backplane.cli.bench.latency.run.run_benchmark` returned
        (or its JSON, reloaded).
    :param path: the PNG to write.
    :raises BackplaneError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise matplotlib_missing("; the JSON can be plotted elsewhere with --plot-from") from None
    shapes = result["shapes"]
    m = result["machine"]
    fig, axes = plt.subplots(
        1, max(len(shapes), 1), figsize=(6.5 * max(len(shapes), 1), 4.8), squeeze=False
    )
    for ax, shape in zip(axes[0], shapes, strict=False):
        all_batches: set[int] = set()
        for c in shape["configs"]:
            pts = [
                (int(r["batch"]), r["ms_per_token"])
                for r in c.get("batches", [])
                if r.get("status") == "ok"
            ]
            if not pts:
                continue
            xs, ys = zip(*sorted(pts), strict=True)
            all_batches.update(xs)
            if c["kind"] == "floor":
                ax.plot(xs, ys, "k--", label=c["label"], linewidth=1.5)
            else:
                style = "-o" if c["kind"] == "backplane" else ":s"
                ax.plot(xs, ys, style, label=c["label"], markersize=4)
        if len(all_batches) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(all_batches))
        ax.set_xticklabels([str(b) for b in sorted(all_batches)])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per output token")
        run = _shape_run(result, shape)
        ax.set_title(
            f"{shape['name']} ({si(shape['params'], '')} params, "
            f"{run['dtype']}), prompt {run['prompt_len']}, {run['new_tokens']} new"
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode latency on {m.get('gpu') or m.get('cpu')}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)


def load_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a result written with ``--json``.

    :param path: the JSON file.
    :return: the result, as :func:`~backplane.cli.bench.latency.run.run_benchmark` returned it.
    :raises BackplaneError: unreadable, not JSON, or not such a result.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise BackplaneError(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise BackplaneError(f"{os.fspath(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not {"machine", "settings", "bandwidth", "shapes"} <= set(
        data
    ):
        raise BackplaneError(
            f"{os.fspath(path)!r} is not a result of `backplane bench latency --json` "
            "(it lacks machine/settings/bandwidth/shapes)"
        )
    return data

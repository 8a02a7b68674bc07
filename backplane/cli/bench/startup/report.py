"""The printed report of ``backplane bench startup``: one table of phases per shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PHASE_ORDER", "format_report"]

#: the phases in start-up order; a phase the engine adds later is listed after them
PHASE_ORDER = (
    "import",
    "backend selection",
    "weight load",
    "memory profiling",
    "cache allocation",
    "graph capture",
    "kernel warm-up",
    "engine setup",
    "other",
)


def _ordered(names: list[str]) -> list[str]:
    known = [p for p in PHASE_ORDER if p in names]
    return known + [n for n in names if n not in PHASE_ORDER]


def _cell(run: Mapping[str, Any], section: str, name: str) -> str:
    if run.get("status") != "ok":
        return "-"
    value = run.get(section, {}).get(name)
    return "-" if value is None else f"{value:.2f}"


def format_report(result: Mapping[str, Any]) -> str:
    """The report: per shape, seconds per phase for each cache state, the total, then details.

    :param result: what :func:`~backplane.cli.bench.startup.run.run_startup_benchmark` returned.
    :return: the text, ending with a newline.
    """
    lines: list[str] = []
    for shape in result["shapes"]:
        runs: Mapping[str, Mapping[str, Any]] = shape["runs"]
        states = list(runs)
        settings = shape.get("engine_settings", {})
        first_ok = next((r for r in runs.values() if r.get("status") == "ok"), {})
        lines.append(
            f"{shape['shape']}: {settings.get('device')} {settings.get('dtype')}, graphs "
            f"{first_ok.get('graph_mode', '?')}, backends {first_ok.get('backends', {})}"
        )
        phases = _ordered(
            list(dict.fromkeys(n for r in runs.values() for n in r.get("phases", {})))
        )
        width = max([len(p) for p in phases] + [len("total"), 12])
        lines.append(f"  {'phase (s)':<{width}}" + "".join(f" {s:>9}" for s in states))
        for name in phases:
            cells = "".join(f" {_cell(runs[s], 'phases', name):>9}" for s in states)
            lines.append(f"  {name:<{width}}{cells}")
        totals = "".join(
            f" {runs[s]['total']:>9.2f}" if runs[s].get("status") == "ok" else f" {'failed':>9}"
            for s in states
        )
        lines.append(f"  {'total':<{width}}{totals}")
        details = list(dict.fromkeys(n for r in runs.values() for n in r.get("details", {})))
        if details:
            dwidth = max(len(d) for d in details)
            lines.append("  within the phases (s):")
            for name in details:
                cells = "".join(f" {_cell(runs[s], 'details', name):>9}" for s in states)
                lines.append(f"    {name:<{dwidth}}{cells}")
        for state, run in runs.items():
            if run.get("status") != "ok":
                lines.append(f"  {state}: failed: {run.get('error')}")
        lines.append("")
    return "\n".join(lines)

"""The report of a throughput run: the printed tables and the plot."""

from __future__ import annotations

from typing import Any

from backplane.cli.bench.anchors import format_comparison, throughput_comparisons
from backplane.cli.bench.workload import (
    print_table,
)


def format_header(result: dict[str, Any]) -> str:
    """The lines that say what was measured: machine, model, engine and workload.

    :param result: :func:`run_throughput`'s result.
    :return: the text, ending with a newline.
    """
    m, mod, eng, w = result["machine"], result["model"], result["engine"], result["workload"]
    cfg = eng["config"]
    where = m["gpu"] or f"{m['cpu']} ({m['cores']} cores)"
    backends = ", ".join(f"{f}={b}" for f, b in eng["backends"].items())
    p, o = w["prompt_tokens"], w["output_tokens"]
    lines = [
        f"machine: {where}, torch {m['torch']}",
        f"model: {mod['name']} ({mod['architecture']}), {cfg['dtype']} on {cfg['device']}",
        f"engine: {backends}; cuda_graphs {cfg['cuda_graphs']}, max_num_seqs "
        f"{cfg['max_num_seqs']}, max_num_tokens {cfg['max_num_tokens']}, max_model_len "
        f"{eng['max_model_len']}",
        f"requests: {w['num_prompts']} ({w['mix']}, seed {w['seed']}); prompt tokens mean "
        f"{p['mean']:.0f} (min {p['min']}, max {p['max']}), output tokens mean {o['mean']:.0f} "
        f"(min {o['min']}, max {o['max']})",
    ]
    return "\n".join(lines) + "\n"


def print_report(result: dict[str, Any]) -> None:
    """Print the run: header, one line per rate, transformers, decode-only.

    :param result: :func:`run_throughput`'s result.
    """
    print(format_header(result))
    print_table(result["rates"])
    for r in result["rates"]:
        if not r["exact_lengths"]:
            print(f"rate {r['rate']}: some requests did not produce exactly their output length")
    anchors = result.get("anchors")
    if anchors is None:
        anchors = throughput_comparisons(result)
    if anchors:
        print("\nagainst published figures (rate inf):")
        for row in anchors:
            print(f"  {format_comparison(row)}")
    hf = result["transformers"]
    print()
    if hf["status"] == "ok":
        ratio = hf.get("backplane_ratio")
        print(
            f"transformers generate, {hf['batch']} requests at once (padded to "
            f"{hf['padded_prompt_len']}): {hf['output_token_throughput']:.1f} output tok/s, "
            f"{hf['total_token_throughput']:.1f} total tok/s"
            + (f"; backplane at inf: {ratio:.2f}x" if ratio is not None else "")
        )
    else:
        print(f"transformers: {hf['status']} ({hf.get('reason')})")
    dec = result["decode"]
    if dec["batches"]:
        print(
            f"\ndecode-only: prompt {dec['prompt_len']} tokens, {dec['steps']} steps per sequence"
        )
        print(f"{'batch':>6} {'ms/step':>9} {'tok/s':>10} {'floor ms':>9} {'x floor':>8}")
        for row in dec["batches"]:
            if row["status"] != "ok":
                print(f"{row['batch']:>6} {row['status']}: {row.get('reason')}")
                continue
            floor = row.get("floor_ms_per_step")
            print(
                f"{row['batch']:>6} {row['ms_per_step']:>9.3f} {row['tokens_per_s']:>10.1f} "
                + (f"{floor:>9.3f} {row['x_floor']:>8.2f}" if floor is not None else "")
            )
        if dec["floor_skipped"]:
            print(f"floor: skipped ({dec['floor_skipped']})")
        elif dec["bandwidth"]:
            print(f"floor: read bandwidth {dec['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")


def matplotlib_reason() -> str | None:
    """Why no plot can be drawn here (``None``: matplotlib imports)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install 'backplane[bench]'"
    return None


def write_plot(result: dict[str, Any], path: str) -> None:
    """Plot output tokens/s against request rate and against decode batch size.

    :param result: :func:`run_throughput`'s result.
    :param path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rates"]
    decode = [r for r in result["decode"]["batches"] if r["status"] == "ok"]
    panels = 1 + bool(decode)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    x = list(range(len(rows)))
    ax.plot(x, [r["output_token_throughput"] for r in rows], "o-", label="backplane")
    hf = result["transformers"]
    if hf["status"] == "ok":
        at = next((i for i, r in enumerate(rows) if r["rate"] == "inf"), len(rows) - 1)
        ax.plot([at], [hf["output_token_throughput"]], "s", label="transformers generate")
    ax.set_xticks(x, [str(r["rate"]) for r in rows])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['workload']['num_prompts']} requests ({result['workload']['mix']})")
    ax.legend()
    ax.grid(alpha=0.3)
    if decode:
        ax = axes[0][1]
        bs = [r["batch"] for r in decode]
        ax.plot(bs, [r["tokens_per_s"] for r in decode], "o-", label="backplane")
        if all("floor_tokens_per_s" in r for r in decode):
            ax.plot(bs, [r["floor_tokens_per_s"] for r in decode], "k--", label="HBM floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"decode only, {result['decode']['steps']} steps")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']['name']}, {result['engine']['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

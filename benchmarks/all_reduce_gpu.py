"""Time the small all-reduces of tensor-parallel decode: NCCL against a one-shot all-reduce.

Two (or ``--gpus``) processes, one GPU each, sum a ``[1, hidden]`` bfloat16 row
(a batch-1 row-parallel output) with

* NCCL (``torch.distributed.all_reduce``), what the engine uses;
* PyTorch's symmetric-memory one-shot all-reduce
  (``torch.ops.symm_mem.one_shot_all_reduce_out``: every rank reads its peers'
  buffers over NVLink and sums them in one kernel, no NVLink multicast needed),
* the engine's own one-shot kernel
  (:class:`~backplane.engine.distributed.one_shot.OneShotAllReduce`: the same
  idea in one Triton kernel that copies the input in itself and launches as a
  programmatic dependent),

first eagerly, one call after another, then as a decode step would run them: a
CUDA graph of ``--layers`` x (one ``hidden x hidden`` product, one all-reduce),
replayed after an eager NCCL broadcast as the engine sends a step's inputs.
Each graph's output is checked against the same chain run eagerly with NCCL.
Prints microseconds per call (eager) and per replayed step (graph); rank 0's
lines only.

    python benchmarks/all_reduce_gpu.py              # two GPUs, hidden 4096, 64 layers
    python benchmarks/all_reduce_gpu.py --gpus 4 --hidden 8192
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backplane.engine.distributed.one_shot import OneShotAllReduce
from backplane.engine.worker.graph.capture import CapturedGraph, capture


def _time(fn: Callable[[], object], n: int) -> float:
    """Microseconds per call of ``fn``, the device drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def _one_shot(group_name: str, device: torch.device, numel: int) -> Callable[[torch.Tensor], None]:
    """An in-place one-shot all-reduce through a symmetric buffer of ``numel`` elements."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buffer, group_name)

    def all_reduce(x: torch.Tensor) -> None:
        flat = x.view(-1)
        buffer[: flat.numel()].copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group_name, out=flat)

    all_reduce.handle = handle  # type: ignore[attr-defined]  # keeps the peers' mappings
    return all_reduce


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=args.gpus, device_id=device)
    say = print if rank == 0 else (lambda *a: None)
    x = torch.full((1, args.hidden), float(rank + 1), dtype=torch.bfloat16, device=device)
    ways: dict[str, Callable[[torch.Tensor], object]] = {
        "nccl": lambda t: dist.all_reduce(t),
        "one-shot": _one_shot(dist.group.WORLD.group_name, device, args.hidden),
        "ours": OneShotAllReduce(dist.group.WORLD, rank, args.gpus, device),
    }
    want = args.gpus * (args.gpus + 1) / 2
    for name, all_reduce in ways.items():
        y = x.clone()
        all_reduce(y)
        torch.cuda.synchronize()
        if not bool((y == want).all()):
            raise RuntimeError(f"{name}: the sum of 1..{args.gpus} came out wrong")
        us = _time(lambda ar=all_reduce, t=y: ar(t), args.calls)
        say(f"eager {name:9s} {us:8.2f} us per all-reduce")

    weight = torch.randn(args.hidden, args.hidden, dtype=torch.bfloat16, device=device) * 0.01
    row = torch.randn(1, args.hidden, generator=torch.Generator().manual_seed(0))
    step_inputs = torch.zeros(64, dtype=torch.int32, device=device)
    for name, all_reduce in ways.items():
        inp = x.clone()

        def chain(
            ar: Callable[[torch.Tensor], object] = all_reduce, h: torch.Tensor = inp
        ) -> torch.Tensor:
            for _ in range(args.layers):
                h = h @ weight
                ar(h)
            return h

        # captured as the engine captures its decode steps (one warm-up run on a side stream)
        graph = capture(chain, None, ())
        out = graph.outputs

        def step(g: CapturedGraph = graph) -> None:
            dist.broadcast(step_inputs, src=0)
            g.replay()

        us = _time(step, args.steps)
        inp.copy_(row.to(inp))
        graph.replay()
        ref = chain(ways["nccl"])
        torch.cuda.synchronize()
        diff = float((out - ref).abs().max())
        say(
            f"graph {name:9s} {us:8.1f} us per step of {args.layers} products + all-reduces "
            f"({us / args.layers:.2f} us per layer; max diff to eager NCCL {diff:.1e})"
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Parse the arguments and start one process per GPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="processes, one GPU each")
    parser.add_argument("--hidden", type=int, default=4096, help="row width (elements)")
    parser.add_argument("--layers", type=int, default=64, help="all-reduces per graph step")
    parser.add_argument("--calls", type=int, default=2000, help="eager calls timed")
    parser.add_argument("--steps", type=int, default=300, help="graph replays timed")
    parser.add_argument("--port", type=int, default=29533, help="rendezvous port")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        parser.error(f"needs {args.gpus} CUDA devices, found {torch.cuda.device_count()}")
    mp.spawn(_worker, args=(args,), nprocs=args.gpus)


if __name__ == "__main__":
    main()

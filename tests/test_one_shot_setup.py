"""The one-shot all-reduce is set up a stage at a time on every rank: a rank that fails a stage
stops the others before the next stage's collective, and all of them report the same failure.

The stages' agreement (:func:`~backplane.engine.distributed.one_shot.run_in_stages`) runs on
two gloo processes with stand-in stages; the real stages (symmetric memory, the kernel) are
GPU-tested in ``test_one_shot_all_reduce_gpu.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from process_helpers import free_port

WORLD = 2
STAGES = ("devices", "allocation", "mapping", "check")


def _rank_main(rank: int, port: int, folder: str, fail_rank: int, fail_stage: str, how: str):
    from backplane.engine.distributed.one_shot import run_in_stages

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    ran: list[str] = []

    def stage(name: str):
        def run() -> str | None:
            ran.append(name)
            if rank == fail_rank and name == fail_stage:
                if how == "raise":
                    raise OSError("no symmetric memory here")
                return "not this GPU"
            return None

        return run

    try:
        failed = run_in_stages(dist.group.WORLD, rank, WORLD, [(n, stage(n)) for n in STAGES])
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"ran": ran, "failed": failed}))


def _run(tmp_path: Path, fail_rank: int, fail_stage: str, how: str) -> list[dict]:
    mp.spawn(
        _rank_main,
        args=(free_port(), str(tmp_path), fail_rank, fail_stage, how),
        nprocs=WORLD,
        join=True,
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    ("fail_stage", "how"), [("allocation", "raise"), ("devices", "reason"), ("check", "raise")]
)
def test_a_stage_failed_on_one_rank_stops_every_rank_before_the_next(tmp_path, fail_stage, how):
    results = _run(tmp_path, fail_rank=1, fail_stage=fail_stage, how=how)
    upto = list(STAGES[: STAGES.index(fail_stage) + 1])
    why = "OSError: no symmetric memory here" if how == "raise" else "not this GPU"
    for result in results:
        # the healthy rank ran the failed stage too, and nothing after it
        assert result["ran"] == upto
        assert result["failed"] == f"rank 1, {fail_stage}: {why}"


def test_every_stage_runs_everywhere_when_none_fails(tmp_path):
    for result in _run(tmp_path, fail_rank=-1, fail_stage="", how="raise"):
        assert result["ran"] == list(STAGES) and result["failed"] is None

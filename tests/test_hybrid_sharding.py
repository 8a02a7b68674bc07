"""Tensor-parallel hybrid models: Mamba2 and gated delta-rule layers split over two ranks.

For each case the parent builds the model with one rank and random float32
weights and runs a fixed schedule of steps through it: a ragged prefill (one
prompt longer than the Mamba2 chunk), a chunked-prefill continuation mixed
with decodes, then all-decode steps, so every recurrent state must carry over
between steps. Two CPU processes joined by gloo then build the same model
with ``tensor_parallel_size`` 2, each loading its shard of the same weights
from the unsharded checkpoint tensors (and, a second time, drawing its slice
of the same random weights), and run the same schedule. Every rank's logits
must equal the one-rank logits, and each rank's recurrent layers must hold
only its share of the heads (parameters and state caches).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_run_helpers import run_schedule, torch_backends
from process_helpers import free_port

from backplane.core.errors import ConfigError
from backplane.core.parallel import TensorParallel, set_tensor_parallel
from backplane.models.base import CausalLM, ModelConfig, build_model
from backplane.models.mixers import GatedDeltaNetMixer, Mamba2Mixer
from backplane.models.presets import PRESETS
from backplane.models.registry import model_class

PAGE_SIZE = 4
WORLD = 2
FAMILIES = ("attention", "ssm", "delta")


def _qwen3_5_config() -> dict[str, Any]:
    """Qwen3.5 (separate DeltaNet projections, dense MLP) on the tiny Qwen3-Next shapes."""
    cfg = {
        k: v
        for k, v in PRESETS["tiny-qwen3-next"].items()
        if not k.startswith(("num_experts", "moe_", "shared_expert", "decoder_sparse", "mlp_only"))
    }
    cfg.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5")
    return cfg


#: case -> config. The variants cover both ways a rank's heads find their
#: group: groups (Mamba2) and key heads (delta rule) split over the ranks, or
#: fewer of them than ranks, so each rank holds a copy of the one its heads use.
CASES: dict[str, dict[str, Any]] = {
    "nemotron_h": dict(PRESETS["tiny-nemotron-h"]),
    "nemotron_h-one-group": {**PRESETS["tiny-nemotron-h"], "n_groups": 1},
    "qwen3_next": dict(PRESETS["tiny-qwen3-next"]),
    "qwen3_next-one-key-head": {**PRESETS["tiny-qwen3-next"], "linear_num_key_heads": 1},
    "qwen3_5": _qwen3_5_config(),
    "qwen3_5-one-key-head": {**_qwen3_5_config(), "linear_num_key_heads": 1},
}

#: (sequence, new tokens) per step: prefills and extends first, decodes last.
#: Sequence 0's prompt (21 tokens) spans two Mamba2 chunks of 16.
SCHEDULE: list[list[tuple[int, int]]] = [
    [(0, 21), (1, 7)],
    [(2, 6), (0, 1), (1, 1)],
    [(2, 5), (0, 1), (1, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
]
NUM_SEQS = 3
#: the one-rank model's random weights, which each rank draws too and keeps its slice of
RANDOM_WEIGHTS = {"seed": 11, "std": 0.1}


def _backends() -> dict[str, Any]:
    """The torch backend of every family the hybrid models use."""
    return torch_backends(FAMILIES)


def _build(config: dict[str, Any]) -> CausalLM:
    """The model of ``config`` in float32 on the CPU, split over this process's group."""
    cfg = ModelConfig(config)
    return build_model(
        model_class(cfg.architecture), cfg, _backends(), dtype=torch.float32, device="cpu"
    )


def _checkpoint(lm: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names, as unsharded tensors."""
    out = {}
    for name, (view, index) in lm.weight_targets().items():
        out[name] = (view if index is None else view[index]).clone()
    return out


def _run_schedule(lm: CausalLM, tokens: dict[int, list[int]]) -> list[torch.Tensor]:
    """Run :data:`SCHEDULE` with fresh caches; return each step's logits ``[tokens, vocab]``."""
    rng = np.random.default_rng(7)
    total = {s: sum(n for step in SCHEDULE for q, n in step if q == s) for s in range(NUM_SEQS)}
    per_seq = -(-max(total.values()) // PAGE_SIZE)
    num_pages = NUM_SEQS * per_seq + 2
    pool = rng.permutation(np.arange(1, num_pages))
    tables = [pool[i * per_seq : (i + 1) * per_seq] for i in range(NUM_SEQS)]
    slots = rng.permutation(np.arange(1, NUM_SEQS + 3))[:NUM_SEQS]
    lm.allocate_caches(
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_slots=NUM_SEQS + 3,
        dtype=torch.float32,
        device="cpu",
    )
    return run_schedule(
        lm,
        _backends(),
        SCHEDULE,
        tables=tables,
        slots=slots,
        page_size=PAGE_SIZE,
        step_ids=lambda step, lens: torch.tensor(
            [t for s, n in step for t in tokens[s][lens[s] : lens[s] + n]], dtype=torch.int64
        ),
    )


def _tokens(vocab: int) -> dict[int, list[int]]:
    """Fixed random tokens for every sequence of :data:`SCHEDULE`."""
    g = torch.Generator().manual_seed(3)
    return {s: torch.randint(0, vocab, (40,), generator=g).tolist() for s in range(NUM_SEQS)}


def _local_shapes(lm: CausalLM) -> list[dict[str, Any]]:
    """Per recurrent layer: its head counts and the shapes of its caches and parameters."""
    rows = []
    specs = lm.cache_specs(num_pages=4, page_size=PAGE_SIZE, num_slots=2, dtype=torch.float32)
    for name, m in lm.cached_layers():
        if isinstance(m, (Mamba2Mixer, GatedDeltaNetMixer)):
            rows.append(
                {
                    "layer": name,
                    "caches": {k: tuple(s.shape) for k, s in specs[name].items()},
                    "params": {k: tuple(p.shape) for k, p in m.named_parameters()},
                }
            )
    return rows


def _rank_main(rank: int, port: int, workdir: str) -> None:
    """One rank: join the gloo group, build the sharded model, load, run, write the logits."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        torch.manual_seed(0)
        job = torch.load(Path(workdir) / "job.pt", weights_only=False)
        set_tensor_parallel(TensorParallel(rank=rank, size=WORLD, group=dist.group.WORLD))
        lm = _build(job["config"])
        lm.load_weights(job["checkpoint"].items(), strict=True)
        drawn = _build(job["config"])
        drawn.init_random_weights_(**RANDOM_WEIGHTS)
        result = {
            "logits": _run_schedule(lm, job["tokens"]),
            "drawn_logits": _run_schedule(drawn, job["tokens"]),
            "shapes": _local_shapes(lm),
        }
        torch.save(result, Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, as the engine's workers do: torch's
    # communicator threads can abort a process while static objects are destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _halved(full: tuple[int, ...], local: tuple[int, ...]) -> bool:
    """Whether ``local`` is ``full`` with exactly one dimension halved."""
    if len(full) != len(local):
        return False
    diff = [i for i, (a, b) in enumerate(zip(full, local, strict=True)) if a != b]
    return len(diff) == 1 and full[diff[0]] == 2 * local[diff[0]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_the_logits_of_one(case: str, tmp_path: Path) -> None:
    """Two gloo ranks, each with its shard, give the one-rank logits at every step."""
    config = CASES[case]
    lm = _build(config)
    lm.init_random_weights_(**RANDOM_WEIGHTS)
    tokens = _tokens(lm.vocab_size)
    want = _run_schedule(lm, tokens)
    full_shapes = _local_shapes(lm)
    torch.save(
        {"config": config, "checkpoint": _checkpoint(lm), "tokens": tokens}, tmp_path / "job.pt"
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)

    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # Loaded from the checkpoint, or drawn at random as one rank draws them:
        # the same weights either way.
        for how in ("logits", "drawn_logits"):
            assert len(got[how]) == len(want)
            for step, (g, w) in enumerate(zip(got[how], want, strict=True)):
                scale = w.abs().max().item()
                torch.testing.assert_close(
                    g,
                    w,
                    rtol=1e-5,
                    atol=1e-5 * scale,
                    msg=lambda m, s=step, r=rank, h=how: f"rank {r} step {s} ({h}): {m}",
                )
        # Each rank's recurrent layers hold half the heads: its recurrent
        # states and head-indexed parameters are half the one-rank model's, and
        # its conv state holds its heads' channels and the groups they read.
        assert [r["layer"] for r in got["shapes"]] == [r["layer"] for r in full_shapes]
        for local, full in zip(got["shapes"], full_shapes, strict=True):
            layer = local["layer"]
            for cache in ("ssm_state", "delta_state"):
                if cache in full["caches"]:
                    assert _halved(full["caches"][cache], local["caches"][cache]), (layer, cache)
            assert local["caches"]["conv_state"][1] == _local_conv_channels(config), layer
            for param in ("A_log", "dt_bias", "out_proj.weight"):
                assert _halved(full["params"][param], local["params"][param]), (layer, param)


def _local_conv_channels(config: dict[str, Any]) -> int:
    """A rank's conv channels: its half of the heads' channels, and its share of the
    groups (Mamba2 B and C) or key heads (delta q and k), at least one."""
    if "mamba_num_heads" in config:
        groups = max(config["n_groups"] // WORLD, 1)
        inner = config["mamba_num_heads"] * config["mamba_head_dim"] // WORLD
        return inner + 2 * groups * config["ssm_state_size"]
    k_heads = max(config["linear_num_key_heads"] // WORLD, 1)
    v_heads = config["linear_num_value_heads"] // WORLD
    return 2 * k_heads * config["linear_key_head_dim"] + v_heads * config["linear_value_head_dim"]


@pytest.mark.parametrize(
    ("case", "key", "value", "named"),
    [
        ("nemotron_h", "n_groups", 3, "n_groups"),
        ("nemotron_h", "mamba_num_heads", 6, "mamba_num_heads"),
        ("qwen3_next", "linear_num_key_heads", 3, "linear_num_key_heads"),
        ("qwen3_5", "linear_num_value_heads", 6, "linear_num_value_heads"),
    ],
)
def test_a_split_that_does_not_fit_is_a_config_error(
    case: str, key: str, value: int, named: str
) -> None:
    """Heads or groups that four ranks can neither split nor copy: an error naming the
    config field and tensor_parallel_size."""
    config = {**CASES[case], key: value}
    if key == "linear_num_key_heads":
        config["linear_num_value_heads"] = 2 * value
    previous = set_tensor_parallel(TensorParallel(rank=1, size=4))
    try:
        with pytest.raises(ConfigError, match=named) as err:
            _build(config)
    finally:
        set_tensor_parallel(previous)
    assert "tensor_parallel_size" in str(err.value)

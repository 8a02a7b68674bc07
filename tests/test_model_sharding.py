"""Tensor-parallel dense attention, MLA and MoE models: two ranks give the logits of one.

For each case the parent builds the model with one rank (float32, random
preset weights or a saved checkpoint) and runs a fixed schedule of steps: a
ragged prefill, a chunked-prefill continuation mixed with decodes, then
all-decode steps. Two CPU processes joined by gloo then build the same model
with a tensor-parallel group of two, each drawing or loading only its shard,
and run the same schedule. Every rank's logits (of the full vocabulary) must
equal the one-rank logits, and each rank must hold only its share of the heads.

Checkpoints come from tiny transformers models: saved with ``save_pretrained``
(each rank reads its slices of the safetensors tensors) and written as GGUF
(dequantised, then sliced).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_run_helpers import run_schedule, torch_backends
from process_helpers import free_port
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.parallel import TensorParallel, set_tensor_parallel
from backplane.models import load_model, loader
from backplane.models.base import CausalLM, ModelConfig, build_model
from backplane.models.linear import Linear, MergedLinear
from backplane.models.loader import iter_safetensors
from backplane.models.mixers import AttentionMixer, MLAMixer
from backplane.models.moe import MoE
from backplane.models.parallel import PartShard, ShardSlice
from backplane.models.presets import PRESETS
from backplane.models.registry import model_class

PAGE_SIZE = 4
WORLD = 2
FAMILIES = ("attention", "mla")

#: preset cases (random weights drawn from one seed): case -> config
PRESET_CASES: dict[str, dict[str, Any]] = {
    "llama": dict(PRESETS["tiny-llama"]),
    # One key/value head for two ranks: each rank keeps a copy of it.
    "llama-one-kv-head": {**PRESETS["tiny-llama"], "num_key_value_heads": 1},
    "llama-tied": {**PRESETS["tiny-llama"], "tie_word_embeddings": True},
    # MLA with q_lora_rank, a dense first layer, then MoE with a shared expert.
    "deepseek_v3": dict(PRESETS["tiny-deepseek-v3"]),
}

#: checkpoint cases: case -> (hf_tiny config factory, transformers class, format)
CHECKPOINT_CASES: dict[str, tuple[str, str, str]] = {
    "llama-safetensors": ("llama", "LlamaForCausalLM", "safetensors"),
    "qwen3-safetensors": ("qwen3", "Qwen3ForCausalLM", "safetensors"),
    # A plain q_proj (split) beside a biased kv_a_proj_with_mqa (replicated).
    "deepseek_v3-q-proj-bias-safetensors": (
        "deepseek_v3_q_proj_bias",
        "DeepseekV3ForCausalLM",
        "safetensors",
    ),
    "llama-gguf": ("llama", "LlamaForCausalLM", "gguf"),
}

#: (sequence, new tokens) per step: prefills and extends first, decodes last
SCHEDULE: list[list[tuple[int, int]]] = [
    [(0, 9), (1, 5)],
    [(2, 6), (0, 1), (1, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
]
NUM_SEQS = 3


def _backends() -> dict[str, Any]:
    return torch_backends(FAMILIES)


def _build(source: dict[str, Any] | str) -> CausalLM:
    """The model of a case: a preset config with seed-0 weights, or a checkpoint path."""
    if isinstance(source, str):
        return load_model(
            source, dtype="float32", device="cpu", backends=_backends(), progress=False
        ).model
    config = ModelConfig(source)
    lm = build_model(
        model_class(config.architecture), config, _backends(), dtype=torch.float32, device="cpu"
    )
    lm.init_random_weights_(seed=0)
    return lm


def _run(lm: CausalLM) -> list[torch.Tensor]:
    """Run :data:`SCHEDULE` through ``lm``; return each step's logits ``[tokens, vocab]``."""
    backends = _backends()
    rng = np.random.default_rng(7)
    pages_per_seq = 8
    num_pages = NUM_SEQS * pages_per_seq + 1
    pool = rng.permutation(np.arange(1, num_pages))  # page 0 is reserved
    tables = [pool[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(NUM_SEQS)]
    lm.allocate_caches(
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_slots=NUM_SEQS + 1,
        dtype=torch.float32,
        device="cpu",
    )
    return run_schedule(
        lm,
        backends,
        SCHEDULE,
        tables=tables,
        slots=[s + 1 for s in range(NUM_SEQS)],
        page_size=PAGE_SIZE,
        step_ids=lambda step, lens: torch.from_numpy(
            rng.integers(0, lm.vocab_size, sum(n for _, n in step))
        ).long(),
    )


def _heads(lm: CausalLM) -> list[tuple[int, ...]]:
    """Per cached layer: the heads the layer and the spec its backend sizes caches from hold."""
    held = []
    for _, m in lm.cached_layers():
        if isinstance(m, AttentionMixer):
            held.append((m.num_heads, m.num_kv_heads, m.spec.num_heads, m.spec.num_kv_heads))
        elif isinstance(m, MLAMixer):
            held.append((m.num_heads, m.spec.num_heads, m.w_uk.shape[0]))
    return held


def _sources(folder: Path) -> dict[str, dict[str, Any] | str]:
    """Every case's source; checkpoints are written into ``folder``."""
    transformers = pytest.importorskip("transformers")
    import hf_tiny

    sources: dict[str, dict[str, Any] | str] = dict(PRESET_CASES)
    for case, (factory, cls_name, fmt) in CHECKPOINT_CASES.items():
        torch.manual_seed(1234)
        cfg = getattr(hf_tiny, factory)()
        cfg.initializer_range = 0.15
        model = getattr(transformers, cls_name)(cfg).eval()
        with torch.no_grad():
            # Non-trivial norms and biases, so a mis-sliced one shows.
            gen = torch.Generator().manual_seed(99)
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        path = folder / case
        if fmt == "gguf":
            pytest.importorskip("gguf")
            from gguf_helpers import write_gguf

            path.mkdir()
            sources[case] = str(write_gguf(model, path / "model.gguf", "llama"))
        else:
            model.save_pretrained(path)
            sources[case] = str(path)
    return sources


def _rank_main(rank: int, port: int, folder: str) -> None:
    """One rank: build every case with the two-rank group, save its logits and heads."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    previous = set_tensor_parallel(TensorParallel(rank, WORLD, dist.group.WORLD))
    read: dict[str, tuple[int, ...]] = {}
    original = loader.iter_safetensors

    def spy(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        # The shapes the files gave, to tell slices read from whole tensors cut later.
        for name, tensor in original(*args, **kwargs):
            read[name] = tuple(tensor.shape)
            yield name, tensor

    loader.iter_safetensors = spy
    try:
        sources = torch.load(Path(folder) / "sources.pt", weights_only=False)
        results = {}
        for case, source in sources.items():
            read.clear()
            lm = _build(source)
            results[case] = {
                "logits": _run(lm),
                "heads": _heads(lm),
                "embedding_rows": lm.embed_tokens.weight.shape[0],
                "read": dict(read),
            }
        torch.save(results, Path(folder) / f"rank{rank}.pt")
    finally:
        loader.iter_safetensors = original
        set_tensor_parallel(previous)
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, as the engine's workers do: torch's
    # communicator threads can abort a process while static objects are destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """``{"sources", "reference": {case: one-rank results}, "ranks": [per rank results]}``."""
    folder = tmp_path_factory.mktemp("sharding")
    sources = _sources(folder)
    torch.save(sources, folder / "sources.pt")
    reference = {}
    for case, source in sources.items():
        lm = _build(source)
        reference[case] = {"logits": _run(lm), "heads": _heads(lm)}
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.spawn(_rank_main, args=(free_port(), str(folder)), nprocs=WORLD, join=True)
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"sources": sources, "reference": reference, "ranks": ranks}


@pytest.mark.parametrize("case", [*PRESET_CASES, *CHECKPOINT_CASES])
def test_two_ranks_give_the_logits_of_one(runs: dict[str, Any], case: str) -> None:
    """Every rank's logits of every step equal the one-rank model's, over the full vocabulary."""
    expected = runs["reference"][case]["logits"]
    for rank, results in enumerate(runs["ranks"]):
        got = results[case]["logits"]
        assert len(got) == len(expected)
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g.shape == e.shape, f"rank {rank} step {step}"
            scale = float(e.abs().max())
            torch.testing.assert_close(
                g,
                e,
                rtol=1e-5,
                atol=1e-5 * scale,
                msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}",
            )
            # Greedy choice is the one-rank model's.
            assert torch.equal(g.argmax(-1), e.argmax(-1))


@pytest.mark.parametrize("case", [*PRESET_CASES, *CHECKPOINT_CASES])
def test_each_rank_holds_its_share_of_heads_and_vocabulary(runs: dict[str, Any], case: str) -> None:
    """Attention / MLA layers hold half the query heads, and KV heads split or one replicated."""
    one = runs["reference"][case]["heads"]
    for results in runs["ranks"]:
        held = results[case]["heads"]
        assert len(held) == len(one) > 0
        for mine, full in zip(held, one, strict=True):
            if len(full) == 4:  # attention: heads, kv heads (layer and spec)
                assert mine[0] == mine[2] == full[0] // WORLD
                assert mine[1] == mine[3] == max(1, full[1] // WORLD)
            else:  # MLA: heads of the layer, the spec and the w_uk split
                assert mine == tuple(n // WORLD for n in full)
        vocab = runs["reference"][case]["logits"][0].shape[-1]
        assert results[case]["embedding_rows"] == vocab // WORLD


# -- one process ------------------------------------------------------------------------


@contextmanager
def _as_rank(rank: int, size: int) -> Iterator[None]:
    """Build layers as ``rank`` of ``size`` (no collective runs while building)."""
    previous = set_tensor_parallel(TensorParallel(rank, size, None))
    try:
        yield
    finally:
        set_tensor_parallel(previous)


def test_one_rank_builds_the_plain_modules() -> None:
    """With one rank the model is made of the single-device classes, nothing parallel."""
    lm = _build(dict(PRESETS["tiny-deepseek-v3"]))
    assert type(lm.embed_tokens) is nn.Embedding
    assert type(lm.lm_head) is Linear
    layer = lm.model.layers[0]
    assert type(layer.self_attn.fused_qkv_a_proj) is MergedLinear
    assert type(layer.self_attn.o_proj) is Linear
    assert type(layer.mlp.gate_up_proj) is MergedLinear
    assert type(layer.mlp.down_proj) is Linear
    assert not lm.param_shards() and not lm.weight_shards()
    llama = _build(dict(PRESETS["tiny-llama"]))
    attn = llama.model.layers[0].self_attn
    assert type(attn.qkv_proj) is MergedLinear and type(attn.o_proj) is Linear


def test_indivisible_heads_are_refused_with_the_fix() -> None:
    """SmolLM2's 9 heads over 2 ranks: a configuration error naming the count and the setting."""
    config = {
        **PRESETS["tiny-llama"],
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 72,
        "head_dim": 8,
    }
    with _as_rank(0, WORLD), pytest.raises(ConfigError) as err:
        _build(config)
    assert "attention heads 9 cannot be split evenly over 2 tensor-parallel ranks" in str(err.value)
    assert "tensor_parallel_size" in str(err.value)


def test_kv_heads_neither_split_nor_replicable_are_refused() -> None:
    """3 KV heads on 4 ranks: neither an even split nor one whole copy per rank."""
    config = {**PRESETS["tiny-llama"], "num_attention_heads": 12, "num_key_value_heads": 3}
    with _as_rank(0, 4), pytest.raises(ConfigError, match="3 key/value heads can neither be split"):
        _build(config)


def test_rank_draws_its_slice_of_the_one_rank_random_weights() -> None:
    """Rank 0 of 2 holds rows [q_0; k_0; v_0] of the one-rank q/k/v weights and half the down
    columns; rank 1 holds the second half of every expert's gate, up and down channels."""
    whole = _build(dict(PRESETS["tiny-llama"])).model.layers[1]
    with _as_rank(0, WORLD):
        mine = _build(dict(PRESETS["tiny-llama"])).model.layers[1]
    q, kv = 4 * 16, 2 * 16
    full = whole.self_attn.qkv_proj.weight
    expected = torch.cat([full[: q // 2], full[q : q + kv // 2], full[q + kv : q + kv + kv // 2]])
    assert torch.equal(mine.self_attn.qkv_proj.weight, expected)
    assert torch.equal(mine.mlp.down_proj.weight, whole.mlp.down_proj.weight[:, :64])
    assert torch.equal(mine.self_attn.o_proj.weight, whole.self_attn.o_proj.weight[:, : q // 2])

    whole_moe = _build(dict(PRESETS["tiny-deepseek-v3"])).model.layers[-1].mlp
    with _as_rank(1, WORLD):
        moe = _build(dict(PRESETS["tiny-deepseek-v3"])).model.layers[-1].mlp
    assert isinstance(moe, MoE) and isinstance(whole_moe, MoE)
    inter = whole_moe.intermediate_size
    half = inter // 2
    gu = whole_moe.experts_gate_up
    assert torch.equal(
        moe.experts_gate_up, torch.cat([gu[:, half:inter], gu[:, inter + half :]], 1)
    )
    assert torch.equal(moe.experts_down, whole_moe.experts_down[:, :, half:])
    assert torch.equal(moe.gate.weight, whole_moe.gate.weight)


def test_safetensors_reads_only_the_slice(tmp_path: Path) -> None:
    """A sliced tensor comes out of the file as the slice; a mis-shaped one whole."""
    from safetensors.torch import save_file

    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    b = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    save_file({"a": a, "b": b}, str(tmp_path / "m.safetensors"))
    shards = {"a": ShardSlice(1, PartShard(4, 2, 4)), "b": ShardSlice(0, PartShard(4, 0, 2))}
    got = dict(iter_safetensors([tmp_path / "m.safetensors"], progress=False, shard_of=shards.get))
    assert torch.equal(got["a"], a[:, 2:4])
    assert torch.equal(got["b"], b)  # dim 0 has 2 rows, not the 4 the shard expects


def test_ranks_read_only_their_slices_of_safetensors(runs: dict[str, Any]) -> None:
    """Split tensors come out of the files as the rank's slice; replicated ones whole."""
    from safetensors import safe_open

    for case, (_, _, fmt) in CHECKPOINT_CASES.items():
        if fmt != "safetensors":
            continue
        with safe_open(str(Path(runs["sources"][case]) / "model.safetensors"), "pt") as f:
            full = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        for results in runs["ranks"]:
            read = results[case]["read"]
            assert set(read) == set(full)
            for name, shape in read.items():
                if name.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")):
                    assert shape == (full[name][0] // WORLD, full[name][1]), name
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    assert shape == (full[name][0], full[name][1] // WORLD), name
                elif "norm" in name or "kv_a_proj_with_mqa" in name or ".gate.weight" in name:
                    assert shape == full[name], name

"""FP8 checkpoints on tensor-parallel ranks: every rank's scales are those of its weight shard.

Three levels (the first two catch wrong scales the third would miss):

* :func:`~backplane.models.quant.loading.shard_row_scales` alone: for every
  scale layout and every kind of cut (rows of a column-parallel shard, merged
  parts with replicated key/value heads, several row slices of one tensor,
  columns of a row-parallel shard, on and off the 128-column blocks), each
  rank's shard times its scales equals the same cut of the whole weight times
  the checkpoint's scales, element by element in float64 (exact: an e4m3 value
  times a float32 scale fits a float64).
* a model loaded as each rank of two (no collectives run while loading): every
  tensor of the FP8 checkpoint, as the rank holds it (FP8 with its row-form
  scales, or dequantised where it stays in full precision: MoE experts, MLA's
  ``kv_b_proj``, row-parallel shards that cut the scale blocks), equals the
  rank's cut of the whole dequantised tensor, exactly.
* the engine, two gloo ranks against one on the same checkpoint: the same
  greedy tokens and log-probabilities within :data:`MAX_LOGPROB_DIFF`. This
  alone would not catch a wrong scale (an RMS norm hides a uniform factor on a
  layer's output), hence the two above.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_fp8_models import _backends, _float_state, _fp8_checkpoints, _greedy_with_logprobs

from backplane.core.parallel import TensorParallel, set_tensor_parallel
from backplane.models import load_model
from backplane.models.base import CausalLM, ModelConfig, build_model
from backplane.models.linear import Linear, MergedLinear
from backplane.models.parallel import ParamShard, PartShard, ShardSlice, kv_head_shard
from backplane.models.presets import PRESETS
from backplane.models.quant.fp8 import FP8_DTYPE, dequantize_rows, quantize_weight
from backplane.models.quant.loading import shard_row_scales
from backplane.models.quant.scheme import Fp8Scheme
from backplane.models.registry import model_class

WORLD = 2

#: TP=2 against TP=1 on the same FP8 checkpoint, float32 on the CPU: both hold
#: bit-identical dequantised weights (no rounding is redone, unlike quantisation on
#: load, whose test allows 0.02), so the log-probabilities differ only by the order
#: the row-parallel partial products are summed in (float32 rounding; measured at
#: most 9.5e-7 over the cases below). 1e-4 leaves 100x room for that and still
#: fails a weight shard off by a rounding of its own (quantisation on load moves
#: them by up to 0.02).
MAX_LOGPROB_DIFF = 1e-4

#: tiny-llama widened so that every shard of two ranks falls on 128x128 blocks:
#: q/k/v heads of 128 rows (one per rank), gate/up 2 x 512 rows, o and down
#: split at input column 128 and 256.
ALIGNED_128 = {
    **PRESETS["tiny-llama"],
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
}

#: config cases: a preset's or one of these
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(PRESETS["tiny-llama"]),
    # one key/value head on two ranks: each rank keeps a copy of its rows and scales
    "llama-one-kv-head": {**PRESETS["tiny-llama"], "num_key_value_heads": 1},
    "aligned-128": ALIGNED_128,
    "tiny-deepseek-v3": dict(PRESETS["tiny-deepseek-v3"]),
    "tiny-qwen3-next": dict(PRESETS["tiny-qwen3-next"]),
    "tiny-nemotron-h": dict(PRESETS["tiny-nemotron-h"]),
}


# -- the scales of one shard ------------------------------------------------------------


def _element_scales(scale: torch.Tensor, rows: int, cols: int, scheme: Fp8Scheme) -> torch.Tensor:
    """Every element's checkpoint scale, float64, expanded from the checkpoint form directly."""
    s = scale.double()
    if scheme.weights == "tensor":
        return s.reshape(1, 1).expand(rows, cols)
    if scheme.weights == "channel":
        return s.reshape(rows, 1).expand(rows, cols)
    bn, bk = scheme.block
    return s.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:rows, :cols]


def _cut(full: torch.Tensor, shard: ShardSlice | ParamShard | None) -> torch.Tensor:
    """A rank's cut of a whole 2-D tensor, written out with plain slicing."""
    if shard is None:
        return full
    parts = (shard.part,) if isinstance(shard, ShardSlice) else shard.parts
    pieces, offset = [], 0
    for p in parts:
        index = [slice(None), slice(None)]
        index[shard.dim] = slice(offset + p.start, offset + p.stop)
        pieces.append(full[tuple(index)])
        offset += p.total
    return torch.cat(pieces, dim=shard.dim)


def _row_form_elements(scales: torch.Tensor, block_k: int, cols: int) -> torch.Tensor:
    """Every element's scale from row-form ``scales`` (one per row and ``block_k`` columns)."""
    return scales.double().repeat_interleave(block_k, dim=1)[:, :cols]


def _even(total: int, rank: int, size: int) -> PartShard:
    n = total // size
    return PartShard(total, rank * n, (rank + 1) * n)


def _shard_cases() -> Iterator[Any]:
    """``(case id, weight shape, shards of the ranks)``: every kind of cut the models make."""
    rows, cols = 256, 384
    for size in (2, 4):
        yield (
            f"column-{size}",
            (rows, cols),
            [ShardSlice(0, _even(rows, r, size)) for r in range(size)],
        )
        # 384 columns: split at 192 (2 ranks, inside a 128-block) and at 96, 192, 288 (4)
        yield (
            f"row-{size}",
            (rows, cols),
            [ShardSlice(1, _even(cols, r, size)) for r in range(size)],
        )
    # ragged blocks on both edges, columns split at 100 (gcd with 128: 4)
    yield "row-ragged", (200, 200), [ShardSlice(1, _even(200, r, 2)) for r in range(2)]
    yield "column-ragged", (200, 200), [ShardSlice(0, _even(200, r, 2)) for r in range(2)]
    # the v_proj of 2 key/value heads of 96 rows on 4 ranks: two ranks share each head
    yield (
        "kv-heads-replicated",
        (192, 256),
        [ShardSlice(0, kv_head_shard(TensorParallel(r, 4), 2, 96)) for r in range(4)],
    )
    # several row slices of one tensor (Mamba2's in_proj, Qwen3.5's in_proj_qkv)
    yield (
        "row-slices-of-one-tensor",
        (256, 192),
        [ParamShard(0, (_even(64, r, 2), _even(64, r, 2), _even(128, r, 2))) for r in range(2)],
    )


SCHEMES = {
    "tensor": Fp8Scheme(weights="tensor"),
    "channel": Fp8Scheme(weights="channel"),
    "block-128": Fp8Scheme(weights="block", block=(128, 128), scale_name="weight_scale_inv"),
    "block-32x64": Fp8Scheme(weights="block", block=(32, 64), scale_name="weight_scale_inv"),
}


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random weights whose 16x16 tiles differ in magnitude by up to 2^8, so that every
    block's scale differs from its neighbours' (a shifted or swapped scale shows)."""
    g = torch.Generator().manual_seed(seed)
    tiles = 2.0 ** torch.randint(-4, 5, (-(-rows // 16), -(-cols // 16)), generator=g).float()
    magnitude = tiles.repeat_interleave(16, 0).repeat_interleave(16, 1)[:rows, :cols]
    return torch.randn(rows, cols, generator=g) * magnitude


@pytest.mark.parametrize("scheme_id", list(SCHEMES))
@pytest.mark.parametrize(
    ("case", "shape", "shards"), [pytest.param(*c, id=c[0]) for c in _shard_cases()]
)
def test_each_shard_dequantises_to_its_slice_of_the_whole_weight(
    scheme_id, case, shape, shards
) -> None:
    scheme = SCHEMES[scheme_id]
    rows, cols = shape
    q, scale = quantize_weight(_weight(rows, cols, seed=len(case)), scheme.weights, scheme.block)
    if scheme.weights == "tensor":
        scale = scale.reshape(())  # as compressed-tensors stores it
    whole = q.double() * _element_scales(scale, rows, cols, scheme)
    for rank, shard in enumerate(shards):
        mine = _cut(q, shard)
        scales, block_k = shard_row_scales(scale, shape, shard, scheme)
        local_rows, local_cols = mine.shape
        assert scales.dtype == torch.float32 and scales.shape[0] == local_rows
        assert scales.shape[1] in (1, -(-local_cols // block_k))
        got = mine.double() * _row_form_elements(scales, block_k, local_cols)
        # exact, element by element: a wrong scale anywhere shows
        assert torch.equal(got, _cut(whole, shard)), f"rank {rank} of {case}"
        # and as the projections dequantise (a float32 product, one rounding)
        torch.testing.assert_close(
            dequantize_rows(mine, scales, block_k, torch.float64),
            _cut(whole, shard),
            rtol=2**-23,
            atol=0,
        )
        aligned = shard.dim == 0 or shard.part.start % scheme.block[1] == 0
        if scheme.weights == "block" and aligned:
            # the checkpoint's block columns, not finer ones
            assert block_k == scheme.block[1]


def test_block_scales_of_several_column_slices_are_refused() -> None:
    scheme = SCHEMES["block-128"]
    shard = ParamShard(1, (PartShard(128, 0, 64), PartShard(128, 0, 64)))
    with pytest.raises(ValueError, match="2 column slices are not supported"):
        shard_row_scales(torch.ones(1, 2), (128, 256), shard, scheme)


# -- a model loaded as each rank -----------------------------------------------------------


@contextmanager
def _as_rank(rank: int, size: int = WORLD) -> Iterator[None]:
    """Build and load models as ``rank`` of ``size`` (loading runs no collective)."""
    previous = set_tensor_parallel(TensorParallel(rank, size, None))
    try:
        yield
    finally:
        set_tensor_parallel(previous)


def _random_model(config: dict[str, Any]) -> CausalLM:
    cfg = ModelConfig(config)
    lm = build_model(
        model_class(cfg.architecture), cfg, _backends(), dtype=torch.float32, device="cpu"
    )
    lm.init_random_weights_(seed=3, std=0.05)
    return lm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(config case, layout, block) -> FP8 checkpoint folder``, written once each."""
    tmp = tmp_path_factory.mktemp("fp8-tp")
    made: dict[tuple, Path] = {}

    def get(case: str, layout: str, block: int = 32) -> Path:
        key = (case, layout, block)
        if key not in made:
            config = CONFIGS[case]
            state = _float_state(_random_model(config))
            made[key], _ = _fp8_checkpoints(
                tmp,
                state,
                layout,
                block=(block, block),
                config=config,
                folder=f"{case}-{layout}-{block}",
            )
        return made[key]

    return get


def _scheme_of(path: Path) -> Fp8Scheme:
    from backplane.models.loader import check_quantization, read_config

    return check_quantization(read_config(path), path / "config.json")


def _whole_dequantised(path: Path, scheme: Fp8Scheme) -> dict[str, torch.Tensor]:
    """The checkpoint's FP8 weights times their scales, float64, by checkpoint name."""
    ckpt = load_file(str(path / "model.safetensors"))
    out = {}
    for name, q in ckpt.items():
        if q.dtype != FP8_DTYPE:
            continue
        scale = ckpt[f"{name[: -len('.weight')]}.{scheme.scale_name}"]
        out[name] = q.double() * _element_scales(scale, *q.shape, scheme)
    return out


def _owners(lm: CausalLM) -> dict[str, Linear]:
    """``{checkpoint-side weight name: the projection holding it}`` (merged parts included)."""
    owners = {}
    for name, m in lm.named_modules():
        if isinstance(m, MergedLinear):
            parent = name.rpartition(".")[0]
            owners.update({f"{parent}.{part}.weight": m for part in m.part_names})
        elif isinstance(m, Linear):
            owners[f"{name}.weight"] = m
    return owners


@pytest.mark.parametrize(
    ("case", "layout", "block", "kept_full"),
    [
        ("tiny-llama", "hf-block", 32, ()),
        # o (64 columns) and down (128) split at 32 and 64, inside 128-column blocks
        ("tiny-llama", "hf-block", 128, ("o_proj", "down_proj")),
        ("aligned-128", "hf-block", 128, ()),
        ("llama-one-kv-head", "hf-block", 32, ()),
        ("llama-one-kv-head", "ct-channel", 32, ()),
        ("tiny-llama", "ct-tensor", 32, ()),
        ("tiny-llama", "ct-block", 32, ()),
        ("tiny-llama", "ct-channel-static", 32, ()),
        # MoE experts and kv_b_proj dequantised from their slices; q_a_proj too (merged
        # with kv_a_proj_with_mqa, which these checkpoints leave unquantised), and the
        # shared expert's down_proj (32 columns split at 16, inside a 32-column block)
        (
            "tiny-deepseek-v3",
            "hf-block",
            32,
            ("kv_b_proj", "experts", "q_a_proj", "shared_experts.down_proj"),
        ),
        (
            "tiny-deepseek-v3",
            "hf-block",
            128,
            ("kv_b_proj", "experts", "q_a_proj", "o_proj", "down_proj"),
        ),
        ("tiny-qwen3-next", "hf-block", 32, ("experts",)),
        ("tiny-nemotron-h", "ct-channel", 32, ("experts",)),
    ],
)
def test_each_rank_holds_its_slice_of_the_dequantised_checkpoint(
    checkpoint, case, layout, block, kept_full, caplog
) -> None:
    path = checkpoint(case, layout, block)
    scheme = _scheme_of(path)
    whole = _whole_dequantised(path, scheme)
    static = {}
    if layout.endswith("static"):
        ckpt = load_file(str(path / "model.safetensors"))
        static = {k: v for k, v in ckpt.items() if k.endswith("input_scale")}
    for rank in range(WORLD):
        caplog.clear()
        with _as_rank(rank), caplog.at_level(logging.WARNING, "backplane.models.quant.loading"):
            lm = load_model(str(path), dtype="float32", device="cpu", backends=_backends()).model
        shards = lm.weight_shards()
        assert shards, "the model was not split"
        targets, owners = lm.weight_targets(), _owners(lm)
        checked = fp8 = 0
        for ckpt_name, full in whole.items():
            name = lm.checkpoint_to_module_name(ckpt_name)
            weight, index = targets[name]
            weight = weight if index is None else weight[index]
            want = _cut(full, shards.get(name))
            if weight.dtype == FP8_DTYPE:
                fp8 += 1
                scales = targets[f"{name}_scale"][0]  # the part's rows of the row form
                block_k = owners[name].quant.block_k
                got = weight.double() * _row_form_elements(scales, block_k, weight.shape[1])
                assert torch.equal(got, want), f"rank {rank}: {name}"
                assert not any(f".{k}" in name for k in kept_full), name
            else:
                # dequantised on load: the float32 rounding of the same products
                assert torch.equal(weight, want.float()), f"rank {rank}: {name}"
                assert any(f".{k}" in name for k in kept_full), f"{name} left FP8 needlessly"
            checked += 1
        assert checked == len(whole) and fp8 > 0
        warned = [r.getMessage() for r in caplog.records if "stay in full precision" in r.message]
        if rank == 0 and any(k.endswith(("o_proj", "down_proj")) for k in kept_full):
            # one warning for all the row-parallel shards that cut scale blocks, naming them
            # and why (rank 0 speaks for the group)
            assert len(warned) == 1 and f"cut {block}-column scale blocks" in warned[0]
            assert "down_proj (its input columns [0, " in warned[0]
        else:
            assert not warned
        if static:
            # static activation scales: whole on every rank, the largest of a merged one's parts
            for weight_name, m in owners.items():
                parts = m.part_names if isinstance(m, MergedLinear) else None
                if m.quant is None or not m.quant.static:
                    continue
                base = weight_name.rsplit(".", 2)[0]
                names = (
                    [f"{base}.{p}" for p in parts] if parts else [weight_name[: -len(".weight")]]
                )
                want_scale = max(static[f"{n}.input_scale"].item() for n in names)
                assert m.input_scale.item() == want_scale, weight_name


# -- the engine on two ranks ----------------------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    ("case", "layout", "block"),
    [
        ("tiny-llama", "hf-block", 32),
        ("tiny-llama", "hf-block", 128),
        ("aligned-128", "hf-block", 128),
        ("llama-one-kv-head", "ct-channel", 32),
        ("tiny-llama", "ct-tensor", 32),
        ("tiny-llama", "ct-block", 32),
        ("tiny-llama", "ct-channel-static", 32),
        ("tiny-deepseek-v3", "hf-block", 32),
    ],
)
def test_two_ranks_give_the_tokens_of_one_on_an_fp8_checkpoint(checkpoint, case, layout, block):

    torch_ops = dict.fromkeys(("attention", "ssm", "mla", "delta"), "torch")
    common = dict(device="cpu", backends=torch_ops, num_kv_pages=32, threads=1)
    _two_ranks_against_one(str(checkpoint(case, layout, block)), common, MAX_LOGPROB_DIFF)


def _two_ranks_against_one(path: str, common: dict[str, Any], max_diff: float) -> None:
    """Greedy tokens of TP=2 equal TP=1's on ``path``, log-probabilities within ``max_diff``."""
    from backplane import LLM

    prompt = [5, 17, 99, 3, 42, 7]
    one = LLM(path, **common)
    try:
        want, want_lp = _greedy_with_logprobs(one, prompt)
    finally:
        one.shutdown()
    llm = LLM(path, tensor_parallel_size=2, **common)
    try:
        model = llm.engine.model
        assert model.tp.size == 2
        assert any(m.weight.dtype == FP8_DTYPE for m in model.modules() if isinstance(m, Linear))
        got, got_lp = _greedy_with_logprobs(llm, prompt)
    finally:
        llm.shutdown()
    assert got == want
    for step, token in enumerate(got):
        diff = abs(got_lp[step][token].logprob - want_lp[step][token].logprob)
        assert diff < max_diff, f"step {step}: log-probabilities {diff:.2e} apart"


#: TP=2 against TP=1 on two GPUs, bfloat16 activations: the FP8 products (cuBLAS or the
#: few-row kernel) sum each rank's shard in float32 and round to bfloat16 before the
#: all-reduce, where one rank rounds once, so the log-probabilities move by bfloat16
#: roundings (2**-8 relative) through the layers
MAX_GPU_LOGPROB_DIFF = 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "layout", "block"), [("aligned-128", "hf-block", 128)])
@pytest.mark.parametrize("graphs", ["off", "full_and_piecewise"])
def test_two_gpus_give_the_tokens_of_one_on_an_fp8_checkpoint(
    checkpoint, case, layout, block, graphs
):
    """The same on two GPUs (NCCL, FP8 products on the device, CUDA graphs on and off)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    common = dict(device="cuda", dtype="bfloat16", num_kv_pages=64, cuda_graphs=graphs)
    _two_ranks_against_one(str(checkpoint(case, layout, block)), common, MAX_GPU_LOGPROB_DIFF)

"""A row-parallel projection with FP8 weights: this rank's partial product through its
quantisation, the bias added once after the sum (or, without the sum, on rank 0 only).

One gloo process stands for the group (its all-reduce returns the partial product
unchanged), so the expected value is this rank's dequantised product plus the bias
where it belongs, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from backplane.core.parallel import TensorParallel
from backplane.models.parallel import PartShard, RowParallelLinear
from backplane.models.quant.fp8 import dequantize_rows
from backplane.models.quant.projection import quantize_linear


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_quantised_shard_adds_the_bias_once(one_rank_group, rank, reduce):
    tp = TensorParallel(rank=rank, size=2, group=one_rank_group)
    torch.manual_seed(rank + 2 * reduce)
    layer = RowParallelLinear(
        PartShard(64, 32 * rank, 32 * rank + 32), 48, bias=True, reduce=reduce, tp=tp
    )
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    quantize_linear(layer)
    assert layer.quant is not None and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(5, 32)
    got = layer(x)
    weight = dequantize_rows(layer.weight, layer.weight_scale, layer.quant.block_k, torch.float64)
    want = x.double() @ weight.T
    if reduce or rank == 0:
        want += layer.bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

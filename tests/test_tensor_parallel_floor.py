"""The memory floor of a tensor-parallel benchmark is one rank's bytes, replicated parts whole."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from backplane.cli.bench.latency.floor import floor_bytes
from backplane.cli.bench.latency.shapes import shape_config
from backplane.cli.bench.latency.shard import rank_weights_info
from backplane.cli.bench.latency.weights import save_random_weights


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = shape_config("tiny-llama")
    return save_random_weights("tiny-llama", config, folder, torch.float32), config


def _rank_bytes_by_rule(folder: str, size: int) -> int:
    """One rank's weight bytes by the Llama sharding rule: norms whole, every projection split."""
    total = 0
    with safe_open(f"{folder}/model.safetensors", framework="pt") as fh:
        for key in fh.keys():
            n = 4 * math.prod(fh.get_slice(key).get_shape())  # float32
            total += n if "norm" in key else n // size
    return total


def test_one_rank_holds_its_shards_and_whole_norms(tiny_llama):
    info, config = tiny_llama
    rank = rank_weights_info(info, torch.float32, 2)
    assert rank.weight_bytes == _rank_bytes_by_rule(info.folder, 2)
    assert rank.embedding_bytes * 2 == info.embedding_bytes
    assert rank.lm_head_bytes * 2 == info.lm_head_bytes
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_whole = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    assert info.kv_bytes_per_token == kv_whole
    assert rank.kv_bytes_per_token == kv_whole / 2
    # the floor of a step is one rank's bytes: about half the whole model's
    whole = floor_bytes(info, 1, 16, 8)["total"]
    half = floor_bytes(rank, 1, 16, 8)["total"]
    assert whole / 2 < half < whole * 0.6


def test_key_value_heads_are_replicated_when_the_ranks_outnumber_them(tiny_llama):
    info, config = tiny_llama
    assert config["num_key_value_heads"] == 2
    rank = rank_weights_info(info, torch.float32, 4)
    # four ranks over two key/value heads: each rank caches one whole head
    assert rank.kv_bytes_per_token == info.kv_bytes_per_token / 2
    assert rank.weight_bytes > _rank_bytes_by_rule(info.folder, 4)


def test_one_rank_is_the_whole_model(tiny_llama):
    info, _ = tiny_llama
    assert rank_weights_info(info, torch.float32, 1) is info


def test_hybrid_rank_keeps_half_the_recurrent_state(tmp_path):
    config = shape_config("tiny-nemotron-h")
    info = save_random_weights("tiny-nemotron-h", config, tmp_path, torch.float32)
    rank = rank_weights_info(info, torch.float32, 2)
    # Mamba2 heads, groups and conv channels are split: each rank's state is its half
    assert info.state_bytes_per_seq > 0
    assert rank.state_bytes_per_seq * 2 == info.state_bytes_per_seq
    assert rank.kv_bytes_per_token * 2 == info.kv_bytes_per_token


def _fp8_rank_bytes_by_rule(folder: str, size: int) -> int:
    """One rank's weight bytes with ``quantization="fp8"``: each projection's shard an e4m3
    byte per weight and a float32 scale per shard row (a row-parallel shard keeps every
    row); norms whole, the embedding and LM head split in float32."""
    total = 0
    with safe_open(f"{folder}/model.safetensors", framework="pt") as fh:
        for key in fh.keys():
            rows, *cols = fh.get_slice(key).get_shape()
            n = rows * math.prod(cols)
            if "norm" in key:
                total += 4 * n
            elif "proj" not in key:
                total += 4 * n // size
            elif key.endswith(("o_proj.weight", "down_proj.weight")):
                total += n // size + 4 * rows
            else:
                total += n // size + 4 * rows // size
    return total


def test_an_fp8_rank_holds_e4m3_shards_with_their_row_scales(tiny_llama):
    from backplane.cli.bench.latency.quantized import held_weights_info

    info, _ = tiny_llama
    held = held_weights_info(info, torch.float32, quantization="fp8", kv_cache_dtype="auto")
    rank = rank_weights_info(held, torch.float32, 2, "fp8")
    assert rank.weight_bytes == _fp8_rank_bytes_by_rule(info.folder, 2)
    assert rank.weight_bytes < rank_weights_info(info, torch.float32, 2).weight_bytes
    assert rank.embedding_bytes * 2 == info.embedding_bytes

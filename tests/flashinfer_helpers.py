"""Helpers of the FlashInfer GPU tests and benchmark: ragged batches and a model-level step runner.

Kept out of the test modules so the benchmark script can share them; nothing here
needs a GPU by itself (the model runner is exercised on the CPU with the torch
backends by ``test_flashinfer.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from backplane.core.forward_context import forward_context, plan_step
from backplane.core.metadata import EAGER, BatchMetadata, StepMode
from backplane.core.packing import build_batch_metadata

#: the DeepSeek-V3 attention shape FlashInfer's MLA kernels take (latent 512, rotary 64),
#: over a small config's other sizes
MLA_DIMS: dict[str, int] = {
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}


def ragged_batch(
    query_lens: list[int],
    cached_lens: list[int],
    page_size: int,
    *,
    num_pages: int | None = None,
    padding: int = 0,
    seed: int = 0,
    device: torch.device | str = "cuda",
    block_table_width: int | None = None,
    mode: StepMode = EAGER,
) -> tuple[BatchMetadata, list[list[int]], int, list[int]]:
    """A batch with shuffled (non-contiguous) page tables and shuffled state slots.

    :param block_table_width: columns of the dense block table (default: just enough).
    :param mode: how the step runs (e.g. the decode graph of a bucket).
    :return: ``(batch, page_tables, num_pages, state_slots)``; page 0 and slot 0 are never used.
    """
    rng = np.random.default_rng(seed)
    need = [-(-(q + c) // page_size) for q, c in zip(query_lens, cached_lens, strict=True)]
    total = sum(need)
    pool = num_pages if num_pages is not None else total + 3
    pages = rng.permutation(np.arange(1, pool))[:total]
    tables, start = [], 0
    for n in need:
        tables.append([int(p) for p in pages[start : start + n]])
        start += n
    slots = [int(s) for s in rng.permutation(np.arange(1, len(query_lens) + 1))]
    batch = build_batch_metadata(
        query_lens,
        cached_lens,
        tables,
        page_size,
        state_slots=slots,
        padded_num_tokens=sum(query_lens) + padding,
        block_table_width=block_table_width,
        device=device,
        mode=mode,
    )
    return batch, tables, pool, slots


def build_random_model(config: dict[str, Any], backends: dict[str, Any], dtype, device) -> Any:
    """Build a model of ``config`` with the fixed-seed random weights of the presets."""
    from backplane.models.base import ModelConfig, build_model
    from backplane.models.registry import model_class

    cfg = ModelConfig(config)
    lm = build_model(model_class(cfg.architecture), cfg, backends, dtype=dtype, device=device)
    lm.init_random_weights_(seed=0)
    return lm


def run_model_steps(
    config: dict[str, Any],
    backends: dict[str, Any],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    page_size: int = 16,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Run four engine-like steps and return the logits of each step.

    Step 0 prefills 30 tokens of a 40-token prompt and a whole 23-token prompt;
    step 1 extends the first prompt by its last 10 tokens while the second
    decodes; steps 2-3 decode both. Token ids are fixed in advance (not
    sampled) so two runs see identical inputs.
    """
    device = torch.device(device)
    lm = build_random_model(config, backends, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(config["vocab_size"])
    prompt0 = torch.randint(0, vocab, (40,), generator=gen)
    prompt1 = torch.randint(0, vocab, (23,), generator=gen)
    decode_ids = torch.randint(0, vocab, (3, 2), generator=gen)
    num_pages = 16
    caches = {
        layer: {name: spec.allocate(device) for name, spec in specs.items()}
        for layer, specs in lm.cache_specs(
            num_pages=num_pages, page_size=page_size, num_slots=4, dtype=dtype
        ).items()
    }
    lm.bind_caches(caches)
    tables = [[3, 5, 7, 9], [2, 4, 6]]
    steps = [
        ([30, 23], [0, 0], [prompt0[:30], prompt1]),
        ([10, 1], [30, 23], [prompt0[30:], decode_ids[0, 1:]]),
        ([1, 1], [40, 24], [decode_ids[1, :1], decode_ids[1, 1:]]),
        ([1, 1], [41, 25], [decode_ids[2, :1], decode_ids[2, 1:]]),
    ]
    used = {f: b for f, b in backends.items() if f in getattr(lm, "families", backends)}
    logits = []
    for query, cached, ids in steps:
        need = [-(-(q + c) // page_size) for q, c in zip(query, cached, strict=True)]
        batch = build_batch_metadata(
            query,
            cached,
            [t[:n] for t, n in zip(tables, need, strict=True)],
            page_size,
            state_slots=[2, 1],
            padded_num_tokens=sum(query) + 2,
            device=device,
        )
        input_ids = torch.zeros(batch.padded_num_tokens, dtype=torch.long)
        input_ids[: batch.num_tokens] = torch.cat(ids)
        with forward_context(batch, plan_step(used, batch)):
            hidden = lm(input_ids.to(device), batch.positions)
            logits.append(lm.compute_logits(hidden[batch.last_token_indices]).float().cpu())
    return logits

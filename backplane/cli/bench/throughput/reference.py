"""transformers ``generate`` on the batch backplane served, where that is the same work."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from backplane.cli.bench.latency.measure import free_device_memory, one_line, skipped
from backplane.cli.bench.latency.reference import generate_transformers, load_transformers_model
from backplane.cli.bench.throughput.model import Model
from backplane.cli.bench.workload import (
    RequestSpec,
)

logger = logging.getLogger(__name__)


def transformers_batch(
    model: Model, specs: list[RequestSpec], rates: list[float], device: Any, dtype: Any
) -> dict[str, Any]:
    """transformers ``generate`` over every request at once, where that is the same work.

    :param model: the model (its HF folder).
    :param specs: the requests.
    :param rates: the rates measured (one must be ``inf``).
    :param device: the ``torch.device``.
    :param dtype: the ``torch.dtype``.
    :return: ``status``, and when measured ``output_token_throughput``,
        ``total_token_throughput``, ``duration_s``, ``ttft_ms``, ``ms_per_step``
        and ``tokens_per_request``; else ``reason``.
    """
    if all(math.isfinite(r) for r in rates):
        return skipped(
            "requests arrive at a rate; transformers generate runs one batch at once "
            "(add inf to --request-rate)"
        )
    out_lens = {s.output_len for s in specs}
    if len(out_lens) != 1:
        return skipped(
            "the requests' output lengths differ; transformers generate gives every row of a "
            "batch one length (pass --output-len)"
        )
    if model.hf_folder is None:
        return skipped(model.why_no_hf or "no Hugging Face folder")
    import torch

    try:
        hf = load_transformers_model(model.hf_folder, device, dtype)
    except ImportError as exc:
        return skipped(f"transformers is not installed ({exc}); pip install transformers")
    except Exception as exc:
        logger.debug("transformers failed to load %s", model.hf_folder, exc_info=True)
        return skipped(f"transformers cannot load the model: {one_line(exc)}")
    n_out = out_lens.pop()
    lens = [len(s.prompt_token_ids) for s in specs]
    width = max(lens)
    pad = hf.generation_config.pad_token_id
    if pad is None:
        eos = hf.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    ids = torch.full((len(specs), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(specs), width), dtype=torch.long)
    for i, s in enumerate(specs):  # padded on the left, as generate expects
        ids[i, width - lens[i] :] = torch.tensor(s.prompt_token_ids, dtype=torch.long)
        mask[i, width - lens[i] :] = 1
    ids, mask = ids.to(device), mask.to(device)
    entry: dict[str, Any] = {
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "batch": len(specs),
        "padded_prompt_len": width,
        "output_len": n_out,
    }
    try:
        generate_transformers(hf, ids, min(n_out, 2), {}, mask)  # warm-up
        t0 = time.perf_counter()
        ttft, per_token, tokens = generate_transformers(hf, ids, n_out, {}, mask)
        wall = time.perf_counter() - t0
    except Exception as exc:
        logger.debug("transformers generate failed", exc_info=True)
        entry.update({"status": "failed", "reason": one_line(exc)})
        return entry
    finally:
        del hf, ids, mask
        free_device_memory(device)
    counts = [len(t) for t in tokens]
    produced = sum(counts)
    entry.update(
        {
            "status": "ok",
            "duration_s": wall,
            "output_tokens": produced,
            "output_token_throughput": produced / wall,
            "total_token_throughput": (produced + sum(lens)) / wall,
            "ttft_ms": ttft * 1e3,
            "ms_per_step": per_token * 1e3,
            "tokens_per_request": counts,
        }
    )
    if any(c != n_out for c in counts):
        entry["status"] = "failed"
        entry["reason"] = f"produced {counts} tokens per request instead of {n_out} each"
    return entry

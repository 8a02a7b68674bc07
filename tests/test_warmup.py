"""Start-up warm-up: the scratch steps fit the engine, reach every kernel variant, and leave none to compile."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch

from backplane.engine.worker.inputs import InputBatch
from backplane.engine.worker.warmup import KEYS_PER_SPLIT, warmup_steps

LIMITS = [
    dict(max_num_tokens=2048, max_num_seqs=32, max_model_len=656, page_size=16),
    dict(max_num_tokens=4096, max_num_seqs=256, max_model_len=32768, page_size=16),
    dict(max_num_tokens=8, max_num_seqs=1, max_model_len=64, page_size=16),
    dict(max_num_tokens=64, max_num_seqs=4, max_model_len=40, page_size=8),
    dict(max_num_tokens=512, max_num_seqs=8, max_model_len=100_000, page_size=32),
]


def _input_batch(limits: dict) -> InputBatch:
    """A CPU input batch sized as an engine with these limits sizes its own."""
    return InputBatch(
        max_num_tokens=limits["max_num_tokens"],
        max_num_seqs=limits["max_num_seqs"],
        max_pages_per_seq=-(-limits["max_model_len"] // limits["page_size"]),
        page_size=limits["page_size"],
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("limits", LIMITS, ids=lambda d: "-".join(map(str, d.values())))
def test_warmup_steps_fit_the_engine_limits(limits: dict) -> None:
    steps = warmup_steps(**limits)
    assert steps
    batch = _input_batch(limits)
    for seqs in steps:
        assert 1 <= len(seqs) <= limits["max_num_seqs"]
        assert sum(s.num_new_tokens for s in seqs) <= limits["max_num_tokens"]
        decoding = [s.num_new_tokens == 1 and s.num_cached_tokens > 0 for s in seqs]
        assert decoding == sorted(decoding), "prefill sequences come first"
        for s in seqs:
            total = s.num_cached_tokens + s.num_new_tokens
            assert total <= limits["max_model_len"]
            assert len(s.request.token_buffer) == total
            assert len(s.page_ids) * limits["page_size"] >= total
            assert (s.page_ids == 0).all()  # the scratch page only
        inputs = batch.prepare(seqs)  # raises on anything the engine would refuse
        meta = inputs.metadata
        assert meta.num_decode_seqs == sum(decoding)


@pytest.mark.parametrize("limits", LIMITS, ids=lambda d: "-".join(map(str, d.values())))
def test_every_metadata_tensor_is_16_byte_aligned_whatever_the_step_shape(limits: dict) -> None:
    """Kernels specialise on 16-byte alignment: it must not change from step to step."""
    batch = _input_batch(limits)
    for seqs in warmup_steps(**limits):
        inputs = batch.prepare(seqs)
        meta = inputs.metadata
        tensors = {
            f.name: getattr(meta, f.name)
            for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)
        }
        tensors.update(input_ids=inputs.input_ids, logits_indices=inputs.logits_indices)
        assert len(tensors) > 8
        for name, t in tensors.items():
            if t.numel():
                assert t.data_ptr() % 16 == 0, (name, [s.num_new_tokens for s in seqs])


def test_warmup_steps_reach_every_attention_kernel_variant() -> None:
    pytest.importorskip("triton")
    from backplane.backends.triton._common import MAX_KV_SPLITS
    from backplane.backends.triton.attention_configs import _prefill_class

    steps = warmup_steps(max_num_tokens=4096, max_num_seqs=64, max_model_len=32768, page_size=16)
    prefill_variants, split_counts, widest = set(), set(), 0
    for seqs in steps:
        is_decode = [s.num_new_tokens == 1 and s.num_cached_tokens > 0 for s in seqs]
        prefill = [s for s, d in zip(seqs, is_decode, strict=True) if not d]
        decode = [s for s, d in zip(seqs, is_decode, strict=True) if d]
        if prefill:
            max_q = max(s.num_new_tokens for s in prefill)
            paged = any(s.num_cached_tokens > 0 for s in prefill)
            prefill_variants.add((_prefill_class(False, max_q, 64), paged, max_q >= 4096))
        if decode:
            longest = max(s.num_cached_tokens + 1 for s in decode)
            split_counts.add(min(-(-longest // KEYS_PER_SPLIT), MAX_KV_SPLITS))
            widest = max(widest, len(decode))
    classes = {"tiny", "short", "medium", "long"}
    expected = {(c, paged, False) for c in classes for paged in (False, True)}
    expected |= {("long", False, True), ("long", True, True)}
    assert prefill_variants == expected
    # every power-of-two split count up to the cap (the longest contexts give the cap)
    assert {1 << i for i in range(MAX_KV_SPLITS.bit_length())} <= split_counts
    assert widest == 63  # the prompt beside max_num_seqs - 1 decodes


@pytest.mark.gpu
def test_no_attention_kernel_compiles_after_start_up() -> None:
    """Serving a mix of prompt lengths and long decodes after start-up compiles no Triton kernel."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from triton.runtime.jit import JITFunction, KernelInterface

    from backplane import LLM, SamplingParams

    def variants() -> dict[str, int]:
        """Compiled variants of every Triton kernel a loaded module defines, by name."""
        out, seen = {}, set()
        for module in list(sys.modules.values()):
            for obj in list(getattr(module, "__dict__", {}).values()):
                # autotuners and heuristics are kernel interfaces wrapping the JIT function as .fn
                while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
                    obj = obj.fn
                if isinstance(obj, JITFunction) and id(obj) not in seen:
                    seen.add(id(obj))
                    n = sum(len(entry[0]) for entry in obj.device_caches.values())
                    if n:
                        out[f"{obj.__module__}.{obj.__name__}"] = n
        return out

    llm = LLM(
        "tiny-llama",
        device="cuda",
        max_model_len=2048,
        max_num_seqs=16,
        max_num_tokens=1024,
        kv_memory="512MiB",  # whatever other tests of the process still hold
        backends={"attention": "triton"},
    )
    try:
        after_start = variants()
        names = {name.rsplit(".", 1)[1] for name in after_start}
        assert {"_prefill_kernel", "_decode_kernel"} <= names, after_start
        vocab = llm.engine.vocab_size
        g = torch.Generator().manual_seed(0)
        shared = torch.randint(1, vocab, (300,), generator=g).tolist()
        prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 40, 90, 700)]
        prompts += [shared + [i + 1] * (5 + 20 * i) for i in range(4)]  # prefix-cache hits
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for n in (600, 20, 1200, 40, 8, 300, 30, 900)
        ]
        outs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
        assert variants() == after_start
    finally:
        llm.shutdown()

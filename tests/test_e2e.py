"""End to end: the engine's greedy generation equals transformers' greedy generation.

For each architecture a tiny transformers model is randomly initialised, saved
with ``save_pretrained`` and loaded by backplane (float32, CPU). Many requests
of different lengths, several sharing prefixes, run concurrently through the
engine with more requests than ``max_num_seqs``, a token budget that forces
chunked prefill and a KV cache small enough to force prefix-cache eviction and
preemption (checked through the engine's counters); with and without the host
KV tier. Each request's tokens must equal greedy decoding of that request
alone by transformers, recomputing the whole sequence every step (no cache).

Random tiny models can have near-ties between the two best logits; a mismatch
is accepted only at a step where the reference's top-2 margin is below
``TIE_MARGIN`` (and the comparison of that request stops there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")


import hf_tiny  # noqa: E402
from hf_tiny import VOCAB, hf_torch_path  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402

PAGE = 4
TIE_MARGIN = 1e-4


#: arch -> (transformers class, config factory, transformers modeling module, recurrent)
ARCHS = {
    "llama": ("LlamaForCausalLM", hf_tiny.llama, "llama", False),
    "qwen3": ("Qwen3ForCausalLM", hf_tiny.qwen3, "qwen3", False),
    "qwen3_5": ("Qwen3_5ForCausalLM", hf_tiny.qwen3_5, "qwen3_5", True),
    "nemotron_h": ("NemotronHForCausalLM", hf_tiny.nemotron_h, "nemotron_h", True),
    "deepseek_v3": ("DeepseekV3ForCausalLM", hf_tiny.deepseek_v3, "deepseek_v3", False),
    "qwen3_next": ("Qwen3NextForCausalLM", hf_tiny.qwen3_next, "qwen3_next", True),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model_factory(
    tmp_path_factory: Any, overrides: dict[str, dict[str, Any]] | None = None
) -> Callable[[str], tuple[Any, str]]:
    """``arch -> (transformers model, saved directory)``, each built once on first use.

    :param tmp_path_factory: pytest's, for the saved checkpoints.
    :param overrides: per architecture, config attributes set over its tiny config
        (wider heads for kernels that take only some head sizes).
    :return: the getter.
    """
    built: dict[str, tuple[Any, str]] = {}

    def get(arch: str) -> tuple[Any, str]:
        if arch not in built:
            cls_name, make_cfg, _, _ = ARCHS[arch]
            torch.manual_seed(1234)
            cfg = make_cfg()
            for key, value in (overrides or {}).get(arch, {}).items():
                setattr(cfg, key, value)
            # wide weights: well-separated logits, so greedy ties are rare
            cfg.initializer_range = 0.15
            model = getattr(transformers, cls_name)(cfg).eval()
            gen = torch.Generator().manual_seed(99)
            with torch.no_grad():  # make norms / biases non-trivial
                for name, p in model.named_parameters():
                    if p.dim() == 1 and not name.endswith(("A_log", "dt_bias", "D")):
                        p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            path = tmp_path_factory.mktemp(arch)
            model.save_pretrained(path)
            built[arch] = (model, str(path))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """``arch -> (transformers model, saved directory)``, built once per architecture."""
    return hf_model_factory(tmp_path_factory)


def hf_greedy(arch: str, model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and top-2 margins, recomputing the whole sequence each step."""
    tokens = list(prompt)
    out, margins = [], []
    with hf_torch_path(ARCHS[arch][2]), torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].double()
            top = torch.topk(logits, 2)
            t = int(top.indices[0])
            margins.append(float(top.values[0] - top.values[1]))
            out.append(t)
            tokens.append(t)
    return out, margins


def make_requests(seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of 2..21 tokens, half of them sharing one of two prefixes, and max_tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, size=9).tolist(), rng.integers(0, VOCAB, size=13).tolist()]
    prompts, max_tokens = [], []
    for i in range(10):
        if i % 2 == 0:
            p = (
                prefixes[(i // 2) % 2]
                + rng.integers(0, VOCAB, size=int(rng.integers(1, 8))).tolist()
            )
        else:
            p = rng.integers(0, VOCAB, size=int(rng.integers(2, 21))).tolist()
        prompts.append(p)
        max_tokens.append(int(rng.integers(4, 11)))
    prompts.append(list(prompts[0]))  # an exact repeat: a full prefix hit
    max_tokens.append(4)
    return prompts, max_tokens


def assert_matches(got: list[int], want: list[int], margins: list[float], what: str) -> bool:
    """Assert equal tokens up to a near-tie; return True if a near-tie ended the comparison."""
    assert len(got) == len(want), f"{what}: {len(got)} tokens, expected {len(want)}"
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            assert margins[k] < TIE_MARGIN, (
                f"{what}: token {k} is {g}, transformers gives {w} (top-2 margin {margins[k]:.3g}); "
                f"got {got}, expected {want}"
            )
            return True
    return False


CASES = [
    pytest.param("llama", "0", id="llama"),
    pytest.param("llama", "64KiB", id="llama-host_tier"),
    pytest.param("qwen3", "0", id="qwen3"),
    pytest.param("deepseek_v3", "0", id="deepseek_v3"),
    pytest.param("deepseek_v3", "64KiB", id="deepseek_v3-host_tier"),
    # recurrent models: prefix reuse through state snapshots, without a host tier
    pytest.param("nemotron_h", "0", id="nemotron_h"),
    pytest.param("qwen3_next", "0", id="qwen3_next"),
    pytest.param("qwen3_5", "0", id="qwen3_5"),
]


@pytest.mark.parametrize("arch,host_kv", CASES)
def test_concurrent_greedy_equals_transformers(hf_model, arch, host_kv):
    model, path = hf_model(arch)
    prompts, max_tokens = make_requests(seed=len(arch))
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=3,
        max_num_tokens=16,
        num_kv_pages=11,
        host_kv_memory=host_kv,
        debug=True,
    )
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    # half the requests arrive first and run a while; the rest join mid-flight
    first = llm.stream(prompts[:5], params[:5])
    outs: dict[str, Any] = {}
    for _ in range(6):
        o = next(first, None)
        if o is not None and o.finished:
            outs[o.request_id] = o
    late = llm.generate(prompts[5:], params[5:])
    for o in first:
        if o.finished:
            outs[o.request_id] = o
    results = sorted(outs.values(), key=lambda o: int(o.request_id)) + late
    assert len(results) == len(prompts)

    sched = llm.engine.scheduler
    kv = llm.engine.kv_manager
    assert sched.stats.preemptions > 0, "the KV cache was meant to be small enough to preempt"
    if not ARCHS[arch][3]:
        assert kv.stats.evicted_pages > 0, "cached pages were meant to be evicted"
        assert sum(o.metrics.prompt_tokens_reused for o in results) > 0
        assert kv.stats.estimated_reused_tokens == kv.stats.realised_reused_tokens
        if host_kv != "0":
            assert kv.stats.offloaded_pages > 0
    assert llm.num_unfinished_requests == 0
    assert kv.num_used_pages == 0

    ties = 0
    for i, (p, m, out) in enumerate(zip(prompts, max_tokens, results, strict=True)):
        assert out.prompt_token_ids == p
        assert out.finish_reason == "length"
        want, margins = hf_greedy(arch, model, p, m)
        ties += assert_matches(
            out.token_ids, want, margins, f"{arch} request {i} ({len(p)} tokens)"
        )
    assert ties <= 1, f"{ties} requests ended in near-ties: the comparison is too weak"

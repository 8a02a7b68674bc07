"""Prefix reuse for hybrid models (Mamba2, gated delta rule) through the engine.

For each hybrid architecture a tiny transformers model is randomly initialised,
saved and loaded by backplane (float32, CPU). A request sharing a long prefix
with an earlier one must skip the cached prefix (its recurrent state restored
from a snapshot) and still produce what the same requests produce with prefix
caching off: the same greedy tokens and the same logprobs. The logprobs are
what makes a wrong recurrent state visible: a tiny random model often keeps its
greedy tokens with a wrong state, never its logprobs.

Snapshot eviction under slot pressure, preemption and abort are checked the
same way, and every page and state slot must be back in its pool at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from hf_tiny import VOCAB  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402

PAGE = 4
LOGPROB_ATOL = 1e-4

#: arch -> (transformers class, config factory)
ARCHS = {
    "nemotron_h": ("NemotronHForCausalLM", hf_tiny.nemotron_h),
    "qwen3_next": ("Qwen3NextForCausalLM", hf_tiny.qwen3_next),
    "qwen3_5": ("Qwen3_5ForCausalLM", hf_tiny.qwen3_5),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """``arch -> saved directory`` of a tiny random model, built once per architecture."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            cls_name, make_cfg = ARCHS[arch]
            torch.manual_seed(1234)
            cfg = make_cfg()
            cfg.initializer_range = 0.15  # well-separated logits: greedy ties are rare
            model = getattr(transformers, cls_name)(cfg).eval()
            path = tmp_path_factory.mktemp(arch)
            model.save_pretrained(path)
            built[arch] = str(path)
        return built[arch]

    return get


def make_llm(path: str, **kw: Any) -> LLM:
    opts: dict[str, Any] = dict(
        device="cpu", dtype="float32", page_size=PAGE, max_num_seqs=2, max_num_tokens=8
    )
    opts.update(kw)
    return LLM(path, debug=True, **opts)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def tokens_and_logprobs(out: Any) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]


def assert_same(got: Any, want: Any, what: str) -> None:
    gt, gl = tokens_and_logprobs(got)
    wt, wl = tokens_and_logprobs(want)
    assert gt == wt, f"{what}: tokens {gt}, without prefix caching {wt}"
    np.testing.assert_allclose(gl, wl, atol=LOGPROB_ATOL, err_msg=what)


def assert_pools_full(llm: LLM) -> None:
    """Every page is free or idle-cached, every state slot free or holding a snapshot."""
    kv = llm.engine.kv_manager
    assert llm.num_unfinished_requests == 0
    assert kv.num_used_pages == 0
    snaps = kv.snapshots
    assert snaps is not None
    assert kv.slots.num_free + len(snaps) == kv.slots.num_slots - 1
    llm.engine.scheduler.check_invariants()


def prompts_of(seed: int, *sizes: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in sizes]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_shared_prefix_is_skipped_and_matches_no_caching(model_path, arch):
    path = model_path(arch)
    a, tail = prompts_of(7, 18, 6)
    b = a + tail  # a later turn of the same conversation
    outs = {}
    for caching in (True, False):
        llm = make_llm(path, enable_prefix_caching=caching)
        oa = llm.generate([a], [greedy(5)])[0]
        ob = llm.generate([b], [greedy(5)])[0]
        outs[caching] = (oa, ob, llm)
    (oa, ob, llm), (ra, rb, _) = outs[True], outs[False]
    # the state was kept after a's last full page (16 tokens): b skips those
    assert ob.metrics.prompt_tokens_reused == 16
    assert rb.metrics.prompt_tokens_reused == 0
    assert llm.engine.kv_manager.snapshots.restored == 1
    assert_same(oa, ra, f"{arch} first request")
    assert_same(ob, rb, f"{arch} request with a cached prefix")
    assert_pools_full(llm)


def test_snapshots_are_evicted_when_slots_are_short(model_path):
    path = model_path("nemotron_h")
    firsts = prompts_of(11, 10, 10, 10, 10)
    pair = prompts_of(12, 9, 9)
    extra = prompts_of(13, 3)[0]
    # max_num_seqs=2: 2 live slots + 2 spare ones
    results = {}
    for caching in (True, False):
        llm = make_llm(path, enable_prefix_caching=caching)
        got = [llm.generate([p], [greedy(3)])[0] for p in firsts]
        got += llm.generate(pair, [greedy(3)] * 2)  # two live sequences at once
        got += [llm.generate([firsts[0] + extra], [greedy(3)])[0]]
        got += [llm.generate([pair[1] + extra], [greedy(3)])[0]]
        results[caching] = (got, llm)
    (got, llm), (want, _) = results[True], results[False]
    snaps = llm.engine.kv_manager.snapshots
    # every prompt's state at 8, then each extension's at 12
    assert snaps.saved == 6 + 2
    # the fourth snapshot found no free slot; the two live sequences and theirs took more
    assert snaps.evicted >= 4
    assert len(snaps) <= 2 + 2
    assert got[-2].metrics.prompt_tokens_reused == 0, "the oldest snapshot was evicted"
    assert got[-1].metrics.prompt_tokens_reused == 8
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"request {i}")
    assert_pools_full(llm)


def test_preemption_with_shared_prefixes_matches_no_caching(model_path):
    path = model_path("qwen3_next")
    base = prompts_of(21, 13)[0]
    tails = prompts_of(22, 3, 5, 2, 6, 4)
    prompts = [base + t for t in tails] + [base[:10]] + prompts_of(23, 11, 7)
    params = [greedy(6)] * len(prompts)
    results = {}
    for caching in (True, False):
        llm = make_llm(path, enable_prefix_caching=caching, max_num_seqs=3, num_kv_pages=12)
        first = llm.generate(prompts[:1], params[:1])
        results[caching] = (first + llm.generate(prompts[1:], params[1:]), llm)
    (got, llm), (want, _) = results[True], results[False]
    assert llm.engine.scheduler.stats.preemptions > 0, "the KV cache was meant to preempt"
    assert sum(o.metrics.prompt_tokens_reused for o in got) > 0
    kv = llm.engine.kv_manager
    assert kv.stats.estimated_reused_tokens == kv.stats.realised_reused_tokens
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"request {i}")
    assert_pools_full(llm)


def test_abort_leaves_no_page_or_slot_behind(model_path):
    path = model_path("qwen3_5")
    base = prompts_of(31, 14)[0]
    llm = make_llm(path, max_num_seqs=3)
    llm.generate([base + [1]], [greedy(2)])  # keeps the state after 12 tokens
    engine = llm.engine
    ids = [
        engine.add_request(base + t, greedy(8), request_id=f"r{i}")
        for i, t in enumerate(prompts_of(32, 5, 9, 3, 6))
    ]
    engine.step()  # admitted, starting from the snapshot, mid-prefill
    assert engine.kv_manager.snapshots.restored >= 1
    assert engine.abort_request(ids[0])  # mid-prefill
    for _ in range(4):
        engine.step()
    assert engine.abort_request(ids[1])  # decoding or mid-prefill
    assert engine.abort_request(ids[3])  # waiting or running
    while engine.has_unfinished_requests():
        engine.step()
    assert_pools_full(llm)


@pytest.mark.parametrize("model", ["tiny-nemotron-h", "tiny-qwen3-next"])
def test_speculation_with_cached_prefixes_matches_no_caching(model):
    from engine_helpers import run_requests

    from backplane.engine.engine import Engine

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    opts = dict(device="cpu", dtype="float32", max_num_seqs=3, max_num_tokens=16, page_size=PAGE)
    rng = np.random.default_rng(41)
    start = rng.integers(1, VOCAB, size=7).tolist()
    # repeated text: n-gram drafts are proposed and verified on top of restored states
    prompts = [start * 3, start * 3 + start[:5], start * 4 + start[:2]]
    params = [SamplingParams(max_tokens=14, temperature=0.0)] * len(prompts)
    got = {}
    for caching in (True, False):
        engine = Engine(
            model=model, speculative_config=ngram, enable_prefix_caching=caching, **opts
        )
        # the first prompt alone, then the others starting from its cached prefix
        tokens = run_requests(engine, prompts[:1], params[:1])
        tokens += run_requests(engine, prompts[1:], params[1:])
        got[caching] = (tokens, engine)
    (tokens, engine), (want, _) = got[True], got[False]
    assert engine.kv_manager.stats.realised_reused_tokens > 0
    assert engine.kv_manager.snapshots.restored > 0
    assert engine.spec.stats.verified_seqs > 0
    assert tokens == want

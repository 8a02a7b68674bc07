"""``SamplingParams.prompt_logprobs`` (vLLM's meaning) against transformers.

A tiny Llama is randomly initialised by transformers, saved and loaded by
backplane (float32, CPU). For every prompt token after the first, the engine's
logprob of that token and its top ``k`` must be transformers' (a float64
``log_softmax`` of its logits over the whole prompt): with the prompt split in
chunks (a small ``max_num_tokens``), with one-token chunks that run with the
decodes, with the prompt already in the prefix cache (the request takes no
hits and still gets every position), beside plain requests whose outputs do
not change, sliced LM-head passes, ``n > 1``, streaming, and through the graph
runner's paths (CPU stand-ins of the piecewise and decode graphs; the real
graphs in the ``gpu`` test at the end).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from hf_tiny import VOCAB  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402
from backplane.core.errors import InvalidFieldError  # noqa: E402
from backplane.engine.sampling import FIELD_RULES  # noqa: E402

PAGE = 4
TORCH_BACKENDS = {"attention": "torch"}
#: logprob tolerance against the float64 reference (float32 engine)
ATOL = 1e-4
#: logits closer than this are a tie: either order is right
TIE = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, str]:
    """A transformers Llama (random, well-separated logits) and the directory it is saved in."""
    torch.manual_seed(1234)
    cfg = hf_tiny.llama()
    cfg.initializer_range = 0.15
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return model, str(path)


def make_llm(path: str, **kw: Any) -> LLM:
    config = dict(
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=4,
        max_num_tokens=8,
        num_kv_pages=96,
        backends=TORCH_BACKENDS,
    )
    config.update(kw)
    return LLM(path, **config)


@pytest.fixture(scope="module")
def llm(tiny):
    with make_llm(tiny[1]) as m:
        yield m


def prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lens]


def reference(model: Any, prompt: list[int]) -> torch.Tensor:
    """float64 log-probabilities: row ``j`` is the distribution of prompt token ``j + 1``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_prompt_logprobs(got: Any, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape and transformers' values: ``None``, then per prompt token its logprob and
    rank and the ``k`` most likely tokens (a near-tie may swap neighbours)."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        d, row, tok = got[j], ref[j - 1], prompt[j]
        assert tok in d, f"position {j}: the prompt token {tok} is missing from {sorted(d)}"
        assert len(d) in (k, k + 1) or (k == 0 and len(d) == 1)
        for t, v in d.items():
            assert v.logprob == pytest.approx(float(row[t]), abs=ATOL), (j, t)
        val = row[tok]
        lo = 1 + int((row > val + TIE).sum())
        hi = 1 + int((row > val - TIE).sum())
        assert lo <= d[tok].rank <= hi, (j, d[tok].rank, lo, hi)
        top = {t for t, v in d.items() if v.rank <= k}
        values, ids = row.topk(k + 1)
        want = set(ids[:k].tolist())
        if top != want:  # only a tie at the k-th place may differ
            assert k and float(values[k - 1] - values[k]) < TIE, (j, top, want)
        assert sorted(v.rank for t, v in d.items() if v.rank <= k) == list(range(1, len(top) + 1))


def _generate(llm: LLM, ps: list[list[int]], params: Any, async_scheduling: bool = True) -> list:
    llm.engine.async_scheduling = async_scheduling
    try:
        return llm.generate(ps, params)
    finally:
        llm.engine.async_scheduling = True


# -- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2", np.float32(1)])
def test_prompt_logprobs_is_validated_when_built(value):
    with pytest.raises(InvalidFieldError, match="prompt_logprobs") as exc:
        SamplingParams(prompt_logprobs=value)
    assert exc.value.field == "prompt_logprobs"


def test_prompt_logprobs_accepts_its_range():
    assert "prompt_logprobs" in FIELD_RULES
    assert SamplingParams().prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    p = SamplingParams(prompt_logprobs=np.int32(20))
    assert p.prompt_logprobs == 20 and type(p.prompt_logprobs) is int


# -- against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_prompts_match_transformers(tiny, llm, async_scheduling):
    """Prompts of up to 37 tokens in chunks of at most 8 (max_num_tokens), k = 5, 0 and 20,
    and a one-token prompt (no position to report)."""
    model, _ = tiny
    ps = prompts(1, (37, 19, 9, 1))
    ks = [5, 0, 20, 3]
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k) for k in ks]
    outs = _generate(llm, ps, params, async_scheduling)
    plain = _generate(llm, ps, SamplingParams(max_tokens=3, temperature=0), async_scheduling)
    for p, k, out, base in zip(ps, ks, outs, plain, strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, p, reference(model, p), k)
        assert out.token_ids == base.token_ids  # generation itself is unchanged
        assert base.prompt_logprobs is None
    assert outs[3].prompt_logprobs == [None]


def test_one_token_chunks_beside_decodes(tiny):
    """With max_num_tokens == max_num_seqs, a long prompt beside three decoding requests gets
    one-token chunks in the middle of its prompt: decode-shaped sequences with prompt rows."""
    model, path = tiny
    ps = prompts(2, (3, 4, 5, 30))
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4)
    ]
    with make_llm(path, max_num_tokens=4) as small:
        steps = _count_one_token_chunks(small)
        outs = small.generate(ps, params)
    assert steps["one_token_prompt_chunks"] > 0, "the setting was meant to make 1-token chunks"
    assert_prompt_logprobs(outs[3].prompt_logprobs, ps[3], reference(model, ps[3]), 4)


def _count_one_token_chunks(llm: LLM) -> dict[str, int]:
    """Count the steps where a prompt_logprobs request runs a 1-token chunk on cached context."""
    seen = {"one_token_prompt_chunks": 0}
    engine = llm.engine
    rows = engine._prompt_rows

    def spy(scheduled, inputs):
        for s in scheduled:
            r = s.request
            if (
                r.prompt_logprobs is not None
                and s.num_new_tokens == 1
                and s.num_cached_tokens > 0
                and s.num_cached_tokens < r.num_prompt_tokens - 1
            ):
                seen["one_token_prompt_chunks"] += 1
        return rows(scheduled, inputs)

    engine._prompt_rows = spy
    return seen


def test_prefix_cache_warm_prompt_still_gets_every_position(tiny, llm):
    """A prompt already in the prefix cache is computed whole for prompt_logprobs (no hits),
    and a prompt_logprobs request's pages are reused by the plain requests after it."""
    model, _ = tiny
    warm, cold = prompts(3, (26, 27))
    plain = SamplingParams(max_tokens=2, temperature=0)
    asks = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    first = llm.generate([warm], plain)[0]
    again = llm.generate([warm], plain)[0]
    assert again.metrics.prompt_tokens_reused > 0, "the plain repeat was meant to hit the cache"
    out = llm.generate([warm], asks)[0]
    assert out.metrics.prompt_tokens_reused == 0
    assert_prompt_logprobs(out.prompt_logprobs, warm, reference(model, warm), 2)
    assert out.token_ids == first.token_ids
    # published: a plain request after a prompt_logprobs one reuses its pages
    asked = llm.generate([cold], asks)[0]
    assert asked.metrics.prompt_tokens_reused == 0
    after = llm.generate([cold], plain)[0]
    assert after.metrics.prompt_tokens_reused >= (len(cold) - 1) // PAGE * PAGE
    assert after.token_ids == asked.token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_plain_requests_beside_prompt_logprobs_are_unchanged(tiny, llm, async_scheduling):
    """A batch mixing prompt_logprobs requests with plain ones (greedy, seeded sampling,
    logprobs, penalties): the plain ones' tokens and logprobs are what they are alone."""
    model, _ = tiny
    ps = prompts(4, (23, 11, 30, 6, 17))
    plain = [
        SamplingParams(max_tokens=6, temperature=0, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.8, seed=5),
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, logprobs=0),
    ]
    alone = [_generate(llm, [ps[i]], plain[i], async_scheduling)[0] for i in range(3)]
    mixed_params = [
        plain[0],
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3),
        plain[1],
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1, logprobs=2),
        plain[2],
    ]
    order = [ps[0], ps[3], ps[1], ps[4], ps[2]]  # plain prompts 0, 1, 2 at 0, 2, 4
    mixed = _generate(llm, order, mixed_params, async_scheduling)
    for got, want in zip([mixed[0], mixed[2], mixed[4]], alone, strict=True):
        assert got.token_ids == want.token_ids and got.prompt_logprobs is None
        if want.outputs[0].logprobs is not None:
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    for i, k in ((1, 3), (3, 1)):
        assert_prompt_logprobs(mixed[i].prompt_logprobs, order[i], reference(model, order[i]), k)
    assert len(mixed[3].outputs[0].logprobs) == 4


def test_long_chunks_go_through_the_lm_head_in_slices(tiny, monkeypatch):
    """Many prompt rows are projected in slices (here 3 rows each): same values."""
    from backplane.engine.worker import runner

    model, path = tiny
    p = prompts(5, (40,))[0]
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4)
    monkeypatch.setattr(runner, "PROMPT_LOGITS_BYTES", 3 * 4 * VOCAB)
    calls = []
    with make_llm(path, max_num_tokens=32) as m:
        head = m.engine.model.compute_logits

        def counted(h):
            calls.append(h.shape[0])
            return head(h)

        m.engine.model.compute_logits = counted
        out = m.generate([p], params)[0]
    assert max(calls) <= 3 and len(calls) > len(p) // 3
    assert_prompt_logprobs(out.prompt_logprobs, p, reference(model, p), 4)


def test_n_samples_stream_and_to_dict(tiny, llm):
    model, _ = tiny
    p = prompts(6, (14,))[0]
    ref = reference(model, p)
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=2, prompt_logprobs=2)
    (out,) = llm.generate([p], sp)
    assert len(out.outputs) == 2
    assert_prompt_logprobs(out.prompt_logprobs, p, ref, 2)
    # streamed: known from the output that brings the first token on
    deltas = list(llm.stream([p], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)))
    firsts = [d for d in deltas if d.token_ids]
    assert all(d.prompt_logprobs is not None for d in firsts)
    assert_prompt_logprobs(deltas[-1].prompt_logprobs, p, ref, 1)
    # to_dict stays JSON-ready
    back = json.loads(json.dumps(out.to_dict()))["prompt_logprobs"]
    assert back[0] is None and len(back) == len(p)
    assert {int(t): v["logprob"] for t, v in back[1].items()} == {
        t: v.logprob for t, v in out.prompt_logprobs[1].items()
    }


class Fault(RuntimeError):
    """The injected error."""


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_steps_mid_prompt_recompute_to_the_same_list(tiny, async_scheduling):
    """Steps that raise in the middle of a chunked prompt restart the request from its committed
    tokens (its prompt computed again, no prefix hits); the list comes out whole and right."""
    model, path = tiny
    ps = prompts(9, (33, 12))
    params = [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    ]
    with make_llm(path, async_scheduling=async_scheduling) as m:
        e = m.engine
        run = e.runner.run
        calls = {"n": 0}

        def flaky(inputs):
            calls["n"] += 1
            if calls["n"] in (3, 5):  # the long prompt is still in its chunks
                raise Fault("injected")
            return run(inputs)

        e.runner.run = flaky
        for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
            e.add_request(p, sp, request_id=f"r{i}")
        got: dict[str, Any] = {}
        tokens: dict[str, list[int]] = {"r0": [], "r1": []}
        raised = 0
        for _ in range(200):
            if not e.has_unfinished_requests():
                break
            try:
                outs = e.step()
            except Fault:
                raised += 1
                continue
            for o in outs:
                tokens[o.request_id] += o.new_token_ids
                if o.prompt_logprobs is not None:
                    assert o.request_id not in got, "delivered twice"
                    got[o.request_id] = o.prompt_logprobs
    assert raised == 2 and set(got) == {"r0"}
    assert_prompt_logprobs(got["r0"], ps[0], reference(model, ps[0]), 2)
    assert len(tokens["r0"]) == 3 and len(tokens["r1"]) == 6


# -- the graph runner's paths (CPU stand-ins) ---------------------------------------------------


def test_graph_runner_paths_give_the_same_prompt_logprobs(tiny):
    """Through the graph runner (piecewise prefill and decode-graph steps, CPU stand-ins):
    prompt rows join the eager gather after a piecewise forward, and a decode-graph step's
    one-token prompt chunks are read from the graph's logits."""
    from graph_helpers import graph_runner_for

    model, path = tiny
    ps = prompts(7, (3, 4, 5, 30))
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    ]
    with make_llm(path, max_num_tokens=8) as m:
        e = m.engine
        e.runner = graph_runner_for(
            e,
            max_num_tokens=8,
            max_num_seqs=4,
            token_bucket_sizes=[8],
            decode_bucket_sizes=[4],
            sampler=e.sampler,
        )
        e.runner.capture()
        assert e.runner.piecewise.failed == {} and e.runner.decode.failed == {}
        seen = set()
        sample = e.runner.sample

        def spy(hidden, inputs, rows):
            mode = inputs.mode
            kind = "piecewise" if mode.is_piecewise else "decode" if mode.is_decode_graph else ""
            seen.add((kind, rows.prompt is not None))
            return sample(hidden, inputs, rows)

        e.runner.sample = spy
        outs = m.generate(ps, params)
        # with a budget of one token per sequence, 1-token prompt chunks run in decode graphs
        e.scheduler.max_num_tokens = 4
        again = m.generate(ps, params)
    assert {("piecewise", True), ("decode", True), ("decode", False)} <= seen, seen
    for out in (outs[3], again[3]):
        assert_prompt_logprobs(out.prompt_logprobs, ps[3], reference(model, ps[3]), 3)


# -- CUDA graphs -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_prompt_logprobs_with_cuda_graphs_equal_eager():
    """Graphs on (piecewise prefill, decode graphs) vs off: the same prompt logprobs (within
    float32 noise of a padded GEMM) and tokens, for chunked prompts beside decoding requests."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    ps = prompts(8, (5, 7, 9, 100, 41))
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=5),
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, logprobs=2),
    ]
    results = {}
    for mode in ("off", "full_and_piecewise"):
        m = LLM(
            "tiny-llama",
            device="cuda",
            dtype="float32",
            max_num_seqs=4,
            max_num_tokens=32,
            max_model_len=128,
            cuda_graphs=mode,
            backends={"attention": "torch", "ssm": "torch", "mla": "torch", "delta": "torch"},
        )
        if mode != "off":
            runner = m.engine.runner
            assert runner.piecewise.failed == {} and runner.decode.failed == {}
        results[mode] = m.generate(ps, params)
        m.shutdown()
        del m
        torch.cuda.empty_cache()
    for off, on in zip(results["off"], results["full_and_piecewise"], strict=True):
        assert on.token_ids == off.token_ids
        if off.prompt_logprobs is None:
            assert on.prompt_logprobs is None
            continue
        assert len(on.prompt_logprobs) == len(off.prompt_logprobs) and on.prompt_logprobs[0] is None
        for a, b in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:], strict=True):
            for t in a.keys() & b.keys():
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
            # the top sets may differ only by a near-tie at their edge
            assert len(a.keys() ^ b.keys()) <= 2

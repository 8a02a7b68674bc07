"""Speculative decoding: configuration, n-gram drafts, exact rejection sampling, the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backplane.core.errors import ConfigError
from backplane.engine.sampling import SamplingParams, apply_filters
from backplane.engine.sampling.rejection import rejection_sample
from backplane.engine.spec_decode import SpeculativeConfig
from backplane.engine.spec_decode.ngram import NgramProposer, find_draft
from backplane.engine.spec_decode.proposer import ProposalRequest, Proposer

# -- configuration --------------------------------------------------------------------------


def test_config_from_mapping() -> None:
    cfg = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    )
    assert cfg == SpeculativeConfig("ngram", 3, 1, 2)
    assert SpeculativeConfig.from_value(cfg.to_dict()) == cfg
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "mtp", "num_speculative_tokens": 1, "model": "x"}, "only read by"),
        ("ngram", "must be a mapping"),
    ],
)
def test_config_refuses(value: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_value(value)


def test_engine_config_yaml_and_cli(tmp_path) -> None:
    import argparse

    from backplane.cli.options import add_engine_arguments, config_from_args
    from backplane.engine.config import EngineConfig

    want = SpeculativeConfig("ngram", 2, 1, 3)
    path = tmp_path / "engine.yaml"
    path.write_text(
        "speculative_config:\n  method: ngram\n  num_speculative_tokens: 2\n"
        "  prompt_lookup_max: 3\n"
    )
    cfg = EngineConfig.from_yaml(str(path))
    assert cfg.speculative_config == want
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    args = parser.parse_args(["--speculative-config", flag])
    assert config_from_args(args).speculative_config == want
    with pytest.raises(ConfigError, match="--speculative-config.*num_speculative_tokens"):
        config_from_args(parser.parse_args(["--speculative-config", '{"method": "ngram"}']))
    with pytest.raises(ConfigError, match="expected a JSON object"):
        EngineConfig(speculative_config="{method: ngram}")


# -- n-gram proposer --------------------------------------------------------------------------


def _naive_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Reference: scan every earlier position, longest suffix first, latest match wins;
    the text goes on copying what followed the match, one token at a time."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[len(tokens) :]
    return []


def test_find_draft_matches_naive_scan() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        lo = int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(0, 5))
        got = find_draft(np.array(tokens, dtype=np.int32), lo, hi, k).tolist()
        assert got == _naive_draft(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_ngram_proposer_respects_per_request_limit() -> None:
    prop = NgramProposer(SpeculativeConfig("ngram", 4))
    assert isinstance(prop, Proposer)
    toks = np.array([5, 6, 7, 8, 9, 5, 6], dtype=np.int32)
    reqs = [ProposalRequest("a", toks, 4, 6), ProposalRequest("b", toks, 2, 6)]
    assert prop.propose(reqs) == [[7, 8, 9, 5], [7, 8]]


# -- rejection sampling ---------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 4.265) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z=4.265: one-sided 1e-5)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _assert_distributed(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit of ``tokens`` against ``probs`` (cells with mass only)."""
    n = len(tokens)
    assert n > 500
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a token without target mass was emitted"
    keep = probs > 0
    expected = probs[keep] * n
    stat = float((((counts[keep] - expected) ** 2) / expected).sum())
    assert stat < _chi2_critical(int(keep.sum()) - 1), (stat, counts / n, probs)


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The sampler's distribution (its filters, then softmax), as an independent reference."""
    n = logits.shape[0]
    filt = apply_filters(
        logits,
        torch.full((n,), params.temperature),
        torch.full((n,), params.top_k, dtype=torch.int64) if params.top_k > 0 else None,
        torch.full((n,), params.top_p) if params.top_p < 1 else None,
    )
    return torch.softmax(filt, -1).double().numpy()


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "point-mass"])
@pytest.mark.parametrize("top_k", [0, 4])
def test_rejection_sampling_exact_in_distribution(with_q: bool, top_k: int) -> None:
    """Each emitted token at output index t is distributed as p_t, whatever q proposed.

    The target here is context-free (p_t depends only on the index t), so the token
    emitted at index t, whenever it is emitted, must follow p_t exactly.
    """
    gen = torch.Generator().manual_seed(1)
    vocab, k, n = 6, 3, 40000
    params = SamplingParams(temperature=0.9, top_k=top_k)
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    p = _target_probs(logits, params)  # [k + 1, vocab]
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    if with_q:
        drafts = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()
    else:
        # a fixed guess per position: likely ones, and a less likely one last
        guess = [int(p[0].argmax()), int(p[1].argmax()), int(np.argsort(p[2])[-2])]
        drafts = torch.tensor(guess).repeat(n, 1)
    num_drafts = np.random.default_rng(2).integers(0, k + 1, size=n)
    seeds = np.random.default_rng(3).integers(-(2**62), 2**62, size=n)
    out = rejection_sample(
        logits.expand(n, k + 1, vocab).contiguous(),
        drafts,
        num_drafts,
        [params] * n,
        seeds,
        np.zeros(n, dtype=np.int64),
        q.expand(n, k, vocab).contiguous() if with_q else None,
    )
    tokens = out.tokens.numpy()
    acc = out.num_accepted.numpy()
    assert (acc <= num_drafts).all()
    emitted = acc + 1
    assert ((tokens >= 0).sum(1) == emitted).all()
    assert (
        tokens[:, :k][np.arange(k) < acc[:, None]] == drafts.numpy()[np.arange(k) < acc[:, None]]
    ).all()
    assert acc.mean() > 0.1  # drafts are accepted at all
    for t in range(k + 1):
        col = tokens[:, t]
        _assert_distributed(col[col >= 0], p[t])


def test_point_mass_matches_plain_sampling_token_for_token() -> None:
    """n-gram verification draws with the sampler's noise: the first emitted token is the
    plain sampler's token at the same seed and index."""
    from backplane.engine.sampling import Sampler

    gen = torch.Generator().manual_seed(4)
    n, k, vocab = 64, 2, 11
    logits = torch.randn(n, k + 1, vocab, generator=gen)
    params = [SamplingParams(temperature=1.0)] * n
    seeds = np.arange(n, dtype=np.int64) * 7919
    offsets = np.arange(n, dtype=np.int64) % 5
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    out = rejection_sample(logits, drafts, np.full(n, k), params, seeds, offsets)
    plain = Sampler().sample(logits[:, 0], params, seeds, offsets)
    assert torch.equal(out.tokens[:, 0], plain)


def test_greedy_accepts_while_argmax_agrees() -> None:
    logits = torch.zeros(2, 4, 5)
    best = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])
    logits.scatter_(2, best.unsqueeze(-1), 5.0)
    drafts = torch.tensor([[1, 2, 0], [0, 1, 0]])
    out = rejection_sample(
        logits,
        drafts,
        np.array([3, 3]),
        [SamplingParams(temperature=0.0)] * 2,
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
    )
    assert out.num_accepted.tolist() == [2, 1]
    assert out.tokens.tolist() == [[1, 2, 3, -1], [0, 0, -1, -1]]
    # fewer drafts than the width: the bonus comes from the position after the last one
    out = rejection_sample(
        logits,
        drafts,
        np.array([1, 0]),
        [SamplingParams(temperature=0.0)] * 2,
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
    )
    assert out.tokens.tolist() == [[1, 2, -1, -1], [0, -1, -1, -1]]


# -- the engine ----------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)


def _qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    transformers = pytest.importorskip("transformers")
    import hf_tiny

    torch.manual_seed(1234)
    cfg = hf_tiny.qwen3()
    cfg.initializer_range = 0.15  # well-separated logits: greedy ties are rare
    path = tmp_path_factory.mktemp("qwen3")
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def _run(engine, prompts, params):
    """Token ids of every request, driving the engine step by step and checking that
    pages past the tokens a request holds are never kept (drafts rejected give theirs back)
    and that no page holding a draft token is registered for reuse."""
    from backplane.core.launch import cdiv

    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        for req in engine.scheduler.running:
            assert req.kv_state.num_pages <= cdiv(req.num_tokens, engine.page_size)
            # only pages of computed (never of rejected draft) tokens reach the prefix cache
            assert req.kv_state.num_registered <= req.num_computed_tokens // engine.page_size
        engine.scheduler.check_invariants()
    return [got[i] for i in ids]


def _engines(model: str, **kw):
    from backplane.engine.engine import Engine

    plain = Engine(model=model, **{**ENGINE, **kw})
    spec = Engine(model=model, speculative_config=NGRAM, **{**ENGINE, **kw})
    return plain, spec


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    base = rng.integers(1, vocab, size=9).tolist()
    return [base * 3, (base[3:] + base) * 2, rng.integers(1, vocab, size=7).tolist()]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-deepseek-v3", "qwen3"])
def test_greedy_and_seeded_tokens_equal_decoding_without_speculation(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = _qwen3_dir(tmp_path_factory) if arch == "qwen3" else arch
    plain, spec = _engines(model)
    prompts = _repetitive_prompts(min(plain.vocab_size, 96))
    params = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.8, seed=11),
    ]
    want = _run(plain, prompts, params)
    got = _run(spec, prompts, params)
    assert got == want
    stats = spec.spec.stats
    assert stats.accepted_tokens > 0 and stats.verified_seqs > 0
    assert plain.spec is None
    # fewer steps than tokens: several tokens were committed in one step
    assert spec.scheduler.stats.steps < plain.scheduler.stats.steps


@pytest.mark.usefixtures("one_torch_thread")
def test_max_tokens_and_stop_token_inside_an_accepted_run() -> None:
    plain, spec = _engines("tiny-llama")
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    prompts = _repetitive_prompts(plain.vocab_size)
    fulls = _run(plain, prompts, [greedy] * len(prompts))
    prompt, full = prompts[0], fulls[0]
    for n in range(1, 12):
        sp = SamplingParams(max_tokens=n, temperature=0.0)
        assert _run(spec, [prompt], [sp])[0] == full[:n]
    # a stop token first sampled after drafts were accepted: the output ends right after it
    prompt, full, first = next(
        (p, f, j)
        for p, f in zip(prompts, fulls, strict=True)
        for j, t in enumerate(f)
        if j >= 10 and f.index(t) == j
    )
    sp = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[full[first]])
    before = spec.spec.stats.accepted_tokens
    assert _run(spec, [prompt], [sp])[0] == full[: first + 1]
    assert spec.spec.stats.accepted_tokens > before


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("host_kv_memory", [0, "1MiB"], ids=["device", "host-tier"])
def test_prefix_caching_and_preemption_with_speculation(host_kv_memory: object) -> None:
    """Few pages: requests are preempted and recompute; shared prefixes hit the cache
    (with the host tier too). A page registered with a rejected draft would corrupt
    later hits."""
    kw = dict(num_kv_pages=24, enable_prefix_caching=True, host_kv_memory=host_kv_memory)
    plain, spec = _engines("tiny-llama", **kw)
    rng = np.random.default_rng(8)
    base = rng.integers(1, plain.vocab_size, size=6).tolist()
    prompts = [base * 2 + rng.integers(1, 50, size=i % 3 + 1).tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=14 + i, temperature=0.0) for i in range(6)]
    want = _run(plain, prompts, params)
    got = _run(spec, prompts, params)
    assert got == want
    assert spec.scheduler.stats.preemptions > 0
    assert (
        spec.kv_manager.stats.reused_pages > 0
        if hasattr(spec.kv_manager.stats, "reused_pages")
        else True
    )
    assert spec.spec.stats.accepted_tokens > 0
    # again, now from a warm prefix cache holding pages of the first round's outputs
    assert _run(spec, [p + o for p, o in zip(prompts, got, strict=True)], params) == _run(
        plain, [p + o for p, o in zip(prompts, want, strict=True)], params
    )


@pytest.mark.usefixtures("one_torch_thread")
def test_abort_while_speculating() -> None:
    plain, spec = _engines("tiny-llama")
    prompts = _repetitive_prompts(plain.vocab_size)[:2]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    want = _run(plain, prompts[1:], [greedy])[0]
    gone = spec.add_request(prompts[0], greedy)
    kept = spec.add_request(prompts[1], greedy)
    got: list[int] = []
    for _ in range(4):
        for out in spec.step():
            if out.request_id == kept:
                got.extend(out.new_token_ids)
    assert spec.abort_request(gone)
    while spec.has_unfinished_requests():
        for out in spec.step():
            if out.request_id == kept:
                got.extend(out.new_token_ids)
        spec.scheduler.check_invariants()
    assert got == want
    # every page is back, as in an engine that never speculated
    assert spec.kv_manager.num_available_pages == plain.kv_manager.num_available_pages
    assert spec.spec.stats.accepted_tokens > 0


@pytest.mark.gpu
def test_graphs_on_engine_speculates_with_the_same_greedy_tokens() -> None:
    """Verification steps run piecewise or eager beside captured decode graphs."""
    from backplane.engine.engine import Engine

    kw = dict(device="cuda", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=16)
    plain = Engine(model="tiny-llama", cuda_graphs="full_and_piecewise", **kw)
    spec = Engine(
        model="tiny-llama", cuda_graphs="full_and_piecewise", speculative_config=NGRAM, **kw
    )
    prompts = _repetitive_prompts(plain.vocab_size)
    params = [SamplingParams(max_tokens=24, temperature=0.0)] * len(prompts)
    assert _run(spec, prompts, params) == _run(plain, prompts, params)
    assert spec.spec.stats.accepted_tokens > 0


@pytest.mark.usefixtures("one_torch_thread")
def test_llm_metrics_stop_string_and_server_counters() -> None:
    """Through the api: the same text as without speculation, a stop string met inside a
    run of accepted drafts truncates alike, and the request's metrics and the server's
    counters report the drafts."""
    from backplane import LLM
    from backplane.api.async_llm import EngineSnapshot
    from backplane.server.metrics import ServerMetrics

    plain = LLM("tiny-llama", **ENGINE)
    spec = LLM("tiny-llama", speculative_config=NGRAM, **ENGINE)
    prompt = _repetitive_prompts(plain.engine.vocab_size)[1]
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    want = plain.generate(prompt, greedy)[0]
    got = spec.generate(prompt, greedy)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    m = got.metrics
    assert m.spec_verify_steps > 0 and m.spec_draft_tokens >= m.spec_accepted_tokens > 0
    assert m.spec_acceptance_rate == m.spec_accepted_tokens / m.spec_draft_tokens
    assert m.spec_mean_accepted_length > 1.0
    assert want.metrics.spec_acceptance_rate is None
    text = want.outputs[0].text
    stop = text[2 * len(text) // 3 :][:3]
    with_stop = SamplingParams(max_tokens=30, temperature=0.0, stop=[stop])
    a = plain.generate(prompt, with_stop)[0].outputs[0]
    b = spec.generate(prompt, with_stop)[0].outputs[0]
    assert (b.text, b.finish_reason) == (a.text, a.finish_reason)
    assert a.finish_reason == "stop" and len(a.text) < len(text)

    class _Engine:  # what ServerMetrics reads of an AsyncLLM
        def add_finished_callback(self, callback):
            pass

        def snapshot(self):
            return EngineSnapshot()

    metrics = ServerMetrics(_Engine(), "m")
    metrics.on_finished(got)
    page = metrics.render().decode()
    assert (
        f'backplane_spec_decode_accepted_tokens_total{{model_name="m"}} {float(m.spec_accepted_tokens)}'
        in page
    )
    assert (
        f'backplane_spec_decode_draft_tokens_total{{model_name="m"}} {float(m.spec_draft_tokens)}'
        in page
    )

"""lm-evaluation-harness end to end against ``backplane serve``.

A real server (the tiny Llama preset on the CPU) runs in a subprocess on
127.0.0.1; lm-eval's ``local-completions`` model drives it with the server's
own tokenizer (``tokenizer_backend=remote``: ``/tokenizer_info``,
``/tokenize``, ``/detokenize``) on two tiny local tasks under
``tests/data/lm_eval`` (nothing is downloaded):

- a multiple-choice task: loglikelihood requests, which lm-eval sends as token
  ids with ``echo``, ``max_tokens: 1`` and ``logprobs: 1``, reading the prompt's
  ``token_logprobs``;
- a ``generate_until`` task: greedy generations cut at a stop string.

Every score lm-eval reports is recomputed from an offline :class:`LLM` of the
same preset: each choice's loglikelihood as the sum of its continuation
tokens' prompt logprobs, the chosen answer as their argmax, and each
generation as the same greedy request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

for _module in ("lm_eval", "fastapi", "uvicorn", "httpx", "datasets"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install 'lm-eval[api]')")

from server_helpers import ROOT, running_server  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402

MODEL = "tiny-llama"
TASKS = Path(__file__).parent / "data" / "lm_eval"
MC, GEN = "backplane_tiny_mc", "backplane_tiny_gen"
#: logprob sums of the server against the offline engine (float32, other batches)
ATOL = 1e-3
SEED = 1234  # lm-eval sends it with every request


def _encode_pair(llm: LLM, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's split of a loglikelihood request into tokens: trailing spaces of the
    context go to the continuation, and the whole is tokenized at once.

    :return: the ids of context + continuation and the context's length in tokens.
    """
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = llm.encode(context)
    whole = llm.encode(context + continuation)
    return whole, len(ctx)


def _loglikelihood(llm: LLM, context: str, continuation: str) -> float:
    """The continuation's log-probability given the context, by the offline engine."""
    ids, ctxlen = _encode_pair(llm, context, continuation)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([ids], params)[0]
    return sum(out.prompt_logprobs[j][ids[j]].logprob for j in range(ctxlen, len(ids)))


def _generation(llm: LLM, context: str, until: list[str], max_tokens: int) -> str:
    """The offline greedy generation, cut at the first stop string as lm-eval cuts it."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=until, seed=SEED)
    text = llm.generate([llm.encode(context)], params)[0].text
    for term in until:
        text = text.split(term)[0]
    return text


@pytest.fixture(scope="module")
def server():
    args = [MODEL, "--device", "cpu", "--max-num-seqs", "8"]
    with running_server(args) as url:
        yield url


def test_lm_eval_local_completions_scores_match_the_engine(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL,
            "base_url": f"{server}/v1/completions",
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "batch_size": 4,
            "max_retries": 1,
        },
        tasks=[MC, GEN],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        random_seed=0,
    )
    assert results is not None
    samples = results["samples"]
    llm = LLM(MODEL, device="cpu", max_num_seqs=8)
    try:
        # multiple choice: every choice's loglikelihood, and the accuracy of their argmax
        mc = sorted(samples[MC], key=lambda s: s["doc_id"])
        assert len(mc) == 4
        hits = []
        for s in mc:
            server_lls = [float(r[0][0]) for r in s["resps"]]
            want = [_loglikelihood(llm, ctx, cont) for ctx, cont in s["arguments"]]
            assert server_lls == pytest.approx(want, abs=ATOL), s["doc_id"]
            assert len(set(round(x, 2) for x in want)) == len(want)  # no near tie decides
            hits.append(max(range(len(want)), key=want.__getitem__) == s["doc"]["answer"])
        assert results["results"][MC]["acc,none"] == pytest.approx(sum(hits) / len(hits))

        # generate_until: the same greedy texts, and their exact match against the targets
        gen = sorted(samples[GEN], key=lambda s: s["doc_id"])
        assert len(gen) == 3
        matches = []
        for s in gen:
            context, kwargs = s["arguments"][0]
            until = list(kwargs["until"])
            want = _generation(llm, context, until, kwargs.get("max_gen_toks", 8))
            assert s["resps"][0][0] == want, s["doc_id"]
            matches.append(want == s["doc"]["target"])
        got = results["results"][GEN]["exact_match,none"]
        assert got == pytest.approx(sum(matches) / len(matches))
    finally:
        llm.shutdown()

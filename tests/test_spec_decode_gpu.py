"""Speculative decoding on a GPU: every architecture, the Triton and FlashInfer attention
backends, CUDA graphs on: greedy output token for token that of decoding without speculation,
the verification steps of models without recurrent state replayed as verify graphs."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import test_e2e  # noqa: E402
from test_e2e import ARCHS  # noqa: E402

from backplane import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

hf_model = test_e2e.hf_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# a KV cache of a fixed size: sized from free memory, engines of tests sharing the GPU
# would take each other's room
ENGINE = dict(
    device="cuda",
    dtype="float32",
    max_num_seqs=4,
    max_num_tokens=64,
    page_size=16,
    kv_memory="256MiB",
)
BACKENDS = ["triton", "flashinfer"]


def _tokens(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[i] for i in ids]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_speculation_on_gpu_gives_the_greedy_tokens_of_plain_decoding(hf_model, arch, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    from backplane.engine.engine import Engine

    _, path = hf_model(arch)
    settings = dict(ENGINE, backends={"attention": backend}, cuda_graphs="full_and_piecewise")
    rng = np.random.default_rng(len(arch))
    base = rng.integers(1, 96, size=9).tolist()
    prompts = [base * 3, (base[3:] + base) * 2, rng.integers(1, 96, size=7).tolist()]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = Engine(model=path, **settings)
    try:
        want = _tokens(plain, prompts, params)
    finally:
        plain.shutdown()
    spec = Engine(model=path, speculative_config=NGRAM, **settings)
    try:
        verify = spec.runner.verify
        replays = []
        if verify is not None:
            # count the verification steps that ran as one captured graph
            replay = verify.replay
            verify.replay = lambda bucket: replays.append(bucket) or replay(bucket)
        got = _tokens(spec, prompts, params)
        stats = spec.spec.stats
        recurrent = spec.executor.driver.has_recurrent_state
        backends = dict(spec.executor.driver.backends)
    finally:
        spec.shutdown()
    assert stats.verified_seqs > 0, "no draft was verified: speculation was not exercised"
    assert got == want
    # every model verifies in captured graphs: under speculation auto picks the recurrent
    # backends that chain rows (FlashInfer's would make a hybrid verify piecewise)
    chaining = [
        f"{family}={b.name}"
        for family, b in backends.items()
        if not getattr(b, "chains_rows", True)
    ]
    assert not chaining, f"auto chose recurrent backends that do not chain rows: {chaining}"
    assert verify is not None, f"no verify graphs (recurrent state: {recurrent})"
    assert replays, "no verification step replayed a verify graph"

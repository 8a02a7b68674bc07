"""Speculative decoding on a GPU: every architecture, the Triton and FlashInfer attention
backends, CUDA graphs on: greedy output token for token that of decoding without speculation,
the verification steps of models without recurrent state replayed as verify graphs.

Triton runs in float32, where verifying ``k + 1`` tokens in one forward and decoding them one
by one agree to the last token. FlashInfer attention runs in bfloat16 only, whose rounding
differs between its prefill kernel (verification) and its decode kernel; there the tokens must
agree up to the first position where plain decoding itself was a near-tie (its two most likely
tokens within bfloat16 noise), where speculation must have taken plain decoding's runner-up;
from then on the sequences go their own ways."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import test_e2e  # noqa: E402
from flashinfer_helpers import MLA_DIMS  # noqa: E402
from test_e2e import ARCHS  # noqa: E402

from backplane import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

hf_model = test_e2e.hf_model

# FlashInfer's kernels take head dims of 64, 128 or 256 (and its MLA DeepSeek's latent
# shape): the tiny configs with their heads widened to those, everything else as tiny
FLASHINFER_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 128},
    "qwen3": {"head_dim": 128},
    "qwen3_5": {"head_dim": 128},
    "nemotron_h": {"head_dim": 128},
    "qwen3_next": {"head_dim": 128},
    # transformers derives these two from the others when a config is made, not after
    "deepseek_v3": {**MLA_DIMS, "head_dim": 64, "qk_head_dim": 192},
}


@pytest.fixture(scope="module")
def hf_flashinfer_model(tmp_path_factory):
    """Like ``hf_model``, with heads of the sizes FlashInfer's kernels take."""
    return test_e2e.hf_model_factory(tmp_path_factory, FLASHINFER_SHAPES)


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


# The largest gap between plain decoding's two most likely tokens (log-probabilities)
# that bfloat16 rounding may swap: its logits of a few units carry steps of 1/32 to 1/16,
# and two kernels' rounding, three layers on and through an expert router, can differ by
# a few of those steps.
BF16_TIE = 0.25


def _tokens(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [tokens for tokens, _ in _outputs(engine, prompts, params)]


def _outputs(
    engine, prompts, params: SamplingParams
) -> list[tuple[list[int], list[tuple[int, float]]]]:
    """Per prompt, the generated tokens and (when ``params.logprobs``) at each of them the
    runner-up token and its log-probability gap to the most likely one."""
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, tuple[list[int], list[tuple[int, float]]]] = {i: ([], []) for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, runners_up = got[out.request_id]
            tokens.extend(out.new_token_ids)
            for top in out.new_logprobs or []:
                (lp1, _), (lp2, second) = sorted(
                    ((lp.logprob, t) for t, lp in top.items()), reverse=True
                )[:2]
                runners_up.append((second, lp1 - lp2))
    return [got[i] for i in ids]


def _assert_same_up_to_ties(
    got: list[list[int]], want: list[tuple[list[int], list[tuple[int, float]]]]
) -> None:
    """Each sequence equal to plain decoding's up to its first near-tie, if any, where it
    must have taken plain decoding's runner-up (a wrong verification picks any token)."""
    for n, (seq, (ref, runners_up)) in enumerate(zip(got, want, strict=True)):
        assert len(seq) == len(ref), f"prompt {n}: {len(seq)} tokens, plain {len(ref)}"
        for j, (a, b) in enumerate(zip(seq, ref, strict=True)):
            if a != b:
                second, gap = runners_up[j]
                assert a == second and gap <= BF16_TIE, (
                    f"prompt {n}, token {j}: speculation gave {a}, plain decoding {b} (runner-up "
                    f"{second}, {gap:.4f} behind; ties are below {BF16_TIE})"
                )
                break


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_speculation_on_gpu_gives_the_greedy_tokens_of_plain_decoding(
    hf_model, hf_flashinfer_model, arch, backend
):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    from backplane.engine.engine import Engine

    exact = backend != "flashinfer"
    _, path = (hf_model if exact else hf_flashinfer_model)(arch)
    # MLA is an attention family of its own: DeepSeek-V3 runs its attention there
    chosen = {"attention": backend, "mla": backend}
    settings = dict(ENGINE, backends=chosen, cuda_graphs="full_and_piecewise")
    if not exact:
        settings["dtype"] = "bfloat16"
    rng = np.random.default_rng(len(arch))
    base = rng.integers(1, 96, size=9).tolist()
    prompts = [base * 3, (base[3:] + base) * 2, rng.integers(1, 96, size=7).tolist()]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = Engine(model=path, **settings)
    try:
        want = _outputs(plain, prompts, dataclasses.replace(params, logprobs=None if exact else 2))
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
    if exact:
        assert got == [tokens for tokens, _ in want]
    else:
        _assert_same_up_to_ties(got, want)
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

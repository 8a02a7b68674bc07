"""Models are built on ``meta`` without running their initialisers and given storage
without torch's Python references: the same model, and a start-up without CUDA graphs
that imports neither ``torch._dynamo`` nor ``sympy``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch

import backplane.models.base as base
from backplane.models.meta_init import materialize, skip_meta_init


def test_fills_of_meta_tensors_are_skipped_and_others_run() -> None:
    with torch.device("meta"), skip_meta_init():
        layer = torch.nn.Linear(4, 3)
        emb = torch.nn.Embedding(5, 2)
    assert layer.weight.is_meta and emb.weight.is_meta
    # a tensor with storage is initialised exactly as without the mode
    torch.manual_seed(0)
    expected = torch.nn.init.normal_(torch.empty(3, 4), std=0.5)
    with skip_meta_init():
        torch.manual_seed(0)
        got = torch.nn.init.normal_(torch.empty(3, 4), std=0.5)
        fan = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(3, 4, device="meta"))
    assert torch.equal(got, expected)
    assert fan == (4, 3)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-nemotron-h"])
def test_the_built_model_is_the_same(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from backplane import LLM

    def weights() -> dict[str, torch.Tensor]:
        llm = LLM(model, device="cpu", num_kv_pages=16, max_num_seqs=2)
        try:
            state = llm.engine.model.state_dict()
            return {k: v.clone() for k, v in state.items()}
        finally:
            llm.shutdown()

    skipped = weights()
    monkeypatch.setattr(base, "skip_meta_init", contextlib.nullcontext)
    initialised = weights()
    assert skipped.keys() == initialised.keys()
    for name, tensor in initialised.items():
        assert torch.equal(skipped[name], tensor), name


@pytest.mark.parametrize("module", ["torch._dynamo", "sympy"])
def test_an_eager_cpu_start_up_does_not_import(module: str) -> None:
    # dynamo comes with graph capture only; sympy with torch's empty_like of meta tensors
    code = textwrap.dedent(
        f"""
        import sys
        from backplane import LLM
        llm = LLM("tiny-llama", device="cpu", num_kv_pages=16, max_num_seqs=2)
        print({module!r} in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_materialize_allocates_what_to_empty_does() -> None:
    def built() -> torch.nn.Module:
        with torch.device("meta"):
            module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        module.register_buffer("table", torch.empty(5, 2, device="meta").t())
        module.requires_grad_(False)
        module[0].bias.requires_grad_(True)
        return module

    expected = built().to_empty(device="cpu")
    got = materialize(built(), "cpu")
    want = dict(expected.named_parameters()) | dict(expected.named_buffers())
    have = dict(got.named_parameters()) | dict(got.named_buffers())
    assert have.keys() == want.keys()
    for name, tensor in have.items():
        ref = want[name]
        assert type(tensor) is type(ref), name
        assert (tensor.shape, tensor.stride(), tensor.dtype) == (
            ref.shape,
            ref.stride(),
            ref.dtype,
        ), name
        assert (tensor.device, tensor.requires_grad) == (ref.device, ref.requires_grad), name
    # the transposed buffer keeps its layout, as empty_like gives it
    assert have["table"].stride() == (1, 2)

"""FP8 models: FP8 checkpoints of both layouts, quantisation on load, the FP8 KV cache, refusals.

Checkpoints are written here from the ``tiny-llama`` preset's random float32
weights: every projection quantised (``quantize_weight``) and stored with its
scale the way Hugging Face's ``fp8`` method (DeepSeek-V3: 128x128 blocks,
``weight_scale_inv``) or compressed-tensors' ``float-quantized`` format
(``weight_scale`` per tensor or channel, optional ``input_scale``) stores it.
Each loads and is compared with the same model holding the dequantised
weights in float32 (equal up to float rounding) and with the unquantised
model (the tolerances below, measured on this preset and documented).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backplane.backends.torch.attention import TorchAttentionBackend
from backplane.backends.torch.delta import TorchDeltaBackend
from backplane.backends.torch.mla import TorchMLABackend
from backplane.backends.torch.ssm import TorchSSMBackend
from backplane.core.errors import ConfigError
from backplane.core.families import AttentionBackend
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.packing import build_batch_metadata
from backplane.engine.config import EngineConfig
from backplane.models import WeightLoadError, load_model
from backplane.models.base import CausalLM
from backplane.models.linear import Linear
from backplane.models.presets import preset_config
from backplane.models.quant.fp8 import FP8_DTYPE, quantize_weight
from backplane.models.quant.kv_cache import use_fp8_kv_cache

PRESET = "tiny-llama"
PAGE_SIZE = 16
PROMPT, DECODE = 20, 12

#: The unquantised model against its FP8 versions, logit errors in units of the
#: reference logits' standard deviation over 32 teacher-forced positions.
#: Measured on this preset: mean error 0.029-0.039, largest 0.16-0.30, next-token
#: agreement 31/32 or 32/32 for every layout and for quantisation on load. The
#: bounds leave about 1.5x room.
MAX_MEAN_LOGIT_ERROR = 0.06
MAX_LOGIT_ERROR = 0.45
MIN_AGREEMENT = 0.9
#: Quantisation on load of the MLA / MoE, Mamba2 and delta-rule presets (measured:
#: mean 0.011-0.041, largest 0.10-0.27, agreement 29/32 to 32/32).
HYBRID_MIN_AGREEMENT = 0.84
#: The FP8 KV cache against the float32 one (measured: mean 0.018-0.021,
#: largest 0.10-0.11, agreement 31/32).
KV_MAX_MEAN_LOGIT_ERROR = 0.035
KV_MAX_LOGIT_ERROR = 0.2


def _backends() -> dict:
    return {
        "attention": TorchAttentionBackend(),
        "mla": TorchMLABackend(),
        "ssm": TorchSSMBackend(),
        "delta": TorchDeltaBackend(),
    }


def _projection_weights(state: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in state if n.endswith("_proj.weight")]


def _float_state(lm: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names, contiguous copies."""
    return {
        name: (t if i is None else t[i]).detach().clone().contiguous()
        for name, (t, i) in lm.weight_targets().items()
    }


def _write(
    path: Path,
    state: dict[str, torch.Tensor],
    quant: dict | None = None,
    preset: str = PRESET,
    config: dict | None = None,
) -> Path:
    """A checkpoint folder of ``state`` with ``config`` (``preset``'s by default)."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(preset_config(preset) if config is None else config)
    if quant is not None:
        config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return path


def _scale_of(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Each element's scale, from a checkpoint scale, one block at a time."""
    out = torch.empty(rows, cols)
    if scale.numel() == 1:
        return out.fill_(scale.item())
    if scale.shape == (rows, 1):
        return out.copy_(scale.expand(rows, cols))
    bn, bk = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = scale[i, j]
    return out


def _fp8_checkpoints(
    tmp: Path,
    state: dict[str, torch.Tensor],
    layout: str,
    preset: str = PRESET,
    *,
    block: tuple[int, int] = (32, 32),  # tiny-llama's widths are 64 and 128: several blocks
    config: dict | None = None,
    folder: str | None = None,
) -> tuple[Path, Path]:
    """An FP8 checkpoint of ``state`` in ``layout`` and a float one holding its dequantised weights
    (``config`` instead of ``preset``'s, and the folders named after ``folder``, where given)."""
    if layout == "hf-block":
        granularity, scale_name = "block", "weight_scale_inv"
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        quant["weight_block_size"] = list(block)
    else:
        granularity = layout.split("-")[1]
        scale_name = "weight_scale"
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": granularity,
                        "block_structure": list(block),
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "tensor" if layout.endswith("static") else "token",
                        "dynamic": not layout.endswith("static"),
                    },
                }
            },
            "ignore": ["lm_head"],
        }
        granularity = granularity.replace("-static", "")
        quant["config_groups"]["group_0"]["weights"]["strategy"] = granularity
    fp8, deq = dict(state), dict(state)
    for name in _projection_weights(state):
        w = state[name]
        if w.dim() != 2:
            continue
        q, scale = quantize_weight(w, granularity, block)
        base = name[: -len(".weight")]
        fp8[name] = q
        fp8[f"{base}.{scale_name}"] = scale.reshape(()) if granularity == "tensor" else scale
        if layout.endswith("static"):
            fp8[f"{base}.input_scale"] = torch.rand(()) + 0.5
        deq[name] = q.float() * _scale_of(scale, *w.shape, block)
    folder = folder or f"{preset}-{layout}"
    return (
        _write(tmp / f"{folder}-fp8", fp8, quant, preset, config),
        _write(tmp / f"{folder}-deq", deq, preset=preset, config=config),
    )


def _logits(lm: CausalLM, ids: torch.Tensor, *, cache_dtype: torch.dtype) -> torch.Tensor:
    """Teacher-forced logits of ``ids``: a prefill of :data:`PROMPT` tokens, then one-token decodes."""
    lm.allocate_caches(
        num_pages=5, page_size=PAGE_SIZE, num_slots=2, dtype=cache_dtype, device="cpu"
    )
    table = torch.arange(1, 5).numpy()
    backends = _backends()
    out, done = [], 0
    for n in [PROMPT] + [1] * DECODE:
        batch = build_batch_metadata([n], [done], [table], PAGE_SIZE, state_slots=[1], device="cpu")
        with torch.no_grad(), forward_context(batch, plan_step(backends, batch)):
            hidden = lm(ids[done : done + n], batch.positions)
            out.append(lm.compute_logits(hidden[:n]).clone())
        done += n
    return torch.cat(out)


def _accurate(
    got: torch.Tensor,
    ref: torch.Tensor,
    mean_bound: float,
    max_bound: float,
    min_agreement: float = MIN_AGREEMENT,
) -> tuple[float, float, float]:
    """Check ``got`` against ``ref``: mean and largest logit error (in units of the
    reference logits' standard deviation) under the bounds, next-token agreement
    at least ``min_agreement``, and some error (the values really were rounded)."""
    err = (got - ref).abs() / ref.std()
    mean, largest = err.mean().item(), err.max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert 0 < mean < mean_bound and largest < max_bound and agree >= min_agreement, (
        mean,
        largest,
        agree,
    )
    return mean, largest, agree


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    lm = load_model(PRESET, dtype="float32", device="cpu", backends=_backends()).model
    state = _float_state(lm)
    tmp = tmp_path_factory.mktemp("fp8")
    ids = torch.randint(
        0, lm.vocab_size, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(5)
    )
    ref = _logits(lm, ids, cache_dtype=torch.float32)
    return tmp, state, ids, ref


@pytest.mark.parametrize(
    "layout", ["hf-block", "ct-tensor", "ct-channel", "ct-block", "ct-channel-static"]
)
def test_fp8_checkpoint_loads_and_matches_its_dequantised_weights(base, layout) -> None:
    tmp, state, ids, ref = base
    fp8_dir, deq_dir = _fp8_checkpoints(tmp, state, layout)
    lm = load_model(str(fp8_dir), dtype="float32", device="cpu", backends=_backends()).model
    linears = {n: m for n, m in lm.named_modules() if isinstance(m, Linear)}
    assert all(m.weight.dtype == FP8_DTYPE for n, m in linears.items() if n != "lm_head")
    assert linears["lm_head"].weight.dtype == torch.float32 and linears["lm_head"].quant is None
    got = _logits(lm, ids, cache_dtype=torch.float32)
    deq = load_model(str(deq_dir), dtype="float32", device="cpu", backends=_backends()).model
    want = _logits(deq, ids, cache_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _accurate(got, ref, MAX_MEAN_LOGIT_ERROR, MAX_LOGIT_ERROR)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-nemotron-h", "tiny-qwen3-next"])
def test_fp8_checkpoints_of_hybrid_and_moe_models(tmp_path, preset) -> None:
    """MLA, Mamba2, gated delta-rule and MoE models: projections kept in FP8, stacked
    experts (and whatever else is no projection) dequantised as they load."""
    lm = load_model(preset, dtype="float32", device="cpu", backends=_backends()).model
    state = _float_state(lm)
    fp8_dir, deq_dir = _fp8_checkpoints(tmp_path, state, "hf-block", preset)
    ids = torch.randint(0, lm.vocab_size, (PROMPT + DECODE,), generator=torch.Generator())
    fp8 = load_model(str(fp8_dir), dtype="float32", device="cpu", backends=_backends()).model
    kept = [n for n, m in fp8.named_modules() if isinstance(m, Linear) and m.quant is not None]
    assert kept
    deq = load_model(str(deq_dir), dtype="float32", device="cpu", backends=_backends()).model
    got = _logits(fp8, ids, cache_dtype=torch.float32)
    want = _logits(deq, ids, cache_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-nemotron-h", "tiny-qwen3-next"])
def test_quantize_on_load_of_hybrid_and_moe_presets(preset) -> None:
    ids = torch.randint(0, 256, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(6))
    ref = _logits(
        load_model(preset, dtype="float32", device="cpu", backends=_backends()).model,
        ids,
        cache_dtype=torch.float32,
    )
    lm = load_model(
        preset, dtype="float32", device="cpu", backends=_backends(), quantization="fp8"
    ).model
    for name, m in lm.named_modules():
        if isinstance(m, Linear):
            full = name.rpartition(".")[2] in ("lm_head", "kv_b_proj", "shared_expert_gate")
            assert (m.weight.dtype == torch.float32) == full, name
    got = _logits(lm, ids, cache_dtype=torch.float32)
    _accurate(got, ref, MAX_MEAN_LOGIT_ERROR, MAX_LOGIT_ERROR, HYBRID_MIN_AGREEMENT)


def test_static_input_scales_load_as_the_largest_of_merged_parts(base) -> None:
    tmp, state, _, _ = base
    fp8_dir, _ = _fp8_checkpoints(tmp, state, "ct-channel-static")
    from safetensors.torch import load_file

    ckpt = load_file(str(fp8_dir / "model.safetensors"))
    lm = load_model(str(fp8_dir), dtype="float32", device="cpu", backends=_backends()).model
    pre = "model.layers.1.self_attn."
    want = max(ckpt[f"{pre}{p}_proj.input_scale"].item() for p in "qkv")
    qkv = lm.get_submodule(f"{pre}qkv_proj")
    assert qkv.quant.static and qkv.input_scale.item() == pytest.approx(want)
    o = lm.get_submodule(f"{pre}o_proj")
    assert o.input_scale.item() == pytest.approx(ckpt[f"{pre}o_proj.input_scale"].item())


def test_fp8_weight_without_its_scale_is_an_error(base) -> None:
    tmp, state, _, _ = base
    fp8_dir, _ = _fp8_checkpoints(tmp, state, "hf-block")
    from safetensors.torch import load_file

    ckpt = load_file(str(fp8_dir / "model.safetensors"))
    # the merged q/k/v keeps full precision when one part has no scale, so the
    # part's FP8 weight would be dequantised: without a scale that cannot be done
    del ckpt["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    save_file(ckpt, str(fp8_dir / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="k_proj.weight.*no weight_scale_inv"):
        load_model(str(fp8_dir), dtype="float32", device="cpu", backends=_backends())


def test_quantize_on_load_rounds_each_row_to_fp8(base) -> None:
    tmp, state, ids, ref = base
    float_dir = _write(tmp / "float", state)
    lm = load_model(
        str(float_dir), dtype="float32", device="cpu", backends=_backends(), quantization="fp8"
    ).model
    deq = dict(state)
    for name in _projection_weights(state):
        w = state[name]
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        deq[name] = (w / scale).to(FP8_DTYPE).float() * scale
    qkv = lm.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.out_features, 1)
    assert lm.get_submodule("lm_head").weight.dtype == torch.float32
    got = _logits(lm, ids, cache_dtype=torch.float32)
    want_dir = _write(tmp / "float-rounded", deq)
    want = _logits(
        load_model(str(want_dir), dtype="float32", device="cpu", backends=_backends()).model,
        ids,
        cache_dtype=torch.float32,
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    _accurate(got, ref, MAX_MEAN_LOGIT_ERROR, MAX_LOGIT_ERROR)


def test_quantize_on_load_of_a_preset() -> None:
    lm = load_model(PRESET, dtype="float32", device="cpu", backends=_backends(), quantization="fp8")
    linears = [m for n, m in lm.model.named_modules() if isinstance(m, Linear) and n != "lm_head"]
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 4.0)])
def test_fp8_kv_cache_against_the_float_cache(base, scales) -> None:
    _, _, ids, ref = base
    lm = load_model(PRESET, dtype="float32", device="cpu", backends=_backends()).model
    layers = len(lm.config["num_hidden_layers"] * [0])
    assert use_fp8_kv_cache(lm, dict.fromkeys(range(layers), scales)) == layers
    specs = lm.cache_specs(num_pages=3, page_size=PAGE_SIZE, num_slots=2, dtype=torch.float32)
    assert {s.dtype for layer in specs.values() for s in layer.values()} == {FP8_DTYPE}
    got = _logits(lm, ids, cache_dtype=torch.float32)
    _accurate(got, ref, KV_MAX_MEAN_LOGIT_ERROR, KV_MAX_LOGIT_ERROR)
    # the cache holds the keys divided by k_scale: its largest entry tracks the scale
    kv = lm.get_submodule("model.layers.0.self_attn").cache("kv_cache")
    k_max, v_max = kv[:, 0].float().abs().max().item(), kv[:, 1].float().abs().max().item()
    plain = load_model(PRESET, dtype="float32", device="cpu", backends=_backends()).model
    _logits(plain, ids, cache_dtype=torch.float32)
    kv_ref = plain.get_submodule("model.layers.0.self_attn").cache("kv_cache")
    assert k_max == pytest.approx(kv_ref[:, 0].abs().max().item() / scales[0], rel=2**-4)
    assert v_max == pytest.approx(kv_ref[:, 1].abs().max().item() / scales[1], rel=2**-4)


def test_fp8_kv_cache_is_refused_by_a_backend_without_it() -> None:
    class NoFp8(AttentionBackend):
        name = "plain"

        def forward(self, *args, **kwargs):
            raise AssertionError("not called")

    lm = load_model(PRESET, dtype="float32", device="cpu", backends={"attention": NoFp8()}).model
    with pytest.raises(ConfigError, match="'plain' attention backend.*torch attention backend"):
        use_fp8_kv_cache(lm)


@pytest.mark.parametrize(
    ("quant", "words"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "format 'pack-quantized'",
        ),
    ],
)
def test_other_quantisation_methods_are_refused_in_one_line(base, quant, words) -> None:
    tmp, state, _, _ = base
    path = _write(tmp / f"refused-{quant['quant_method']}-{len(words)}", state, quant)
    with pytest.raises(ConfigError) as info:
        load_model(str(path), device="cpu", backends=_backends())
    message = str(info.value)
    assert words in message and "fp8" in message and "\n" not in message
    assert str(path / "config.json") in message


def test_engine_options_for_fp8() -> None:
    cfg = EngineConfig(quantization="FP8", kv_cache_dtype="fp8")
    assert cfg.quantization == "fp8" and cfg.kv_cache_dtype == "fp8"
    assert EngineConfig().quantization is None and EngineConfig().kv_cache_dtype == "auto"
    for method in ("awq", "gptq", "bitsandbytes"):
        with pytest.raises(ConfigError, match=f"quantization.*{method}.*not supported.*fp8"):
            EngineConfig(quantization=method)
    with pytest.raises(ConfigError, match="kv_cache_dtype.*auto, fp8"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="quantization='gptq' is not supported"):
        load_model(PRESET, device="cpu", backends=_backends(), quantization="gptq")


def test_engine_runs_fp8_weights_and_an_fp8_kv_cache() -> None:
    from backplane import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = "an fp8 engine"
    plain = LLM(PRESET, device="cpu", backends={"attention": "torch"}, num_kv_pages=16)
    want = plain.generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(
        PRESET,
        device="cpu",
        backends={"attention": "torch"},
        num_kv_pages=16,
        quantization="fp8",
        kv_cache_dtype="fp8",
    )
    engine = llm.engine
    caches = [t for layer in engine.caches.values() for t in layer.values()]
    assert caches and all(t.dtype == FP8_DTYPE for t in caches)
    assert engine.model.get_submodule("model.layers.0.mlp.down_proj").weight.dtype == FP8_DTYPE
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(got) == len(want) and got[:4] == want[:4]


def _greedy_with_logprobs(llm, prompt: list[int]) -> tuple[list[int], list[dict]]:
    from backplane import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), list(out.logprobs)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-nemotron-h", "tiny-deepseek-v3"])
def test_two_ranks_quantise_their_shards_on_load(preset) -> None:
    """TP=2 with ``quantization="fp8"`` against one rank quantising the whole model: the same
    greedy tokens (up to a near-tie of the one rank) and log-probabilities within 0.02 (a
    row-parallel shard's rows are scaled over its own columns, so the rounding differs)."""
    from backplane import LLM
    from backplane.models.parallel import ColumnParallelLinear, RowParallelLinear

    prompt = [5, 17, 99, 3, 42, 7]
    torch_ops = dict.fromkeys(("attention", "ssm", "mla", "delta"), "torch")
    common = dict(device="cpu", backends=torch_ops, num_kv_pages=32, threads=1)
    one = LLM(preset, quantization="fp8", **common)
    try:
        want, want_lp = _greedy_with_logprobs(one, prompt)
    finally:
        one.shutdown()
    llm = LLM(preset, tensor_parallel_size=2, quantization="fp8", **common)
    try:
        split = {
            name: m
            for name, m in llm.engine.model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        }
        assert any(isinstance(m, RowParallelLinear) for m in split.values())
        full = [n for n, m in split.items() if m.weight.dtype != FP8_DTYPE]
        # as on one rank: these stay in full precision
        assert all(n.rpartition(".")[2] in ("kv_b_proj", "shared_expert_gate") for n in full), full
        got, got_lp = _greedy_with_logprobs(llm, prompt)
    finally:
        llm.shutdown()
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            top = sorted(p.logprob for p in want_lp[step].values())[-2:]
            assert top[1] - top[0] < 0.02, f"step {step}: {g} != {w}, not a near-tie"
            break
        diff = abs(got_lp[step][g].logprob - want_lp[step][w].logprob)
        assert diff < 0.02, f"step {step}: log-probabilities {diff:.3f} apart"


def test_fp8_options_from_the_command_line_and_yaml(tmp_path) -> None:
    import argparse

    from backplane.cli.options import add_engine_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(ConfigError, match="--quantization.*'awq' is not supported"):
        config_from_args(parser.parse_args(["--quantization", "awq"]))
    path = tmp_path / "engine.yaml"
    path.write_text("quantization: fp8\nkv_cache_dtype: fp8\n")
    cfg = EngineConfig.from_yaml(path)
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("fp8", "fp8")


def test_fp8_kv_cache_takes_the_checkpoints_per_layer_scales(base) -> None:
    tmp, state, ids, ref = base
    fp8_dir, _ = _fp8_checkpoints(tmp, state, "ct-channel")
    from safetensors.torch import load_file

    ckpt = load_file(str(fp8_dir / "model.safetensors"))
    scales = {0: (0.5, 2.0), 2: (0.25, 0.125)}
    for layer, (k, v) in scales.items():
        ckpt[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        ckpt[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(ckpt, str(fp8_dir / "model.safetensors"))
    lm = load_model(str(fp8_dir), dtype="float32", device="cpu", backends=_backends()).model
    use_fp8_kv_cache(lm, {1: (3.0, 4.0)})
    for layer in range(4):
        spec = lm.get_submodule(f"model.layers.{layer}.self_attn").spec
        want = {**scales, 1: (3.0, 4.0)}.get(layer, (1.0, 1.0))
        assert (spec.k_scale, spec.v_scale) == want, layer
    got = _logits(lm, ids, cache_dtype=torch.float32)
    _accurate(got, ref, MAX_MEAN_LOGIT_ERROR, MAX_LOGIT_ERROR)

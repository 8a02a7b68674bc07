"""Whole-model parity with Hugging Face transformers.

For each supported architecture a tiny, randomly initialised transformers
model is saved with ``save_pretrained`` and loaded by backplane in float32.
Then:

(a) one ragged prefill batch of several sequences of different lengths gives
    the same logits, at every position, as transformers run per sequence;
(b) continuing with backplane's caches -- a chunked-prefill continuation
    mixed with decodes, then several all-decode steps -- gives at each new
    token the logits transformers computes over the whole sequence.

Pages and state slots are handed out shuffled, never page 0 / slot 0. Every
test runs for each registered backend of the families the model uses (the
others on ``torch``); unavailable backends are skipped with their reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")


import hf_tiny  # noqa: E402
from hf_tiny import VOCAB, hf_torch_path  # noqa: E402

from backplane.core.families import (  # noqa: E402
    AttentionLayerSpec,
    DeltaLayerSpec,
    MLALayerSpec,
    SSMLayerSpec,
)
from backplane.core.forward_context import forward_context, plan_step  # noqa: E402
from backplane.core.packing import build_batch_metadata  # noqa: E402
from backplane.core.registry import get_registry  # noqa: E402
from backplane.models import load_model  # noqa: E402
from backplane.testing.plugin import backend_params, load_backend  # noqa: E402

PAGE_SIZE = 4

#: architecture -> (HF class name, config factory, families used, HF modeling module)
ARCHS: dict[str, tuple[str, Any, tuple[str, ...], str]] = {
    "llama": ("LlamaForCausalLM", hf_tiny.llama, ("attention",), "llama"),
    "qwen3": ("Qwen3ForCausalLM", hf_tiny.qwen3, ("attention",), "qwen3"),
    "nemotron_h": ("NemotronHForCausalLM", hf_tiny.nemotron_h, ("attention", "ssm"), "nemotron_h"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", hf_tiny.deepseek_v3, ("mla",), "deepseek_v3"),
    "deepseek_v3_q_proj": (
        "DeepseekV3ForCausalLM",
        hf_tiny.deepseek_v3_q_proj,
        ("mla",),
        "deepseek_v3",
    ),
    "deepseek_v3_q_proj_bias": (
        "DeepseekV3ForCausalLM",
        hf_tiny.deepseek_v3_q_proj_bias,
        ("mla",),
        "deepseek_v3",
    ),
    "qwen3_5": ("Qwen3_5ForCausalLM", hf_tiny.qwen3_5, ("attention", "ssm", "delta"), "qwen3_5"),
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        hf_tiny.qwen3_next,
        ("attention", "ssm", "delta"),
        "qwen3_next",
    ),
}

# -- backends ------------------------------------------------------------------------


def _backend_choices() -> list[Any]:
    """One parameter per (architecture, backend combination).

    Built from the kit's :func:`backend_params`: for each family the model
    uses, each registered backend of that family is swapped in with the other
    families on ``torch`` (the all-``torch`` combination once). The param
    keeps the kit's marks: the backend marker ``--backplane-backend`` filters
    on and the skip of an unavailable backend.
    """
    params = []
    for arch, (_, _, families, _) in ARCHS.items():
        all_torch_done = False
        for fam in families:
            for p in backend_params(fam):
                spec = p.values[0]
                if spec is None:  # no backend of this family registered: keep the skip
                    params.append(pytest.param(arch, None, marks=p.marks, id=f"{arch}-{p.id}"))
                    continue
                if spec.name == "torch":
                    if all_torch_done:
                        continue
                    all_torch_done = True
                combo = {f: "torch" for f in families}
                combo[fam] = spec.name
                cid = arch + "-" + ",".join(f"{f}={n}" for f, n in combo.items())
                params.append(pytest.param(arch, combo, marks=p.marks, id=cid))
    return params


def resolve_backends(combo: dict[str, str]) -> dict[str, Any]:
    """Instantiate the selected backend of each family (loaded once per session)."""
    registry = get_registry()
    return {fam: load_backend(registry.get(fam, name)) for fam, name in combo.items()}


def _device_dtype(combo: dict[str, str]) -> tuple[torch.device, torch.dtype]:
    """CPU/float32 unless a chosen backend lacks them (then CUDA / bfloat16)."""
    registry = get_registry()
    caps = [registry.get(fam, name).capabilities for fam, name in combo.items()]
    device = torch.device("cpu")
    if any(c and "cpu" not in c for c in caps):
        if not torch.cuda.is_available():
            pytest.skip(f"{combo} needs CUDA")
        device = torch.device("cuda")
    dtype = torch.float32
    if any(c and "float32" not in c for c in caps):
        dtype = torch.bfloat16
    return device, dtype


# -- the HF side -----------------------------------------------------------------------


def _perturb_(model: torch.nn.Module, gen: torch.Generator) -> None:
    # HF initialises norms to identity, biases to zero and the router
    # correction bias to zero; random values make those paths observable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias", "D")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.05)


#: Wider head dimensions for backends whose kernels only take production shapes
#: (e.g. FlashInfer: attention head_dim 64/128/256, MLA 512 + 64, delta 128).
WIDE: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 64},
    "qwen3": {"head_dim": 64},
    "nemotron_h": {"head_dim": 64, "mamba_head_dim": 64, "ssm_state_size": 32},
    "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64},
    "deepseek_v3_q_proj": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64},
    "deepseek_v3_q_proj_bias": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64},
    "qwen3_5": {"head_dim": 64, "linear_key_head_dim": 128, "linear_value_head_dim": 128},
    "qwen3_next": {"head_dim": 64, "linear_key_head_dim": 128, "linear_value_head_dim": 128},
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[tuple[str, str], tuple[Any, str]]:
    """``{(arch, profile): (transformers model, saved directory)}``, built lazily.

    ``profile`` is ``"tiny"`` or ``"wide"`` (:data:`WIDE` applied).
    """

    class _Lazy(dict):
        def __missing__(self, key: tuple[str, str]) -> tuple[Any, str]:
            arch, profile = key
            cls_name, make_cfg, _, _ = ARCHS[arch]
            torch.manual_seed(1234)
            cfg = make_cfg()
            cfg.initializer_range = 0.15
            if profile == "wide":
                for k, v in WIDE[arch].items():
                    setattr(cfg, k, v)
            model = getattr(transformers, cls_name)(cfg).eval()
            _perturb_(model, torch.Generator().manual_seed(99))
            path = tmp_path_factory.mktemp(f"{arch}-{profile}")
            model.save_pretrained(path)
            self[key] = (model, str(path))
            return self[key]

    return _Lazy()


def hf_logits(arch: str, model: Any, tokens: list[int]) -> torch.Tensor:
    """Full-sequence transformers logits ``[len, vocab]`` (float64 comparison copy)."""
    with hf_torch_path(ARCHS[arch][3]), torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=False)
    return out.logits[0].double()


# -- the backplane side -----------------------------------------------------------------


class Engine:
    """Minimal stepping harness: page/slot bookkeeping and one forward per step."""

    def __init__(
        self, lm: Any, backends: dict[str, Any], num_seqs: int, max_len: int, device, seed: int
    ):
        self.lm, self.backends, self.device = lm, backends, device
        rng = np.random.default_rng(seed)
        pages_per_seq = -(-max_len // PAGE_SIZE)
        num_pages = num_seqs * pages_per_seq + 3
        pool = rng.permutation(np.arange(1, num_pages))  # page 0 is reserved scratch
        self.page_tables = [
            pool[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(num_seqs)
        ]
        num_slots = num_seqs + 3
        self.slots = rng.permutation(np.arange(1, num_slots))[:num_seqs]  # slot 0 reserved
        self.caches = lm.allocate_caches(
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            num_slots=num_slots,
            dtype=next(lm.parameters()).dtype,
            device=device,
        )
        self.lens = [0] * num_seqs

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step; ``new_tokens`` in batch order (prefill/extend first).

        :return: ``{seq: logits of every new token [n, vocab]}``.
        """
        seqs = list(new_tokens)
        batch = build_batch_metadata(
            [len(new_tokens[s]) for s in seqs],
            [self.lens[s] for s in seqs],
            [self.page_tables[s] for s in seqs],
            PAGE_SIZE,
            state_slots=[int(self.slots[s]) for s in seqs],
            device=self.device,
        )
        ids = torch.tensor(
            [t for s in seqs for t in new_tokens[s]], dtype=torch.int64, device=self.device
        )
        with torch.no_grad(), forward_context(batch, plan_step(self.backends, batch)):
            hidden = self.lm(ids, batch.positions)
            logits = self.lm.compute_logits(hidden[: batch.num_tokens])
        out = {}
        start = 0
        for s in seqs:
            n = len(new_tokens[s])
            out[s] = logits[start : start + n].double().cpu()
            start += n
            self.lens[s] += n
        return out


def _unsupported(lm: Any, backends: dict[str, Any], dtype: torch.dtype) -> str | None:
    """The first layer a backend declares it cannot run (backends with ``supports``)."""
    family_of = {
        AttentionLayerSpec: "attention",
        MLALayerSpec: "mla",
        SSMLayerSpec: "ssm",
        DeltaLayerSpec: "delta",
    }
    for name, mixer in lm.cached_layers():
        for attr in ("spec", "ssm_spec", "delta_spec"):
            spec = getattr(mixer, attr, None)
            fam = family_of.get(type(spec))
            supports = getattr(backends.get(fam), "supports", None)
            if supports is None:
                continue
            ok, reason = supports(spec, dtype)
            if not ok:
                return f"{fam} backend on {name}: {reason}"
    return None


def _load(arch: str, hf_models, combo: dict[str, str] | None):
    """Load the saved transformers model with the combination's backends.

    Uses the tiny shapes when every backend takes them, else the wide ones.

    :return: ``(hf model, backplane model, backends, device, saved path)``.
    """
    if combo is None:
        pytest.skip("a family this model needs has no registered backend")
    device, dtype = _device_dtype(combo)
    backends = resolve_backends(combo)
    reason = None
    for profile in ("tiny", "wide"):
        hf_model, path = hf_models[arch, profile]
        loaded = load_model(path, dtype=dtype, device=device, backends=backends, progress=False)
        reason = _unsupported(loaded.model, backends, dtype)
        if reason is None:
            assert loaded.model.families == set(ARCHS[arch][2])
            return hf_model, loaded.model, backends, device, path
    pytest.skip(f"{combo}: {reason}")


def _torch_baseline(arch: str, path: str, device: torch.device, dtype: torch.dtype):
    """The same checkpoint with every family on ``torch``, on ``device`` in ``dtype``."""
    backends = resolve_backends({f: "torch" for f in ARCHS[arch][2]})
    lm = load_model(path, dtype=dtype, device=device, backends=backends, progress=False).model
    return lm, backends


def _assert_close(
    got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype, on_cuda: bool
) -> None:
    """Every logit within tolerance of the float32 transformers reference.

    2e-4 of the logit scale on CPU; 1e-2 on CUDA, where Triton kernels may
    multiply in TF32 (10-bit mantissa).
    """
    assert dtype == torch.float32
    scale = max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    tol = 2e-4 if not on_cuda else 1e-2
    assert err <= tol * scale, f"{what}: max |diff| {err:.3e} (logit scale {scale:.3e})"


def _assert_like_baseline(
    got: torch.Tensor, base: torch.Tensor, want: torch.Tensor, what: str
) -> None:
    """bfloat16: the backend adds little error to what bfloat16 itself costs.

    ``base`` is the all-``torch`` run at the same dtype and device. At most
    15% of positions (and never fewer than two: a short sequence would
    otherwise allow one) may be off by more than twice the baseline's error at
    that position plus 5% of the scale: a near-tie between two experts can flip
    routing at this precision, and kernels that keep bfloat16 intermediates
    round differently from the torch backends. Over the other positions the
    mean error may be at most twice the baseline's (plus 0.5% of the logit
    scale); the outliers are left out of that mean, since one flipped routing
    decision moves a whole position's logits. A wrong cache read or state slot
    spoils every later position and fails the outlier count.
    """
    scale = max(want.abs().max().item(), 1.0)
    e_got, e_base = (got - want).abs(), (base - want).abs()
    off = e_got.amax(-1) > 2 * e_base.amax(-1) + 5e-2 * scale
    kept = ~off
    mean_got = e_got[kept].mean().item() if kept.any() else 0.0
    mean_base = e_base[kept].mean().item() if kept.any() else 0.0
    allowed = max(2, int(0.15 * off.numel()))
    assert mean_got <= 2 * mean_base + 5e-3 * scale and int(off.sum()) <= allowed, (
        f"{what} (bfloat16): mean |diff| {mean_got:.3e} vs torch backends {mean_base:.3e} "
        f"over the {int(kept.sum())} positions within bounds; {int(off.sum())} of "
        f"{off.numel()} positions (at {off.nonzero().flatten().tolist()}) well beyond the "
        f"torch backends' error, {allowed} allowed (logit scale {scale:.3e})"
    )


def lm_dtype(lm: Any) -> torch.dtype:
    """The model's parameter dtype."""
    return next(lm.parameters()).dtype


def _check(arch, combo_run, lm, device, path, got, refs, label) -> None:
    """Compare per-sequence logits with transformers (and, in bfloat16, the torch backends)."""
    dtype = lm_dtype(lm)
    base = None
    if dtype != torch.float32:
        base_lm, base_backends = _torch_baseline(arch, path, device, dtype)
        base = combo_run(base_lm, base_backends, device)
    for i, mine in got.items():
        want = refs[i][: mine.shape[0]]
        what = f"{arch} {label(i, mine.shape[0])}"
        if base is None:
            _assert_close(mine, want, what, dtype, device.type == "cuda")
        else:
            _assert_like_baseline(mine, base[i], want, what)


# -- the tests ------------------------------------------------------------------------------

PROMPT_LENS = [7, 3, 11, 1, 5]


def _prompts(seed: int, extra: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n + extra).tolist() for n in PROMPT_LENS[:count]]


def _run_prefill(lm, backends, device) -> dict[int, torch.Tensor]:
    """One ragged prefill step over all prompts."""
    prompts = _prompts(0, 0, len(PROMPT_LENS))
    eng = Engine(lm, backends, len(prompts), max(PROMPT_LENS), device, seed=1)
    return eng.step(dict(enumerate(prompts)))


DECODE_STEPS = 5
CUT = 4


def _run_chunked_then_decode(lm, backends, device) -> dict[int, torch.Tensor]:
    """Chunked prefill, an extend mixed with decodes, then all-decode steps."""
    full = _prompts(1, DECODE_STEPS + 1, 4)
    prompts = [f[:n] for f, n in zip(full, PROMPT_LENS[:4], strict=True)]
    eng = Engine(lm, backends, len(full), max(map(len, full)), device, seed=2)
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(full))}
    # Step 1: sequence 2 prefills only the first part of its prompt (chunked prefill).
    first = {i: (p[:CUT] if i == 2 else p) for i, p in enumerate(prompts)}
    for i, lg in eng.step(first).items():
        got[i].append(lg)
    # Step 2: sequence 2 continues its prompt (extend) while the others decode one token.
    step2 = {2: prompts[2][CUT:]}
    step2.update({i: [full[i][len(prompts[i])]] for i in range(len(full)) if i != 2})
    for i, lg in eng.step(step2).items():
        got[i].append(lg)
    # Then all sequences decode together, token by token.
    for _ in range(DECODE_STEPS):
        step = {i: [full[i][eng.lens[i]]] for i in range(len(full))}
        for i, lg in eng.step(step).items():
            got[i].append(lg)
    return {i: torch.cat(v) for i, v in got.items()}


@pytest.mark.parametrize(("arch", "combo"), _backend_choices())
def test_prefill_ragged_batch_matches_transformers(arch, combo, hf_models):
    hf_model, lm, backends, device, path = _load(arch, hf_models, combo)
    got = _run_prefill(lm, backends, device)
    refs = [hf_logits(arch, hf_model, p) for p in _prompts(0, 0, len(PROMPT_LENS))]
    _check(
        arch, _run_prefill, lm, device, path, got, refs, lambda i, n: f"prefill seq {i} (len {n})"
    )


@pytest.mark.parametrize(("arch", "combo"), _backend_choices())
def test_chunked_prefill_then_decode_matches_transformers(arch, combo, hf_models):
    hf_model, lm, backends, device, path = _load(arch, hf_models, combo)
    got = _run_chunked_then_decode(lm, backends, device)
    refs = [hf_logits(arch, hf_model, f) for f in _prompts(1, DECODE_STEPS + 1, 4)]
    _check(
        arch,
        _run_chunked_then_decode,
        lm,
        device,
        path,
        got,
        refs,
        lambda i, n: f"seq {i}: chunked prefill + decode, {n} positions",
    )


def test_qwen3_5_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` checkpoint runs text like transformers does."""
    torch.manual_seed(5)
    text = hf_tiny.qwen3_5().to_dict()
    text["initializer_range"] = 0.15
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 2,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    _perturb_(hf, torch.Generator().manual_seed(7))
    hf.save_pretrained(tmp_path)
    combo = {"attention": "torch", "ssm": "torch", "delta": "torch"}
    backends = resolve_backends(combo)
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", backends=backends).model
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (6, 2, 9)]
    eng = Engine(lm, backends, len(prompts), 9, torch.device("cpu"), seed=4)
    got = eng.step(dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        with hf_torch_path("qwen3_5"), torch.no_grad():
            want = hf(input_ids=torch.tensor([p]), use_cache=False).logits[0].double()
        _assert_close(got[i], want, f"qwen3_5 multimodal checkpoint, seq {i}", torch.float32, False)

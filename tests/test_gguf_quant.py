"""GGUF projections kept quantised: QuantizedLinear against gguf's reference dequantisation,
and the loader keeping Q8_0 / Q4_K / Q5_K / Q6_K projections as blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_helpers import write_gguf  # noqa: E402
from gguf_quant_helpers import QT, quantize, random_blocks, requantize  # noqa: E402
from test_gguf_loader import tiny_llama  # noqa: E402

from backplane.backends.torch.attention import TorchAttentionBackend  # noqa: E402
from backplane.core.forward_context import forward_context, plan_step  # noqa: E402
from backplane.core.packing import build_batch_metadata  # noqa: E402
from backplane.models import load_model  # noqa: E402
from backplane.models.gguf import GGUFCheckpoint  # noqa: E402
from backplane.models.gguf.qlinear import QuantizedLinear  # noqa: E402

KEPT = [QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def _backends() -> dict[str, TorchAttentionBackend]:
    return {"attention": TorchAttentionBackend()}


def _reference(blocks: np.ndarray, qtype: QT) -> torch.Tensor:
    """gguf's reference dequantisation of ``[rows, row bytes]`` blocks, float32."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


def _module(parts, blocks: list[np.ndarray], in_features: int, bias: torch.Tensor | None = None):
    """A QuantizedLinear of ``parts`` with each part's blocks copied in as the loader does."""
    m = QuantizedLinear(in_features, parts, bias=bias is not None)
    targets = dict(m.checkpoint_slices())
    with torch.no_grad():
        for (name, _, _), b in zip(parts, blocks, strict=True):
            targets[f"{name}.weight"].copy_(torch.from_numpy(b))
        if bias is not None:
            m.bias.copy_(bias)
    return m


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 summation bound for ``x @ w.T``: a few units in the last place of ``|x| @ |w|.T``."""
    return 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_blocks_dequantise_as_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 24, 512, rng)
    m = _module([("proj", 24, int(qtype))], [blocks], 512)
    assert torch.equal(m.dequantized(torch.float32), _reference(blocks, qtype))
    # the float matrix exists nowhere: the module holds the bytes of the blocks only
    held = sum(p.numel() * p.element_size() for p in m.parameters())
    assert held == blocks.nbytes


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_forward_equals_the_reference_product(qtype, rows):
    rng = np.random.default_rng(7 + int(qtype))
    blocks = random_blocks(qtype, 40, 768, rng)
    bias = torch.randn(40)
    m = _module([("proj", 40, int(qtype))], [blocks], 768, bias)
    x = torch.randn(rows, 768)
    w = _reference(blocks, qtype)
    want = x.double() @ w.double().T + bias.double()
    with torch.no_grad():
        got = m(x)
    assert got.shape == (rows, 40) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= _bound(x, w)).all()


def test_merged_parts_of_mixed_types_keep_their_own_runs():
    """q/k of Q4_K share one tensor of rows; v of Q6_K (as Q4_K_M files store it) has its own."""
    rng = np.random.default_rng(3)
    parts = [("q_proj", 64, 12), ("k_proj", 32, 12), ("v_proj", 32, 14)]
    blocks = [
        random_blocks(QT.Q4_K, 64, 256, rng),
        random_blocks(QT.Q4_K, 32, 256, rng),
        random_blocks(QT.Q6_K, 32, 256, rng),
    ]
    bias = torch.randn(128)
    m = _module(parts, blocks, 256, bias)
    assert [(first, rows) for first, rows, _ in m.runs] == [(0, 96), (96, 32)]
    w = torch.cat(
        [
            _reference(blocks[0], QT.Q4_K),
            _reference(blocks[1], QT.Q4_K),
            _reference(blocks[2], QT.Q6_K),
        ]
    )
    x = torch.randn(3, 256)
    with torch.no_grad():
        q, k, v = m.split(m(x))
    want = x.double() @ w.double().T + bias.double()
    got = torch.cat([q, k, v], dim=-1).double()
    assert ((got - want).abs() <= _bound(x, w)).all()


def test_repacked_q4k_and_q6k_runs_keep_one_copy_and_their_values(monkeypatch):
    """With the Triton ops (here: the interpreter's say-so), the Q4_K and Q6_K runs are
    repacked once and their raw blocks dropped; the Q5_K run stays; values and products do
    not change."""
    import backplane.kernels

    rng = np.random.default_rng(4)
    types = (QT.Q4_K, QT.Q4_K, QT.Q6_K, QT.Q5_K)
    parts = [("gate_proj", 48, 12), ("up_proj", 16, 12), ("down_proj", 32, 14), ("o", 8, 13)]
    blocks = [
        random_blocks(QT.Q4_K, 48, 512, rng),
        random_blocks(QT.Q4_K, 16, 512, rng),
        random_blocks(QT.Q6_K, 32, 512, rng),
        random_blocks(QT.Q5_K, 8, 512, rng),
    ]
    w = torch.cat([_reference(b, t) for b, t in zip(blocks, types, strict=True)])
    bias = torch.randn(104)
    m = _module(parts, blocks, 512, bias)
    m.fused_ops = "triton"
    assert m.prepare_fused_ops() == 0, "CPU tensors outside the interpreter stay raw"
    monkeypatch.setattr(backplane.kernels, "interpreting", lambda: True)
    assert m.prepare_fused_ops() == 2 and m.packed_runs == {0, 1}
    assert m.prepare_fused_ops() == 0, "repacked twice"
    assert m.qweight_0.numel() == 0 and m.weight.dtype == torch.int32
    assert m.qweight_1.numel() == 0 and m.q6k_ql_1.shape == (32, 64)
    assert m.qweight_2.shape == blocks[3].shape, "Q5_K stays raw"
    held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    # Q4_K repacked at 4.625 bits a weight; Q6_K at its own 6.5625
    assert held == 64 * 512 * 37 // 64 + blocks[2].nbytes + blocks[3].nbytes + bias.numel() * 4
    kinds = [type(b).__name__ if isinstance(b, tuple) else "raw" for b, _ in m.blocks()]
    assert kinds == ["PackedQ4K", "PackedQ6K", "raw"]
    assert torch.equal(m.dequantized(torch.float32), w)
    m.fused_ops = "torch"
    x = torch.randn(3, 512)
    with torch.no_grad():
        got = m(x).double()
    want = x.double() @ w.double().T + bias.double()
    assert ((got - want).abs() <= _bound(x, w)).all()
    with pytest.raises(RuntimeError, match="load the checkpoint before"):
        dict(m.checkpoint_slices())


def test_a_traced_product_keeps_the_raw_blocks(monkeypatch):
    """A product traced (or captured) before the repacking pins the raw blocks: the graph
    would read them."""
    import backplane.kernels

    rng = np.random.default_rng(6)
    m = _module([("proj", 16, 12)], [random_blocks(QT.Q4_K, 16, 256, rng)], 256)
    m.fused_ops = "triton"
    monkeypatch.setattr(backplane.kernels, "interpreting", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        m(torch.randn(2, 256))  # the torch path: nothing runs in the interpreter
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert m.prepare_fused_ops() == 0 and not m.packed_runs and m.qweight_0.numel() > 0


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match=r"Q4_K rows of 576 values cannot stay quantised"):
        QuantizedLinear(576, [("proj", 8, 12)])


# -- the loader --------------------------------------------------------------------------------

#: a tiny Llama whose widths are whole k-quant super-blocks
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)

#: the types of a Q4_K_M-like file: v and down in other k-quants, the head in Q8_0
TYPES = {
    "attn_q": QT.Q4_K,
    "attn_k": QT.Q4_K,
    "attn_v": QT.Q6_K,
    "attn_output": QT.Q4_K,
    "ffn_gate": QT.Q4_K,
    "ffn_up": QT.Q4_K,
    "ffn_down": QT.Q5_K,
    "output": QT.Q8_0,
}


def _type_of(name: str, shape: tuple[int, ...]) -> QT | None:
    return TYPES.get(name.split(".")[-2])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The float32 file of a tiny Llama, its Q8_0 copy and its k-quant copy."""
    model = tiny_llama(5, **WIDE)
    tmp = tmp_path_factory.mktemp("kquant")
    f32 = write_gguf(model, tmp / "f32.gguf", "llama")
    return {
        "f32": f32,
        "q8_0": requantize(f32, tmp / "q8.gguf", lambda name, shape: QT.Q8_0),
        "kquant": requantize(f32, tmp / "kq.gguf", _type_of),
    }


def _load(path, monkeypatch=None):
    if monkeypatch is not None:  # the loader of before: every tensor dequantised at load
        monkeypatch.setattr(GGUFCheckpoint, "keep_quantized", lambda self, lm: 0)
    return load_model(path, dtype=torch.float32, device="cpu", backends=_backends(), progress=False)


def prefill_logits(lm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids``, prefilled in one step."""
    page = 16
    pages = -(-len(ids) // page)
    lm.allocate_caches(
        num_pages=pages + 1, page_size=page, num_slots=2, dtype=torch.float32, device="cpu"
    )
    batch = build_batch_metadata(
        [len(ids)], [0], [list(range(1, pages + 1))], page, state_slots=[1], device="cpu"
    )
    used = {f: b for f, b in _backends().items() if f in lm.families}
    with torch.no_grad(), forward_context(batch, plan_step(used, batch)):
        hidden = lm(torch.tensor(ids), batch.positions)
        return lm.compute_logits(hidden).float()


def test_loader_keeps_every_kquant_projection_as_blocks(files):
    kq = files["kquant"]
    lm = _load(kq).model
    reader = gguf.GGUFReader(str(kq))
    quantised = {t.name: t for t in reader.tensors if t.tensor_type != QT.F32}
    modules = [m for m in lm.modules() if isinstance(m, QuantizedLinear)]
    # qkv and gate/up merged, o and down, per layer, and the LM head
    assert len(modules) == 4 * lm.config["num_hidden_layers"] + 1
    held = sum(p.numel() for m in modules for p in m.parameters() if p.dtype == torch.uint8)
    assert held == sum(int(t.n_bytes) for t in quantised.values())
    attn = lm.model.layers[0].self_attn.qkv_proj
    assert [GGML for _, _, GGML in attn.runs] == [int(QT.Q4_K), int(QT.Q6_K)]


def test_setting_the_triton_ops_repacks_the_q4k_and_q6k_projections(files, monkeypatch):
    """``set_fused_ops("triton")`` repacks every Q4_K and Q6_K run (through
    ``prepare_fused_ops``) and the model computes the same logits, bit for bit, from the
    repacked weights."""
    import backplane.kernels
    import backplane.models.base

    ids = [5, 17, 33, 2, 8, 60]
    lm = _load(files["kquant"]).model
    before = prefill_logits(lm, ids)
    # "triton" on CPU tensors: the interpreter's say-so, without running a kernel here
    monkeypatch.setattr(backplane.models.base, "check_fused_ops", lambda impl, device: None)
    monkeypatch.setattr(backplane.kernels, "interpreting", lambda: True)
    lm.set_fused_ops("triton")
    modules = [m for m in lm.modules() if isinstance(m, QuantizedLinear)]
    repacked = (int(QT.Q4_K), int(QT.Q6_K))
    for m in modules:
        want = {i for i, (_, _, t) in enumerate(m.runs) if t in repacked}
        assert m.packed_runs == want, (m, m.packed_runs)
    assert any(int(QT.Q6_K) in [t for _, _, t in m.runs] for m in modules)
    assert any(not m.packed_runs for m in modules), "the Q5_K and Q8_0 runs stay raw"
    lm.set_fused_ops("torch")
    assert torch.equal(prefill_logits(lm, ids), before)


def test_kept_blocks_compute_what_dequantising_at_load_computes(files, monkeypatch):
    """Same file, same arithmetic: the logits agree to float32 rounding, greedy tokens exactly."""
    kq = files["kquant"]
    ids = [5, 17, 33, 2, 8, 60, 61, 62, 9, 11, 40]
    kept = prefill_logits(_load(kq).model, ids)
    ref = prefill_logits(_load(kq, monkeypatch).model, ids)
    scale = ref.abs().max()
    assert (kept - ref).abs().max() <= 1e-5 * scale
    assert torch.equal(kept.argmax(-1), ref.argmax(-1))


#: logits of the quantised files against the float32 model of random weights: the
#: relative RMS error of the (mean-centred) logits and the share of positions
#: whose greedy token agrees; measured 0.014 / 0.93 (Q8_0), 0.11 / 0.86 (k-quants).
#: Random weights amplify errors more than trained ones (see test_gguf_quant_smollm2.py).
TOLERANCES = {"q8_0": (0.03, 0.8), "kquant": (0.2, 0.75)}


def logit_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(relative RMS error, greedy agreement)`` of logits ``[positions, vocab]``."""
    centred = ref - ref.mean(-1, keepdim=True)
    err = ((got - ref).norm() / centred.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return err, agree


@pytest.mark.parametrize("kind", sorted(TOLERANCES))
def test_quantised_logits_stay_near_the_float_model(files, kind):
    ids = list(range(3, 90, 3))
    ref = prefill_logits(_load(files["f32"]).model, ids)
    got = prefill_logits(_load(files[kind]).model, ids)
    err, agree = logit_error(got, ref)
    max_err, min_agree = TOLERANCES[kind]
    assert err <= max_err, err
    assert agree >= min_agree, agree


def test_quantised_blocks_match_the_encoder():
    """The test encoders round-trip through gguf's reference within each type's step."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 512)).astype(np.float32)
    for qtype, rel in ((QT.Q8_0, 0.01), (QT.Q4_K, 0.12), (QT.Q5_K, 0.06), (QT.Q6_K, 0.04)):
        back = gguf.quants.dequantize(quantize(w, qtype), qtype)
        assert np.sqrt(((back - w) ** 2).mean()) <= rel * w.std(), qtype.name

"""The engine loop: request rejection, abort, padding through the runner seam, sizing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backplane.core.errors import OutOfKVMemoryError, RequestError
from backplane.core.hookspecs import FAMILIES
from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams
from backplane.engine.worker.runner import EagerModelRunner

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: The reference backends: which others are available here (Triton under
#: TRITON_INTERPRET=1, FlashInfer on a GPU) must not change what these tests run.
TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")
AUTO_BACKENDS = dict.fromkeys(FAMILIES, "auto")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model: str = "tiny-llama", **kw) -> Engine:
    cfg = dict(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=32,
        page_size=4,
        num_kv_pages=64,
        backends=TORCH_BACKENDS,
    )
    cfg.update(kw)
    return Engine(**cfg)


def run_all(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not engine.has_unfinished_requests()
    return tokens


def alone(prompt, params=GREEDY, model="tiny-llama") -> list[int]:
    e = make_engine(model)
    rid = e.add_request(prompt, params)
    return run_all(e)[rid]


def test_bad_requests_are_rejected_and_others_keep_running():
    e = make_engine()
    prompt = np.arange(5, 17, dtype=np.int32)
    rid = e.add_request(prompt, GREEDY, request_id="good")
    got = []
    for o in e.step():
        got.extend(o.new_token_ids)
    bad = [
        ([], GREEDY, "empty"),
        ([1, 2, 10_000], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        (list(range(100)) * 30, GREEDY, "exceeds the model length"),
        ([1, 2], "greedy", "SamplingParams"),
        ([1, 2], GREEDY, "already in use"),
    ]
    for p, sp, msg in bad:
        with pytest.raises(RequestError, match=msg):
            e.add_request(p, sp, request_id="good" if msg == "already in use" else None)
    tokens = run_all(e)
    assert got + tokens.get(rid, []) == alone(prompt)
    assert e.kv_manager.num_used_pages == 0


def test_request_larger_than_kv_cache_is_rejected():
    e = make_engine(num_kv_pages=4)  # 3 usable pages of 4 tokens
    with pytest.raises(OutOfKVMemoryError):
        e.add_request(list(range(20)), GREEDY)
    rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(run_all(e)[rid]) == 4


def test_abort_frees_pages_and_reports_once():
    e = make_engine()
    a = e.add_request(list(range(1, 30)), GREEDY)
    b = e.add_request(list(range(40, 50)), GREEDY)
    b_tokens = []
    for _ in range(2):
        b_tokens += [t for o in e.step() if o.request_id == b for t in o.new_token_ids]
    assert e.kv_manager.num_used_pages > 0
    assert e.abort_request(a)
    assert not e.abort_request("nope")
    outs = e.step()
    b_tokens += [t for o in outs if o.request_id == b for t in o.new_token_ids]
    aborted = [o for o in outs if o.request_id == a]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    rest = run_all(e)
    assert a not in rest
    assert b_tokens + rest.get(b, []) == alone(list(range(40, 50)))
    assert e.kv_manager.num_used_pages == 0
    assert not e.abort_request(a)


class PaddingRunner(EagerModelRunner):
    """Pads every step by a few tokens, as a CUDA-graph bucket would."""

    calls = 0

    def padded_num_tokens(self, num_tokens: int, num_seqs: int, is_decode_only: bool) -> int:
        return num_tokens + 3

    def run(self, inputs):
        PaddingRunner.calls += 1
        assert inputs.input_ids.shape[0] == inputs.metadata.num_tokens + 3
        return super().run(inputs)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-nemotron-h"])
def test_runner_seam_with_padding_gives_same_tokens(model):
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 2)]
    ref = make_engine(model)
    ids = [ref.add_request(p, GREEDY) for p in prompts]
    want = run_all(ref)
    e = make_engine(model)
    e.runner = PaddingRunner(e.model, e.input_batch)
    ids2 = [e.add_request(p, GREEDY) for p in prompts]
    got = run_all(e)
    assert PaddingRunner.calls > 0
    assert [got[i] for i in ids2] == [want[i] for i in ids]


def test_seeded_sampling_is_reproducible_regardless_of_batch():
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    first = alone([5, 6, 7], p)
    e = make_engine()
    others = [e.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=5)) for n in (3, 9)]
    rid = e.add_request([5, 6, 7], p)
    out = run_all(e)
    assert out[rid] == first and all(o in out for o in others)
    assert (
        alone([5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=8, ignore_eos=True))
        != first
    )


def test_kv_memory_sizing():
    e = make_engine(num_kv_pages=None, kv_memory="1MiB")
    # tiny-llama: 4 layers x [P, 2, page, 2 heads, 16] float32
    per_page = 4 * 2 * 4 * 2 * 16 * 4
    assert e.num_pages == (1 << 20) // per_page
    assert e.kv_bytes == e.num_pages * per_page
    with pytest.raises(OutOfKVMemoryError, match="kv_memory"):
        make_engine(num_kv_pages=None, kv_memory=per_page)
    r = make_engine("tiny-nemotron-h", num_kv_pages=None, kv_memory="2MiB")
    # a slot per sequence, the reserved slot 0, and (prefix caching on) a quarter as many
    # snapshot slots, at least two
    spare = max(2, r.max_num_seqs // 4)
    assert r.executor.driver.num_snapshot_slots == spare
    assert r.num_slots == r.max_num_seqs + 1 + spare and r.state_bytes > 0
    assert r.kv_bytes + r.state_bytes <= 2 << 20


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model", ["tiny-llama", "tiny-nemotron-h", "tiny-deepseek-v3", "tiny-qwen3-next"]
)
@pytest.mark.parametrize("graphs", ["off", "decode", "full_and_piecewise"])
def test_cuda_engine_matches_cpu(model, graphs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 2, 14)]
    results = []
    for device in ("cpu", "cuda"):
        e = make_engine(
            model,
            device=device,
            dtype="float32",
            cuda_graphs=graphs if device == "cuda" else "off",
            # the reference backends run float32 and every head size on both devices
            backends=TORCH_BACKENDS,
        )
        ids = [e.add_request(p, GREEDY) for p in prompts]
        out = run_all(e)
        results.append([out[i] for i in ids])
    assert results[0] == results[1]


def _picky_backend():
    """An attention backend that refuses every layer, as a kernel with shape limits does."""
    from backplane.backends.torch.attention import TorchAttentionBackend
    from backplane.core.errors import UnsupportedLayerError

    class Picky(TorchAttentionBackend):
        name = "picky"

        def cache_spec(self, layer, **kw):
            raise UnsupportedLayerError(
                f"attention backend 'picky' cannot run layer {layer.layer_id}: head_dim too small",
                family="attention",
                backend="picky",
            )

    return Picky


def _registry(*specs):
    """The torch plugin and ``specs`` only: ``auto`` chooses among exactly these."""
    import backplane.plugins.torch as torch_plugin
    from backplane.core.hookspecs import hookimpl
    from backplane.core.registry import BackendRegistry

    class Plugin:
        @hookimpl
        def backplane_attention_backends(self):
            return list(specs)

    reg = BackendRegistry(load_entry_points=False)
    assert reg.register(torch_plugin, "torch").error is None
    assert reg.register(Plugin(), "test-plugin").error is None
    return reg


def test_auto_falls_back_from_a_backend_that_cannot_run_the_model(caplog):
    """``auto`` picks the best backend; one that rejects the model's layers is replaced."""
    from backplane.core.backend_spec import BackendSpec
    from backplane.core.errors import BackendUnavailableError
    from backplane.engine.selection import select_backend

    picky = BackendSpec(family="attention", name="picky", load=_picky_backend(), priority=100)
    reg = _registry(picky)
    assert select_backend("attention", "auto", registry=reg).name == "picky"
    with caplog.at_level("WARNING"):
        e = make_engine(backends=AUTO_BACKENDS, registry=reg)
    assert type(e.backends["attention"]).__name__ == "TorchAttentionBackend"
    assert "auto falls back to 'torch'" in caplog.text
    rid = e.add_request([1, 2, 3], GREEDY)
    assert len(run_all(e)[rid]) == GREEDY.max_tokens
    # a backend named explicitly is never replaced
    with pytest.raises(BackendUnavailableError, match="picky"):
        make_engine(backends={**AUTO_BACKENDS, "attention": "picky"}, registry=reg)


def test_the_engine_selects_and_falls_back_within_the_registry_it_is_given(caplog):
    """Selection and the ``auto`` fallback both use the engine's registry, never the global one."""
    from backplane.backends.torch.attention import TorchAttentionBackend
    from backplane.core.backend_spec import BackendSpec

    class Plain(TorchAttentionBackend):
        name = "plain"

    reg = _registry(
        BackendSpec(family="attention", name="picky", load=_picky_backend(), priority=100),
        BackendSpec(family="attention", name="plain", load=Plain, priority=50),
    )
    with caplog.at_level("WARNING"):
        e = make_engine(backends=AUTO_BACKENDS, registry=reg)
    assert "auto falls back to 'plain'" in caplog.text
    assert type(e.backends["attention"]) is Plain
    assert {f: b.name for f, b in e.backends.items()} == {"attention": "plain"}
    rid = e.add_request([1, 2, 3], GREEDY)
    assert len(run_all(e)[rid]) == GREEDY.max_tokens

"""Splitting at dynamic ops, the piecewise runner's phases and buffers, and the capture hook (CPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.engine.worker.graph.capture import capture
from backplane.engine.worker.graph.context import GraphPhase
from backplane.engine.worker.graph.piecewise import DynamicOpSegment, PiecewiseGraphs, StaticSegment
from backplane.engine.worker.graph.split import split_at_dynamic_ops


def _rowmix_shape(x, w, out=None):
    return x.shape, x.dtype


@cached_op("bp_graph_test::rowmix", ("out",), _rowmix_shape)
def rowmix(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    torch.mul(x, w, out=buf)
    return finish_output(out, buf, x.shape[0])


# same name, other namespace: must NOT be treated as dynamic (identity, not substrings)
@cached_op("bp_graph_test_other::rowmix", ("out",), _rowmix_shape)
def rowmix_lookalike(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    torch.mul(x, w, out=buf)
    return finish_output(out, buf, x.shape[0])


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 8)
        self.l2 = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.l1(x) + pos[:, None]
        h = rowmix(h, self.w, None)
        h = rowmix_lookalike(torch.relu(self.l2(h)), self.w, None)
        h = rowmix(h, self.w, None)
        # a call through the op packet runs the same overload: also dynamic
        h = torch.ops.bp_graph_test.rowmix(h, self.w, None)
        return h * 2 + 1


def test_split_matches_ops_by_identity():
    gm = torch.fx.symbolic_trace(Toy())
    split, segments = split_at_dynamic_ops(gm, [rowmix])
    kinds = [s.dynamic for s in segments]
    assert kinds == [False, True, False, True, True, False]
    assert all(s.op is rowmix._opoverload for s in segments if s.dynamic)
    # the look-alike stays inside a static segment
    static_targets = [
        n.target
        for s in segments
        if not s.dynamic
        for n in getattr(split, s.name).graph.nodes
        if n.op == "call_function"
    ]
    assert rowmix_lookalike._opoverload in static_targets
    x, pos = torch.randn(5, 8), torch.arange(5.0)
    torch.testing.assert_close(split(x, pos), gm(x, pos))


@pytest.fixture
def captured():
    model = Toy()
    buckets = [1, 2, 4, 8]
    # CPU tensors: eager stand-ins, also where CUDA is available (a CUDA graph of CPU ops is empty)
    pw = PiecewiseGraphs(model.forward, [rowmix], buckets, cuda=False)
    xs, ps = torch.zeros(8, 8), torch.zeros(8)

    @contextlib.contextmanager
    def make_inputs(bucket):
        xs[:bucket].normal_()
        ps[:bucket] = torch.arange(bucket, dtype=torch.float32)
        yield (xs[:bucket], ps[:bucket])

    pw.capture(make_inputs)
    return model, pw, xs, ps


def test_piecewise_replay_equals_eager_for_every_bucket(captured):
    model, pw, xs, ps = captured
    assert pw.captured == {1, 2, 4, 8}
    assert pw.failed == {}
    for bucket in (8, 4, 2, 1):
        xs[:bucket].normal_()
        ps[:bucket] = torch.randn(bucket)
        got = pw.run(bucket, xs[:bucket], ps[:bucket]).clone()
        want = model(xs[:bucket].clone(), ps[:bucket].clone())
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert pw.ctx.phase is GraphPhase.EAGER and pw.ctx.bucket is None


def test_dynamic_segment_skips_the_dispatcher_without_autograd(monkeypatch):
    from backplane.engine.worker.graph import piecewise

    op = rowmix._opoverload
    seen = []
    real = rowmix._init_fn

    def spy(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(rowmix, "_init_fn", spy)
    call = piecewise._python_impl(op)
    x, pos = torch.randn(3, 8), torch.randn(8)
    with torch.no_grad():
        direct = call(x, pos, None)
    assert seen == [False]  # the function itself, no dispatcher in between
    dispatched = call(x, pos, None)  # with autograd on: through the registered op
    torch.testing.assert_close(direct, dispatched, rtol=0, atol=0)
    torch.testing.assert_close(direct, real(x, pos, None), rtol=0, atol=0)


def test_out_buffers_per_op_and_bucket_share_one_allocation(captured):
    _, pw, _, _ = captured
    split, _ = pw.compiler.splits[0]
    dyn = [m for m in split.children() if isinstance(m, DynamicOpSegment)]
    static = [m for m in split.children() if isinstance(m, StaticSegment)]
    assert len(dyn) == 3 and len(static) == 3
    for seg in dyn:
        sizes = {b: buf.shape[0] for b, buf in seg.buffers.items()}
        assert all(sizes[b] == b for b in sizes if b > 1)
        ptrs = {buf.data_ptr() for b, buf in seg.buffers.items()}
        # smaller buckets are row-prefix views of the largest bucket's buffer of the same op
        assert len(ptrs) == 1
    # two dynamic ops never share a buffer
    assert dyn[0].buffers[8].data_ptr() != dyn[1].buffers[8].data_ptr()


def test_capture_postprocess_hook_restores_mutated_inputs():
    x = torch.ones(4)

    def forward(x, offset):
        offset.add_(1)  # like speculative decoding advancing offsets in place
        return x * offset

    def restore(x, offset):
        offset.sub_(1)

    good_offset = torch.full((4,), 5.0)
    g = capture(forward, restore, (x, good_offset), num_warmup=2)
    assert torch.equal(good_offset, torch.full((4,), 5.0))
    assert torch.equal(g.replay(), torch.full((4,), 6.0))

    bad_offset = torch.full((4,), 5.0)
    g = capture(forward, None, (x, bad_offset), num_warmup=2)
    assert not torch.equal(g.replay(), torch.full((4,), 6.0))


def test_many_runners_in_one_process_each_trace_their_own_model():
    """More runners than dynamo's recompile limit, each over a model class of its own."""
    limit = int(getattr(torch._dynamo.config, "recompile_limit", 8))
    for i in range(limit + 2):
        cls = type(f"Toy{i}", (Toy,), {})
        model = cls()
        pw = PiecewiseGraphs(model.forward, [rowmix], [2, 4], cuda=False)
        xs, ps = torch.randn(4, 8), torch.arange(4, dtype=torch.float32)

        @contextlib.contextmanager
        def make_inputs(bucket, xs=xs, ps=ps):
            yield (xs[:bucket], ps[:bucket])

        pw.capture(make_inputs)
        assert pw.failed == {}, (i, pw.failed)
        with make_inputs(4) as args:
            torch.testing.assert_close(pw.run(4, *args), model(*args), rtol=0, atol=0)

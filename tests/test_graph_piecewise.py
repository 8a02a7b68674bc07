"""Piecewise recording: cuts at dynamic ops by identity, out buffers, escaped ops, phases (CPU),
and replays equal to eager forwards on CUDA.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from backplane.core.contract import cached_op, finish_output, intercept_cached_ops, output_buffer
from backplane.engine.worker.graph.capture import capture
from backplane.engine.worker.graph.context import GraphPhase
from backplane.engine.worker.graph.piecewise import (
    EscapeCheck,
    EscapedOpError,
    PiecewiseGraphs,
    _Recorder,
    normalize_ops,
)

#: what the dynamic op reads besides its inputs, like a step's metadata
STEP = {"scale": 1.0}


def _rowmix_shape(x, w, out=None):
    return x.shape, x.dtype


@cached_op("bp_graph_test::rowmix", ("out",), _rowmix_shape)
def rowmix(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    torch.mul(x, w * STEP["scale"], out=buf)
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
        h = rowmix(h, self.w)
        h = rowmix_lookalike(torch.relu(self.l2(h)), self.w)
        h = rowmix(h, self.w)
        # the caller's own buffer, passed positionally: the op writes there
        own = torch.empty_like(h)
        rowmix(h, self.w, own)
        return own * 2 + 1


class EscapingToy(Toy):
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.l1(x) + pos[:, None]
        # through the dispatcher: a recording cannot cut here
        return torch.ops.bp_graph_test.rowmix(h, self.w, None)


class FakeGraph:
    """Records nothing: on the CPU the recorded forward runs for real, step by step."""

    def capture_begin(self, pool=None) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


def _record(model, *args):
    recorder = _Recorder(normalize_ops([rowmix]), None, graph_type=FakeGraph)
    with torch.inference_mode(), intercept_cached_ops(recorder):
        recorder.begin()
        out = model(*args)
        recorder.end()
    return recorder.recording, out


def test_the_recording_cuts_at_each_dynamic_op_and_nowhere_else():
    model = Toy()
    x, pos = torch.randn(5, 8), torch.arange(5.0)
    rec, out = _record(model, x, pos)
    # graph, op, graph (the look-alike stays inside it), op, graph (empty), op, graph
    kinds = ["op" if isinstance(s, functools.partial) else "graph" for s in rec.steps]
    assert kinds == ["graph", "op", "graph", "op", "graph", "op", "graph"]
    assert rec.ops == 3 and len(rec.graphs) == 4
    assert all(s.func is rowmix._init_fn for s in rec.steps if isinstance(s, functools.partial))
    with torch.inference_mode():
        torch.testing.assert_close(out, model(x, pos), rtol=0, atol=0)


def test_recorded_op_steps_write_their_out_buffers_again():
    model = Toy()
    x, pos = torch.randn(5, 8), torch.arange(5.0)
    rec, _ = _record(model, x, pos)
    op_steps = [s for s in rec.steps if isinstance(s, functools.partial)]
    outs = [s.keywords.get("out", s.args[-1] if len(s.args) == 3 else None) for s in op_steps]
    assert all(isinstance(o, torch.Tensor) and o.shape == (5, 8) for o in outs)
    # the out buffers are distinct (the op's own allocations and the caller's buffer)
    assert len({o.data_ptr() for o in outs}) == 3
    want = [o.clone() for o in outs]
    with torch.inference_mode():
        for o in outs:
            o.fill_(float("nan"))
        for step in op_steps:
            step()
    for o, w in zip(outs, want, strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    # a replayed op reads the step's state at replay, not at capture
    STEP["scale"] = 3.0
    try:
        with torch.inference_mode():
            op_steps[0]()
        torch.testing.assert_close(outs[0], want[0] * 3.0)
    finally:
        STEP["scale"] = 1.0


def test_a_dynamic_op_reaching_the_dispatcher_is_caught():
    model = EscapingToy()
    ops = normalize_ops([rowmix])
    with torch.inference_mode(), pytest.raises(EscapedOpError, match="op object"):
        with EscapeCheck(ops):
            model(torch.randn(3, 8), torch.arange(3.0))
    # through the op object the same call passes the check (the interceptor takes it)
    with torch.inference_mode(), intercept_cached_ops(lambda op, a, k: op._init_fn(*a, **k)):
        with EscapeCheck(ops):
            Toy()(torch.randn(3, 8), torch.arange(3.0))


def _buffers(buckets):
    xs, ps = torch.zeros(max(buckets), 8), torch.zeros(max(buckets))

    @contextlib.contextmanager
    def make_inputs(bucket):
        xs[:bucket].normal_()
        ps[:bucket] = torch.arange(bucket, dtype=torch.float32)
        yield (xs[:bucket], ps[:bucket])

    return xs, ps, make_inputs


def test_a_bucket_whose_forward_escapes_fails_and_runs_eagerly():
    model = EscapingToy()
    pw = PiecewiseGraphs(model.forward, [rowmix], [2, 4], cuda=False, check_escapes=True)
    _, _, make_inputs = _buffers([2, 4])
    with torch.inference_mode():
        pw.capture(make_inputs)
    assert pw.captured == set()
    assert set(pw.failed) == {2, 4} and all("EscapedOpError" in e for e in pw.failed.values())


@pytest.mark.parametrize("check_escapes", [False, True])
def test_without_cuda_every_bucket_is_warmed_up_and_runs_eagerly(check_escapes):
    model = Toy()
    buckets = [1, 2, 4, 8]
    pw = PiecewiseGraphs(model.forward, [rowmix], buckets, cuda=False, check_escapes=check_escapes)
    xs, ps, make_inputs = _buffers(buckets)
    with torch.inference_mode():
        pw.capture(make_inputs)
        assert pw.captured == set(buckets) and pw.failed == {} and pw.recordings == {}
        for bucket in (8, 4, 2, 1):
            xs[:bucket].normal_()
            got = pw.run(bucket, xs[:bucket], ps[:bucket])
            torch.testing.assert_close(got, model(xs[:bucket], ps[:bucket]), rtol=0, atol=0)
    assert pw.ctx.phase is GraphPhase.EAGER and pw.ctx.bucket is None


@pytest.mark.gpu
def test_cuda_replays_equal_eager_forwards_and_run_the_ops_eagerly():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    model = Toy().cuda()
    buckets = [2, 4, 8, 16]
    pw = PiecewiseGraphs(model.forward, [rowmix], buckets, check_escapes=True)
    xs, ps = torch.zeros(16, 8, device="cuda"), torch.zeros(16, device="cuda")

    @contextlib.contextmanager
    def make_inputs(bucket):
        xs[:bucket].normal_()
        ps[:bucket] = torch.arange(bucket, dtype=torch.float32, device="cuda")
        yield (xs[:bucket], ps[:bucket])

    with torch.inference_mode():
        pw.capture(make_inputs)
        assert pw.failed == {} and pw.captured == set(buckets)
        assert all(pw.recordings[b].ops == 3 for b in buckets)
        for scale in (1.0, -0.5):
            STEP["scale"] = scale
            for bucket in (16, 2, 8, 4):
                xs[:bucket].normal_()
                ps[:bucket].uniform_()
                got = pw.run(bucket, xs[:bucket], ps[:bucket]).clone()
                want = model(xs[:bucket].clone(), ps[:bucket].clone())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        STEP["scale"] = 1.0
        # inputs elsewhere than at capture are copied to where the graphs read them
        other = torch.randn(4, 8, device="cuda")
        got = pw.run(4, other, ps[:4]).clone()
        torch.testing.assert_close(got, model(other, ps[:4]), rtol=1e-5, atol=1e-5)
    pw.release()
    assert pw.recordings == {}


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


def test_the_kit_finds_a_backend_calling_its_op_through_the_dispatcher():
    from backplane.testing.checks import check_op_objects_called

    class Backend:
        def dynamic_ops(self):
            return (torch.ops.bp_graph_test.rowmix.default,)

    x, w = torch.randn(3, 8), torch.randn(8)
    assert check_op_objects_called(Backend(), lambda: rowmix(x, w)) == 1
    with pytest.raises(EscapedOpError):
        check_op_objects_called(Backend(), lambda: torch.ops.bp_graph_test.rowmix(x, w, None))
    with pytest.raises(AssertionError, match="op object"):
        check_op_objects_called(Backend(), lambda: rowmix_lookalike(x, w))


class FailingToy(Toy):
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        rowmix(self.l1(x) + pos[:, None], self.w)
        raise RuntimeError("out of memory in the middle of a recording")


def test_a_failed_recording_ends_the_capture_it_left_open():
    class OpenGraphs(FakeGraph):
        open = 0

        def capture_begin(self, pool=None) -> None:
            OpenGraphs.open += 1

        def capture_end(self) -> None:
            OpenGraphs.open -= 1

    recorder = _Recorder(normalize_ops([rowmix]), None, graph_type=OpenGraphs)
    with torch.inference_mode(), intercept_cached_ops(recorder):
        recorder.begin()
        with pytest.raises(RuntimeError, match="out of memory"):
            FailingToy()(torch.randn(3, 8), torch.arange(3.0))
        assert OpenGraphs.open == 1  # the graph begun after the op is still recording
        recorder.abort()
    assert OpenGraphs.open == 0
    recorder.abort()  # nothing open: nothing to do
    assert OpenGraphs.open == 0


def test_an_interceptor_holds_for_its_own_thread_only():
    import threading

    seen = []
    x, w = torch.randn(2, 8), torch.randn(8)

    def other():
        with torch.inference_mode():
            rowmix(x, w)

    with torch.inference_mode(), intercept_cached_ops(lambda op, a, k: seen.append(op) or x):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert seen == []
        rowmix(x, w)
    assert seen == [rowmix]

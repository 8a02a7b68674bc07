"""Host-side bookkeeping of a step stays exact where it is done incrementally.

The output processor keeps each request's inter-token gaps across steps instead of
differencing every commit time again; the gaps it reports must still equal
``np.diff`` of the request's commit times after every step.
"""

from __future__ import annotations

import numpy as np

from backplane.api.output_processor import OutputProcessor, TrackedRequest
from backplane.engine.outputs import EngineStepOutput
from backplane.engine.request import Request
from backplane.engine.sampling import SamplingParams


def _request(max_tokens: int) -> Request:
    return Request("g", [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_gaps_follow_commit_times_step_by_step():
    rng = np.random.default_rng(3)
    req = _request(64)
    op = OutputProcessor(None, frozenset(), lambda rid: True)
    t = TrackedRequest(req, [5, 6, 7])
    now = 100.0
    seen = []
    # one token per step, sometimes two (a failed asynchronous step delivers late), or none
    for per_step in [1, 1, 2, 1, 0, 3, 1, 1, 2, 1]:
        new = []
        for _ in range(per_step):
            now += float(rng.uniform(0.001, 0.2))
            tok = int(rng.integers(0, 256))
            req.append_token(tok, now=now)
            new.append(tok)
        out = op.update(t, EngineStepOutput("g", new))
        gaps = out.metrics.inter_token_latencies
        assert gaps == np.diff(req.output_token_times).tolist()
        seen.append(gaps)
    # each output holds its own list: changing one changes no later output
    seen[-1].append(-1.0)
    again = op.output(t, incremental=False).metrics.inter_token_latencies
    assert again == np.diff(req.output_token_times).tolist()


def test_decode_through_the_wrapped_tokenizer_gives_the_tokenizers_text():
    from backplane.models.presets import byte_tokenizer
    from backplane.models.tokenizer import TextTokenizer

    tok = TextTokenizer(byte_tokenizer())
    op = OutputProcessor(tok, frozenset(), lambda rid: True)
    rng = np.random.default_rng(5)
    for _ in range(50):
        ids = rng.integers(0, 258, int(rng.integers(1, 12)))  # bytes, bos and eos among them
        want = tok.decode(ids.tolist(), skip_special_tokens=True)
        assert op.decode(ids.tolist()) == want
        assert op.decode(ids) == want
        assert op.decode(tuple(ids.tolist())) == want
    assert op.decode([]) == ""

    class Upper:
        """Another tokenizer put in place afterwards: it decodes from then on."""

        def decode(self, ids, skip_special_tokens=True):
            return "X" * len(ids)

    op.tokenizer = Upper()
    assert op.decode([65, 66]) == "XX"


def _sampling_request(rid: str, seed: int, **kw: object) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=16, **kw))
    r.sampling_seed = seed
    return r


def test_sampling_rows_follow_their_requests_as_the_batch_changes():
    from backplane.engine.step_rows import sampling_rows

    a = _sampling_request("a", 11, logprobs=2)
    b = _sampling_request("b", 22, min_tokens=4, stop_token_ids=[9, 10])
    c = _sampling_request("c", 33, presence_penalty=0.5)
    d = _sampling_request("d", 44)
    batches = [[a, b, c], [a, b, c], [c, a, b], [a, b], [a, b, d], [d], [a, b, c]]
    for step, reqs in enumerate(batches):
        for r in reqs:
            r.append_token(5 + step)
        rows = sampling_rows(reqs, None)
        assert rows.seeds.tolist() == [r.sampling_seed for r in reqs]
        assert list(rows.params) == [r.sampling_params for r in reqs]
        assert rows.offsets.tolist() == [r.num_output_tokens for r in reqs]
        asked = [r.sampling_params.logprobs for r in reqs if r.sampling_params.logprobs is not None]
        assert rows.num_logprobs == (max(asked) if asked else -1)
        want_penalty = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
        want_suppress = [
            i for i, r in enumerate(reqs) if r.num_output_tokens < r.sampling_params.min_tokens
        ]
        if not want_penalty and not want_suppress:
            assert rows.processing is None
        else:
            proc = rows.processing
            got = [] if proc.penalty_rows is None else proc.penalty_rows.tolist()
            assert got == want_penalty
            got = [] if proc.suppress is None else sorted(set(proc.suppress.rows.tolist()))
            assert got == want_suppress
        # what a step's rows hold is theirs: writing into them changes no later step
        rows.seeds[:] = -1
        rows.params.clear()
        if rows.processing is not None and rows.processing.penalty_rows is not None:
            rows.processing.penalty_rows[:] = 7


def _decode_seq(tokens: list[int], pending_row: int, page: int):
    from backplane.engine.worker.inputs import ScratchRequest, ScratchSeq

    buf = np.asarray(tokens, dtype=np.int32)
    return ScratchSeq(
        ScratchRequest(buf, pending_source_row=pending_row),
        num_new_tokens=1,
        num_cached_tokens=len(tokens) - 1,
        page_ids=np.asarray([page], dtype=np.int32),
        state_slot=0,
        is_prefill_chunk_final=True,
    )


def test_decode_inputs_take_in_flight_tokens_and_host_tokens_alike():
    import torch

    from backplane.engine.worker.inputs import InputBatch

    ib = InputBatch(max_num_tokens=64, max_num_seqs=8, max_pages_per_seq=4, page_size=16)
    in_flight = torch.tensor([901, 902, 903, 904], dtype=torch.int64)
    prefill = _decode_seq([7, 8, 9, 10, 11], -1, 5)
    prefill.num_new_tokens, prefill.num_cached_tokens = 5, 0
    cases = [
        # every decode token is in flight (the steady asynchronous state)
        [_decode_seq([1, 2, 0], 2, 1), _decode_seq([3, 4, 5, 0], 0, 2), _decode_seq([6, 0], 3, 3)],
        # some are known on the host
        [
            _decode_seq([1, 2, 33], -1, 1),
            _decode_seq([3, 4, 5, 0], 1, 2),
            _decode_seq([6, 44], -1, 3),
        ],
        # a prefill before decodes that are all in flight
        [prefill, _decode_seq([1, 2, 0], 3, 1), _decode_seq([3, 0], 2, 2)],
    ]
    for seqs in cases:
        want = []
        for s in seqs:
            c, q = s.num_cached_tokens, s.num_new_tokens
            row = s.request.pending_source_row
            if q == 1 and row >= 0:
                want.append(int(in_flight[row]))
            else:
                want.extend(int(t) for t in s.request.token_buffer[c : c + q])
        ib.pending_source = in_flight
        inputs = ib.prepare(seqs)
        ib.pending_source = None
        assert inputs.input_ids[: len(want)].tolist() == want
        positions = [
            p
            for s in seqs
            for p in range(s.num_cached_tokens, s.num_cached_tokens + s.num_new_tokens)
        ]
        assert inputs.positions[: len(want)].tolist() == positions

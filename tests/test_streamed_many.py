"""One step's streamed outputs, their texts decoded together, equal those made one by one.

:meth:`OutputProcessor.update_streamed_many` takes every request's tokens, decodes the
windows of all of them in one call and then finishes each output; what it hands the
streams (and the state it leaves in each request) must be what :meth:`update` makes
request by request, whatever the requests ask for (stop strings, logprobs) and however
their windows move on.
"""

from __future__ import annotations

import numpy as np
import pytest

from backplane.api.output_processor import OutputProcessor, PendingOutput, TrackedRequest
from backplane.engine.outputs import EngineStepOutput
from backplane.engine.request import Request
from backplane.engine.sampling import Logprob, SamplingParams

PROMPT = [5, 6, 7]
# multi-byte characters (held back until whole), a stop string ("zq") near the end, and
# enough bytes for the detokenising window to move on several times
TEXTS = [
    "héllo wörld ✓ then ✓✓ more words and zq tail " * 2,
    "plain ascii text that runs long enough to move the window on a few times over",
    "ünïcödé ✓✓✓ all the way through, ✓ and more ✓ to come ✓",
]
STATE = ("text", "sent", "emitted", "prefix_offset", "read_offset", "window", "finished")


def _fields(out) -> dict:
    """Everything an output shows but its timings."""
    c = out.outputs[0]
    return {
        "request_id": out.request_id,
        "finished": out.finished,
        "new_token_ids": list(out.new_token_ids),
        "new_text": out.new_text,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "logprobs": None
        if c.logprobs is None
        else [{t: (lp.logprob, lp.decoded_token) for t, lp in d.items()} for d in c.logprobs],
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "gaps": list(out.metrics.inter_token_latencies),
    }


def _processor(tokenizer: bool) -> OutputProcessor:
    from backplane.models.presets import byte_tokenizer
    from backplane.models.tokenizer import TextTokenizer

    return OutputProcessor(
        TextTokenizer(byte_tokenizer()) if tokenizer else None, frozenset(), lambda rid: True
    )


def _requests(rng: np.random.Generator) -> list[tuple[Request, list[int], int]]:
    """``(request, its tokens, the step it is finished by length at or -1)`` per request:
    plain, with a stop string, with logprobs, and one ended early by the engine."""
    kinds = [{}, {"stop": ["zq"]}, {"logprobs": 1}, {}, {"stop": ["✓ a", "long"]}]
    out = []
    for i, kw in enumerate(kinds):
        params = SamplingParams(max_tokens=400, **kw)
        ids = list(TEXTS[i % len(TEXTS)].encode())
        end = int(rng.integers(5, 30)) if i == 3 else -1
        out.append((Request(f"r{i}", PROMPT, params), ids, end))
    return out


def _run(seed: int, tokenizer: bool = True) -> None:
    rng = np.random.default_rng(seed)
    op = _processor(tokenizer)
    reqs = _requests(rng)
    refs = [TrackedRequest(r, PROMPT, "p") for r, _, _ in reqs]
    gots = [TrackedRequest(r, PROMPT, "p") for r, _, _ in reqs]
    pos = [0] * len(reqs)
    now = 10.0
    for step in range(200):
        pairs_ref, pairs_got = [], []
        for i, (req, ids, end) in enumerate(reqs):
            if refs[i].finished:
                continue
            k = int(rng.choice([0, 1, 1, 1, 2]))
            new = ids[pos[i] : pos[i] + k]
            pos[i] += len(new)
            for tok in new:
                now += 0.01
                req.append_token(tok, now=now)
            finished = step == end or pos[i] >= len(ids)
            lps = [{t: Logprob(-0.5, 1)} for t in new] if req.sampling_params.logprobs else None
            so = EngineStepOutput(
                req.request_id,
                new,
                finished=finished,
                finish_reason="length" if finished else None,
                new_logprobs=lps,
            )
            pairs_ref.append((refs[i], so))
            pairs_got.append((gots[i], so))
        if not pairs_ref:
            break
        want = [op.update(t, so) for t, so in pairs_ref]
        got = op.update_streamed_many(pairs_got)
        assert len(got) == len(want)
        for g, w, (rt, _), (gt, _) in zip(got, want, pairs_ref, pairs_got, strict=True):
            assert type(g) is PendingOutput or g.finished
            built = g.build() if type(g) is PendingOutput else g
            assert _fields(built) == _fields(w)
            assert [getattr(gt, a) for a in STATE] == [getattr(rt, a) for a in STATE]
    assert all(t.finished for t in refs)


@pytest.mark.parametrize("seed", range(6))
def test_a_step_decoded_together_hands_out_what_each_request_gets_alone(seed):
    _run(seed)


def test_without_a_tokenizer_the_outputs_carry_tokens_only():
    _run(0, tokenizer=False)


def test_a_step_decodes_its_windows_in_one_call(monkeypatch):
    op = _processor(True)
    backend = op.tokenizer.backend
    calls = {"one": 0, "batch": 0}

    class Counting:
        def decode(self, *a, **kw):
            calls["one"] += 1
            return backend.decode(*a, **kw)

        def decode_batch(self, *a, **kw):
            calls["batch"] += 1
            return backend.decode_batch(*a, **kw)

    counting = Counting()
    monkeypatch.setattr(op, "_direct", counting.decode)
    monkeypatch.setattr(op, "_direct_batch", counting.decode_batch)
    params = SamplingParams(max_tokens=40)
    ts = [TrackedRequest(Request(f"r{i}", PROMPT, params), PROMPT) for i in range(8)]
    for step in range(20):
        pairs = []
        for i, t in enumerate(ts):
            tok = 97 + (i + step) % 26
            t.request.append_token(tok, now=float(step))
            pairs.append((t, EngineStepOutput(t.request.request_id, [tok])))
        op.update_streamed_many(pairs)
    assert calls == {"one": 0, "batch": 20}
    assert ts[3].text == "".join(chr(97 + (3 + s) % 26) for s in range(20))

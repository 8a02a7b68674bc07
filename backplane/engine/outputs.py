"""What a step gives back: :class:`EngineStepOutput`, and the bookkeeping behind it.

A launched step (:class:`LaunchedStep`) carries its sampled tokens on the
device, their pinned host copies and the logprobs copied with them. Once the
copies reached the host, the helpers here keep each committed token's
logprobs (and a prompt's logprobs, chunk by chunk) in its request, and the
engine loop builds one :class:`EngineStepOutput` per request that got a token
or finished.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

import torch

from backplane.engine.request import PromptLogprobs, Request
from backplane.engine.sampling import (
    Logprob,
    LogprobsTensors,
    PromptLogprobRows,
    logprob_dicts,
)
from backplane.engine.sched import Scheduler, SchedulerOutput

__all__ = [
    "EngineStepOutput",
    "collect_outputs",
    "HostLogprobs",
    "LaunchedStep",
    "PromptLaunch",
    "TokenCopies",
    "finished_requests",
    "keep_logprobs",
    "keep_prompt_logprobs",
    "prompt_logprob_list",
    "to_host",
]

#: Host copies of :class:`~backplane.engine.sampling.LogprobsTensors`: token ids,
#: logprobs, ranks.
HostLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: One position's logprobs: ``{token_id: Logprob}`` (``None`` where nothing was asked).
LogprobDict = dict[int, Logprob] | None


@dataclass
class EngineStepOutput:
    """What one step produced for one request.

    :param request_id: the request.
    :param new_token_ids: tokens committed this step (zero or one; two after a failed
        asynchronous step, whose committed token comes with the next one).
    :param finished: whether the request is done.
    :param finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (its steps
        kept failing, see :meth:`Engine.step`) once finished.
    :param new_logprobs: one ``{token_id: Logprob}`` per new token when the request
        asks for logprobs (``SamplingParams.logprobs``), else ``None``.
    :param prompt_logprobs: with the request's first token, when it asks for
        ``SamplingParams.prompt_logprobs``: ``None`` for the first prompt token, then per
        prompt token ``{token_id: Logprob}`` of that token and the top ones (once;
        ``None`` in every other output).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[LogprobDict] | None = None
    prompt_logprobs: list[LogprobDict] | None = None


@dataclass
class PromptLaunch:
    """A step's prompt-logprob rows: what the device computes and where it goes.

    :param rows: the device rows (indices into the hidden states, target tokens).
    :param entries: ``(request, first prompt position, first row)`` per request, in row
        order; each request's rows run to the next entry's first row.
    :param host: host copies of the rows' logprobs (valid once the step's event completed).
    """

    rows: PromptLogprobRows
    entries: list[tuple[Request, int, int]]
    host: HostLogprobs | None = None


@dataclass
class LaunchedStep:
    """A step on the device: what was scheduled, which requests sample, and their tokens.

    :param sched: the scheduler's output.
    :param reqs: the requests that sample, in row order of ``tokens``.
    :param tokens: ``[len(reqs)]`` int64 sampled tokens on the device.
    :param host: pinned host copy of ``tokens`` (valid once ``event`` completed).
    :param event: recorded after the copy (``None`` on CPU).
    :param logprobs: host copies of the rows' logprobs (valid once ``event`` completed),
        or ``None`` when no row asked.
    :param prompt: the step's prompt-logprob rows, or ``None``.
    """

    sched: SchedulerOutput
    reqs: list[Request]
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None
    logprobs: HostLogprobs | None = None
    prompt: PromptLaunch | None = None

    def wait(self) -> dict[str, int]:
        """The sampled tokens by request id, once they reached the host."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host.tolist()
        return {r.request_id: t for r, t in zip(self.reqs, tokens, strict=True)}


class TokenCopies:
    """Two pinned host buffers for the sampled tokens, used in turn.

    Step N+1's copy is issued before step N's tokens are read, so each step
    copies into the buffer the step before last used (committed by then).

    :param max_rows: most sampled rows in one step.
    :param device: the device the tokens are sampled on (pinned buffers and events on CUDA).
    """

    def __init__(self, max_rows: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else []
        #: the buffer the next step copies into (0 or 1)
        self.turn = 0

    def start(
        self, tokens: torch.Tensor, wait_too: bool = False
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Issue the copy of a step's tokens to the host.

        :param tokens: ``[n]`` int64 tokens on the device.
        :param wait_too: the step copies something else (prompt logprobs) that needs an
            event even without tokens.
        :return: the host view (valid once the event completed) and the event the caller
            records after issuing its other copies (``None`` on CPU, or with nothing to wait for).
        """
        n = len(tokens)
        turn = self.turn
        self.turn ^= 1
        host = self._host[turn][:n]
        if n:
            host.copy_(tokens, non_blocking=True)
        event = self._events[turn] if self._events and (n or wait_too) else None
        return host, event


def to_host(lp: LogprobsTensors) -> HostLogprobs:
    """Start copying logprobs to (pinned) host tensors; they are read once the step's
    event completed.

    :param lp: the device logprobs.
    :return: the host tensors (token ids, logprobs, ranks).
    """
    pin = lp.token_ids.is_cuda
    ids, vals, ranks = (
        torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=True)
        for t in (lp.token_ids, lp.logprobs, lp.ranks)
    )
    return ids, vals, ranks


def keep_prompt_logprobs(launched: LaunchedStep, gone: Set[str] = frozenset()) -> None:
    """Store a committed step's prompt logprobs in their requests (by prompt position).

    :param launched: the step just committed (its copies have reached the host).
    :param gone: requests aborted since the launch.
    """
    prompt = launched.prompt
    if prompt is None or prompt.host is None:
        return
    ids, vals, ranks = (t.numpy() for t in prompt.host)
    ends = [e[2] for e in prompt.entries[1:]] + [len(ranks)]
    for (req, lo, a), b in zip(prompt.entries, ends, strict=True):
        if req.request_id in gone:
            continue
        req.prompt_logprobs.store(lo, ids[a:b], vals[a:b], ranks[a:b])


def prompt_logprob_list(state: PromptLogprobs) -> list[LogprobDict]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then one dict per token.

    :param state: a request's complete prompt logprobs.
    :return: the list, one entry per prompt token.
    """
    ks = [state.k] * state.num_positions
    return [None, *logprob_dicts(state.token_ids, state.logprobs, state.ranks, ks)]


def keep_logprobs(
    launched: LaunchedStep, sampled: dict[str, int], gone: Set[str] = frozenset()
) -> None:
    """Append each committed token's logprobs to its request (after the tokens reached the host).

    :param launched: the step whose tokens were just committed.
    :param sampled: the tokens committed, by request id.
    :param gone: requests aborted since the launch (their token was dropped).
    """
    if launched.logprobs is None:
        return
    ids, vals, ranks = (t.numpy() for t in launched.logprobs)
    ks = [r.sampling_params.logprobs for r in launched.reqs]
    for r, d in zip(launched.reqs, logprob_dicts(ids, vals, ranks, ks), strict=True):
        rid = r.request_id
        if d is not None and r.logprobs is not None and rid in sampled and rid not in gone:
            r.logprobs.append(d)


def finished_requests(scheduler: Scheduler, sched: SchedulerOutput) -> list[Request]:
    """Requests finished before this step (aborts, in ``sched.finished``) or by it.

    :param scheduler: the engine's scheduler (its finished requests are popped).
    :param sched: the step's scheduler output.
    :return: the requests.
    """
    return [*sched.finished, *scheduler.pop_finished()]


def _attach_logprobs(o: EngineStepOutput, req: Request) -> None:
    """Give an output with new tokens the logprobs its request kept for them (and its prompt
    logprobs, once complete and not yet delivered)."""
    if not o.new_token_ids:
        return
    kept = req.logprobs
    if kept is not None:
        # the request keeps one entry per committed token, in order
        o.new_logprobs = kept[len(kept) - len(o.new_token_ids) :]
    plp = req.prompt_logprobs
    if plp is not None and plp.complete and not plp.delivered:
        plp.delivered = True
        o.prompt_logprobs = prompt_logprob_list(plp)


def collect_outputs(
    requests: dict[str, Request],
    prompt_waiting: set[Request],
    scheduler: Scheduler,
    sched: SchedulerOutput,
    sampled: dict[str, int],
    undelivered: dict[str, int] | None = None,
) -> list[EngineStepOutput]:
    """One output per request that got a token or finished; finished requests leave the engine.

    :param requests: the engine's live requests by id (finished ones are removed).
    :param prompt_waiting: requests whose prompt logprobs are still wanted (finished
        ones are removed).
    :param scheduler: the engine's scheduler (its finished requests are popped).
    :param sched: the step's scheduler output.
    :param sampled: the tokens committed now, by request id.
    :param undelivered: tokens committed by an earlier step that raised before
        returning them; delivered first.
    :return: the outputs.
    """
    outs: dict[str, EngineStepOutput] = {}
    get = requests.get
    if undelivered is not None and undelivered is not sampled:
        # committed by a step that raised afterwards: delivered now, first
        for rid, tok in undelivered.items():
            outs[rid] = EngineStepOutput(rid, [tok])
        for rid, tok in sampled.items():
            o = outs.get(rid)
            if o is None:
                outs[rid] = EngineStepOutput(rid, [tok])
            else:
                o.new_token_ids.append(tok)
        for rid, o in outs.items():
            req = get(rid)
            if req is not None:
                _attach_logprobs(o, req)
    else:
        # the common step: one token per request, so one pass builds and completes each output
        for rid, tok in sampled.items():
            o = outs[rid] = EngineStepOutput(rid, [tok])
            req = get(rid)
            if req is not None and (req.logprobs is not None or req.prompt_logprobs is not None):
                _attach_logprobs(o, req)
    # every request the scheduler finished (stopped, length, aborted) this step
    for req in finished_requests(scheduler, sched):
        rid = req.request_id
        o = outs.get(rid)
        if o is None:
            o = outs[rid] = EngineStepOutput(rid)
        o.finished = True
        o.finish_reason = req.finish_reason.value if req.finish_reason is not None else None
        requests.pop(rid, None)
        prompt_waiting.discard(req)
    return list(outs.values())

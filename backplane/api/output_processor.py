"""From the engine's tokens to :class:`RequestOutput`: detokenising, stop strings, stop reasons.

:class:`OutputProcessor` turns each engine step's outputs for one request
(:class:`TrackedRequest`) into the :class:`RequestOutput` the API hands out:
the text is detokenised incrementally (a few tokens per step, never the whole
output), stop strings end the request (:mod:`backplane.api.stop`), and the
text that could still become a stop string is held back from streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.api.outputs import (
    CompletionOutput,
    Logprob,
    MetricsSnapshot,
    RequestOutput,
    metrics_from,
    streamed_completion,
    streamed_output,
)
from backplane.api.pending_output import PendingOutput, coalesced
from backplane.api.stop import StopAutomaton, StopMatcher
from backplane.engine.outputs import EngineStepOutput
from backplane.engine.request import Request
from backplane.models.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

__all__ = ["OutputProcessor", "PendingOutput", "TrackedRequest", "coalesced"]

# Most tokens of the detokenising window before its start moves up: a longer window
# costs a little more per decode, a shorter one a second decode more often.
_MAX_WINDOW = 16


class TrackedRequest:
    """The API's view of one live request, with incremental detokenization state.

    Text is produced from a sliding window of tokens, so each step decodes a
    few tokens rather than the whole output: ``decode(ids[prefix:read])`` is
    the text already emitted for that window, ``decode(ids[prefix:])`` the
    window with the new tokens; the difference is new text, held back while it
    ends in an incomplete character (U+FFFD). With stop strings, the end of the
    text that could still become one is held back too (``sent`` counts the
    characters handed out so far).

    :param request: the engine's request (its ``sampling_params``, ``stats``,
        ``output_token_times`` and ``request_id`` are read).
    :param prompt: the prompt's token ids.
    :param prompt_text: what ``RequestOutput.prompt`` shows (``None`` for token ids).
    :param public_id: the id its outputs carry (that of the ``n > 1`` request
        this one is a sample of); default: the engine request's id.
    :param index: the sample's index in that request.
    :param stop_automaton: the automaton of its stop strings, built ahead (else built here).
    """

    __slots__ = (
        "request",
        "prompt",
        "prompt_text",
        "public_id",
        "index",
        "text",
        "token_ids",
        "emitted",
        "sent",
        "finished",
        "reason",
        "prefix_offset",
        "read_offset",
        "window",
        "stops",
        "matcher",
        "include_stop",
        "stop_str",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "gaps",
    )

    def __init__(
        self,
        request: Request,
        prompt: list[int],
        prompt_text: str | None = None,
        *,
        public_id: str | None = None,
        index: int = 0,
        stop_automaton: StopAutomaton | None = None,
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.prompt_text = prompt_text
        self.public_id = request.request_id if public_id is None else public_id
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.emitted = 0
        self.sent = 0
        self.finished = False
        self.reason: str | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        #: the text of the tokens ``[prefix_offset:read_offset]`` when known (saves a decode)
        self.window: str | None = None
        params = getattr(request, "sampling_params", None)
        self.stops: tuple[str, ...] = tuple(getattr(params, "stop", ()) or ())
        self.matcher = StopMatcher(self.stops, stop_automaton) if self.stops else None
        self.include_stop = bool(getattr(params, "include_stop_str_in_output", False))
        self.stop_str: str | None = None
        # stop strings are not searched in the text of the first min_tokens tokens
        # (0 once the search has begun)
        self.min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if getattr(params, "logprobs", None) is not None else None
        )
        # set once the engine delivers them (with the first token)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        # the gaps between the commit times of its tokens so far (see _metrics)
        self.gaps: list[float] = []


class OutputProcessor:
    """Detokenises requests' tokens and builds their outputs.

    :param tokenizer: the model's tokenizer, or ``None`` (then texts are empty).
    :param end_ids: the model's end-of-sequence ids and the chat end of turn: a
        stop on one of those reports no ``stop_reason``, as in vLLM.
    :param abort: ends a request in the engine by id (called when a stop
        string matches, so its pages are freed at once).
    """

    def __init__(
        self,
        tokenizer: Any,  # Any: whatever the checkpoint's loader made (HF tokenizers or GGUF)
        end_ids: frozenset[int],
        abort: Callable[[str], bool],
    ) -> None:
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self._abort = abort
        # The wrapped ``tokenizers.Tokenizer`` of a TextTokenizer decodes the same ids to the
        # same text; calling it directly saves two Python calls and a list copy per decode,
        # two decodes per request per step.
        self._direct_owner: Any = None
        self._direct: Callable[..., str] | None = None
        self._direct_batch: Callable[..., list[str]] | None = None
        if isinstance(tokenizer, TextTokenizer):
            self._direct_owner = tokenizer
            self._direct = tokenizer.backend.decode
            self._direct_batch = getattr(tokenizer.backend, "decode_batch", None)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Detokenize, skipping special tokens where the tokenizer can.

        :param token_ids: the ids.
        :return: the text (empty without a tokenizer).
        """
        tokenizer = self.tokenizer
        if tokenizer is None or len(token_ids) == 0:
            return ""
        if tokenizer is self._direct_owner:
            ids = token_ids if type(token_ids) is list else list(token_ids)
            return self._direct(ids, skip_special_tokens=True)
        try:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        except TypeError:
            return self.tokenizer.decode(list(token_ids))

    def decode_many(self, windows: list[list[int]]) -> list[str]:
        """Detokenize several id lists, each as :meth:`decode` would.

        The ``tokenizers`` library decodes a batch in one call, without the GIL: the
        engine loop's detokenising then leaves the streams' readers free to run.

        :param windows: the id lists.
        :return: their texts, in order.
        """
        batch = self._direct_batch
        if batch is not None and self.tokenizer is self._direct_owner:
            return batch(windows, skip_special_tokens=True)
        return [self.decode(w) for w in windows]

    def update(self, t: TrackedRequest, step_output: EngineStepOutput) -> RequestOutput:
        """Take one engine step's output for ``t`` and return ``t``'s incremental output.

        :param t: the request.
        :param step_output: the engine's output for it (``new_token_ids``,
            ``new_logprobs``, ``prompt_logprobs``, ``finished``, ``finish_reason``).
        :return: the tokens and text added since the previous output, and the totals.
        """
        self._take(t, step_output)
        return self.output(t, incremental=True)

    def _take(self, t: TrackedRequest, step_output: EngineStepOutput) -> bool:
        """Add a step's tokens, logprobs and finish state to ``t``; return whether it finished."""
        t.token_ids.extend(step_output.new_token_ids)
        if t.logprobs is not None and step_output.new_logprobs:
            t.logprobs.extend(self.decoded(d) for d in step_output.new_logprobs)
        if step_output.prompt_logprobs is not None:
            t.prompt_logprobs = self.decoded_list(step_output.prompt_logprobs)
        if step_output.finished:
            t.finished = True
            t.reason = step_output.finish_reason
        return step_output.finished

    def absorb(self, t: TrackedRequest, step_output: EngineStepOutput) -> bool:
        """Take one engine step's output for ``t`` without building an output object.

        For callers that hand out only a request's final output
        (:meth:`backplane.LLM.generate`): the tokens, logprobs and finish state
        are taken as :meth:`update` takes them, but the text is detokenised only
        where stop strings must be searched in it; without stop strings the
        finished request's text is decoded once, whole, by :meth:`output`.

        :param t: the request.
        :param step_output: the engine's output for it.
        :return: whether ``t`` is finished (then build its output with :meth:`output`).
        """
        if self._take(t, step_output):
            return True
        if t.matcher is not None and t.stop_str is None:
            self._catch_up(t)
        return t.finished

    def output(self, t: TrackedRequest, *, incremental: bool) -> RequestOutput:
        """Bring ``t``'s text up to date with its tokens and build its output.

        :param t: the request.
        :param incremental: ``new_token_ids`` / ``new_text`` hold what was added
            since the previous output (else everything).
        :return: the output.
        """
        start, sent, visible = self._advance(t)
        if not incremental:
            start, sent, visible = 0, 0, len(t.text)
        return self._build(t, start, sent, visible)

    def update_streamed(
        self, t: TrackedRequest, step_output: EngineStepOutput
    ) -> RequestOutput | PendingOutput:
        """:meth:`update` for a stream whose reader builds the output on its own thread.

        The request's text is brought up to date here (stop strings are searched
        on the engine's side), but a running request's :class:`RequestOutput` is
        left to :meth:`PendingOutput.build`: building one for every stream every
        step was most of the engine loop's host time per step. A finished request's
        output is built at once (finished-request callbacks read it).

        :param t: the request.
        :param step_output: the engine's output for it.
        :return: the finished output, or what builds the running one's.
        """
        self._take(t, step_output)
        return self._streamed(t)

    def update_streamed_many(
        self, pairs: Sequence[tuple[TrackedRequest, EngineStepOutput]]
    ) -> list[RequestOutput | PendingOutput]:
        """:meth:`update_streamed` for each of one step's requests, their texts decoded together.

        The tokens of every request are taken first; then the windows of those whose
        text grows are detokenised in one :meth:`decode_many` call, and each
        request's text, stop strings and output follow as :meth:`update_streamed`
        would have made them.

        :param pairs: ``(request, its engine output)`` per request of the step.
        :return: the outputs, in the order of ``pairs``.
        """
        take = self._take
        windows: list[list[int]] = []
        # per window: the index of its pair (~index for a window's already emitted text)
        owners: list[int] = []
        check = self.tokenizer is not None
        for i, (t, so) in enumerate(pairs):
            take(t, so)
            # the windows _catch_up would decode for a running request
            if check and not t.finished and t.stop_str is None:
                ids = t.token_ids
                if len(ids) > t.read_offset:
                    if t.window is None:
                        if t.read_offset > t.prefix_offset:
                            windows.append(ids[t.prefix_offset : t.read_offset])
                            owners.append(~i)
                        else:
                            t.window = ""
                    windows.append(ids[t.prefix_offset :])
                    owners.append(i)
        news: list[str | None] = [None] * len(pairs)
        if windows:
            for i, text in zip(owners, self.decode_many(windows), strict=True):
                if i < 0:
                    pairs[~i][0].window = text
                else:
                    news[i] = text
        outs: list[RequestOutput | PendingOutput] = []
        pending, streamed, grow = self._pending, self._streamed, self._grow
        for (t, _), new in zip(pairs, news, strict=True):
            if t.matcher is not None or t.finished:
                outs.append(streamed(t, new))
                continue
            # what _streamed does for a running request without stop strings: the text
            # grows by the window's new part, and all of it is handed out
            start = t.emitted
            t.emitted = len(t.token_ids)
            if new is not None:
                grow(t, new)
            sent = t.sent
            t.sent = visible = len(t.text)
            outs.append(pending(t, start, sent, visible))
        return outs

    def _streamed(self, t: TrackedRequest, new: str | None = None) -> RequestOutput | PendingOutput:
        """The rest of :meth:`update_streamed` once the step's tokens are taken (``new``:
        the request's window decoded ahead, see :meth:`_catch_up`)."""
        start, sent, visible = self._advance(t, new)
        if t.finished:  # by the engine, or by a stop string found just now
            return self._build(t, start, sent, visible)
        return self._pending(t, start, sent, visible)

    @staticmethod
    def _pending(t: TrackedRequest, start: int, sent: int, visible: int) -> PendingOutput:
        """A running request's output as of now, built by its reader (see :meth:`_build`)."""
        logprobs = t.logprobs
        return PendingOutput(
            t,
            start,
            len(t.token_ids),
            None if logprobs is None else len(logprobs),
            t.text,
            sent,
            visible,
            t.prompt_logprobs,
            _metrics(t),
        )

    def _advance(self, t: TrackedRequest, new: str | None = None) -> tuple[int, int, int]:
        """Mark ``t``'s tokens and text as handed out, its text brought up to date first.

        :param t: the request.
        :param new: its window decoded ahead (see :meth:`_catch_up`), or ``None``.
        :return: the first token and the first character not handed out before, and
            how much of the text is handed out now (the end that may still grow into a
            stop string is held back while the request runs).
        """
        start = t.emitted
        t.emitted = len(t.token_ids)
        if t.stop_str is None:  # a matched stop string froze the text
            self._catch_up(t, new)
        visible = len(t.text)
        if t.matcher is not None and not t.finished:  # the end that may grow into a stop string
            visible -= t.matcher.partial()
        sent = t.sent
        visible = max(min(visible, len(t.text)), min(sent, len(t.text)))
        t.sent = visible
        return start, sent, visible

    def _build(self, t: TrackedRequest, start: int, sent: int, visible: int) -> RequestOutput:
        """``t``'s output as of now: its tokens from ``start`` and text ``[sent:visible]`` are new."""
        reason = t.stop_str if t.stop_str is not None else stop_reason(t, self.end_ids)
        snapshot = _metrics(t)
        if not t.finished:
            # A running request's output copies its growing lists only if they are read
            # (streams mostly read the new tokens and text): O(new tokens) per step.
            completion = streamed_completion(
                t.index, t.text, t.token_ids, t.logprobs, t.reason, reason
            )
            return streamed_output(
                t.public_id,
                t.prompt_text,
                t.prompt,
                completion,
                t.prompt_logprobs,
                t.token_ids[start:],
                t.text[sent:visible],
                snapshot,
            )
        completion = CompletionOutput(
            index=t.index,
            text=t.text,
            token_ids=list(t.token_ids),
            logprobs=None if t.logprobs is None else list(t.logprobs),
            finish_reason=t.reason,
            stop_reason=reason,
        )
        return RequestOutput(
            request_id=t.public_id,
            prompt=t.prompt_text,
            prompt_token_ids=t.prompt,
            outputs=[completion],
            finished=True,
            prompt_logprobs=t.prompt_logprobs,
            new_token_ids=t.token_ids[start:],
            new_text=t.text[sent:visible],
            metrics=None if snapshot is None else metrics_from(snapshot),
        )

    def _catch_up(self, t: TrackedRequest, new: str | None = None) -> None:
        """Bring ``t``'s text up to date with its tokens and search it for stop strings.

        The text of a finished request is decoded whole (the exact final text);
        a running one's from its sliding window, and only when it has tokens the
        text has not read yet. ``new``: that window (``ids[prefix_offset:]``)
        already decoded, when the caller decoded it with other requests' windows.
        """
        if t.finished:
            final = self.decode(t.token_ids)  # the exact final text
            if t.matcher is not None and not final.startswith(t.text):
                t.matcher.rewind(_common_prefix(t.text, final))
            t.text = final
        elif self.tokenizer is not None and len(t.token_ids) > t.read_offset:
            ids = t.token_ids
            if t.window is None:
                t.window = self.decode(ids[t.prefix_offset : t.read_offset])
            self._grow(t, self.decode(ids[t.prefix_offset :]) if new is None else new)
        if t.matcher is not None:
            t.matcher.consume(t.text)
            if len(t.token_ids) > t.min_tokens:
                self._match_stop(t)

    @staticmethod
    def _grow(t: TrackedRequest, new: str) -> None:
        """Add to ``t``'s text what its window's text ``new`` (``ids[prefix_offset:]``, the
        window text known: ``t.window``) has past the text already emitted, once it ends in
        a whole character; move the window on."""
        old = t.window
        if len(new) > len(old) and not new.endswith("\ufffd"):
            t.text += new[len(old) :]
            n = len(t.token_ids)
            if n - t.prefix_offset <= _MAX_WINDOW:
                # The window keeps its start, so the text just decoded is the next
                # step's old text: one decode per step instead of two.
                t.window = new
            else:
                t.prefix_offset = t.read_offset
                t.window = None
            t.read_offset = n

    def decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """One position's logprobs with each token's text filled in (when there is a tokenizer).

        :param entry: token id -> its logprob.
        :return: the same, each with its decoded text.
        """
        if self.tokenizer is None:
            return entry
        return {tok: Logprob(lp.logprob, lp.rank, self.decode([tok])) for tok, lp in entry.items()}

    def decoded_list(
        self, entries: list[dict[int, Logprob] | None]
    ) -> list[dict[int, Logprob] | None]:
        """Prompt logprobs with each token's text (each distinct token decoded once).

        :param entries: one entry per prompt position (``None`` for the first).
        :return: the same, each logprob with its decoded text.
        """
        if self.tokenizer is None:
            return entries
        texts: dict[int, str] = {}
        out: list[dict[int, Logprob] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            d = {}
            for tok, lp in entry.items():
                s = texts.get(tok)
                if s is None:
                    s = texts[tok] = self.decode([tok])
                d[tok] = Logprob(lp.logprob, lp.rank, s)
            out.append(d)
        return out

    def _match_stop(self, t: TrackedRequest) -> None:
        """Finish ``t`` at its first stop string (trimmed unless it is to be kept).

        The matcher has read the text already; this only asks it. With
        ``min_tokens``, the search starts once more tokens than that were
        generated, and a match must end after the text of the first
        ``min_tokens`` tokens (vLLM's rule). A match ends the request in the
        engine at once (its pages are freed); the tokens stay in ``token_ids``.
        """
        matcher = t.matcher
        assert matcher is not None
        if not matcher.searching:
            # the first search: the text of the first min_tokens tokens does not count
            held = self.decode(t.token_ids[: t.min_tokens]).rstrip("\ufffd") if t.min_tokens else ""
            matcher.set_floor(min(len(held), len(t.text)))
            t.min_tokens = 0
        found = matcher.match()
        if found is None:
            return
        p, s = found
        t.text = t.text[: p + len(s)] if t.include_stop else t.text[:p]
        t.stop_str = s
        if not t.finished:
            t.finished = True
            self._abort(t.request.request_id)
        t.reason = "stop"


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common beginning of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stop_reason(t: TrackedRequest, end_ids: frozenset[int] = frozenset()) -> int | None:
    """The stop token that ended a ``"stop"`` finish (``None`` for end-of-sequence or other).

    :param t: the request.
    :param end_ids: the model's end-of-sequence ids and the chat end of turn: a stop
        on one of those is an end of sequence, as in vLLM.
    :return: the token id, or ``None``.
    """
    if t.reason != "stop" or not t.token_ids:
        return None
    last = t.token_ids[-1]
    if last in end_ids:
        return None
    return last if last in t.request.sampling_params.stop_token_ids else None


def _metrics(t: TrackedRequest) -> MetricsSnapshot:
    """The request's timings and counters as of now, from which :class:`RequestMetrics` is built.

    :param t: the request; its list of inter-token gaps is brought up to date.
    :return: the :class:`RequestMetrics` fields but the gaps, in field order (arrival
        time, time to first token, reused prompt tokens, preemptions, finish time,
        verifying steps, draft tokens, accepted draft tokens); the request's list of
        gaps; how many of them are its gaps now.
    """
    req = t.request
    st = req.stats
    gaps = _gaps(t, req.output_token_times)
    first = st.first_token_time
    scalars = (
        st.arrival_time,
        None if first is None else first - st.arrival_time,
        int(st.cached_tokens),
        int(st.num_preemptions),
        st.finished_time,
        st.num_spec_steps,
        st.num_draft_tokens,
        st.num_accepted_tokens,
    )
    return scalars, gaps, len(gaps)


def _gaps(t: TrackedRequest, times: np.ndarray) -> list[float]:
    """``np.diff(times).tolist()``, computed only for the tokens committed since the last call.

    A committed token's time never changes, so each step adds the gaps of its new
    tokens instead of differencing the whole output again (O(output) per step).

    :param t: the request (its ``gaps`` are extended in place).
    :param times: the commit times of its tokens.
    :return: ``t.gaps``.
    """
    gaps = t.gaps
    n = len(times) - 1
    k = len(gaps)
    if n == k + 1:
        gaps.append(float(times[n]) - float(times[k]))
    elif n > k:
        gaps.extend(np.diff(times[k:]).tolist())
    elif n < k:  # fewer committed tokens than seen: start over
        gaps = t.gaps = np.diff(times).tolist() if n > 0 else []
    return gaps

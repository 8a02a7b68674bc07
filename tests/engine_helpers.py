"""Driving an engine's requests to the end, for the tests that compare engines' tokens."""

from __future__ import annotations

from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams


def run_requests(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    check_invariants: bool = True,
) -> list[list[int]]:
    """Add every prompt and step the engine until all requests finish.

    :param engine: the engine.
    :param prompts: the prompts' token ids.
    :param params: each prompt's sampling parameters.
    :param check_invariants: check the scheduler's invariants after every step.
    :return: each request's generated token ids, in the order of ``prompts``.
    """
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        if check_invariants:
            engine.scheduler.check_invariants()
    return [got[i] for i in ids]

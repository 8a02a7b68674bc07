"""Start-up warm-up: scratch steps that meet every kernel variant before any request does.

JIT-compiled kernels, Triton's above all, build one variant per combination of
compile-time constants the first time it is launched. The attention kernels
have several such classes: the tile configuration follows the longest query of
a prefill, a prefill that extends cached context reads keys through the pages,
and the decode's key-split count follows the longest context of the step. The
CUDA-graph captures meet only some of them (fresh prompts of each bucket size,
decode at the longest context); a serving process meets the rest in its first
mixed steps, where each new variant costs a second or more of compilation
inside some request's time to first token.

:func:`warmup_steps` lists one scratch step per class, built like the capture
batches from :class:`~backplane.engine.inputs.ScratchSeq` (zero tokens, every
page the scratch page, the scratch state slot), so running them touches no live
cache data. The engine runs them through its model runner at start-up, the way
a real step of that shape runs (piecewise graphs included); with Triton's disk
cache warm, they take milliseconds.
"""

from __future__ import annotations

from backplane.engine.inputs import ScratchSeq, scratch_seq

#: Prompt lengths that reach every prefill tile class of the attention kernels
#: (tiny <= 32 < short <= 64 < medium < 2048 <= long; 4096 adds the
#: tensor-descriptor loads of very long prompts).
PREFILL_LENGTHS = (16, 48, 128, 2048, 4096)

#: Context length that gives a decode sequence one key split; each doubling doubles it.
KEYS_PER_SPLIT = 128


def warmup_steps(
    *, max_num_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int
) -> list[list[ScratchSeq]]:
    """The scratch steps to run at start-up, prefill sequences first in each.

    * every prefill length class, as a fresh prompt and as an extension of
      one cached page;
    * decode at contexts of 128, 256, ... up to ``max_model_len`` tokens (one
      more key split per doubling), beside a short fresh prompt so that the
      step is a mixed one, as it is in serving (a decode-only step replays its
      captured graph);
    * the widest mixed step: the prompt beside ``max_num_seqs - 1`` short decodes.

    Every step respects the engine's limits, so some classes drop out for
    small ``max_num_tokens`` or ``max_model_len``.

    :param max_num_tokens: most tokens in one step.
    :param max_num_seqs: most sequences in one step.
    :param max_model_len: the longest sequence.
    :param page_size: tokens per page.
    :return: the steps, each a list of sequences.
    """
    steps: list[list[ScratchSeq]] = []
    lengths = sorted({min(q, max_num_tokens, max_model_len) for q in PREFILL_LENGTHS})
    for q in lengths:
        steps.append([scratch_seq(q, 0, page_size)])
        cached = min(page_size, max_model_len - q)
        if cached > 0:
            steps.append([scratch_seq(q, cached, page_size)])
    # a decode needs one cached token; the prompt beside it one token of budget
    prompt = min(PREFILL_LENGTHS[0], max_num_tokens - 1, max_model_len)
    beside = [scratch_seq(prompt, 0, page_size)] if prompt > 0 and max_num_seqs > 1 else []
    contexts = []
    length = KEYS_PER_SPLIT
    while length < max_model_len:
        contexts.append(length)
        length *= 2
    contexts.append(max_model_len)
    for context in contexts:
        if context >= 2:
            steps.append([*beside, scratch_seq(1, context - 1, page_size)])
    width = min(max_num_seqs - len(beside), max_num_tokens - (prompt if beside else 0))
    if width > 1 and max_model_len >= 2:
        steps.append([*beside, *(scratch_seq(1, 1, page_size) for _ in range(width))])
    return steps

"""How a recurrent mixer's heads and the groups they read are split over tensor-parallel ranks.

Mamba2's ``B``/``C`` groups and the gated delta rule's key heads are each
read by several heads (value heads). A rank holds a slice of the heads; it
must also hold every group its heads read, and nothing more, so that its
recurrence runs without communication.
"""

from __future__ import annotations

from backplane.core.parallel import TensorParallel, UnevenSplitError
from backplane.models.parallel import PartShard, head_shard


def group_shard(tp: TensorParallel, num_groups: int, rows: int, what: str) -> PartShard:
    """The rows of the groups that ``tp``'s rank holds: its share, or a copy of one.

    With at least as many groups as ranks the groups are split evenly (the
    heads of rank ``r`` read exactly its groups); with fewer, ranks
    ``[i * size / num_groups, (i + 1) * size / num_groups)`` each keep a copy
    of group ``i``, the one all their heads read.

    :param tp: the group of ranks.
    :param num_groups: the layer's groups.
    :param rows: rows (or channels) per group.
    :param what: what the groups are, with the config key, for the error message.
    :return: the rank's slice of the ``num_groups * rows`` rows.
    :raises UnevenSplitError: neither count divides the other (a configuration error).
    """
    if num_groups % tp.size == 0:
        return head_shard(tp, num_groups, rows, what)
    if tp.size % num_groups:
        raise UnevenSplitError(
            f"{num_groups} {what} can neither be split over nor replicated on {tp.size} "
            f"tensor-parallel ranks; choose a tensor_parallel_size that divides {num_groups} "
            "or is a multiple of it"
        )
    group = tp.rank // (tp.size // num_groups)
    return PartShard(num_groups * rows, group * rows, (group + 1) * rows)

"""Cut a traced model at its dynamic ops.

Dynamic ops are the cached ops of the selected backends (attention, SSM, MLA,
delta): they read per-step metadata and may launch shape-dependent kernels, so
they run eagerly between captured static segments. They are matched by exact
op identity (``OpOverload`` objects), never by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.passes.split_module import split_module


@dataclass
class Segment:
    """One piece of the split graph.

    :param name: the submodule's attribute name in the split module.
    :param dynamic: ``True`` for a segment holding exactly one dynamic op.
    :param op: that op, for dynamic segments.
    """

    name: str
    dynamic: bool
    op: object | None = None


def normalize_ops(ops: Iterable[object]) -> set[object]:
    """Return the ``OpOverload`` set for custom ops given as overloads, packets or CustomOpDefs."""
    result: set[object] = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            result.update(getattr(op, name) for name in op.overloads())
        elif hasattr(op, "_opoverload"):
            result.add(op._opoverload)
        else:
            result.add(op)
    return result


def node_overload(node: torch.fx.Node) -> object:
    """The op overload a ``call_function`` node runs.

    A call through the packet (``torch.ops.ns.op(...)``) runs its default
    overload, so it resolves to that overload object.
    """
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.default
    return target


def is_dynamic_node(node: torch.fx.Node, dynamic_ops: set[object]) -> bool:
    """True when ``node`` calls one of ``dynamic_ops`` (by identity of the overload)."""
    return node.op == "call_function" and node_overload(node) in dynamic_ops


def split_at_dynamic_ops(
    gm: torch.fx.GraphModule, dynamic_ops: Iterable[object]
) -> tuple[torch.fx.GraphModule, list[Segment]]:
    """Split ``gm`` so that each dynamic op sits alone in its own submodule.

    :param gm: a traced graph whose cached ops are leaf ``call_function`` nodes.
    :param dynamic_ops: the ops to split at.
    :return: the split module (calling its submodules in order) and the
        segments in execution order.
    """
    ops = normalize_ops(dynamic_ops)
    partition = 0
    assignment: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_dynamic_node(node, ops):
            partition += 1
            assignment[node] = partition
            partition += 1
        else:
            assignment[node] = partition
    split = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    segments: list[Segment] = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        calls = [n for n in sub.graph.nodes if n.op == "call_function"]
        dyn = [n for n in calls if is_dynamic_node(n, ops)]
        if dyn:
            if len(calls) != 1:
                raise RuntimeError(f"segment {node.target} mixes a dynamic op with other calls")
            segments.append(Segment(node.target, True, node_overload(dyn[0])))
        else:
            segments.append(Segment(node.target, False))
    return split, segments

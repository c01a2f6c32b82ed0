"""Repeated operators: the same operator at the same place of repeated modules (a transformer's
blocks, an MLP's layers), on the same shapes, doing the same work.

A measured profile times every node on its own, and each time carries noise (a few percent on a
quiet CPU, more on a loaded one). The solver then cuts where that noise happens to make a stage
cheap, and the launched plan pays the difference: run G's MLP `cpsat` stages measured 0.98x their
price while `uniform`'s measured 0.95x (docs/benchmarks.md). The noise of one node is not
information about where to cut. So a measured profile gives each group of repeated operators
the mean of their measured times: the group's total, and every stage's expected cost, stay what
was measured, and the noise of n measurements shrinks by about sqrt(n).

Two nodes repeat each other when they run the same operator on tensors of the same shapes, dtypes
and requires-grad flags, with parameters of the same shapes (trainable alike), at the same
occurrence of that operator inside modules of the same class whose paths differ only in their
indices (`blocks.3.attn` and `blocks.7.attn`). The requires-grad flags matter: the first layer of
a network, whose input needs no gradient, has a cheaper backward than the layers after it.
"""
from __future__ import annotations

import re

from partc.cost.table import requires_grad_tensors
from partc.graph.opgraph import OpGraph, OpNode

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _signature(graph: OpGraph, node: OpNode, occurrence: int, requires: set[str]) -> tuple:
    def tensor(name: str) -> tuple:
        spec = graph.tensor(name)
        return spec.shape, spec.dtype, spec.batch_dim, name in requires

    return (node.target, _INDEX.sub("#", node.module), node.module_type, occurrence,
            tuple(tensor(t) for t in node.inputs),
            tuple((graph.param(p).shape, graph.param(p).dtype, graph.param(p).trainable)
                  for p in node.params),
            tuple((t.shape, t.dtype, t.batch_dim) for t in node.outputs),
            node.flops, node.flops_per_sample, node.bytes_read, node.bytes_written, node.is_view)


def repeated_nodes(graph: OpGraph) -> list[tuple[str, ...]]:
    """Groups of two or more nodes that repeat each other (module docstring), each in graph
    order, the groups in the order of their first node."""
    requires = requires_grad_tensors(graph)
    seen: dict[tuple[str, str], int] = {}  # (module instance, target) -> calls so far
    groups: dict[tuple, list[str]] = {}
    for node in graph.nodes:
        key = (node.module, node.target)
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        groups.setdefault(_signature(graph, node, occurrence, requires), []).append(node.name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def pooled(values: dict[str, float], groups: list[tuple[str, ...]]) -> dict[str, float]:
    """`values` (seconds per node) with each group's nodes given the group's mean: the group's
    sum is unchanged."""
    out = dict(values)
    for names in groups:
        mean = sum(values[n] for n in names) / len(names)
        for n in names:
            out[n] = mean
    return out

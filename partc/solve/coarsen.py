"""Coarsening: OpGraph + CostTable -> BlockGraph, RaNNC's atomic and block levels.

The stage solver assigns blocks, not operators, to stages: a few hundred convex groups of nodes
small enough to balance stages finely and few enough for CP-SAT to solve quickly. Two levels:

1. Atomic groups: nodes that must never be separated are joined (union-find):
   - view/alias nodes and run-time metadata checks go with the producer of their input (a cut
     after a view would ship an alias of a tensor the previous stage already ships);
   - batch-independent nodes (weight transposes, position ids, masks built from constants) go with
     their first consumer: they cost nothing per sample and cutting after them would ship a
     constant.
   The quotient graph of these groups is then made acyclic by merging its strongly connected
   components, so every group is convex.
2. Blocks: the atomic groups, in a topological order, are merged into contiguous runs. A contiguous
   run of a topological order is convex (a path that left it and came back would have to go
   backwards in the order), and the block graph is a DAG whose edges point forward in that order.
   Runs are merged greedily until at most `max_blocks` remain. First come merges whose result
   stays within the average block time (total / max_blocks), the cut whose two sides share the
   deepest module path first: cuts inside a module (between a Linear's pieces, inside an
   attention) disappear before cuts between layers. Then, if still too many, the merge with the
   smallest combined time halved per shared module level. Blocks end up about equal in time and
   aligned with module boundaries.

docs/solver.md describes the algorithm with an example.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from partc.cost.op_classes import FREE_KINDS, held_params
from partc.cost.table import CostTable, Curve, Linear
from partc.errors import PartcError
from partc.graph.opgraph import OpGraph
from partc.options import DEFAULT_MAX_BLOCKS


class CoarsenError(PartcError):
    """Coarsening cannot produce what was asked (e.g. max_blocks < 1)."""


@dataclass(frozen=True)
class Block:
    """A convex group of OpGraph nodes, the unit the stage solver places.

    Costs are sums over the nodes, as Curves of the micro-batch size. `params` are the
    canonical names of the parameters, buffers and constants its nodes use (tied ones once).
    """

    index: int
    nodes: tuple[str, ...]  # in graph (topological) order
    modules: tuple[str, ...]  # module paths of its nodes, in order of first use
    forward: Curve
    backward: Curve
    saved: Curve
    params: tuple[str, ...]

    @property
    def module(self) -> str:
        """The innermost module containing every node of the block ('' = the root)."""
        return common_module(self.modules)


@dataclass(frozen=True)
class BlockTensor:
    """A tensor another block (or the loss) needs: produced by block `producer` (None: a graph
    input, which the first stage receives) and consumed by `consumers` (other blocks) and, when
    `is_output`, by the loss on the last stage."""

    name: str
    producer: int | None
    consumers: tuple[int, ...]
    is_output: bool
    nbytes: Linear  # per micro-batch of size m
    requires_grad: bool  # whether its gradient flows back across a cut


@dataclass(frozen=True)
class BlockGraph:
    """Blocks in a topological order; every edge goes from a lower to a higher index."""

    graph: OpGraph
    blocks: tuple[Block, ...]
    edges: tuple[tuple[int, int], ...]  # distinct (u, v), u < v
    tensors: tuple[BlockTensor, ...]
    num_atomic: int

    @property
    def is_chain(self) -> bool:
        """True when block i feeds block i+1 for every i: then only contiguous runs of blocks can
        form stages, and the exact chain DP solves the same problem as CP-SAT."""
        edges = set(self.edges)
        return all((i, i + 1) in edges for i in range(len(self.blocks) - 1))

    def block_of(self) -> dict[str, int]:
        """OpGraph node name -> block index."""
        return {n: b.index for b in self.blocks for n in b.nodes}

    def summary(self) -> dict[str, Any]:
        """Counts for reports: nodes, atomic groups, blocks, edges, whether it is a chain."""
        return {"nodes": len(self.graph.nodes), "atomic_groups": self.num_atomic,
                "blocks": len(self.blocks), "edges": len(self.edges),
                "boundary_tensors": len(self.tensors), "chain": self.is_chain}


def common_module(paths: tuple[str, ...] | list[str]) -> str:
    """Longest common module-path prefix, by whole components ('a.b' and 'a.bc' share 'a')."""
    if not paths:
        return ""
    parts = [p.split(".") if p else [] for p in paths]
    prefix = parts[0]
    for other in parts[1:]:
        n = 0
        while n < len(prefix) and n < len(other) and prefix[n] == other[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix)


def _module_depth(a: str, b: str) -> int:
    """Number of leading module-path components `a` and `b` share."""
    pa, pb = (a.split(".") if a else []), (b.split(".") if b else [])
    n = 0
    while n < len(pa) and n < len(pb) and pa[n] == pb[n]:
        n += 1
    return n


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # The lower position is the root: deterministic whatever the call order.
            if rb < ra:
                ra, rb = rb, ra
            self.parent[rb] = ra


def atomic_groups(graph: OpGraph) -> list[list[int]]:
    """Groups of node positions that must stay together, in a topological order of the groups,
    each group's positions ascending. See the module docstring for the rules."""
    nodes = graph.nodes
    position = {n.name: i for i, n in enumerate(nodes)}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in dict.fromkeys(n.inputs):
            consumers.setdefault(t, []).append(i)
    users: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for p in dict.fromkeys(graph.param(q).name for q in n.params):
            users.setdefault(p, []).append(i)
    uf = _UnionFind(len(nodes))

    def first_consumer(i: int) -> int | None:
        found = [c for t in nodes[i].outputs for c in consumers.get(t.name, ())]
        return min(found) if found else None

    def input_producer(i: int) -> int | None:
        for t in nodes[i].inputs:
            p = graph.producer(t)
            if p is not None:
                return position[p]
        return None

    for i, n in enumerate(nodes):
        if n.is_view or n.kind in FREE_KINDS:
            target = input_producer(i)
            if target is None:
                target = first_consumer(i)
        elif not n.batch_dependent:
            target = first_consumer(i)
            if target is None:
                target = input_producer(i)
            if target is None:
                # Feeds nothing and reads no tensor: a buffer update such as batch norm's
                # num_batches_tracked += 1. It belongs with the module that owns the buffer.
                target = _param_sharer(i, users, len(nodes)) if len(nodes) > 1 else None
        else:
            continue
        if target is not None:
            uf.union(i, target)
    return _acyclic_groups(graph, uf, consumers)


def _param_sharer(i: int, users: dict[str, list[int]], num_nodes: int) -> int:
    """Another node using one of node i's parameters or buffers, or else its program neighbour."""
    for others in users.values():
        if i in others:
            for j in others:
                if j != i:
                    return j
    return i + 1 if i + 1 < num_nodes else i - 1


def _acyclic_groups(graph: OpGraph, uf: _UnionFind,
                    consumers: dict[str, list[int]]) -> list[list[int]]:
    """Merge the strongly connected components of the groups' quotient graph (a group that a path
    leaves and re-enters is not convex), then order the groups topologically."""
    n = len(graph.nodes)
    while True:
        roots = sorted({uf.find(i) for i in range(n)})
        succ = _quotient_edges(graph, uf, consumers)
        components = _strongly_connected(roots, succ)
        merged = False
        for comp in components:
            if len(comp) > 1:
                merged = True
                for r in comp[1:]:
                    uf.union(comp[0], r)
        if not merged:
            break
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(uf.find(i), []).append(i)
    succ = _quotient_edges(graph, uf, consumers)
    indegree = {r: 0 for r in members}
    for _root, outs in succ.items():
        for s in outs:
            indegree[s] += 1
    # Kahn's algorithm, taking the ready group whose last node comes first in the program: the
    # order stays close to the program's (module by module), and it is deterministic.
    ready = [(members[r][-1], r) for r, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[list[int]] = []
    while ready:
        _, r = heapq.heappop(ready)
        order.append(members[r])
        for s in sorted(succ.get(r, ())):
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (members[s][-1], s))
    if len(order) != len(members):  # pragma: no cover - SCC merging guarantees a DAG
        raise AssertionError("atomic groups still have a cycle")
    return order


def _quotient_edges(graph: OpGraph, uf: _UnionFind,
                    consumers: dict[str, list[int]]) -> dict[int, set[int]]:
    succ: dict[int, set[int]] = {}
    for i, node in enumerate(graph.nodes):
        ri = uf.find(i)
        for t in node.outputs:
            for c in consumers.get(t.name, ()):
                rc = uf.find(c)
                if rc != ri:
                    succ.setdefault(ri, set()).add(rc)
    return succ


def _strongly_connected(roots: list[int], succ: dict[int, set[int]]) -> list[list[int]]:
    """Tarjan's algorithm, iterative (graphs have tens of thousands of nodes)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    components: list[list[int]] = []
    counter = 0
    for start in roots:
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                components.append(sorted(comp))
    return components


def _group_module(graph: OpGraph, group: list[int]) -> tuple[str, str]:
    """Module paths of a group's first and last priced node (what a cut before/after it splits)."""
    priced = [i for i in group if not graph.nodes[i].is_view
              and graph.nodes[i].kind not in FREE_KINDS] or group
    return graph.nodes[priced[0]].module, graph.nodes[priced[-1]].module


def coarsen(table: CostTable, max_blocks: int = DEFAULT_MAX_BLOCKS,
            microbatch_size: float | None = None) -> BlockGraph:
    """Group the table's graph into at most `max_blocks` convex blocks (module docstring).

    `microbatch_size` is the size at which times are compared when balancing (default: the
    captured batch size); blocks keep their costs as functions of the micro-batch size.
    """
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
        raise CoarsenError(f"max_blocks must be an integer >= 1, got {max_blocks!r}",
                           hint="e.g. --max-blocks 256")
    graph = table.graph
    if not graph.nodes:
        raise CoarsenError("the model's graph has no operators", hint="check the model file")
    m = float(microbatch_size or graph.batch_size)
    groups = atomic_groups(graph)
    times = [sum(table.forward_s(graph.nodes[i].name, m) + table.backward_s(graph.nodes[i].name, m)
                 for i in g) for g in groups]
    mods = [_group_module(graph, g) for g in groups]
    # Cut c sits between groups c and c+1; its depth is fixed by the two sides' modules.
    depth = [_module_depth(mods[c][1], mods[c + 1][0]) for c in range(len(groups) - 1)]
    runs = _merge_runs(times, depth, max_blocks)
    return _build_block_graph(table, groups, runs)


def _merge_runs(times: list[float], depth: list[int], max_blocks: int) -> list[tuple[int, int]]:
    """Greedy merging of adjacent runs [start, end) of groups, cheapest cut first."""
    n = len(times)
    start = list(range(n))  # run starting at i (only valid for run heads)
    end = [i + 1 for i in range(n)]
    prev = [i - 1 for i in range(n)]
    nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
    run_time = list(times)
    alive = [True] * n
    version = [0] * n
    heap: list[tuple[tuple[int, int, float], int, int, int]] = []

    target = sum(times) / max_blocks  # the average block time at the requested count

    def push(head: int) -> None:
        # The cut after run `head` (between it and the next run). Merges that keep the run
        # within the average block time come first, deepest shared module first (then the
        # smallest); the rest by time discounted by the shared depth.
        right = nxt[head]
        if right < 0:
            return
        combined = run_time[head] + run_time[right]
        d = depth[end[head] - 1]
        key = (0, -d, combined) if combined <= target else (1, 0, combined / (2.0 ** d))
        heapq.heappush(heap, (key, end[head] - 1, head, version[head]))

    for i in range(n):
        push(i)
    count = n
    while count > max_blocks and heap:
        _, _, head, ver = heapq.heappop(heap)
        if not alive[head] or ver != version[head] or nxt[head] < 0:
            continue
        right = nxt[head]
        if end[head] != start[right]:  # stale entry: the neighbour changed
            continue
        # Merge `right` into `head`.
        end[head] = end[right]
        run_time[head] += run_time[right]
        alive[right] = False
        nxt[head] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = head
        version[head] += 1
        count -= 1
        push(head)
        if prev[head] >= 0:
            version[prev[head]] += 1
            push(prev[head])
    return [(start[i], end[i]) for i in range(n) if alive[i]]


def _build_block_graph(table: CostTable, groups: list[list[int]],
                       runs: list[tuple[int, int]]) -> BlockGraph:
    graph = table.graph
    nodes = graph.nodes
    from partc.solve.memory import differentiable_tensors  # memory imports cost_model, not coarsen

    requires = differentiable_tensors(graph)
    blocks: list[Block] = []
    block_of_pos: dict[int, int] = {}
    for b, (lo, hi) in enumerate(runs):
        positions = sorted(p for g in groups[lo:hi] for p in g)
        names = tuple(nodes[p].name for p in positions)
        for p in positions:
            block_of_pos[p] = b
        fwd = [table.cost(n).forward for n in names]
        bwd = [table.cost(n).backward for n in names]
        saved = [table.cost(n).saved for n in names]
        params = dict.fromkeys(graph.param(p).name for n in names
                               for p in held_params(graph.node(n)))
        modules = dict.fromkeys(nodes[p].module for p in positions
                                if not nodes[p].is_view and nodes[p].kind not in FREE_KINDS)
        blocks.append(Block(
            index=b, nodes=names, modules=tuple(modules) or (nodes[positions[0]].module,),
            forward=Curve.total(fwd), backward=Curve.total(bwd), saved=Curve.total(saved),
            params=tuple(params)))
    position = {n.name: i for i, n in enumerate(nodes)}
    edges: set[tuple[int, int]] = set()
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.kind in FREE_KINDS:
            continue  # metadata checks read shapes only: they do not make a tensor cross a cut
        for t in dict.fromkeys(n.inputs):
            producer = graph.producer(t)
            src = block_of_pos[position[producer]] if producer is not None else None
            dst = block_of_pos[i]
            if src != dst:
                consumers.setdefault(t, [])
                if dst not in consumers[t]:
                    consumers[t].append(dst)
                if src is not None:
                    edges.add((src, dst))
    outputs = {o.tensor for o in graph.outputs}
    tensors: list[BlockTensor] = []
    for name in [t.name for t in graph.inputs] + [t.name for n in nodes for t in n.outputs]:
        if name not in consumers and name not in outputs:
            continue
        producer = graph.producer(name)
        spec = graph.tensor(name)
        if spec.batch_dim is None:
            nbytes = Linear(float(spec.nbytes), 0.0)
        else:
            nbytes = Linear(0.0, spec.nbytes / graph.batch_size)
        tensors.append(BlockTensor(
            name=name,
            producer=block_of_pos[position[producer]] if producer is not None else None,
            consumers=tuple(sorted(consumers.get(name, ()))), is_output=name in outputs,
            nbytes=nbytes, requires_grad=name in requires))
    if any(u >= v for u, v in edges):  # pragma: no cover - runs of a topological order
        raise AssertionError("block edges must point forward")
    return BlockGraph(graph=graph, blocks=tuple(blocks), edges=tuple(sorted(edges)),
                      tensors=tuple(tensors), num_atomic=len(groups))




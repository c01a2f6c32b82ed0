"""What users do today, as strategies priced by the same cost model: `uniform` and `params`.

- uniform: Megatron-LM's default. The model's repeated layers (the longest numbered child list,
  such as `bert.encoder.layer.*` or `transformer.h.*`) are split into equal runs, one per stage;
  what comes before the first layer (embeddings) goes to the first stage, what follows the last
  (final norm, head, loss) to the last. A model without repeated layers is split into runs of equal
  block counts.
- params: DeepSpeed's `partition_method="parameters"`: contiguous runs of blocks with balanced
  trainable parameter counts (the smallest possible largest stage).

Both cut the blocks' topological order, so every edge points forward. The exact contiguous DP
(`chain-dp`) is in partc.solve.strategies.chain_dp and CP-SAT (`cpsat`) in
partc.solve.strategies.cpsat.
"""
from __future__ import annotations

from partc.solve.coarsen import BlockGraph


def layer_runs(blocks: BlockGraph) -> tuple[str, list[int]] | None:
    """The model's repeated layers: (container path, layer number of every block or -1).

    The container is the module path whose numbered children hold the most blocks, e.g.
    'bert.encoder.layer' for BERT; None when the model has no numbered children."""
    counts: dict[str, set[int]] = {}
    for b in blocks.blocks:
        for container, number in _numbered_prefixes(b.module):
            counts.setdefault(container, set()).add(number)
    if not counts:
        return None
    # Most distinct layers, then the outermost container (shorter path), then by name.
    container = min(counts, key=lambda c: (-len(counts[c]), c.count("."), c))
    if len(counts[container]) < 2:
        return None
    ordered = sorted(counts[container])
    index = {num: i for i, num in enumerate(ordered)}
    layers = []
    for b in blocks.blocks:
        found = -1
        for c, number in _numbered_prefixes(b.module):
            if c == container:
                found = index[number]
                break
        layers.append(found)
    return container, layers


def _numbered_prefixes(path: str) -> list[tuple[str, int]]:
    """('a.b', 3) for every numbered component of 'a.b.3.c' (container path, number)."""
    parts = path.split(".") if path else []
    return [(".".join(parts[:i]), int(p)) for i, p in enumerate(parts) if p.isdigit() and i > 0]


def uniform_assignment(blocks: BlockGraph, num_stages: int) -> tuple[int, ...] | None:
    """Equal numbers of layers per stage (module docstring); None if there are too few."""
    n = len(blocks.blocks)
    if n < num_stages:
        return None
    runs = layer_runs(blocks)
    if runs is not None and len(set(x for x in runs[1] if x >= 0)) >= num_stages:
        layers = runs[1]
        num_layers = max(layers) + 1
        assignment = []
        current = 0
        for layer in layers:
            if layer >= 0:
                current = layer * num_stages // num_layers
            assignment.append(current)
        # Blocks after the last layer (norm, head) join the last stage.
        last_layer_block = max(i for i, layer in enumerate(layers) if layer >= 0)
        for i in range(last_layer_block + 1, n):
            assignment[i] = num_stages - 1
        result = tuple(assignment)
        if len(set(result)) == num_stages and list(result) == sorted(result):
            return result
    return tuple(i * num_stages // n for i in range(n))


def params_assignment(blocks: BlockGraph, num_stages: int) -> tuple[int, ...] | None:
    """Contiguous runs with the smallest possible largest trainable parameter count."""
    n = len(blocks.blocks)
    if n < num_stages:
        return None
    graph = blocks.graph
    seen: set[str] = set()
    counts = []
    for b in blocks.blocks:
        total = 0
        for p in b.params:
            param = graph.param(p)
            if p not in seen and param.kind == "parameter" and param.trainable:
                seen.add(p)
                total += param.numel
        counts.append(total)

    def greedy(limit: int) -> list[list[int]] | None:
        """Left-to-right runs of at most `limit` parameters; None if a block alone exceeds it."""
        runs: list[list[int]] = [[]]
        load = 0
        for i, c in enumerate(counts):
            if c > limit:
                return None
            if runs[-1] and load + c > limit:
                runs.append([])
                load = 0
            runs[-1].append(i)
            load += c
        return runs

    lo, hi = max(counts), max(sum(counts), max(counts))
    while lo < hi:  # the smallest limit that needs at most num_stages runs
        mid = (lo + hi) // 2
        runs = greedy(mid)
        if runs is not None and len(runs) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    runs = greedy(lo) or [list(range(n))]
    # Fewer runs than stages: splitting a run never raises the largest one.
    while len(runs) < num_stages:
        i = max(j for j, run in enumerate(runs) if len(run) > 1)
        runs[i:i + 1] = [runs[i][:-1], runs[i][-1:]]
    return tuple(k for k, run in enumerate(runs) for _ in run)

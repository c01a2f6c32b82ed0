"""Exact contiguous partition by dynamic programming (the `chain-dp` strategy and the test oracle).

Stages are contiguous runs of the blocks' topological order (PipeDream's and torchgpipe's
balancing, generalised to DAGs by cutting a topological order). For one rank per stage (GPipe,
1F1B) the DP is exact for StageProblem's objective J = max_d g_d + sum_k t_k under the linear
memory model: for every prefix of blocks and number of stages it keeps the Pareto front of
(max g so far, sum of t so far) labels, which is enough because J is increasing in both. On a
block graph that is a chain (block i feeds block i+1), contiguous runs are the only valid
assignments, so CP-SAT must reach exactly the DP's optimum there.

For interleaved 1F1B (virtual stages of one rank are not adjacent) the DP cannot see per-rank sums;
it then balances the virtual stages' times (min max t_k, then min sum t_k) and leaves memory and the
exact objective to the caller's evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass

from partc.solve.stage_problem import StageProblem


@dataclass(frozen=True)
class DPResult:
    """The DP's best assignment (stage per block), its objective (StageProblem.objective units)
    and how many segment evaluations it took."""

    assignment: tuple[int, ...] | None
    objective: int | None
    evaluations: int


def solve_chain_dp(problem: StageProblem, upper_bound: int | None = None) -> DPResult:
    """Optimal contiguous assignment of `problem` (module docstring). `upper_bound`: only
    solutions with an objective below it are of interest (prunes the search); None if none."""
    n = problem.num_blocks
    V = problem.shape.virtual_stages
    S = problem.shape.stages
    v = problem.shape.chunks
    M = problem.shape.num_microbatches
    exact = v == 1
    if n < V:
        return DPResult(None, None, 0)

    def prefix(values: list[int]) -> list[int]:
        out = [0]
        for x in values:
            out.append(out[-1] + x)
        return out

    comp = prefix(problem.compute)
    static = prefix(problem.static)
    temps = prefix(problem.temps)
    saved = prefix(problem.saved)
    trainable = prefix([1 if h else 0 for h in problem.has_trainable])
    sync = [prefix([problem.sync[b][d] for b in range(n)]) for d in range(S)]
    # Per cut c (between blocks c-1 and c), summed over the tensors crossing it: the transfer
    # time the stage after boundary k and the one before it pay (CrossingTensor), receive
    # memory, and the sender's memory per rank.
    xfwd = [[0] * V for _ in range(n + 1)]
    xbwd = [[0] * V for _ in range(n + 1)]
    recv = [0] * (n + 1)
    send = [[0] * S for _ in range(n + 1)]
    for t in problem.tensors:
        # Cuts producer+1 .. last needing block are crossed (cut n is the end, not a boundary).
        lo, hi = max(t.producer + 1, 1), min(t.last_block(n), n - 1)
        sends = [problem.send_units(t, d) for d in range(S)]
        for c in range(lo, hi + 1):
            frow, brow = xfwd[c], xbwd[c]
            for k in range(1, V):
                frow[k] += t.after[k]
                brow[k] += t.before[k]
            recv[c] += M * t.size
            srow = send[c]
            for d in range(S):
                srow[d] += sends[d]
    shared = problem.shared
    capacity = problem.capacity

    INF = float("inf")
    best_bound = upper_bound if upper_bound is not None else INF
    # labels[j]: Pareto front of (G, sum_t, prev_cut, prev_label) after the stages so far.
    labels: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n + 1)]
    labels[0] = [(0, 0, -1, -1)]
    history: list[list[list[tuple[int, int, int, int]]]] = []
    evaluations = 0
    rest_compute = [comp[n] - comp[j] for j in range(n + 1)]
    for k in range(V):
        d = k % S
        last = k == V - 1
        new: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n + 1)]
        j_lo, j_hi = k + 1, n - (V - 1 - k)
        for j in range(j_lo, j_hi + 1):
            if last and j != n:
                continue
            front = new[j]
            peak = 0
            for i in range(j - 1, k - 1, -1):
                peak = max(peak, problem.transient[i])
                if not labels[i]:
                    continue
                evaluations += 1
                sh_static = sh_temps = sh_sync = 0
                for p in shared:
                    if any(i <= b < j for b in p.blocks):
                        sh_static += p.static
                        sh_temps += p.temps
                        sh_sync += p.sync[d]
                st = static[j] - static[i] + sh_static
                if exact:
                    act = problem.activation_units(d, saved[j] - saved[i]) + (
                        problem.loss_units(d) if last else 0)
                    fixed_mem = st + max(act + peak, temps[j] - temps[i] + sh_temps) \
                        + problem.corrections[d]
                    if fixed_mem > capacity:
                        break  # only grows as the segment grows
                    mem = fixed_mem + (recv[i] if k > 0 else problem.inputs) \
                        + (send[j][d] if not last else 0) + problem.host_data[d]
                    if mem > capacity:
                        continue
                elif st > capacity:
                    break
                t_k = problem.stage_fixed[k] + comp[j] - comp[i] + (xfwd[i][k] if k > 0 else 0) \
                    + (xbwd[j][k + 1] if not last else 0)
                if exact:
                    has = trainable[j] - trainable[i] > 0
                    g = (M - 1) * t_k + sync[d][j] - sync[d][i] + sh_sync \
                        + (problem.sync_latency[d] if has else 0)
                else:
                    g = t_k
                for li, (G, total, _, _) in enumerate(labels[i]):
                    G2 = G if G >= g else g
                    total2 = total + t_k
                    if G2 + total2 + rest_compute[j] >= best_bound:
                        continue
                    _insert(front, (G2, total2, i, li))
        history.append(labels)
        labels = new
    final = labels[n]
    if not final:
        return DPResult(None, None, evaluations)
    G, total, i, li = min(final, key=lambda lab: (lab[0] + lab[1], lab[0], lab[2], lab[3]))
    # Walk back through the layers.
    cuts = [n]
    layer = V - 1
    while layer > 0:
        cuts.append(i)
        _, _, i, li = history[layer][i][li]
        layer -= 1
    cuts.append(0)
    cuts.reverse()
    assignment = [0] * n
    for k in range(V):
        for b in range(cuts[k], cuts[k + 1]):
            assignment[b] = k
    result = tuple(assignment)
    return DPResult(result, problem.objective(result), evaluations)


def _insert(front: list[tuple[int, int, int, int]], label: tuple[int, int, int, int]) -> None:
    """Add `label` to a Pareto front of (G, total) unless dominated; drop what it dominates.
    Ties keep the earlier label (the first found in the fixed loop order: deterministic)."""
    G, total = label[0], label[1]
    keep = []
    for other in front:
        if other[0] <= G and other[1] <= total:
            return
        if not (G <= other[0] and total <= other[1]):
            keep.append(other)
    keep.append(label)
    front[:] = keep

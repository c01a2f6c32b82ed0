"""Stage assignment as a CP-SAT program (OR-Tools), the `cpsat` strategy.

Ladder (order) encoding, which solved our probe instances to optimality where the one-hot
encoding stalled (toolchain-probe section 6): y[b][k] = [stage(b) >= k] for k = 1..V-1, with
y[b][k+1] -> y[b][k]; block b is on stage k iff y[b][k] - y[b][k+1] = 1 (a linear expression).

- Precedence: for every block edge u -> v and every k, y[u][k] -> y[v][k] (stage(u) <= stage(v));
  this holds for DAGs, not only chains.
- Every stage non-empty.
- Crossings: z[t][k] >= y[c][k] - y[p][k] for every consumer c of tensor t produced by p (graph
  inputs: p is on stage 0; graph outputs: a consumer on the last stage); minimisation makes z the
  indicator that t crosses boundary k (relayed through intermediate stages).
- Shared parameters: h[p][d] >= [a block using p is on rank d]; has[d] likewise for trainables.
- Objective and memory: exactly StageProblem.objective and StageProblem.rank_memory, so a CP-SAT
  optimum and the chain DP's optimum are comparable number for number.

Deterministic: fixed seed, `interleave_search` (deterministic whatever the worker count) and a
deterministic-time limit instead of a wall-clock one, so the same inputs give the same plan.

Interruptible: CP-SAT never touches SIGINT (`catch_sigint_signal` off: by default it catches
Ctrl-C during a solve and leaves SIG_DFL installed afterwards, so a later Ctrl-C killed partc
outright); the solve runs in a worker thread and Ctrl-C stops it at once (`_run_solver`).
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeAlias

from ortools.sat.python import cp_model, cp_model_helper

from partc.solve.stage_problem import StageProblem

# A 0-1 variable, or a constant where the encoding fixes one (the ladder's ends y[b][0] = 1 and
# y[b][V] = 0; no crossing of boundary 0).
Lit: TypeAlias = "cp_model.IntVar | int"
# A linear expression over the model's variables, or a constant (a sum over no variables).
Expr: TypeAlias = "cp_model.LinearExpr | int"


@dataclass(frozen=True)
class CpSatResult:
    """What CP-SAT returned for one shape: status name, best assignment (stage per block) and its
    objective, the proven lower bound (StageProblem.objective units), and the wall time."""

    status: str  # "OPTIMAL" | "FEASIBLE" | "INFEASIBLE" | "UNKNOWN" | "MODEL_INVALID"
    assignment: tuple[int, ...] | None
    objective: int | None
    bound: int | None
    wall_s: float
    deterministic_time: float

    @property
    def gap(self) -> float | None:
        """(objective - bound) / objective; 0 when proven optimal."""
        if self.objective is None or self.bound is None:
            return None
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


def solve_cpsat(problem: StageProblem, time_limit_s: float = 10.0, workers: int = 2,
                seed: int = 0, hints: Sequence[Sequence[int]] = ()) -> CpSatResult:
    """Optimise `problem` with CP-SAT. `time_limit_s` is in CP-SAT's deterministic seconds
    (about wall seconds on one core); `hints` are known assignments (e.g. the chain DP's): the
    best valid one seeds the search, so the result is never worse than it."""
    model, y, objective = _build(problem)
    n = problem.num_blocks
    V = problem.shape.virtual_stages
    valid_hints = [tuple(h) for h in hints if problem.valid(h) and problem.fits(h)]
    if valid_hints:
        best = min(valid_hints, key=problem.objective)
        for b in range(n):
            for k in range(1, V):
                var = y[b][k]
                assert isinstance(var, cp_model.IntVar)  # only the ends k = 0, V are constants
                model.add_hint(var, best[b] >= k)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = max(2, workers)
    params.interleave_search = True
    params.random_seed = seed
    params.max_deterministic_time = time_limit_s
    params.log_search_progress = False
    params.catch_sigint_signal = False  # Python's handler stays in charge of Ctrl-C
    start = time.perf_counter()
    status = _run_solver(solver, model)
    wall = time.perf_counter() - start
    name = solver.status_name(status)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assignment = tuple(sum(int(solver.boolean_value(y[b][k])) for k in range(1, V))
                           for b in range(n))
        value = problem.objective(assignment)
        bound = int(round(solver.best_objective_bound))
        result = CpSatResult(name, assignment, value, min(bound, value), wall,
                             solver.deterministic_time)
    else:
        bound = None
        if status == cp_model.UNKNOWN:
            bound = int(round(solver.best_objective_bound))
        result = CpSatResult(name, None, None, bound, wall, solver.deterministic_time)
    # The hint is a valid solution of the same model; keep it if CP-SAT ran out of time before
    # getting back to it.
    if valid_hints:
        best = min(valid_hints, key=problem.objective)
        if result.objective is None or problem.objective(best) < result.objective:
            bound = result.bound
            result = CpSatResult("FEASIBLE", best, problem.objective(best),
                                 None if bound is None else min(bound, problem.objective(best)),
                                 wall, result.deterministic_time)
    return result


# How often the waiting thread checks on the solve (a signal interrupts its wait at once).
_POLL_S = 0.05


def _run_solver(solver: cp_model.CpSolver,
                model: cp_model.CpModel) -> cp_model_helper.CpSolverStatus:
    """`solver.solve(model)`, interruptible by Ctrl-C (or SIGTERM turned into an exception).

    The solve runs in a worker thread (the binding releases the GIL), while this thread waits in
    short steps, so a KeyboardInterrupt is raised here at once: it stops the search
    (`stop_search`, repeated until the solve returns, since a stop asked before the solve has
    begun is a no-op), waits for the worker and propagates. The answer is the same as a direct
    `solver.solve(model)`: the parameters (seed, workers, deterministic time) decide it, not the
    thread. (Waiting on an Event, not on `Thread.join`: an interrupted join marks a running
    thread as stopped in Python 3.11, and the interpreter would then exit under CP-SAT.)

    Afterwards Python's own SIGINT handler is installed again at the OS level, in case a native
    library replaced it (CP-SAT does when `catch_sigint_signal` is on).
    """
    in_main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if in_main else None
    done = threading.Event()
    statuses: list[cp_model_helper.CpSolverStatus] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            statuses.append(solver.solve(model))
        except BaseException as exc:  # handed to the waiting thread
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=work, name="partc-cpsat", daemon=True)
    try:
        worker.start()
        try:
            while not done.wait(_POLL_S):
                pass
        except BaseException:  # KeyboardInterrupt, or what a signal handler raised
            _stop(solver, done)
            raise
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
    if errors:
        raise errors[0]
    return statuses[0]


def _stop(solver: cp_model.CpSolver, done: threading.Event) -> None:
    """Stop a running solve and wait until it has returned (milliseconds)."""
    while not done.is_set():
        try:
            solver.stop_search()
            done.wait(_POLL_S)
        except KeyboardInterrupt:  # another Ctrl-C: the search is stopping already
            continue


def _build(problem: StageProblem) -> tuple[cp_model.CpModel, list[list[Lit]], cp_model.LinearExpr]:
    shape = problem.shape
    n = problem.num_blocks
    S, V, v, M = shape.stages, shape.virtual_stages, shape.chunks, shape.num_microbatches
    model = cp_model.CpModel()
    one = 1
    # y[b][0] = 1 and y[b][V] = 0 are constants.
    y: list[list[Lit]] = []
    for b in range(n):
        row: list[Lit] = [one] + [model.new_bool_var(f"y{b}_{k}") for k in range(1, V)] + [0]
        y.append(row)
        for k in range(1, V - 1):
            model.add_implication(row[k + 1], row[k])
    for u, w in problem.blocks.edges:
        for k in range(1, V):
            model.add_implication(y[u][k], y[w][k])

    def x(b: int, k: int) -> Expr:  # block b on virtual stage k
        return y[b][k] - y[b][k + 1]

    def on_rank(b: int, d: int) -> Expr:  # block b on rank d (any of its virtual stages)
        return sum(x(b, k) for k in range(d, V, S))

    for k in range(V):
        model.add(sum(x(b, k) for b in range(n)) >= 1)
    # Crossing indicators.
    cross: list[list[Lit]] = []
    for t in problem.tensors:
        row = [0]  # no boundary 0: nothing crosses into stage 0
        for k in range(1, V):
            z = model.new_bool_var(f"z{t.name}_{k}")
            prod = 0 if t.producer < 0 else y[t.producer][k]
            for c in t.consumers:
                model.add(z >= y[c][k] - prod)
            if t.is_output:
                model.add(z >= 1 - prod)
            row.append(z)
        cross.append(row)

    # Times.
    stage_t = []
    for k in range(V):
        expr = problem.stage_fixed[k] + sum(problem.compute[b] * x(b, k) for b in range(n)
                                            if problem.compute[b])
        for t, row in zip(problem.tensors, cross, strict=True):
            if k >= 1 and t.after[k]:
                expr += t.after[k] * row[k]
            if k + 1 < V and t.before[k + 1]:
                expr += t.before[k + 1] * row[k + 1]
        stage_t.append(expr)
    total_t = sum(stage_t)
    horizon = (M + 1) * (sum(problem.compute) + sum((max(t.after) + max(t.before)) * V
                                                      for t in problem.tensors)) * v + 1
    sync_total = sum(max(row) for row in problem.sync) + sum(
        max(p.sync) for p in problem.shared) + max(problem.sync_latency, default=0)
    horizon += (M + 1) * v * sync_total
    G = model.new_int_var(0, horizon, "G")
    T_max = model.new_int_var(0, horizon, "T_max") if v > 1 else None
    held = {(p.name, d): model.new_bool_var(f"h{p.name}_{d}") for p in problem.shared
            for d in range(S)}
    for p in problem.shared:
        for d in range(S):
            for b in p.blocks:
                model.add(held[p.name, d] >= on_rank(b, d))
    for d in range(S):
        T_d = sum(stage_t[k] for k in range(d, V, S))
        sync = sum(problem.sync[b][d] * on_rank(b, d) for b in range(n) if problem.sync[b][d])
        sync += sum(p.sync[d] * held[p.name, d] for p in problem.shared if p.sync[d])
        if problem.sync_latency[d]:
            has = model.new_bool_var(f"has{d}")
            for b in range(n):
                if problem.has_trainable[b]:
                    model.add(has >= on_rank(b, d))
            sync += problem.sync_latency[d] * has
        model.add(G >= (M - 1) * T_d + sync)
        if T_max is not None:
            model.add(T_max >= T_d)
        _add_memory(model, problem, d, on_rank, cross, held)
    objective = v * G + total_t + ((v - 1) * T_max if T_max is not None else 0)
    model.minimize(objective)
    return model, y, objective


def _add_memory(model: cp_model.CpModel, problem: StageProblem, d: int,
                on_rank: Callable[[int, int], Expr], cross: list[list[Lit]],
                held: dict[tuple[str, int], cp_model.IntVar]) -> None:
    """rank_memory(d) <= capacity, term by term as StageProblem.rank_memory computes it."""
    shape = problem.shape
    n = problem.num_blocks
    S, V, M = shape.stages, shape.virtual_stages, shape.num_microbatches
    cap = problem.capacity
    static = sum(problem.static[b] * on_rank(b, d) for b in range(n) if problem.static[b])
    static += sum(p.static * held[p.name, d] for p in problem.shared if p.static)
    temps = sum(problem.temps[b] * on_rank(b, d) for b in range(n) if problem.temps[b])
    temps += sum(p.temps * held[p.name, d] for p in problem.shared if p.temps)
    comm: Expr = (problem.inputs if d == 0 else 0) + problem.host_data[d]
    for t, row in zip(problem.tensors, cross, strict=True):
        for k in range(1, V):
            if k % S == d and t.size:
                comm += M * t.size * row[k]
            if (k - 1) % S == d:
                units = problem.send_units(t, d)
                if units:
                    comm += units * row[k]
    saved = sum(problem.saved[b] * on_rank(b, d) for b in range(n) if problem.saved[b])
    # act >= ceil(coef * saved), coef = in_flight / chunks (a rational with denominator chunks).
    v = shape.chunks
    coef_num = int(round(problem.activation_coef[d] * v))
    act = model.new_int_var(0, cap + 1, f"act{d}")
    model.add(v * act >= coef_num * saved)
    if (V - 1) % S == d:
        act_total = act + problem.loss_units(d)
    else:
        act_total = act
    peak = model.new_int_var(0, max(problem.transient, default=0), f"peak{d}")
    for b in range(n):
        if problem.transient[b]:
            model.add(peak >= problem.transient[b] * on_rank(b, d))
    extra = model.new_int_var(0, 2 * cap + max(problem.transient, default=0) + problem.loss + 2,
                              f"extra{d}")
    model.add(extra >= act_total + peak)
    model.add(extra >= temps)
    model.add(static + comm + extra + problem.corrections[d] <= cap)

"""`partc show`: a plan as a terminal summary, a PNG report and a self-contained HTML page.

Everything comes from plan.yaml alone (no model, no stage file is loaded): the schedule is
replayed with partc.solve.simulator from the per-stage times and transfers and the per-rank sync
times the plan records (`Plan.pipeline_spec`), so the Gantt chart shows exactly the iteration the
solver predicted.

The PNG has three panels: the simulated schedule (pipeline ranks x time; forward and backward of
every micro-batch, the gradient all-reduce and optimizer step, idle time hatched as bubbles),
per-rank memory by kind against the usable device memory, and per-stage forward/backward/transfer
time per micro-batch.

With the metrics of a run of the plan (`partc launch --metrics`, partc.plans.run_metrics) the
summary adds a table of measured vs predicted times and memory per stage (`format_measured`, which
launch also prints at the end of a run), and the picture draws measured bars beside the predicted
ones in the memory and time panels.
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

from partc.files import write_atomic
from partc.options import SHARDED_STATE
from partc.plans.plan import Plan, format_plan, stage_levers_text
from partc.plans.run_metrics import RunMetrics
from partc.solve.partition import spread_clause
from partc.solve.simulator import Simulation, simulate

# One colour per kind of work; micro-batches alternate between two shades of it.
_COLOURS = {"forward": ("#4C78A8", "#72A0CF"), "backward": ("#E45756", "#F08A89"),
            "allreduce": ("#54A24B", "#54A24B"), "tied": ("#EECA3B", "#EECA3B"),
            "optimizer": ("#B279A2", "#B279A2")}
_IDLE = "#B8B8B8"
_MEMORY_KINDS = (("parameters", "parameters", "#4C78A8"), ("gradients", "gradients", "#F58518"),
                 ("optimizer_state", "optimizer state", "#B279A2"),
                 ("activations", "activations", "#E45756"),
                 ("recompute", "recompute", "#FF9DA6"), ("workspace", "workspace", "#9D755D"),
                 ("communication", "communication", "#BAB0AC"))


def replay(plan: Plan) -> Simulation:
    """The plan's predicted iteration, re-simulated from plan.yaml."""
    return simulate(plan.pipeline_spec())


def replay_measured(plan: Plan, metrics: RunMetrics) -> Simulation | None:
    """The plan's schedule re-simulated with a run's own per-stage forward and backward times
    and per-rank optimizer steps (medians over its timed steps) in place of the predicted ones:
    what the schedule and transfer model predicts once the stage costs are right, so a gap
    between the run and the prediction splits into the stage costs' part and the rest.

    Where ranks share a core, a stage's wall time includes its core-mates' turns, which the
    simulation shares out again: there the replay takes the computations' CPU times (the work
    itself), and is None for a run that has none (CUDA, metrics of earlier partc versions).
    RunMetricsError if the run cannot be one of the plan (`RunMetrics.check_shape`)."""
    metrics.check_shape(plan)
    spec = plan.pipeline_spec()
    stages = metrics.stage_summaries()
    posts = plan.p2p_posts_priced()
    work = [w for m in stages
            if (w := m.compute_s(spec.shares_cores, posts[m.index])) is not None]
    if len(work) < len(stages):
        return None
    optimizer = [0.0] * spec.num_ranks
    for m, (_, _, opt) in zip(stages, work, strict=True):
        optimizer[m.pipeline_rank] += opt
    return simulate(replace(
        spec, stages=tuple(replace(t, forward_s=fwd, backward_s=bwd)
                           for t, (fwd, bwd, _) in zip(spec.stages, work, strict=True)),
        optimizer_s=tuple(optimizer)))


def _memory_unit(plan: Plan) -> tuple[str, int]:
    """GiB when the fullest device holds a GiB or more, else MiB: (name, bytes per unit)."""
    big = max((m.total for m in plan.predicted.memory), default=0) >= 2**30
    return ("GiB", 2**30) if big else ("MiB", 2**20)


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f}"


def format_summary(plan: Plan, metrics: RunMetrics | None = None) -> str:
    """The terminal summary: the compile table, then memory per rank by kind and the schedule's
    busy/idle time per rank; with a run's `metrics`, measured vs predicted (`format_measured`)."""
    sim = replay(plan)
    lines = [format_plan(plan)]
    usable = plan.predicted.usable_memory_bytes
    memory = plan.predicted.memory
    unit, div = _memory_unit(plan)
    lines.append("")
    lines.append(f"memory per device ({unit}; usable {usable / div:,.1f} of "
                 f"{plan.cluster.device.memory_bytes / div:,.1f}):")
    short = {"optimizer_state": "optimizer", "communication": "comm"}
    kinds = [k for k, _, _ in _MEMORY_KINDS]
    lines.append(f"{'rank':>4} " + " ".join(f"{short.get(k, k):>11}" for k in kinds)
                 + f" {'total':>9} {'of usable':>9} {'levers save':>11}")
    for rank, mem in enumerate(memory):
        saved = plan.predicted.lever_savings(rank)
        lines.append(f"{rank:>4} " + " ".join(f"{getattr(mem, k) / div:>11,.2f}" for k in kinds)
                     + f" {mem.total / div:>9,.2f} {mem.total / usable if usable else 0:>9.1%}"
                     + f" {saved / div:>11,.2f}")
    lines.append("")
    span = sim.last_backward_s
    shape = plan.training.shape
    lines.append(f"schedule ({shape.schedule}, {shape.num_microbatches} "
                 f"micro-batches): forward/backward span {span * 1e3:.3f} ms, iteration "
                 f"{sim.iteration_s * 1e3:.3f} ms")
    for rank, busy in enumerate(sim.busy_s):
        idle = max(span - busy, 0.0)
        lines.append(f"  rank {rank}: busy {busy * 1e3:.3f} ms, idle {idle * 1e3:.3f} ms "
                     f"({idle / span if span else 0:.1%})")
    if metrics is not None:
        lines.append("")
        lines.append(format_measured(plan, metrics))
    return "\n".join(lines)


def predicted_transfer_s(plan: Plan, k: int) -> float:
    """Predicted p2p time of stage k per step: every micro-batch's transfers into and out of it
    (its own sends, its predecessor's forward send and its successor's backward send)."""
    stages, M = plan.stages, plan.training.shape.num_microbatches
    own = stages[k].send_forward_s + stages[k].send_backward_s
    before = stages[k - 1].send_forward_s if k > 0 else 0.0
    after = stages[k + 1].send_backward_s if k + 1 < len(stages) else 0.0
    return M * (own + before + after)


def _tied_span_s(plan: Plan) -> list[float]:
    """Per rank, the simulated time from its arrival at the tied-gradient sums to their end
    (waiting for the other ranks included, as launch measures it)."""
    span = [0.0] * plan.training.shape.stages
    if plan.predicted.tied_sync:
        for e in simulate(plan.pipeline_spec()).events:
            if e.kind == "tied":
                span[e.rank] += e.end_s - e.start_s
    return span


def format_measured(plan: Plan, metrics: RunMetrics) -> str:
    """Measured (a run's medians, `RunMetrics.stage_summaries`) vs predicted per stage, and the
    iteration. RunMetricsError if the run cannot be one of the plan (`RunMetrics.check_shape`:
    another stage count, micro-batch count, replica count, stage placement or device kind)."""
    metrics.check_shape(plan)
    p = plan.predicted
    timed = metrics.timed_steps()
    step = metrics.median_step_s()
    samples = plan.training.global_batch_size
    unit, div = _memory_unit(plan)
    first, last = timed[0].step, timed[-1].step
    lines = [f"measured ({len(metrics.steps)} step(s); medians over step(s) {first}..{last}; "
             f"each stage at the slowest of its replicas) vs predicted:",
             f"iteration {step * 1e3:.1f} ms (median), {samples / step:,.1f} samples/s; "
             f"predicted {p.iteration_s * 1e3:.1f} ms, {p.samples_per_s:,.1f} samples/s "
             f"({step / p.iteration_s if p.iteration_s else 0:.2f}x)"]
    if p.speed_modes and p.iteration_s:
        # an expectation over the devices' speed spread: the mean step is what it predicts
        mean = metrics.mean_step_s()
        lines.append(f"mean step {mean * 1e3:.1f} ms ({mean / p.iteration_s:.2f}x the predicted "
                     f"expectation over {spread_clause(p.speed_spread_source)})")
    if not metrics.strictly_timed_steps():
        # the fallback of timed_steps: say so, or a warm-up's lazy allocations and a profiler's
        # slowdown read as the plan's prediction being that far off
        lines.append("NOT TIMED: every step of this run is its warm-up (step 1) or profiled, "
                     "slower than training, and these medians include them (launch with more "
                     "--steps to time the plan)")
    shared = plan.pipeline_spec().shares_cores
    summaries = metrics.stage_summaries()
    replayed = replay_measured(plan, metrics)
    if replayed is not None and replayed.iteration_s > 0:
        what = "CPU times" if shared else "times"
        lines.append(f"schedule replayed with this run's stage {what}: "
                     f"{replayed.iteration_s * 1e3:.1f} ms (run/replay "
                     f"{step / replayed.iteration_s:.2f}x; the rest of the gap to the "
                     "prediction is the stage costs)")
    header = (f"{'stage':>5} {'rank':>4} | {'fwd ms':>8} {'pred':>8} | {'bwd ms':>8} "
              f"{'pred':>8} | {'p2p ms':>8} {'pred':>8} | {'opt ms':>8} {'pred':>8} | "
              f"{'sync ms':>8} {'pred':>8} | {'peak ' + unit:>9} {'pred':>9}")
    lines.append(header)
    tied = _tied_span_s(plan)
    for m in summaries:
        st = plan.stages[m.index]
        r = st.rank
        peak = "-" if m.peak_memory_bytes is None else f"{m.peak_memory_bytes / div:,.1f}"
        # the memory model's peak of the rank (what the plan promises to fit), not the
        # simulator's timeline, which leaves out communication buffers and workspace
        pred_peak = p.memory[r].total if r < len(p.memory) else 0
        lines.append(
            f"{m.index:>5} {r:>4} | {m.forward_s * 1e3:>8.3f} {st.forward_s * 1e3:>8.3f} | "
            f"{m.backward_s * 1e3:>8.3f} {st.backward_s * 1e3:>8.3f} | "
            f"{m.p2p_s * 1e3:>8.3f} {predicted_transfer_s(plan, m.index) * 1e3:>8.3f} | "
            f"{m.optimizer_s * 1e3:>8.3f} {_at(p.optimizer_s, r) * 1e3:>8.3f} | "
            f"{(m.ddp_allreduce_s + m.tied_sync_s) * 1e3:>8.3f} "
            f"{(_at(p.allreduce_s, r) + tied[r]) * 1e3:>8.3f} | {peak:>9} "
            f"{pred_peak / div:>9,.1f}")
    work = [(m.index, w) for m in summaries if (w := m.compute_s(shared_core=True)) is not None]
    if shared and len(work) == len(summaries):
        # wall times on shared cores include the core-mates' turns; the prediction's are the
        # work alone, which the simulator shares out
        lines.append("CPU ms per micro-batch (fwd/bwd; processes share cores, so the wall "
                     "times above include core-mates' turns): " + ", ".join(
                         f"stage {k} {fwd * 1e3:.3f}/{bwd * 1e3:.3f}"
                         for k, (fwd, bwd, _) in work))
    lines.append("fwd/bwd: per micro-batch; p2p, opt(imizer) and (gradient) sync: per step. "
                 "Measured p2p is posting and waiting, so it includes waiting for the neighbour "
                 "stages (bubbles); predicted is the transfers alone. p2p, tied sync and peak "
                 f"memory are the pipeline rank's. Peak memory: {metrics.memory_method}.")
    return "\n".join(lines)


def _at(values: tuple[float, ...], rank: int) -> float:
    return values[rank] if rank < len(values) else 0.0


# ---- the picture ------------------------------------------------------------------------------

def _title(plan: Plan) -> str:
    s, p, c = plan.training.shape, plan.predicted, plan.cluster
    virtual = f" x {s.chunks} virtual" if s.chunks > 1 else ""
    levers = levers_summary(plan)
    return (f"{plan.model.name}: {s.stages} stages x {s.replicas} replicas{virtual}, "
            f"{s.schedule}, {s.num_microbatches} micro-batches of {s.microbatch_size}"
            + (f"; {levers}" if levers else "")
            + f" on {s.num_devices} x {c.device.name} ({c.name})\n"
            f"predicted {p.iteration_s * 1e3:.2f} ms/iteration, "
            f"{p.samples_per_s:,.1f} samples/s, bubble {p.bubble_fraction:.1%}")


def levers_summary(plan: Plan) -> str:
    """Which stages use which memory lever: "checkpointing on stage 1; optimizer state sharded
    on stages 0, 1", or "" when none does."""
    parts = []
    ckpt = [st.index for st in plan.stages if st.activation_checkpointing]
    if ckpt:
        parts.append(f"checkpointing on stage{'s' if len(ckpt) > 1 else ''} "
                     f"{', '.join(map(str, ckpt))}")
    for kind in sorted({st.sharding for st in plan.stages} - {"none"}):
        sharded = [st.index for st in plan.stages if st.sharding == kind]
        parts.append(f"{SHARDED_STATE[kind]} sharded on stage{'s' if len(sharded) > 1 else ''} "
                     f"{', '.join(map(str, sharded))}")
    return "; ".join(parts)


def _recomputes(plan: Plan) -> bool:
    return any(st.activation_checkpointing for st in plan.stages)


def _rank_label(plan: Plan, rank: int) -> str:
    stages = [s for s in plan.stages if s.rank == rank]
    devices = stages[0].devices if stages else ()
    dev = ",".join(map(str, devices[:4])) + ("…" if len(devices) > 4 else "")
    return f"rank {rank}\nstage {','.join(str(s.index) for s in stages)}\ndev {dev}"


def _draw_schedule(ax: Any, plan: Plan, sim: Simulation) -> None:
    from matplotlib.patches import Patch

    ranks = sim.num_ranks
    span = sim.iteration_s or 1.0
    scale = 1e3  # ms
    height = 0.8
    chunks = max(sim.chunks, 1)
    for rank in range(ranks):
        y = ranks - 1 - rank
        # Idle time inside the forward/backward span is the pipeline bubble.
        busy = sorted((e.start_s, e.end_s) for e in sim.events
                      if e.rank == rank and e.kind in ("forward", "backward"))
        cursor = 0.0
        idle = []
        for start, end in busy + [(sim.last_backward_s, sim.last_backward_s)]:
            if start > cursor + 1e-12:
                idle.append((cursor * scale, (start - cursor) * scale))
            cursor = max(cursor, end)
        if idle:
            ax.broken_barh(idle, (y - height / 2, height), facecolors="white",
                           edgecolor=_IDLE, hatch="///", linewidth=0)
    # one collection per rank and colour, not one per event: a plan of 65536 micro-batches
    # draws in seconds
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in sim.events:
        shade = _COLOURS[e.kind][e.microbatch % 2 if e.microbatch >= 0 else 0]
        bars.setdefault((e.rank, shade), []).append((e.start_s * scale,
                                                     (e.end_s - e.start_s) * scale))
    for (rank, shade), ranges in bars.items():
        ax.broken_barh(ranges, (ranks - 1 - rank - height / 2, height), facecolors=shade,
                       edgecolor="white", linewidth=0.6)
    for e in sim.events:
        y = ranks - 1 - e.rank
        if e.kind in ("forward", "backward"):
            chunk = e.stage // ranks if chunks > 1 else 0
            label = f"{e.microbatch}" + (f"·v{chunk}" if chunks > 1 else "")
            if e.end_s - e.start_s < span * (0.004 + 0.0065 * len(label)):
                continue  # too narrow to read
            ax.text((e.start_s + e.end_s) / 2 * scale, y, label, ha="center", va="center",
                    fontsize=6.5, color="white")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([_rank_label(plan, r) for r in reversed(range(ranks))], fontsize=8)
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_xlim(0, span * scale * 1.01)
    ax.set_xlabel("time in one training iteration (ms); numbers are micro-batches")
    ax.set_title("simulated schedule (every replica runs the same)", fontsize=10, loc="left")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    labels = {"forward": "forward", "backward": "backward" + (
        " (with recompute)" if _recomputes(plan) else ""),
        "allreduce": "gradient all-reduce", "tied": "tied-gradient sum (waits for the others)",
        "optimizer": "optimizer step"}
    present = {e.kind for e in sim.events if e.end_s > e.start_s}
    handles = [Patch(facecolor=_COLOURS[k][0], label=text) for k, text in labels.items()
               if k in present]
    handles.append(Patch(facecolor="white", edgecolor=_IDLE, hatch="///", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=len(handles), fontsize=8, frameon=False)


def _measured_peaks(plan: Plan, metrics: RunMetrics) -> list[float | None]:
    """Measured peak bytes per pipeline rank (the run's median), None where not measured."""
    peaks: list[float | None] = [None] * len(plan.predicted.memory)
    for m in metrics.stage_summaries():
        r = plan.stages[m.index].rank
        if m.peak_memory_bytes is not None and r < len(peaks):
            peaks[r] = max(peaks[r] or 0.0, float(m.peak_memory_bytes))
    return peaks


def _draw_memory(ax: Any, plan: Plan, metrics: RunMetrics | None = None) -> None:
    memory = plan.predicted.memory
    usable = plan.predicted.usable_memory_bytes
    device = plan.cluster.device.memory_bytes
    ranks = list(range(len(memory)))
    unit, div = _memory_unit(plan)
    # with a run: predicted (stacked by kind) on the left of each rank, measured on the right
    width, shift = (0.6, 0.0) if metrics is None else (0.36, -0.2)
    xs = [r + shift for r in ranks]
    bottom = [0.0] * len(memory)
    for key, label, colour in _MEMORY_KINDS:
        values = [getattr(m, key) / div for m in memory]
        if any(values):
            ax.bar(xs, values, bottom=bottom, color=colour, label=label, width=width)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    top = max(bottom) if bottom else 0.0
    for x, total in zip(xs, bottom, strict=True):
        ax.text(x, total, f"{total:.1f}\n{total * div / usable:.1%}" if usable else "",
                ha="center", va="bottom", fontsize=7)
    if metrics is not None:
        peaks = _measured_peaks(plan, metrics)
        values = [(v or 0.0) / div for v in peaks]
        ax.bar([r + 0.2 for r in ranks], values, width=width, color="white",
               edgecolor="black", hatch="..", label=f"measured peak ({metrics.memory_method})")
        for rank, v, raw in zip(ranks, values, peaks, strict=True):
            ax.text(rank + 0.2, v, "n/a" if raw is None else f"{v:.1f}", ha="center",
                    va="bottom", fontsize=7)
        top = max([top, *values])
    limit = usable / div
    if limit <= top * 3:  # the limit is in view: draw it
        ax.axhline(limit, color="black", linestyle="--", linewidth=1)
        ax.text(len(ranks) - 0.5, limit, f" usable {limit:,.1f} {unit} (device "
                f"{device / div:,.1f})", va="bottom", ha="right", fontsize=8)
        ax.set_ylim(0, max(top, limit) * 1.18)
    else:
        ax.set_ylim(0, top * 1.35 if top else 1)
        ax.text(0.99, 0.97, f"usable {limit:,.1f} {unit} per device is off the scale\n"
                f"(the fullest device uses {top / limit:.1%} of it)", transform=ax.transAxes,
                ha="right", va="top", fontsize=8)
    ax.set_xticks(ranks)
    ax.set_xticklabels([f"rank {r}" for r in ranks], fontsize=8)
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(f"peak memory per device (labels: {unit}, share of usable)"
                 + ("; right: measured" if metrics is not None else ""), fontsize=10,
                 loc="left")
    ax.legend(fontsize=7, loc="upper left", ncol=2, frameon=False)


def _draw_times(ax: Any, plan: Plan, metrics: RunMetrics | None = None) -> None:
    stages = list(plan.stages)
    # with a run: predicted on the left of each stage, measured (hatched) on the right
    width, shift = (0.6, 0.0) if metrics is None else (0.36, -0.2)
    xs = [k + shift for k in range(len(stages))]
    fwd = [s.forward_s * 1e3 for s in stages]
    bwd = [s.backward_s * 1e3 for s in stages]
    send = [(s.send_forward_s + s.send_backward_s) * 1e3 for s in stages]
    ax.bar(xs, fwd, color=_COLOURS["forward"][0], width=width, label="forward")
    ax.bar(xs, bwd, bottom=fwd, color=_COLOURS["backward"][0], width=width,
           label="backward" + (" + recompute" if _recomputes(plan) else ""))
    ax.bar(xs, send, bottom=[f + b for f, b in zip(fwd, bwd, strict=True)], color="#BAB0AC",
           width=width, label="send activations + gradients")
    totals = [f + b + s for f, b, s in zip(fwd, bwd, send, strict=True)]
    for x, total in zip(xs, totals, strict=True):
        ax.text(x, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    top = max(totals, default=0.0)
    if metrics is not None:
        M = plan.training.shape.num_microbatches
        summaries = metrics.stage_summaries()
        mx = [m.index + 0.2 for m in summaries]
        mf = [m.forward_s * 1e3 for m in summaries]
        mb = [m.backward_s * 1e3 for m in summaries]
        mp = [m.p2p_s / M * 1e3 for m in summaries]  # per step -> per micro-batch
        ax.bar(mx, mf, width=width, color=_COLOURS["forward"][1], hatch="..",
               edgecolor="white", label="measured forward")
        ax.bar(mx, mb, bottom=mf, width=width, color=_COLOURS["backward"][1], hatch="..",
               edgecolor="white", label="measured backward")
        ax.bar(mx, mp, bottom=[f + b for f, b in zip(mf, mb, strict=True)], width=width,
               color="#DDDDDD", hatch="..", edgecolor="white",
               label="measured p2p (with waiting)")
        measured = [f + b + q for f, b, q in zip(mf, mb, mp, strict=True)]
        for x, total in zip(mx, measured, strict=True):
            ax.text(x, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
        top = max([top, *measured])
    elif totals:
        ax.axhline(sum(totals) / len(totals), color="black", linestyle=":", linewidth=1)
    if top:
        ax.set_ylim(0, top * 1.25)
    ax.set_xticks(list(range(len(stages))))
    ax.set_xticklabels([f"stage {s.index}\nrank {s.rank}" for s in stages], fontsize=8)
    ax.set_ylabel("ms per micro-batch")
    ax.set_title("time per micro-batch per stage" + (
        " (left: predicted, right: measured)" if metrics is not None else " (dotted: mean)"),
        fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="upper left", frameon=False)


def render_png(plan: Plan, path: str | Path | None = None, dpi: int = 110,
               metrics: RunMetrics | None = None) -> bytes:
    """The report picture (module docstring) as PNG bytes, also written to `path` if given;
    with a run's `metrics`, measured bars beside the predicted ones."""
    if metrics is not None:
        metrics.check_shape(plan)
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    sim = replay(plan)
    ranks = sim.num_ranks
    fig = plt.figure(figsize=(14, 4.2 + 0.55 * ranks + 4.0), dpi=dpi)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.2 + 0.45 * ranks, 4.0], hspace=0.55,
                            wspace=0.18)
    _draw_schedule(fig.add_subplot(grid[0, :]), plan, sim)
    _draw_memory(fig.add_subplot(grid[1, 0]), plan, metrics)
    _draw_times(fig.add_subplot(grid[1, 1]), plan, metrics)
    title = _title(plan)
    if metrics is not None:
        step = metrics.median_step_s()
        title += (f"; measured {step * 1e3:.2f} ms/iteration (median), "
                  f"{plan.training.global_batch_size / step:,.1f} samples/s")
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    buffer = io.BytesIO()
    # No timestamps in the file: the same plan gives the same picture.
    fig.savefig(buffer, format="png", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = buffer.getvalue()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    return data


def render_html(plan: Plan, path: str | Path, png: bytes | None = None,
                metrics: RunMetrics | None = None) -> Path:
    """A self-contained HTML page: the picture (embedded) and the plan summary as tables (with a
    run's `metrics`, measured vs predicted too)."""
    png = png if png is not None else render_png(plan, metrics=metrics)
    e = html.escape
    setup, p, c, r = plan.training, plan.predicted, plan.cluster, plan.solver
    shape = setup.shape
    usable = p.usable_memory_bytes
    rows = []
    for s in plan.stages:
        mem = s.peak_memory_bytes
        rows.append(
            "<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in (
                s.index, s.rank, ",".join(map(str, s.devices)), f"{s.parameters:,}",
                f"{s.forward_s * 1e3:.3f}", f"{s.backward_s * 1e3:.3f}", _gib(mem),
                f"{mem / usable:.1%}" if usable else "-", stage_levers_text(plan, s), s.file))
            + f"<td class='modules'>{e(', '.join(s.modules))}</td></tr>")
    gap = "-" if r.gap is None else f"{r.gap:.2%}"
    levers = levers_summary(plan)
    facts = [("model", f"{plan.model.name} ({plan.model.parameters:,} parameters, "
                       f"{plan.model.file})"),
             ("graph", plan.model.graph_hash),
             ("cluster", f"{c.name}: {shape.num_devices} of {c.num_devices} "
                         f"{c.device.name} devices, {c.backend}"),
             ("training", f"global batch {setup.global_batch_size} = {shape.replicas} "
                          f"replicas x {shape.num_microbatches} micro-batches x "
                          f"{shape.microbatch_size}; {shape.schedule}, {setup.config.optimizer}, "
                          f"{setup.config.precision}"
                          + (f"; {levers}" if levers else "")),
             ("predicted", f"{p.iteration_s * 1e3:.3f} ms/iteration, "
                           f"{p.samples_per_s:,.1f} samples/s, bubble "
                           f"{p.bubble_fraction:.1%}" + p.spread_text()),
             ("solver", f"{r.strategy} {r.status}, gap {gap}, search gap "
                        f"{r.search_gap:.2%} over {r.shapes_enumerated} shapes"),
             ("costs", f"{plan.costs.source}"
                       + (f" ({plan.costs.profile})" if plan.costs.profile else "")),
             ("partc", plan.partc_version)]
    if plan.tied_parameters:
        facts.append(("tied", "; ".join(f"{x.name} in stages {', '.join(map(str, x.stages))}"
                                        for x in plan.tied_parameters)))
    picture = base64.b64encode(png).decode()
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>partc plan: {e(plan.model.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
td, th {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; vertical-align: top; }}
th {{ background: #f3f3f3; }} td.modules, .facts td {{ text-align: left; }}
.facts th {{ text-align: left; }} img {{ max-width: 100%; border: 1px solid #eee; }}
pre {{ background: #f7f7f7; padding: 1em; overflow-x: auto; }}
</style></head><body>
<h1>partc plan: {e(plan.model.name)}</h1>
<table class="facts">{''.join(f'<tr><th>{e(k)}</th><td>{e(v)}</td></tr>' for k, v in facts)}</table>
<img alt="simulated schedule, memory and time per stage" src="data:image/png;base64,{picture}">
<h2>Stages</h2>
<table><tr><th>stage</th><th>rank</th><th>devices</th><th>parameters</th><th>fwd ms</th>
<th>bwd ms</th><th>memory GiB</th><th>of usable</th><th>levers (saved)</th><th>file</th>
<th>modules</th></tr>
{''.join(rows)}
</table>
<h2>Summary</h2>
<pre>{e(format_summary(plan, metrics))}</pre>
</body></html>
"""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, page)

"""`partc show`: a plan as a terminal summary, a PNG report and a self-contained HTML page.

Everything comes from plan.yaml alone (no model, no stage file is loaded): the schedule is
replayed with partc.solve.simulator from the per-stage times and transfers and the per-rank sync
times the plan records (`Plan.pipeline_spec`), so the Gantt chart shows exactly the iteration the
solver predicted.

The PNG has three panels: the simulated schedule (pipeline ranks x time; forward and backward of
every micro-batch, the gradient all-reduce and optimizer step, idle time hatched as bubbles),
per-rank memory by kind against the usable device memory, and per-stage forward/backward/transfer
time per micro-batch.
"""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from partc.files import write_atomic
from partc.plans.plan import Plan, format_plan
from partc.solve.simulator import Simulation, simulate

# One colour per kind of work; micro-batches alternate between two shades of it.
_COLOURS = {"forward": ("#4C78A8", "#72A0CF"), "backward": ("#E45756", "#F08A89"),
            "allreduce": ("#54A24B", "#54A24B"), "optimizer": ("#B279A2", "#B279A2")}
_IDLE = "#B8B8B8"
_MEMORY_KINDS = (("parameters", "parameters", "#4C78A8"), ("gradients", "gradients", "#F58518"),
                 ("optimizer_state", "optimizer state", "#B279A2"),
                 ("activations", "activations", "#E45756"),
                 ("recompute", "recompute", "#FF9DA6"), ("workspace", "workspace", "#9D755D"),
                 ("communication", "communication", "#BAB0AC"))


def replay(plan: Plan) -> Simulation:
    """The plan's predicted iteration, re-simulated from plan.yaml."""
    return simulate(plan.pipeline_spec())


def _memory_unit(plan: Plan) -> tuple[str, int]:
    """GiB when the fullest device holds a GiB or more, else MiB: (name, bytes per unit)."""
    big = max((m.total for m in plan.predicted.memory), default=0) >= 2**30
    return ("GiB", 2**30) if big else ("MiB", 2**20)


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f}"


def format_summary(plan: Plan) -> str:
    """The terminal summary: the compile table, then memory per rank by kind and the schedule's
    busy/idle time per rank."""
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
                 + f" {'total':>9} {'of usable':>9}")
    for rank, mem in enumerate(memory):
        lines.append(f"{rank:>4} " + " ".join(f"{getattr(mem, k) / div:>11,.2f}" for k in kinds)
                     + f" {mem.total / div:>9,.2f} {mem.total / usable if usable else 0:>9.1%}")
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
    return "\n".join(lines)


# ---- the picture ------------------------------------------------------------------------------

def _title(plan: Plan) -> str:
    s, p, c = plan.training.shape, plan.predicted, plan.cluster
    virtual = f" x {s.chunks} virtual" if s.chunks > 1 else ""
    return (f"{plan.model.name}: {s.stages} stages x {s.replicas} replicas{virtual}, "
            f"{s.schedule}, {s.num_microbatches} micro-batches of {s.microbatch_size}"
            + (", activation checkpointing" if s.activation_checkpointing else "")
            + f" on {s.num_devices} x {c.device.name} ({c.name})\n"
            f"predicted {p.iteration_s * 1e3:.2f} ms/iteration, "
            f"{p.samples_per_s:,.1f} samples/s, bubble {p.bubble_fraction:.1%}")


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
        for start, end in busy + [(sim.last_backward_s, sim.last_backward_s)]:
            if start > cursor + 1e-12:
                ax.broken_barh([(cursor * scale, (start - cursor) * scale)],
                               (y - height / 2, height), facecolors="white",
                               edgecolor=_IDLE, hatch="///", linewidth=0)
            cursor = max(cursor, end)
    for e in sim.events:
        y = ranks - 1 - e.rank
        shade = _COLOURS[e.kind][e.microbatch % 2 if e.microbatch >= 0 else 0]
        ax.broken_barh([(e.start_s * scale, (e.end_s - e.start_s) * scale)],
                       (y - height / 2, height), facecolors=shade, edgecolor="white",
                       linewidth=0.6)
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
        " (with recompute)" if plan.training.shape.activation_checkpointing else ""),
        "allreduce": "gradient all-reduce", "optimizer": "optimizer step"}
    present = {e.kind for e in sim.events if e.end_s > e.start_s}
    handles = [Patch(facecolor=_COLOURS[k][0], label=text) for k, text in labels.items()
               if k in present]
    handles.append(Patch(facecolor="white", edgecolor=_IDLE, hatch="///", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=len(handles), fontsize=8, frameon=False)


def _draw_memory(ax: Any, plan: Plan) -> None:
    memory = plan.predicted.memory
    usable = plan.predicted.usable_memory_bytes
    device = plan.cluster.device.memory_bytes
    ranks = list(range(len(memory)))
    unit, div = _memory_unit(plan)
    bottom = [0.0] * len(memory)
    for key, label, colour in _MEMORY_KINDS:
        values = [getattr(m, key) / div for m in memory]
        if any(values):
            ax.bar(ranks, values, bottom=bottom, color=colour, label=label, width=0.6)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    top = max(bottom) if bottom else 0.0
    for rank, total in zip(ranks, bottom, strict=True):
        ax.text(rank, total, f"{total:.1f}\n{total * div / usable:.1%}" if usable else "",
                ha="center", va="bottom", fontsize=7)
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
    ax.set_title(f"peak memory per device (labels: {unit}, share of usable)", fontsize=10,
                 loc="left")
    ax.legend(fontsize=7, loc="upper left", ncol=2, frameon=False)


def _draw_times(ax: Any, plan: Plan) -> None:
    stages = list(plan.stages)
    xs = list(range(len(stages)))
    fwd = [s.forward_s * 1e3 for s in stages]
    bwd = [s.backward_s * 1e3 for s in stages]
    send = [(s.send_forward_s + s.send_backward_s) * 1e3 for s in stages]
    ax.bar(xs, fwd, color=_COLOURS["forward"][0], width=0.6, label="forward")
    ax.bar(xs, bwd, bottom=fwd, color=_COLOURS["backward"][0], width=0.6,
           label="backward" + (" + recompute" if plan.training.shape.activation_checkpointing
                             else ""))
    ax.bar(xs, send, bottom=[f + b for f, b in zip(fwd, bwd, strict=True)], color="#BAB0AC",
           width=0.6, label="send activations + gradients")
    totals = [f + b + s for f, b, s in zip(fwd, bwd, send, strict=True)]
    for x, total in zip(xs, totals, strict=True):
        ax.text(x, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    if totals:
        ax.axhline(sum(totals) / len(totals), color="black", linestyle=":", linewidth=1)
        ax.set_ylim(0, max(totals) * 1.25)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"stage {s.index}\nrank {s.rank}" for s in stages], fontsize=8)
    ax.set_ylabel("ms per micro-batch")
    ax.set_title("time per micro-batch per stage (dotted: mean)", fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="upper left", frameon=False)


def render_png(plan: Plan, path: str | Path | None = None, dpi: int = 110) -> bytes:
    """The report picture (module docstring) as PNG bytes, also written to `path` if given."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    sim = replay(plan)
    ranks = sim.num_ranks
    fig = plt.figure(figsize=(14, 4.2 + 0.55 * ranks + 4.0), dpi=dpi)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.2 + 0.45 * ranks, 4.0], hspace=0.55,
                            wspace=0.18)
    _draw_schedule(fig.add_subplot(grid[0, :]), plan, sim)
    _draw_memory(fig.add_subplot(grid[1, 0]), plan)
    _draw_times(fig.add_subplot(grid[1, 1]), plan)
    fig.suptitle(_title(plan), fontsize=11, x=0.01, ha="left")
    buffer = io.BytesIO()
    # No timestamps in the file: the same plan gives the same picture.
    fig.savefig(buffer, format="png", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = buffer.getvalue()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    return data


def render_html(plan: Plan, path: str | Path, png: bytes | None = None) -> Path:
    """A self-contained HTML page: the picture (embedded) and the plan summary as tables."""
    png = png if png is not None else render_png(plan)
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
                f"{mem / usable:.1%}" if usable else "-", s.file))
            + f"<td class='modules'>{e(', '.join(s.modules))}</td></tr>")
    gap = "-" if r.gap is None else f"{r.gap:.2%}"
    facts = [("model", f"{plan.model.name} ({plan.model.parameters:,} parameters, "
                       f"{plan.model.file})"),
             ("graph", plan.model.graph_hash),
             ("cluster", f"{c.name}: {shape.num_devices} of {c.num_devices} "
                         f"{c.device.name} devices, {c.backend}"),
             ("training", f"global batch {setup.global_batch_size} = {shape.replicas} "
                          f"replicas x {shape.num_microbatches} micro-batches x "
                          f"{shape.microbatch_size}; {shape.schedule}, {setup.config.optimizer}, "
                          f"{setup.config.precision}"
                          + (", activation checkpointing" if shape.activation_checkpointing
                             else "")),
             ("predicted", f"{p.iteration_s * 1e3:.3f} ms/iteration, "
                           f"{p.samples_per_s:,.1f} samples/s, bubble "
                           f"{p.bubble_fraction:.1%}"),
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
<th>bwd ms</th><th>memory GiB</th><th>of usable</th><th>file</th><th>modules</th></tr>
{''.join(rows)}
</table>
<h2>Summary</h2>
<pre>{e(format_summary(plan))}</pre>
</body></html>
"""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, page)

"""`partc` console script (click). Each command parses options and calls into `partc`.

User errors (PartcError) print one line, `partc: error: ... (hint: ...)`, and exit 2; a bug prints
one line and exits 3. `partc --debug ...` (or PARTC_DEBUG=1) shows the traceback instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

import click

from partc.solve.coarsen import DEFAULT_MAX_BLOCKS
from partc.errors import PartcError

INTERNAL_ERROR_EXIT = 3


def _version() -> str:
    try:
        return version("partc")
    except PackageNotFoundError:
        return "unknown"


class PartcGroup(click.Group):
    """Turns partc errors into one clear line and an exit code instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except PartcError as exc:
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"partc: error: {exc.one_line()}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("partc: interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # a partc bug: still one line unless --debug
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"partc: internal error: {type(exc).__name__}: {exc} "
                       "(hint: rerun with --debug for the traceback and report it)", err=True)
            ctx.exit(INTERNAL_ERROR_EXIT)


def _debug(ctx: click.Context) -> bool:
    return bool(ctx.find_root().meta.get("partc.debug")) or os.environ.get("PARTC_DEBUG") == "1"


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().meta["partc.debug"] = True


def debug_option(f: Any) -> Any:
    """--debug, accepted before or after the command name."""
    return click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                        callback=_set_debug, help="Show full tracebacks on errors.")(f)


@contextlib.contextmanager
def writing_to(path: Path) -> Iterator[None]:
    """Turn an OSError while writing `path` into a one-line user error."""
    try:
        yield
    except OSError as exc:
        raise PartcError(f"cannot write {path}: {exc.strerror}",
                         hint="choose a writable output path") from exc


@click.group(cls=PartcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@debug_option
@click.version_option(_version(), prog_name="partc")
def cli() -> None:
    """partc: ahead-of-time partition compiler for training PyTorch models across devices."""


@cli.command()
@click.argument("model", type=click.Path(readable=False, path_type=Path))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size to capture the model at.")
@click.option("--depth", "-d", type=click.IntRange(min=0), default=1, show_default=True,
              help="Module-tree depth of the table (0: whole model, 1: the root's children, ...).")
@click.option("--json", "json_out", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="Also write the summary as JSON to this file.")
@click.option("--save", "save_dir", type=click.Path(readable=False, file_okay=False, path_type=Path),
              help="Write the OpGraph (graph.json) and the weightless ONNX model (model.onnx) here.")
@click.option("--no-onnx", is_flag=True, help="Skip the ONNX export (FX-only OpGraph).")
@debug_option
def inspect(model: Path, batch_size: int, depth: int, json_out: Path | None,
            save_dir: Path | None, no_onnx: bool) -> None:
    """Capture MODEL (a model file) and print parameters, FLOPs and activations per module."""
    from partc.graph.module_summary import format_table, summarize_modules
    from partc.frontend.capture import capture_graph
    from partc.progress import TerminalProgress

    progress = TerminalProgress()
    result = capture_graph(model, batch_size, onnx=not no_onnx, progress=progress)
    if save_dir is not None:
        with writing_to(save_dir):
            written = result.save(save_dir)
        for kind, path in written.items():
            click.echo(f"wrote {kind}: {path}", err=True)
    summary = summarize_modules(result.graph, depth)
    click.echo(format_table(summary))
    if json_out is not None:
        with writing_to(json_out):
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(summary.to_dict(), indent=2, sort_keys=True) + "\n")
        click.echo(f"wrote {json_out}", err=True)


def _batch_sizes(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise click.BadParameter("give two or more distinct batch sizes >= 1, e.g. 2,4")
    return sizes


@cli.command()
@click.argument("model", type=click.Path(readable=False, path_type=Path))
@click.option("--device", default="cpu", show_default=True,
              help="Device to measure on: cpu, cuda or cuda:N.")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=2, show_default=True,
              help="Micro-batch size B to capture at; B and 2B are profiled.")
@click.option("--batch-sizes", callback=_batch_sizes,
              help="Profile these micro-batch sizes instead of B and 2B (comma-separated, >= 2).")
@click.option("--method", type=click.Choice(["auto", "onnxruntime", "torch"]), default="auto",
              show_default=True,
              help="Forward times from onnxruntime (auto: when the ONNX export works) or torch.")
@click.option("--analytic", "analytic_device", metavar="DEVICE",
              help="Write the analytic (roofline) cost table for a device config instead of "
                   "measuring (a name from configs/devices/ or a YAML path).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Intra-op threads on CPU (partc runs one process per core).")
@click.option("--runs", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed runs per measurement (median).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed warm-up runs before timing.")
@click.option("--output", "-o", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              default=Path("profile.yaml"), show_default=True, help="Profile file to write.")
@debug_option
def profile(model: Path, device: str, batch_size: int, batch_sizes: tuple[int, ...], method: str,
            analytic_device: str | None, threads: int, runs: int, warmup: int, output: Path) -> None:
    """Measure (or compute) the cost of every operator of MODEL: forward and backward time and
    activation bytes per node, as a function of the micro-batch size."""
    from partc.cost.table import format_cost_summary
    from partc.progress import TerminalProgress

    progress = TerminalProgress()
    if analytic_device is not None:
        from partc.cost.roofline import analytic_cost_table
        from partc.hardware.configs import load_device
        from partc.cost.activations import saved_activations
        from partc.frontend.capture import capture_graph

        spec = load_device(analytic_device)
        result = capture_graph(model, batch_size, onnx=False, progress=progress)
        with progress.step("measuring saved activations (meta-safe) and pricing by roofline"):
            table = analytic_cost_table(result.graph, spec, saved=saved_activations(result.capture))
    else:
        from partc.cost.measured import ProfileOptions, profile_model

        options = ProfileOptions(device=device, batch_sizes=batch_sizes, method=method,
                                 threads=threads, warmup=warmup, runs=runs)
        table = profile_model(model, batch_size, options, progress)
    with writing_to(output):
        output.parent.mkdir(parents=True, exist_ok=True)
        table.save(output)
    click.echo(format_cost_summary(table))
    click.echo(f"wrote {output}", err=True)


def plan_options(default_cluster: str, compare: bool = False) -> Any:
    """The options `solve` and `compile` share: cluster, batch, costs and everything the search
    lets a user pin. `compare` adds `--strategy all`."""
    options = [
        click.option("--cluster", "-c", "cluster_name", default=default_cluster, show_default=True,
                     help="Cluster config: 'local' (this machine: its GPUs, or its CPU cores as "
                          "gloo processes), a name from configs/clusters/, or a YAML path."),
        click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True,
                     help="Global batch size (samples per training iteration over all replicas)."),
        click.option("--profile", "profile_path", type=click.Path(readable=False, dir_okay=False, path_type=Path),
                     help="Measured costs from `partc profile` (default: analytic, from the "
                          "cluster's device config)."),
        click.option("--strategy", type=click.Choice(["cpsat", "chain-dp", "uniform", "params"]
                                                      + (["all"] if compare else [])),
                     default="cpsat", show_default=True,
                     help="How stages are cut" + ("; 'all' compares every strategy on the same "
                                                  "search." if compare else ".")),
        click.option("--stages", type=click.IntRange(min=1), help="Pin the pipeline stages."),
        click.option("--replicas", type=click.IntRange(min=1),
                     help="Pin the data-parallel replicas."),
        click.option("--microbatches", type=click.IntRange(min=1),
                     help="Pin the micro-batch count."),
        click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "interleaved-1f1b"]),
                     help="Pin the pipeline schedule."),
        click.option("--checkpointing/--no-checkpointing", default=None,
                     help="Pin activation checkpointing on or off (default: searched)."),
        click.option("--optimizer", type=click.Choice(["sgd", "sgd-momentum", "adam", "adamw"]),
                     default="adamw", show_default=True),
        click.option("--precision", type=click.Choice(["fp32", "bf16-mixed"]), default="fp32",
                     show_default=True),
        click.option("--memory-margin", type=click.FloatRange(min=0, max=1, max_open=True),
                     default=0.1, show_default=True, help="Fraction of device memory kept free."),
        click.option("--max-blocks", type=click.IntRange(min=1), default=DEFAULT_MAX_BLOCKS,
                     show_default=True, help="Blocks the graph is coarsened to before solving."),
        click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=10.0,
                     show_default=True, help="CP-SAT deterministic seconds per refined shape."),
        click.option("--refine", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Best shapes CP-SAT optimises after the DP screen."),
        click.option("--capture-batch", type=click.IntRange(min=1), default=2, show_default=True,
                     help="Batch size the model is captured at (costs scale to any micro-batch)."),
    ]

    def apply(f: Any) -> Any:
        for option in reversed(options):
            f = option(f)
        return f
    return apply


def _search_inputs(kw: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(cluster, TrainingConfig, SearchOptions) from the plan options."""
    from partc.hardware.local import resolve_cluster
    from partc.solve.memory import TrainingConfig
    from partc.solve.search import SearchOptions

    cluster = resolve_cluster(kw["cluster_name"])
    training = TrainingConfig(optimizer=kw["optimizer"], precision=kw["precision"],
                              memory_margin=kw["memory_margin"])
    strategy = kw["strategy"]
    options = SearchOptions(strategy="cpsat" if strategy == "all" else strategy,
                            stages=kw["stages"], replicas=kw["replicas"],
                            num_microbatches=kw["microbatches"], schedule=kw["schedule"],
                            activation_checkpointing=kw["checkpointing"],
                            max_blocks=kw["max_blocks"], time_limit_s=kw["time_limit"],
                            refine=kw["refine"])
    return cluster, training, options


@cli.command()
@click.argument("model", type=click.Path(readable=False, path_type=Path))
@plan_options(default_cluster="cpu", compare=True)
@click.option("--output", "-o", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="Write the partition (YAML) here.")
@click.option("--timeline", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="Write the simulated schedule (events, memory over time) as JSON here.")
@debug_option
def solve(model: Path, output: Path | None, timeline: Path | None, **kw: Any) -> None:
    """Find the best pipeline x data-parallel partition of MODEL for a cluster and global batch:
    coarsen, search shapes, cut stages (CP-SAT by default), simulate; print the plan."""
    from partc.solve.coarsen import coarsen
    from partc.solve.partition import format_partition, format_comparison
    from partc.cost.plan_costs import plan_costs
    from partc.frontend.capture import capture_graph
    from partc.progress import TerminalProgress
    from partc.solve.search import compare_strategies, search

    progress = TerminalProgress()
    cluster, training, options = _search_inputs(kw)
    result = capture_graph(model, kw["capture_batch"], onnx=False, progress=progress)
    table = plan_costs(result, cluster.device, kw["profile_path"], progress)
    with progress.step(f"coarsen to at most {options.max_blocks} blocks"):
        blocks = coarsen(table, options.max_blocks)
    if kw["strategy"] == "all":
        results = compare_strategies(table, cluster, kw["batch_size"], training, options,
                                     blocks=blocks, progress=progress)
        click.echo(format_comparison(results))
        chosen = results["cpsat"]
        if not hasattr(chosen, "shape"):
            raise chosen  # type: ignore[misc]
        partition = chosen  # type: ignore[assignment]
    else:
        partition = search(table, cluster, kw["batch_size"], training, options, blocks=blocks,
                           progress=progress)
    click.echo(format_partition(partition))
    if output is not None:
        with writing_to(output):
            output.parent.mkdir(parents=True, exist_ok=True)
            partition.save(output)
        click.echo(f"wrote {output}", err=True)
    if timeline is not None:
        with writing_to(timeline):
            timeline.parent.mkdir(parents=True, exist_ok=True)
            timeline.write_text(json.dumps(partition.simulation.to_dict(), sort_keys=True) + "\n")
        click.echo(f"wrote {timeline}", err=True)


@cli.command(name="compile")
@click.argument("model", type=click.Path(readable=False, path_type=Path))
@plan_options(default_cluster="local")
@click.option("--output", "-o", type=click.Path(readable=False, file_okay=False, path_type=Path),
              help="Plan directory to write (plan.yaml + stage_<k>.pt) [default: plans/<model>].")
@debug_option
def compile_command(model: Path, output: Path | None, **kw: Any) -> None:
    """Compile MODEL into a plan directory: capture, price, coarsen, solve, simulate, then split
    the program into stages, trace each to TorchScript (stage_<k>.pt) and write plan.yaml."""
    from partc.emit.compile import CompileOptions, compile_model
    from partc.plans.plan import format_plan
    from partc.progress import TerminalProgress

    progress = TerminalProgress()
    cluster, training, search_options = _search_inputs(kw)
    output = output if output is not None else Path("plans") / model.stem
    options = CompileOptions(batch_size=kw["batch_size"], search=search_options,
                             training=training, profile=kw["profile_path"],
                             capture_batch=kw["capture_batch"])
    result = compile_model(model, cluster, output, options, progress)
    click.echo(format_plan(result.plan, solver_wall_s=result.partition.solver.wall_s))
    click.echo(f"wrote {output / 'plan.yaml'} and {result.plan.num_stages} stage files "
               f"in {result.timings['total_s']:.1f} s", err=True)


@cli.command()
@click.argument("plan", type=click.Path(readable=False, path_type=Path))
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-4, show_default=True,
              help="Relative tolerance (of the largest reference magnitude per tensor).")
@click.option("--atol", type=click.FloatRange(min=0), default=1e-5, show_default=True,
              help="Absolute tolerance.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="RNG seed of both runs (dropout) and of a meta model's initialisation.")
@click.option("--device", default="cpu", show_default=True,
              help="Device both runs use (cpu, cuda, cuda:N).")
@click.option("--init-from", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="A torch.save'd state_dict of the model: both runs take their weights from it "
                   "by FQN (as launch --init-from does) instead of the stage files or, for a "
                   "meta-device model, the model's own initialisation.")
@debug_option
def verify(plan: Path, rtol: float, atol: float, seed: int, device: str,
           init_from: Path | None) -> None:
    """Check a plan: schema, stage file hashes, and that the stages in sequence compute the model's
    outputs, loss and every gradient (exit 1 when above tolerance)."""
    from partc.emit.verify import format_report, verify_plan

    report = verify_plan(plan, rtol=rtol, atol=atol, seed=seed, device=device,
                         init_from=init_from)
    click.echo(format_report(report))
    if not report.ok:
        sys.exit(1)


@cli.command()
@click.argument("plan", type=click.Path(readable=False, path_type=Path))
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Training steps (global batches) to run, counted from step 0; a resumed run "
                   "continues up to this step.")
@click.option("--checkpoint-dir", type=click.Path(readable=False, file_okay=False, path_type=Path),
              help="Write per-stage checkpoints (model + optimizer, by parameter name) and a "
                   "manifest here; an elastic restart resumes from the newest complete one.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Checkpoint every K steps (0: only after the last step).")
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=2, show_default=True,
              help="Complete checkpoints kept; older ones are deleted.")
@click.option("--resume", is_flag=True,
              help="Continue from the newest complete checkpoint in --checkpoint-dir.")
@click.option("--init-from", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="A torch.save'd state_dict of the model (or a partc checkpoint's stage file): "
                   "initial weights by FQN, instead of the stage files' or a meta model's own "
                   "initialisation.")
@click.option("--lr", type=float, help="Learning rate [default: 1e-3 for adam/adamw, 0.01 sgd].")
@click.option("--weight-decay", type=float,
              help="Weight decay [default: 0.01 for adamw, else 0].")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of dropout (per step and rank) and of a meta model's initialisation.")
@click.option("--metrics", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="Append one JSON line per step (loss, samples/s, per-stage times) here.")
@click.option("--log-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="Print a progress line every N steps (when stderr is not a terminal).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes (as torchrun); the plan's processes are split evenly over them.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="This node's rank (as torchrun).")
@click.option("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (as torchrun); "
              "required with --nnodes > 1.")
@click.option("--rdzv-backend", default="c10d", show_default=True, help="As torchrun.")
@click.option("--rdzv-id", default="partc", show_default=True, help="Job id (as torchrun).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart all workers up to N times when one fails (as torchrun); they resume "
                   "from the newest checkpoint.")
@debug_option
def launch(plan: Path, steps: int, checkpoint_dir: Path | None, checkpoint_every: int,
           keep_checkpoints: int, resume: bool, init_from: Path | None, lr: float | None,
           weight_decay: float | None, seed: int, metrics: Path | None, log_every: int,
           nnodes: int, node_rank: int, rdzv_endpoint: str, rdzv_backend: str, rdzv_id: str,
           max_restarts: int) -> None:
    """Train a plan on torch.distributed: one process per device, pipeline x data parallel,
    started by torch's elastic launcher (torchrun's flags and semantics)."""
    from partc.run.launch import ElasticOptions, launch as run_plan
    from partc.run.training import TrainOptions

    options = TrainOptions(steps=steps, seed=seed, lr=lr, weight_decay=weight_decay,
                           checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                           keep_checkpoints=keep_checkpoints, resume=resume, init_from=init_from,
                           metrics=metrics, log_every=log_every)
    elastic = ElasticOptions(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                             rdzv_backend=rdzv_backend, rdzv_id=rdzv_id, max_restarts=max_restarts)
    run_plan(plan, options, elastic)


@cli.command()
@click.argument("plans", nargs=-1, required=True, type=click.Path(readable=False, path_type=Path))
@click.option("--model", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="The model file (default: the one recorded in the plan, relative to it).")
@debug_option
def check(plans: tuple[Path, ...], model: Path | None) -> None:
    """Is each of PLANS still what `partc compile` would write? Re-captures the model, compares
    its graph with the plan's and re-solves with the plan's recorded inputs. A directory stands
    for every plan.yaml under it. Exit 0: all current; 1: a plan is stale (what changed, what
    moves, old vs new throughput, the command that refreshes it); 2: bad input."""
    from partc.plans.check import check_plan, find_plans, format_check
    from partc.progress import TerminalProgress

    paths = find_plans(plans)
    if len(paths) == 1:
        report = check_plan(paths[0], model, TerminalProgress())
        click.echo(format_check(report))
        sys.exit(report.exit_code)
    worst = 0
    for path in paths:  # keep going: CI wants every stale plan in one run
        try:
            report = check_plan(path, model, TerminalProgress())
        except PartcError as exc:
            if _debug(click.get_current_context()):
                traceback.print_exc()
            click.echo(f"partc: error: {path}: {exc.one_line()}", err=True)
            worst = 2
            continue
        click.echo(format_check(report))
        worst = max(worst, report.exit_code)
    sys.exit(worst)


@cli.command()
@click.argument("old", type=click.Path(readable=False, path_type=Path))
@click.argument("new", type=click.Path(readable=False, path_type=Path))
@debug_option
def diff(old: Path, new: Path) -> None:
    """Show how plan NEW differs from plan OLD: shape, modules that change stage, per-stage
    devices, predicted times and memory, throughput. Exit 0 either way."""
    from partc.plans.plan import load_plan
    from partc.plans.diff import diff_layouts, format_diff, layout_of_plan

    a, b = load_plan(old), load_plan(new)
    click.echo(f"--- {old}\n+++ {new}")
    click.echo(format_diff(diff_layouts(layout_of_plan(a), layout_of_plan(b)), "old", "new"))


@cli.command()
@click.argument("plan", type=click.Path(readable=False, path_type=Path))
@click.option("--png", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="Write the report picture here: simulated schedule (Gantt), memory and time "
                   "per stage.")
@click.option("--html", type=click.Path(readable=False, dir_okay=False, path_type=Path),
              help="Write a self-contained HTML report (the picture and the plan summary).")
@debug_option
def show(plan: Path, png: Path | None, html: Path | None) -> None:
    """Summarise PLAN: stages, devices, predicted times and memory per device, the simulated
    schedule's idle time; --png/--html draw it. Reads plan.yaml only."""
    from partc.plans.plan import load_plan
    from partc.plans.report import format_summary, render_html, render_png

    loaded = load_plan(plan)
    click.echo(format_summary(loaded))
    picture = None
    if png is not None:
        with writing_to(png):
            picture = render_png(loaded, png)
        click.echo(f"wrote {png}", err=True)
    if html is not None:
        with writing_to(html):
            render_html(loaded, html, picture)
        click.echo(f"wrote {html}", err=True)


def main() -> None:
    cli(prog_name="partc")


if __name__ == "__main__":
    sys.exit(main())

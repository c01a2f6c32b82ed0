"""`partc` console script (click). Each command parses options and calls into `partc`.

User errors (PartcError) print one line, `partc: error: ... (hint: ...)`, and exit 2; a bug prints
one line and exits 3. `partc --debug ...` (or PARTC_DEBUG=1) shows the traceback instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, TypeVar

import click

from partc.errors import PartcError
from partc.files import write_atomic
from partc.interrupts import exec_holding_signals, held_interrupts, release_held_signals
from partc.options import (
    COSTS_MODES,
    DEFAULT_CAPTURE_BATCH,
    PRECISIONS,
    PROFILE_METHODS,
    STRATEGIES,
    ElasticOptions,
    FlaggedField,
    Precision,
    ProfileMethod,
    SearchOptions,
    TrainingConfig,
    TrainOptions,
    flagged_fields,
    from_flags,
)
from partc.version import __version__

if TYPE_CHECKING:  # annotations only: the CLI imports partc's heavier modules when it runs them
    from partc.plans.recalibrate import RunOfPlan

F = TypeVar("F", bound=Callable[..., Any])

INTERNAL_ERROR_EXIT = 3


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that a command
    cleans up the same way (compile removes its unfinished plan); exit 143 (128 + SIGTERM)."""

    line = "partc: terminated"
    exit_code = 143


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises Terminated while a command runs (where nothing else handles SIGTERM)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class UserPath(click.Path):
    """A path option or argument: click never reads it (partc does, with its own errors), it
    arrives as a pathlib.Path, and one that cannot be resolved (a symbolic-link loop) is a
    usage error here: partc resolved such a path later, as an internal error (exit 3)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(readable=False, path_type=Path, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        try:
            Path(os.fsdecode(path)).resolve()
        except (RuntimeError, OSError) as exc:  # RuntimeError: Python < 3.13's symlink loop
            self.fail(f"{os.fsdecode(value)!r} cannot be resolved: {exc}", param, ctx)
        return path


class PartcGroup(click.Group):
    """Turns partc errors into one clear line and an exit code instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with _sigterm_interrupts():
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except PartcError as exc:
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"partc: error: {exc.one_line()}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:  # Ctrl-C: 130; Terminated (SIGTERM): 143
            click.echo(getattr(exc, "line", "") or "partc: interrupted", err=True)
            ctx.exit(getattr(exc, "exit_code", 130))
        except SystemExit as exc:
            # partc's commands end with ctx.exit: a SystemExit here comes from code partc ran
            # (a model's forward or a library), and must not pass for the command's outcome
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"partc: error: code run by partc called sys.exit({exc.code!r}) (hint: "
                       "model code must not exit the process; raise an exception instead)",
                       err=True)
            ctx.exit(2)
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
def writing_to(path: Path, what: str = "output", inputs: tuple[Path, ...] = ()
               ) -> Iterator[None]:
    """Write `path` (an output, named by its option `what`): never over a plan file or one of
    the command's `inputs` (a user error), and an OSError becomes a one-line user error."""
    from partc.plans.plan import refuse_plan_artifact

    refuse_plan_artifact(path, what, inputs)
    try:
        yield
    except OSError as exc:
        raise PartcError(f"cannot write {path}: {exc.strerror}",
                         hint="choose a writable output path") from exc


@click.group(cls=PartcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@debug_option
@click.version_option(__version__, prog_name="partc")
def cli() -> None:
    """partc: ahead-of-time partition compiler for training PyTorch models across devices."""


@cli.command()
@click.argument("model", type=UserPath())
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size to capture the model at.")
@click.option("--depth", "-d", type=click.IntRange(min=0), default=1, show_default=True,
              help="Module-tree depth of the table (0: whole model, 1: the root's children, ...).")
@click.option("--json", "json_out",
              type=UserPath(dir_okay=False),
              help="Also write the summary as JSON to this file.")
@click.option("--save", "save_dir",
              type=UserPath(file_okay=False),
              help="Write the OpGraph (graph.json) and the weightless ONNX model (model.onnx) "
                   "here.")
@click.option("--no-onnx", is_flag=True, help="Skip the ONNX export (FX-only OpGraph).")
@debug_option
def inspect(model: Path, batch_size: int, depth: int, json_out: Path | None,
            save_dir: Path | None, no_onnx: bool) -> None:
    """Capture MODEL (a model file) and print parameters, FLOPs and activations per module."""
    _refuse_a_bad_model_file(model)
    with held_interrupts():
        from partc.frontend.capture import capture_graph
        from partc.graph.module_summary import format_table, summarize_modules
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
        with writing_to(json_out, "--json", (model,)):
            json_out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(json_out, json.dumps(summary.to_dict(), indent=2, sort_keys=True) + "\n")
        click.echo(f"wrote {json_out}", err=True)


def _batch_sizes(_ctx: click.Context, _param: click.Parameter,
                 value: str | None) -> tuple[int, ...]:
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
@click.argument("model", type=UserPath())
@click.option("--device", default="cpu", show_default=True,
              help="Device to measure on: cpu, cuda or cuda:N.")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=2, show_default=True,
              help="Micro-batch size B to capture at; B and 2B are profiled.")
@click.option("--batch-sizes", callback=_batch_sizes,
              help="Profile these micro-batch sizes instead of B and 2B (comma-separated, >= 2).")
@click.option("--method", type=click.Choice(PROFILE_METHODS), default="auto",
              show_default=True,
              help="Forward times from onnxruntime (auto: when the ONNX export works and "
                   "onnxruntime has the device's execution provider) or torch.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=PRECISIONS[0],
              show_default=True,
              help="Training precision to price (measured bf16-mixed: under bf16 autocast, as "
                   "partc launch runs it, timed in torch).")
@click.option("--analytic", "analytic_device", metavar="DEVICE",
              help="Write the analytic (roofline) cost table for a device config instead of "
                   "measuring (a name from configs/devices/ or a YAML path).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Intra-op threads on CPU (partc runs one process per core).")
@click.option("--neighbours", type=click.IntRange(min=0), default=0, show_default=True,
              help="CPU: processes kept training the same model while measuring (the node's "
                   "other devices; compile uses its cluster's devices per node - 1). As many "
                   "as the cores: one shares the measuring core, timed by CPU time.")
@click.option("--runs", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed runs per measurement (median).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed warm-up runs before timing.")
@click.option("--output", "-o", type=UserPath(dir_okay=False),
              default=Path("profile.yaml"), show_default=True, help="Profile file to write.")
@debug_option
def profile(model: Path, device: str, batch_size: int, batch_sizes: tuple[int, ...],
            method: ProfileMethod, precision: Precision, analytic_device: str | None,
            threads: int, neighbours: int, runs: int, warmup: int, output: Path) -> None:
    """Measure (or compute) the cost of every operator of MODEL: forward and backward time and
    activation bytes per node, as a function of the micro-batch size."""
    _refuse_a_bad_model_file(model)
    from partc.cost.table import format_cost_summary
    from partc.progress import TerminalProgress

    progress = TerminalProgress()
    if analytic_device is not None:
        from partc.hardware.configs import load_device

        spec = load_device(analytic_device)  # torch-free: a bad name fails before the imports
        with held_interrupts():
            from partc.cost.plan_costs import plan_costs
            from partc.frontend.capture import capture_graph

        result = capture_graph(model, batch_size, onnx=False, progress=progress)
        table = plan_costs(result, spec, progress=progress, precision=precision)
    else:
        with held_interrupts():
            from partc.cost.measured import ProfileOptions
            from partc.plans.measurable_sizes import profile_within_memory

        options = ProfileOptions(device=device, batch_sizes=batch_sizes, method=method,
                                 threads=threads, warmup=warmup, runs=runs, precision=precision,
                                 neighbours=neighbours)
        table = profile_within_memory(model, batch_size, options, progress)
    with writing_to(output, "--output", (model,)):
        output.parent.mkdir(parents=True, exist_ok=True)
        table.save(output)
    click.echo(format_cost_summary(table))
    click.echo(f"wrote {output}", err=True)


def dataclass_options(cls: type, **overrides: dict[str, Any]) -> Callable[[F], F]:
    """click options for every flagged field of an options dataclass of partc.options: the flag,
    help, value range, choices and default come from the field itself, the keyword argument is
    the field's name (so `from_flags(cls, kwargs)` builds the options). `overrides` adds or
    replaces click settings per field name (e.g. an extra choice)."""
    decorators = []
    for f in flagged_fields(cls):
        settings: dict[str, Any] = {"help": f.flag.help}
        names: tuple[str, ...] = (f.flag.name, f.name)
        if f.kind is bool and f.optional:
            names = (f"{f.flag.name}/{f.negative}", f.name)
            settings["default"] = None
        elif f.kind is bool:
            settings["is_flag"] = True
        else:
            settings["default"] = f.default
            settings["show_default"] = f.default not in (None, "")
            settings["type"] = _click_type(f)
        settings.update(overrides.get(f.name, {}))
        decorators.append(click.option(*names, **settings))

    def apply(function: F) -> F:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function
    return apply


def _click_type(f: FlaggedField) -> Any:
    kind, flag = f.kind, f.flag
    ranged = flag.min is not None or flag.max is not None
    if f.choices is not None:
        return click.Choice(f.choices)
    if kind is int:
        return click.IntRange(min=_int_bound(flag.min), max=_int_bound(flag.max),
                              min_open=flag.min_open, max_open=flag.max_open) if ranged else int
    if kind is float:
        return click.FloatRange(min=flag.min, max=flag.max, min_open=flag.min_open,
                                max_open=flag.max_open) if ranged else float
    if kind is Path:
        return UserPath(dir_okay=flag.path != "file", file_okay=flag.path != "dir")
    return kind


def _int_bound(bound: float | None) -> int | None:
    """An int field's range bound (Flag holds float bounds; int fields give whole numbers)."""
    return None if bound is None else int(bound)


def plan_options(default_cluster: str, compare: bool = False) -> Callable[[F], F]:
    """The options `solve` and `compile` share: cluster, batch, costs, the training settings
    (TrainingConfig) and everything the search lets a user pin (SearchOptions). `compare` adds
    `--strategy all`."""
    strategy: dict[str, dict[str, Any]] = {}
    if compare:
        strategy = {"strategy": {
            "type": click.Choice([*STRATEGIES, "all"]),
            "help": "How stages are cut; 'all' compares every strategy on the same search."}}
    options = [
        click.option("--cluster", "-c", "cluster_name", default=default_cluster, show_default=True,
                     help="Cluster config: 'local' (this machine: its GPUs, or its CPU cores as "
                          "gloo processes), a name from configs/clusters/, a YAML path, or a "
                          "plan (its plan.yaml or directory: the cluster it was compiled for)."),
        click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True,
                     help="Global batch size (samples per training iteration over all replicas)."),
        click.option("--profile", "profile_path",
                     type=UserPath(dir_okay=False),
                     help="Measured costs from `partc profile` (overrides --costs)."),
        click.option("--costs", type=click.Choice(COSTS_MODES), default="auto",
                     show_default=True,
                     help="Without --profile: 'measured' profiles the model on this machine "
                          "(cached), 'analytic' prices it from the cluster's device config; "
                          "'auto' measures when the cluster is this machine (local, or a "
                          "one-node CPU cluster)."),
        dataclass_options(SearchOptions, **strategy),
        dataclass_options(TrainingConfig),
        click.option("--capture-batch", type=click.IntRange(min=1), default=DEFAULT_CAPTURE_BATCH,
                     show_default=True,
                     help="Batch size the model is captured at (costs scale to any micro-batch)."),
    ]

    def apply(function: F) -> F:
        for option in reversed(options):
            function = option(function)
        return function
    return apply


def _search_inputs(kw: dict[str, Any]) -> tuple[Any, TrainingConfig, SearchOptions]:
    """(cluster, TrainingConfig, SearchOptions) from the plan options."""
    from partc.plans.plan import cluster_of

    cluster = cluster_of(kw["cluster_name"])
    compare = kw["strategy"] == "all"
    options = from_flags(SearchOptions, {**kw, "strategy": "cpsat"} if compare else kw)
    return cluster, from_flags(TrainingConfig, kw), options


@cli.command()
@click.argument("model", type=UserPath())
@plan_options(default_cluster="local", compare=True)
@click.option("--output", "-o", type=UserPath(dir_okay=False),
              help="Write the partition (YAML) here.")
@click.option("--timeline", type=UserPath(dir_okay=False),
              help="Write the simulated schedule (events, memory over time) as JSON here.")
@debug_option
def solve(model: Path, output: Path | None, timeline: Path | None, **kw: Any) -> None:
    """Find the best pipeline x data-parallel partition of MODEL for a cluster and global batch:
    coarsen, search shapes, cut stages (CP-SAT by default), simulate; print the plan."""
    _refuse_a_bad_model_file(model)
    # the options are torch-free: a bad cluster fails before the seconds of importing torch
    cluster, training, options = _search_inputs(kw)
    with held_interrupts():
        from partc.frontend.capture import capture_graph
        from partc.hardware.specs import priced_by_text
        from partc.plans.priced_search import priced_search
        from partc.progress import TerminalProgress
        from partc.solve.partition import format_comparison, format_partition
        from partc.solve.search import compare_strategies

    progress = TerminalProgress()
    result = capture_graph(model, kw["capture_batch"], onnx=False, progress=progress)
    # (with --strategy all, `options` asks for cpsat: every strategy is then compared on the
    # costs measured for cpsat's plan)
    priced = priced_search(result, cluster, kw["batch_size"], training, options,
                           profile=kw["profile_path"], costs=kw["costs"], progress=progress)
    partition = priced.partition
    if kw["strategy"] == "all":
        results = compare_strategies(priced.table, cluster, kw["batch_size"], training, options,
                                     blocks=priced.blocks, progress=progress)
        click.echo(format_comparison(results))
        chosen = results["cpsat"]
        if isinstance(chosen, PartcError):
            raise chosen
        partition = chosen
    profile, source = kw["profile_path"] or priced.profile, priced.table.source
    how = "measured on" if source.kind == "measured" else "analytic, for"
    click.echo(format_partition(partition, priced_by_text(
        cluster.device, None if profile is None else f"{profile} ({how} {source.device})")))
    if output is not None:
        with writing_to(output, "--output", (model,)):
            output.parent.mkdir(parents=True, exist_ok=True)
            partition.save(output)
        click.echo(f"wrote {output}", err=True)
    if timeline is not None:
        with writing_to(timeline, "--timeline", (model,)):
            timeline.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(timeline, json.dumps(partition.simulation.to_dict(), sort_keys=True)
                         + "\n")
        click.echo(f"wrote {timeline}", err=True)


@cli.command(name="compile")
@click.argument("model", type=UserPath())
@plan_options(default_cluster="local")
@click.option("--output", "-o", type=UserPath(file_okay=False),
              help="Plan directory to write (plan.yaml + stage_<k>.pt) [default: plans/<model>].")
@click.option("--calibrate-from", "calibrate_from", multiple=True,
              type=UserPath(dir_okay=False),
              help="A `partc launch --metrics` file of a plan of this model: scale each stage's "
                   "operator costs so they predict what that run measured; the corrected costs "
                   "are written as the plan's profile.yaml. Repeat it to pool several runs of "
                   "the same plan (medians over all their timed steps).")
@debug_option
def compile_command(model: Path, output: Path | None, calibrate_from: tuple[Path, ...],
                    **kw: Any) -> None:
    """Compile MODEL into a plan directory: capture, price, coarsen, solve, simulate, then split
    the program into stages, trace each to TorchScript (stage_<k>.pt) and write plan.yaml."""
    _refuse_a_bad_model_file(model)
    cluster, training, search_options = _search_inputs(kw)  # torch-free, as in solve
    runs_of_plan: tuple[RunOfPlan, ...] = ()
    if calibrate_from:
        # the metrics files and the plan they name, before the capture (seconds to minutes): a
        # wrong or broken file, or runs of different plans, fail at once; a cut-short line (a
        # killed run) is a warning
        from partc.plans.recalibrate import read_runs_of_plan

        runs_of_plan = read_runs_of_plan(calibrate_from)
        for read in runs_of_plan:
            for note in read.run.notes:
                click.echo(f"partc: warning: {note}", err=True)
    with held_interrupts():
        from partc.emit.compile import CompileOptions, compile_model
        from partc.plans.plan import format_plan
        from partc.progress import TerminalProgress

    progress = TerminalProgress()
    output = output if output is not None else Path("plans") / model.stem
    options = CompileOptions(batch_size=kw["batch_size"], search=search_options,
                             training=training, profile=kw["profile_path"],
                             capture_batch=kw["capture_batch"], costs=kw["costs"],
                             calibrate_from=runs_of_plan)
    result = compile_model(model, cluster, output, options, progress)
    click.echo(format_plan(result.plan, solver_wall_s=result.partition.solver.wall_s))
    click.echo(f"plan digest: {result.plan.content_digest()}")
    click.echo(f"wrote {output / 'plan.yaml'} and {result.plan.num_stages} stage files "
               f"in {result.timings['total_s']:.1f} s", err=True)


def _refuse_a_bad_model_file(model: Path) -> None:
    """Refuse a missing, unreadable or syntactically broken model file (torch-free) before the
    command imports torch and the capture stack, seconds that would only end in that one line."""
    from partc.frontend.model_source import refuse_bad_model_source

    refuse_bad_model_source(model)


def _refuse_a_bad_plan(plan: Path, *, files: bool = False, expect: str | None = None) -> None:
    """Read and validate the plan (torch-free) before the command imports torch: a missing,
    damaged or inconsistent plan is refused in a fraction of a second instead of after seconds
    of imports. `files`: also its stage files and model file against their recorded sha256 (for
    the commands that refuse a plan whose files changed: verify, launch; check reports them).
    `expect`: launch's --expect digest, checked first as launch checks it. The command reads and
    checks all of it again itself; this only fails it early."""
    from partc.plans.plan import load_plan

    loaded = load_plan(plan)
    if expect is not None:
        loaded.require_digest(expect)
    if files:
        loaded.check_stage_files()
        loaded.model_source()


@cli.command()
@click.argument("plan", type=UserPath())
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-4, show_default=True,
              help="Relative tolerance (of the largest reference magnitude per tensor).")
@click.option("--atol", type=click.FloatRange(min=0), default=1e-5, show_default=True,
              help="Absolute tolerance.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="RNG seed of both runs (dropout) and of a meta model's initialisation.")
@click.option("--device", default="cpu", show_default=True,
              help="Device both runs use (cpu, cuda, cuda:N).")
@click.option("--init-from", type=UserPath(dir_okay=False),
              help="A torch.save'd state_dict of the model: both runs take their weights from it "
                   "by FQN (as launch --init-from does) instead of the stage files or, for a "
                   "meta-device model, the model's own initialisation.")
@debug_option
def verify(plan: Path, rtol: float, atol: float, seed: int, device: str,
           init_from: Path | None) -> None:
    """Check a plan: schema, stage file hashes, and that the stages in sequence compute the model's
    outputs, loss and every gradient (exit 1 when above tolerance)."""
    _refuse_a_bad_plan(plan, files=True)
    with held_interrupts():
        from partc.emit.verify import format_report, verify_plan

    report = verify_plan(plan, rtol=rtol, atol=atol, seed=seed, device=device,
                         init_from=init_from)
    click.echo(format_report(report))
    if not report.ok:
        click.get_current_context().exit(1)


@cli.command()
@click.argument("plan", type=UserPath())
@dataclass_options(TrainOptions)
@dataclass_options(ElasticOptions)
@debug_option
def launch(plan: Path, **kw: Any) -> None:
    """Train a plan on torch.distributed: one process per device, pipeline x data parallel,
    started by torch's elastic launcher (torchrun's flags and semantics)."""
    _refuse_a_bad_plan(plan, files=True, expect=kw.get("expect"))
    from partc.run.launch import launch as run_plan

    run_plan(plan, from_flags(TrainOptions, kw), from_flags(ElasticOptions, kw))


@cli.command()
@click.argument("plans", nargs=-1, required=True, type=UserPath())
@click.option("--model", type=UserPath(dir_okay=False),
              help="The model file (default: the one recorded in the plan, relative to it).")
@debug_option
def check(plans: tuple[Path, ...], model: Path | None) -> None:
    """Is each of PLANS still what `partc compile` would write? Re-captures the model, compares
    its graph with the plan's and re-solves with the plan's recorded inputs. A directory stands
    for every plan.yaml under it. Exit 0: all current; 1: a plan is stale (what changed, what
    moves, old vs new throughput, the command that refreshes it); 2: bad input."""
    from partc.plans.check import find_plans, format_check
    from partc.progress import TerminalProgress

    def check_one(path: Path) -> int:
        _refuse_a_bad_plan(path)
        with held_interrupts():
            from partc.emit.check import (
                ISOLATED_ENV,
                check_in_child,
                check_plan,
                model_file_changed,
            )

        # a model file changed since compile is checked in a child process: its code cannot
        # make this process report the plan current
        if os.environ.get(ISOLATED_ENV) != "1" and model_file_changed(path, model):
            return check_in_child(path, model)
        report = check_plan(path, model, TerminalProgress())
        click.echo(format_check(report))
        return report.exit_code

    paths = find_plans(plans)
    if len(paths) == 1:
        click.get_current_context().exit(check_one(paths[0]))
    worst = 0
    for path in paths:  # keep going: CI wants every stale plan in one run
        try:
            code = check_one(path)
        except PartcError as exc:
            if _debug(click.get_current_context()):
                traceback.print_exc()
            click.echo(f"partc: error: {path}: {exc.one_line()}", err=True)
            code = 2
        worst = max(worst, code)
    click.get_current_context().exit(worst)


@cli.command()
@click.argument("old", type=UserPath())
@click.argument("new", type=UserPath())
@debug_option
def diff(old: Path, new: Path) -> None:
    """Show how plan NEW differs from plan OLD: shape, modules that change stage, per-stage
    devices, predicted times and memory, throughput. Exit 0 either way."""
    from partc.plans.diff import diff_layouts, format_diff, layout_of_plan
    from partc.plans.plan import load_plan

    a, b = load_plan(old), load_plan(new)
    click.echo(f"--- {old}\n+++ {new}")
    click.echo(format_diff(diff_layouts(layout_of_plan(a), layout_of_plan(b)), "old", "new"))


@cli.command()
@click.argument("plan", type=UserPath())
@click.option("--png", type=UserPath(dir_okay=False),
              help="Write the report picture here: simulated schedule (Gantt), memory and time "
                   "per stage.")
@click.option("--html", type=UserPath(dir_okay=False),
              help="Write a self-contained HTML report (the picture and the plan summary).")
@click.option("--metrics", type=UserPath(dir_okay=False),
              help="The metrics file of a run of PLAN (`partc launch --metrics`): add measured "
                   "vs predicted times and memory per stage, and measured bars to the picture.")
@debug_option
def show(plan: Path, png: Path | None, html: Path | None, metrics: Path | None) -> None:
    """Summarise PLAN: stages, devices, predicted times and memory per device, the simulated
    schedule's idle time; --png/--html draw it; --metrics sets a run beside the prediction.
    Reads plan.yaml (and the metrics file) only."""
    from partc.plans.plan import load_plan, refuse_plan_artifact
    from partc.plans.report import format_summary, render_html, render_png
    from partc.plans.run_metrics import RunMetrics

    loaded = load_plan(plan)
    inputs = (plan, *loaded.pinned_files(), *((metrics,) if metrics is not None else ()))
    for out, flag in ((png, "--png"), (html, "--html")):
        if out is not None:  # refused before drawing anything
            refuse_plan_artifact(out, flag, inputs)
    run = None
    if metrics is not None:
        run = RunMetrics.load(metrics)
        run.check_shape(loaded, f"plan {plan}")
        # a run of another plan file of the same stages (a recompile, a calibrated plan), or of
        # one that cannot be told any more, is shown with a warning; a provably other one is not
        which = run.check_run_of(loaded, f"plan {plan}")
        for note in (*run.notes, *((which,) if which else ())):
            click.echo(f"partc: warning: {note}", err=True)
    click.echo(format_summary(loaded, run))
    picture = None
    if png is not None:
        with writing_to(png, "--png", inputs):
            picture = render_png(loaded, png, metrics=run)
        click.echo(f"wrote {png}", err=True)
    if html is not None:
        with writing_to(html, "--html", inputs):
            render_html(loaded, html, picture, metrics=run)
        click.echo(f"wrote {html}", err=True)


@cli.command()
@click.option("--device", default="cpu", show_default=True,
              help="What to measure: cpu (one device = --threads cores), cuda or cuda:N.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="CPU cores (torch threads) per device (--device cpu).")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=20.0,
              show_default=True, help="Time budget of the device measurements (< 5: small "
                                      "sizes, a smoke test).")
@click.option("--name", default=None,
              help="Config name: the files' stem and the device's name [default: cpu, or the "
                   "GPU's name, e.g. nvidia-h100-80gb-hbm3].")
@click.option("--devices", type=click.IntRange(min=1), multiple=True,
              help="(--device cpu, repeatable) Also write clusters/NAME-N.yaml: this machine as "
                   "N processes; more than its cores (at --threads 1) share them.")
@click.option("--output", "-o", "out_dir", required=True,
              type=UserPath(file_okay=False),
              help="Configs folder to write devices/NAME.yaml and clusters/NAME.yaml into.")
@debug_option
def calibrate(device: str, threads: int, seconds: float, name: str | None,
              devices: tuple[int, ...], out_dir: Path) -> None:
    """Measure this machine's CPU or a CUDA GPU and write a device and a cluster config
    (OUT/devices/NAME.yaml, OUT/clusters/NAME.yaml) for `partc compile --cluster
    OUT/clusters/NAME.yaml`. Run it on an idle machine."""
    with held_interrupts():
        from partc.hardware.calibration import format_calibration
        from partc.run.overhead import calibrate_machine

    result = calibrate_machine(out_dir, device, name=name, threads=threads, seconds=seconds,
                               devices=devices)
    if result.other_processes_cores > 0.1:
        click.echo(f"partc: warning: other processes used {result.other_processes_cores:.0%} "
                   "of a core meanwhile; the numbers are low, rerun on an idle machine", err=True)
    click.echo(format_calibration(result))
    more = ", ".join(str(path) for _, path in result.more_clusters)
    click.echo(f"wrote {result.device_path} and {result.cluster_path}"
               + (f" (and {more})" if more else ""), err=True)


# Python randomises str hashes per process, so model code that iterates over a set of strings
# (HF ModernBERT's RoPE, over its layer types) captures a different graph in every process and
# `partc check` would call a just-compiled plan stale: every partc process runs with one seed
# (torchrun's workers inherit it).
HASH_SEED = "0"


def main() -> NoReturn:
    """The console script: click's standalone mode always exits with the command's exit code.
    Re-executes itself first where str hashing is not seeded with HASH_SEED."""
    release_held_signals()  # entered without partc.cli.entry (python -m cli.main): here
    if os.environ.get("PYTHONHASHSEED") != HASH_SEED:
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        with contextlib.suppress(OSError):  # where it cannot, it runs unseeded
            exec_holding_signals([sys.executable, *sys.orig_argv[1:]])
    cli.main(prog_name="partc")


if __name__ == "__main__":
    sys.exit(main())

"""The shared vocabulary of partc, and the options users set.

One definition of each word that several passes, the plan format and the command line share:
pipeline schedules, precisions, optimizers, strategies and placements are `Literal` types (mypy
checks every comparison against them) with their tuples of values for run-time checks and click
choices. The option types users set are documented dataclasses here too:

- `TrainingConfig`: how a stage is trained, as far as memory and time are concerned (optimizer,
  precision, schedule, activation checkpointing, sharding, memory margin);
- `SearchOptions`: what the user pins of the hybrid-parallel search and how hard it works;
- `TrainOptions`: how `partc launch` trains (steps, seeds, checkpoints, logging);
- `ElasticOptions`: torchrun's multi-node and restart flags for `partc launch`.

Each converts to and from plain data in one place: `to_dict`/`from_dict` (plan.yaml, JSON) and
`to_argv`/`add_arguments`+`from_namespace` (command lines), all driven by the fields themselves; a
field's command-line flag and help live in its metadata (`option(...)`), which the click CLI
(partc.cli) and the launch worker's argparse both read. This module imports nothing heavy: the
CLI reads choices and defaults from it at start-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, get_args

from partc.errors import LaunchError, MemoryConfigError, PartcError, SearchError

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
SCHEDULES: Final[tuple[Schedule, ...]] = get_args(Schedule)

# bf16-mixed: bf16 params, activations and boundary tensors for compute, fp32 master weights,
# fp32 gradient accumulation and fp32 optimizer states (Megatron-LM's recipe).
Precision = Literal["fp32", "bf16-mixed"]
PRECISIONS: Final[tuple[Precision, ...]] = get_args(Precision)


def matmul_dtype_of(precision: Precision) -> str:
    """The dtype a precision runs matrix products in (autocast's lower precision), whose speed
    spread and speed reference a device config gives (DeviceSpec.speed_modes)."""
    return "bfloat16" if precision == "bf16-mixed" else "float32"

Optimizer = Literal["sgd", "sgd-momentum", "adam", "adamw"]
OPTIMIZERS: Final[tuple[Optimizer, ...]] = get_args(Optimizer)

# How `partc profile` times operators: onnxruntime per node where the ONNX export worked (auto), or
# always onnxruntime, or torch's profiler alone.
ProfileMethod = Literal["auto", "onnxruntime", "torch"]
PROFILE_METHODS: Final[tuple[ProfileMethod, ...]] = get_args(ProfileMethod)
# Where compile's costs come from: measured on this machine, the analytic roofline, or auto
# (measured when the cluster is this machine, docs/cost-model.md).
CostsMode = Literal["auto", "measured", "analytic"]
COSTS_MODES: Final[tuple[CostsMode, ...]] = get_args(CostsMode)

# How stages are cut (partc.solve.strategies): CP-SAT over the block DAG, the exact contiguous DP,
# and the two baselines users hand-pick today (equal layers, equal parameters).
Strategy = Literal["cpsat", "chain-dp", "uniform", "params"]
STRATEGIES: Final[tuple[Strategy, ...]] = get_args(Strategy)

# How pipeline ranks map onto devices: a rank's replicas side by side (its all-reduce stays in a
# node) or a pipeline's ranks side by side (its point-to-point transfers stay in a node).
Placement = Literal["stage-major", "pipeline-major"]
PLACEMENTS: Final[tuple[Placement, ...]] = get_args(Placement)

# What a stage's data-parallel replicas shard among themselves instead of each holding a copy:
# nothing (DDP), the optimizer state (ZeRO-1: torch's ZeroRedundancyOptimizer; each replica
# steps the parameters it owns and broadcasts them), or the optimizer state and the gradients
# (ZeRO-2: each micro-batch's gradients are reduced to the replica owning them as they form,
# partc.run.gradient_sharding). docs/memory-model.md prices each.
Sharding = Literal["none", "optimizer", "gradients"]
SHARDINGS: Final[tuple[Sharding, ...]] = get_args(Sharding)
# What each sharding splits, in words (summaries and messages).
SHARDED_STATE: Final[dict[Sharding, str]] = {
    "none": "nothing", "optimizer": "optimizer state",
    "gradients": "optimizer state and gradients"}


@dataclass(frozen=True)
class OptimizerSpec:
    """What partc needs to know of an optimizer, in one place: the memory model, the cost of its
    step, and the torch optimizer launch builds (partc.run.training.build_optimizer)."""

    states: int  # state tensors per parameter (momentum buffer; Adam's two moments)
    step_accesses: int  # elements the step reads and writes per parameter element
    step_temporary: bool  # the foreach step allocates one parameter-sized temporary at once
    lr: float  # default learning rate (torch's, and 0.01 for SGD, which has none)
    weight_decay: float  # default weight decay (torch's)
    momentum: float = 0.0
    step_counter_bytes: int = 0  # per parameter tensor: Adam's `step`, a float32 scalar tensor
    # per step, whatever the parameters: the foreach step divides each tensor by a Python scalar,
    # which torch wraps as a float64 0-dim tensor and copies to float32 (8 + 4 bytes, live
    # together while one tensor's division runs; measured on CPU with torch.profiler)
    step_scalar_bytes: int = 0
    # kernels the step runs on each parameter tensor: torch's foreach step on a CPU runs every one
    # tensor by tensor, a dispatch each (`step_dispatch_s`). Measured per tensor on an Intel Xeon
    # VM, 1 thread: Adam 12.3 us, AdamW 14.2, SGD 1.2, SGD with momentum 4.0, these counts times
    # the 1.28 us CPU dispatch; a stage of many small tensors (ResNet's batch norms) steps in
    # 1 ms where its bytes take 0.1 ms.
    step_kernels: int = 1


OPTIMIZER_SPECS: Final[dict[Optimizer, OptimizerSpec]] = {
    # step_accesses: tensor-sized reads + writes of torch's default (foreach on GPUs, a loop
    # over parameters on CPUs: the same passes), not a fused kernel's minimum. SGD: p += -lr*g
    # (3). Momentum: buf.mul_().add_(g) (2 + 3), p.add_(buf) (3).
    "sgd": OptimizerSpec(states=0, step_accesses=3, step_temporary=False, lr=0.01,
                         weight_decay=0.0, step_kernels=1),
    "sgd-momentum": OptimizerSpec(states=1, step_accesses=8, step_temporary=False, lr=0.01,
                                  weight_decay=0.0, momentum=0.9, step_kernels=3),
    # Adam: m.lerp_(g) 3, v.mul_() 2, v.addcmul_(g, g) 3, sqrt(v) 2, div 2, add_(eps) 2,
    # p.addcdiv_(m, denom) 4 = 18; AdamW's decoupled decay p.mul_() adds 2. The foreach path
    # allocates sqrt(exp_avg_sq) for every parameter at once (step_temporary). Kernels per
    # tensor: the step count's add, lerp, mul, addcmul, sqrt, div, add, addcdiv and the bias
    # corrections' scalar reads (10); AdamW's decay one more.
    "adam": OptimizerSpec(states=2, step_accesses=18, step_temporary=True, lr=1e-3,
                          step_counter_bytes=4, step_scalar_bytes=12, weight_decay=0.0,
                          step_kernels=10),
    "adamw": OptimizerSpec(states=2, step_accesses=20, step_temporary=True, lr=1e-3,
                           step_counter_bytes=4, step_scalar_bytes=12, weight_decay=0.01,
                           step_kernels=11),
}

DEFAULT_MAX_BLOCKS: Final = 128  # CP-SAT proves 8-stage cuts in seconds at 128 (docs/solver.md)
# The batch size a model is captured at; costs are linear in the batch, so any small size works.
DEFAULT_CAPTURE_BATCH: Final = 2


def check_choice(what: str, value: object, choices: tuple[str, ...],
                 error: type[PartcError] = PartcError) -> None:
    """Raise `error` naming `what` unless `value` is one of `choices` (with a close match)."""
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(choices)}"
    raise error(f"unknown {what} {value!r} (expected one of {', '.join(choices)})", hint=hint)


# ---- fields with a command-line flag ---------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """A field's command-line face: its flag, help, and the range its value must lie in."""

    name: str  # "--stages"; a bool | None field also gets "--no-<name>"
    help: str = ""
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    path: Literal["file", "dir", ""] = ""  # for Path fields: what the path must name


def option(default: Any = dataclasses.MISSING, *, flag: str, help: str = "",
           min: float | None = None, max: float | None = None, min_open: bool = False,
           max_open: bool = False, path: Literal["file", "dir", ""] = "") -> Any:
    """A dataclass field settable from the command line as `flag`."""
    return field(default=default, metadata={"flag": Flag(flag, help, min, max, min_open,
                                                         max_open, path)})


T = TypeVar("T")


@dataclass(frozen=True)
class FlaggedField:
    """One command-line option of an option type: what a parser needs to know of the field."""

    name: str  # the field's name: the keyword argument / argparse dest
    flag: Flag
    kind: Any  # its type without None: int, float, str, bool, Path or a Literal of words
    optional: bool  # None allowed; a bool that may be None is a --flag/--no-flag pair
    default: Any  # None when the field has no default

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The words a Literal-typed option takes, None for other types."""
        return get_args(self.kind) if typing.get_origin(self.kind) is Literal else None

    @property
    def negative(self) -> str:
        """The flag that sets an optional bool to False: --no-<name>."""
        return "--no-" + self.flag.name.removeprefix("--")


def flagged_fields(cls: type) -> list[FlaggedField]:
    """The fields of an option type that have a command-line flag, in field order."""
    hints = typing.get_type_hints(cls)  # evaluates the postponed annotations
    found = []
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag")
        if flag is None:
            continue
        kind, optional = _without_none(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        found.append(FlaggedField(f.name, flag, kind, optional, default))
    return found


def _without_none(annotation: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed): `int | None` -> (int, True)."""
    args = get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), len(rest) < len(args)
    return annotation, False


def to_dict(options: Any) -> dict[str, Any]:
    """Every field as plain data (paths as strings), in field order."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        out[f.name] = str(value) if isinstance(value, Path) else value
    return out


def from_dict(cls: type[T], data: typing.Mapping[str, Any]) -> T:
    """An options object from plain data: the keys that are fields of `cls` (others are left to
    the caller), missing ones at their defaults; strings become paths where a field is a Path."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        value = data[f.name]
        if _without_none(hints[f.name])[0] is Path and isinstance(value, str):
            value = Path(value)
        values[f.name] = value
    return cls(**values)


def from_flags(cls: type[T], values: typing.Mapping[str, Any]) -> T:
    """The options parsed command-line values give, keyed by field name (click's keyword
    arguments, an argparse namespace's vars): only fields that have a flag are read, so the
    options of one command line can be several option types that share names."""
    names = {f.name for f in flagged_fields(cls)}
    return from_dict(cls, {k: v for k, v in values.items() if k in names})


def to_argv(options: Any, *, changed_only: bool = True) -> list[str]:
    """The command-line flags that give `options` (by default only those that differ from the
    field's default: the shortest command line)."""
    argv: list[str] = []
    for f in flagged_fields(type(options)):
        value = getattr(options, f.name)
        if changed_only and value == f.default:
            continue
        if isinstance(value, bool):
            if f.optional:
                argv.append(f.flag.name if value else f.negative)
            elif value:
                argv.append(f.flag.name)
        elif value is not None:
            argv += [f.flag.name, _format(value)]
    return argv


def _format(value: Any) -> str:
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else str(value)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """argparse arguments for every flagged field of `cls` (dest = the field name)."""
    for f in flagged_fields(cls):
        if f.kind is bool and f.optional:
            parser.add_argument(f.flag.name, dest=f.name, default=f.default,
                                action=argparse.BooleanOptionalAction, help=f.flag.help)
        elif f.kind is bool:
            parser.add_argument(f.flag.name, dest=f.name, action="store_true", help=f.flag.help)
        else:
            parser.add_argument(f.flag.name, dest=f.name, type=str if f.choices else f.kind,
                                default=f.default, choices=f.choices, help=f.flag.help)


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    """The options an argparse namespace (of `add_arguments(cls)`) holds."""
    return from_flags(cls, vars(namespace))


# ---- the option types ------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainingConfig:
    """How a stage is trained, as far as memory and time are concerned.

    `activation_checkpointing`: each in-flight micro-batch keeps only its stage inputs; the stage's
    forward is recomputed right before its backward. `sharding`: what the stage's data-parallel
    replicas shard among themselves (`Sharding`; `shards` of them). `memory_margin`: fraction of
    device memory kept free for allocator fragmentation, the CUDA context and communication
    libraries. The search sets `schedule` per pipeline shape and `activation_checkpointing`,
    `sharding` and `shards` per pipeline rank; users set the rest.
    """

    optimizer: Optimizer = option("adamw", flag="--optimizer", help="Optimizer the plan trains "
                                  "with (its states and step are priced).")
    precision: Precision = option("fp32", flag="--precision", help="fp32, or bf16-mixed (bf16 "
                                  "compute, fp32 master weights, gradients and states).")
    schedule: Schedule = "1f1b"
    activation_checkpointing: bool = False
    memory_margin: float = option(0.1, flag="--memory-margin", min=0, max=1, max_open=True,
                                  help="Fraction of device memory kept free.")
    sharding: Sharding = "none"
    shards: int = 1  # replicas the sharded state is split over (1: none)

    def __post_init__(self) -> None:
        check_choice("optimizer", self.optimizer, OPTIMIZERS, MemoryConfigError)
        check_choice("precision", self.precision, PRECISIONS, MemoryConfigError)
        check_choice("schedule", self.schedule, SCHEDULES, MemoryConfigError)
        check_choice("sharding", self.sharding, SHARDINGS, MemoryConfigError)
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise MemoryConfigError(f"shards must be an integer >= 1, got {self.shards!r}",
                                    hint="the replicas a sharded stage is split over")
        if not isinstance(self.activation_checkpointing, bool):
            raise MemoryConfigError(
                f"activation_checkpointing must be true or false, got "
                f"{self.activation_checkpointing!r}", hint="pass a boolean")
        margin = self.memory_margin
        if (isinstance(margin, bool) or not isinstance(margin, (int, float))
                or not math.isfinite(margin) or not 0 <= margin < 1):
            raise MemoryConfigError(
                f"memory_margin must be a fraction in [0, 1), got {margin!r}",
                hint="e.g. 0.1 keeps 10% of device memory free")

    @property
    def bf16(self) -> bool:
        """Compute (activations, boundary tensors, weights used) in bfloat16."""
        return self.precision == "bf16-mixed"

    @property
    def matmul_dtype(self) -> str:
        """The dtype the precision runs matrix products in (autocast's lower precision), whose
        speed spread the device config gives (DeviceSpec.speed_modes)."""
        return matmul_dtype_of(self.precision)

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        return OPTIMIZER_SPECS[self.optimizer]

    @property
    def optimizer_shards(self) -> int:
        """Replicas the optimizer state is split over (1: each holds all of it)."""
        return self.shards if self.sharding != "none" else 1

    @property
    def gradient_shards(self) -> int:
        """Replicas the gradients are split over (1: each holds all of them)."""
        return self.shards if self.sharding == "gradients" else 1


@dataclass(frozen=True)
class SearchOptions:
    """What the user pins of the search (None: searched) and how hard the solver works."""

    strategy: Strategy = option("cpsat", flag="--strategy", help="How stages are cut.")
    stages: int | None = option(None, flag="--stages", min=1, help="Pin the pipeline stages.")
    replicas: int | None = option(None, flag="--replicas", min=1,
                                  help="Pin the data-parallel replicas.")
    num_microbatches: int | None = option(None, flag="--microbatches", min=1,
                                          help="Pin the micro-batch count.")
    schedule: Schedule | None = option(None, flag="--schedule", help="Pin the pipeline schedule.")
    activation_checkpointing: bool | None = option(
        None, flag="--checkpointing",
        help="Pin activation checkpointing on or off for every stage (default: searched, per "
             "stage: a stage recomputes only where its memory needs it).")
    sharding: Sharding | None = option(
        None, flag="--sharding",
        help="Pin what every stage's data-parallel replicas shard (none; optimizer: ZeRO-1; "
             "gradients: ZeRO-2, optimizer state and gradients) (default: searched, per stage).")
    max_blocks: int = option(DEFAULT_MAX_BLOCKS, flag="--max-blocks", min=1,
                             help="Blocks the graph is coarsened to before solving.")
    time_limit_s: float = option(10.0, flag="--time-limit", min=0, min_open=True,
                                 help="CP-SAT deterministic seconds per refined shape.")
    workers: int = 2  # CP-SAT workers: fixed, so that the same inputs give the same plan
    refine: int = option(1, flag="--refine", min=1,
                         help="Best shapes CP-SAT optimises after the DP screen.")
    max_microbatches: int = 64

    # The fields that pin the pipeline shape (plan.yaml's costs.pinned).
    PINNED: typing.ClassVar[tuple[str, ...]] = (
        "stages", "replicas", "num_microbatches", "schedule", "activation_checkpointing",
        "sharding")

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, STRATEGIES, SearchError)
        if self.schedule is not None:
            check_choice("schedule", self.schedule, SCHEDULES, SearchError)
        if self.sharding is not None:
            check_choice("sharding", self.sharding, SHARDINGS, SearchError)
        for name in ("stages", "replicas", "num_microbatches"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise SearchError(f"{name} must be an integer >= 1, got {value!r}",
                                  hint="leave it out to let partc search it")
        if not self.time_limit_s > 0:
            raise SearchError(f"time limit must be > 0 s, got {self.time_limit_s}",
                              hint="e.g. --time-limit 10")
        for name in ("refine", "workers", "max_microbatches", "max_blocks"):
            if getattr(self, name) < 1:
                raise SearchError(f"{name} must be >= 1, got {getattr(self, name)}",
                                  hint="use a positive number")

    def pinned(self) -> dict[str, Any]:
        """The pinned shape choices (those not left to the search)."""
        return {k: getattr(self, k) for k in self.PINNED if getattr(self, k) is not None}


@dataclass(frozen=True)
class TrainOptions:
    """How long and how to train; every rank gets the same options (as command-line flags)."""

    steps: int = option(10, flag="--steps", min=1, help="Training steps (global batches) to run, "
                        "counted from step 0; a resumed run continues up to this step.")
    seed: int = option(0, flag="--seed", help="Seed of dropout (per step and rank) and of a meta "
                       "model's initialisation.")
    lr: float | None = option(None, flag="--lr", help="Learning rate [default: 1e-3 for "
                              "adam/adamw, 0.01 sgd].")
    weight_decay: float | None = option(None, flag="--weight-decay",
                                        help="Weight decay [default: 0.01 for adamw, else 0].")
    checkpoint_dir: Path | None = option(
        None, flag="--checkpoint-dir", path="dir",
        help="Write per-stage checkpoints (model + optimizer, by parameter name) and a manifest "
             "here; an elastic restart resumes from the newest complete one.")
    checkpoint_every: int = option(0, flag="--checkpoint-every", min=0,
                                   help="Checkpoint every K steps (0: only after the last step).")
    keep_checkpoints: int = option(2, flag="--keep-checkpoints", min=1,
                                   help="Complete checkpoints kept; older ones are deleted.")
    resume: bool = option(False, flag="--resume", help="Continue from the newest complete "
                          "checkpoint in --checkpoint-dir.")
    init_from: Path | None = option(
        None, flag="--init-from", path="file",
        help="Initial weights by FQN, instead of the stage files' or a meta model's own "
             "initialisation: a torch.save'd state_dict (or a checkpoint dict holding one, or a "
             "partc checkpoint's stage file), a safetensors file, or a sharded checkpoint's "
             "*.index.json. A wrapper's prefix (module., _orig_mod.) is read away.")
    metrics: Path | None = option(None, flag="--metrics", path="file", help="Append one JSON "
                                  "line per step (loss, samples/s, per-stage times) here.")
    trace: Path | None = option(
        None, flag="--trace", path="dir",
        help="Write a torch.profiler trace of one step (the third) per rank here: rank<R>.json "
             "(Chrome/Perfetto) and rank<R>.txt (operators and kernels ranked by time).")
    log_every: int = option(1, flag="--log-every", min=1, help="Print a progress line every N "
                            "steps (when stderr is not a terminal).")
    expect: str | None = option(
        None, flag="--expect",
        help="Run only if the plan's digest (printed by compile and check: sha256 of plan.yaml, "
             "which records every stage file's and the model file's sha256) is this one; pins a "
             "reviewed plan from outside it.")
    allow_other_model: bool = option(False, flag="--allow-other-model", help="--resume from a "
                                     "checkpoint written by a plan of another model (graph "
                                     "hash); its tensors are still matched by name and shape.")
    allow_nonfinite_loss: bool = option(
        False, flag="--allow-nonfinite-loss",
        help="Train on through steps whose loss is NaN or infinite (by default the run stops at "
             "the first, before a checkpoint can keep the weights it updated).")

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise LaunchError(f"--steps must be at least 1, got {self.steps}",
                              hint="e.g. --steps 100")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.log_every < 1:
            raise LaunchError("--checkpoint-every must be >= 0, --keep-checkpoints and "
                              "--log-every >= 1",
                              hint="e.g. --checkpoint-every 50 --keep-checkpoints 2")
        if self.resume and self.checkpoint_dir is None:
            raise LaunchError("--resume needs --checkpoint-dir",
                              hint="pass the directory an earlier launch wrote checkpoints to")
        if self.lr is not None and not self.lr > 0:
            raise LaunchError(f"--lr must be positive, got {self.lr}", hint="e.g. --lr 1e-4")


@dataclass(frozen=True)
class ElasticOptions:
    """torchrun's multi-node and fault-tolerance flags, with torchrun's meaning."""

    nnodes: int = option(1, flag="--nnodes", min=1, help="Nodes (as torchrun); the plan's "
                         "processes are split evenly over them.")
    node_rank: int = option(0, flag="--node-rank", min=0, help="This node's rank (as torchrun).")
    rdzv_endpoint: str = option("", flag="--rdzv-endpoint", help="HOST:PORT of the rendezvous "
                                "(as torchrun); required with --nnodes > 1.")
    rdzv_backend: str = option("c10d", flag="--rdzv-backend", help="As torchrun.")
    rdzv_id: str = option("partc", flag="--rdzv-id", help="Job id (as torchrun).")
    max_restarts: int = option(0, flag="--max-restarts", min=0, help="Restart all workers up to "
                               "N times when one fails (as torchrun); they resume from the newest "
                               "checkpoint.")
    monitor_interval: float = 0.1

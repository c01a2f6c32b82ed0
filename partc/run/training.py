"""What a training run of a plan is, independent of how it is distributed: options, optimizer,
data, seeds, and the single-process reference run that `partc launch` must reproduce.

`partc launch` (partc.run.runtime, one process per device) and `train_single_process` (the whole
model in one process) build their optimizer, draw their batches and seed their steps through the
same functions here, so "the distributed run equals single-process training" is a comparison of
two executions of one definition.
"""
from __future__ import annotations

import argparse
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.utils._pytree as pytree

from partc.errors import PartcError
from partc.frontend.model_file import Inputs, ModelFile, load_model_file
from partc.plans.plan import Plan, PlanError

# Defaults per optimizer: torch's own, except a learning rate for SGD (torch has none).
DEFAULT_LR = {"sgd": 0.01, "sgd-momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}
DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "sgd-momentum": 0.0, "adam": 0.0, "adamw": 0.01}


class LaunchError(PartcError):
    """A launch that cannot start or continue: bad options, world size, environment."""


@dataclass(frozen=True)
class TrainOptions:
    """How long and how to train; every rank gets the same options (as command-line flags)."""

    steps: int = 10
    seed: int = 0
    lr: float | None = None  # None: DEFAULT_LR of the plan's optimizer
    weight_decay: float | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # 0: only after the last step (when checkpoint_dir is set)
    keep_checkpoints: int = 2
    resume: bool = False
    init_from: Path | None = None
    metrics: Path | None = None  # JSON lines, one per step, written by rank 0
    log_every: int = 1

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise LaunchError(f"--steps must be at least 1, got {self.steps}", hint="e.g. --steps 100")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.log_every < 1:
            raise LaunchError("--checkpoint-every must be >= 0, --keep-checkpoints and --log-every "
                              ">= 1", hint="e.g. --checkpoint-every 50 --keep-checkpoints 2")
        if self.resume and self.checkpoint_dir is None:
            raise LaunchError("--resume needs --checkpoint-dir",
                              hint="pass the directory an earlier launch wrote checkpoints to")
        if self.lr is not None and not self.lr > 0:
            raise LaunchError(f"--lr must be positive, got {self.lr}", hint="e.g. --lr 1e-4")

    def argv(self) -> list[str]:
        """These options as the flags `python -m partc.launch` parses (`parse_train_options`)."""
        out = ["--steps", str(self.steps), "--seed", str(self.seed),
               "--checkpoint-every", str(self.checkpoint_every),
               "--keep-checkpoints", str(self.keep_checkpoints), "--log-every", str(self.log_every)]
        for flag, value in (("--lr", self.lr), ("--weight-decay", self.weight_decay),
                            ("--checkpoint-dir", self.checkpoint_dir),
                            ("--init-from", self.init_from), ("--metrics", self.metrics)):
            if value is not None:
                out += [flag, str(value)]
        return out + (["--resume"] if self.resume else [])


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of TrainOptions, for the per-rank entry point (`python -m partc.launch`)."""
    d = TrainOptions()
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--weight-decay", type=float)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-from", type=Path)
    parser.add_argument("--metrics", type=Path)
    parser.add_argument("--log-every", type=int, default=d.log_every)


def train_options_from(ns: argparse.Namespace) -> TrainOptions:
    return TrainOptions(steps=ns.steps, seed=ns.seed, lr=ns.lr, weight_decay=ns.weight_decay,
                        checkpoint_dir=ns.checkpoint_dir, checkpoint_every=ns.checkpoint_every,
                        keep_checkpoints=ns.keep_checkpoints, resume=ns.resume,
                        init_from=ns.init_from, metrics=ns.metrics, log_every=ns.log_every)


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], options: TrainOptions
                    ) -> torch.optim.Optimizer | None:
    """The plan's optimizer over `params` (None when there are none: a stage without weights).
    foreach kernels, as the memory model assumes."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return None
    lr = options.lr if options.lr is not None else DEFAULT_LR[name]
    wd = options.weight_decay if options.weight_decay is not None else DEFAULT_WEIGHT_DECAY[name]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=wd, foreach=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd, foreach=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=True)
    raise PlanError(f"unknown optimizer {name!r} in the plan",
                    hint="use a plan written by this partc (sgd, sgd-momentum, adam, adamw)")


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one step on one rank (dropout): a function of the step, so a resumed run
    draws what the uninterrupted one drew without saving RNG state."""
    return zlib.crc32(f"{seed}:{step}:{rank}".encode()) & 0x7FFFFFFF


def model_file_of(plan: Plan) -> ModelFile:
    path = plan.model_path
    if not path.is_file():
        raise PlanError(f"the plan's model file {plan.model.file} (resolved to {path}) is missing",
                        hint="keep the plan directory where compile wrote it relative to the "
                             "model file, or re-run partc compile")
    return load_model_file(path)


def global_batches(model_file: ModelFile, plan: Plan) -> Iterator[tuple[Inputs, Any]]:
    """The run's batches of global_batch_size samples, from the model file's batches() or
    synthetic ones (`ModelFile.data`). Draw them with `next_batch`."""
    batch = int(plan.training["global_batch_size"])
    m = plan.microbatch_size
    first = tuple(plan.model.outputs[0].shape)
    shape = (batch, *first[1:]) if first and first[0] == m else first
    return iter(model_file.data(batch, output_shape=shape))


def next_batch(data: Iterator[tuple[Inputs, Any]], seed: int, step: int) -> tuple[Inputs, Any]:
    """Step `step`'s batch. Drawn under an RNG seeded by (seed, step) alone and restored after,
    so a batches() that uses torch's global RNG gives every rank (the first stage's inputs, the
    last stage's targets) the same samples, and a resumed run the same batches."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step_seed(seed, step, -1))
        try:
            return next(data)
        except StopIteration:
            raise LaunchError(f"the model file's batches() ran out at step {step + 1}",
                              hint="make batches() yield at least --steps batches (e.g. loop "
                                   "over epochs)") from None


def batched_flags(flat: list[Any], batch: int) -> tuple[bool, ...]:
    """Per flat model input: does it carry the batch in dim 0? Others (a shared mask, a table)
    go whole to every replica and micro-batch."""
    return tuple(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
                 for t in flat)


def check_inputs(flat: list[Any], plan: Plan, batched: tuple[bool, ...]) -> None:
    """The model file's batch must have the plan's input shapes (at the global batch size)."""
    batch = int(plan.training["global_batch_size"])
    if len(flat) != len(plan.model.inputs):
        raise LaunchError(f"the model file's batches give {len(flat)} input tensors, the plan "
                          f"has {len(plan.model.inputs)}", hint="re-run partc compile")
    for t, ref, b in zip(flat, plan.model.inputs, batched):
        want = (batch, *ref.shape[1:]) if b else tuple(ref.shape)
        if tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != ref.dtype:
            raise LaunchError(f"input {ref.path or ref.name} of a batch is {tuple(t.shape)} "
                              f"{str(t.dtype).removeprefix('torch.')}, the plan needs {want} "
                              f"{ref.dtype}", hint="batches(batch_size) must yield full batches "
                              "shaped like example_inputs(batch_size)")


def output_spec(plan: Plan, model_file: ModelFile) -> pytree.TreeSpec:
    """The model's output structure, to rebuild the last stage's flat outputs for loss_fn."""
    if plan.model.output_spec:
        return pytree.treespec_loads(plan.model.output_spec)
    from partc.frontend.model_file import inputs_to_meta

    with torch.device("meta"):  # never materialise the model for its output structure
        model = model_file.build().to("meta").train()
    args, kwargs = inputs_to_meta(model_file.inputs(plan.microbatch_size))
    with torch.no_grad():
        return pytree.tree_flatten(model(*args, **kwargs))[1]


def train_single_process(plan: Plan, options: TrainOptions, chunks: int = 1,
                         device: str = "cpu") -> list[float]:
    """Train the whole model in this process for options.steps steps, the way the plan's run
    does (same initial weights, optimizer, batches, loss); returns the loss per step.

    chunks > 1 runs each batch as that many equal micro-batches with gradient accumulation (the
    mean of their losses), which is what a pipeline x data-parallel run computes; equal to one
    whole batch for models without batch-coupled layers (batch norm)."""
    from partc.emit.stage_code import load_stage
    from partc.emit.stage_weights import load_state_dict_file, whole_model_weights

    plan.check_stage_files()
    model_file = model_file_of(plan)
    dev = torch.device(device)
    model = model_file.build().train()
    stages = [] if plan.model.on_meta else [load_stage(plan.stage_path(s), map_location=dev)
                                            for s in plan.stages]
    checkpoint = load_state_dict_file(options.init_from) if options.init_from else None
    whole_model_weights(model, model_file, plan.model.on_meta, stages, plan.model.aliases(),
                        dev, options.seed, checkpoint=checkpoint)
    optimizer = build_optimizer(plan.training["optimizer"], model.parameters(), options)
    loss_fn = model_file.loss()
    batch = int(plan.training["global_batch_size"])
    losses = []
    data = global_batches(model_file, plan)
    for step in range(options.steps):
        (args, kwargs), target = next_batch(data, options.seed, step)
        torch.manual_seed(step_seed(options.seed, step, 0))
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for piece, tgt in zip(split_batch((args, kwargs), batch, chunks),
                              split_batch(target, batch, chunks)):
            a, k = pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t,
                                   piece)
            tgt = pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, tgt)
            loss = loss_fn(model(*a, **k), tgt) / chunks
            loss.backward()
            total += float(loss.detach())
        if optimizer is not None:
            optimizer.step()
        losses.append(total)
    return losses


def split_batch(value: Any, batch: int, chunks: int) -> list[Any]:
    """Split inputs or a target (any structure) into `chunks` equal parts along dim 0 of every
    tensor that has the batch there; the rest go whole to each part (as in `batched_flags`).
    Replicas and micro-batches are cut this way."""
    if chunks == 1:
        return [value]
    leaves, spec = pytree.tree_flatten(value)
    out = []
    for c in range(chunks):
        pieces = [torch.tensor_split(x, chunks)[c]
                  if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x
                  for x in leaves]
        out.append(pytree.tree_unflatten(pieces, spec))
    return out

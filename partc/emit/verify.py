"""`partc verify`: do the plan's stage files compute what the model computes?

Checks, in order, stopping at the first failure of the first three:
1. plan.yaml against the schema (partc.plans.plan.load_plan);
2. every stage file's SHA-256 against plan.yaml, before any stage file is loaded;
3. each stage's tensors, inputs and outputs against plan.yaml (names; count, shape, dtype);
4. numerics: one micro-batch from the model file's data (or synthetic data) through the eager
   model (forward, loss_fn, backward) and through the stages in sequence, the way
   torch.distributed.pipelining runs them (each stage's inputs detached, its backward driven by
   the gradients of the next stage's inputs), then the model outputs, the loss and every
   parameter gradient compared (a tied parameter's gradient is the sum over the stages holding
   it), and so are the floating-point buffers after the forward (batch-norm running statistics).

Both runs use the same weights (the stage files', loaded into the eager model by FQN, which also
checks that a normal state_dict maps onto the stages; for a meta-device model both get the model's
own initialisation, partc.emit.stage_weights) and the same RNG seed, so dropout masks agree when the
stages run the random operators in the model's order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from partc.emit.stage_code import load_stage
from partc.emit.stage_graph import flatten_inputs
from partc.emit.stage_weights import (
    check_stage_tensors,
    plan_weights,
    set_stage_tensors,
    stage_state,
    whole_model_weights,
)
from partc.errors import summarize_exception
from partc.plans.plan import Plan, PlanError, load_plan

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5


@dataclass(frozen=True)
class Comparison:
    """One compared tensor: max |stages - eager| and the allowed error."""

    what: str  # "output <path>", "loss", "grad <fqn>"
    max_abs_error: float
    max_abs_reference: float
    allowed: float

    @property
    def ok(self) -> bool:
        return self.max_abs_error <= self.allowed


@dataclass
class VerifyReport:
    plan: Plan
    comparisons: list[Comparison] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # structural failures (missing grads, ...)
    notes: list[str] = field(default_factory=list)  # what was read differently than stored

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.comparisons)

    def worst(self, prefix: str) -> Comparison | None:
        rows = [c for c in self.comparisons if c.what.startswith(prefix)]
        return max(rows, key=lambda c: (c.max_abs_error / c.allowed if c.allowed else 0.0),
                   default=None)


def verify_plan(path: str | Path, *, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL,
                seed: int = 0, device: str = "cpu",
                init_from: str | Path | None = None) -> VerifyReport:
    """Run every check of the module docstring; structural failures raise PlanError, numerical
    ones are in the report (`report.ok`). `init_from`: a state_dict file both runs take their
    weights from by FQN (the `--init-from` path of launch) instead of the stage files or the
    model's own initialisation."""
    plan = load_plan(path)
    plan.check_stage_files()
    dev = _device(device)
    # imported first: its imports register the custom operators the stage files call
    model_file = plan.load_model_file()
    stages = [load_stage(plan.stage_bytes(s), map_location=dev) for s in plan.stages]
    for st, module in zip(plan.stages, stages, strict=True):
        check_stage_tensors(module, st)
    model = model_file.build().train()
    aliases = plan.model.aliases()
    report = VerifyReport(plan=plan)
    weights = plan_weights(init_from, plan) if init_from is not None else None
    if weights is not None and weights.note(str(init_from)):
        report.notes.append(str(weights.note(str(init_from))))
    checkpoint = weights.state if weights is not None else None
    whole = whole_model_weights(model, model_file, plan.model.on_meta, stages, aliases, dev, seed,
                                checkpoint=checkpoint)
    for st, module in zip(plan.stages, stages, strict=True):
        # the stage's tensors as launch gets them: checkpoint, stage file, own initialisation
        mine = stage_state(module, st.parameter_names, st.buffer_names, checkpoint=checkpoint,
                           aliases=aliases, model_file=model_file, device=dev, seed=seed,
                           where=str(init_from) if init_from else f"stage {st.index}")
        if plan.model.on_meta and checkpoint is None:
            # initialised alone, a stage must get the whole model's values
            differ = [n for n, t in mine.items() if not torch.equal(t, whole[n])]
            if differ:
                report.problems.append(f"stage {st.index} initialised alone differs from the "
                                       f"whole model's initialisation in {', '.join(differ[:3])}")
        set_stage_tensors(module, mine)
        module.train()

    inputs, target = model_file.first_batch(plan.microbatch_size,
                                            output_shape=plan.model.outputs[0].shape)
    inputs = _to(inputs, dev)
    target = _to(target, dev)
    loss_fn = model_file.loss()

    # ---- eager ----------------------------------------------------------------------------
    torch.manual_seed(seed)
    # a copy: forward() may change its inputs in place (`x.mul_(2)`), and the stages get them next
    args, kwargs = pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, inputs)
    try:
        out = model(*args, **kwargs)
        loss = loss_fn(out, target)
        loss.backward()
    except RuntimeError as exc:  # an operator without a kernel on this device (a meta model's)
        report.problems.append(f"the model itself fails to run on {dev.type}: "
                               f"{summarize_exception(exc, 200)}")
        return report
    ref_flat, out_spec = pytree.tree_flatten(out)
    ref_grads = {n: p.grad for n, p in model.named_parameters()}

    # ---- stages ---------------------------------------------------------------------------
    flat = flatten_inputs(inputs, pytree.treespec_loads(plan.model.input_spec)) \
        if plan.model.input_spec else pytree.tree_leaves(inputs)
    torch.manual_seed(seed)
    current = [t.to(dev) for t in flat]
    boundary_inputs: list[list[torch.Tensor]] = []
    boundary_outputs: list[tuple[torch.Tensor, ...]] = []
    for st, module in zip(plan.stages, stages, strict=True):
        # as launch runs them (stage_runner.boundary_tensors): the model's inputs need no
        # gradient (forward() may change them in place, as eagerly), a boundary's do
        taken = [t.detach().requires_grad_(t.is_floating_point() and st.index > 0)
                 for t in current]
        if len(taken) != len(st.inputs):
            report.problems.append(f"stage {st.index} gets {len(taken)} tensors, plan.yaml lists "
                                   f"{len(st.inputs)} inputs")
            return report
        try:
            outs = module(*taken)
        except RuntimeError as exc:
            report.problems.append(f"stage {st.index} fails to run: "
                                   f"{summarize_exception(exc, 200)}")
            return report
        _check_io(report, st.index, outs, st.outputs)
        boundary_inputs.append(taken)
        boundary_outputs.append(outs)
        current = list(outs)
    if report.problems:
        return report
    stage_out = pytree.tree_unflatten(current, out_spec)
    stage_loss = loss_fn(stage_out, target)
    grads_in: list[torch.Tensor | None] | None = None
    for k in range(len(stages) - 1, -1, -1):
        outs = boundary_outputs[k]
        if grads_in is None:
            stage_loss.backward()
        else:
            # stage k+1's inputs are stage k's outputs, so one gradient per output
            pairs = [(o, g) for o, g in zip(outs, grads_in, strict=True)
                     if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads_in = [t.grad if t.requires_grad else None for t in boundary_inputs[k]]

    # ---- compare --------------------------------------------------------------------------
    if len(ref_flat) != len(current):
        report.problems.append(f"the stages return {len(current)} outputs, the model "
                               f"{len(ref_flat)}")
        return report
    # plan.yaml's output list is input here: a mismatch must not crash the check
    for ref, got, spec in zip(ref_flat, current, plan.model.outputs, strict=False):
        report.comparisons.append(_compare(f"output {spec.path}", got, ref, rtol, atol))
    report.comparisons.append(_compare("loss", stage_loss, loss, rtol, atol))
    # buffers the forward updates in place (batch-norm running statistics) must agree too
    model_buffers = dict(model.named_buffers(remove_duplicate=False))
    for module in stages:
        for name, buf in module.named_buffers():
            if name in model_buffers:
                report.comparisons.append(_compare(f"buffer {name}", buf, model_buffers[name],
                                                   rtol, atol))
    summed: dict[str, torch.Tensor] = {}
    for module in stages:
        for name, p in module.named_parameters():
            if p.grad is not None:
                summed[name] = summed[name] + p.grad if name in summed else p.grad
    for name, ref_grad in sorted(ref_grads.items()):
        got = next((summed[n] for n in (name, *aliases.get(name, ())) if n in summed), None)
        if ref_grad is None and got is None:
            continue
        if ref_grad is None or got is None:
            report.problems.append(f"parameter {name} has a gradient in "
                                   f"{'the stages' if ref_grad is None else 'the model'} only")
            continue
        report.comparisons.append(_compare(f"grad {name}", got, ref_grad, rtol, atol))
    return report


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise PlanError(f"unknown device {name!r}", hint="use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(f"device {name} requested but torch sees no CUDA device",
                        hint="use --device cpu on this machine")
    if device.type not in ("cpu", "cuda"):
        raise PlanError(f"device {name} is not supported", hint="use cpu, cuda or cuda:N")
    return device


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _check_io(report: VerifyReport, index: int, outs: Any, expected: Any) -> None:
    if not isinstance(outs, tuple) or len(outs) != len(expected):
        returned = len(outs) if isinstance(outs, tuple) else 1
        report.problems.append(f"stage {index} returns {returned} tensor(s), plan.yaml lists "
                               f"{len(expected)}")
        return
    for t, ref in zip(outs, expected, strict=True):
        if tuple(t.shape) != tuple(ref.shape) or str(t.dtype).removeprefix("torch.") != ref.dtype:
            report.problems.append(f"stage {index} output {ref.name} is {tuple(t.shape)} "
                                   f"{t.dtype}, plan.yaml says {tuple(ref.shape)} {ref.dtype}")


def _compare(what: str, got: torch.Tensor, ref: torch.Tensor, rtol: float,
             atol: float) -> Comparison:
    got = got.detach().double()
    ref = ref.detach().double()
    if got.shape != ref.shape:
        return Comparison(what=f"{what} (shape {tuple(got.shape)} vs {tuple(ref.shape)})",
                          max_abs_error=float("inf"), max_abs_reference=0.0, allowed=0.0)
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    return Comparison(what=what, max_abs_error=err, max_abs_reference=scale,
                      allowed=atol + rtol * scale)


def format_report(report: VerifyReport) -> str:
    """The summary `partc verify` prints: max errors per kind, failures listed."""
    plan = report.plan
    lines = [f"{plan.model.name}: {plan.num_stages} stage files match plan.yaml (sha256)"]
    lines += [f"  note: {n}" for n in report.notes]
    for kind, label in (("output", "outputs"), ("loss", "loss"), ("grad", "gradients"),
                        ("buffer", "buffers")):
        rows = [c for c in report.comparisons if c.what.startswith(kind)]
        if not rows:
            continue
        worst = report.worst(kind)
        assert worst is not None
        bad = sum(not c.ok for c in rows)
        lines.append(f"  {label:<10} {len(rows):>4} compared, "
                     f"max abs error {worst.max_abs_error:.3g} "
                     f"({worst.what}; allowed {worst.allowed:.3g})"
                     + (f", {bad} above tolerance" if bad else ""))
    for c in report.comparisons:
        if not c.ok:
            lines.append(f"  FAIL {c.what}: max abs error {c.max_abs_error:.3g} > {c.allowed:.3g}")
    for p in report.problems:
        lines.append(f"  FAIL {p}")
    lines.append("verify: " + ("ok" if report.ok else "FAILED"))
    return "\n".join(lines)


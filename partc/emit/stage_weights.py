"""How weights reach a stage: from its file, from a checkpoint by FQN, or from the model's own
initialisation, one stage at a time (a meta-device model is never materialised whole).

Stage files of a real model carry its weights (`weights: stage-files` in plan.yaml). A meta-device
model's stage files carry code and parameter shapes only (`weights: initialise-at-launch`); before
it runs, each stage gets real tensors by FQN, from one of:

- a weights file (`--init-from model.pt`: a torch.save'd state_dict of the original model, a
  safetensors file or a sharded checkpoint's index, `partc.emit.weights_file`; mapped or read
  lazily, so a process reads only its stage's tensors; tied weights may appear under any alias), or
- the model's own initialisation (`initial_state`): build_model() on meta, give real storage to just
  the modules that own the stage's tensors, and initialise each of them with the model's own code:
  Hugging Face models through their `_init_weights(module)`, other modules through their
  `reset_parameters()`. Each module's initialisation runs under a seed derived from the run seed and
  the module's path, so a module gets the same values whichever stage (or process, or replica)
  initialises it, and the same values as a whole-model initialisation (`partc verify` checks this).
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from partc.emit.weights_file import ModelWeights, WeightsError, for_model, read_weights_file
from partc.frontend.export import tied_groups
from partc.frontend.model_file import ModelFile
from partc.plans.plan import Plan, PlanError, PlanStage


def stage_tensors(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a (TorchScript) stage by FQN."""
    return {**dict(stage.named_parameters()), **dict(stage.named_buffers())}


def set_stage_tensors(stage: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Replace the stage's tensors named in `values` (new storage: works on meta stages). Parameters
    stay parameters with their requires_grad."""
    params = dict(stage.named_parameters())
    for name, value in values.items():
        path, _, leaf = name.rpartition(".")
        owner = stage
        for part in path.split(".") if path else []:  # ScriptModules have no get_submodule
            owner = getattr(owner, part)
        if name in params:
            setattr(owner, leaf, torch.nn.Parameter(value.detach().clone(),
                                                    requires_grad=params[name].requires_grad))
        else:
            setattr(owner, leaf, value.detach().clone())


def _get(model: torch.nn.Module, name: str) -> torch.Tensor:
    path, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(path) if path else model, leaf)


def _module_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _owners(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.nn.Module]:
    """Module path -> module, for every module that directly owns one of `names`."""
    owners: dict[str, torch.nn.Module] = {}
    for name in names:
        path, _, _ = name.rpartition(".")
        try:
            owners[path] = model.get_submodule(path) if path else model
        except AttributeError:
            raise WeightsError(f"the model has no module {path!r} (for {name})",
                               hint="the model file changed since the plan was compiled; "
                                    "re-run partc compile") from None
    return owners


def _hf_initialiser(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The nearest Hugging Face PreTrainedModel at or above `path` (it knows how to initialise
    its modules), or None."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        candidate = model.get_submodule(".".join(parts[:depth])) if depth else model
        if callable(getattr(candidate, "_init_weights", None)) and hasattr(candidate, "config"):
            return candidate
    return None


@torch.no_grad()
def initial_state(model_file: ModelFile, names: Iterable[str], device: torch.device | str,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors `names` (FQNs of parameters and buffers) as the model's own initialisation makes
    them, on `device`, materialising only the modules that own them (module docstring)."""
    names = sorted(set(names))
    device = torch.device(device)
    model = model_file.build()
    groups = tied_groups(model)
    wanted = sorted({alias for n in names for alias in groups.get(n, (n,))})
    owners = _owners(model, wanted)
    for path in sorted(owners):
        owners[path].to_empty(device=device, recurse=False)
    # to_empty gave each alias of a tied tensor its own storage: tie them again
    for group in {groups[n] for n in wanted if n in groups}:
        first = _get(model, group[0])
        for alias in group[1:]:
            path, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(path) if path else model, leaf, first)
    # Hugging Face initialises bottom-up and lets a parent override its children (GPT-2 scales
    # c_proj in GPT2Attention._init_weights), so ancestors run too, deepest first.
    units = set(owners)
    for path in owners:
        parts = path.split(".") if path else []
        units.update(".".join(parts[:d]) for d in range(len(parts)))
    failed: list[str] = []
    for path in sorted(units, key=lambda p: (-(p.count(".") + 1 if p else 0), p)):
        module = model.get_submodule(path) if path else model
        hf = _hf_initialiser(model, path)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_module_seed(seed, path))
            if hf is not None:
                hf._init_weights(module)  # type: ignore[operator]
            elif path not in owners:
                continue
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()  # type: ignore[operator]
            elif callable(getattr(module, "_reset_parameters", None)):  # nn.MultiheadAttention
                module._reset_parameters()  # type: ignore[operator]
            elif any(True for _ in module.parameters(recurse=False)) or \
                    any(True for _ in module.buffers(recurse=False)):
                failed.append(path or "(root)")
    if failed:
        raise WeightsError(f"no way to initialise the tensors of module(s) {', '.join(failed[:5])} "
                           "of a meta-device model (neither a Hugging Face _init_weights nor "
                           "reset_parameters())",
                           hint="pass --init-from with a state_dict of the model")
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    return {n: state[n].detach() for n in names}


def plan_weights(path: str | Path, plan: Plan) -> ModelWeights:
    """A weights file's tensors named as `plan`'s model names them (a wrapper's prefix read
    away, `partc.emit.weights_file.for_model`)."""
    return for_model(read_weights_file(path), _plan_names(plan), plan.model.aliases(), str(path))


def check_weights_file(path: str | Path, plan: Plan) -> str | None:
    """Raise unless a weights file holds every tensor `plan`'s stages take from it (reading the
    names, not the tensors: launch asks before any process starts); returns the note that a
    wrapper's prefix was read away, or None."""
    weights = plan_weights(path, plan)
    where = f"{path} (read without the prefix {weights.prefix!r})" if weights.prefix else str(path)
    stored_names(weights.state, _plan_names(plan), plan.model.aliases(), where)
    return weights.note(str(path))


def _plan_names(plan: Plan) -> list[str]:
    return [n for st in plan.stages for n in (*st.parameter_names, *st.buffer_names)]


def stored_names(state: Mapping[str, torch.Tensor], names: Iterable[str],
                 aliases: Mapping[str, Iterable[str]], where: str) -> dict[str, str]:
    """For each of `names`, the name `state` holds it under (itself, or any alias of a tied
    tensor); raises naming the missing ones. Reads no tensor."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in names:
        for candidate in (name, *aliases.get(name, ())):
            if candidate in state:
                found[name] = candidate
                break
        else:
            others = tuple(aliases.get(name, ()))
            missing.append(name + (f" (or {', '.join(others)})" if others else ""))
    if missing:
        raise WeightsError(f"{where} lacks {len(missing)} tensor(s) a stage needs: "
                           f"{', '.join(missing[:5])}",
                           hint="save the full state_dict of the same model (torch.save("
                                "model.state_dict(), path))")
    return found


def pick_state(state: Mapping[str, torch.Tensor], names: Iterable[str],
               aliases: Mapping[str, Iterable[str]], where: str) -> dict[str, torch.Tensor]:
    """The tensors `names` from a state dict, accepting any alias of a tied tensor. Raises with
    the missing names; shapes are checked by the caller against the stage."""
    return {name: state[stored] for name, stored in stored_names(state, names, aliases,
                                                                 where).items()}


def fit_to_stage(stage: torch.nn.Module, values: Mapping[str, torch.Tensor],
                 where: str) -> dict[str, torch.Tensor]:
    """`values` in the stage's dtypes: each must have the shape of the stage's tensor of the
    same name, and its dtype, or a floating dtype that is cast to the stage's (as torch's
    load_state_dict copies: a bf16-saved Hugging Face checkpoint into an fp32 plan); raises
    for another shape, or an integer/floating mismatch (other data, not other precision)."""
    current = stage_tensors(stage)
    fitted: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        want = current[name]
        castable = value.dtype.is_floating_point and want.dtype.is_floating_point
        if tuple(value.shape) != tuple(want.shape) or (value.dtype != want.dtype
                                                       and not castable):
            raise WeightsError(f"{where}: {name} is {tuple(value.shape)} {value.dtype}, the stage "
                               f"needs {tuple(want.shape)} {want.dtype}",
                               hint="the weights are of another model or configuration")
        fitted[name] = value.to(want.dtype)
    return fitted


def stage_state(stage: torch.nn.Module, parameter_names: Iterable[str],
                buffer_names: Iterable[str], *, checkpoint: Mapping[str, torch.Tensor] | None,
                aliases: Mapping[str, Iterable[str]], model_file: ModelFile | None,
                device: torch.device | str, seed: int = 0,
                where: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """The tensors a loaded stage still needs, by FQN (module docstring): parameters and
    state_dict buffers from `checkpoint` when given; every other tensor the stage file holds for
    real is kept (constants, non-persistent buffers); what is left (meta tensors) comes from the
    model's own initialisation. Returns only the tensors to set (`set_stage_tensors`)."""
    current = stage_tensors(stage)
    values: dict[str, torch.Tensor] = {}
    if checkpoint is not None:
        wanted = [*parameter_names, *buffer_names]
        picked = pick_state(checkpoint, wanted, aliases, where)
        values = {n: t.to(device) for n, t in picked.items()}
    missing = [n for n, t in current.items() if n not in values and t.is_meta]
    if missing:
        if model_file is None:
            raise WeightsError(f"the stage has no values for {', '.join(missing[:3])}",
                               hint="pass the model file or --init-from")
        values.update(initial_state(model_file, missing, device, seed))
    return fit_to_stage(stage, values, where)


def whole_model_weights(model: torch.nn.Module, model_file: ModelFile, on_meta: bool,
                        stages: Sequence[torch.nn.Module], aliases: dict[str, tuple[str, ...]],
                        device: torch.device, seed: int,
                        checkpoint: Mapping[str, torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
    """Give the whole (unsplit) model the weights a plan's stages start from, in place: the
    checkpoint's when given, else a meta model's own initialisation, else the stage files'.
    The model ends up on `device`; returns the plan's weights by FQN (for a checkpoint, {}).
    This is the single-process side of every stages-vs-model comparison (verify, launch tests,
    benchmarks)."""
    if on_meta:
        whole = _initialise_whole(model, model_file, device, seed)
    else:
        model.to(device)
        whole = {}
        for module in stages:  # the first stage holding a tied tensor
            for name, t in stage_tensors(module).items():
                whole.setdefault(name, t.detach())
    keys = set(model.state_dict())
    if checkpoint is not None:
        # by the model's names: a lazily read file reads no tensor the model lacks
        model.load_state_dict({k: checkpoint[k] for k in sorted(keys) if k in checkpoint},
                              strict=False)
        return {}
    values = {n: t for n, t in whole.items() if n in keys}
    for name, t in whole.items():  # a tied tensor under every name the model has for it
        for other in aliases.get(name, ()):
            if other in keys and other not in values:
                values[other] = t
    model.load_state_dict(values, strict=False)
    return whole


def _initialise_whole(model: torch.nn.Module, model_file: ModelFile, device: torch.device,
                      seed: int) -> dict[str, torch.Tensor]:
    """A meta-device model's own initialisation, whole; the model moved onto it."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    state = initial_state(model_file, names, device, seed)
    groups = tied_groups(model)
    model.to_empty(device=device)
    # to_empty may give each name of a tied tensor its own storage: share the first again
    for group in set(groups.values()):
        first = model.get_parameter(group[0])
        for alias in group[1:]:
            path, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(path) if path else model, leaf, first)
    model.load_state_dict(state, strict=False)
    for name, value in state.items():  # non-persistent buffers are not in load_state_dict's reach
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        if leaf in owner._buffers:
            owner._buffers[leaf] = value.clone()
    return state


def check_stage_tensors(stage: torch.nn.Module, spec: PlanStage) -> None:
    """PlanError unless the stage file holds exactly the tensors plan.yaml lists for it
    (parameters, buffers, constants): weights are assigned by those names, so a mismatch is a
    stage file of another plan or an edited plan.yaml, refused before anything trains."""
    names = set(stage_tensors(stage))
    expected = set(spec.parameter_names) | set(spec.buffer_names) | set(spec.constant_names)
    if names != expected:
        raise PlanError(f"stage {spec.index} holds tensors {sorted(names ^ expected)[:3]} that "
                        "plan.yaml does not list (or the reverse)",
                        hint="the stage file does not belong to this plan; re-run partc compile")

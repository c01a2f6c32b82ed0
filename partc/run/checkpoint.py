"""Training checkpoints of `partc launch`: one file per stage, keyed by parameter name, plus a
manifest written last.

    CHECKPOINT_DIR/step-00000040/stage-0.pt     {"model": {fqn: tensor}, "optimizer": {fqn: state}}
    CHECKPOINT_DIR/step-00000040/stage-1.pt
    CHECKPOINT_DIR/step-00000040/manifest.json  written once every stage file is in place

Every file is written to a temporary name, flushed to disk and renamed, and the manifest only after
all ranks have renamed theirs (a barrier), so a directory with a manifest whose files all exist
with the recorded sizes is complete; `latest_checkpoint` returns the newest such one and ignores
anything a crash left half-written. Model and optimizer tensors are stored under the model's
parameter names (FQNs), not under stage-local positions, so a checkpoint is independent of the
plan that wrote it: a plan re-cut into other stages resumes from it, and its stage files together
form an ordinary state_dict (`--init-from` accepts any of them).
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from partc.errors import PartcError
from partc.files import Content, write_atomic
from partc.options import Optimizer

FORMAT = "partc-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(PartcError):
    """A checkpoint directory that cannot be written, or one to resume from that does not fit."""


def step_directory(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def stage_file_name(stage: int) -> str:
    return f"stage-{stage}.pt"


def save_stage(root: Path, step: int, stage: int, model: dict[str, torch.Tensor],
               optimizer: dict[str, dict[str, Any]]) -> Path:
    """Write one stage's tensors (by FQN) and optimizer state (by FQN) atomically."""
    directory = step_directory(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / stage_file_name(stage)
    state = {"model": {n: t.detach().cpu() for n, t in model.items()},
             "optimizer": {n: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                               for k, v in s.items()} for n, s in optimizer.items()}}
    _write_atomically(path, lambda f: torch.save(state, f))
    return path


def write_manifest(root: Path, step: int, num_stages: int, info: dict[str, Any],
                   keep: int) -> Path:
    """Mark step's checkpoint complete (call once every stage file is written): the manifest
    lists exactly stage-0..stage-(num_stages-1), each of which must be there. Then delete all but
    the newest `keep` complete checkpoints up to this step, and older incomplete ones."""
    directory = step_directory(root, step)
    files = {}
    for k in range(num_stages):
        name = stage_file_name(k)
        try:
            files[name] = (directory / name).stat().st_size
        except OSError:
            raise CheckpointError(f"checkpoint {directory} lacks {name} after every rank wrote "
                                  "its stages", hint="the checkpoint directory must be one "
                                  "shared filesystem path for all nodes") from None
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": files, **info}
    path = directory / MANIFEST
    text = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    _write_atomically(path, text)
    complete = [c.step for c in _complete(root) if c.step <= step]
    for s in _step_dirs(root):
        if s < step and (s not in complete or s not in complete[-keep:]):
            shutil.rmtree(step_directory(root, s), ignore_errors=True)
    return path


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    step: int
    directory: Path
    manifest: dict[str, Any]

    def files(self) -> list[Path]:
        return [self.directory / name for name in sorted(self.manifest["files"])]

    def load(self, names: set[str], aliases: dict[str, tuple[str, ...]]
             ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Model tensors and optimizer states for `names` (a tied tensor under any of its names),
        read memory-mapped from whichever stage files hold them. Missing names are absent."""
        model: dict[str, torch.Tensor] = {}
        optimizer: dict[str, dict[str, Any]] = {}
        for path in self.files():
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for name in names:
                for key in (name, *aliases.get(name, ())):
                    if name not in model and key in state["model"]:
                        model[name] = state["model"][key]
                    if name not in optimizer and key in state["optimizer"]:
                        optimizer[name] = state["optimizer"][key]
        return model, optimizer


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint under `root`, or None."""
    complete = _complete(Path(root))
    return complete[-1] if complete else None


def choose_resume(root: str | Path, *, resume: bool, restarted: bool, steps: int,
                  optimizer: Optimizer, global_batch_size: int) -> Checkpoint | None:
    """The checkpoint a run continues from (None: start at step 0), or CheckpointError.

    A fresh run (neither --resume nor an elastic restart) refuses a directory that already holds
    a checkpoint: pruning and restarts would mix two runs. A resumed one takes the newest complete
    checkpoint, which must be before --steps (at it, after a restart: the run had finished) and
    come from the same optimizer and global batch (the data position counts batches)."""
    found = latest_checkpoint(root)
    if not (resume or restarted):
        if found is not None:
            raise CheckpointError(f"--checkpoint-dir {root} already holds a checkpoint (step "
                                  f"{found.step})", hint="pass --resume to continue that run, or "
                                  "use an empty directory")
        return None
    if found is None:
        if resume:
            raise CheckpointError(f"--resume: no complete checkpoint in {root}",
                                  hint="check the directory, or drop --resume to start from "
                                       "step 0")
        return None
    if found.step > (steps if restarted else steps - 1):
        raise CheckpointError(f"the newest checkpoint in {root} is at step {found.step}, --steps "
                              f"is {steps}", hint=f"pass --steps greater than {found.step}")
    m = found.manifest
    if m.get("optimizer") != optimizer:
        raise CheckpointError(f"checkpoint {found.directory} holds {m.get('optimizer')} state, "
                              f"the plan trains with {optimizer}",
                              hint="resume with a plan compiled for the same optimizer, or start "
                                   "from its weights with --init-from")
    if m.get("global_batch_size") != global_batch_size:
        raise CheckpointError(f"checkpoint {found.directory} was trained at global batch "
                              f"{m.get('global_batch_size')}, the plan's is {global_batch_size}",
                              hint="resume with a plan of the same global batch, or start from "
                                   "its weights with --init-from")
    return found


def checkpoint_at(root: str | Path, step: int) -> Checkpoint | None:
    """The complete checkpoint of `step` under `root`, or None (missing or incomplete)."""
    return next((c for c in _complete(Path(root)) if c.step == step), None)


def _step_dirs(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(steps)


def _complete(root: Path) -> list[Checkpoint]:
    found = []
    for step in _step_dirs(root):
        directory = step_directory(root, step)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            continue
        sizes = manifest.get("files", {})
        if sizes and all((directory / n).is_file() and (directory / n).stat().st_size == size
                         for n, size in sizes.items()):
            found.append(Checkpoint(step=step, directory=directory, manifest=manifest))
    return found


def _write_atomically(path: Path, content: Content) -> None:
    """`path` whole or absent (partc.files.write_atomic); a failure is a CheckpointError."""
    try:
        write_atomic(path, content)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint file {path}: {exc.strerror}",
                              hint="check the checkpoint directory's space and "
                                   "permissions") from None

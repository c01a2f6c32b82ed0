"""Training checkpoints of `partc launch`: one file per stage, keyed by parameter name, plus a
manifest written last that records every file's size and SHA-256.

    CHECKPOINT_DIR/step-00000040/stage-0.pt     {"model": {fqn: tensor}, "optimizer": {fqn: state}}
    CHECKPOINT_DIR/step-00000040/stage-1.pt
    CHECKPOINT_DIR/step-00000040/manifest.json  written once every stage file is in place

Every file is written to a temporary name, flushed to disk and renamed, its SHA-256 taken from
the bytes as they are written; the manifest comes only after all ranks have renamed theirs, so a
step directory without a manifest is a crash's leftover and is ignored. A checkpoint is *good*
when its manifest reads and every file has the recorded size and SHA-256 (`verify`, which reads
every byte once; a version-1 manifest has sizes only). Resuming takes the newest good checkpoint
and says which damaged ones it passed over (`choose_resume`); pruning keeps the newest `keep` good
ones and never deletes one that verified for a new one that did not (`write_manifest`).

Model and optimizer tensors are stored under the model's parameter names (FQNs), not under
stage-local positions, so a checkpoint is independent of the plan that wrote it: a plan re-cut
into other stages resumes from it, and its stage files together form an ordinary state_dict
(`--init-from` accepts any of them).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Mapping, cast

from partc.errors import PartcError
from partc.files import Content, write_atomic
from partc.options import Optimizer

if TYPE_CHECKING:  # torch at run time only where tensors are saved or loaded: `partc launch`
    import torch  # validates a plan and its checkpoints before any worker imports torch

FORMAT = "partc-checkpoint"
VERSION = 2  # 2: files {name: {"size", "sha256"}}; 1: files {name: size}
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# What the launcher's pre-flight verified, handed to the workers it starts (the environment is
# inherited), so rank 0 neither hashes the same files again nor repeats a warning.
SHARED_ENV = "PARTC_CHECKPOINTS_VERIFIED"


class CheckpointError(PartcError):
    """A checkpoint directory that cannot be written, or one to resume from that does not fit."""


def step_directory(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def stage_file_name(stage: int) -> str:
    return f"stage-{stage}.pt"


@dataclass(frozen=True)
class StageFile:
    """A stage file as written: what the manifest records of it."""

    stage: int
    name: str
    size: int
    sha256: str


class _HashingWriter:
    """A binary file object for torch.save that hashes and counts the bytes it passes on. A
    failed write (a full disk, a file size limit) is kept, not raised through torch's C++ writer
    (which would report it as an unexplained RuntimeError): the rest is skipped and the caller
    raises it once torch.save returns."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self.error is None:
            try:
                self.f.write(view)
            except OSError as exc:
                self.error = exc
            else:
                self.hash.update(view)
                self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        if self.error is None:
            try:
                self.f.flush()
            except OSError as exc:
                self.error = exc


def save_stage(root: Path, step: int, stage: int, model: dict[str, torch.Tensor],
               optimizer: dict[str, dict[str, Any]]) -> StageFile:
    """Write one stage's tensors (by FQN) and optimizer state (by FQN) atomically; returns its
    size and SHA-256 (of the bytes written). A stale manifest of the same step (a damaged
    checkpoint this run passed over) is removed first. CheckpointError when it cannot be
    written; nothing half-written is left behind."""
    import torch

    directory = step_directory(root, step)
    path = directory / stage_file_name(stage)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
    except OSError as exc:
        raise _write_error(directory, exc) from None
    state = {"model": {n: t.detach().cpu() for n, t in model.items()},
             "optimizer": {n: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                               for k, v in s.items()} for n, s in optimizer.items()}}
    written: list[_HashingWriter] = []

    def write(f: BinaryIO) -> None:
        writer = _HashingWriter(f)
        written.append(writer)
        torch.save(state, cast(BinaryIO, writer))  # torch uses write() and flush()
        if writer.error is not None:  # a full disk, a file size limit: say that
            raise writer.error

    _write_atomically(path, write)
    return StageFile(stage=stage, name=path.name, size=written[-1].size,
                     sha256=written[-1].hash.hexdigest())


def write_manifest(root: Path, step: int, num_stages: int, files: Mapping[int, StageFile],
                   info: dict[str, Any], keep: int) -> Path:
    """Mark step's checkpoint complete (call once every stage file is written): the manifest
    lists exactly stage-0..stage-(num_stages-1) with the sizes and SHA-256 their writers
    reported (`files`, by stage), and `info` (model, graph_hash, optimizer, ...). Then the new
    checkpoint is read back and verified; only if it is good are older checkpoints pruned: the
    newest `keep` good ones (the new one included) stay, older and damaged ones go, as do
    leftovers without a manifest. CheckpointError (nothing pruned) if the new one is not good."""
    directory = step_directory(root, step)
    entries = {}
    for k in range(num_stages):
        name = stage_file_name(k)
        if k not in files or not (directory / name).is_file():
            raise CheckpointError(f"checkpoint {directory} lacks {name} after every rank wrote "
                                  "its stages", hint="the checkpoint directory must be one "
                                  "shared filesystem path for all nodes")
        entries[name] = {"size": files[k].size, "sha256": files[k].sha256}
    manifest = {**info, "format": FORMAT, "version": VERSION, "step": step, "files": entries}
    path = directory / MANIFEST
    text = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    _write_atomically(path, text)
    new = _read(directory, step)
    problem = new if isinstance(new, str) else verify(new)
    if problem is not None:
        raise CheckpointError(f"checkpoint {directory} does not read back as written: {problem}",
                              hint="the checkpoint filesystem loses or changes data; older "
                                   "checkpoints are kept")
    good = 1
    for s in reversed(_step_dirs(root)):
        if s >= step:
            continue
        older = step_directory(root, s)
        found = _read(older, s)
        if good < keep and isinstance(found, Checkpoint) and verify(found) is None:
            good += 1
            continue
        shutil.rmtree(older, ignore_errors=True)
    return path


def discard_step(root: Path, step: int) -> None:
    """After a failed save of `step`: remove its directory unless it holds a good checkpoint
    (no half-written files, nothing that could be taken for a checkpoint)."""
    directory = step_directory(root, step)
    if not directory.is_dir():
        return
    found = _read(directory, step)
    if isinstance(found, Checkpoint) and verify(found) is None:
        return
    shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint on disk whose manifest reads and whose files have the recorded sizes (`verify`
    checks their contents)."""

    step: int
    directory: Path
    manifest: dict[str, Any]
    manifest_sha256: str = ""

    @property
    def version(self) -> int:
        return int(self.manifest.get("version", 1))

    def files(self) -> list[Path]:
        return [self.directory / name for name in sorted(self.manifest["files"])]

    def load(self, names: set[str], aliases: dict[str, tuple[str, ...]]
             ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Model tensors and optimizer states for `names` (a tied tensor under any of its names),
        read memory-mapped from whichever stage files hold them. Missing names are absent. (The
        files were verified when the checkpoint was chosen, not again here.)"""
        import torch

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


def verify(checkpoint: Checkpoint) -> str | None:
    """None if every file of `checkpoint` has its recorded SHA-256 (reads every byte, once per
    process and file version: verdicts are kept by file identity and modification time), else
    what is wrong. A version-1 manifest records sizes only, which `_read` checked."""
    _load_shared()
    key = _signature(checkpoint)
    if key is not None and key in _verdicts:
        return _verdicts[key] or None
    problem = None
    if checkpoint.version >= 2:
        for name, entry in sorted(checkpoint.manifest["files"].items()):
            try:
                digest = _sha256_file(checkpoint.directory / name)
            except OSError as exc:
                problem = f"cannot read {name}: {exc.strerror}"
                break
            if digest != entry["sha256"]:
                problem = f"{name} does not match its SHA-256 in the manifest"
                break
    if key is not None:
        _verdicts[key] = problem or ""
    return problem


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """The newest checkpoint under `root` with a manifest and files of the recorded sizes (not
    hashed: `verify` it, or use `choose_resume`), or None."""
    root = Path(root)
    for step in reversed(_step_dirs(root)):
        found = _read(step_directory(root, step), step)
        if isinstance(found, Checkpoint):
            return found
    return None


def newest_good_checkpoint(root: str | Path) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` that verifies, and the newer damaged ones passed over
    (directory, what is wrong), newest first. Step directories without a manifest (a crash's
    leftovers) are skipped silently."""
    root = Path(root)
    damaged: list[tuple[Path, str]] = []
    for step in reversed(_step_dirs(root)):
        directory = step_directory(root, step)
        if not (directory / MANIFEST).exists():
            continue
        found = _read(directory, step)
        problem = found if isinstance(found, str) else verify(found)
        if problem is None:
            assert isinstance(found, Checkpoint)
            return found, damaged
        damaged.append((directory, problem))
    return None, damaged


def choose_resume(root: str | Path, *, resume: bool, restarted: bool, steps: int,
                  optimizer: Optimizer, global_batch_size: int, graph_hash: str | None = None,
                  model: str = "", allow_other_model: bool = False,
                  warn: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The checkpoint a run continues from (None: start at step 0), or CheckpointError.

    A fresh run (neither --resume nor an elastic restart) refuses a directory that already holds
    a checkpoint: pruning and restarts would mix two runs. A resumed one takes the newest good
    checkpoint (`newest_good_checkpoint`: every file's SHA-256 verified), warning once about
    newer damaged ones it passes over; none good is an error. The checkpoint must be before
    --steps (at it, after a restart: the run had finished), of the plan's model (`graph_hash`,
    unless `allow_other_model`) and come from the same optimizer and global batch (the data
    position counts batches). Warnings go to `warn` (default: stderr, each text once per launch)."""
    warn = warn or _warn
    root = Path(root)
    if not (resume or restarted):
        held = next((s for s in reversed(_step_dirs(root))
                     if (step_directory(root, s) / MANIFEST).exists()), None)
        if held is not None:
            raise CheckpointError(f"--checkpoint-dir {root} already holds a checkpoint (step "
                                  f"{held})", hint="pass --resume to continue that run, or "
                                  "use an empty directory")
        return None
    found, damaged = newest_good_checkpoint(root)
    if found is None:
        if damaged:
            listed = "; ".join(f"{d.name}: {why}" for d, why in damaged[:3])
            raise CheckpointError(f"no checkpoint in {root} is intact ({listed})",
                                  hint="restore the directory from a copy, or start again "
                                       "from step 0 in an empty --checkpoint-dir")
        if resume:
            raise CheckpointError(f"--resume: no complete checkpoint in {root}",
                                  hint="check the directory, or drop --resume to start from "
                                       "step 0")
        return None
    if damaged:
        listed = ", ".join(f"{d} ({why})" for d, why in damaged)
        warn(f"damaged checkpoint {listed}: resuming from the newest good one, "
             f"{found.directory} (step {found.step})")
    if found.version < 2:
        warn(f"checkpoint {found.directory} has a version-{found.version} manifest without "
             "SHA-256 digests: only its file sizes were checked")
    if found.step > (steps if restarted else steps - 1):
        raise CheckpointError(f"the newest checkpoint in {root} is at step {found.step}, --steps "
                              f"is {steps}", hint=f"pass --steps greater than {found.step}")
    m = found.manifest
    if graph_hash is not None and m.get("graph_hash") != graph_hash:
        theirs = f"model {m.get('model', '?')!r} (graph {str(m.get('graph_hash'))[:12]})"
        ours = f"model {model!r} (graph {graph_hash[:12]})" if model else \
            f"graph {graph_hash[:12]}"
        if not allow_other_model:
            raise CheckpointError(f"checkpoint {found.directory} is of {theirs}, the plan's is "
                                  f"{ours}",
                                  hint="resume with a plan of the same model, pass "
                                       "--allow-other-model to load its tensors by name and "
                                       "shape anyway, or start from them with --init-from")
        warn(f"resuming from checkpoint {found.directory} of {theirs} under the plan's {ours} "
             "(--allow-other-model): tensors are matched by name and shape")
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
    """The checkpoint of `step` under `root` (manifest read, file sizes checked), or None."""
    found = _read(step_directory(Path(root), step), step)
    return found if isinstance(found, Checkpoint) else None


def shared_verdicts() -> str:
    """This process's verification verdicts and reported warnings, for `SHARED_ENV`: the
    launcher's pre-flight hands them to the workers it starts."""
    _load_shared()
    return json.dumps({"verdicts": _verdicts, "warned": sorted(_warned)}, sort_keys=True)


def _step_dirs(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(steps)


def _read(directory: Path, step: int) -> Checkpoint | str:
    """The checkpoint in `directory` if its manifest reads and its files have the recorded
    sizes, else what is wrong."""
    try:
        data = (directory / MANIFEST).read_bytes()
    except OSError as exc:
        return f"cannot read {MANIFEST}: {exc.strerror}"
    try:
        manifest = json.loads(data)
        version = manifest.get("version")
        files = manifest.get("files")
        ok = (manifest.get("format") == FORMAT and manifest.get("step") == step
              and version in READABLE_VERSIONS and isinstance(files, dict) and files)
    except (ValueError, AttributeError, RecursionError):
        ok = False
    if not ok:
        return f"{MANIFEST} is not a partc checkpoint manifest of step {step}"
    for name, entry in files.items():
        size = entry if version == 1 else (entry.get("size") if isinstance(entry, dict) else None)
        if version >= 2 and not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)):
            return f"{MANIFEST} lists {name} without a SHA-256"
        try:
            actual = (directory / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    return Checkpoint(step=step, directory=directory, manifest=manifest,
                      manifest_sha256=hashlib.sha256(data).hexdigest())


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# Verdicts of `verify` by `_signature` ("" good, else what is wrong) and warnings already shown.
_verdicts: dict[str, str] = {}
_warned: set[str] = set()
_shared_loaded = False


def _load_shared() -> None:
    global _shared_loaded
    if _shared_loaded:
        return
    _shared_loaded = True
    try:
        shared = json.loads(os.environ.get(SHARED_ENV, "{}"))
        _verdicts.update({str(k): str(v) for k, v in shared.get("verdicts", {}).items()})
        _warned.update(str(w) for w in shared.get("warned", []))
    except (ValueError, AttributeError):
        pass


def _signature(checkpoint: Checkpoint) -> str | None:
    """Identifies the checkpoint's exact bytes on disk without reading them: its manifest's
    SHA-256 and each file's identity, size and modification times (a rewrite changes them)."""
    parts = [str(checkpoint.directory.resolve()), checkpoint.manifest_sha256]
    try:
        for path in checkpoint.files():
            st = path.stat()
            parts.append(f"{path.name} {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} "
                         f"{st.st_ctime_ns}")
    except OSError:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _warn(text: str) -> None:
    _load_shared()
    if text in _warned:
        return
    _warned.add(text)
    print(f"partc launch: warning: {text}", file=sys.stderr, flush=True)


def _write_error(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}",
                           hint="free space on the checkpoint filesystem or fix its "
                                "permissions")


def _write_atomically(path: Path, content: Content) -> None:
    """`path` whole or absent (partc.files.write_atomic); a failure is a CheckpointError."""
    try:
        write_atomic(path, content)
    except OSError as exc:
        raise _write_error(path, exc) from None

"""The plan artifact: plan.yaml (schema v1) and its stage files, as typed data.

A plan directory holds `plan.yaml`, one `stage_<k>.pt` per (virtual) stage and `timings.yaml`
(wall-clock times of the compile; not part of the plan, never compared). `Plan.save` writes
plan.yaml deterministically (sorted keys, rounded floats, no timestamps, no absolute paths: the
model file is recorded relative to the plan directory), so the same inputs give the same bytes.
`load_plan` validates the file against the JSON Schema shipped in partc/schema/ before anything
reads it, and `Plan.check_stage_files` checks every stage file's SHA-256 before anything loads one.
The format is documented in docs/plan-format.md.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path, PureWindowsPath
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import yaml

from partc.errors import PartcError
from partc.files import load_yaml, write_atomic, yaml_problem
from partc.hardware.configs import cluster_from_dict
from partc.hardware.local import resolve_cluster
from partc.hardware.specs import ClusterSpec, priced_by_text
from partc.hardware.units import format_quantity
from partc.options import SHARDINGS, SearchOptions, Sharding, from_dict, to_dict
from partc.solve.partition import Prediction, SolverReport, TrainingSetup, round_seconds
from partc.solve.simulator import PipelineSpec, StageTiming
from partc.solve.stage_problem import RankLevers, p2p_posts_priced

if TYPE_CHECKING:
    from partc.frontend.model_file import ModelFile

SCHEMA_VERSION = 1
PLAN_FILE = "plan.yaml"
# The profile a compile measured on this machine, written beside plan.yaml (PlanCosts.profile).
PROFILE_FILE = "profile.yaml"
TIMINGS_FILE = "timings.yaml"
SCHEMA_FILE = Path(__file__).parent / "schema" / "plan-v1.schema.json"
WEIGHTS_IN_STAGE_FILES = "stage-files"
WEIGHTS_AT_LAUNCH = "initialise-at-launch"
MODEL_INPUT = "input"  # `TensorRef.peer` of a stage-0 input that is a model input
LOSS = "loss"  # `TensorRef.peer` of a last-stage output that goes to the loss


class PlanError(PartcError):
    """A plan file that is missing, malformed, from another schema version, or tampered with."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor at a stage boundary (or a model input/output) at the micro-batch size.

    For a stage input `peer` is the stage it comes from (or "input"); for a stage output, the
    stages that read it (or "loss"). `relay` marks an output the stage passes on unchanged.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    peer: tuple[int | str, ...] = ()
    path: str = ""  # for model inputs/outputs: where it sits in the structure (pytree key string)
    relay: bool = False
    # a boundary tensor between stages: the dtype it has, and is sent in, under the plan's
    # precision when that is not `dtype` (bf16-mixed: a projection's output is bfloat16, a
    # residual stream stays float32); "" = `dtype`
    wire_dtype: str = ""
    # a boundary tensor between stages laid out in memory in another order than its dims (a
    # transposed query, a view of a [batch, seq, heads, dim] buffer): its dims in memory order,
    # outermost first, in which it is sent, so the receiver gets the strides the unsplit model
    # had; () = as it is (docs/launch.md, "Boundary layouts")
    wire_order: tuple[int, ...] = ()

    @property
    def runtime_dtype(self) -> str:
        """The dtype the tensor crosses a stage boundary in."""
        return self.wire_dtype or self.dtype

    @property
    def wire_shape(self) -> tuple[int, ...]:
        """The shape it crosses a stage boundary in: `shape` in `wire_order`."""
        return tuple(self.shape[d] for d in self.wire_order) if self.wire_order else self.shape

    def to_dict(self, peer_key: str | None) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.wire_dtype:
            d["wire_dtype"] = self.wire_dtype
        if self.wire_order:
            d["wire_order"] = list(self.wire_order)
        if peer_key == "from":
            d["from"] = self.peer[0]
        elif peer_key == "to":
            d["to"] = list(self.peer)
        if self.path:
            d["path"] = self.path
        if self.relay:
            d["relay"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorRef":
        peer: tuple[int | str, ...] = ()
        if "from" in d:
            peer = (d["from"],)
        elif "to" in d:
            peer = tuple(d["to"])
        return cls(name=d["name"], shape=tuple(d["shape"]), dtype=d["dtype"], peer=peer,
                   path=d.get("path", ""), relay=bool(d.get("relay", False)),
                   wire_dtype=d.get("wire_dtype", ""),
                   wire_order=tuple(d.get("wire_order", ())))


@dataclass(frozen=True)
class PlanStage:
    """One (virtual) stage of the plan: its file, where it runs, what it holds and costs."""

    index: int
    rank: int
    file: str
    sha256: str
    replicas: int
    devices: tuple[int, ...]
    parameters: int  # element count of the parameters it holds
    parameter_names: tuple[str, ...]
    buffer_names: tuple[str, ...]  # buffers in the model's state_dict
    constant_names: tuple[str, ...]  # tensors not in a state_dict (non-persistent buffers, ...)
    modules: tuple[str, ...]
    num_nodes: int
    inputs: tuple[TensorRef, ...]
    outputs: tuple[TensorRef, ...]
    forward_s: float
    backward_s: float
    peak_memory_bytes: int
    # What the schedule simulation took for this stage (partc.solve.simulator.StageTiming), so
    # `partc show` can replay the schedule from plan.yaml alone.
    send_forward_s: float = 0.0
    send_backward_s: float = 0.0
    activation_bytes: int = 0
    static_bytes: int = 0
    # of the sends, the links' per-message latencies (absent in older plans: 0)
    send_forward_latency_s: float = 0.0
    send_backward_latency_s: float = 0.0
    # The memory levers its rank uses (partc.solve.levers), which launch runs: recomputing
    # activations, and what its replicas shard.
    activation_checkpointing: bool = False
    sharding: Sharding = "none"

    @property
    def levers(self) -> RankLevers:
        """The memory levers its rank uses (what launch runs it with)."""
        return RankLevers(self.activation_checkpointing, self.sharding)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "rank": self.rank, "file": self.file, "sha256": self.sha256,
                "activation_checkpointing": self.activation_checkpointing,
                "sharding": self.sharding,
                "replicas": self.replicas, "devices": list(self.devices),
                "parameters": self.parameters, "parameter_names": list(self.parameter_names),
                "buffer_names": list(self.buffer_names),
                "constant_names": list(self.constant_names), "modules": list(self.modules),
                "num_nodes": self.num_nodes,
                "inputs": [t.to_dict("from") for t in self.inputs],
                "outputs": [t.to_dict("to") for t in self.outputs],
                "predicted": {"forward_s": round_seconds(self.forward_s),
                              "backward_s": round_seconds(self.backward_s),
                              "peak_memory_bytes": self.peak_memory_bytes,
                              "send_forward_s": round_seconds(self.send_forward_s),
                              "send_backward_s": round_seconds(self.send_backward_s),
                              "send_forward_latency_s":
                                  round_seconds(self.send_forward_latency_s),
                              "send_backward_latency_s":
                                  round_seconds(self.send_backward_latency_s),
                              "activation_bytes": self.activation_bytes,
                              "static_bytes": self.static_bytes}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], checkpointing: bool = False) -> "PlanStage":
        """`checkpointing`: the stage's when plan.yaml does not say (older plans: the
        training's)."""
        p = d["predicted"]
        return cls(index=d["index"], rank=d["rank"], file=d["file"], sha256=d["sha256"],
                   activation_checkpointing=d.get("activation_checkpointing", checkpointing),
                   sharding=d.get("sharding", "none"),
                   replicas=d["replicas"], devices=tuple(d["devices"]),
                   parameters=d["parameters"], parameter_names=tuple(d["parameter_names"]),
                   buffer_names=tuple(d["buffer_names"]),
                   constant_names=tuple(d["constant_names"]), modules=tuple(d["modules"]),
                   num_nodes=d["num_nodes"],
                   inputs=tuple(TensorRef.from_dict(t) for t in d["inputs"]),
                   outputs=tuple(TensorRef.from_dict(t) for t in d["outputs"]),
                   forward_s=p["forward_s"], backward_s=p["backward_s"],
                   peak_memory_bytes=p["peak_memory_bytes"],
                   send_forward_s=p["send_forward_s"], send_backward_s=p["send_backward_s"],
                   send_forward_latency_s=p.get("send_forward_latency_s", 0.0),
                   send_backward_latency_s=p.get("send_backward_latency_s", 0.0),
                   activation_bytes=p["activation_bytes"], static_bytes=p["static_bytes"])


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that more than one stage holds (a tied embedding): its gradient is the sum of
    the stages' gradients, and launch keeps the copies equal."""

    name: str  # the FQN the stages hold it under
    aliases: tuple[str, ...]  # the model's other FQNs for the same tensor
    stages: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    file: str  # relative to the plan directory, inside the plan's tree (`plan_tree_root`)
    sha256: str  # of the model file's bytes that compile imported; checked before every import
    name: str
    graph_hash: str
    on_meta: bool
    parameters: int
    weights: str  # WEIGHTS_IN_STAGE_FILES or WEIGHTS_AT_LAUNCH
    inputs: tuple[TensorRef, ...]
    outputs: tuple[TensorRef, ...]
    input_spec: str  # torch.utils._pytree.treespec_dumps of (args, kwargs); "" if not serialisable
    output_spec: str  # the same for the model's output structure
    tied_weights: tuple[tuple[str, ...], ...] = ()  # FQNs naming one tensor (any stage count)
    # What `partc check` explains changes with: module path -> hash of its own operators, and
    # parameter/buffer FQN -> "dtype[shape]" (OpGraph.module_fingerprints/parameter_signatures).
    module_fingerprints: dict[str, str] = field(default_factory=dict)
    parameter_signatures: dict[str, str] = field(default_factory=dict)

    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Every FQN of a tied tensor -> its other FQNs."""
        return {n: tuple(a for a in group if a != n) for group in self.tied_weights for n in group}

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "name": self.name,
                "graph_hash": self.graph_hash,
                "on_meta": self.on_meta, "parameters": self.parameters, "weights": self.weights,
                "inputs": [t.to_dict(None) for t in self.inputs],
                "outputs": [t.to_dict(None) for t in self.outputs],
                "input_spec": self.input_spec, "output_spec": self.output_spec,
                "tied_weights": [list(g) for g in self.tied_weights],
                "fingerprint": {"modules": dict(self.module_fingerprints),
                                "parameters": dict(self.parameter_signatures)}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelInfo":
        return cls(file=d["file"], sha256=d["sha256"], name=d["name"],
                   graph_hash=d["graph_hash"],
                   on_meta=d["on_meta"], parameters=d["parameters"], weights=d["weights"],
                   inputs=tuple(TensorRef.from_dict(t) for t in d["inputs"]),
                   outputs=tuple(TensorRef.from_dict(t) for t in d["outputs"]),
                   input_spec=d["input_spec"], output_spec=d["output_spec"],
                   tied_weights=tuple(tuple(g) for g in d["tied_weights"]),
                   module_fingerprints=dict(d["fingerprint"]["modules"]),
                   parameter_signatures=dict(d["fingerprint"]["parameters"]))


CostSourceKind = Literal["analytic", "profile"]


@dataclass(frozen=True)
class PlanCosts:
    """What the plan was solved with besides the model, the cluster and the training settings
    (plan.yaml's `costs`), so that `partc check` can re-solve exactly as compile did."""

    source: CostSourceKind  # the analytic roofline, or a measured profile
    profile: str | None  # the profile file, relative to the plan directory
    capture_batch_size: int
    search: SearchOptions
    profile_sha256: str | None = None  # of the profile file; check verifies it (None: older)

    # The search options a plan records; the others (workers, max_microbatches) are fixed.
    RECORDED: ClassVar[tuple[str, ...]] = ("max_blocks", "strategy", "time_limit_s", "refine")

    def to_dict(self) -> dict[str, Any]:
        search = to_dict(self.search)
        sha = {"profile_sha256": self.profile_sha256} if self.profile_sha256 else {}
        return {"source": self.source, "profile": self.profile, **sha,
                "capture_batch_size": self.capture_batch_size,
                **{k: search[k] for k in self.RECORDED}, "pinned": self.search.pinned()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlanCosts":
        search = from_dict(SearchOptions, {**{k: d[k] for k in cls.RECORDED},
                                           **(d.get("pinned") or {})})
        return cls(source=d["source"], profile=d["profile"],
                   capture_batch_size=d["capture_batch_size"], search=search,
                   profile_sha256=d.get("profile_sha256"))


@dataclass(frozen=True)
class Plan:
    """plan.yaml, schema v1 (docs/plan-format.md). `directory` is where it was loaded from or
    saved to; it is not part of the file."""

    partc_version: str
    partc_build: str  # partc.version.build_id() of the partc that wrote it
    torch_version: str  # the torch that traced the stage files (public version, no +local)
    model: ModelInfo
    cluster: ClusterSpec  # written with num_devices and devices_used (the training's)
    training: TrainingSetup
    costs: PlanCosts
    stages: tuple[PlanStage, ...]
    tied_parameters: tuple[TiedParameter, ...]
    solver: SolverReport  # as recorded: rounded, no wall time
    predicted: Prediction
    directory: Path | None = field(default=None, compare=False)
    # "sha256:<hex>" of plan.yaml's bytes as read or written: the plan's identity. plan.yaml
    # records every stage file's, the model file's and the profile's sha256, so the digest pins
    # everything the plan runs (`partc launch --expect`).
    digest: str = field(default="", compare=False)
    raw: bytes = field(default=b"", compare=False, repr=False)  # plan.yaml's bytes, as read

    # ---- reading ---------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def microbatch_size(self) -> int:
        return self.training.shape.microbatch_size

    @property
    def model_path(self) -> Path:
        """The model file, resolved against the plan's directory; PlanError when plan.yaml names
        an absolute path or one that leaves the plan's tree (`resolve_model_file`)."""
        return resolve_model_file(self.directory or Path("."), self.model.file)

    def existing_model_path(self) -> Path:
        """`model_path`, or PlanError when the file is not there."""
        path = self.model_path
        if not path.is_file():
            raise PlanError(f"the plan's model file {self.model.file} (resolved to {path}) is "
                            "missing", hint="keep the plan directory where compile wrote it "
                                            "relative to the model file, or re-run partc compile")
        return path

    def load_model_file(self) -> "ModelFile":
        """Import the plan's model file, from bytes whose sha256 is the one plan.yaml recorded
        (read once: the bytes checked are the bytes run). PlanError when the file changed since
        compile. This imports torch (partc.frontend.model_file)."""
        from partc.frontend.model_file import load_model_file

        return load_model_file(self.existing_model_path(), source=self.model_source())

    def model_source(self) -> bytes:
        """The model file's bytes, checked against plan.yaml's sha256 (PlanError: changed)."""
        path = self.existing_model_path()
        source = _read(path, "the plan's model file")
        actual = hashlib.sha256(source).hexdigest()
        if actual != self.model.sha256:
            raise PlanError(f"model file {path} changed since the plan was compiled (sha256 "
                            f"{actual[:12]}.., plan.yaml recorded {self.model.sha256[:12]}..)",
                            hint="run partc check to see what changed, then recompile the plan")
        return source

    def stage_path(self, stage: PlanStage) -> Path:
        base = self.directory if self.directory is not None else Path(".")
        return base / stage.file

    def pinned_files(self) -> tuple[Path, ...]:
        """The files this plan pins (plan.yaml, the model file, the stage files, a profile beside
        it): what no command's output may overwrite."""
        base = self.directory if self.directory is not None else Path(".")
        files = [base / PLAN_FILE, base / self.model.file,
                 *(self.stage_path(s) for s in self.stages)]
        if self.costs.profile:
            files.append(base / self.costs.profile)
        return tuple(files)

    def stage_bytes(self, stage: PlanStage) -> bytes:
        """The stage file's bytes, read once and checked against plan.yaml's sha256: load the
        TorchScript from these bytes, never by path (a file swapped after the check would run
        unchecked code). PlanError when missing or different."""
        path = self.stage_path(stage)
        if not path.is_file():
            raise PlanError(f"stage file {path} of stage {stage.index} is missing",
                            hint="re-run partc compile to regenerate the plan directory")
        data = _read(path, f"stage file of stage {stage.index}")
        actual = hashlib.sha256(data).hexdigest()
        if actual != stage.sha256:
            raise PlanError(f"stage file {path} does not match plan.yaml "
                            f"(sha256 {actual[:12]}.., expected {stage.sha256[:12]}..): "
                            "modified or corrupted",
                            hint="re-run partc compile; never edit stage files by hand")
        return data

    def pipeline_spec(self) -> PipelineSpec:
        """The schedule simulation's input, rebuilt from plan.yaml (`simulate` of it replays the
        predicted iteration: partc show draws it)."""
        shape, p = self.training.shape, self.predicted
        return PipelineSpec(
            schedule=shape.schedule, num_ranks=shape.stages,
            num_microbatches=shape.num_microbatches,
            stages=tuple(StageTiming(forward_s=s.forward_s, backward_s=s.backward_s,
                                     send_forward_s=s.send_forward_s,
                                     send_backward_s=s.send_backward_s,
                                     send_forward_latency_s=s.send_forward_latency_s,
                                     send_backward_latency_s=s.send_backward_latency_s,
                                     activation_bytes=float(s.activation_bytes),
                                     static_bytes=float(s.static_bytes)) for s in self.stages),
            allreduce_s=p.allreduce_s, optimizer_s=p.optimizer_s, tied=p.tied_sync,
            host_sends=self.cluster.host_sends, core_sharing=shape.core_sharing(self.cluster),
            wake_credit_s=self.cluster.wake_credit_s)

    def p2p_posts_priced(self) -> list[float | None]:
        """Per stage, the priced CPU of one pass's p2p posts and waits, which its predicted
        forward and backward hold; None where the device's microbatch_overhead_s holds them
        (partc.solve.stage_problem.p2p_posts_priced)."""
        return p2p_posts_priced(self.cluster, self.training.shape)

    def check_stage_files(self) -> None:
        """Raise PlanError unless every stage file exists and has the recorded SHA-256 (a check
        before work starts; loaders still load from `stage_bytes`)."""
        for stage in self.stages:
            self.stage_bytes(stage)

    # ---- writing ---------------------------------------------------------------------------
    def cluster_dict(self) -> dict[str, Any]:
        """plan.yaml's `cluster`: the cluster spec, its device count and the devices used."""
        return {**self.cluster.to_dict(), "num_devices": self.cluster.num_devices,
                "devices_used": self.training.shape.num_devices}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "partc_version": self.partc_version,
            "partc_build": self.partc_build,
            "torch_version": self.torch_version,
            "model": self.model.to_dict(),
            "cluster": self.cluster_dict(),
            "training": self.training.to_dict(),
            "costs": self.costs.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "tied_parameters": [{"name": t.name, "aliases": list(t.aliases),
                                 "stages": list(t.stages)} for t in self.tied_parameters],
            "solver": self.solver.to_dict(include_time=False),
            "predicted": self.predicted.to_dict(),
        }

    def dumps(self) -> str:
        """plan.yaml's text: sorted keys, block style except lists of numbers (shapes, devices)
        on one line; byte-identical for equal plans."""
        return yaml.dump(self.to_dict(), Dumper=_PlanDumper, sort_keys=True,
                         default_flow_style=False, width=100)

    def save(self, directory: str | Path) -> Path:
        """Write plan.yaml into `directory` (validated against the schema first)."""
        data = self.to_dict()
        validate_plan_dict(data, "the plan being written")
        return write_atomic(Path(directory) / PLAN_FILE, self.dumps())

    def content_digest(self) -> str:
        """The digest plan.yaml written by `save` has (`digest` of the loaded file)."""
        return plan_digest(self.dumps().encode())

    def require_digest(self, expected: str, where: str = "--expect") -> None:
        """PlanError unless this plan's digest is `expected` (with or without "sha256:")."""
        want = expected.strip().lower().removeprefix("sha256:")
        if not re.fullmatch(r"[0-9a-f]{64}", want):
            raise PlanError(f"{where} {expected!r} is not a plan digest",
                            hint="pass the `plan digest: sha256:...` line that partc compile or "
                                 "partc check printed")
        if self.digest.removeprefix("sha256:") != want:
            raise PlanError(f"{where}: the plan is not the reviewed one (digest "
                            f"{self.digest[:19]}.., expected sha256:{want[:12]}..)",
                            hint="plan.yaml (or a file it pins) changed after review; run "
                                 "partc check on it and review the change")

    @classmethod
    def from_dict(cls, d: dict[str, Any], directory: Path | None = None,
                  where: str = "the plan") -> "Plan":
        """A Plan from plan.yaml's content (already valid against the schema): every section
        typed, and what the schema cannot say checked (consistent shapes, counts and totals)."""
        try:
            training = TrainingSetup.from_dict(d["training"])
            cluster_data = {k: v for k, v in d["cluster"].items()
                            if k not in ("num_devices", "devices_used")}
            cluster = cluster_from_dict(cluster_data, f"{where}: cluster")
            plan = cls(partc_version=d["partc_version"], partc_build=d["partc_build"],
                       torch_version=d["torch_version"],
                       model=ModelInfo.from_dict(d["model"]),
                       cluster=cluster, training=training, costs=PlanCosts.from_dict(d["costs"]),
                       stages=tuple(PlanStage.from_dict(
                           s, checkpointing=training.shape.activation_checkpointing)
                           for s in d["stages"]),
                       tied_parameters=tuple(TiedParameter(name=t["name"],
                                                           aliases=tuple(t["aliases"]),
                                                           stages=tuple(t["stages"]))
                                             for t in d["tied_parameters"]),
                       solver=SolverReport.from_dict(d["solver"]),
                       predicted=Prediction.from_dict(d["predicted"]), directory=directory)
            if plan.cluster_dict() != d["cluster"]:
                raise ValueError("its device counts are not the cluster's and the training's")
            _check_finite(d)
            _check_consistency(plan)
            plan.pipeline_spec()  # what show and check simulate must be buildable
        except (PartcError, KeyError, ValueError, TypeError) as exc:
            reason = exc.message if isinstance(exc, PartcError) else str(exc)
            raise PlanError(f"{where} is not a valid plan: {reason}",
                            hint="re-run partc compile; see docs/plan-format.md for the "
                                 "format") from exc
        return plan


class _PlanDumper(yaml.SafeDumper):
    """SafeDumper writing lists of numbers in flow style: `shape: [1, 32, 256]`."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    numbers = bool(data) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                 for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=numbers)


_PlanDumper.add_representer(list, _represent_list)


@lru_cache(maxsize=1)
def plan_schema() -> dict[str, Any]:
    """The JSON Schema of plan.yaml v1 (partc/schema/plan-v1.schema.json)."""
    return json.loads(SCHEMA_FILE.read_text())


def validate_plan_dict(data: Any, where: str) -> None:
    """Raise PlanError naming the first schema violation of `data` (plan.yaml's content)."""
    import jsonschema

    if isinstance(data, dict) and data.get("schema_version") not in (None, SCHEMA_VERSION):
        raise PlanError(f"{where} has schema_version {data.get('schema_version')!r}; this partc "
                        f"reads version {SCHEMA_VERSION}",
                        hint="re-run partc compile with this partc, or use the partc that wrote it")
    validator = jsonschema.Draft202012Validator(plan_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        at = "/".join(str(p) for p in first.absolute_path) or "(top level)"
        raise PlanError(f"{where} is not a valid plan: at {at}: {first.message}"
                        + (f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""),
                        hint="re-run partc compile; see docs/plan-format.md for the format")


def cluster_of(name_or_path: str | Path) -> ClusterSpec:
    """The cluster `--cluster` names: `local` (this machine), a cluster config (a name from
    configs/clusters/ or a YAML path), or a plan (its plan.yaml or directory): the cluster that
    plan was compiled for, as it records it. A plan is how a recompile reproduces a cluster no
    config name gives back, such as one calibrated into a directory under a shipped config's name
    (`partc check`'s stale hint, `compile_command`)."""
    text, path = str(name_or_path), Path(name_or_path)
    # a bare word is a config name, as configs' own lookup reads it (`local`, `cpu`)
    if ("/" in text or os.sep in text or text.endswith((".yaml", ".yml"))) and (
            (path / PLAN_FILE).is_file() or (path.is_file() and _is_plan_file(path))):
        return load_plan(path).cluster
    return resolve_cluster(name_or_path)


def _is_plan_file(path: Path) -> bool:
    """Whether a YAML file is a plan (its top level has plan.yaml's `schema_version`, `cluster`
    and `stages`) rather than a cluster config; unreadable files are left to the config loader,
    whose error names them."""
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and {"schema_version", "cluster", "stages"} <= data.keys()


def load_plan(path: str | Path) -> Plan:
    """Read and validate plan.yaml (a file, or a plan directory containing one). The file is read
    once; the Plan's `digest` is of those bytes."""
    path = Path(path)
    if path.is_dir():
        path = path / PLAN_FILE
    if not path.is_file():
        raise PlanError(f"plan file {path} not found",
                        hint="pass the plan.yaml that partc compile wrote (or its directory)")
    if path.suffix == ".py":
        raise PlanError(f"{path} is a Python file, not a plan",
                        hint="pass the plan directory (or its plan.yaml) that `partc compile "
                             f"{path}` wrote")
    raw = _read(path, "plan file")
    try:
        data = load_yaml(raw.decode())
    except UnicodeDecodeError as exc:
        raise PlanError(f"plan file {path} is not valid YAML: {exc}",
                        hint="re-run partc compile to regenerate it") from exc
    except yaml.YAMLError as exc:
        raise PlanError(f"plan file {path} is not valid YAML {yaml_problem(exc)}",
                        hint="re-run partc compile to regenerate it") from exc
    validate_plan_dict(data, str(path))
    plan = Plan.from_dict(data, directory=path.parent, where=str(path))
    return replace(plan, digest=plan_digest(raw), raw=raw)


def plan_digest(data: bytes) -> str:
    """The digest of plan.yaml's bytes: "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PlanError(f"cannot read {what} {path}: {exc.strerror}",
                        hint="check the path and its permissions") from exc


# An environment variable that names the tree a plan's model file must lie in, for checkouts
# without a .git (a CI tarball); otherwise the git work tree holding the plan directory.
PLAN_ROOT_ENV = "PARTC_PLAN_ROOT"


def plan_tree_root(plan_dir: Path) -> Path | None:
    """The tree a plan's model file must resolve inside: $PARTC_PLAN_ROOT, else the nearest
    ancestor of the plan directory holding `.git` (the repository the plan is reviewed in);
    None when neither exists (then only absolute paths are refused)."""
    env = os.environ.get(PLAN_ROOT_ENV)
    if env:
        return Path(env).resolve()
    here = plan_dir.resolve()
    for candidate in (here, *here.parents):
        if (candidate / ".git").exists():
            return candidate
    return None


def resolve_model_file(plan_dir: Path, recorded: str) -> Path:
    """The model file plan.yaml's `model.file` names (`resolve_in_plan_tree`)."""
    return resolve_in_plan_tree(plan_dir, recorded, "model file")


def resolve_in_plan_tree(plan_dir: Path, recorded: str, what: str) -> Path:
    """A file plan.yaml names (the model file, a profile), resolved (symlinks followed) against
    the plan directory. PlanError for an absolute path, or one that resolves outside the plan's
    tree (`plan_tree_root`): a plan may only name files of the repository it is reviewed in."""
    if Path(recorded).is_absolute() or PureWindowsPath(recorded).is_absolute():
        raise PlanError(f"the plan's {what} {recorded!r} is an absolute path",
                        hint=f"plans name their {what} relative to the plan directory; "
                             "re-run partc compile")
    path = (plan_dir / recorded).resolve()
    root = plan_tree_root(plan_dir)
    if root is not None and not path.is_relative_to(root):
        raise PlanError(f"the plan's {what} {recorded!r} resolves to {path}, outside the "
                        f"plan's tree {root}",
                        hint=f"a plan may only name a {what} in its own repository (set "
                             f"{PLAN_ROOT_ENV} to widen the tree); re-run partc compile")
    return path


# No number partc writes comes near this (FLOP/s 1e18, bytes 1e16, seconds 1e6), and sums and
# products of a few below it stay finite: a hand-edited 1e308 made `show --html` overflow to inf
# and fail with an internal error.
_MAX_MAGNITUDE = 1e100


def _check_finite(data: Any, at: str = "") -> None:
    """ValueError at the first NaN, infinite or absurd (_MAX_MAGNITUDE) number (YAML's .nan and
    .inf pass the schema)."""
    if isinstance(data, float) and not abs(data) < _MAX_MAGNITUDE:
        what = "beyond any value partc writes" if math.isfinite(data) else "not finite"
        raise ValueError(f"{at.lstrip('/') or 'a number'} is {data}, {what}")
    if isinstance(data, dict):
        for key, value in data.items():
            _check_finite(value, f"{at}/{key}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _check_finite(value, f"{at}/{i}")


def _check_consistency(plan: Plan) -> None:
    """What the schema cannot say: the stages form the training shape's grid (index, file,
    pipeline rank, devices per replica), boundary tensors name existing stages, tied parameters
    name stages that hold them. ValueError naming the first inconsistency."""
    shape = plan.training.shape
    if len(plan.stages) != shape.virtual_stages:
        raise ValueError(f"{len(plan.stages)} stages for a {shape.label()} shape")
    p = plan.predicted
    for name, values in (("peak_memory_bytes", p.peak_memory_bytes), ("memory", p.memory),
                         ("allreduce_s", p.allreduce_s), ("optimizer_s", p.optimizer_s),
                         ("memory_without_levers", p.memory_without_levers or p.memory)):
        if len(values) != shape.stages:
            raise ValueError(f"predicted.{name} has {len(values)} entries for "
                             f"{shape.stages} pipeline rank(s)")
    for sync in p.tied_sync:
        if any(not 0 <= r < shape.stages for r in sync.ranks):
            raise ValueError(f"predicted.tied_sync names ranks {list(sync.ranks)} of a "
                             f"{shape.stages}-rank pipeline")
    if shape.num_devices > plan.cluster.num_devices:
        raise ValueError(f"the shape uses {shape.num_devices} devices, the cluster has "
                         f"{plan.cluster.num_devices}")
    last = len(plan.stages)
    for k, st in enumerate(plan.stages):
        expected = (k, stage_file_name(k), k % shape.stages, shape.replicas,
                    shape.rank_devices(k % shape.stages))
        if (st.index, st.file, st.rank, st.replicas, st.devices) != expected:
            raise ValueError(f"stage {k} is (index {st.index}, file {st.file}, rank {st.rank}, "
                             f"{st.replicas} replica(s) on devices {list(st.devices)}); the "
                             f"shape puts it at (index {k}, file {expected[1]}, rank "
                             f"{expected[2]}, {expected[3]} replica(s) on devices "
                             f"{list(expected[4])})")
        if st.activation_checkpointing and not shape.activation_checkpointing:
            raise ValueError(f"stage {k} checkpoints activations, which the training does not "
                             "allow")
        if SHARDINGS.index(st.sharding) > SHARDINGS.index(shape.sharding):
            raise ValueError(f"stage {k} shards {st.sharding}, the training allows "
                             f"{shape.sharding}")
        first = plan.stages[st.rank]
        if (st.activation_checkpointing, st.sharding) != \
                (first.activation_checkpointing, first.sharding):
            raise ValueError(f"stage {k} has other levers than stage {first.index} of the same "
                             f"pipeline rank {st.rank}")
        for t in (*st.inputs, *st.outputs):
            if t.wire_order and sorted(t.wire_order) != list(range(len(t.shape))):
                raise ValueError(f"stage {k} tensor {t.name} has wire_order "
                                 f"{list(t.wire_order)}, not an order of its {len(t.shape)} "
                                 "dims")
        for t in st.inputs:
            src = t.peer[0] if t.peer else None
            if not (src == MODEL_INPUT or (isinstance(src, int) and 0 <= src < k)):
                raise ValueError(f"stage {k} input {t.name} comes from {src!r}, not an earlier "
                                 f"stage or {MODEL_INPUT!r}")
            if isinstance(src, int):
                # stages talk to their neighbours only (a tensor from further back is relayed):
                # what crosses must be received as stage k - 1 sends it, same bytes in the same
                # order
                sent = next((o for o in plan.stages[k - 1].outputs if o.name == t.name), None)
                if sent is None:
                    raise ValueError(f"stage {k} input {t.name} is not among stage {k - 1}'s "
                                     "outputs")
                if (sent.shape, sent.runtime_dtype, sent.wire_order) != \
                        (t.shape, t.runtime_dtype, t.wire_order):
                    raise ValueError(f"stage {k} input {t.name} is received as {list(t.shape)} "
                                     f"{t.runtime_dtype} in order {list(t.wire_order)}; stage "
                                     f"{k - 1} sends {list(sent.shape)} {sent.runtime_dtype} in "
                                     f"order {list(sent.wire_order)}")
        for t in st.outputs:
            if any(not (p == LOSS or (isinstance(p, int) and k < p < last)) for p in t.peer):
                raise ValueError(f"stage {k} output {t.name} goes to {list(t.peer)}, not later "
                                 f"stages or {LOSS!r}")
    for tied in plan.tied_parameters:
        if len(set(tied.stages)) < 2 or any(
                not 0 <= s < last or tied.name not in plan.stages[s].parameter_names
                for s in tied.stages):
            raise ValueError(f"tied parameter {tied.name} names stages {list(tied.stages)} that "
                             "do not all hold it")


def write_timings(directory: str | Path, timings: dict[str, float]) -> Path:
    """timings.yaml: wall-clock seconds of each compile step and of the solver. Kept out of
    plan.yaml so that the plan is byte-identical across runs."""
    return write_atomic(Path(directory) / TIMINGS_FILE,
                        yaml.safe_dump({k: round(v, 3) for k, v in timings.items()},
                                       sort_keys=True))


def stage_file_name(index: int) -> str:
    return f"stage_{index}.pt"


# The file names compile writes into a plan directory (the one definition of them).
ARTIFACT_NAMES = (rf"{re.escape(PLAN_FILE)}|{re.escape(PROFILE_FILE)}|{re.escape(TIMINGS_FILE)}"
                  r"|stage_\d+\.pt")
PLAN_ARTIFACT = re.compile(rf"^(?:{ARTIFACT_NAMES})$")


def refuse_plan_artifact(path: str | Path, what: str, inputs: tuple[Path, ...] = ()) -> None:
    """PlanError when writing `path` (an output of a command, named by option `what`) would
    overwrite a plan: a plan.yaml, or a stage file, profile or timings file beside one; or one
    of the command's own `inputs`."""
    path = Path(path)
    resolved = path.resolve()
    if not resolved.is_dir() and (resolved.name == PLAN_FILE or (
            PLAN_ARTIFACT.match(resolved.name) and (resolved.parent / PLAN_FILE).is_file())):
        raise PlanError(f"{what} {path} would overwrite a plan file",
                        hint="write outputs outside plan directories; only partc compile "
                             "writes a plan")
    if any(_same_file(resolved, Path(i)) for i in inputs):
        raise PlanError(f"{what} {path} is also an input of this command (or a file the plan "
                        "pins)", hint="write the output to another file")


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names: the same path, a symlink, or a hard link."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def stage_levers_text(plan: Plan, stage: PlanStage) -> str:
    """The stage's memory levers and what they save: "ckpt+shard-optimizer -1.2 GiB", "-"."""
    saved = plan.predicted.lever_savings(stage.rank)
    return stage.levers.label + (f" -{format_quantity(saved, 'B')}" if saved else "")


def format_plan(plan: Plan, solver_wall_s: float | None = None) -> str:
    """The summary table `partc compile` prints: one row per stage (devices, parameters, predicted
    times and memory), then throughput, bubble and the solver's report."""
    s, c = plan.training.shape, plan.cluster
    lines = [f"{plan.model.name}: {s.stages} stage(s) x {s.replicas} replica(s)"
             + (f" x {s.chunks} virtual" if s.chunks > 1 else "")
             + f", {s.schedule}, {s.num_microbatches} micro-batches of {s.microbatch_size}"
             + f" on {s.num_devices}/{c.num_devices} {c.device.name} devices of "
               f"{c.name}; global batch {plan.training.global_batch_size}"]
    usable = plan.predicted.usable_memory_bytes
    lines.append(f"{'stage':>5} {'rank':>4} {'devices':<12} {'params':>12} {'fwd ms':>9} "
                 f"{'bwd ms':>9} {'memory GiB':>11} {'of usable':>9} {'levers':<22}  modules")
    for st in plan.stages:
        devices = ",".join(str(d) for d in st.devices)
        modules = ", ".join(st.modules[:3]) + (f" ... ({len(st.modules)})"
                                               if len(st.modules) > 3 else "")
        share = st.peak_memory_bytes / usable if usable else 0.0
        lines.append(f"{st.index:>5} {st.rank:>4} {devices:<12.12} {st.parameters:>12,} "
                     f"{st.forward_s * 1e3:>9.3f} {st.backward_s * 1e3:>9.3f} "
                     f"{st.peak_memory_bytes / 2**30:>11.3f} {share:>9.1%} "
                     f"{stage_levers_text(plan, st):<22}  {modules}")
    p = plan.predicted
    lines.append(f"predicted: {p.iteration_s * 1e3:.3f} ms/iteration, "
                 f"{p.samples_per_s:,.1f} samples/s, bubble {p.bubble_fraction:.1%}"
                 + p.spread_text())
    lines.append(priced_by_text(c.device, plan.costs.profile if plan.costs.source == "profile"
                                else None))
    if plan.tied_parameters:
        lines.append("tied: " + "; ".join(f"{x.name} in stages {', '.join(map(str, x.stages))}"
                                          for x in plan.tied_parameters))
    r = plan.solver
    gap = "-" if r.gap is None else f"{r.gap:.2%}"
    lines.append(f"solver: {r.strategy} {r.status}, gap {gap}, search gap {r.search_gap:.2%}"
                 + (f", {solver_wall_s:.1f} s" if solver_wall_s is not None else ""))
    return "\n".join(lines)

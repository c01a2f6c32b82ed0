"""Per-node forward time from onnxruntime's profiler on a target execution provider.

The weightless ONNX model (weights are graph inputs, see partc.frontend.onnx_export) runs in an
InferenceSession with profiling on and `ORT_DISABLE_ALL` graph optimisation, so every profiled
kernel is one ONNX node of the exported graph, and every ONNX node maps to one OpGraph node
(`OpNode.onnx_nodes`). ORT's fused kernels (ORT_ENABLE_ALL) would be faster, but their names do not
map back, and what partc prices is the work of each OpGraph node in torch, not ORT's fusion of it;
the absolute scale is calibrated against torch anyway (partc.cost.measured).

Each node's time is the sum of its ONNX nodes' `*_kernel_time` events in a run; the reported value
is the median over the timed runs after warm-up runs.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from partc.errors import PartcError
from partc.options import Precision, ProfileMethod

if TYPE_CHECKING:
    # onnx is imported where a model is fed or saved: importing it (with ml_dtypes) takes about
    # 1.1 s, which every compile, check and verify that never touches ONNX would pay.
    import onnx

_KERNEL_SUFFIX = "_kernel_time"


def _numpy_type(elem_type: int) -> Any:
    """The numpy dtype partc feeds for an ONNX TensorProto element type, None where it has none."""
    import onnx

    types: dict[int, Any] = {
        onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
        onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
        onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT16: np.int16,
        onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8,
        onnx.TensorProto.BOOL: np.bool_}
    return types.get(elem_type)


class ProfileError(PartcError):
    """The device or runtime cannot profile this model."""


# The onnxruntime execution provider that runs on each kind of torch device partc profiles.
_PROVIDERS: dict[str, str] = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclass(frozen=True)
class TimingChoice:
    """What times forward per node: an onnxruntime execution provider, or torch (`provider` is
    None); `fallback` says why `auto` fell back to torch ("" when it did not)."""

    provider: str | None
    fallback: str = ""


def choose_provider(method: ProfileMethod, device_type: str, available: Sequence[str],
                    precision: Precision = "fp32") -> TimingChoice:
    """Pick the forward timing for `method` on a device of `device_type`, given onnxruntime's
    available providers (`onnxruntime.get_available_providers()`). Pure, so it is testable
    anywhere. `auto` falls back to torch when onnxruntime has no provider for the device or the
    precision needs autocast (onnxruntime cannot autocast); an explicit `onnxruntime` that cannot
    be honoured is a ProfileError."""
    if method == "torch":
        return TimingChoice(None)
    if precision != "fp32":
        if method == "onnxruntime":
            raise ProfileError(f"onnxruntime cannot time {precision} (it runs the exported graph's "
                               "own dtypes; bf16-mixed is torch autocast)",
                               hint="use --method auto or torch with --precision " + precision)
        return TimingChoice(None, f"{precision} is timed in torch (onnxruntime cannot autocast)")
    provider = _PROVIDERS.get(device_type)
    if provider is None:
        raise ProfileError(f"cannot profile on device type {device_type!r}",
                           hint="use --device cpu or cuda[:N]")
    if provider in available:
        return TimingChoice(provider)
    missing = (f"onnxruntime here has no {provider} (available: "
               f"{', '.join(available) or 'none'})")
    if method == "onnxruntime":
        raise ProfileError(missing, hint="install the onnxruntime build for this device (e.g. "
                                         "onnxruntime-gpu matching your CUDA), or use --method "
                                         "auto or torch")
    return TimingChoice(None, f"{missing}: forward times measured in torch")


def execution_provider(device: torch.device) -> tuple[str, dict[str, Any]]:
    """onnxruntime execution provider (and its options) for a torch device; ProfileError when
    onnxruntime here has none for it."""
    import onnxruntime as ort

    provider = choose_provider("onnxruntime", device.type, ort.get_available_providers()).provider
    assert provider is not None  # an explicit onnxruntime choice raises instead
    if device.type == "cuda":
        return provider, {"device_id": device.index or 0}
    return provider, {}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; ORT inputs would be declared float
        t = t.float()
    return t.contiguous().numpy()


def onnx_feeds(model: onnx.ModelProto, named: dict[str, torch.Tensor],
               seed: int = 0) -> dict[str, np.ndarray]:
    """Values for every graph input: from `named` (user inputs by placeholder name, weights by FQN
    or alias) when present, otherwise random values of the declared type and shape."""
    import onnx

    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        tensor_type = value.type.tensor_type
        if value.name in named:
            feeds[value.name] = _to_numpy(named[value.name])
            continue
        dtype = _numpy_type(tensor_type.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor_type.shape.dim]
        if dtype is None:
            raise ProfileError(f"ONNX input {value.name!r} has an element type partc cannot feed "
                               f"({onnx.TensorProto.DataType.Name(tensor_type.elem_type)})",
                               hint="profile in torch instead (partc profile --method torch)")
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = (rng.standard_normal(shape) * 0.02).astype(dtype)
        elif dtype is np.bool_:
            feeds[value.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype=dtype)
    return feeds


@dataclass(frozen=True)
class OrtTiming:
    """onnxruntime forward timing of one exported model at one batch size."""

    batch_size: int
    provider: str
    model_run_s: float  # median wall time of InferenceSession.run
    node_forward_s: dict[str, float]  # OpGraph node -> median summed kernel time
    unmapped_s: float  # kernels of ONNX nodes that map to no OpGraph node
    runs: int


def time_onnx(model: onnx.ModelProto, feeds: dict[str, np.ndarray], onnx_to_node: dict[str, str],
              batch_size: int, device: torch.device, threads: int = 1, warmup: int = 3,
              runs: int = 10) -> OrtTiming:
    """Profile `model` on the execution provider of `device` and attribute kernel time to
    OpGraph nodes through `onnx_to_node` (ONNX node name -> OpGraph node name)."""
    import onnx
    import onnxruntime as ort

    provider, options = execution_provider(device)
    with tempfile.TemporaryDirectory(prefix="partc-ort-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(path))
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3  # errors only: ORT warns about unfoldable constants
        # denormals flushed, as launch computes (partc.cost.torch_profiler.cpu_settings);
        # ORT sets its threads' and the calling thread's mode from this (default: kept)
        opts.add_session_config_entry("session.set_denormal_as_zero", "1")
        # One profiled session: the trace's model_run spans tell warm-up runs from timed ones.
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(tmp) / "ort_profile")
        try:
            session = ort.InferenceSession(str(path), opts, providers=[(provider, options)])
        except Exception as exc:
            raise ProfileError(
                f"onnxruntime cannot load the exported model: {str(exc).splitlines()[0]}",
                hint="profile in torch instead (partc profile --method torch)") from exc
        for _ in range(warmup):
            session.run(None, feeds)
        walls: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            # run() returns the outputs as numpy arrays in host memory, so on CUDA it has
            # waited for the device's kernels: the clock reads after them
            session.run(None, feeds)
            walls.append(time.perf_counter() - t0)
        trace = session.end_profiling()
        events = json.loads(Path(trace).read_text())
        os.unlink(trace)
    return _attribute(events, onnx_to_node, batch_size, provider, walls, warmup, runs)


def _attribute(events: list[dict[str, Any]], onnx_to_node: dict[str, str], batch_size: int,
               provider: str, walls: list[float], warmup: int, runs: int) -> OrtTiming:
    """Per-run, per-node kernel time from a Chrome-trace event list (runs after warm-up only)."""
    run_spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e.get("cat") == "Session" and e.get("name") == "model_run")
    timed = run_spans[warmup:warmup + runs]
    per_run: list[dict[str, float]] = [dict() for _ in timed]
    unmapped: list[float] = [0.0 for _ in timed]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith(_KERNEL_SUFFIX):
            continue
        ts = e["ts"]
        run = next((i for i, (a, b) in enumerate(timed) if a <= ts <= b), None)
        if run is None:
            continue
        onnx_name = e["name"][:-len(_KERNEL_SUFFIX)]
        node = onnx_to_node.get(onnx_name)
        seconds = e["dur"] * 1e-6
        if node is None:
            unmapped[run] += seconds
        else:
            per_run[run][node] = per_run[run].get(node, 0.0) + seconds
    names = sorted({n for r in per_run for n in r})
    node_fwd = {n: statistics.median([r.get(n, 0.0) for r in per_run]) for n in names}
    return OrtTiming(batch_size=batch_size, provider=provider, model_run_s=statistics.median(walls),
                     node_forward_s={n: v for n, v in node_fwd.items() if v > 0},
                     unmapped_s=statistics.median(unmapped) if unmapped else 0.0, runs=runs)

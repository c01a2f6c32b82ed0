"""Hardware descriptions for the analytic cost model: devices, links and clusters.

A device says how fast one accelerator computes and streams memory and how much memory it has; a
cluster says how many such devices there are per node, how many nodes, and how fast the links
between them are. Both are frozen dataclasses of plain numbers in base units (bytes, bytes/s,
FLOP/s, seconds) so the cost model and the solver never deal with units. They are read from
configs/ by partc.hardware.configs (format: docs/hardware.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

# Operator classes the cost model prices differently. Every device gives an efficiency for each.
OP_CLASSES = ("matmul", "conv", "attention", "norm", "elementwise", "reduction", "gather", "copy",
              "other")

# Classes that run on matrix units (tensor cores, AMX, oneDNN GEMM kernels): only these reach the
# dtype's matrix peak. Everything else runs on vector units, which are no faster than float32.
MATRIX_CLASSES = ("matmul", "conv", "attention")

# Keys allowed in `peak_flops`. "tf32" is float32 matrix math on tensor cores (used only when the
# device sets allow_tf32); "float8" covers every float8 variant torch has.
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")


BACKENDS = ("nccl", "gloo")
DEVICE_KINDS = ("cuda", "cpu")


def _dtype_key(dtype: str) -> str:
    """torch dtype names ("torch.float32", "float8_e4m3fn", "half") -> a `peak_flops` key."""
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8"):
        return "float8"
    return {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)


# SIMD register widths a CPU device may record (bytes), and the one read where none is: the
# width the memory model's CPU kernel terms were first measured at (AVX-512)
CPU_VECTOR_BYTES = (16, 32, 64)
DEFAULT_CPU_VECTOR_BYTES = 64


def vector_bytes_problem(value: object, kind: str = "cpu") -> str | None:
    """Why `value` is no SIMD width a device of `kind` (or a profile of one) may record, or
    None (0: not recorded; only a cpu device records one). The one check of the key, wherever
    it is read."""
    widths = ", ".join(map(str, CPU_VECTOR_BYTES))
    if isinstance(value, bool) or value not in (0, *CPU_VECTOR_BYTES):
        return f"must be one of {widths}, got {value!r}"
    if value and kind != "cpu":
        return f"must be one of {widths} on a cpu device, got {value!r} on a {kind} device"
    return None


@dataclass(frozen=True)
class DeviceSpec:
    """One device: compute peaks, memory bandwidth and capacity, and how much of it is reached.

    Time of an operator in the analytic model is `op_overhead_s + max(flops / flops_per_s(dtype,
    class), bytes / bytes_per_s())`. Numbers are in base units (bytes, bytes/s, FLOP/s, seconds).
    """

    name: str
    kind: str  # "cuda" | "cpu"
    memory_bytes: int  # usable memory per device
    peak_flops: dict[str, float]  # dtype -> dense peak FLOP/s; "float32" always present
    memory_bandwidth: float  # bytes/s, peak
    efficiency: dict[str, float]  # op class (every one of OP_CLASSES) -> fraction of peak reached
    bandwidth_efficiency: float  # fraction of memory_bandwidth reached by streaming ops
    op_overhead_s: float  # fixed time per executed (non-view) operator: launch / dispatch
    description: str = ""
    source: str = ""
    allow_tf32: bool = False  # float32 matrix ops run at the "tf32" peak (when it is given)
    # Fixed time per operator's backward (autograd engine node + kernel launch); None: the same
    # as op_overhead_s. Eager training pays it once per differentiable operator per micro-batch.
    backward_op_overhead_s: float | None = None
    # The pipelining runtime's fixed host time per stage, per micro-batch and pass (forward or
    # backward): schedule bookkeeping, the autograd call (the p2p posts and waits: below, where
    # measured apart; configs without p2p_post_cpu_s hold them here).
    microbatch_overhead_s: float = 0.0
    # The computing thread's CPU per transfer end a stage pass has (the receive of its input or
    # the send of its output: gloo's post and wait), beyond the bytes' copy, which the link
    # prices. A middle pipeline stage has two per pass, the first and last one, a single stage
    # none.
    p2p_post_cpu_s: float = 0.0
    # The extra host time of a stage pass (forward or backward) that starts from caches other
    # processes' work evicted: where pipeline processes share a core, each pass follows a
    # core-mate's turn and pays it (the runtime's and the stage's code and data fetched again).
    cold_pass_s: float = 0.0
    # Fixed time of an operator dispatched without autograd (an optimizer step's kernels, which
    # run under no_grad); None: the same as op_overhead_s.
    dispatch_overhead_s: float | None = None
    # The cache one device may use and the bandwidth streaming passes reach over a working set
    # that fits it (bytes, bytes/s); 0: not measured, every pass streams at the DRAM rate. A CPU
    # optimizer steps one parameter at a time, all its passes over that parameter's tensors
    # before the next, so a parameter whose step working set fits steps at this rate.
    cache_bytes: int = 0
    cache_bandwidth: float = 0.0
    # The extra time of a rank's optimizer step that starts from evicted caches, as launch's
    # steps follow the backward's and the transfers' work: the step's code and its temporaries'
    # memory fetched again (beyond each parameter's first pass from memory, which the bytes term
    # prices). `partc calibrate` times an AdamW step over a group within the cache, warm and
    # after a flush (measured on an AMD EPYC VM: 0.5-0.7 ms); 0: not measured.
    step_cold_s: float = 0.0
    # The machine a calibrated config was measured on (`partc calibrate` writes its CPU model or
    # GPU name); "" for a datasheet config. A config used to price this machine says, through
    # it, when its overheads and link are another machine's (partc.hardware.local).
    calibrated_on: str = ""
    # Where a datasheet config's predictions were last compared with measurements on its device
    # (which device, when, what held and what did not, and where it is written up); "" for one
    # never compared. Said beside every prediction priced with it (`pricing_text`), so that a
    # plan for hardware partc has not measured reads as an estimate. Not a number the pricing
    # uses: equality and `partc diff` ignore it, like `description` and `source`.
    checked_against: str = field(default="", compare=False)
    # A CPU's SIMD register width in bytes (64: AVX-512, 32: AVX2, 16: SSE, NEON); its kernels
    # block tensors by it (oneDNN's convolutions pad channels to a register of floats,
    # partc.solve.memory.kernel_scratch). 0: not recorded, read as DEFAULT_CPU_VECTOR_BYTES.
    vector_bytes: int = 0
    # How the device's speed moves from one training step to the next, per dtype key
    # ("float32", "bfloat16", ...): (probability, factor) modes, factors of the time a profile
    # prices with probability-weighted mean 1, each device (each core where processes share
    # one) drawing its mode on its own (measured by partc calibrate, partc.hardware.speed_spread;
    # the simulator's expectation over it: partc.solve.stragglers). A dtype without modes: the
    # device runs every step at its priced speed.
    speed_spread: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # The speed the spread's factor 1 stands for, per dtype key: the mean time of one call of
    # the spread's matmul (partc.hardware.speed_spread.KERNEL, one thread) over the windows
    # `partc calibrate` measured the spread in. A CPU profile times the same matmul beside its
    # totals (partc.cost.speed_probe), and a profile of this machine is scaled by the two's
    # ratio (partc.cost.speed_correction), so that a profile taken in a slow minute prices the
    # machine's mean speed. A dtype without one: profiles are priced as measured.
    speed_reference_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = _device_problems(self)
        if problems:
            raise ValueError(f"invalid DeviceSpec {self.name!r}: {problems[0]}")

    def flops_per_s(self, dtype: str, op_class: str) -> float:
        """FLOP/s an operator of `op_class` reaches on `dtype` operands.

        Matrix classes (matmul, conv, attention) get the dtype's peak (float32 with allow_tf32: the
        tf32 peak); a dtype the device does not list falls back to float32. Other classes run on
        vector units, which tensor cores do not speed up, so they get at most the float32 peak.
        Torch dtype names are accepted ("float8_e4m3fn" -> float8; integer dtypes -> float32).
        """
        if op_class not in self.efficiency:
            raise ValueError(f"unknown op class {op_class!r}; expected one of {OP_CLASSES}")
        key = _dtype_key(dtype)
        fp32 = self.peak_flops["float32"]
        if op_class in MATRIX_CLASSES:
            if key == "float32" and self.allow_tf32 and "tf32" in self.peak_flops:
                key = "tf32"
            peak = self.peak_flops.get(key, fp32)
        else:
            peak = min(self.peak_flops.get(key, fp32), fp32)
        return peak * self.efficiency[op_class]

    def speed_modes(self, dtype: str) -> tuple[tuple[float, float], ...]:
        """The (probability, factor) speed modes of steps computing in `dtype` (torch names
        accepted); () where none were measured."""
        return self.speed_spread.get(_dtype_key(dtype), ())

    def pricing_text(self) -> str:
        """How far this config's numbers are known to hold, for the line beside a prediction:
        measured on a machine (`calibrated_on`), a datasheet's compared with a measured device
        (`checked_against`), or a datasheet's never compared (unverified)."""
        if self.calibrated_on:
            return f"{self.name}, calibrated on {self.calibrated_on}"
        if self.checked_against:
            return f"{self.name}'s datasheet numbers, compared with measurements: " \
                   f"{self.checked_against}"
        return (f"{self.name}'s datasheet numbers, never compared with a measured "
                f"{self.name}: unverified")

    def backward_overhead_s(self) -> float:
        """Fixed time of one operator's backward (`backward_op_overhead_s`, else the forward's)."""
        return (self.op_overhead_s if self.backward_op_overhead_s is None
                else self.backward_op_overhead_s)

    def no_grad_overhead_s(self) -> float:
        """Fixed time of one operator outside autograd (`dispatch_overhead_s`, else the
        forward's `op_overhead_s`)."""
        return self.op_overhead_s if self.dispatch_overhead_s is None else self.dispatch_overhead_s

    def bytes_per_s(self) -> float:
        """Memory bandwidth that streaming operators reach (bytes/s)."""
        return self.memory_bandwidth * self.bandwidth_efficiency

    def stream_bytes_per_s(self, working_set: float) -> float:
        """Bandwidth of repeated streaming passes over `working_set` bytes: `cache_bandwidth`
        where the working set fits `cache_bytes`, else `bytes_per_s()`."""
        if self.cache_bandwidth > 0 and 0 < working_set <= self.cache_bytes:
            return max(self.cache_bandwidth, self.bytes_per_s())
        return self.bytes_per_s()

    def to_dict(self) -> dict[str, Any]:
        """Plain data in base units; `device_from_dict` reads it back to an equal spec. The
        overhead terms are written only when set, so specs without them keep their old text."""
        extra: dict[str, Any] = {}
        if self.backward_op_overhead_s is not None:
            extra["backward_op_overhead_s"] = self.backward_op_overhead_s
        if self.microbatch_overhead_s:
            extra["microbatch_overhead_s"] = self.microbatch_overhead_s
        if self.cold_pass_s:
            extra["cold_pass_s"] = self.cold_pass_s
        if self.p2p_post_cpu_s:
            extra["p2p_post_cpu_s"] = self.p2p_post_cpu_s
        if self.dispatch_overhead_s is not None:
            extra["dispatch_overhead_s"] = self.dispatch_overhead_s
        if self.cache_bytes or self.cache_bandwidth:
            extra["cache_bytes"] = self.cache_bytes
            extra["cache_bandwidth"] = self.cache_bandwidth
        if self.step_cold_s:
            extra["step_cold_s"] = self.step_cold_s
        if self.calibrated_on:
            extra["calibrated_on"] = self.calibrated_on
        if self.checked_against:
            extra["checked_against"] = self.checked_against
        if self.vector_bytes:
            extra["vector_bytes"] = self.vector_bytes
        if self.speed_spread:
            extra["speed_spread"] = {k: [list(mode) for mode in self.speed_spread[k]]
                                     for k in sorted(self.speed_spread)}
        if self.speed_reference_s:
            extra["speed_reference_s"] = {k: self.speed_reference_s[k]
                                          for k in sorted(self.speed_reference_s)}
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "source": self.source,
            "memory_bytes": self.memory_bytes,
            "peak_flops": {k: self.peak_flops[k] for k in sorted(self.peak_flops)},
            "allow_tf32": self.allow_tf32,
            "memory_bandwidth": self.memory_bandwidth,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "efficiency": {k: self.efficiency[k] for k in OP_CLASSES},
            "op_overhead_s": self.op_overhead_s,
            **extra,
        }


def priced_by_text(device: DeviceSpec, profile: str | None) -> str:
    """The `priced by:` line beside a prediction: a profile file (`profile` names it), else the
    roofline of `device` and how far its numbers are known to hold (`DeviceSpec.pricing_text`)."""
    if profile is not None:
        return f"priced by: the profile {profile}"
    return f"priced by: the roofline of {device.pricing_text()}"


def _device_problems(d: DeviceSpec) -> list[str]:
    problems = []
    if d.kind not in DEVICE_KINDS:
        problems.append(f"kind {d.kind!r} is not one of {DEVICE_KINDS}")
    if "float32" not in d.peak_flops:
        problems.append("peak_flops has no 'float32'")
    problems += [f"unknown dtype {k!r} in peak_flops" for k in d.peak_flops if k not in DTYPES]
    problems += [f"peak_flops[{k!r}] must be > 0" for k, v in d.peak_flops.items() if not v > 0]
    if set(d.efficiency) != set(OP_CLASSES):
        problems.append(f"efficiency must give exactly the op classes {OP_CLASSES}")
    problems += [f"efficiency[{k!r}] must be in (0, 1]" for k, v in d.efficiency.items()
                 if not 0 < v <= 1]
    if not 0 < d.bandwidth_efficiency <= 1:
        problems.append("bandwidth_efficiency must be in (0, 1]")
    if not d.memory_bytes > 0:
        problems.append("memory_bytes must be > 0")
    if not d.memory_bandwidth > 0:
        problems.append("memory_bandwidth must be > 0")
    if not d.op_overhead_s >= 0:
        problems.append("op_overhead_s must be >= 0")
    if d.backward_op_overhead_s is not None and not d.backward_op_overhead_s >= 0:
        problems.append("backward_op_overhead_s must be >= 0")
    if not d.microbatch_overhead_s >= 0:
        problems.append("microbatch_overhead_s must be >= 0")
    if not d.cold_pass_s >= 0:
        problems.append("cold_pass_s must be >= 0")
    if not d.p2p_post_cpu_s >= 0:
        problems.append("p2p_post_cpu_s must be >= 0")
    if not d.step_cold_s >= 0:
        problems.append("step_cold_s must be >= 0")
    if d.dispatch_overhead_s is not None and not d.dispatch_overhead_s >= 0:
        problems.append("dispatch_overhead_s must be >= 0")
    if (vector := vector_bytes_problem(d.vector_bytes, d.kind)) is not None:
        problems.append(f"vector_bytes {vector}")
    if not d.cache_bytes >= 0 or not d.cache_bandwidth >= 0:
        problems.append("cache_bytes and cache_bandwidth must be >= 0")
    elif bool(d.cache_bytes) != bool(d.cache_bandwidth):
        problems.append("cache_bytes and cache_bandwidth go together: give both or neither")
    for dtype, modes in d.speed_spread.items():
        if dtype not in DTYPES:
            problems.append(f"unknown dtype {dtype!r} in speed_spread")
        elif (problem := speed_modes_problem(modes)) is not None:
            problems.append(f"speed_spread[{dtype!r}] {problem}")
    for dtype, seconds in d.speed_reference_s.items():
        if dtype not in DTYPES:
            problems.append(f"unknown dtype {dtype!r} in speed_reference_s")
        elif (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
              or not math.isfinite(seconds) or not seconds > 0):
            problems.append(f"speed_reference_s[{dtype!r}] must be a positive time in seconds")
    return problems


SPREAD_MEAN_TOLERANCE = 0.01  # a spread's probability-weighted factor is 1 to within this


def speed_modes_problem(modes: object, mean_one: bool = True) -> str | None:
    """Why `modes` is not a device's speed modes of one dtype (DeviceSpec.speed_spread), or
    None: a non-empty sequence of (probability, factor) pairs, probabilities in (0, 1] summing
    to 1, factors > 0 with probability-weighted mean 1 (the profiled time is the mean one).
    `mean_one=False`: any mean (a launched run's spread, whose factors are of the stages'
    median times: partc.plans.recalibrate)."""
    if not isinstance(modes, (list, tuple)) or not modes:
        return "must be a non-empty list of [probability, factor] pairs"
    for mode in modes:
        if (not isinstance(mode, (list, tuple)) or len(mode) != 2
                or any(isinstance(v, bool) or not isinstance(v, (int, float))
                       or not math.isfinite(v) for v in mode)):
            return f"has {mode!r}, not a [probability, factor] pair of numbers"
        if not 0 < mode[0] <= 1 or not mode[1] > 0:
            return f"has {list(mode)!r}: a probability in (0, 1] and a factor > 0"
    total = sum(p for p, _ in modes)
    if abs(total - 1) > 1e-6:
        return f"has probabilities summing to {total:g}, not 1"
    mean = sum(p * f for p, f in modes)
    if mean_one and abs(mean - 1) > SPREAD_MEAN_TOLERANCE:
        return (f"has a mean factor of {mean:.4f}: factors are of the profiled (mean) time, "
                "their probability-weighted mean 1")
    return None


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point link: bandwidth per direction (bytes/s) and per-message latency (s)."""

    bandwidth: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency_s >= 0:
            raise ValueError(f"invalid LinkSpec: bandwidth must be > 0 and latency_s >= 0, "
                             f"got {self.bandwidth}, {self.latency_s}")

    def transfer_s(self, nbytes: int) -> float:
        """Time to send `nbytes` over this link: latency + nbytes / bandwidth (0 for no bytes)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return 0.0 if nbytes == 0 else self.latency_s + nbytes / self.bandwidth

    def latency_part_s(self, nbytes: int) -> float:
        """Of `transfer_s(nbytes)`, the latency (0 for no bytes)."""
        return 0.0 if nbytes == 0 else self.latency_s

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth": self.bandwidth, "latency_s": self.latency_s}


@dataclass(frozen=True)
class ClusterSpec:
    """`num_nodes` nodes of `devices_per_node` identical devices. Device i lives on node
    i // devices_per_node; devices of one node talk over `intra_node`, others over `inter_node`
    (bandwidth per device: a node's NICs shared by its devices)."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    num_nodes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: str  # "nccl" | "gloo"
    description: str = ""
    source: str = ""
    # CPU processes of a node share this many physical cores, device i pinned to core
    # i % cores_per_node (partc.hardware.local.pin_to_core); None: a core (or GPU) per device
    cores_per_node: int | None = None
    # Where processes share a core: the CPU seconds one that wakes from a gloo wait runs ahead
    # of a core-mate that kept computing before the two share the core equally (Linux's fair
    # scheduler; measured by partc calibrate, partc.hardware.wake_credit; the simulator's use:
    # partc.solve.shared_cores). 0: processor sharing at every instant.
    wake_credit_s: float = 0.0

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.num_nodes < 1:
            raise ValueError("devices_per_node and num_nodes must be >= 1")
        if self.cores_per_node is not None and not 1 <= self.cores_per_node:
            raise ValueError("cores_per_node must be >= 1")
        if not 0 <= self.wake_credit_s < math.inf:
            raise ValueError(f"wake_credit_s must be a finite number >= 0, got "
                             f"{self.wake_credit_s!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {BACKENDS}")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def busy_cores_per_node(self) -> int:
        """Cores a node's devices keep busy at once (one per device, or every shared core)."""
        return min(self.devices_per_node, self.cores_per_node or self.devices_per_node)

    @property
    def threads_per_device(self) -> int:
        """Intra-op threads of a CPU device's process as launch starts it (without
        OMP_NUM_THREADS: the node's physical cores shared out among its processes, at least 1);
        1 where the config gives no cores_per_node (a core per device) and on GPUs."""
        if self.device.kind != "cpu" or self.cores_per_node is None:
            return 1
        return max(1, self.cores_per_node // self.devices_per_node)

    @property
    def devices_per_core(self) -> float:
        """Devices time-sharing one core (1 when each has its own)."""
        if self.cores_per_node is None or self.cores_per_node >= self.devices_per_node:
            return 1.0
        return self.devices_per_node / self.cores_per_node

    def core_of(self, device_index: int) -> tuple[int, int]:
        """(node, core) a device runs on: its own core unless cores are shared."""
        node = self.node_of(device_index)
        local = device_index % self.devices_per_node
        cores = self.cores_per_node or self.devices_per_node
        return node, local % cores

    @property
    def host_sends(self) -> bool:
        """Whether point-to-point transfers are the processes' own work (gloo): a send moves
        only once its receive is posted, and gloo's IO thread copies the bytes on both
        processes' cores (bench/gloo_p2p.py; the simulator's model: partc.solve.host_p2p). NCCL
        runs transfers on its own streams and the host goes on."""
        return self.backend == "gloo"

    def node_of(self, device_index: int) -> int:
        """The node that device `device_index` (0 .. num_devices-1) belongs to."""
        if not 0 <= device_index < self.num_devices:
            raise ValueError(f"device index {device_index} out of range 0..{self.num_devices - 1}")
        return device_index // self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between devices a and b: intra-node when they share a node, else inter-node."""
        return self.intra_node if self.node_of(a) == self.node_of(b) else self.inter_node

    def allreduce_s(self, nbytes: int, group: Sequence[int]) -> float:
        """Ring all-reduce of `nbytes` over the devices in `group`.

        2(n-1)/n * nbytes / B + 2(n-1) * L, where B and L are the bandwidth and latency of the
        slowest link the ring uses (inter-node as soon as the group spans nodes). 0 when the group
        has at most one device or there is nothing to reduce.
        """
        link = self._ring_link(group)
        if link is None or nbytes == 0:
            return 0.0
        n = len(group)
        return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency_s

    def broadcast_s(self, nbytes: int, group: Sequence[int]) -> float:
        """Pipelined (chunked) broadcast of `nbytes` from one device of `group` to the others:
        nbytes / B + (n-1) * L on the slowest link of the ring over `group` (the data streams
        once along it). 0 when the group has at most one device or nothing is sent."""
        return self.broadcasts_s((nbytes,), group)

    def broadcasts_s(self, sizes: Sequence[int], group: Sequence[int]) -> float:
        """`broadcast_s` of each of `sizes` over the same group, one after the other: their sum,
        the ring's link found once (a ZeRO step broadcasts once per replica, over all of them)."""
        link = self._ring_link(group)
        if link is None:
            return 0.0
        latency = (len(group) - 1) * link.latency_s
        return sum(nbytes / link.bandwidth + latency if nbytes else 0.0 for nbytes in sizes)

    def reduce_s(self, nbytes: int, group: Sequence[int]) -> float:
        """Pipelined reduce of `nbytes` from every device of `group` onto one of them: the
        mirror of `broadcast_s` (the partial sums stream once along the ring), the same time."""
        return self.broadcast_s(nbytes, group)

    def reduces_s(self, sizes: Sequence[int], group: Sequence[int]) -> float:
        """`reduce_s` of each of `sizes` over the same group, one after the other."""
        return self.broadcasts_s(sizes, group)

    def _ring_link(self, group: Sequence[int]) -> LinkSpec | None:
        """The slowest link a ring over `group` uses (inter-node as soon as it spans nodes);
        None for at most one device."""
        n = len(group)
        if len(set(group)) != n:
            raise ValueError(f"group has repeated devices: {list(group)}")
        if n <= 1:
            return None
        if min(group) < 0 or max(group) >= self.num_devices:
            raise ValueError(f"group {list(group)} is outside devices 0..{self.num_devices - 1}")
        # one pass in C, not node_of per device: the search asks this of groups of every
        # replica count, up to the cluster's size
        nodes = len({i // self.devices_per_node for i in group})
        links = []
        if nodes < n:  # some two devices share a node: the ring uses an intra link
            links.append(self.intra_node)
        if nodes > 1:
            links.append(self.inter_node)
        return min(links, key=lambda link: link.bandwidth)

    def to_dict(self) -> dict[str, Any]:
        """Plain data in base units, the device inline; `cluster_from_dict` reads it back."""
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "device": self.device.to_dict(),
            "devices_per_node": self.devices_per_node,
            "num_nodes": self.num_nodes,
            "backend": self.backend,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            **({"cores_per_node": self.cores_per_node} if self.cores_per_node is not None
               else {}),
            **({"wake_credit_s": self.wake_credit_s} if self.wake_credit_s else {}),
        }


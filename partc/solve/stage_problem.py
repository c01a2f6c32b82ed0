"""The stage-assignment problem for one pipeline shape, in the integers every strategy shares.

A `PipelineShape` fixes everything but the cut: pipeline ranks S, data-parallel replicas R, micro-
batch count M and size m, schedule, virtual stages per rank (interleaved 1F1B), activation
checkpointing and how ranks map onto the cluster's devices. `StageProblem.build` prices every block
of a BlockGraph for that shape as integers (time in units of `time_unit_s`, bytes in units of
`memory_unit`), so the exact chain DP (partc.solve.strategies.chain_dp) and CP-SAT
(partc.solve.strategies.cpsat) optimise the same objective over the same numbers and their optima
can be compared exactly.

Objective (docs/solver.md derives it), with V = S*v virtual stages, virtual stage k on rank k % S:

    t_k  = compute of its blocks (forward + backward [+ forward again under checkpointing]
           + adding each backward's parameter gradients into the held ones, `gradient_add_s`)
           + its fixed work per micro-batch (stage_fixed[k]: the runtime's host work, and the
             loss function's forward and backward on the last virtual stage)
           + transfer time of what it receives: activations crossing boundary k (forward) and
             gradients crossing boundary k+1 (backward)
    T_d  = sum of t_k over the virtual stages of rank d
    g_d  = (M - 1) * T_d + allreduce_d + optimizer_d
    J    = max_d g_d + (max_d T_d * (v - 1) + sum_k t_k) / v

For v = 1 that is the classic (M - 1) * bottleneck + fill-and-drain estimate plus the slowest
rank's gradient all-reduce and optimizer step. A tensor produced on stage p and last needed on
stage c crosses every boundary in (p, c] (torch.distributed.pipelining stages only talk to their
neighbours, so intermediate stages relay it); graph inputs enter at stage 0, graph outputs leave
at the last stage (the loss).

Memory per rank is linear in the assignment (parameters, gradients, optimizer state, in-flight
activations, pipeline buffers, the largest backward transient of its blocks), an approximation of
partc.solve.memory.stage_memory; `corrections` tighten a rank's capacity where the exact model
found the linear one too low (the search's check-and-resolve loop).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterable, Sequence, TypeVar

from partc.cost.table import CostTable
from partc.errors import PartcError
from partc.graph.opgraph import Param
from partc.hardware.specs import ClusterSpec, DeviceSpec, LinkSpec
from partc.options import (
    PLACEMENTS,
    SCHEDULES,
    SHARDINGS,
    Placement,
    Precision,
    Schedule,
    Sharding,
    TrainingConfig,
)
from partc.solve.coarsen import BlockGraph
from partc.solve.memory import (
    StageMemory,
    differentiable_tensors,
    host_data_bytes,
    in_flight_microbatches,
    kernel_scratch,
    loss_saved_bytes,
    param_memory,
    stage_memory,
    trainable_weight_bytes,
    usable_memory,
)


class ShapeError(PartcError):
    """A pipeline shape that cannot run: too many devices, batch not divisible, bad schedule."""


@dataclass(frozen=True)
class RankLevers:
    """The memory levers one pipeline rank uses (all its virtual stages alike): activation
    checkpointing (recompute each micro-batch's forward before its backward, keeping only the
    stage inputs), and what its data-parallel replicas shard (`Sharding`)."""

    activation_checkpointing: bool = False
    sharding: Sharding = "none"

    @property
    def label(self) -> str:
        """How tables show them: "ckpt", "shard-optimizer", "ckpt+shard-optimizer", "-"."""
        parts = (["ckpt"] if self.activation_checkpointing else []) + \
            ([f"shard-{self.sharding}"] if self.sharding != "none" else [])
        return "+".join(parts) or "-"


@dataclass(frozen=True)
class PipelineShape:
    """Everything about a hybrid-parallel layout except where the cuts fall.

    `activation_checkpointing` and `sharding` are what the shape allows its ranks: the search
    prices the cut with them on every rank, then turns them off on each rank whose memory does
    not need them (`RankLevers`, partc.solve.levers)."""

    stages: int  # S: pipeline ranks (devices per pipeline)
    replicas: int  # R: data-parallel copies of the pipeline
    num_microbatches: int  # M per replica per iteration
    microbatch_size: int  # m
    schedule: Schedule = "1f1b"
    chunks: int = 1  # virtual stages per rank (interleaved-1f1b only)
    activation_checkpointing: bool = False
    placement: Placement = "stage-major"
    sharding: Sharding = "none"

    def __post_init__(self) -> None:
        for name in ("stages", "replicas", "num_microbatches", "microbatch_size", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShapeError(f"{name} must be an integer >= 1, got {value!r}",
                                 hint="check the pipeline options")
        if self.schedule not in SCHEDULES:
            raise ShapeError(f"unknown schedule {self.schedule!r}",
                             hint=f"use one of {', '.join(SCHEDULES)}")
        if (self.chunks > 1) != (self.schedule == "interleaved-1f1b"):
            raise ShapeError(f"schedule {self.schedule} with {self.chunks} virtual stages per rank",
                             hint="interleaved-1f1b needs chunks >= 2; the others use 1")
        if self.placement not in PLACEMENTS:
            raise ShapeError(f"unknown placement {self.placement!r}",
                             hint=f"use one of {', '.join(PLACEMENTS)}")
        if self.sharding not in SHARDINGS:
            raise ShapeError(f"unknown sharding {self.sharding!r}",
                             hint=f"use one of {', '.join(SHARDINGS)}")
        if self.sharding != "none" and self.replicas < 2:
            raise ShapeError(f"sharding {self.sharding} needs data-parallel replicas, the shape "
                             "has one", hint="shard only with --replicas 2 or more")
        if self.sharding != "none" and self.chunks > 1:
            # launch shards each virtual stage's optimizer on its own, a partition the memory
            # model does not follow (it splits a rank's parameters together)
            raise ShapeError(f"sharding {self.sharding} with {self.chunks} virtual stages per "
                             "rank is not supported",
                             hint="use --sharding none with interleaved-1f1b")

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def num_devices(self) -> int:
        return self.stages * self.replicas

    @property
    def global_batch_size(self) -> int:
        return self.replicas * self.num_microbatches * self.microbatch_size

    def device(self, rank: int, replica: int) -> int:
        """Cluster device index of pipeline rank `rank` in replica `replica`.

        stage-major: a rank's replicas sit on neighbouring devices (its all-reduce stays inside a
        node); pipeline-major: a pipeline's ranks sit on neighbouring devices (its point-to-point
        transfers stay inside a node)."""
        if self.placement == "stage-major":
            return rank * self.replicas + replica
        return replica * self.stages + rank

    @property
    def shards(self) -> int:
        """Replicas a sharded rank splits its state over (1 without sharding);
        `TrainingConfig.optimizer_shards` of the shape's `training_config`."""
        return self.replicas if self.sharding != "none" else 1

    def training_config(self, training: TrainingConfig,
                        levers: "RankLevers | None" = None) -> TrainingConfig:
        """`training` for this shape: its schedule, and the levers of one rank (`levers`; None:
        every lever the shape allows, on)."""
        levers = levers or RankLevers(self.activation_checkpointing, self.sharding)
        return replace(training, schedule=self.schedule,
                       activation_checkpointing=levers.activation_checkpointing,
                       sharding=levers.sharding,
                       shards=self.replicas if levers.sharding != "none" else 1)

    def rank_devices(self, rank: int) -> tuple[int, ...]:
        """The devices running pipeline rank `rank`, one per replica."""
        # `device` over every replica, as one range (the search asks this of every shape)
        if self.placement == "stage-major":
            return tuple(range(rank * self.replicas, (rank + 1) * self.replicas))
        return tuple(range(rank, self.stages * self.replicas, self.stages))

    def boundary_links(self, cluster: ClusterSpec) -> list[LinkSpec | None]:
        """Per boundary k (1..V-1; index 0 is None): the link between the ranks of virtual
        stages k-1 and k, in replica 0 (every replica has the same layout)."""
        S = self.stages
        return [None] + [cluster.link(self.device((k - 1) % S, 0), self.device(k % S, 0))
                         for k in range(1, self.virtual_stages)]

    def core_sharing(self, cluster: ClusterSpec) -> tuple[tuple[int, ...], ...]:
        """Per pipeline rank, the pipeline ranks (once per device, so once per replica) whose
        devices share the core its replica-0 device runs on, itself included; () when every
        device has its own core (`PipelineSpec.core_sharing`)."""
        if cluster.devices_per_core <= 1:
            return ()
        on_core: dict[tuple[int, int], list[int]] = {}
        for rank in range(self.stages):
            for replica in range(self.replicas):
                on_core.setdefault(cluster.core_of(self.device(rank, replica)), []).append(rank)
        return tuple(tuple(sorted(on_core[cluster.core_of(self.device(rank, 0))]))
                     for rank in range(self.stages))

    def label(self) -> str:
        parts = [f"S{self.stages}xR{self.replicas}", f"M{self.num_microbatches}",
                 f"m{self.microbatch_size}", self.schedule + (f"x{self.chunks}" if self.chunks > 1
                                                             else "")]
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.sharding != "none":
            parts.append(f"shard-{self.sharding}")
        if self.replicas > 1 and self.stages > 1:
            parts.append(self.placement)
        return " ".join(parts)


@dataclass(frozen=True)
class CrossingTensor:
    """A block-level tensor as the problem sees it (block positions; -1: a graph input)."""

    name: str
    producer: int
    consumers: tuple[int, ...]
    is_output: bool
    # Per boundary k (index 0 unused): the transfer time units the stage after the boundary (k)
    # and the stage before it (k - 1) pay when the tensor crosses it. Where sends are
    # asynchronous (NCCL) each pays for what it receives: the activation is `after`'s, the
    # gradient `before`'s. Where the processes copy the data themselves (gloo) both pay for
    # both: the receiver waits for the transfer, 1F1B's sender for its send, and the bytes are
    # copied on both cores (partc.solve.host_p2p, as the simulator runs it).
    after: tuple[int, ...]
    before: tuple[int, ...]
    size: int  # memory units per micro-batch
    grad_size: int  # memory units of its gradient per micro-batch (0: no gradient)

    def last_block(self, num_blocks: int) -> int:
        """Position of the last block that needs it (num_blocks: the loss, after every block)."""
        return num_blocks if self.is_output else max(self.consumers, default=self.producer)


@dataclass(frozen=True)
class SharedParam:
    """A parameter used by several blocks: a rank holding any of them holds it once."""

    name: str
    blocks: tuple[int, ...]
    static: int  # memory units: weights + gradients + optimizer state
    temps: int  # optimizer-step temporaries
    sync: tuple[int, ...]  # per rank: time units its all-reduce and optimizer step add


@dataclass
class StageProblem:
    """One shape's assignment problem in integers (see the module docstring)."""

    blocks: BlockGraph
    table: CostTable
    cluster: ClusterSpec
    training: TrainingConfig  # schedule/checkpointing are the shape's
    shape: PipelineShape
    time_unit_s: float
    memory_unit: int
    compute: list[int]  # per block: time units per micro-batch
    static: list[int]  # per block: units of its own (unshared) weights, grads, optimizer state
    temps: list[int]  # per block: units of optimizer-step temporaries of its own parameters
    saved: list[int]  # per block: units saved for backward per micro-batch
    transient: list[int]  # per block: units of its largest backward transient
    sync: list[list[int]]  # [block][rank]: time units of all-reduce + step for its own params
    has_trainable: list[bool]  # per block: owns a trainable parameter
    tensors: list[CrossingTensor]
    shared: list[SharedParam]
    sync_latency: list[int]  # per rank: all-reduce latency term when it has trainable params
    activation_coef: list[float]  # per rank: saved bytes multiplier (in-flight / chunks)
    keep_coef: list[float]  # per rank: sent outputs kept per micro-batch (in-flight / chunks)
    loss: int  # units the loss keeps per in-flight micro-batch on the last stage
    inputs: int  # units of the input micro-batches the first rank holds
    capacity: int  # usable memory units per device
    corrections: list[int] = field(default_factory=list)  # per rank, memory units
    # per virtual stage, time units it pays per micro-batch whatever its blocks: the pipelining
    # runtime's host work for one forward and one backward (DeviceSpec.microbatch_overhead_s),
    # and on the last one the loss function's forward and backward (CostTable.loss)
    stage_fixed: list[int] = field(default_factory=list)
    # per rank, bytes of the step's data its process holds where device memory is the host's
    # (partc.solve.memory.host_data_bytes), and the same in memory units
    host_data_bytes: tuple[float, ...] = ()
    host_data: list[int] = field(default_factory=list)
    # levers every rank keeps on whether its memory needs them or not: the ones the user pinned
    # (--checkpointing, --sharding), which partc.solve.levers never turns off
    forced_levers: RankLevers = field(default_factory=lambda: RankLevers())
    # per rank, the ranks whose devices share its core, itself included
    # (PipelineShape.core_sharing); () when every device has its own core
    core_sharing: tuple[tuple[int, ...], ...] = ()

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, blocks: BlockGraph, table: CostTable, cluster: ClusterSpec,
              training: TrainingConfig, shape: PipelineShape,
              memo: dict[tuple, Any] | None = None,
              forced_levers: RankLevers | None = None) -> "StageProblem":
        """Price every block for `shape` (see the module docstring). `memo`, shared by the builds
        of one search (same blocks and table), keeps the shape-independent pieces: per-parameter
        bytes and per-block transients at a micro-batch size; a search over thousands of shapes
        of a 100B-parameter model spent most of its time recomputing them."""
        memo = {} if memo is None else memo
        if shape.num_devices > cluster.num_devices:
            raise ShapeError(f"{shape.label()} needs {shape.num_devices} devices, the cluster "
                             f"has {cluster.num_devices}", hint="use fewer stages or replicas")
        training = shape.training_config(training)
        graph = table.graph
        m, M, S = shape.microbatch_size, shape.num_microbatches, shape.stages
        ckpt = shape.activation_checkpointing
        # each block's gradient accumulation per pass (`gradient_add_s`; a tied weight's on each
        # block that uses it: its copies on different stages each accumulate). The adds' seconds
        # are the same for every shape of a search: memoised per block, scaled by the count.
        device = cluster.device
        per_pass = gradient_adds(shape, shape.sharding, kept_whole=False) / M

        def block_adds_s(params: Sequence[str]) -> float:
            return sum(add_seconds_of(graph.param(n), training, device) for n in params)

        adds_s = [_memo(memo, ("adds", i, training.bf16, device.name),
                        functools.partial(block_adds_s, b.params))
                  for i, b in enumerate(blocks.blocks)]
        compute_s = [b.forward.at(m) * (2.0 if ckpt else 1.0) + b.backward.at(m)
                     + adds * per_pass for b, adds in zip(blocks.blocks, adds_s, strict=True)]
        usable = usable_memory(cluster.device.memory_bytes, training)
        # ~2^20 time units for the whole model's compute: fine enough to balance, small enough
        # that (M - 1) * time stays far inside int64; ~2^24 memory units in a device.
        units = _Units(time_s=max(sum(compute_s) / float(1 << 20), 1e-12),
                       memory_bytes=max(1, usable >> 24))
        per_byte, latency = _sync_rates(cluster, shape)
        terms = _BlockTerms.of(blocks, table, cluster, training, shape, units, per_byte, memo)
        in_flight = [in_flight_microbatches(shape.schedule, d, S, M, shape.chunks)
                     for d in range(S)]
        loss = units.memory(loss_saved_bytes(table, m))
        inputs = units.memory(M * sum(table.tensor_bytes(t.name, m) for t in graph.inputs))
        host = host_data_bytes(table, cluster.device.kind, shape.global_batch_size, m, M, S,
                               num_stages=S * shape.chunks, processes=S * shape.replicas)
        return cls(blocks=blocks, table=table, cluster=cluster, training=training, shape=shape,
                   time_unit_s=units.time_s, memory_unit=units.memory_bytes,
                   compute=[units.time(x) for x in compute_s], static=terms.static,
                   temps=terms.temps, saved=terms.saved, transient=terms.transient,
                   sync=terms.sync, has_trainable=terms.has_trainable,
                   tensors=_crossing_tensors(blocks, table, shape, cluster, training.bf16, units),
                   shared=terms.shared,
                   # a sharded rank's replicas each broadcast what they updated after the step:
                   # R broadcasts of (R - 1) latencies, R / 2 all-reduce latencies more
                   # (sharded gradients: a reduce per owner and micro-batch, R / 2 all-reduce
                   # latencies each)
                   sync_latency=[units.time(x * (1 + shape.shards / 2 if shape.shards > 1
                                                 else 1.0)
                                            + x * shape.shards / 2 * shape.num_microbatches
                                            * (shape.sharding == "gradients"))
                                 for x in latency],
                   activation_coef=[(1.0 if ckpt else in_flight[d]) / shape.chunks
                                    for d in range(S)],
                   keep_coef=[in_flight[d] / shape.chunks for d in range(S)], loss=loss,
                   inputs=inputs, capacity=usable // units.memory_bytes, corrections=[0] * S,
                   stage_fixed=[units.time(f + b)
                                for f, b in stage_fixed_s(table, cluster, shape)],
                   host_data_bytes=host, host_data=[units.memory(x) for x in host],
                   forced_levers=forced_levers or RankLevers(),
                   core_sharing=shape.core_sharing(cluster))

    # ---- evaluation of an assignment ---------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.compute)

    def rank_of(self, stage: int) -> int:
        return stage % self.shape.stages

    def crossings(self, assignment: Sequence[int], tensor: CrossingTensor) -> range:
        """The boundaries k (1..V-1) the tensor crosses under `assignment` (stage per block)."""
        V = self.shape.virtual_stages
        lo = 0 if tensor.producer < 0 else assignment[tensor.producer]
        hi = V - 1 if tensor.is_output else max((assignment[c] for c in tensor.consumers),
                                                  default=lo)
        return range(lo + 1, hi + 1)

    def stage_times(self, assignment: Sequence[int]) -> list[int]:
        """t_k in time units for every virtual stage."""
        t = list(self.stage_fixed)
        for b, k in enumerate(assignment):
            t[k] += self.compute[b]
        for tensor in self.tensors:
            for k in self.crossings(assignment, tensor):
                # On the stage that waits for it, or with gloo on both (CrossingTensor)
                t[k] += tensor.after[k]
                t[k - 1] += tensor.before[k]
        return t

    def rank_sync(self, assignment: Sequence[int]) -> list[int]:
        """All-reduce + optimizer time units per rank."""
        S = self.shape.stages
        sync = [0] * S
        has = [False] * S
        held: list[set[str]] = [set() for _ in range(S)]
        for b, k in enumerate(assignment):
            d = self.rank_of(k)
            sync[d] += self.sync[b][d]
            has[d] = has[d] or self.has_trainable[b]
        for p in self.shared:
            for b in p.blocks:
                d = self.rank_of(assignment[b])
                if p.name not in held[d]:
                    held[d].add(p.name)
                    sync[d] += p.sync[d]
        return [s + (self.sync_latency[d] if has[d] else 0) for d, s in enumerate(sync)]

    def objective(self, assignment: Sequence[int]) -> int:
        """v * J in time units (an integer; J = objective / chunks)."""
        return self._objective(assignment, paced_by_cores=False)

    def shared_core_objective(self, assignment: Sequence[int]) -> int:
        """`objective` with each rank's steady state paced by its core: where ranks share a core
        (an oversubscribed CPU node), a micro-batch's turn through the steady state costs the
        core the work of every rank on it, which J's per-rank term does not see (with a faster
        link than the shipped cpu one, it read a 2-stage, 2-replica ResNet on 4 processes over 2
        cores as 23.6 ms at 2 micro-batches, simulated 29.5, and let its bound prune 1
        micro-batch, simulated 25.4). The same as `objective` without sharing; never below it."""
        return self._objective(assignment, paced_by_cores=bool(self.core_sharing))

    def _objective(self, assignment: Sequence[int], paced_by_cores: bool) -> int:
        S, v, M = self.shape.stages, self.shape.chunks, self.shape.num_microbatches
        t = self.stage_times(assignment)
        per_rank = [0] * S
        for k, x in enumerate(t):
            per_rank[self.rank_of(k)] += x
        sync = self.rank_sync(assignment)
        steady = [max(per_rank[d], sum(per_rank[o] for o in self.core_sharing[d]))
                  for d in range(S)] if paced_by_cores else per_rank
        g = max((M - 1) * steady[d] + sync[d] for d in range(S))
        return v * g + (v - 1) * max(per_rank) + sum(t)

    def rank_memory(self, assignment: Sequence[int]) -> list[int]:
        """The linear memory model per rank in memory units, corrections included."""
        S, V, M = self.shape.stages, self.shape.virtual_stages, self.shape.num_microbatches
        static = [0] * S
        temps = [0] * S
        saved = [0] * S
        peak = [0] * S
        comm = [0] * S
        for b, k in enumerate(assignment):
            d = self.rank_of(k)
            static[d] += self.static[b]
            temps[d] += self.temps[b]
            saved[d] += self.saved[b]
            peak[d] = max(peak[d], self.transient[b])
        for p in self.shared:
            for d in sorted({self.rank_of(assignment[b]) for b in p.blocks}):
                static[d] += p.static
                temps[d] += p.temps
        for tensor in self.tensors:
            for k in self.crossings(assignment, tensor):
                comm[self.rank_of(k)] += M * tensor.size
                comm[self.rank_of(k - 1)] += self.send_units(tensor, self.rank_of(k - 1))
        comm[self.rank_of(0)] += self.inputs
        for d, held in enumerate(self.host_data):
            comm[d] += held
        last = self.rank_of(V - 1)
        out = []
        for d in range(S):
            act = self.activation_units(d, saved[d]) + (self.loss_units(d) if d == last else 0)
            out.append(static[d] + comm[d] + max(act + peak[d], temps[d]) + self.corrections[d])
        return out

    def activation_units(self, rank: int, saved: int) -> int:
        return int(math.ceil(self.activation_coef[rank] * saved))

    def loss_units(self, rank: int) -> int:
        return int(math.ceil(self.keep_coef[rank] * self.loss))

    def send_units(self, tensor: CrossingTensor, rank: int) -> int:
        """Memory a rank spends on a tensor it sends: kept outputs and gradient buffers."""
        return int(math.ceil(self.keep_coef[rank] * tensor.size)) \
            + self.shape.num_microbatches * tensor.grad_size

    def fits(self, assignment: Sequence[int]) -> bool:
        return all(x <= self.capacity for x in self.rank_memory(assignment))

    def exact_memory(self, assignment: Sequence[int],
                     levers: Sequence[RankLevers] | None = None) -> list[StageMemory]:
        """partc.solve.memory.stage_memory of every rank (its virtual stages together), each
        with its `levers` (None: every lever the shape allows, on every rank)."""
        nodes, relayed = self.rank_nodes(assignment)
        tied = self.tied_across_ranks(assignment)
        return [self.rank_memory_with(d, nodes[d], relayed[d],
                                      None if levers is None else levers[d], tied)
                for d in range(self.shape.stages)]

    def tied_across_ranks(self, assignment: Sequence[int]) -> frozenset[str]:
        """The parameters two or more pipeline ranks hold (tied or reused weights), whose
        copies' gradients launch sums across ranks."""
        return frozenset(p.name for p in self.shared
                         if len({self.rank_of(assignment[b]) for b in p.blocks}) > 1)

    def rank_nodes(self, assignment: Sequence[int]) -> tuple[list[list[str]], list[list[str]]]:
        """Per rank, the OpGraph nodes its stages run, and the tensors they pass on (a virtual
        stage relays a tensor it neither makes nor is the last to need)."""
        S = self.shape.stages
        nodes: list[list[str]] = [[] for _ in range(S)]
        for b, k in enumerate(assignment):
            nodes[self.rank_of(k)].extend(self.blocks.blocks[b].nodes)
        relayed: list[list[str]] = [[] for _ in range(S)]
        for tensor in self.tensors:
            for k in self.crossings(assignment, tensor)[:-1]:
                relayed[self.rank_of(k)].append(tensor.name)
        return nodes, relayed

    def rank_memory_with(self, rank: int, nodes: Sequence[str], relayed: Sequence[str],
                         levers: RankLevers | None,
                         kept_whole: Collection[str] = ()) -> StageMemory:
        """stage_memory of one rank running `nodes` (relaying `relayed`) with `levers`;
        `kept_whole`: the parameters other ranks hold too (`tied_across_ranks`)."""
        return stage_memory(self.table, nodes, microbatch_size=self.shape.microbatch_size,
                            host_data=self.host_data_bytes[rank], relayed=relayed,
                            # launch frees them between steps unless a DDP bucket holds them
                            # (sharded gradients have none)
                            gradients_resident=self.shape.replicas > 1 and (
                                levers.sharding if levers else self.shape.sharding)
                            != "gradients", kept_whole=kept_whole,
                            threads=self.cluster.threads_per_device,
                            num_microbatches=self.shape.num_microbatches, stage_index=rank,
                            num_stages=self.shape.stages,
                            config=self.shape.training_config(self.training, levers),
                            chunks=self.shape.chunks)

    def usable_bytes(self) -> int:
        return usable_memory(self.cluster.device.memory_bytes, self.training)

    def valid(self, assignment: Sequence[int]) -> bool:
        """Every block placed, every stage non-empty, every edge forward (stage(u) <= stage(v))."""
        V = self.shape.virtual_stages
        if len(assignment) != self.num_blocks or any(not 0 <= k < V for k in assignment):
            return False
        if len(set(assignment)) != V:
            return False
        return all(assignment[u] <= assignment[v] for u, v in self.blocks.edges)


def stage_fixed_s(table: CostTable, cluster: ClusterSpec,
                  shape: PipelineShape) -> list[tuple[float, float]]:
    """Per virtual stage, the (forward, backward) seconds it spends per micro-batch whatever
    blocks it holds: the pipelining runtime's host work per pass
    (DeviceSpec.microbatch_overhead_s), its p2p posts and waits (`p2p_post_s`), where its rank's
    process shares a core with another (PipelineShape.core_sharing) the cold start each pass
    makes after a core-mate's turn (DeviceSpec.cold_pass_s), and, on the last virtual stage, the
    loss function (CostTable.loss, outside the graph: run on the stage's outputs)."""
    m = shape.microbatch_size
    overhead = cluster.device.microbatch_overhead_s
    cold = cluster.device.cold_pass_s
    sharing = shape.core_sharing(cluster) if cold else ()
    posts = p2p_post_s(cluster, shape)
    # virtual stage k runs on pipeline rank k % stages (PipelineShape.links)
    per_pass = [overhead + posts[k] + (cold if sharing and len(sharing[k % shape.stages]) > 1
                                       else 0.0)
                for k in range(shape.virtual_stages)]
    fixed = [(s, s) for s in per_pass]
    fwd, bwd = fixed[-1]
    fixed[-1] = (fwd + table.loss.forward.at(m), bwd + table.loss.backward.at(m))
    return fixed


def p2p_post_s(cluster: ClusterSpec, shape: PipelineShape) -> list[float]:
    """Per virtual stage, the computing thread's CPU in one pass's p2p posts and waits
    (DeviceSpec.p2p_post_cpu_s per tensor the pass receives from or sends to another stage: a
    forward receives its input unless it is the first stage and sends its output unless it is
    the last, a backward the other way round; a single stage has none). The same in both
    passes. The bytes' copy is the link's (the simulator's transfers), not in this."""
    per_end = cluster.device.p2p_post_cpu_s
    v = shape.virtual_stages
    return [per_end * ((k > 0) + (k < v - 1)) for k in range(v)]


def p2p_posts_priced(cluster: ClusterSpec, shape: PipelineShape) -> list[float | None]:
    """`p2p_post_s` where the device prices the posts apart (`p2p_post_cpu_s` set), else None
    per virtual stage: a device whose `microbatch_overhead_s` holds them (what a measured pass
    is compared with: partc.plans.run_metrics.host_per_pass_s)."""
    if not cluster.device.p2p_post_cpu_s:
        return [None] * shape.virtual_stages
    return list(p2p_post_s(cluster, shape))


@dataclass(frozen=True)
class _Units:
    """The integer units a problem is priced in: time units of `time_s` seconds, memory units of
    `memory_bytes` bytes (memory rounded up: a stage never looks smaller than it is)."""

    time_s: float
    memory_bytes: int

    def time(self, seconds: float) -> int:
        return int(round(seconds / self.time_s))

    def memory(self, nbytes: float) -> int:
        return int(math.ceil(nbytes / self.memory_bytes - 1e-9)) if nbytes > 0 else 0


def _sync_rates(cluster: ClusterSpec, shape: PipelineShape) -> tuple[list[float], list[float]]:
    """Per pipeline rank: seconds per byte and latency of the gradient all-reduce over its
    replicas (both 0 without replicas)."""
    per_byte: list[float] = []
    latency: list[float] = []
    for d in range(shape.stages):
        if shape.replicas > 1:
            group = shape.rank_devices(d)
            # allreduce_s is latency + bytes * slope: recover both from two sizes.
            small, large = 1 << 20, 1 << 30
            slope = ((cluster.allreduce_s(large, group) - cluster.allreduce_s(small, group))
                     / (large - small))
            per_byte.append(slope)
            latency.append(cluster.allreduce_s(small, group) - slope * small)
        else:
            per_byte.append(0.0)
            latency.append(0.0)
    return per_byte, latency


@dataclass
class _BlockTerms:
    """Per-block memory and sync terms of a problem, and the parameters blocks share."""

    static: list[int]  # units of its own (unshared) weights, gradients, optimizer state
    temps: list[int]  # units of optimizer-step temporaries of its own parameters
    saved: list[int]  # units saved for backward per micro-batch
    transient: list[int]  # units of its largest backward transient
    sync: list[list[int]]  # [block][rank]: time units of all-reduce + step of its own params
    has_trainable: list[bool]
    shared: list[SharedParam]

    @classmethod
    def of(cls, blocks: BlockGraph, table: CostTable, cluster: ClusterSpec,
           training: TrainingConfig, shape: PipelineShape, units: _Units,
           per_byte: list[float], memo: dict[tuple, Any]) -> "_BlockTerms":
        graph = table.graph
        m, S = shape.microbatch_size, shape.stages
        bf16 = training.bf16
        # Parameters: per-parameter static bytes, temporaries and step traffic.
        users: dict[str, list[int]] = {}
        for b in blocks.blocks:
            for p in b.params:
                users.setdefault(p, []).append(b.index)
        param_info = {p: _memo(memo, ("param", p, training),
                               functools.partial(_param_bytes, graph.param(p), training))
                      for p in users}
        dispatch = step_dispatch_s(training, cluster.device)

        shards = training.optimizer_shards

        def sync_units(name: str) -> tuple[int, ...]:
            """Per rank: the parameter's all-reduce over the replicas, then its optimizer step;
            sharded, the step of its share (1/shards on average) and the all-gather of the
            updated weights (half an all-reduce's bytes per byte); gradients sharded (not a
            tied parameter's), a reduce of its gradient per micro-batch instead of the
            all-reduce."""
            p = graph.param(name)
            gbytes = _memo(memo, ("sync", name, training), lambda: sync_bytes(p, training))[0]
            gather = param_memory(p, training)[0] if shards > 1 and gbytes else 0
            # the owner's broadcast (a reduce) streams the bytes once: bytes / B, i.e. the
            # all-reduce's per-byte rate times n / (2 (n - 1))
            once = shards / (2 * (shards - 1) or 1)
            reduced = gbytes * (shape.num_microbatches * once
                                if training.gradient_shards > 1 and not p.aliases else 1.0)
            # (times the runs' factor where the costs were calibrated from launches, as
            # partc.solve.levers.step_seconds prices it)
            step = (_memo(memo, ("step", name, training, cluster.device.name),
                          lambda: step_seconds_of(p, training, cluster.device))
                    + (dispatch if gbytes else 0.0)) * table.optimizer_factor / shards
            return tuple(units.time(reduced * per_byte[d] + gather * per_byte[d] * once + step)
                         for d in range(S))

        shared_names = sorted(p for p, bs in users.items() if len(set(bs)) > 1)
        shared = [SharedParam(name=p, blocks=tuple(sorted(set(users[p]))),
                              static=units.memory(param_info[p][0]),
                              temps=units.memory(param_info[p][1]), sync=sync_units(p))
                  for p in shared_names]
        shared_set = set(shared_names)
        requires = _memo(memo, ("requires",), lambda: differentiable_tensors(graph))
        terms = cls(static=[], temps=[], saved=[], transient=[], sync=[], has_trainable=[],
                    shared=shared)
        for b in blocks.blocks:
            own = [p for p in b.params if p not in shared_set]
            terms.static.append(units.memory(sum(param_info[p][0] for p in own)))
            terms.temps.append(units.memory(sum(param_info[p][1] for p in own)))
            per_rank = [0] * S
            for p in own:
                for d, u in enumerate(sync_units(p)):
                    per_rank[d] += u
            terms.sync.append(per_rank)
            terms.has_trainable.append(any(graph.param(p).kind == "parameter"
                                           and graph.param(p).trainable for p in b.params))
            terms.saved.append(units.memory(b.saved.at(m)))
            terms.transient.append(units.memory(_memo(
                memo, ("transient", b.index, m, bf16),
                functools.partial(_block_transient, table, b.nodes, m, requires, bf16,
                                  cluster.threads_per_device))))
        return terms


def _crossing_tensors(blocks: BlockGraph, table: CostTable, shape: PipelineShape,
                      cluster: ClusterSpec, bf16: bool, units: _Units) -> list[CrossingTensor]:
    """The block graph's tensors with their transfer time at every boundary k on the link
    between ranks (k-1) % S and k % S, put on the stage that waits for it (CrossingTensor), and
    their memory per micro-batch."""
    m = shape.microbatch_size
    links = shape.boundary_links(cluster)
    tensors: list[CrossingTensor] = []
    for t in blocks.tensors:
        nbytes = wire_bytes(table, t.name, m, bf16)
        grad = nbytes if t.requires_grad else 0.0
        hops = [link for link in links[1:] if link is not None]
        forward = tuple([0] + [units.time(link.transfer_s(int(nbytes))) for link in hops])
        backward = tuple([0] + [units.time(link.transfer_s(int(grad))) for link in hops])
        if cluster.host_sends:
            after = before = tuple(f + b for f, b in zip(forward, backward, strict=True))
        else:
            after, before = forward, backward
        tensors.append(CrossingTensor(
            name=t.name, producer=-1 if t.producer is None else t.producer,
            consumers=t.consumers, is_output=t.is_output, after=after, before=before,
            size=units.memory(nbytes), grad_size=units.memory(grad)))
    return _merge_parallel(tensors)


def wire_bytes(table: CostTable, tensor: str, m: float, bf16: bool) -> float:
    """Bytes a boundary tensor occupies when sent: the dtype it has under the precision's
    autocast (launch sends it as the stage computed it; `CostTable.runtime_bytes`)."""
    return table.runtime_bytes(tensor, m, "bf16-mixed" if bf16 else "fp32")


def _merge_parallel(tensors: list[CrossingTensor]) -> list[CrossingTensor]:
    """Tensors with the same producer block, consumer blocks and output flag cross the same
    boundaries under every assignment: one crossing variable serves them all."""
    merged: dict[tuple, CrossingTensor] = {}
    for t in tensors:
        key = (t.producer, t.consumers, t.is_output)
        other = merged.get(key)
        if other is None:
            merged[key] = t
        else:
            merged[key] = CrossingTensor(
                name=other.name, producer=t.producer, consumers=t.consumers,
                is_output=t.is_output,
                after=tuple(a + b for a, b in zip(other.after, t.after, strict=True)),
                before=tuple(a + b for a, b in zip(other.before, t.before, strict=True)),
                size=other.size + t.size, grad_size=other.grad_size + t.grad_size)
    return list(merged.values())


T = TypeVar("T")


def _memo(memo: dict[tuple, Any], key: tuple, compute: Callable[[], T]) -> T:
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _param_bytes(p: Param, training: TrainingConfig) -> tuple[float, float]:
    """(static, step temporaries) bytes of one parameter/buffer; partc.solve.memory's rules.
    A sharded optimizer state (and sharded gradients) count 1/shards of it here (the linear
    model's even split; the exact model takes ZeroRedundancyOptimizer's partition, and
    corrections close the gap)."""
    weights, grads, state, temps = param_memory(p, training)
    shards = training.optimizer_shards
    grad_shards = 1 if p.aliases else training.gradient_shards  # a tied one's is kept whole
    return float(weights + grads / grad_shards + state / shards), float(temps / shards)


def step_dispatch_s(training: TrainingConfig, device: DeviceSpec) -> float:
    """Host time the optimizer step spends on each parameter tensor apart from its bytes: on a
    CPU torch's foreach step runs each of its kernels tensor by tensor
    (`OptimizerSpec.step_kernels` dispatches outside autograd, `DeviceSpec.no_grad_overhead_s`);
    on a GPU a foreach kernel takes many tensors per launch, so nothing per tensor."""
    if device.kind != "cpu":
        return 0.0
    return training.optimizer_spec.step_kernels * device.no_grad_overhead_s()


def step_seconds_of(p: Param, training: TrainingConfig, device: DeviceSpec) -> float:
    """The bytes term of one parameter's optimizer step (`sync_bytes`' passes), 0 for buffers
    and frozen parameters. A CPU steps one parameter at a time: where its step working set
    (parameter, gradient, states, the step's temporary) fits the device's cache
    (`DeviceSpec.stream_bytes_per_s`), the first pass reads the parameter, gradient and states
    from memory (the forward and backward left other data in the cache) and the others run at
    the cache's rate; else every pass streams from memory. Measured on an Intel Xeon VM, a
    BERT stage's AdamW step: 7.8-8.7 ms launched, predicted 14.1 all from memory, 6.0 all from
    the cache, 7.7-8.3 so."""
    moved = sync_bytes(p, training)[1]
    if not moved:
        return 0.0
    weights, grads, states, temps = param_memory(p, training)
    memory = device.bytes_per_s()
    cached = device.stream_bytes_per_s(weights + grads + states + temps)
    if cached <= memory:
        return moved / memory
    first = min(weights + grads + states, moved)
    return first / memory + (moved - first) / cached


def gradient_adds(shape: PipelineShape, sharding: Sharding, kept_whole: bool) -> float:
    """How many times per step a stage's backward passes add one trainable parameter's fresh
    gradient into the gradient it already holds (autograd's AccumulateGrad, in place), as
    launch runs them: without replicas the gradients are set to None before each step, so the
    first micro-batch's is taken over and the other M - 1 are added; under DDP they are views
    into its buckets, zeroed in place, so all M are added; with sharded gradients
    (partc.run.gradient_sharding) a replica keeps, and adds into, only the gradients it owns
    (1/R of them on average) and a kept-whole (tied) parameter's."""
    M, R = shape.num_microbatches, shape.replicas
    if R > 1 and sharding == "gradients":
        return (M - 1) * (1.0 if kept_whole else 1.0 / R)
    return float(M if R > 1 else M - 1)


def add_seconds_of(p: Param, training: TrainingConfig, device: DeviceSpec) -> float:
    """One in-place add of a parameter's fresh gradient into its held one (0 for buffers and
    frozen parameters): the held gradient is read from memory (the rest of the micro-batch's
    work ran since it was last touched), the fresh one read and the sum written at the rate of
    a working set of the two (the cache's where they fit, `DeviceSpec.stream_bytes_per_s`); on a
    CPU the autograd engine also dispatches the add, outside autograd's recording
    (`DeviceSpec.no_grad_overhead_s`); a GPU launches it asynchronously with the backward."""
    grads = param_memory(p, training)[1]
    if not grads:
        return 0.0
    dispatch = device.no_grad_overhead_s() if device.kind == "cpu" else 0.0
    return grads / device.bytes_per_s() + 2 * grads / device.stream_bytes_per_s(2 * grads) \
        + dispatch


def gradient_add_s(params: Iterable[Param], training: TrainingConfig, device: DeviceSpec,
                   shape: PipelineShape, sharding: Sharding,
                   kept_whole: Collection[str] = ()) -> float:
    """A stage's gradient accumulation per backward pass, averaged over the step's micro-batches
    (`gradient_adds` of `add_seconds_of` for each of its parameters, over M): what a profile,
    which times every backward with the gradients set to None, does not hold. `kept_whole`:
    the parameters other pipeline ranks hold too."""
    M = shape.num_microbatches
    return sum(add_seconds_of(p, training, device)
               * gradient_adds(shape, sharding, p.name in kept_whole) for p in params) / M


def sync_bytes(p: Param, training: TrainingConfig) -> tuple[int, int]:
    """(gradient bytes a data-parallel all-reduce moves, bytes the optimizer step reads and
    writes) for one parameter; (0, 0) for buffers and frozen parameters."""
    grads = param_memory(p, training)[1]
    if not grads:
        return 0, 0
    return grads, p.numel * training.optimizer_spec.step_accesses * 4


def _block_transient(table: CostTable, nodes: Sequence[str], m: float,
                     requires: frozenset[str], bf16: bool, threads: int = 1) -> float:
    """Largest backward transient of one node of the block: gradients of its outputs, of its
    inputs and of its parameters, alive together while its backward runs."""
    graph = table.graph
    precision: Precision = "bf16-mixed" if bf16 else "fp32"
    peak = 0.0
    for name in nodes:
        node = graph.node(name)
        if node.is_view:
            continue
        total = sum(table.runtime_bytes(t.name, m, precision) for t in node.outputs
                    if t.name in requires)
        total += sum(table.runtime_bytes(t, m, precision) for t in set(node.inputs)
                     if t in requires)
        total += kernel_scratch(table, node, m, bf16, requires, threads)
        total += trainable_weight_bytes(graph, node, bf16)
        peak = max(peak, total)
    return peak
